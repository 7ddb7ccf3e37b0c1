"""PowerLimitOptimizer: Zeus's GlobalPowerLimitOptimizer as a Lightning callback, measured by the shared meter.

The state machine (Zeus's ``Ready``, ``Warmup``, ``Profiling`` and ``Done``, limits in mW, the same transitions,
one log line at each) is :class:`lightning_energy.optimize.power_limit.controller.PowerLimitController`,
framework-free; this callback translates the Trainer's hooks into its calls and owns only the Lightning glue:
the card (taken and put back), the windows' measurement through the Trainer's timeline, the collectives,
the logged metrics and the files.

Why not wrap ``zeus.optimizer.power_limit.GlobalPowerLimitOptimizer`` itself: its constructor opens every
GPU, turns on persistence mode and sets the maximum limit (at ``Trainer`` construction, before
``setup`` could fail cleanly, and even where a dry run must not touch the card); it measures through its
own ``ZeusMonitor`` windows (a synchronize and NVML reads on the training thread) instead of the one
shared sampler; its all-reduce moves tensors to CUDA (no CPU/gloo DDP); it knows only the exhaustive
sweep, no validation interruptions and no checkpoint state. What of Zeus fits is used as is: its
selectors (``Energy``, ``Time``, ``ZeusCost``, ``MaxSlowdownConstraint``) for every choice, its profile
file layout, and its device layer (``zeus.device.gpu.common.GPU``) for every read and write of the card.
"""

from __future__ import annotations

import atexit
import math
import os
import weakref
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_energy.extras import check_installed
from lightning_energy.integration.base import MeteredCallback
from lightning_energy.integration.lightning_internals import batches_that_stepped, is_accumulating
from lightning_energy.integration.timeline import StepFigures, should_log_step
from lightning_energy.io import atomic_write_json
from lightning_energy.measure import ranks as distributed
from lightning_energy.measure.meter import Mark, measure
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.optimize.power_limit import gpu_control
from lightning_energy.optimize.power_limit.controller import Card, PowerLimitController, PowerLimitSettings
from lightning_energy.optimize.power_limit.profile_file import (
    FIGURE_FILE,
    PROFILE_FILE,
    profile_figure,
    read_profile,
    write_figure_png,
    write_profile,
)
from lightning_energy.optimize.power_limit.search import (
    DEFAULT_MAX_REPEATS,
    DEFAULT_NOISE,
    DEFAULT_REPEAT_BUDGET,
    DEFAULT_SETTLE_BUDGET,
    DEFAULT_TOLERANCE,
)
from lightning_energy.units import MW_PER_W


class PowerLimitConfigError(MisconfigurationException, ValueError):
    """Settings that cannot work on this run (Lightning's configuration error, and a ValueError)."""


DRY_RUN_FILE = "power_limit_dry_run.json"
PERMISSION_FIXES = (gpu_control.PERMISSION_FIXES[:-1] + "; (3) pass PowerLimitOptimizer(dry_run=True) to see what "
                    "would be profiled without touching the card.")

# the card-control helpers live in lightning_energy.optimize.power_limit.gpu_control (shared with the sweep)
default_limit_mW = gpu_control.default_limit_mW
limit_permission_problem = gpu_control.permission_problem


