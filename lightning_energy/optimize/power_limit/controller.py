"""The power-limit optimiser's state machine, written out once, without Lightning (as Zeus's
``GlobalPowerLimitOptimizer`` with its ``Ready``, ``Warmup``, ``Profiling`` and ``Done`` states).

:class:`PowerLimitController` is told where each training step begins (:meth:`~PowerLimitController.step_begins`),
when a window is interrupted (:meth:`~PowerLimitController.interrupt`) and when the fit ends; every transition
happens in it and each writes ONE line, an INFO record of this module's logger on rank 0 only::

    power limit: ready; after 1 step(s) 300 W is profiled first (adaptive search over 7 limits, 300-150 W)
    power limit: warmup at 250 W, steps 12-21
    power limit: profiling 250 W, steps 22-61
    power limit: profiling 250 W again, steps 62-101 (a repeated window: no warm-up)
    power limit: profiling at 250 W interrupted by a validation run; 250 W is profiled again
    power limit: zeus_cost picks 225 W after profiling 5 of 7 limits in 7 windows (adaptive search); training
    goes on at 225 W from step 430

A step is numbered by the optimizer steps done before it (0-based: the Trainer's ``global_step`` at its start
with one optimizer). What touches the world goes through a :class:`Port` (the front end's glue): setting the
card's limit, keeping what measures a window's bounds, measuring a window, and the collectives of a multi-rank
run (every rank runs the same transitions; rank 0 decides and broadcasts, so every rank applies the same limit).
Which limit comes next and which one is chosen is the search's (``lightning_energy.optimize.power_limit.search``).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from lightning_energy.optimize.power_limit.profile_file import profile_document
from lightning_energy.optimize.power_limit.search import (
    DEFAULT_MAX_REPEATS,
    DEFAULT_NOISE,
    DEFAULT_REPEAT_BUDGET,
    DEFAULT_SETTLE_BUDGET,
    DEFAULT_TOLERANCE,
    SEARCHES,
    SELECTORS,
    LimitProfile,
    Objective,
    limit_grid,
    make_search,
)
from lightning_energy.units import MW_PER_W

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PowerLimitSettings:
    """What the optimiser does, checked at construction (``ValueError``/``TypeError`` naming the setting).

    selector, eta_knob, max_slowdown_factor, max_power_scope: what is minimised
    (:class:`~lightning_energy.optimize.power_limit.search.Objective`). search, tolerance, noise, max_repeats,
    repeat_budget, settle_budget: how limits are chosen for profiling (``make_search``). wait_steps,
    warmup_steps, profile_steps: optimizer steps before anything, per limit before measuring and measured.
    pl_step_W: spacing of the candidate limits (W). dry_run: profile the limit in force only, never set one.
    """

    selector: str = "zeus_cost"
    eta_knob: float = 0.5
    max_slowdown_factor: float = 1.1
    search: str = "exhaustive"
    wait_steps: int = 1
    warmup_steps: int = 10
    profile_steps: int = 40
    pl_step_W: int = 25
    tolerance: float = DEFAULT_TOLERANCE
    noise: float = DEFAULT_NOISE
    max_repeats: int = DEFAULT_MAX_REPEATS
    repeat_budget: int = DEFAULT_REPEAT_BUDGET
    settle_budget: int = DEFAULT_SETTLE_BUDGET
    max_power_scope: str = "job"
    dry_run: bool = False

    def __post_init__(self) -> None:
        if self.selector not in SELECTORS:
            raise ValueError(f"`selector` must be one of {SELECTORS}, got {self.selector!r}")
        if self.search not in SEARCHES:
            raise ValueError(f"`search` must be one of {SEARCHES}, got {self.search!r}")
        for name, low in (("wait_steps", 0), ("warmup_steps", 0), ("profile_steps", 1), ("pl_step_W", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")
        self.objective()  # validates eta_knob, max_slowdown_factor and max_power_scope
        make_search("adaptive", [1], Objective(), self.tolerance, self.noise, self.max_repeats, self.repeat_budget,
                    self.settle_budget)  # validates tolerance, noise, max_repeats and the budgets
        if not isinstance(self.dry_run, bool):
            raise TypeError(f"`dry_run` must be a bool, got {type(self.dry_run).__name__}")
        for name in ("eta_knob", "max_slowdown_factor", "tolerance", "noise"):
            object.__setattr__(self, name, float(getattr(self, name)))

    def objective(self, world_size: int = 1) -> Objective:
        return Objective(self.selector, self.eta_knob, self.max_slowdown_factor, world_size, self.max_power_scope)

    def make_search(self, grid: list[int], objective: Objective):
        return make_search(self.search, grid, objective, self.tolerance, self.noise, self.max_repeats,
                           self.repeat_budget, self.settle_budget,
                           warmup_share=self.warmup_steps / self.profile_steps)


@dataclass(frozen=True)
class Card:
    """The card's facts at the start of the fit: its name and limits (W) and the limit in force then."""

    name: str
    min_W: int
    max_W: int
    default_W: int
    start_W: int


