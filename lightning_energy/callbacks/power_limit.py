"""PowerLimitOptimizer: Zeus's GlobalPowerLimitOptimizer as a Lightning callback, measured by the shared meter.

Why not wrap ``zeus.optimizer.power_limit.GlobalPowerLimitOptimizer`` itself: its constructor opens every
GPU, turns on persistence mode and sets the maximum limit (at ``Trainer`` construction, before
``setup`` could fail cleanly, and even where a dry run must not touch the card); it measures through its
own ``ZeusMonitor`` windows (a synchronize and NVML reads on the training thread) instead of the one
shared sampler; its all-reduce moves tensors to CUDA (no CPU/gloo DDP); it knows only the exhaustive
sweep, no validation interruptions and no checkpoint state. What of Zeus fits is used as is: its state
classes (``Ready``, ``Warmup``, ``Profiling``, ``Done``, limits in mW) with the same transitions, its
selectors (``Energy``, ``Time``, ``ZeusCost``, ``MaxSlowdownConstraint``) for every choice, its profile
file layout, and its device layer (``zeus.device.gpu.common.GPU``) for every read and write of the card.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import math
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_energy.extras import check_installed
from lightning_energy.measure import ranks as distributed
from lightning_energy.optimize.power_limit import gpu_control
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.lightning_internals import batches_that_stepped, is_accumulating
from lightning_energy.integration.timeline import StepFigures, should_log_step
from lightning_energy.io import atomic_write_json
from lightning_energy.measure.meter import Mark, measure
from lightning_energy.optimize.power_limit.search import (
    DEFAULT_MAX_REPEATS,
    DEFAULT_NOISE,
    DEFAULT_REPEAT_BUDGET,
    DEFAULT_SETTLE_BUDGET,
    DEFAULT_TOLERANCE,
    MAX_POWER_SCOPES,
    SEARCHES,
    SELECTORS,
    LimitProfile,
    Objective,
    limit_grid,
    make_search,
)
from lightning_energy.optimize.power_limit.profile_file import (
    FIGURE_FILE,
    PROFILE_FILE,
    profile_document,
    profile_figure,
    read_profile,
    write_figure_png,
    write_profile,
)
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.units import MW_PER_W


class PowerLimitConfigError(MisconfigurationException, ValueError):
    """Settings that cannot work on this run (Lightning's configuration error, and a ValueError)."""


log_info = rank_zero_info_for(__name__)

DRY_RUN_FILE = "power_limit_dry_run.json"
PERMISSION_FIXES = (gpu_control.PERMISSION_FIXES[:-1] + "; (3) pass PowerLimitOptimizer(dry_run=True) to see what "
                    "would be profiled without touching the card.")


def _zeus_states():
    with contextlib.redirect_stdout(io.StringIO()):
        from zeus.optimizer.power_limit import Done, Profiling, Ready, Warmup
    return Ready, Warmup, Profiling, Done


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

    The limits change at the same steps as Zeus's (the state machine runs in ``on_train_batch_start``);
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
            repeated windows; exhaustive when profiles break monotonicity; see
            ``lightning_energy.optimize.power_limit.search.AdaptiveSearch``).
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
        if selector not in SELECTORS:
            raise ValueError(f"`selector` must be one of {SELECTORS}, got {selector!r}")
        if search not in SEARCHES:
            raise ValueError(f"`search` must be one of {SEARCHES}, got {search!r}")
        for name, value, low in (("wait_steps", wait_steps, 0), ("warmup_steps", warmup_steps, 0),
                                 ("profile_steps", profile_steps, 1), ("pl_step_W", pl_step_W, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")
        Objective(selector, eta_knob, max_slowdown_factor, max_power_scope=max_power_scope)  # validates them
        make_search("adaptive", [1], Objective(), tolerance, noise, max_repeats, repeat_budget,
                    settle_budget)  # validates them
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
            raise ValueError(f"`tolerance` must be a number in [0, 1), got {tolerance!r}")
        interval_s = self.check_interval(interval_s)
        self.check_flags(dry_run=dry_run, log_figure=log_figure)
        if profile_path is not None and not isinstance(profile_path, (str, Path)):
            raise TypeError(f"`profile_path` must be a path or None, got {type(profile_path).__name__}")
        if gpu is not None and not all(hasattr(gpu, m) for m in ("get_power_management_limit_constraints",
                                                                 "set_power_management_limit",
                                                                 "reset_power_management_limit")):
            raise TypeError(f"`gpu` must be a zeus.device.gpu.common.GPU (e.g. SimulatedGPU), got {type(gpu).__name__}")
        self.selector = selector
        self.eta_knob = float(eta_knob)
        self.max_slowdown_factor = float(max_slowdown_factor)
        self.search = search
        self.wait_steps, self.warmup_steps, self.profile_steps = wait_steps, warmup_steps, profile_steps
        self.pl_step_W = pl_step_W
        self.profile_path = Path(profile_path) if profile_path is not None else None
        self.dry_run = dry_run
        self.gpu = gpu
        self._user_sensors = self.check_sensors(sensors)
        self.tolerance = float(tolerance)
        self.noise, self.max_repeats, self.repeat_budget = float(noise), max_repeats, repeat_budget
        self.settle_budget = settle_budget
        self.max_power_scope = max_power_scope
        self.interval_s = interval_s
        self.log_figure = log_figure
        # results of the last fit
        self.chosen_limit_W: int | None = None
        self.profiles: dict[int, LimitProfile] = {}
        self.retried_windows = 0
        self.limits_profiled: list[int] = []  # every limit whose window completed, in order (this run)
        self.profile_file: Path | None = None
        self.figure_file: Path | None = None
        self.dry_run_report: dict | None = None
        self._resume: dict | None = None
        self._state = None
        self._controller: gpu_control.LimitController | None = None
        self._hangup = gpu_control.HangupGuard(self._restore)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(selector=self.selector, search=self.search)

    # ---------------------------------------------------------------- set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        Ready, Warmup, Profiling, Done = _zeus_states()
        gpu = self.gpu if self.gpu is not None else gpu_control.rank_gpu(trainer.strategy.root_device)
        low_mW, high_mW = gpu.get_power_management_limit_constraints()
        problem = None if self.dry_run else limit_permission_problem(gpu)
        everyone = distributed.gather(trainer, {"limits_mW": (int(low_mW), int(high_mW)), "problem": problem})
        problems = [f"rank {rank}: {row['problem']}" for rank, row in enumerate(everyone) if row["problem"]]
        if problems:
            raise RuntimeError(f"PowerLimitOptimizer cannot set GPU power limits ({'; '.join(problems)}). "
                               + PERMISSION_FIXES)
        if len({row["limits_mW"] for row in everyone}) > 1:
            ranges = ", ".join(f"rank {r}: {row['limits_mW']}" for r, row in enumerate(everyone))
            raise ValueError(f"PowerLimitOptimizer needs the same power-limit range on every GPU, got {ranges} (mW)")
        self._gpu = gpu
        self._min_W, self._max_W = int(low_mW) // MW_PER_W, int(high_mW) // MW_PER_W
        default = gpu_control.default_limit_mW(gpu)
        self._default_W = default // MW_PER_W if default is not None else self._max_W
        self._start_W = int(gpu.get_power_management_limit()) // MW_PER_W
        self._gpu_name = str(gpu.get_name())
        self._grid = limit_grid(self._min_W, self._max_W, self.pl_step_W)
        self._objective = Objective(self.selector, self.eta_knob, self.max_slowdown_factor, trainer.world_size,
                                    self.max_power_scope)
        self._strategy = make_search(self.search, self._grid, self._objective, self.tolerance, self.noise,
                                     self.max_repeats, self.repeat_budget, self.settle_budget,
                                     warmup_share=self.warmup_steps / self.profile_steps)
        self._simulated = gpu_control.is_simulated(gpu)
        self._own_clock = getattr(gpu, "simulated_reading", lambda: None)() is not None
        self._readings: dict[int, tuple[float, float]] = {}  # simulated card's own (J, s) at bounding steps
        if not self.dry_run:
            self._take_card(gpu)
        self.profiles, self.limits_profiled, self.retried_windows = {}, [], 0
        self.chosen_limit_W, self.dry_run_report = None, None
        # windows by the index of their bounding steps (Lightning's ``_batches_that_stepped`` at the step):
        # the open one's first step, and the last finished one (limit, first step, step after the last)
        self._window_first: int | None = None
        self._pending: tuple[int, int, int] | None = None
        self._starts: dict[int, Mark] = {}  # start marks of the steps bounding those windows, from their figures
        self._step_begun: int | None = None  # the step whose first batch started last
        self._current_W = self._start_W
        self._loaded_profile = False
        if self.profile_path is not None and self.profile_path.exists() and not self.dry_run:
            self._load_profile_file(self.profile_path)
            self._state = Done(optimal_power_limit=self.chosen_limit_W * MW_PER_W)
        else:
            first = self._start_W if self.dry_run else self._strategy.next_limit({})
            self._state = Ready(next_power_limit=first * MW_PER_W, steps=self.wait_steps + 1)
        if self._resume is not None:
            self._apply_resume(self._resume)
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
        controller = gpu_control.LimitController(gpu, f"PowerLimitOptimizer (pid {os.getpid()})")
        try:
            controller.take()
        except gpu_control.permission_errors() as err:  # Zeus's (NVIDIA) or amdsmi's NO_PERM (AMD)
            controller.restore()
            raise RuntimeError(f"PowerLimitOptimizer cannot set GPU power limits ({err}). " + PERMISSION_FIXES) from err
        self._controller = controller
        # what is in force from here: a killed run's marker may just have put the card back
        self._start_W = controller.before.limit_mW // MW_PER_W
        atexit.register(self._restore)
        self._hangup.install()

    def _load_profile_file(self, path: Path) -> None:
        profiles, document = read_profile(path)
        outside = [p.limit_W for p in profiles if not self._min_W <= p.limit_W <= self._max_W]
        if outside:
            raise ValueError(f"power-limit profile {path} holds limits {outside} W outside this GPU's range "
                             f"[{self._min_W}, {self._max_W}] W; delete it or point `profile_path` elsewhere")
        if document.get("gpu_name") not in (None, self._gpu_name):
            rank_zero_warn(f"power-limit profile {path} was made on {document['gpu_name']!r}, this is {self._gpu_name!r}")
        self.profiles = {p.limit_W: p for p in profiles}
        self.chosen_limit_W = self._strategy.choose(self.profiles)
        self._loaded_profile = True
        log_info(f"PowerLimitOptimizer: profile loaded from {path}; {self.selector} picks {self.chosen_limit_W} W")

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        if exception is not None or stage == "fit":
            self._restore()

    # ---------------------------------------------------------------- the card
    def _set_limit(self, trainer: Trainer, limit_W: int) -> None:
        if self.dry_run:
            raise AssertionError("a dry run never sets a limit")
        if limit_W != self._current_W:
            self._gpu.set_power_management_limit(limit_W * MW_PER_W)
            self._current_W = limit_W
            self._log(trainer, {"power_limit/current_W": float(limit_W)})

    def _restore(self) -> None:
        """The card as it was before the fit (fit end, exception, Ctrl-C, SIGHUP, interpreter exit)."""
        controller, self._controller = self._controller, None
        if controller is None:
            return
        atexit.unregister(self._restore)
        self._hangup.uninstall()
        before = controller.before
        problems = controller.restore()  # the run is ending: tell, do not mask the original error
        if before is not None:
            self._current_W = before.limit_mW // MW_PER_W
        if problems:
            rank_zero_warn("PowerLimitOptimizer: " + "; ".join(problems) + (
                f". The crash marker {controller.marker} stays: `lightning-energy restore-power-limit` retries"
                if controller.marker is not None else ""))

    # ---------------------------------------------------------------- training
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        Ready, Warmup, Profiling, Done = _zeus_states()
        if not isinstance(self._state, Done):
            self._check_epoch_fits_a_window(trainer)
        if not self.dry_run:
            target = self.chosen_limit_W if isinstance(self._state, Done) else self._max_W
            self._set_limit(trainer, target)  # Zeus: the maximum before profiling starts
        self._log(trainer, {"power_limit/current_W": float(self._current_W)})

    def _check_epoch_fits_a_window(self, trainer: Trainer) -> None:
        span = self.warmup_steps + self.profile_steps + 1
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
        step = batches_that_stepped(trainer)
        if step == self._step_begun:
            return  # a later micro-batch of the same optimizer step (gradient accumulation)
        self._step_begun = step
        Ready, Warmup, Profiling, Done = _zeus_states()
        state = self._state
        if isinstance(state, Done):
            return
        state.steps -= 1
        if state.steps > 0:
            return
        if isinstance(state, Ready):
            self._begin_limit(trainer, state.next_power_limit // MW_PER_W)
        elif isinstance(state, Warmup):
            self._start_window(state.current_power_limit // MW_PER_W)
        else:
            self._finish_window(trainer, state.current_power_limit // MW_PER_W)

    def _begin_limit(self, trainer: Trainer, limit_W: int) -> None:
        Ready, Warmup, Profiling, Done = _zeus_states()
        if not self.dry_run:
            self._set_limit(trainer, limit_W)
        if self.warmup_steps > 0:
            self._state = Warmup(current_power_limit=limit_W * MW_PER_W, steps=self.warmup_steps)
        else:
            self._start_window(limit_W)

    def _start_window(self, limit_W: int) -> None:
        Ready, Warmup, Profiling, Done = _zeus_states()
        self._state = Profiling(current_power_limit=limit_W * MW_PER_W, steps=self.profile_steps)
        self._window_first = self._step_begun  # the window starts where this step's figures will start
        self._read_own_clock(self._step_begun)

    def _finish_window(self, trainer: Trainer, limit_W: int) -> None:
        self._merge_pending(trainer)  # the previous window: its figures arrived long ago
        self._pending = (limit_W, self._window_first, self._step_begun)  # ends where this step starts
        self._read_own_clock(self._step_begun)
        self._window_first = None
        self.limits_profiled.append(limit_W)
        if self.dry_run:
            self._finish_dry_run(trainer)
            return
        if self._strategy.needs_measurements:
            self._merge_pending(trainer)  # a decision point: this window's figures are needed now
            proposal = self._strategy.next_limit(self.profiles, limit_W) if trainer.is_global_zero else None
            next_W = trainer.strategy.broadcast(proposal, src=0)
        else:
            known = {**self.profiles, limit_W: None}
            next_W = self._strategy.next_limit(known, limit_W)
        if next_W is None:
            self._decide(trainer)
        elif next_W == limit_W:  # the same limit again (a near-tie): no change, so no warm-up
            self._start_window(limit_W)
        else:
            self._begin_limit(trainer, next_W)

    def _bounding_steps(self) -> set[int]:
        """The steps whose start marks bound the open window and the finished one not yet merged."""
        steps = {self._window_first} if self._window_first is not None else set()
        if self._pending is not None:
            steps.update(self._pending[1:])
        return steps

    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        """Keep the start mark of a step that bounds a window (the figures arrive a few steps late)."""
        if figures.step in self._bounding_steps():
            self._starts[figures.step] = figures.start

    def _window_marks(self, trainer: Trainer, first: int, after_last: int) -> tuple[Mark, Mark] | None:
        """The start marks of steps ``first`` and ``after_last``: from their figures, or, when these have not
        arrived yet, after a bounded wait for the samples to reach the start of the step beginning now."""
        if first not in self._starts or after_last not in self._starts:
            now = self.timeline.open_step_start
            if now is not None:
                self.attachment.meter.wait(now)  # every step before this one is measured now ...
                self.timeline.flush(trainer)  # ... and delivered to on_step_measured
                if after_last == self._step_begun:
                    self._starts.setdefault(after_last, now)  # the mark this step's figures will carry
        start, end = self._starts.get(first), self._starts.get(after_last)
        return (start, end) if start is not None and end is not None and start.resolved and end.resolved else None

    def _merge_pending(self, trainer: Trainer) -> None:
        """Turn the last finished window into a profile: energy summed over ranks, time of the slowest.

        A collective: every rank calls it at the same transition. A window some rank cannot measure (its
        steps' figures never came: the fit stopped inside its last step) is dropped on every rank.
        """
        if self._pending is None:
            return
        limit_W, first, after_last = self._pending
        marks = self._window_marks(trainer, first, after_last)  # still pending: a flush there delivers its steps
        self._pending = None
        keep = self._bounding_steps()
        self._starts = {step: mark for step, mark in self._starts.items() if step in keep}
        local = None
        if self._own_clock:  # the simulated card's own figures: independent of the host's timing
            start, end = self._readings.pop(first, None), self._readings.get(after_last)
            if start is not None and end is not None:
                local = (end[0] - start[0], end[1] - start[1])
        elif marks is not None:
            m = measure(*marks)
            local = (sum(m.energy_J.get(name, 0.0) for name in self._device_sensors), m.duration_s)
        rows = distributed.gather(trainer, local)
        if any(row is None for row in rows):
            rank_zero_warn(f"PowerLimitOptimizer: the window of {limit_W} W could not be measured; it is dropped")
            if limit_W in self.limits_profiled:
                self.limits_profiled.remove(limit_W)
            return
        window = LimitProfile(limit_W, sum(r[0] for r in rows), max(r[1] for r in rows), self.profile_steps)
        known = self.profiles.get(limit_W)
        self.profiles[limit_W] = known.merged(window) if known is not None else window

    def _read_own_clock(self, step: int) -> None:
        """A simulated card on its own clock: its (energy J, time s) at the start of a window's bounding step
        (before that step's work: the callback's ``on_train_batch_start`` runs first)."""
        if self._own_clock:
            self._readings[step] = self._gpu.simulated_reading()

    def _ordered_profiles(self) -> list[LimitProfile]:
        return sorted(self.profiles.values(), key=lambda p: p.limit_W, reverse=True)  # Zeus's profiling order

    def _decide(self, trainer: Trainer) -> None:
        Ready, Warmup, Profiling, Done = _zeus_states()
        self._merge_pending(trainer)
        choice = self._strategy.choose(self.profiles) if trainer.is_global_zero else None
        self.chosen_limit_W = int(trainer.strategy.broadcast(choice, src=0))
        self._state = Done(optimal_power_limit=self.chosen_limit_W * MW_PER_W)
        self._set_limit(trainer, self.chosen_limit_W)
        log_info(f"PowerLimitOptimizer: {self.selector} picks {self.chosen_limit_W} W after profiling "
                       f"{len(self.profiles)} of {len(self._grid)} limits ({self.search} search)")
        if trainer.is_global_zero:
            self._write_results(trainer)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any, batch_idx: int) -> None:
        if not is_accumulating(trainer) and should_log_step(trainer):
            self._log(trainer, {"power_limit/current_W": float(self._current_W)})

    # ---------------------------------------------------------------- interruptions
    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._interrupt(trainer, "the end of a training epoch")

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and self._state is not None:
            self._interrupt(trainer, "a validation run")

    def _interrupt(self, trainer: Trainer, reason: str) -> None:
        """As Zeus on an epoch end: drop the window, profile that limit again from the next step."""
        Ready, Warmup, Profiling, Done = _zeus_states()
        state = self._state
        if not isinstance(state, (Warmup, Profiling)):
            return
        limit_W = state.current_power_limit // MW_PER_W
        log_info(f"PowerLimitOptimizer: {type(state).__name__.lower()} of {limit_W} W interrupted by {reason}; "
                       "it is profiled again")
        self._window_first = None
        keep = self._bounding_steps()
        self._starts = {step: mark for step, mark in self._starts.items() if step in keep}
        self.retried_windows += 1
        self._state = Ready(next_power_limit=limit_W * MW_PER_W, steps=1)
        if not self.dry_run:
            self._set_limit(trainer, self._max_W)

    # ---------------------------------------------------------------- end of fit
    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        Ready, Warmup, Profiling, Done = _zeus_states()
        if not isinstance(self._state, Done):
            self._merge_pending(trainer)
            rank_zero_warn(f"PowerLimitOptimizer: training ended before profiling finished ({len(self.profiles)} of "
                           f"{len(self._grid)} limits profiled); no limit was chosen. Train longer or lower "
                           "`profile_steps`/`warmup_steps`.")
        self._restore()

    def _write_results(self, trainer: Trainer) -> None:
        ordered = self._ordered_profiles()
        costs = self._objective.costs(ordered)
        metrics = {"power_limit/chosen_W": float(self.chosen_limit_W),
                   "power_limit/retried_windows": float(self.retried_windows)}
        for p in ordered:
            metrics[f"power_limit/{p.limit_W}W/energy_per_step_J"] = p.energy_per_step_J
            metrics[f"power_limit/{p.limit_W}W/time_per_step_s"] = p.time_per_step_s
            metrics[f"power_limit/{p.limit_W}W/cost"] = costs[p.limit_W]
        self._log(trainer, metrics)
        document = profile_document(
            ordered, self._objective, self.chosen_limit_W, gpu_name=self._gpu_name,
            limit_constraints_W=[self._min_W, self._max_W], default_limit_W=self._default_W,
            pl_step_W=self.pl_step_W, search=self.search, wait_steps=self.wait_steps,
            warmup_steps=self.warmup_steps, profile_steps=self.profile_steps, retried_windows=self.retried_windows,
            loaded_from=str(self.profile_path) if self._loaded_profile else None,
            simulated=self._simulated, energy_source=("simulated GPU (the card's own clock)" if self._own_clock else
                                                      "simulated GPU" if self._simulated else "measured"),
        )
        self.profile_file = write_profile(self._log_dir / PROFILE_FILE, document)
        if self.profile_path is not None and not self.profile_path.exists():
            write_profile(self.profile_path, document)
        if self.log_figure:
            self._write_figure(trainer, ordered)

    def _write_figure(self, trainer: Trainer, ordered: list[LimitProfile]) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        figure = profile_figure(ordered, self._objective, self.chosen_limit_W, self._gpu_name, self._simulated)
        self.figure_file = write_figure_png(figure, self._log_dir / FIGURE_FILE)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("power_limit/profile", figure, global_step=trainer.global_step, close=False)

    def _log(self, trainer: Trainer, metrics: dict) -> None:
        self.log_metrics(trainer, metrics, batches_that_stepped(trainer))

    # ---------------------------------------------------------------- dry run
    def _finish_dry_run(self, trainer: Trainer) -> None:
        Ready, Warmup, Profiling, Done = _zeus_states()
        self._merge_pending(trainer)
        here = self.profiles.pop(self._start_W)
        self._state = Done(optimal_power_limit=self._start_W * MW_PER_W)
        plan = self._strategy.plan()
        per_limit = self.warmup_steps + self.profile_steps
        steps = {"min": self.wait_steps + plan["min_limits"] * per_limit + plan["calibration_windows"] * self.profile_steps,
                 "max": self.wait_steps + (plan["max_limits"] + plan["repeat_budget"] + plan["confirmation_windows"])
                 * per_limit}
        total = trainer.estimated_stepping_batches
        problem = gpu_control.permission_problem(self._gpu)
        self.dry_run_report = {
            "dry_run": True,
            "gpu_name": self._gpu_name,
            "limit_constraints_W": [self._min_W, self._max_W],
            "default_limit_W": self._default_W,
            "current_limit_W": self._start_W,
            "can_set_limits": problem is None,
            "permission_problem": problem,
            "selector": self._objective.describe(),
            **plan,
            "candidate_limits_W": list(self._grid),
            "steps_per_limit": per_limit,
            "profiling_steps": steps,
            "measured_at_current_limit": {"energy_per_step_J": here.energy_per_step_J,
                                          "time_per_step_s": here.time_per_step_s},
            "expected_profiling_time_s": {k: v * here.time_per_step_s for k, v in steps.items()},
            "expected_profiling_energy_J": {k: v * here.energy_per_step_J for k, v in steps.items()},
            "share_of_training": ({k: v / total for k, v in steps.items()}
                                  if isinstance(total, (int, float)) and math.isfinite(total) and total > 0 else None),
            "note": "time and energy are extrapolated from the current limit: lower limits draw less power per "
                    "step but run slower",
        }
        if trainer.is_global_zero:
            self.profile_file = atomic_write_json(self._log_dir / DRY_RUN_FILE, self.dry_run_report)
            log_info(
                f"PowerLimitOptimizer dry run: would profile {plan['min_limits']}-{plan['max_limits']} of "
                f"{len(self._grid)} limits {self._grid} W ({self.search} search), {steps['min']}-{steps['max']} steps, "
                f"about {self.dry_run_report['expected_profiling_time_s']['max']:.1f} s and "
                f"{self.dry_run_report['expected_profiling_energy_J']['max']:.0f} J at most; "
                f"{'the card allows it' if problem is None else 'but: ' + problem}. Report: {self.profile_file}"
            )

    # ---------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        if self._state is None:
            return dict(self._resume or {})
        Ready, Warmup, Profiling, Done = _zeus_states()
        state = self._state
        if isinstance(state, (Warmup, Profiling)):  # an unfinished window is profiled again after a resume
            state = Ready(next_power_limit=state.current_power_limit, steps=1)
        pending = [self._pending[0]] if self._pending is not None else []
        return {
            "state": {"type": type(state).__name__, **state.dict()},
            "profiles": [p.to_json() for p in self._ordered_profiles()],
            "unmeasured_W": pending,
            "chosen_limit_W": self.chosen_limit_W,
            "retried_windows": self.retried_windows,
            "grid_W": list(self._grid),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict)
        if self.attachment is not None:  # already set up (Lightning restores callbacks after setup)
            self._apply_resume(self._resume)

    def _apply_resume(self, saved: dict) -> None:
        Ready, Warmup, Profiling, Done = _zeus_states()
        if not saved or "state" not in saved:
            return
        if saved.get("grid_W") != list(self._grid):
            rank_zero_warn("PowerLimitOptimizer: the checkpoint was profiled over other limits "
                           f"({saved.get('grid_W')} W); profiling starts again")
            return
        classes = {"Ready": Ready, "Warmup": Warmup, "Profiling": Profiling, "Done": Done}
        fields = dict(saved["state"])
        kind = fields.pop("type")
        self.profiles = {int(row["power_limit"]): LimitProfile(
            int(row["power_limit"]), float(row["energy"]), float(row["time"]), int(row["steps"]),
            tuple(tuple(w) for w in row.get("windows", ())) if len(row.get("windows", ())) > 1 else ())
            for row in saved.get("profiles", [])}
        self.chosen_limit_W = saved.get("chosen_limit_W")
        self.retried_windows = int(saved.get("retried_windows", 0))
        state = classes[kind](**fields)
        if isinstance(state, Ready) and saved.get("unmeasured_W"):
            # the window that ended just before the checkpoint had no figures yet: profile it again first
            state = Ready(next_power_limit=saved["unmeasured_W"][0] * MW_PER_W, steps=1)
        self._state = state
        self._resume = None