class PowerLimitOptimizer(MeteredCallback):
    """Find the GPU power limit that minimises a time-energy cost while training, then train at it.

    As Zeus's ``GlobalPowerLimitOptimizer``: after ``wait_steps`` training steps, each candidate limit
    is set, warmed up for ``warmup_steps`` steps and profiled for ``profile_steps`` steps (a window from
    the start of one step to the start of the step after the last, as Zeus's ``on_step_begin`` to
    ``on_step_begin``: what runs between steps, data loading included, counts); then the selector's
    choice is applied for the rest of training. A step is an optimizer step (with gradient accumulation:
    all its micro-batches), as in the Trainer's timeline. A window that an epoch end or a validation run
    interrupts is thrown away and that limit profiled again. In DDP every rank measures its own GPU,
    energies are summed and times take the slowest rank, rank 0 decides and broadcasts: every rank
    applies the same limit.

    The limits change at the same steps as Zeus's (the state machine,
    ``lightning_energy.optimize.power_limit.controller``, runs in ``on_train_batch_start``; each transition is
    one INFO line of that module's logger on rank 0, e.g. ``power limit: profiling 250 W, steps 22-61``);
    the windows are the Trainer's timeline's step marks, ``measure(first.start, after_last.start)`` of
    the steps' figures, read when the figures arrive (a few steps later). Only a transition that needs a
    number (the final choice, each step of the adaptive search, a dry run's end) waits, bounded, for the
    samples to reach the step beginning then. Work that runs between steps belongs to the window whatever
    the callback order: e.g. ``gpu_sim.SimulatedWorkload``'s step, which runs in ``on_train_batch_end``
    and so inside the timeline's own step window only when it comes before the first suite callback in
    ``Trainer(callbacks=[...])``, is always inside the start-to-start windows.

    Energy is the device-scope energy of this callback's sensors (this rank's GPU counter), as Zeus
    counts GPU energy; for a simulated card on its own clock (``SimulatedGPU(clock="simulated")``) the
    card's own energy and time (the simulator's figures, not the host's timing: the same pick every run).

    The card is put back as it was before the fit (the limit and the persistence mode in force then, an
    administrator's setting included, not NVML's default) at fit end, on an exception, on Ctrl-C, on
    SIGHUP and at interpreter exit. Before the first change a crash marker is written
    (``lightning_energy.optimize.power_limit.gpu_control``); after SIGKILL or a power loss ``lightning-energy
    restore-power-limit`` puts the card back, and so does the next fit on that card, before it records
    what was there (a warning line says so). Where another live process (or another controller in this
    one) already controls the card, ``setup`` fails before training with one line naming it
    (``gpu_control.CardInUseError``) and the card is left alone: profiling beside another controller would
    measure its limits, not ours. A chosen limit is always one that was profiled.

    Logged metrics (rank zero, beside the loss):

    - ``power_limit/current_W``: the limit in force, at every logging step and at each change (W).
    - ``power_limit/<L>W/energy_per_step_J``, ``power_limit/<L>W/time_per_step_s``,
      ``power_limit/<L>W/cost`` (unit per selector: J/step, s/step, or the slowdown ratio): each
      profiled limit ``L``, when the choice is made.
    - ``power_limit/chosen_W``: the chosen limit; ``power_limit/retried_windows``: interrupted windows.

    Files in the log dir: ``power_limit_profile.json`` (Zeus's measurement layout plus per-step figures,
    costs and quadratic fits), ``power_limit_profile.png`` (energy, time and cost vs limit; a quadratic fit
    with R² only where spare points test it; "simulated GPU" on a simulated card; also to TensorBoard as
    ``power_limit/profile``); with ``dry_run`` ``power_limit_dry_run.json``.

    Args:
        selector: ``"zeus_cost"`` (eta*E + (1-eta)*MaxPower*T), ``"energy"``, ``"time"`` or ``"max_slowdown"``.
        eta_knob: eta of the ZeusCost selector, in [0, 1].
        max_slowdown_factor: for ``"max_slowdown"``: the lowest limit at most this much slower than the maximum.
        search: ``"exhaustive"`` (Zeus: every limit, ``pl_step_W`` apart, Zeus's selector picks) or
            ``"adaptive"`` (fewer limits: branch and bound on monotonic time and power, near-ties settled by
            repeated windows; exhaustive when profiles break monotonicity; never more profiling steps than the
            sweep; on grids of fewer than 9 limits ``"energy"`` and ``"zeus_cost"`` profile every limit once, as
            the sweep does; see ``lightning_energy.optimize.power_limit.search.AdaptiveSearch``).
        wait_steps, warmup_steps, profile_steps: steps before anything, per limit before and while measuring.
        pl_step_W: spacing of the candidate limits (W).
        profile_path: a profile file: loaded and used without profiling when it exists, written when not.
        dry_run: never touch the card; profile the current limit only and report the limits that would be
            profiled and the expected profiling steps, time and energy.
        gpu: the device to control: a Zeus ``GPU`` object such as ``lightning_energy.simulate.gpu_sim.SimulatedGPU``;
            default: this rank's CUDA device, found through the energy sensors' CUDA -> NVML mapping.
        sensors: the sensors to measure with (default: the GPU's own sensor for a simulated GPU, else the
            shared auto-detected ones); only ``"device"``-scope sensors count.
        tolerance: for ``search="adaptive"``: a pick within this fraction of the optimum is good enough (max
            slowdown: a pick may break the constraint by this fraction of the time).
        noise: for ``search="adaptive"``: the assumed run-to-run spread of one window (relative standard
            deviation), pooled with what repeated windows show.
        max_repeats, repeat_budget: for ``search="adaptive"``: most extra windows per limit, and per search
            while exploring (the noise calibration and limits that split a near-tie included).
        settle_budget: for ``search="adaptive"``: most further repeated windows that settle the final choice
            (near-ties, limits near the max-slowdown threshold) once ``repeat_budget`` is spent.
        max_power_scope: ZeusCost's MaxPower in DDP: ``"job"`` (the highest limit times the world size,
            beside energy summed over every rank: the same pick as one rank alone) or ``"process"`` (Zeus's
            DDP recipe, one GPU per process: times 1; see ``lightning_energy.optimize.power_limit.search``).

    Every setting but ``profile_path``, ``gpu``, ``sensors``, ``interval_s`` and ``log_figure`` is kept in
    ``settings`` (a frozen :class:`~lightning_energy.optimize.power_limit.controller.PowerLimitSettings`).
    """

    def __init__(
        self,
        selector: str = "zeus_cost",
        eta_knob: float = 0.5,
        max_slowdown_factor: float = 1.1,
        search: str = "exhaustive",
        wait_steps: int = 1,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step_W: int = 25,
        profile_path: str | None = None,
        dry_run: bool = False,
        gpu: Any = None,
        sensors: list[Sensor] | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
        interval_s: float = DEFAULT_INTERVAL_S,
        log_figure: bool = True,
        noise: float = DEFAULT_NOISE,
        max_repeats: int = DEFAULT_MAX_REPEATS,
        repeat_budget: int = DEFAULT_REPEAT_BUDGET,
        settle_budget: int = DEFAULT_SETTLE_BUDGET,
        max_power_scope: str = "job",
    ) -> None:
        super().__init__()
        check_installed("zeus", "PowerLimitOptimizer")  # fail at construction, not in the middle of a fit
        self.settings = PowerLimitSettings(
            selector=selector, eta_knob=eta_knob, max_slowdown_factor=max_slowdown_factor, search=search,
            wait_steps=wait_steps, warmup_steps=warmup_steps, profile_steps=profile_steps, pl_step_W=pl_step_W,
            tolerance=tolerance, noise=noise, max_repeats=max_repeats, repeat_budget=repeat_budget,
            settle_budget=settle_budget, max_power_scope=max_power_scope, dry_run=dry_run)
        self.interval_s = self.check_interval(interval_s)
        self.check_flags(log_figure=log_figure)
        if profile_path is not None and not isinstance(profile_path, (str, Path)):
            raise TypeError(f"`profile_path` must be a path or None, got {type(profile_path).__name__}")
        if gpu is not None and not all(hasattr(gpu, m) for m in ("get_power_management_limit_constraints",
                                                                 "set_power_management_limit",
                                                                 "reset_power_management_limit")):
            raise TypeError(f"`gpu` must be a zeus.device.gpu.common.GPU (e.g. SimulatedGPU), got {type(gpu).__name__}")
        self.profile_path = Path(profile_path) if profile_path is not None else None
        self.gpu, self.log_figure = gpu, log_figure
        self._user_sensors = self.check_sensors(sensors)
        self.profile_file: Path | None = None  # files of the last fit
        self.figure_file: Path | None = None
        self.dry_run_report: dict | None = None
        self._controller: PowerLimitController | None = None  # the state machine of the last fit
        self._resume: dict | None = None
        self._card: gpu_control.LimitController | None = None
        self._hangup = gpu_control.HangupGuard(self._restore)

    # results of the last fit, the controller's
    chosen_limit_W = property(lambda self: self._controller.chosen_limit_W if self._controller else None)
    profiles = property(lambda self: self._controller.profiles if self._controller else {})
    limits_profiled = property(lambda self: self._controller.limits_profiled if self._controller else [])
    retried_windows = property(lambda self: self._controller.retried_windows if self._controller else 0)
    _strategy = property(lambda self: self._controller.search)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(selector=self.settings.selector, search=self.settings.search)

    # ---------------------------------------------------------------- set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        dry_run = self.settings.dry_run
        gpu = self.gpu if self.gpu is not None else gpu_control.rank_gpu(trainer.strategy.root_device)
        low_mW, high_mW = gpu.get_power_management_limit_constraints()
        problem = None if dry_run else limit_permission_problem(gpu)
        everyone = distributed.gather(trainer, {"limits_mW": (int(low_mW), int(high_mW)), "problem": problem})
        problems = [f"rank {rank}: {row['problem']}" for rank, row in enumerate(everyone) if row["problem"]]
        if problems:
            raise RuntimeError(f"PowerLimitOptimizer cannot set GPU power limits ({'; '.join(problems)}). "
                               + PERMISSION_FIXES)
        if len({row["limits_mW"] for row in everyone}) > 1:
            ranges = ", ".join(f"rank {r}: {row['limits_mW']}" for r, row in enumerate(everyone))
            raise ValueError(f"PowerLimitOptimizer needs the same power-limit range on every GPU, got {ranges} (mW)")
        self._gpu = gpu
        max_W = int(high_mW) // MW_PER_W
        default = gpu_control.default_limit_mW(gpu)
        self._start_W = int(gpu.get_power_management_limit()) // MW_PER_W
        name = str(gpu.get_name())
        self._simulated = gpu_control.is_simulated(gpu)
        self._own_clock = getattr(gpu, "simulated_reading", lambda: None)() is not None
        self._readings: dict[int, tuple[float, float]] = {}  # simulated card's own (J, s) at bounding steps
        self._starts: dict[int, Mark] = {}  # start marks of the steps bounding the windows, from their figures
        if not dry_run:
            self._take_card(gpu)  # may put a killed run's limit back: ``_start_W`` is what is in force then
        self._current_W = self._start_W
        self.dry_run_report = None
        card = Card(name, int(low_mW) // MW_PER_W, max_W,
                    default // MW_PER_W if default is not None else max_W, self._start_W)
        port = _TrainerPort(self, trainer)
        self._controller = PowerLimitController(self.settings, card, port, trainer.world_size, trainer.global_rank)
        if self.profile_path is not None and self.profile_path.exists() and not dry_run:
            profiles, document = read_profile(self.profile_path)
            if document.get("gpu_name") not in (None, card.name):
                rank_zero_warn(f"power-limit profile {self.profile_path} was made on {document['gpu_name']!r}, "
                               f"this is {card.name!r}")
            self._controller.load(profiles, str(self.profile_path))
        else:
            self._controller.start()
        if self._resume is not None:
            self._controller.restore(self._resume)
            self._resume = None
        sensors = self._user_sensors
        if sensors is None and hasattr(gpu, "energy_sensor"):
            sensors = [gpu.energy_sensor()]
        attachment = self.attach(trainer, sensors, interval_s=self.interval_s)
        self._device_sensors = [s.name for s in attachment.sensors if s.scope == "device"]
        if not self._device_sensors:
            names = attachment.sensor_names
            self.detach(trainer)
            raise RuntimeError("PowerLimitOptimizer found no device-scope energy sensor for this rank's GPU "
                               f"(sensors: {names}); pass `sensors` with the GPU's sensor")
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)

    def _take_card(self, gpu) -> None:
        """Record what was there (the settings in force, or those a killed run's crash marker recorded, put
        back first) and write the crash marker before any change; persistence mode on, as Zeus does before
        changing limits. Restored by :meth:`_restore`. ``gpu_control.CardInUseError`` (the card untouched)
        where another live controller has the card."""
        card = gpu_control.LimitController(gpu, f"PowerLimitOptimizer (pid {os.getpid()})")
        try:
            card.take()
        except gpu_control.permission_errors() as err:  # Zeus's (NVIDIA) or amdsmi's NO_PERM (AMD)
            card.restore()
            raise RuntimeError(f"PowerLimitOptimizer cannot set GPU power limits ({err}). " + PERMISSION_FIXES) from err
        self._card = card
        # what is in force from here: a killed run's marker may just have put the card back
        self._start_W = card.before.limit_mW // MW_PER_W
        atexit.register(self._restore)
        self._hangup.install()

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        if exception is not None or stage == "fit":
            self._restore()

    # ---------------------------------------------------------------- the card
    def _set_limit(self, trainer: Trainer, limit_W: int) -> None:
        if self.settings.dry_run:
            raise AssertionError("a dry run never sets a limit")
        if limit_W != self._current_W:
            self._gpu.set_power_management_limit(limit_W * MW_PER_W)
            self._current_W = limit_W
            self._log(trainer, {"power_limit/current_W": float(limit_W)})

    def _restore(self) -> None:
        """The card as it was before the fit (fit end, exception, Ctrl-C, SIGHUP, interpreter exit)."""
        card, self._card = self._card, None
        if card is None:
            return
        atexit.unregister(self._restore)
        self._hangup.uninstall()
        before = card.before
        problems = card.restore()  # the run is ending: tell, do not mask the original error
        if before is not None:
            self._current_W = before.limit_mW // MW_PER_W
        if problems:
            rank_zero_warn("PowerLimitOptimizer: " + "; ".join(problems) + (
                f". The crash marker {card.marker} stays: `lightning-energy restore-power-limit` retries"
                if card.marker is not None else ""))

    # ---------------------------------------------------------------- training
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._controller.done:
            self._check_epoch_fits_a_window(trainer)
        self._controller.begin_training()
        self._log(trainer, {"power_limit/current_W": float(self._current_W)})

    def _check_epoch_fits_a_window(self, trainer: Trainer) -> None:
        span = self.settings.warmup_steps + self.settings.profile_steps + 1
        accumulate = max(int(trainer.accumulate_grad_batches), 1)
        batches = trainer.num_training_batches
        between_validations = trainer.val_check_batch if trainer.enable_validation else math.inf
        room = min(batches, between_validations if between_validations else math.inf)
        if math.ceil(room / accumulate) < span:
            per_step = f" of {accumulate} batches" if accumulate > 1 else ""
            raise PowerLimitConfigError(
                f"PowerLimitOptimizer: profiling one limit needs warmup_steps + profile_steps + 1 = {span} training "
                f"steps{per_step} in a row, but an epoch has {batches} batches (validation every "
                f"{between_validations}); every window would be interrupted. Lower `warmup_steps`/`profile_steps` "
                "or make epochs longer."
            )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Zeus's ``on_step_begin``, once per optimizer step (its first micro-batch)."""
        if self._controller.step_begins(batches_that_stepped(trainer)) is None:
            return
        if self.settings.dry_run:
            self._finish_dry_run(trainer)
        elif trainer.is_global_zero:
            self._write_results(trainer)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any, batch_idx: int) -> None:
        if not is_accumulating(trainer) and should_log_step(trainer):
            self._log(trainer, {"power_limit/current_W": float(self._current_W)})

    # ---------------------------------------------------------------- the windows' measurement
    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        """Keep the start mark of a step that bounds a window (the figures arrive a few steps late)."""
        keep = self._controller.bounding_steps()
        self._starts = {step: mark for step, mark in self._starts.items() if step in keep}
        if figures.step in keep:
            self._starts[figures.step] = figures.start

    def _window_marks(self, trainer: Trainer, first: int, after_last: int) -> tuple[Mark, Mark] | None:
        """The start marks of steps ``first`` and ``after_last``: from their figures, or, when these have not
        arrived yet, after a bounded wait for the samples to reach the start of the step beginning now."""
        if first not in self._starts or after_last not in self._starts:
            now = self.timeline.open_step_start
            if now is not None:
                self.attachment.meter.wait(now)  # every step before this one is measured now ...
                self.timeline.flush(trainer)  # ... and delivered to on_step_measured
                if after_last == self._controller.step:
                    self._starts.setdefault(after_last, now)  # the mark this step's figures will carry
        start, end = self._starts.get(first), self._starts.get(after_last)
        return (start, end) if start is not None and end is not None and start.resolved and end.resolved else None

    def _measure(self, trainer: Trainer, first: int, after_last: int) -> tuple[float, float] | None:
        """This rank's (energy J, time s) of a window: device-scope energy between the two steps' start marks,
        or a simulated card's own figures."""
        marks = self._window_marks(trainer, first, after_last)  # a flush there delivers its steps to the others
        if self._own_clock:  # the simulated card's own figures: independent of the host's timing
            start, end = self._readings.pop(first, None), self._readings.get(after_last)
            return (end[0] - start[0], end[1] - start[1]) if start is not None and end is not None else None
        if marks is None:
            return None
        m = measure(*marks)
        return sum(m.energy_J.get(name, 0.0) for name in self._device_sensors), m.duration_s

    def _read_own_clock(self, step: int) -> None:
        """A simulated card on its own clock: its (energy J, time s) at the start of a window's bounding step
        (before that step's work: the callback's ``on_train_batch_start`` runs first)."""
        if self._own_clock:
            self._readings[step] = self._gpu.simulated_reading()

    # ---------------------------------------------------------------- interruptions
    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._controller.interrupt("the end of a training epoch")

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and self._controller is not None:
            self._controller.interrupt("a validation run")

    # ---------------------------------------------------------------- end of fit
    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._controller.end_of_fit():
            rank_zero_warn(f"PowerLimitOptimizer: training ended before profiling finished ({len(self.profiles)} of "
                           f"{len(self._controller.grid)} limits profiled); no limit was chosen. Train longer or lower "
                           "`profile_steps`/`warmup_steps`.")
        self._restore()

    def _write_results(self, trainer: Trainer) -> None:
        self._log(trainer, self._controller.metrics())
        document = self._controller.document(simulated=self._simulated, energy_source=(
            "simulated GPU (the card's own clock)" if self._own_clock else
            "simulated GPU" if self._simulated else "measured"))
        self.profile_file = write_profile(self._log_dir / PROFILE_FILE, document)
        if self.profile_path is not None and not self.profile_path.exists():
            write_profile(self.profile_path, document)
        if self.log_figure:
            self._write_figure(trainer, self._controller.ordered_profiles())

    def _write_figure(self, trainer: Trainer, ordered) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        figure = profile_figure(ordered, self._controller.objective, self.chosen_limit_W,
                                self._controller.card.name, self._simulated)
        self.figure_file = write_figure_png(figure, self._log_dir / FIGURE_FILE)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("power_limit/profile", figure, global_step=trainer.global_step, close=False)

    def _log(self, trainer: Trainer, metrics: dict) -> None:
        self.log_metrics(trainer, metrics, batches_that_stepped(trainer))

    def _finish_dry_run(self, trainer: Trainer) -> None:
        path = self._log_dir / DRY_RUN_FILE
        self.dry_run_report = self._controller.dry_run_report(
            gpu_control.permission_problem(self._gpu), trainer.estimated_stepping_batches, path)
        if trainer.is_global_zero:
            self.profile_file = atomic_write_json(path, self.dry_run_report)

    # ---------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        return self._controller.state_dict() if self._controller is not None else dict(self._resume or {})

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict)
        if self.attachment is not None:  # already set up (Lightning restores callbacks after setup)
            self._controller.restore(self._resume)
            self._resume = None


class _TrainerPort:
    """The controller's :class:`~lightning_energy.optimize.power_limit.controller.Port` on a Trainer (held weakly:
    the results kept after the fit do not keep the Trainer and its model alive)."""

    def __init__(self, callback: PowerLimitOptimizer, trainer: Trainer) -> None:
        self._callback, self._trainer = callback, weakref.ref(trainer)

    def set_limit(self, limit_W: int) -> None:
        self._callback._set_limit(self._trainer(), limit_W)

    def window_boundary(self, step: int) -> None:
        self._callback._read_own_clock(step)

    def measure(self, first_step: int, after_last_step: int) -> tuple[float, float] | None:
        return self._callback._measure(self._trainer(), first_step, after_last_step)

    def gather(self, value: Any) -> list[Any]:
        return distributed.gather(self._trainer(), value)

    def broadcast(self, value: Any) -> Any:
        return self._trainer().strategy.broadcast(value, src=0)
