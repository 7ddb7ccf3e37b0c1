"""Sweeps: a grid over precision x batch size x power limit, repeated, each point a normal Lightning fit.

A config read and checked by :mod:`lightning_energy.sweep.config` (see ``configs/sweep_tiny.yaml``) names
the model (``class_path`` + ``init_args``, and optionally a LightningDataModule under ``data``), the grid,
the repetitions and the Trainer settings; this module runs it. The grid's order is shuffled anew for every repetition (as in the power-limit study) so slow drifts of
the machine do not line up with one axis. Every run is a fit with ``EnergyCallback``, recorded in the
run catalog, with the CERN study's estimate (energy per batch over 10 batches x batches) beside the
measured energy.

Power limits (``grid.power_limit_W``):

- simulated (``sensors: {simulated: ...}``): every run trains on a simulated GPU
  (:class:`lightning_energy.simulate.gpu_sim.SimulatedGPU`, the V100 model of the power-limit study, through
  :class:`~lightning_energy.simulate.gpu_sim.SimulatedWorkload`): each training batch is also a step on the
  simulated card, which takes the model's time and draws the model's power under the run's limit, so
  below the draw the workload asks for steps slow down and energy per step follows the model. The card's
  energy counter is the device sensor. ``power_limit_W: null`` runs at the card's default limit.
- real (``sensors: auto``): the limit is set on the NVIDIA GPUs the Trainer uses through
  ``lightning_energy.optimize.power_limit.gpu_control`` (the energy sensors' CUDA -> NVML mapping and Zeus's device layer, as
  ``PowerLimitOptimizer`` does). Before the first run the sweep checks that every limit lies in the cards'
  range and that this process may set limits (SYS_ADMIN or the Zeus daemon), and fails otherwise; the
  limit in force before the sweep is put back after each run (``null`` runs at it), and at the end the
  persistence mode too, also when a run fails or is interrupted (a crash marker for SIGKILL:
  ``lightning-energy restore-power-limit``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass

from lightning_energy.provenance import of_report
from lightning_energy.sweep.config import AXES, SweepConfig, make_simulated_gpu
from lightning_energy.units import MW_PER_W

PERMISSION_HELP = ("Fixes: run the Zeus daemon (zeusd) and export ZEUSD_SOCK_PATH=<its socket> "
                   "(https://ml.energy/zeus/getting_started/#system-privileges), or give the process the SYS_ADMIN "
                   "capability (`docker run --cap-add SYS_ADMIN ...`, or root); or sweep simulated limits with "
                   "`sensors: {simulated: {gpu: {...}}}`.")


class SweepError(RuntimeError):
    """A sweep that cannot start (GPU power limits not settable) or a run of it that failed."""


def sweep_order(points: list[dict], repetitions: int, seed: int) -> list[tuple[int, dict]]:
    """(repetition, point) in run order: every repetition runs the whole grid in its own random order."""
    rng = random.Random(seed)
    order = []
    for repetition in range(repetitions):
        shuffled = list(points)
        rng.shuffle(shuffled)
        order += [(repetition, point) for point in shuffled]
    return order


def run_name(repetition: int, point: dict) -> str:
    limit = "none" if point["power_limit_W"] is None else f"{point['power_limit_W']:g}W"
    return f"rep{repetition}_prec{point['precision']}_bs{point['batch_size']}_pl{limit}"


@dataclass
class SimulatedHardware:
    """What one simulated run trains on: its sensors, the callbacks that drive the simulated GPU, the GPU."""

    sensors: list
    callbacks: list
    gpu: object = None


def simulated_hardware(simulated: dict, power_limit_W: float | None, clock=None) -> SimulatedHardware:
    """The simulated device and host of one run.

    With a simulated GPU (``simulated["gpu"]``): a fresh card at ``power_limit_W`` (its default when None),
    its energy counter as the device sensor and a ``SimulatedWorkload`` running every training batch on it.
    Otherwise a device sensor drawing ``device_W``. ``clock``: a fake clock with ``advance`` (tests) or
    None for real time (the simulated steps then sleep).
    """
    from lightning_energy.simulate.simulated_sensor import SimulatedSensor

    now = clock if clock is not None else time.perf_counter
    host_W = simulated["host_W"]
    host = [SimulatedSensor("sim_host", host_W, scope="host", clock=now)] if host_W > 0 else []
    if simulated["gpu"] is None:
        return SimulatedHardware([SimulatedSensor("sim_device", simulated["device_W"], scope="device", clock=now),
                                  *host], [])
    from lightning_energy.simulate.gpu_sim import SimulatedWorkload

    gpu = make_simulated_gpu(simulated["gpu"], clock)
    if power_limit_W is not None:
        gpu.set_power_management_limit(int(power_limit_W) * MW_PER_W)
    return SimulatedHardware([gpu.energy_sensor("sim_gpu"), *host], [SimulatedWorkload(gpu=gpu)], gpu)


class GpuPowerLimits:
    """Power limits of the real NVIDIA GPUs a sweep trains on, through ``lightning_energy.optimize.power_limit.gpu_control``.

    :meth:`open` finds the Trainer's CUDA devices through the energy sensors' CUDA -> NVML mapping and
    checks, before any run, that this process may set limits on every card and that every limit of the
    grid is in the cards' range; :meth:`applied` sets one limit for a run and puts back what was in force
    before the sweep after it, whatever happens (``null``: that limit); :meth:`close` puts back the
    persistence mode too and removes the crash markers (``lightning-energy restore-power-limit`` after a
    SIGKILL).
    """

    def __init__(self, gpus: dict[int, object]) -> None:
        from lightning_energy.optimize.power_limit.gpu_control import LimitController

        self.gpus = gpus  # CUDA index -> zeus.device.gpu.common.GPU (gpu_index: the NVML index)
        self.controllers = {i: LimitController(gpu, f"lightning-energy sweep (pid {os.getpid()})")
                            for i, gpu in gpus.items()}

    @classmethod
    def open(cls, trainer_config: dict, limits_W: list[float]) -> "GpuPowerLimits":
        from lightning_energy.optimize.power_limit import gpu_control

        count = gpu_control.visible_gpu_count()
        if count == 0:
            raise SweepError("grid.power_limit_W with `sensors: auto` needs NVIDIA GPUs, but this process sees no "
                             "CUDA device; simulate the limits with `sensors: {simulated: ...}`")
        indices = _gpu_indices(trainer_config.get("devices", "auto"), count)
        missing = [i for i in indices if not 0 <= i < count]
        if missing:
            raise SweepError(f"trainer.devices names GPU(s) {missing} but this process sees {count} CUDA device(s)")
        gpus = {}
        for i in indices:
            try:
                gpus[i] = gpu_control.open_gpu(i)
            except gpu_control.GpuControlError as err:
                raise SweepError(f"grid.power_limit_W with `sensors: auto`: {err}; no run was started") from None
        problems = [f"GPU {gpu_control.nvml_index(gpu)}: {problem}" for gpu in gpus.values()
                    if (problem := gpu_control.permission_problem(gpu))]
        if problems:
            raise SweepError(f"the sweep cannot set GPU power limits ({'; '.join(problems)}); no run was started. "
                             + PERMISSION_HELP)
        for gpu in gpus.values():
            low_mW, high_mW = gpu.get_power_management_limit_constraints()
            outside = sorted({limit for limit in limits_W if limit is not None
                              and not low_mW <= round(limit * MW_PER_W) <= high_mW})
            if outside:
                raise SweepError(f"grid.power_limit_W {outside} W outside GPU {gpu_control.nvml_index(gpu)}'s range "
                                 f"[{low_mW / MW_PER_W:g}, {high_mW / MW_PER_W:g}] W; no run was started")
        return cls(gpus)

    @contextlib.contextmanager
    def applied(self, limit_W: float | None):
        """Within the block every card runs at ``limit_W`` (None: the limit in force before the sweep);
        that limit afterwards."""
        failed = False
        try:
            for controller in self.controllers.values():
                before = controller.take()  # the first time: records what was there, writes the marker
                controller.gpu.set_power_management_limit(before.limit_mW if limit_W is None
                                                          else int(round(limit_W * MW_PER_W)))
            yield
        except BaseException:
            failed = True
            raise
        finally:
            self._put_back_limits(quiet=failed)

    def _put_back_limits(self, quiet: bool) -> None:
        from lightning_energy.optimize.power_limit.gpu_control import smi_hint

        problems = []
        for controller in self.controllers.values():
            if controller.before is None:
                continue
            try:
                controller.gpu.set_power_management_limit(controller.before.limit_mW)
            except Exception as err:
                problems.append(f"GPU {controller.index} ({type(err).__name__}: {err}); set it by hand: "
                                f"{smi_hint(controller.index, controller.before.limit_mW)}")
        self._report(problems, "the power limit in force before the sweep", quiet)

    def close(self, quiet: bool = False) -> None:
        """Every card as it was before the sweep (limit and persistence mode); the crash markers removed."""
        problems = [problem for controller in self.controllers.values() for problem in controller.restore()]
        self._report(problems, "the settings in force before the sweep", quiet)

    @staticmethod
    def _report(problems: list[str], what: str, quiet: bool) -> None:
        if not problems:
            return
        message = f"the sweep could not restore {what} of {'; '.join(problems)}"
        if quiet:  # the run already failed: tell, do not mask its error
            logging.getLogger(__name__).error(message)
        else:
            raise SweepError(message)


def _gpu_indices(devices, count: int) -> list[int]:
    """The GPU indices a Trainer's ``devices`` setting selects out of ``count`` visible GPUs."""
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            return list(range(count))
        parts = [p for p in text.split(",") if p.strip()]
        if "," in text:
            return [int(p) for p in parts]
        devices = int(text)
    if isinstance(devices, int):
        return list(range(count)) if devices == -1 else list(range(devices))
    return [int(d) for d in devices]