# ------------------------------------------------------------------------------------ the states (Zeus's, in mW)
def _positive(state) -> None:
    for name, value in asdict(state).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(state).__name__}.{name} must be an integer >= 1, got {value!r}")


@dataclass
class Ready:
    """Waiting ``steps`` step beginnings before ``next_power_limit`` (mW) is set: the initial state (after
    ``wait_steps`` steps), and after an interrupted window (the next step). -> ``Warmup`` (or ``Profiling``
    without warm-up steps)."""

    next_power_limit: int
    steps: int

    __post_init__ = _positive


@dataclass
class Warmup:
    """Running ``steps`` steps at ``current_power_limit`` (mW) before measuring. -> ``Profiling``; an epoch end or
    a validation run -> ``Ready`` (the same limit again)."""

    current_power_limit: int
    steps: int

    __post_init__ = _positive


@dataclass
class Profiling:
    """Measuring ``steps`` steps at ``current_power_limit`` (mW). -> ``Warmup`` at the next limit, ``Profiling``
    (the same limit again, no warm-up) or ``Done``; an epoch end or a validation run -> ``Ready``."""

    current_power_limit: int
    steps: int

    __post_init__ = _positive


@dataclass
class Done:
    """Training at ``optimal_power_limit`` (mW) (in a dry run: the limit in force, never changed). Final."""

    optimal_power_limit: int

    __post_init__ = _positive


STATES = {cls.__name__: cls for cls in (Ready, Warmup, Profiling, Done)}


def _steps(first: int, count: int) -> str:
    return f"step {first}" if count == 1 else f"steps {first}-{first + count - 1}"


class Port(Protocol):
    """What the controller asks of the front end (every rank calls these at the same transitions)."""

    def set_limit(self, limit_W: int) -> None:
        """Put this rank's card at ``limit_W``."""

    def window_boundary(self, step: int) -> None:
        """A window starts or ends where step ``step`` begins: keep what measuring it will need."""

    def measure(self, first_step: int, after_last_step: int) -> tuple[float, float] | None:
        """This rank's (energy J, time s) from the start of ``first_step`` to the start of ``after_last_step``;
        None where it cannot be measured."""

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank (collective)."""

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (collective)."""


