"""BatchSizeSearch: profile candidate batch sizes before training, keep the cheapest by energy, time or ZeusCost.

The trials run the way Lightning's ``BatchSizeFinder`` runs its own (a checkpoint of model and optimizer
first, the fit loop run for a few steps per candidate with loggers and callbacks set aside, everything
restored after), and the result goes through the same plumbing: ``lightning_setattr`` on the model, its
``hparams`` or the datamodule. Lightning's finder looks for the largest batch that fits in memory; this
search measures each candidate with the Trainer's measurement session and picks by cost.

The trials run before training, with the suite's other callbacks set aside: the Trainer's timeline sees
none of their steps (no step figure, no epoch holds them; they count in the fit's total). Each trial's
window is its own pair of marks, placed by a probe that is always the last callback of the trial, so
the order of ``Trainer(callbacks=[...])`` changes nothing in it.
"""

from __future__ import annotations

import math
import os
import uuid
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from lightning_energy.integration.base import MeteredCallback
from lightning_energy.io import atomic_write_json
from lightning_energy.meter import Mark, measure
from lightning_energy.sampler import DEFAULT_INTERVAL_S
from lightning_energy.sensors.base import Sensor

COSTS = ("energy", "time", "zeus_cost")
RESULT_FILE = "batch_size_search.json"


class _TrialProbe(Callback):
    """Marks the measured steps of one trial: after ``warmup`` steps, ``steps`` steps (samples counted).

    The trial's steps are no boundaries of the Trainer's timeline (its callbacks are set aside while the
    trials run): these are marks of the probe's own, through ``timeline.mark()``.
    """

    def __init__(self, timeline, warmup: int, steps: int) -> None:
        from lightning_energy.gpu_sim import batch_length  # imports zeus (for its GPU class): only when searching

        self._batch_length = batch_length
        self.timeline, self.warmup, self.steps = timeline, warmup, steps
        self.seen = 0
        self.samples = 0
        self.start: Mark | None = None
        self.end: Mark | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen == self.warmup:
            self.start = self.timeline.mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.start is not None and self.end is None:
            self.samples += self._batch_length(batch) or 0
            if self.seen == self.warmup + self.steps - 1:
                self.end = self.timeline.mark()
        self.seen += 1