def run_sweep(config: SweepConfig, order: list[tuple[int, dict]], clock=None) -> list[dict]:
    """Every run of ``order``, in order; :class:`SweepError` names a run that failed.

    With real power limits, the cards are checked before the first run and the default limit is
    restored after each. ``clock``: a fake clock for the simulated hardware (tests), None for real time.
    """
    limits = None
    if config.power_limits == "real":
        limits = GpuPowerLimits.open(config.trainer, config.grid["power_limit_W"])
    rows = []
    failed = True
    try:
        with quiet_lightning():
            for index, (repetition, point) in enumerate(order):
                name = run_name(repetition, point)
                try:
                    with limits.applied(point["power_limit_W"]) if limits else contextlib.nullcontext():
                        rows.append(run_one(config, repetition, point, index, clock=clock))
                except SweepError:
                    raise
                except Exception as err:
                    raise SweepError(f"run {name} ({index + 1}/{len(order)}) failed: {type(err).__name__}: {err}") from err
        failed = False
    finally:
        if limits is not None:
            limits.close(quiet=failed)
    return rows


def run_one(config: SweepConfig, repetition: int, point: dict, order_index: int, clock=None) -> dict:
    """One grid point as a normal Lightning fit; returns its results row (``clock``: see :func:`run_sweep`)."""
    import lightning as L
    from lightning.fabric.utilities.seed import seed_everything
    from lightning.pytorch.cli import instantiate_class
    from lightning.pytorch.loggers import CSVLogger

    from lightning_energy.callbacks.batch_sample_estimate import BatchSampleEstimate
    from lightning_energy.callbacks.carbon import CarbonCallback
    from lightning_energy.callbacks.catalog import CatalogCallback
    from lightning_energy.callbacks.energy import EnergyCallback
    from lightning_energy.catalog import CATALOG_FILE

    name = run_name(repetition, point)
    seed_everything(config.seed, verbose=False)
    # as LightningCLI builds a class_path spec; the grid's batch size goes to the datamodule where there is
    # one, else to the model; the datamodule first (both may draw from the seeded random state)
    batch = {"batch_size": point["batch_size"]}
    data = None
    if config.data is not None:
        data = instantiate_class((), {**config.data, "init_args": {**config.data["init_args"], **batch}})
    model_args = config.model["init_args"] if config.data is not None else {**config.model["init_args"], **batch}
    model = instantiate_class((), {**config.model, "init_args": model_args})
    hardware = simulated_hardware(config.simulated, point["power_limit_W"], clock) if config.simulated else None
    sensors = hardware.sensors if hardware is not None else None
    kind = {"simulated": "simulated GPU", "real": "real GPU"}.get(config.power_limits)
    attributes = {"sweep": config.name, "repetition": repetition, "order": order_index, **point,
                  "power_limit": kind if point["power_limit_W"] is not None else None}
    energy = EnergyCallback(sensors=sensors, verbose=False, **config.energy)
    sample = BatchSampleEstimate(n_batches=config.cern_batches)
    catalog = CatalogCallback(config.output_dir / CATALOG_FILE, config=attributes)
    # the simulated GPU's step runs first in on_train_batch_end, so every step window measured holds it
    callbacks = [*(hardware.callbacks if hardware is not None else []), energy, sample, catalog]
    if config.carbon is not None:
        callbacks.append(CarbonCallback(verbose=False, **config.carbon))
    trainer_args = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False,
                    **config.trainer}
    trainer = L.Trainer(callbacks=callbacks, precision=point["precision"], default_root_dir=str(config.output_dir),
                        logger=CSVLogger(str(config.output_dir), name="runs", version=name), **trainer_args)
    trainer.fit(model, datamodule=data)
    report = energy.report
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train/loss", "val/loss")}
    per_step = per_step_figures(report)
    gpu = hardware.gpu if hardware is not None else None
    if gpu is not None:  # what gpu_sim's model says a step of the grid's batch size costs at this limit
        per_step["model_time_per_step_s"] = gpu.step_time_s(batch_size=point["batch_size"])
        per_step["model_device_J_per_step"] = gpu.step_energy_J(batch_size=point["batch_size"])
    return {
        "run": name, "run_dir": str(trainer.log_dir), "order": order_index, "repetition": repetition, **point,
        "epochs": len(report["epochs"]), "batches": sample.batches, "duration_s": report["duration_s"],
        "energy_J": report["total_J"], "train_J": report["train_J"], "edp_Js": report["edp_Js"], **per_step,
        "estimated": report["estimated"], "provenance": of_report(report), "gCO2e": catalog.record["gCO2e"],
        "catalog_id": catalog.record_id,
        "cern_batch_J": sample.batch_J_mean, "cern_sampled": sample.sampled,
        "cern_estimate_J": sample.estimate_J,
        "cern_vs_train": sample.estimate_J / report["train_J"] if sample.estimate_J and report["train_J"] else None,
        **metrics,
    }