class PowerLimitController:
    """The state machine over one fit: which limit is in force at each step, which window is measured, and the
    choice. ``profiles`` (by limit, W), ``limits_profiled`` (each finished window's limit, in order),
    ``retried_windows`` and ``chosen_limit_W`` (W; None until chosen) are its results."""

    def __init__(self, settings: PowerLimitSettings, card: Card, port: Port, world_size: int = 1,
                 rank: int = 0) -> None:
        self.settings, self.card, self.rank = settings, card, rank
        self._port = port
        self.grid = limit_grid(card.min_W, card.max_W, settings.pl_step_W)
        self.objective = settings.objective(world_size)
        self.search = settings.make_search(self.grid, self.objective)
        self.state: Ready | Warmup | Profiling | Done | None = None
        self.profiles: dict[int, LimitProfile] = {}
        self.limits_profiled: list[int] = []
        self.retried_windows = 0
        self.chosen_limit_W: int | None = None
        self.loaded_from: str | None = None  # the profile file the choice was read from
        self.dry_run_measurement: LimitProfile | None = None  # a dry run's window at the limit in force
        self._step: int | None = None  # the step whose first batch began last
        self._window_first: int | None = None  # the open window's first step
        self._pending: tuple[int, int, int] | None = None  # the last finished window: limit, first, after last

    def _say(self, message: str) -> None:
        if self.rank == 0:
            log.info("power limit: " + message, stacklevel=2)  # the record names the transition

    @property
    def done(self) -> bool:
        return isinstance(self.state, Done)

    @property
    def step(self) -> int | None:
        """The step that began last (the optimizer steps done before it)."""
        return self._step

    def bounding_steps(self) -> set[int]:
        """The steps whose start marks bound the open window and the finished one not yet measured."""
        steps = {self._window_first} if self._window_first is not None else set()
        if self._pending is not None:
            steps.update(self._pending[1:])
        return steps

    # ------------------------------------------------------------------------------- initial states
    def start(self) -> None:
        """``Ready``: after ``wait_steps`` steps, the first limit (a dry run: the limit in force)."""
        s = self.settings
        first = self.card.start_W if s.dry_run else self.search.next_limit({})
        self.state = Ready(next_power_limit=first * MW_PER_W, steps=s.wait_steps + 1)
        what = (f"the limit in force, {first} W, is profiled (a dry run: the card is never changed)" if s.dry_run
                else f"{first} W is profiled first ({s.search} search over {len(self.grid)} limits, "
                     f"{self.grid[0]}-{self.grid[-1]} W)")
        self._say(f"ready; after {s.wait_steps} step(s) {what}")

    def load(self, profiles: list[LimitProfile], source: str) -> None:
        """``Done`` at once: the choice from a profile file's ``profiles`` (``ValueError`` for limits outside
        the card's range)."""
        outside = [p.limit_W for p in profiles if not self.card.min_W <= p.limit_W <= self.card.max_W]
        if outside:
            raise ValueError(f"power-limit profile {source} holds limits {outside} W outside this GPU's range "
                             f"[{self.card.min_W}, {self.card.max_W}] W; delete it or point `profile_path` elsewhere")
        self.profiles = {p.limit_W: p for p in profiles}
        self.chosen_limit_W = self.search.choose(self.profiles)
        self.loaded_from = source
        self.state = Done(optimal_power_limit=self.chosen_limit_W * MW_PER_W)
        self._say(f"profile loaded from {source}; {self.settings.selector} picks {self.chosen_limit_W} W")

    def begin_training(self) -> None:
        """As Zeus, the maximum before profiling starts (the choice when already made); a dry run sets nothing."""
        if not self.settings.dry_run:
            self._port.set_limit(self.chosen_limit_W if self.done else self.card.max_W)

    # ------------------------------------------------------------------------------- the transitions
    def step_begins(self, step: int) -> Done | None:
        """Zeus's ``on_step_begin``: once per optimizer step (later calls with the same ``step`` are its other
        micro-batches). Returns the ``Done`` state when this step made the choice (or ended a dry run)."""
        if step == self._step:
            return None
        self._step = step
        state = self.state
        if isinstance(state, Done):
            return None
        state.steps -= 1
        if state.steps > 0:
            return None
        if isinstance(state, Ready):
            self._warm_up(state.next_power_limit // MW_PER_W)
        elif isinstance(state, Warmup):
            self._profile(state.current_power_limit // MW_PER_W)
        else:
            self._end_window(state.current_power_limit // MW_PER_W)
        return self.state if self.done else None

    def _warm_up(self, limit_W: int) -> None:
        """-> ``Warmup`` at ``limit_W`` (straight to ``Profiling`` without warm-up steps)."""
        if not self.settings.dry_run:
            self._port.set_limit(limit_W)
        warmup = self.settings.warmup_steps
        if warmup == 0:
            self._profile(limit_W)
            return
        self.state = Warmup(current_power_limit=limit_W * MW_PER_W, steps=warmup)
        self._say(f"warmup at {limit_W} W, {_steps(self._step, warmup)}")

    def _profile(self, limit_W: int, again: bool = False) -> None:
        """-> ``Profiling`` at ``limit_W``: the window starts where this step starts."""
        profile = self.settings.profile_steps
        self.state = Profiling(current_power_limit=limit_W * MW_PER_W, steps=profile)
        self._window_first = self._step
        self._port.window_boundary(self._step)
        self._say(f"profiling {limit_W} W{' again' if again else ''}, {_steps(self._step, profile)}"
                  + (" (a repeated window: no warm-up)" if again else ""))

    def _end_window(self, limit_W: int) -> None:
        """The window ends where this step starts: -> the next limit's ``Warmup``, ``Profiling`` again, or ``Done``."""
        self._merge_pending()  # the previous window: its figures arrived long ago
        self._pending = (limit_W, self._window_first, self._step)
        self._port.window_boundary(self._step)
        self._window_first = None
        self.limits_profiled.append(limit_W)
        if self.settings.dry_run:
            self._merge_pending()
            self.dry_run_measurement = self.profiles.pop(self.card.start_W)
            self.state = Done(optimal_power_limit=self.card.start_W * MW_PER_W)  # told by dry_run_report's line
            return
        if self.search.needs_measurements:
            self._merge_pending()  # a decision point: this window's figures are needed now
            proposal = self.search.next_limit(self.profiles, limit_W) if self.rank == 0 else None
            next_W = self._port.broadcast(proposal)
        else:
            next_W = self.search.next_limit({**self.profiles, limit_W: None}, limit_W)
        if next_W is None:
            self._decide()
        elif next_W == limit_W:  # the same limit again (a near-tie): no change, so no warm-up
            self._profile(limit_W, again=True)
        else:
            self._warm_up(next_W)

    def _decide(self) -> None:
        """-> ``Done``: rank 0's choice (the search's selector over the profiled limits), on every rank."""
        self._merge_pending()
        choice = self.search.choose(self.profiles) if self.rank == 0 else None
        self.chosen_limit_W = int(self._port.broadcast(choice))
        self.state = Done(optimal_power_limit=self.chosen_limit_W * MW_PER_W)
        self._port.set_limit(self.chosen_limit_W)
        windows = sum(p.window_count for p in self.profiles.values())
        self._say(f"{self.settings.selector} picks {self.chosen_limit_W} W after profiling {len(self.profiles)} of "
                  f"{len(self.grid)} limits in {windows} windows ({self.settings.search} search); training goes on "
                  f"at {self.chosen_limit_W} W from step {self._step}")

    def interrupt(self, reason: str) -> None:
        """As Zeus on an epoch end: a warm-up or window cut by ``reason`` is dropped -> ``Ready`` (that limit
        again from the next step, at the maximum meanwhile)."""
        state = self.state
        if not isinstance(state, (Warmup, Profiling)):
            return
        limit_W = state.current_power_limit // MW_PER_W
        self._window_first = None
        self.retried_windows += 1
        self.state = Ready(next_power_limit=limit_W * MW_PER_W, steps=1)
        if not self.settings.dry_run:
            self._port.set_limit(self.card.max_W)
        self._say(f"{type(state).__name__.lower()} at {limit_W} W interrupted by {reason}; "
                  f"{limit_W} W is profiled again")

    def end_of_fit(self) -> bool:
        """The fit ends: the last finished window is measured. True when the choice was made."""
        if not self.done:
            self._merge_pending()
        return self.done

    # ------------------------------------------------------------------------------- measurements
    def _merge_pending(self) -> None:
        """Turn the last finished window into a profile: energy summed over ranks, time of the slowest.

        A collective: every rank calls it at the same transition. A window some rank cannot measure (its
        steps' figures never came: the fit stopped inside its last step) is dropped on every rank.
        """
        if self._pending is None:
            return
        limit_W, first, after_last = self._pending
        local = self._port.measure(first, after_last)  # while pending: the glue may still collect its bounds
        self._pending = None
        rows = self._port.gather(local)
        if any(row is None for row in rows):
            if self.rank == 0:
                warnings.warn(f"power limit: the window of {limit_W} W could not be measured; it is dropped",
                              UserWarning, stacklevel=2)
            if limit_W in self.limits_profiled:
                self.limits_profiled.remove(limit_W)
            return
        window = LimitProfile(limit_W, sum(r[0] for r in rows), max(r[1] for r in rows),
                              self.settings.profile_steps)
        known = self.profiles.get(limit_W)
        self.profiles[limit_W] = known.merged(window) if known is not None else window

    def ordered_profiles(self) -> list[LimitProfile]:
        return sorted(self.profiles.values(), key=lambda p: p.limit_W, reverse=True)  # Zeus's profiling order

    # ------------------------------------------------------------------------------- results
    def metrics(self) -> dict[str, float]:
        """The choice as metrics: ``power_limit/chosen_W``, ``power_limit/retried_windows`` and, for each profiled
        limit ``L``, ``power_limit/<L>W/energy_per_step_J``, ``.../time_per_step_s`` and ``.../cost``."""
        ordered = self.ordered_profiles()
        costs = self.objective.costs(ordered)
        metrics = {"power_limit/chosen_W": float(self.chosen_limit_W),
                   "power_limit/retried_windows": float(self.retried_windows)}
        for p in ordered:
            metrics[f"power_limit/{p.limit_W}W/energy_per_step_J"] = p.energy_per_step_J
            metrics[f"power_limit/{p.limit_W}W/time_per_step_s"] = p.time_per_step_s
            metrics[f"power_limit/{p.limit_W}W/cost"] = costs[p.limit_W]
        return metrics

    def document(self, **meta) -> dict:
        """The profile file's document (``profile_file.profile_document``): the profiles, the choice, how they
        were made, and ``meta`` (``simulated``, ``energy_source``)."""
        s, card = self.settings, self.card
        return profile_document(
            self.ordered_profiles(), self.objective, self.chosen_limit_W, gpu_name=card.name,
            limit_constraints_W=[card.min_W, card.max_W], default_limit_W=card.default_W, pl_step_W=s.pl_step_W,
            search=s.search, wait_steps=s.wait_steps, warmup_steps=s.warmup_steps, profile_steps=s.profile_steps,
            retried_windows=self.retried_windows, loaded_from=self.loaded_from, **meta)

    # ------------------------------------------------------------------------------- a dry run's report
    def dry_run_report(self, permission_problem: str | None, planned_steps: float | None,
                       report_path: Any = None) -> dict:
        """What a full run would profile, extrapolated from the dry run's window; logs its one line."""
        s, card, here = self.settings, self.card, self.dry_run_measurement
        plan = self.search.plan()
        per_limit = s.warmup_steps + s.profile_steps
        steps = {"min": s.wait_steps + plan["min_limits"] * per_limit + plan["calibration_windows"] * s.profile_steps,
                 "max": s.wait_steps + (plan["max_limits"] + plan["repeat_budget"] + plan["confirmation_windows"])
                 * per_limit}
        known = isinstance(planned_steps, (int, float)) and math.isfinite(planned_steps) and planned_steps > 0
        report = {
            "dry_run": True,
            "gpu_name": card.name,
            "limit_constraints_W": [card.min_W, card.max_W],
            "default_limit_W": card.default_W,
            "current_limit_W": card.start_W,
            "can_set_limits": permission_problem is None,
            "permission_problem": permission_problem,
            "selector": self.objective.describe(),
            **plan,
            "candidate_limits_W": list(self.grid),
            "steps_per_limit": per_limit,
            "profiling_steps": steps,
            "measured_at_current_limit": {"energy_per_step_J": here.energy_per_step_J,
                                          "time_per_step_s": here.time_per_step_s},
            "expected_profiling_time_s": {k: v * here.time_per_step_s for k, v in steps.items()},
            "expected_profiling_energy_J": {k: v * here.energy_per_step_J for k, v in steps.items()},
            "share_of_training": {k: v / planned_steps for k, v in steps.items()} if known else None,
            "note": "time and energy are extrapolated from the current limit: lower limits draw less power per "
                    "step but run slower",
        }
        self._say(
            f"dry run: would profile {plan['min_limits']}-{plan['max_limits']} of {len(self.grid)} limits "
            f"{self.grid} W ({s.search} search), {steps['min']}-{steps['max']} steps, about "
            f"{report['expected_profiling_time_s']['max']:.1f} s and {report['expected_profiling_energy_J']['max']:.0f}"
            f" J at most; {'the card allows it' if permission_problem is None else 'but: ' + permission_problem}"
            + (f". Report: {report_path}" if report_path is not None else ""))
        return report

    # ------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's part: an unfinished warm-up or window is profiled again after a resume."""
        state = self.state
        if isinstance(state, (Warmup, Profiling)):
            state = Ready(next_power_limit=state.current_power_limit, steps=1)
        return {
            "state": {"type": type(state).__name__, **asdict(state)},
            "profiles": [p.to_json() for p in self.ordered_profiles()],
            "unmeasured_W": [self._pending[0]] if self._pending is not None else [],
            "chosen_limit_W": self.chosen_limit_W,
            "retried_windows": self.retried_windows,
            "grid_W": list(self.grid),
        }

    def restore(self, saved: dict) -> None:
        """Go on from a checkpoint's :meth:`state_dict` (a warning, and a fresh start, when it was profiled over
        other limits)."""
        if not saved or "state" not in saved:
            return
        if saved.get("grid_W") != list(self.grid):
            if self.rank == 0:
                warnings.warn("power limit: the checkpoint was profiled over other limits "
                              f"({saved.get('grid_W')} W); profiling starts again", UserWarning, stacklevel=2)
            return
        fields = dict(saved["state"])
        kind = fields.pop("type")
        self.profiles = {int(row["power_limit"]): LimitProfile(
            int(row["power_limit"]), float(row["energy"]), float(row["time"]), int(row["steps"]),
            tuple(tuple(w) for w in row.get("windows", ())) if len(row.get("windows", ())) > 1 else ())
            for row in saved.get("profiles", [])}
        self.chosen_limit_W = saved.get("chosen_limit_W")
        self.retried_windows = int(saved.get("retried_windows", 0))
        state = STATES[kind](**fields)
        if isinstance(state, Ready) and saved.get("unmeasured_W"):
            # the window that ended just before the checkpoint had no figures yet: profile it again first
            state = Ready(next_power_limit=saved["unmeasured_W"][0] * MW_PER_W, steps=1)
        self.state = state
        if isinstance(state, Done):
            self._say(f"resumed from a checkpoint: {state.optimal_power_limit // MW_PER_W} W was chosen")
        else:
            limit_mW = state.next_power_limit if isinstance(state, Ready) else state.current_power_limit
            self._say(f"resumed from a checkpoint: {len(self.profiles)} of {len(self.grid)} limits profiled, "
                      f"{limit_mW // MW_PER_W} W next")
