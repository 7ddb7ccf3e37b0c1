"""BatchSizeSearch: try candidate batch sizes at the start of fit, train with the one that reaches a target cheapest.

Zeus's point about batch sizes (Chung et al., "Zeus", NSDI 2023; its ``BatchSizeOptimizer``): a larger batch
costs less per sample but may need more epochs to reach the same accuracy, so the batch size that costs
least *per sample* is often not the one that costs least *to reach the target*. This search therefore
trains each candidate from the same weights until a validation metric reaches ``target`` and ranks the
candidates by what that took: energy to accuracy (ETA, J), time to accuracy (TTA, s) or Zeus's cost
``eta*ETA + (1-eta)*MaxPower*TTA`` (J). A candidate whose cost so far exceeds ``beta_knob`` times the
best finished one is stopped early (Zeus's pruning rule, applied within one run instead of across
recurrences). ``method="per_sample"`` keeps the old, cheaper ranking by cost per sample over a few
steps; it ignores convergence and usually picks the largest batch that fits.

The trials run the way Lightning's ``BatchSizeFinder`` runs its own (a checkpoint of model and optimizer
first, the fit loop run per candidate with loggers and callbacks set aside, everything restored after),
and the result goes through the same plumbing: ``lightning_setattr`` on the model, its ``hparams`` or the
datamodule. Training then starts from the restored weights with the chosen batch size.

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
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.lightning_internals import (
    batches_that_stepped, dataloaders_come_from_the_module, first_batch_size, reset_fit_dataloaders,
    restore_checkpoint, strategy_is_distributed)
from lightning_energy.io import atomic_write_json
from lightning_energy.measure.meter import Mark, measure
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.optimize.power_limit.gpu_control import rank_gpu
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.units import W_PER_MW

log_info = rank_zero_info_for(__name__)

METHODS = ("to_target", "per_sample")
COSTS = ("energy", "time", "zeus_cost")
MODES = ("min", "max")
RESULT_FILE = "batch_size_search.json"


class _TrialProbe(Callback):
    """Marks the measured steps of one per-sample trial: after ``warmup`` steps, ``steps`` steps (samples counted).

    The trial's steps are no boundaries of the Trainer's timeline (its callbacks are set aside while the
    trials run): these are marks of the probe's own, through ``timeline.mark()``.
    """

    def __init__(self, timeline, warmup: int, steps: int) -> None:
        self.timeline, self.warmup, self.steps = timeline, warmup, steps
        self.seen = 0
        self.samples = 0
        self.start: Mark | None = None
        self.end: Mark | None = None

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen == self.warmup:
            self.start = self.timeline.mark()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.start is not None and self.end is None:
            self.samples += first_batch_size(batch) or 0
            if self.seen == self.warmup + self.steps - 1:
                self.end = self.timeline.mark()
        self.seen += 1


class _TargetProbe(Callback):
    """One to-target trial: a mark at the start of training, the metric after every validation run.

    Ends the trial (``trainer.should_stop``) when ``monitor`` reaches the target, or when the cost so far
    (``cost_so_far(start, now)``, which waits, bounded, for the samples to reach now) exceeds ``limit``.
    One bounded wait per validation run, none per step.
    """

    def __init__(self, search: "BatchSizeSearch", limit: float) -> None:
        self.search, self.limit = search, limit
        self.start: Mark | None = None
        self.end: Mark | None = None
        self.steps = self.samples = self.validations = 0
        self.metric: float | None = None
        self.reached = False
        self.pruned_at: tuple[float, float, float] | None = None  # (J, s, cost) when pruned

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self.start = self.search.timeline.mark()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps += 1
        self.samples += first_batch_size(batch) or 0

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or self.start is None:
            return
        search = self.search
        value = trainer.callback_metrics.get(search.monitor)
        if value is None:
            raise MisconfigurationException(f"BatchSizeSearch: metric {search.monitor!r} is not logged in validation; "
                                            f"logged: {sorted(trainer.callback_metrics)}")
        self.validations += 1
        self.metric = float(value)
        if search.reached(self.metric):
            self.end = search.timeline.mark()
            self.reached = True
            trainer.should_stop = True
        elif math.isfinite(self.limit):
            figures = search._figures(self.start, search.timeline.mark())
            if figures[2] > self.limit:
                self.pruned_at = figures
                trainer.should_stop = True


class BatchSizeSearch(MeteredCallback):
    """Try each candidate batch size at the start of fit and train with the one that reaches the target cheapest.

    ``method="to_target"`` (the default; needs ``monitor`` and ``target``): each candidate trains from the
    same initial weights until ``monitor`` reaches ``target`` after a validation run (``mode``: ``"min"``,
    reached when ``<= target``; ``"max"``: ``>= target``), for at most ``trial_max_epochs`` epochs. Measured
    from the start of the trial's training to the end of the validation run that reached the target
    (validation included, as in Zeus): energy to accuracy ``ETA`` (J, this rank's device sensors, or every
    sensor when there is no device one) and time to accuracy ``TTA`` (s). The cost: ``energy`` (ETA, J),
    ``time`` (TTA, s) or ``zeus_cost`` (``eta*ETA + (1-eta)*MaxPower*TTA``, J, with MaxPower the GPU's
    maximum power limit or ``max_power_W``). After every validation run a trial whose cost so far exceeds
    ``beta_knob`` times the lowest finished cost is stopped ("pruned"; Zeus's rule). A candidate that
    never reaches the target, is pruned, or runs out of memory is not chosen.

    ``method="per_sample"``: each candidate runs ``warmup_steps`` + ``steps`` steps without validation and is
    ranked by its cost *per sample* (J/sample, s/sample, or the ZeusCost per sample). Cheap, but it does not
    see convergence: it favours the largest batch that fits, which can cost more to reach a target.

    Weights, optimizer and loop state are restored after the trials; training then starts with the chosen
    batch size set through ``lightning_setattr`` (model attribute, ``hparams``, or datamodule).

    Logged (rank zero, once): ``batch_size/chosen``, and per candidate ``batch_size/<b>/cost``,
    ``batch_size/<b>/energy_J`` and ``batch_size/<b>/time_s`` (to target; ``per_sample``:
    ``batch_size/<b>/energy_per_sample_J`` and ``batch_size/<b>/time_per_sample_s``),
    ``batch_size/<b>/peak_memory_B`` (when known). The table is logged (INFO, rank zero) and written to
    ``batch_size_search.json`` in the log dir; energies from a modelled sensor (a CPU estimate) are labelled
    so there (``energy_estimated``, ``energy_label``) and in the table.

    Args:
        batch_sizes: the candidates (positive integers), tried in increasing order.
        monitor, target, mode: the validation metric, the value to reach and its direction (to target).
        method: ``"to_target"`` or ``"per_sample"`` (see above).
        cost: ``"energy"``, ``"time"`` or ``"zeus_cost"``.
        eta_knob: eta of ``zeus_cost``, in [0, 1].
        max_power_W: MaxPower of ``zeus_cost``; default: the GPU's maximum power limit.
        beta_knob: prune a to-target trial whose cost exceeds this multiple of the best (> 1; None: never).
        trial_max_epochs: epochs a to-target trial may take (default: the Trainer's ``max_epochs``).
        warmup_steps, steps: steps per candidate before and while measuring (per sample).
        batch_arg_name: the attribute holding the batch size (as Lightning's ``BatchSizeFinder``).
        gpu: a Zeus ``GPU`` object (e.g. ``SimulatedGPU``) for the max power limit and peak memory.
        sensors: the sensors to measure with (default: the GPU's own sensor for a simulated GPU, else
            the shared auto-detected ones).
    """

    def __init__(self, batch_sizes: list[int], monitor: str | None = None, target: float | None = None,
                 mode: str = "min", method: str = "to_target", cost: str = "energy", eta_knob: float = 0.5,
                 max_power_W: float | None = None, beta_knob: float | None = 2.0,
                 trial_max_epochs: int | None = None, warmup_steps: int = 1, steps: int = 3,
                 batch_arg_name: str = "batch_size", gpu: Any = None, sensors: list[Sensor] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        if not isinstance(batch_sizes, (list, tuple)) or not batch_sizes or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"`batch_sizes` must be a non-empty list of positive integers, got {batch_sizes!r}")
        if len(set(batch_sizes)) != len(batch_sizes):
            raise ValueError(f"`batch_sizes` lists a size twice: {batch_sizes!r}")
        if method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}, got {method!r}")
        if method == "to_target":
            if not isinstance(monitor, str) or not monitor or isinstance(target, bool) or not isinstance(
                    target, (int, float)) or not math.isfinite(target):
                raise ValueError(
                    "BatchSizeSearch ranks batch sizes by the cost to reach a validation target (as Zeus): give "
                    f"`monitor` (a metric name) and a finite `target`, got monitor={monitor!r}, target={target!r}; "
                    "or method='per_sample' for the cost per sample over a few steps (it ignores convergence "
                    "and favours the largest batch that fits)")
            if mode not in MODES:
                raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        if cost not in COSTS:
            raise ValueError(f"`cost` must be one of {COSTS}, got {cost!r}")
        if isinstance(eta_knob, bool) or not isinstance(eta_knob, (int, float)) or not 0.0 <= eta_knob <= 1.0:
            raise ValueError(f"`eta_knob` must be a number in [0, 1], got {eta_knob!r}")
        if max_power_W is not None and not (isinstance(max_power_W, (int, float)) and max_power_W > 0):
            raise ValueError(f"`max_power_W` must be a positive number of watts or None, got {max_power_W!r}")
        if beta_knob is not None and (isinstance(beta_knob, bool) or not isinstance(beta_knob, (int, float))
                                      or not beta_knob > 1):
            raise ValueError(f"`beta_knob` must be a number > 1 or None, got {beta_knob!r}")
        for name, value, low in (("warmup_steps", warmup_steps, 0), ("steps", steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")
        if trial_max_epochs is not None and (isinstance(trial_max_epochs, bool) or not isinstance(trial_max_epochs, int)
                                             or trial_max_epochs < 1):
            raise ValueError(f"`trial_max_epochs` must be an integer >= 1 or None, got {trial_max_epochs!r}")
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(f"`batch_arg_name` must be a non-empty string, got {batch_arg_name!r}")
        self.batch_sizes = sorted(batch_sizes)
        self.method = method
        self.monitor, self.mode = monitor, mode
        self.target = float(target) if target is not None else None
        self.cost = cost
        self.eta_knob = float(eta_knob)
        self.max_power_W = max_power_W
        self.beta_knob = None if beta_knob is None else float(beta_knob)
        self.trial_max_epochs = trial_max_epochs
        self.warmup_steps, self.steps = warmup_steps, steps
        self.batch_arg_name = batch_arg_name
        self.gpu = gpu
        self.configure_measurement(sensors, interval_s=interval_s)
        self.results: list[dict] = []
        self.chosen_batch_size: int | None = None
        self.result_file: Path | None = None
        self.energy_estimated = False

    def reached(self, value: float) -> bool:
        """True when ``value`` of the monitored metric meets the target."""
        return value <= self.target if self.mode == "min" else value >= self.target

    # ---------------------------------------------------------------- set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        if strategy_is_distributed(trainer):
            raise MisconfigurationException("BatchSizeSearch runs in one process only (as Lightning's BatchSizeFinder); "
                                            "search on one device, then train distributed with the chosen size")
        if not dataloaders_come_from_the_module(trainer):
            raise MisconfigurationException(
                "BatchSizeSearch cannot change the batch size of dataloaders passed to `.fit()`; build them in the "
                "LightningModule or a LightningDataModule from its `batch_size`")
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MisconfigurationException(
                f"BatchSizeSearch: field `{self.batch_arg_name}` not found in the model, its hparams, the datamodule or "
                "its hparams (set `batch_arg_name`)")
        if self.method == "to_target":
            self._trial_epochs = self.trial_max_epochs or trainer.max_epochs
            if self._trial_epochs is None or self._trial_epochs < 1:
                raise MisconfigurationException("BatchSizeSearch: a to-target trial needs a bound: set `trial_max_epochs` "
                                                "(the Trainer's max_epochs is unbounded)")
        self._max_power_W = self._resolve_max_power(trainer) if self.cost == "zeus_cost" else None
        sensors = self._user_sensors
        if sensors is None and hasattr(self.gpu, "energy_sensor"):
            sensors = [self.gpu.energy_sensor()]
        attachment = self.attach(trainer, sensors, interval_s=self.interval_s)
        device = [s for s in attachment.sensors if s.scope == "device"]
        used = device or list(attachment.sensors)  # ours only: the session may hold others
        self._energy_sensors = [s.name for s in used]
        self.energy_estimated = any(getattr(s, "estimated", False) for s in used)
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)

    def _resolve_max_power(self, trainer: Trainer) -> float:
        if self.max_power_W is not None:
            return float(self.max_power_W)
        gpu = self.gpu
        if gpu is None and trainer.strategy.root_device.type == "cuda":
            gpu = rank_gpu(trainer.strategy.root_device, "BatchSizeSearch")
        if gpu is None:
            raise MisconfigurationException("BatchSizeSearch(cost='zeus_cost') needs MaxPower: pass `max_power_W` "
                                            "(no GPU to read the maximum power limit from)")
        return gpu.get_power_management_limit_constraints()[1] * W_PER_MW

    # ---------------------------------------------------------------- the search
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.fast_dev_run:
            return
        if self.method == "to_target" and not trainer.enable_validation:
            raise MisconfigurationException("BatchSizeSearch reads the validation metric to see when a trial reaches "
                                            "its target: give the Trainer a validation loop (or method='per_sample')")
        self.results = self._run_trials(trainer, pl_module)
        usable = [r for r in self.results if r["failure"] is None]
        if not usable:
            raise RuntimeError("BatchSizeSearch: every candidate failed: "
                               + "; ".join(f"{r['batch_size']}: {r['failure']}" for r in self.results))
        best = min(usable, key=lambda r: (r["cost"], r["batch_size"]))
        self.chosen_batch_size = best["batch_size"]
        lightning_setattr(pl_module, self.batch_arg_name, self.chosen_batch_size)
        reset_fit_dataloaders(trainer)
        self._report(trainer)

    def _figures(self, start: Mark, end: Mark) -> tuple[float, float, float]:
        """(J of our sensors, s, cost) between two marks; waits (bounded) for the samples to reach ``end``."""
        m = measure(start, self.attachment.meter.wait(end))
        energy_J = sum(m.energy_J.get(name, 0.0) for name in self._energy_sensors)
        return energy_J, m.duration_s, self._cost(energy_J, m.duration_s)

    def _cost(self, energy_J: float, time_s: float) -> float:
        if self.cost == "energy":
            return energy_J
        if self.cost == "time":
            return time_s
        return self.eta_knob * energy_J + (1 - self.eta_knob) * self._max_power_W * time_s

    def _run_trials(self, trainer: Trainer, pl_module: LightningModule) -> list[dict]:
        ckpt_path = os.path.join(trainer.default_root_dir, f".batch_size_search_{uuid.uuid4().hex}.ckpt")
        trainer.save_checkpoint(ckpt_path)
        loop = trainer.fit_loop
        saved = {
            "loggers": trainer.loggers, "callbacks": trainer.callbacks, "max_steps": loop.epoch_loop.max_steps,
            "min_steps": loop.epoch_loop.min_steps, "max_epochs": loop.max_epochs, "min_epochs": loop.min_epochs,
            "limit_train_batches": trainer.limit_train_batches, "limit_val_batches": trainer.limit_val_batches,
            "loop_state": deepcopy(loop.state_dict()), "batch_size": lightning_getattr(pl_module, self.batch_arg_name),
        }
        kept = [c for c in trainer.callbacks if getattr(c, "keep_during_trials", False)]
        results: list[dict] = []
        try:
            from lightning.pytorch.loggers.logger import DummyLogger

            trainer.logger = DummyLogger() if trainer.logger is not None else None
            trainer.limit_train_batches = 1.0
            loop.epoch_loop.min_steps, loop.min_epochs = None, None  # a trial may stop at any validation
            if self.method == "per_sample":
                trainer.limit_val_batches = 0
                loop.epoch_loop.max_steps = self.warmup_steps + self.steps
                loop.max_epochs = -1  # the steps, not the epochs, end a trial
            else:
                loop.epoch_loop.max_steps, loop.max_epochs = -1, self._trial_epochs
            for size in self.batch_sizes:
                if self.method == "per_sample":
                    probe = _TrialProbe(self.timeline, self.warmup_steps, self.steps)
                else:
                    finished = [r["cost"] for r in results if r["failure"] is None]
                    limit = self.beta_knob * min(finished) if finished and self.beta_knob else math.inf
                    probe = _TargetProbe(self, limit)
                trainer.callbacks = [*kept, probe]
                results.append(self._trial(trainer, pl_module, size, probe, saved["loop_state"], ckpt_path))
        finally:
            trainer.loggers, trainer.callbacks = saved["loggers"], saved["callbacks"]
            loop.epoch_loop.max_steps, loop.max_epochs = saved["max_steps"], saved["max_epochs"]
            loop.epoch_loop.min_steps, loop.min_epochs = saved["min_steps"], saved["min_epochs"]
            trainer.limit_train_batches = saved["limit_train_batches"]
            trainer.limit_val_batches = saved["limit_val_batches"]
            trainer.should_stop = False
            lightning_setattr(pl_module, self.batch_arg_name, saved["batch_size"])
            loop.load_state_dict(deepcopy(saved["loop_state"]))
            loop.restarting = False
            reset_fit_dataloaders(trainer)
            loop.reset()
            restore_checkpoint(trainer, ckpt_path)
            trainer.strategy.remove_checkpoint(ckpt_path)
        return results

    def _trial(self, trainer: Trainer, pl_module: LightningModule, size: int, probe: Callback, state,
               ckpt_path: str) -> dict:
        from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error

        row: dict[str, Any] = {"batch_size": size, "failure": None}
        if self.method == "to_target":  # every candidate trains from the same weights and optimizer state
            restore_checkpoint(trainer, ckpt_path)
        lightning_setattr(pl_module, self.batch_arg_name, size)
        on_cuda = trainer.strategy.root_device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        if hasattr(self.gpu, "reset_peak_memory"):
            self.gpu.reset_peak_memory()
        loop = trainer.fit_loop
        try:
            reset_fit_dataloaders(trainer)
            loop.load_state_dict(deepcopy(state))
            loop.restarting = False
            trainer.should_stop = False
            loop.run()
        except Exception as err:
            if not (isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)):
                raise
            garbage_collection_cuda()
            row["failure"] = f"out of memory ({err})"
            return row
        finally:
            trainer.should_stop = False
        row["peak_memory_B"] = (int(torch.cuda.max_memory_allocated(trainer.strategy.root_device)) if on_cuda
                                else getattr(self.gpu, "peak_memory_B", None))
        if isinstance(probe, _TargetProbe):
            return self._target_row(row, probe)
        if probe.end is None:
            row["failure"] = (f"an epoch has fewer than warmup_steps + steps = {self.warmup_steps + self.steps} batches "
                              f"of {size}")
            return row
        energy_J, time_s, _ = self._figures(probe.start, probe.end)
        row.update({
            "samples": probe.samples, "steps": self.steps, "energy_J": energy_J, "time_s": time_s,
            "energy_per_sample_J": energy_J / probe.samples, "time_per_sample_s": time_s / probe.samples,
        })
        row["cost"] = self._cost(row["energy_per_sample_J"], row["time_per_sample_s"])
        return row

    def _target_row(self, row: dict, probe: _TargetProbe) -> dict:
        row.update({"steps": probe.steps, "samples": probe.samples, "validations": probe.validations,
                    "metric": probe.metric, "reached": probe.reached})
        if probe.reached:
            energy_J, time_s, cost = self._figures(probe.start, probe.end)
        elif probe.pruned_at is not None:
            energy_J, time_s, cost = probe.pruned_at
            row["failure"] = (f"pruned: cost so far {cost:.4g} > beta_knob {self.beta_knob:g} x the best "
                              f"{probe.limit / self.beta_knob:.4g}")
        else:
            row["failure"] = f"{self.monitor} did not reach {self.target:g} in {self._trial_epochs} epochs"
            return row
        row.update({"energy_J": energy_J, "time_s": time_s, "cost": cost})
        if probe.samples:
            row.update({"energy_per_sample_J": energy_J / probe.samples, "time_per_sample_s": time_s / probe.samples})
        return row

    # ---------------------------------------------------------------- report
    @property
    def energy_label(self) -> str:
        return "CPU estimate" if self.energy_estimated else "measured"

    def _report(self, trainer: Trainer) -> None:
        per_sample = self.method == "per_sample"
        metrics: dict[str, float] = {"batch_size/chosen": float(self.chosen_batch_size)}
        what = "per sample" if per_sample else f"to {self.monitor} {'<=' if self.mode == 'min' else '>='} {self.target:g}"
        lines = [f"BatchSizeSearch ({self.cost} {what}; energy: {self.energy_label}): chosen batch size "
                 f"{self.chosen_batch_size}",
                 f"{'batch':>7} {'J' if not per_sample else 'J/sample':>12} {'s' if not per_sample else 's/sample':>12} "
                 f"{'steps':>7} {'peak GiB':>9} {'cost':>12}  note"]
        energy_key, time_key = ("energy_per_sample_J", "time_per_sample_s") if per_sample else ("energy_J", "time_s")
        for r in self.results:
            b = r["batch_size"]
            memory = r.get("peak_memory_B")
            if memory is not None:
                metrics[f"batch_size/{b}/peak_memory_B"] = float(memory)
            gib = f"{memory / 1024**3:.2f}" if memory is not None else "-"
            if "cost" not in r:
                lines.append(f"{b:>7} {'-':>12} {'-':>12} {r.get('steps', '-'):>7} {gib:>9} {'-':>12}  {r['failure']}")
                continue
            if r["failure"] is None:
                metrics.update({f"batch_size/{b}/{energy_key}": r[energy_key], f"batch_size/{b}/{time_key}": r[time_key],
                                f"batch_size/{b}/cost": r["cost"]})
            note = "<- chosen" if b == self.chosen_batch_size else (r["failure"] or "")
            lines.append(f"{b:>7} {r[energy_key]:>12.4g} {r[time_key]:>12.4g} {r['steps']:>7} {gib:>9} "
                         f"{r['cost']:>12.4g}  {note}")
        log_info("\n".join(lines))
        self.log_metrics(trainer, metrics, batches_that_stepped(trainer))
        if trainer.is_global_zero:
            self.result_file = atomic_write_json(self._log_dir / RESULT_FILE, {
                "method": self.method, "cost": self.cost,
                "cost_unit": "s" if self.cost == "time" else "J",
                "cost_per": "sample" if per_sample else "run to target",
                "monitor": self.monitor, "target": self.target, "mode": self.mode if not per_sample else None,
                "eta_knob": self.eta_knob if self.cost == "zeus_cost" else None,
                "max_power_W": self._max_power_W, "beta_knob": None if per_sample else self.beta_knob,
                "warmup_steps": self.warmup_steps if per_sample else None, "steps": self.steps if per_sample else None,
                "energy_sensors": list(self._energy_sensors), "energy_estimated": self.energy_estimated,
                "energy_label": self.energy_label,
                "chosen_batch_size": self.chosen_batch_size,
                "candidates": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                               for r in self.results],
            })

