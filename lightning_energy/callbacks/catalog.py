"""CatalogCallback: every fit recorded in the run catalog, every checkpoint stamped with what it cost."""

from __future__ import annotations

import errno
import math
import shlex
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.measure import ranks as distributed
from lightning_energy.carbon import CarbonIntensity, world_average
from lightning_energy.catalog import (
    CATALOG_FILE, RUN_ATTRIBUTES_FILE, Catalog, CatalogError, CatalogUnavailableError,
)
from lightning_energy.core.published import Published
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.io import try_atomic_write_json
from lightning_energy.measure.meter import measure
from lightning_energy.provenance import combine, of_entry, tagged
from lightning_energy.outputs.report import version
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.cpu_model import cpu_model_name
from lightning_energy.units import J_PER_KWH

log_info = rank_zero_info_for(__name__)

CHECKPOINT_KEY = "energy_metadata"
CATALOG_TIMEOUT_S = 10.0  # how long the end-of-fit write waits for another writer of the catalog


class CatalogCallback(MeteredCallback):
    """Record each fit in the SQLite run catalog and put the same energy metadata into each checkpoint.

    A record (and ``checkpoint["energy_metadata"]``) holds: model class, parameter count, FLOPs per
    training step (counted with ``torch.utils.flop_counter`` on the first step, or given), hardware,
    precision, batch size, steps, epochs, energy per sensor and in total (J, continuing across
    resumes), time (s), CO2e (g, with the intensity and PUE of a ``CarbonCallback`` in the Trainer,
    else the labelled world average), final metrics, checkpoint path and config. The log dir gets
    ``run_attributes.json`` (model, precision, batch size and ``config``) for
    ``lightning-energy compare --by``. Nothing is logged as a metric. With an ``EnergyToAccuracy`` in the
    Trainer, its figures join the record's metrics and the run attributes: ``energy_to_target_J``,
    ``time_to_target_s``, ``epochs_to_target`` when the target was reached, ``target_budget_exceeded``
    (1), ``energy_at_give_up_J`` and ``time_at_give_up_s`` when its budget ended the run.

    The energy is read from the Trainer's timeline: the fit's record spans its start and end marks (the
    same window as ``EnergyCallback``'s report); a checkpoint's figures reach the latest samples without
    waiting (extrapolated from the last power by one sampling interval at most).

    An unwritable catalog location (read-only, a file in the way, a full disk) fails the fit before
    training; a catalog that cannot take the record at the end (locked by another process for over
    ``CATALOG_TIMEOUT_S`` s, damaged, not a catalog) never fails it: the fit is warned about once as not
    recorded (``record_id`` None, the reason in ``problems``) and ``run_attributes.json`` is still written.

    At fit end one line (rank zero, the ``lightning_energy`` logger) gives the record's id, its energy (saying
    whether it is measured, estimated or simulated) and CO2e, the catalog file, and the exact command that
    lists it (``lightning-energy catalog list`` alone reads ``./runs`` or ``.``, not ``<default_root_dir>``).

    Args:
        catalog_path: the SQLite file (default ``<default_root_dir>/energy_catalog.sqlite``).
        config: extra attributes of the run to store (JSON-serialisable dict).
        flops_per_step: FLOPs of one training step, if known (skips counting).
        count_flops: count the FLOPs of the first training step when not given.
        sensors, backend, interval_s: as for ``EnergyCallback``; with ``sensors=None`` the sensors of an
            ``EnergyCallback`` in the same Trainer are read (wherever it is listed).
    """

    def __init__(
        self,
        catalog_path: str | Path | None = None,
        config: dict | None = None,
        flops_per_step: float | None = None,
        count_flops: bool = True,
        sensors: list[Sensor] | None = None,
        backend: str = "auto",
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        super().__init__()
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"`config` must be a dict, got {type(config).__name__}")
        if flops_per_step is not None and (isinstance(flops_per_step, bool)
                                           or not isinstance(flops_per_step, (int, float)) or not flops_per_step > 0):
            raise ValueError(f"`flops_per_step` must be a number > 0 or None, got {flops_per_step!r}")
        self.check_flags(count_flops=count_flops)
        self.configure_measurement(sensors, backend, interval_s)
        self.catalog_path = None if catalog_path is None else Path(catalog_path)
        self.config = dict(config or {})
        self.flops_per_step = None if flops_per_step is None else float(flops_per_step)
        self.count_flops = count_flops
        self.record: dict | None = None
        self.record_id: int | None = None
        self.problems: list[str] = []  # why the last fit's record or attributes could not be written
        self._resumed: dict = {}
        self._flop_counter = None
        self._snapshot_cache: tuple[int, dict] | None = None
        self._running: tuple[Trainer, LightningModule] | None = None

    # ---------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.attachment is not None or stage != TrainerFn.FITTING:
            return
        path = self.catalog_path or Path(trainer.default_root_dir) / CATALOG_FILE
        self._catalog = Catalog(path, timeout_s=CATALOG_TIMEOUT_S)
        if trainer.is_global_zero:
            try:
                self._catalog.ensure()  # an unwritable location fails here, before training
            except CatalogUnavailableError as err:
                if err.errno != errno.EBUSY:
                    raise
            except CatalogError:
                pass  # damaged: the fit goes on and is warned about as not recorded at its end
        self.attach(trainer, self._user_sensors, self.backend, self.interval_s)
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self._counted_flops: float | None = None
        self._snapshot_cache = None
        self.record, self.record_id, self.problems = None, None, []

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        if exception is not None:
            self._stop_flop_counter()
        self._running = None

    # ---------------------------------------------------------------- fit
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._running = (trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        wanted = self.count_flops and self.flops_per_step is None and self._counted_flops is None
        if wanted and self._flop_counter is None:
            from torch.utils.flop_counter import FlopCounterMode

            self._flop_counter = FlopCounterMode(display=False)
            self._flop_counter.__enter__()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        if self._flop_counter is not None:
            self._counted_flops = self._stop_flop_counter()

    def _stop_flop_counter(self) -> float | None:
        counter, self._flop_counter = self._flop_counter, None
        if counter is None:
            return None
        try:
            counter.__exit__(None, None, None)
            return float(counter.get_total_flops())
        except Exception as err:  # counting is a convenience: never break the fit over it
            rank_zero_warn(f"lightning-energy: could not count FLOPs per step ({type(err).__name__}: {err})")
            return math.nan

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._running is None or self.timeline is None or self.timeline.fit_start is None:
            return
        checkpoint[CHECKPOINT_KEY] = self._snapshot(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the timeline has resolved the fit's end mark before this runs
        record = self._snapshot(trainer, pl_module, cache=False, final=True)
        if not trainer.is_global_zero:
            return
        target = _to_target(self.attachment.session.published)
        record = {**record, "metrics": {**record["metrics"], **target}}
        self.record = record
        try:
            self.record_id = self._catalog.add(record)
        except CatalogError as err:  # a locked, damaged or full catalog never fails the fit
            self.record_id = None
            self.problems.append(str(err))
            rank_zero_warn(f"lightning-energy: fit not recorded in the catalog: {err}")
        attributes = {"model": record["model"], "precision": record["precision"], "batch_size": record["batch_size"],
                      "parameters": record["parameters"], "catalog_id": self.record_id, **target, **self.config}
        problem = try_atomic_write_json(self._log_dir / RUN_ATTRIBUTES_FILE, attributes)
        if problem:
            self.problems.append(problem)
            rank_zero_warn(f"lightning-energy: {problem}")
        if self.record_id is not None:
            log_info(self.summary_line())

    def summary_line(self) -> str:
        """The recorded fit in one line: id, energy (J, with its provenance), CO2e (g) and the command listing it."""
        record, path = self.record, Path(self._catalog.path)
        energy = tagged(f"{record['energy_J']:.4g} J", record["provenance"])
        return (f"CatalogCallback: fit recorded as id {self.record_id}: {energy}, {record['gCO2e']:.3g} gCO2e "
                f"({record['intensity_label']}) in {path}; list it with: lightning-energy catalog list --catalog "
                f"{shlex.quote(str(path.resolve()))}")

    # ---------------------------------------------------------------- the record
    def _fit_so_far(self, final: bool) -> tuple[dict[str, float], float]:
        """This rank's J per sensor of this callback and seconds since the fit's start: to the fit's end mark
        (``final``), else to the latest samples (not waiting; extrapolated by one interval at most)."""
        timeline, names = self.timeline, self.attachment.sensor_names
        start = timeline.fit_start
        if final:
            fit = measure(start, timeline.fit_end)
            return {n: fit.energy_J.get(n, 0.0) for n in names}, fit.duration_s
        if not start.resolved:  # only a checkpoint within the fit's first sampling interval
            self.attachment.meter.wait(start)
        sampler = self.attachment.sampler
        now = sampler.clock()
        now_energy, _ = sampler.energy_at(names, now)
        energy = {n: now_energy[n] - start.energy[n] if now_energy.get(n) is not None
                  and start.energy.get(n) is not None else 0.0 for n in names}
        return energy, now - start.t

    def _snapshot(self, trainer: Trainer, pl_module: LightningModule, cache: bool = True, final: bool = False) -> dict:
        """The metadata of the fit so far (collective: every rank calls it)."""
        step = trainer.global_step
        if cache and self._snapshot_cache is not None and self._snapshot_cache[0] == step:
            return self._snapshot_cache[1]
        energy, seconds = self._fit_so_far(final)
        local = [{**s.describe(), "rank": trainer.global_rank, "energy_J": energy.get(s.name, 0.0)}
                 for s in self.attachment.sensors]
        sensors = _add_resumed([s for rank in distributed.gather(trainer, local) for s in rank],
                               self._resumed.get("sensors", []))
        duration_s = max(distributed.gather(trainer, seconds)) + self._resumed.get("duration_s", 0.0)
        energy_J = sum(s["energy_J"] for s in sensors)
        intensity, pue = _intensity(self.attachment.session.published)
        flops = self.flops_per_step if self.flops_per_step is not None else self._counted_flops
        record = {
            "created_unix_s": time.time(),
            "tool": f"lightning-energy {version()}",
            "run_dir": str(self._log_dir),
            "model": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
            "parameters": sum(p.numel() for p in pl_module.parameters()),
            "flops_per_step": flops if flops is not None and math.isfinite(flops) else None,
            "hardware": _hardware(trainer),
            "precision": str(trainer.precision),
            "batch_size": _batch_size(trainer, pl_module),
            "steps": trainer.global_step,
            "epochs": trainer.current_epoch,
            "duration_s": duration_s,
            "energy_J": energy_J,
            "energy_kWh": energy_J / J_PER_KWH,
            "estimated": any(s["estimated"] for s in sensors),
            "provenance": combine(of_entry(s) for s in sensors),
            "sensors": sensors,
            "gCO2e": energy_J / J_PER_KWH * intensity.g_per_kWh * pue,
            "intensity_g_per_kWh": intensity.g_per_kWh,
            "intensity_label": intensity.label,
            "pue": pue,
            "checkpoint_path": _checkpoint_path(trainer),
            "metrics": _scalar_metrics(trainer.callback_metrics),
            "config": {"run": self.config, "trainer": _trainer_config(trainer), "hparams": _plain(pl_module.hparams)},
        }
        self._snapshot_cache = (step, record)
        return record

    # ---------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        if self._running is not None and self.timeline is not None and self.timeline.fit_start is not None:
            record = self._snapshot(*self._running)  # cached for on_save_checkpoint at the same step
        elif self._snapshot_cache is not None:
            record = self._snapshot_cache[1]
        else:
            return dict(self._resumed)
        return {"sensors": record["sensors"], "duration_s": record["duration_s"]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict)


def _add_resumed(sensors: list[dict], resumed: list[dict]) -> list[dict]:
    """Add the energy a resumed checkpoint had recorded to this session's, matched by (rank, name)."""
    before = {(s["rank"], s["name"]): s for s in resumed}
    out = []
    for s in sensors:
        previous = before.pop((s["rank"], s["name"]), None)
        out.append({**s, "energy_J": s["energy_J"] + (previous["energy_J"] if previous else 0.0)})
    return out + list(before.values())


def _intensity(published: Published) -> tuple[CarbonIntensity, float]:
    """(intensity, PUE) a ``CarbonCallback`` of the Trainer published (``"carbon"``), else the world average
    and PUE 1."""
    carbon = published.get("carbon")
    if carbon is not None:
        return carbon["intensity"], carbon["pue"]
    return world_average("no CarbonCallback in the Trainer"), 1.0


def _to_target(published: Published) -> dict[str, float]:
    """The figures an ``EnergyToAccuracy`` of the Trainer published (``"energy_to_accuracy"``): to its target
    (J, s, validation runs) when reached; ``target_budget_exceeded`` 1 (and the energy and time spent) when
    its budget ended the run; nothing without one."""
    eta = published.get("energy_to_accuracy")
    if eta is None:
        return {}
    if eta["result"] is not None:
        return {k: float(eta["result"][k]) for k in ("energy_to_target_J", "time_to_target_s", "epochs_to_target")}
    if eta["gave_up"] is not None:
        return {"target_budget_exceeded": 1.0, "energy_at_give_up_J": float(eta["gave_up"]["energy_J"]),
                "time_at_give_up_s": float(eta["gave_up"]["time_s"])}
    return {}


def _hardware(trainer: Trainer) -> str:
    root = trainer.strategy.root_device
    parts = [f"{type(trainer.accelerator).__name__.replace('Accelerator', '').lower()} x{trainer.num_devices}"
             f" (world size {trainer.world_size})", f"cpu: {cpu_model_name() or 'unknown'}"]
    if root.type == "cuda":
        import torch

        parts.append(f"gpu: {torch.cuda.get_device_name(root)}")
    return "; ".join(parts)


def _batch_size(trainer: Trainer, pl_module: LightningModule) -> int | None:
    for hparams in (pl_module.hparams, getattr(trainer.datamodule, "hparams", {}) if trainer.datamodule else {}):
        value = hparams.get("batch_size") if hasattr(hparams, "get") else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    loader = trainer.train_dataloader
    value = getattr(loader, "batch_size", None)
    return value if isinstance(value, int) else None


def _checkpoint_path(trainer: Trainer) -> str | None:
    callback = trainer.checkpoint_callback
    if callback is None:
        return None
    return getattr(callback, "best_model_path", "") or getattr(callback, "last_model_path", "") or None


def _scalar_metrics(metrics: dict) -> dict[str, float]:
    out = {}
    for name, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(number):
            out[name] = number
    return out


def _trainer_config(trainer: Trainer) -> dict:
    return {
        "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps,
        "limit_train_batches": trainer.limit_train_batches, "limit_val_batches": trainer.limit_val_batches,
        "accumulate_grad_batches": trainer.accumulate_grad_batches, "precision": str(trainer.precision),
        "num_devices": trainer.num_devices, "world_size": trainer.world_size,
    }


def _plain(hparams) -> dict:
    """Hyper-parameters as JSON-friendly values (others as their repr)."""
    out = {}
    for key, value in dict(hparams).items():
        out[str(key)] = value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
    return out