def per_step_figures(report: dict) -> dict:
    """From an energy report: device energy (J) of the fit, training steps, time (s) and device J per step.

    Per-step figures use the training part of the epochs (epoch windows without validation): all of it,
    between the steps too, divided by the steps.
    """
    device = {s["name"] for s in report["sensors"] if s["scope"] == "device"}
    steps = sum(e["steps"] for e in report["epochs"])
    train_s = sum(e["train_s"] for e in report["epochs"])
    train_device_J = sum(j for e in report["epochs"] for name, j in e["per_sensor_J"].items() if name in device)
    return {"device_J": sum(s["energy_J"] for s in report["sensors"] if s["scope"] == "device"), "steps": steps,
            "time_per_step_s": train_s / steps if steps else None,
            "device_J_per_step": train_device_J / steps if steps else None}


def summarise(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over the repetitions of each grid point (in grid order of first run)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[a] for a in AXES), []).append(row)
    out = []
    for key, members in groups.items():
        entry = dict(zip(AXES, key))
        entry["runs"] = len(members)
        for name in ("duration_s", "energy_J", "edp_Js", "cern_estimate_J"):
            values = [m[name] for m in members if m[name] is not None]
            mean = sum(values) / len(values) if values else math.nan
            entry[f"{name}_mean"] = mean
            entry[f"{name}_std"] = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else math.nan
        out.append(entry)
    return out


@contextlib.contextmanager
def quiet_lightning():
    """Lightning's informational lines (GPU available, tips) and the callbacks' (report written, fit recorded)
    held back during the sweep's fits."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning_fabric",
                                               "pytorch_lightning", "lightning_energy.callbacks")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