class BatchSizeSearch(MeteredCallback):
    """Try each candidate batch size for a few steps at the start of fit and train with the cheapest.

    Per candidate: ``warmup_steps`` steps, then ``steps`` measured steps (energy of this rank's device
    sensors, or of every sensor when there is no device one; time; samples; peak memory). The costs per
    sample: ``energy`` (J), ``time`` (s) or ``zeus_cost`` (``eta*E + (1-eta)*MaxPower*T``, J, with MaxPower
    the GPU's maximum power limit or ``max_power_W``). A candidate that runs out of memory is skipped.
    Weights, optimizer and loop state are restored after the trials; training then starts with the
    chosen batch size set through ``lightning_setattr`` (model attribute, ``hparams``, or datamodule).

    Logged (rank zero, once): ``batch_size/<b>/energy_per_sample_J``, ``batch_size/<b>/time_per_sample_s``,
    ``batch_size/<b>/peak_memory_B`` (when known), ``batch_size/<b>/cost``, ``batch_size/chosen``. The
    table is printed (``rank_zero_info``) and written to ``batch_size_search.json`` in the log dir.

    Args:
        batch_sizes: the candidates (positive integers).
        cost: ``"energy"``, ``"time"`` or ``"zeus_cost"``.
        eta_knob: eta of ``zeus_cost``, in [0, 1].
        max_power_W: MaxPower of ``zeus_cost``; default: the GPU's maximum power limit.
        warmup_steps, steps: steps per candidate before and while measuring.
        batch_arg_name: the attribute holding the batch size (as Lightning's ``BatchSizeFinder``).
        gpu: a Zeus ``GPU`` object (e.g. ``SimulatedGPU``) for the max power limit and peak memory.
        sensors: the sensors to measure with (default: the GPU's own sensor for a simulated GPU, else
            the shared auto-detected ones).
    """

    def __init__(self, batch_sizes: list[int], cost: str = "energy", eta_knob: float = 0.5,
                 max_power_W: float | None = None, warmup_steps: int = 1, steps: int = 3,
                 batch_arg_name: str = "batch_size", gpu: Any = None, sensors: list[Sensor] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        if not isinstance(batch_sizes, (list, tuple)) or not batch_sizes or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"`batch_sizes` must be a non-empty list of positive integers, got {batch_sizes!r}")
        if len(set(batch_sizes)) != len(batch_sizes):
            raise ValueError(f"`batch_sizes` lists a size twice: {batch_sizes!r}")
        if cost not in COSTS:
            raise ValueError(f"`cost` must be one of {COSTS}, got {cost!r}")
        if isinstance(eta_knob, bool) or not isinstance(eta_knob, (int, float)) or not 0.0 <= eta_knob <= 1.0:
            raise ValueError(f"`eta_knob` must be a number in [0, 1], got {eta_knob!r}")
        if max_power_W is not None and not (isinstance(max_power_W, (int, float)) and max_power_W > 0):
            raise ValueError(f"`max_power_W` must be a positive number of watts or None, got {max_power_W!r}")
        for name, value, low in (("warmup_steps", warmup_steps, 0), ("steps", steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(f"`batch_arg_name` must be a non-empty string, got {batch_arg_name!r}")
        self.batch_sizes = sorted(batch_sizes)
        self.cost = cost
        self.eta_knob = float(eta_knob)
        self.max_power_W = max_power_W
        self.warmup_steps, self.steps = warmup_steps, steps
        self.batch_arg_name = batch_arg_name
        self.gpu = gpu
        self._user_sensors = self.check_sensors(sensors)
        self.interval_s = self.check_interval(interval_s)
        self.results: list[dict] = []
        self.chosen_batch_size: int | None = None
        self.result_file: Path | None = None

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        if trainer._accelerator_connector.is_distributed:
            raise MisconfigurationException("BatchSizeSearch runs in one process only (as Lightning's BatchSizeFinder); "
                                            "search on one device, then train distributed with the chosen size")
        if not trainer.fit_loop._data_source.is_module():
            raise MisconfigurationException(
                "BatchSizeSearch cannot change the batch size of dataloaders passed to `.fit()`; build them in the "
                "LightningModule or a LightningDataModule from its `batch_size`")
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MisconfigurationException(
                f"BatchSizeSearch: field `{self.batch_arg_name}` not found in the model, its hparams, the datamodule or "
                "its hparams (set `batch_arg_name`)")
        self._max_power_W = self._resolve_max_power(trainer) if self.cost == "zeus_cost" else None
        sensors = self._user_sensors
        if sensors is None and hasattr(self.gpu, "energy_sensor"):
            sensors = [self.gpu.energy_sensor()]
        attachment = self.attach(trainer, sensors, interval_s=self.interval_s)
        device = [s.name for s in attachment.sensors if s.scope == "device"]
        self._energy_sensors = device or attachment.sensor_names  # ours only: the session may hold others
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)

    def _resolve_max_power(self, trainer: Trainer) -> float:
        if self.max_power_W is not None:
            return float(self.max_power_W)
        gpu = self.gpu
        if gpu is None and trainer.strategy.root_device.type == "cuda":
            from lightning_energy.callbacks.power_limit import rank_gpu

            gpu = rank_gpu(trainer)
        if gpu is None:
            raise MisconfigurationException("BatchSizeSearch(cost='zeus_cost') needs MaxPower: pass `max_power_W` "
                                            "(no GPU to read the maximum power limit from)")
        return gpu.get_power_management_limit_constraints()[1] / 1000.0

    # ---------------------------------------------------------------- the search
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.fast_dev_run:
            return
        self.results = self._run_trials(trainer, pl_module)
        usable = [r for r in self.results if r["failure"] is None]
        if not usable:
            raise RuntimeError("BatchSizeSearch: every candidate failed: "
                               + "; ".join(f"{r['batch_size']}: {r['failure']}" for r in self.results))
        best = min(usable, key=lambda r: (r["cost"], r["batch_size"]))
        self.chosen_batch_size = best["batch_size"]
        lightning_setattr(pl_module, self.batch_arg_name, self.chosen_batch_size)
        _reset_dataloaders(trainer)
        self._report(trainer)

    def _run_trials(self, trainer: Trainer, pl_module: LightningModule) -> list[dict]:
        ckpt_path = os.path.join(trainer.default_root_dir, f".batch_size_search_{uuid.uuid4().hex}.ckpt")
        trainer.save_checkpoint(ckpt_path)
        loop = trainer.fit_loop
        saved = {
            "loggers": trainer.loggers, "callbacks": trainer.callbacks, "max_steps": loop.epoch_loop.max_steps,
            "max_epochs": loop.max_epochs, "limit_train_batches": trainer.limit_train_batches,
            "limit_val_batches": trainer.limit_val_batches, "loop_state": deepcopy(loop.state_dict()),
            "batch_size": lightning_getattr(pl_module, self.batch_arg_name),
        }
        kept = [c for c in trainer.callbacks if getattr(c, "keep_during_trials", False)]
        results = []
        try:
            from lightning.pytorch.loggers.logger import DummyLogger

            trainer.logger = DummyLogger() if trainer.logger is not None else None
            trainer.limit_train_batches, trainer.limit_val_batches = 1.0, 0
            loop.epoch_loop.max_steps = self.warmup_steps + self.steps
            loop.max_epochs = -1  # the steps, not the epochs, end a trial
            for size in self.batch_sizes:
                probe = _TrialProbe(self.timeline, self.warmup_steps, self.steps)
                trainer.callbacks = [*kept, probe]
                results.append(self._trial(trainer, pl_module, size, probe, saved["loop_state"]))
        finally:
            trainer.loggers, trainer.callbacks = saved["loggers"], saved["callbacks"]
            loop.epoch_loop.max_steps, loop.max_epochs = saved["max_steps"], saved["max_epochs"]
            trainer.limit_train_batches = saved["limit_train_batches"]
            trainer.limit_val_batches = saved["limit_val_batches"]
            lightning_setattr(pl_module, self.batch_arg_name, saved["batch_size"])
            loop.load_state_dict(deepcopy(saved["loop_state"]))
            loop.restarting = False
            _reset_dataloaders(trainer)
            loop.reset()
            trainer._checkpoint_connector.restore(ckpt_path)
            trainer.strategy.remove_checkpoint(ckpt_path)
        return results

    def _trial(self, trainer: Trainer, pl_module: LightningModule, size: int, probe: _TrialProbe, state) -> dict:
        from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error

        row: dict[str, Any] = {"batch_size": size, "failure": None}
        lightning_setattr(pl_module, self.batch_arg_name, size)
        on_cuda = trainer.strategy.root_device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        if hasattr(self.gpu, "reset_peak_memory"):
            self.gpu.reset_peak_memory()
        loop = trainer.fit_loop
        try:
            _reset_dataloaders(trainer)
            loop.load_state_dict(deepcopy(state))
            loop.restarting = False
            loop.run()
        except Exception as err:
            if not (isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)):
                raise
            garbage_collection_cuda()
            row["failure"] = f"out of memory ({err})"
            return row
        if probe.end is None:
            row["failure"] = (f"an epoch has fewer than warmup_steps + steps = {self.warmup_steps + self.steps} batches "
                              f"of {size}")
            return row
        m = measure(probe.start, self.attachment.meter.wait(probe.end))
        energy_J = sum(m.energy_J.get(name, 0.0) for name in self._energy_sensors)
        row.update({
            "samples": probe.samples, "steps": self.steps, "energy_J": energy_J, "time_s": m.duration_s,
            "energy_per_sample_J": energy_J / probe.samples, "time_per_sample_s": m.duration_s / probe.samples,
            "peak_memory_B": (int(torch.cuda.max_memory_allocated(trainer.strategy.root_device)) if on_cuda
                              else getattr(self.gpu, "peak_memory_B", None)),
        })
        row["cost"] = self._cost(row)
        return row

    def _cost(self, row: dict) -> float:
        if self.cost == "energy":
            return row["energy_per_sample_J"]
        if self.cost == "time":
            return row["time_per_sample_s"]
        return self.eta_knob * row["energy_per_sample_J"] + (1 - self.eta_knob) * self._max_power_W * row["time_per_sample_s"]

    def _report(self, trainer: Trainer) -> None:
        metrics: dict[str, float] = {"batch_size/chosen": float(self.chosen_batch_size)}
        lines = [f"BatchSizeSearch ({self.cost}): chosen batch size {self.chosen_batch_size}",
                 f"{'batch':>7} {'J/sample':>12} {'s/sample':>12} {'peak GiB':>9} {'cost':>12}  note"]
        for r in self.results:
            b = r["batch_size"]
            if r["failure"] is not None:
                lines.append(f"{b:>7} {'-':>12} {'-':>12} {'-':>9} {'-':>12}  {r['failure']}")
                continue
            metrics.update({f"batch_size/{b}/energy_per_sample_J": r["energy_per_sample_J"],
                            f"batch_size/{b}/time_per_sample_s": r["time_per_sample_s"],
                            f"batch_size/{b}/cost": r["cost"]})
            memory = r["peak_memory_B"]
            if memory is not None:
                metrics[f"batch_size/{b}/peak_memory_B"] = float(memory)
            gib = f"{memory / 1024**3:.2f}" if memory is not None else "-"
            mark = "  <- chosen" if b == self.chosen_batch_size else ""
            lines.append(f"{b:>7} {r['energy_per_sample_J']:>12.4g} {r['time_per_sample_s']:>12.4g} {gib:>9} "
                         f"{r['cost']:>12.4g}{mark}")
        rank_zero_info("\n".join(lines))
        self.log_metrics(trainer, metrics, trainer.fit_loop.epoch_loop._batches_that_stepped)
        if trainer.is_global_zero:
            self.result_file = atomic_write_json(self._log_dir / RESULT_FILE, {
                "cost": self.cost, "eta_knob": self.eta_knob if self.cost == "zeus_cost" else None,
                "max_power_W": self._max_power_W, "warmup_steps": self.warmup_steps, "steps": self.steps,
                "chosen_batch_size": self.chosen_batch_size,
                "candidates": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                               for r in self.results],
            })


def _reset_dataloaders(trainer: Trainer) -> None:
    """Rebuild the fit loop's dataloaders after a batch-size change (as Lightning's batch-size finder does)."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    loop.epoch_loop.val_loop._combined_loader = None
    loop.epoch_loop.val_loop.setup_data()
