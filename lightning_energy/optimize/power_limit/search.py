"""Power-limit profiling without Lightning: candidate limits, selectors, search strategies (the profile file:
:mod:`lightning_energy.optimize.power_limit.profile_file`).

Selection is Zeus's: the final choice is made by ``zeus.optimizer.power_limit``'s selectors (``Energy``,
``Time``, ``ZeusCost`` with eta, ``MaxSlowdownConstraint``) over ``PowerLimitMeasurement`` objects of
*profiled* limits only (a limit is never chosen without a measured window at it), and the profile file
keeps Zeus's ``{"measurements": [{"power_limit", "energy", "time"}]}`` layout (extra keys of ours beside
them), so Zeus's ``GlobalPowerLimitOptimizer(profile_path=...)`` can read our files and we read its files.

Search: Zeus profiles every limit from the maximum down in ``pl_step`` watts (:class:`ExhaustiveSweep`).
:class:`AdaptiveSearch` profiles fewer, without assuming a shape for the curves (no quadratic model:
real curves have flat parts, knees, cliffs at a clock floor, plateaus of clock bins and voltage-floor
kinks). It rests on two physical facts of DVFS power capping, checked on every profile: a step never
gets faster at a lower limit (time per step non-increasing in the limit) and the card never draws more
at a lower limit (mean power per step non-decreasing). Between two profiled limits ``lo < hi`` every
limit then costs at least ``P(lo) * T(hi)`` J per step, ``T(hi)`` s, and so on for each selector: a gap
whose bound cannot beat the best profiled cost by more than ``tolerance`` is never profiled (branch and
bound). Measurements carry run-to-run noise: bounds and comparisons use a noise margin (the relative
spread of one window, from repeated windows pooled with the ``noise`` prior; none on the best profile's own
measurement where a bound shares it), and a pick within noise of another is settled by repeating windows
(at most ``max_repeats`` more per limit): from the exploration budget first, then from a separate settle
budget; a tie that repeated windows show to be exact (no noise at all) is not settled; a pick resting on one
window gets a second. Windows are ranked by possible gain per step, so a repeat of the limit just profiled (no
warm-up) goes first. A monotonic fact is trusted only where a profile could have refuted it: a grid neighbour
of the best profiled limit not yet profiled gets a window before the pick (all selectors but max slowdown), and for ``time`` a gap beside the
fastest profile is bisected rather than bounded away (a thermal top slower than the limits below it shows only
there). The sweep's profiling (every limit once, each after a limit change) is a hard cap: a window that would
pass it is not profiled and the choice is made from what is measured; once the windows still worth profiling
would not all fit, those beside the best profiled limit go first. When profiles break either fact beyond noise
the search falls back to Zeus's exhaustive sweep within the same cap (the calibration window may leave one
limit out: the limits beside the cheapest profiled ones go first).

Grid size: on a grid of fewer than :data:`SMALL_GRID_LIMITS` (9) limits the cap is barely every limit once.
There energy, ZeusCost and max slowdown profile every limit once in Zeus's order (the equal-budget rule: the
sweep's own windows, the choice Zeus's selector over them). Time keeps its bounds but profiles the maximum once
(no calibration window) and takes a never-profiled limit before any repeat. From 9 limits on the maximum is
profiled twice first (the noise calibration) and every rule above applies.

DDP: energy is summed over ranks and time is the slowest rank's. ZeusCost's ``MaxPower`` is the highest
limit times ``world_size`` by default (``max_power_scope="job"``: the job's power budget beside the job's
energy, so N identical ranks pick what one rank alone picks); Zeus's own DDP recipe
(``GlobalPowerLimitOptimizer`` with one GPU per process's ``ZeusMonitor``) ends up with a ``ZeusCost``
of ``world_size=1`` beside energy summed over every GPU (``max_power_scope="process"``), which weighs time
``world_size`` times less and picks lower limits as the job grows.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

SELECTORS = ("energy", "time", "zeus_cost", "max_slowdown")
SEARCHES = ("exhaustive", "adaptive")
MAX_POWER_SCOPES = ("job", "process")
DEFAULT_TOLERANCE = 0.02  # a pick is good within 2 % of the optimum (the benchmark's success criterion)
# Run-to-run spread (relative standard deviation) of one window assumed before repeated windows measure it:
# the measurements show 3-5 %; the estimate from repeats is pooled with this prior (weight PRIOR_DOF).
DEFAULT_NOISE = 0.03
PRIOR_DOF = 2.0
CONFIDENCE_Z = 1.5  # near-ties: a rival within this many standard deviations of the best is profiled again
GAP_Z = 1.0  # a gap's lower bound allows for this many standard deviations of noise in its ends
FALLBACK_Z = 3.0  # a profile breaks monotonic time or power only beyond this many standard deviations
DEFAULT_MAX_REPEATS = 3  # most extra windows of one limit
DEFAULT_REPEAT_BUDGET = 6  # most extra windows while exploring (the noise calibration and near-tie splits included)
# Most further windows that settle the final choice (repeats of near-ties, or of limits near the max-slowdown
# threshold) once the exploration budget is spent: the fallback to more profiling, never a worse pick.
DEFAULT_SETTLE_BUDGET = 2
# Warm-up steps per window after a limit change, as a share of the profile steps (Zeus's defaults: 10 / 40).
DEFAULT_WARMUP_SHARE = 0.25
EXACT_REL = 1e-9  # windows (and costs) agreeing to this relative precision are equal: float rounding only
MIN_SPARE_POINTS = 2  # a fit of p parameters is drawn with its R² only from p + 2 points on
# DVFS-model guidance (issue 30 item 2, :mod:`lightning_energy.optimize.power_limit.dvfs_model`): on grids of at
# least MODEL_MIN_LIMITS limits, once 4 limits are profiled, the model fitted to every profile picks the next windows
# (its optimum, then the pick's grid neighbours) while each profile lies within MODEL_FIT_Z standard deviations of it
# (time and power; + MODEL_SLACK for the model's own error) and each limit profiled on its prediction within
# MODEL_CHECK_Z; once either breaks, branch and bound goes on alone.
# Off: on benchmarks/power_limit_search.py it does not reach issue 30 item 2's 0.6 of the sweep's steps on 13-limit
# grids (the shapes it must abandon, cliffs, plateaus and host-bound steps, keep branch and bound's share there).
DEFAULT_MODEL_PRUNING = False
MODEL_MIN_LIMITS = 9
MODEL_FIT_Z = 2.5
MODEL_SLACK = 0.005
MODEL_CHECK_Z = 3.0  # a limit profiled on the model's prediction breaks it beyond this many standard deviations
MODEL_PREDICTION_VARIANCE = 0.5  # the fitted model's own prediction variance, in windows' variances
_UNGUIDED = object()  # the DVFS model does not guide this step: branch and bound does
# Small grids (fewer limits): the cap (the sweep's profiling) is barely every limit once, so there is no
# calibration window, energy and ZeusCost profile every limit once in Zeus's order (the equal-budget rule), and
# for time a limit never profiled goes before any repeat.
SMALL_GRID_LIMITS = 9
# A grid neighbour of the best profiled limit not yet profiled is worth a window with at least this possible gain
# (beyond the tolerance): the bounds beside the best rest on the best's own monotonic facts, which only a neighbour
# can refute.
NEIGHBOUR_GAIN = 1e-3


def _zeus_power_limit():
    with contextlib.redirect_stdout(io.StringIO()):  # zeus pulls amdsmi, which prints without ROCm
        import zeus.optimizer.power_limit as module
    return module


def limit_grid(min_W: int, max_W: int, step_W: int) -> list[int]:
    """Zeus's candidate limits: from ``max_W`` down to ``min_W`` in ``step_W`` watts (the order profiled)."""
    if step_W <= 0:
        raise ValueError(f"the limit step must be > 0 W, got {step_W}")
    if min_W > max_W:
        raise ValueError(f"minimum limit {min_W} W above maximum {max_W} W")
    return list(range(max_W, min_W - 1, -step_W))


@dataclass(frozen=True)
class LimitProfile:
    """One profiled limit: energy (J, summed over ranks) and time (s, slowest rank) of ``steps`` steps.

    ``windows``: the (energy J, time s, steps) of each window merged into it (one unless the limit was
    profiled again to settle a near-tie); empty means one window with the totals above.
    """

    limit_W: int
    energy_J: float
    time_s: float
    steps: int
    windows: tuple[tuple[float, float, int], ...] = field(default=(), compare=False)

    @property
    def energy_per_step_J(self) -> float:
        return self.energy_J / self.steps

    @property
    def time_per_step_s(self) -> float:
        return self.time_s / self.steps

    @property
    def mean_power_W(self) -> float:
        """Mean draw over the windows (J/s)."""
        return self.energy_J / self.time_s

    @property
    def window_count(self) -> int:
        return max(len(self.windows), 1)

    def window_figures(self) -> list[tuple[float, float, int]]:
        return list(self.windows) or [(self.energy_J, self.time_s, self.steps)]

    def merged(self, other: "LimitProfile") -> "LimitProfile":
        """This profile and another window of the same limit as one (sums; both windows kept)."""
        if other.limit_W != self.limit_W:
            raise ValueError(f"cannot merge windows of {self.limit_W} W and {other.limit_W} W")
        return LimitProfile(self.limit_W, self.energy_J + other.energy_J, self.time_s + other.time_s,
                            self.steps + other.steps, tuple(self.window_figures() + other.window_figures()))

    def to_json(self, cost: float | None = None) -> dict:
        """Zeus's measurement keys (``power_limit`` W, ``energy`` J and ``time`` s of the windows) and ours."""
        row = {"power_limit": self.limit_W, "energy": self.energy_J, "time": self.time_s, "steps": self.steps,
               "energy_per_step_J": self.energy_per_step_J, "time_per_step_s": self.time_per_step_s,
               "windows": [list(w) for w in self.window_figures()]}
        if cost is not None:
            row["cost"] = cost
        return row


class Objective:
    """A selector by name: Zeus's ``OptimumSelector`` for the choice, and the per-step cost it minimises.

    ``energy``: J per step. ``time``: s per step. ``zeus_cost``: ``eta*E + (1-eta)*MaxPower*T`` per step
    (J) with MaxPower the highest profiled limit times ``world_size`` (``max_power_scope="job"``, as
    Zeus's ``ZeusCost(world_size=...)``) or times 1 (``"process"``: Zeus's DDP recipe, see the module
    docstring). ``max_slowdown``: the lowest limit whose time is within ``max_slowdown_factor`` of the
    time at the highest profiled limit; its cost is the slowdown ratio.
    """

    def __init__(self, selector: str = "zeus_cost", eta_knob: float = 0.5, max_slowdown_factor: float = 1.1,
                 world_size: int = 1, max_power_scope: str = "job") -> None:
        if selector not in SELECTORS:
            raise ValueError(f"`selector` must be one of {SELECTORS}, got {selector!r}")
        if isinstance(eta_knob, bool) or not isinstance(eta_knob, (int, float)) or not 0.0 <= eta_knob <= 1.0:
            raise ValueError(f"`eta_knob` must be a number in [0, 1], got {eta_knob!r}")
        if (isinstance(max_slowdown_factor, bool) or not isinstance(max_slowdown_factor, (int, float))
                or not max_slowdown_factor >= 1.0):
            raise ValueError(f"`max_slowdown_factor` must be a number >= 1.0, got {max_slowdown_factor!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"`world_size` must be an integer >= 1, got {world_size!r}")
        if max_power_scope not in MAX_POWER_SCOPES:
            raise ValueError(f"`max_power_scope` must be one of {MAX_POWER_SCOPES}, got {max_power_scope!r}")
        self.selector = selector
        self.eta_knob = float(eta_knob)
        self.max_slowdown_factor = float(max_slowdown_factor)
        self.world_size = world_size
        self.max_power_scope = max_power_scope

    @property
    def is_threshold(self) -> bool:
        """True for the max-slowdown constraint (a threshold on time, not a cost to minimise)."""
        return self.selector == "max_slowdown"

    @property
    def cost_label(self) -> str:
        """What the cost is, for a plot's axis."""
        return {"energy": "energy", "time": "time", "zeus_cost": "ZeusCost η·E + (1−η)·P_max·t",
                "max_slowdown": "slowdown"}[self.selector]

    @property
    def cost_unit(self) -> str:
        return {"energy": "J/step", "time": "s/step", "zeus_cost": "J/step", "max_slowdown": "x"}[self.selector]

    @property
    def max_power_ranks(self) -> int:
        """The GPUs ZeusCost's MaxPower counts: ``world_size`` (scope ``job``) or 1 (scope ``process``)."""
        return self.world_size if self.max_power_scope == "job" else 1

    def describe(self) -> dict:
        out = {"name": self.selector, "world_size": self.world_size}
        if self.selector == "zeus_cost":
            out["eta_knob"] = self.eta_knob
            out["max_power_scope"] = self.max_power_scope
        if self.selector == "max_slowdown":
            out["max_slowdown_factor"] = self.max_slowdown_factor
        return out

    def zeus_selector(self):
        """The Zeus ``OptimumSelector`` this objective stands for."""
        zpl = _zeus_power_limit()
        if self.selector == "energy":
            return zpl.Energy()
        if self.selector == "time":
            return zpl.Time()
        if self.selector == "zeus_cost":
            return zpl.ZeusCost(eta_knob=self.eta_knob, world_size=self.max_power_ranks)
        return zpl.MaxSlowdownConstraint(factor=self.max_slowdown_factor)

    def select(self, profiles: list[LimitProfile]) -> int:
        """The chosen limit (W), one of ``profiles``, by Zeus's selector over per-step energy and time."""
        if not profiles:
            raise ValueError("no profiled power limit to select from")
        for p in profiles:
            if not (p.energy_J > 0 and p.time_s > 0):
                raise ValueError(f"power limit {p.limit_W} W was measured at {p.energy_J} J in {p.time_s} s; "
                                 "Zeus's selectors need positive energy and time (is a device sensor missing?)")
        zpl = _zeus_power_limit()
        ordered = sorted(profiles, key=lambda p: p.limit_W, reverse=True)  # Zeus's profiling order: same ties
        measurements = [zpl.PowerLimitMeasurement(power_limit=p.limit_W, energy=p.energy_per_step_J,
                                                  time=p.time_per_step_s) for p in ordered]
        return int(self.zeus_selector().select(measurements))

    def costs(self, profiles: list[LimitProfile]) -> dict[int, float]:
        """The per-step cost of every profile (unit :attr:`cost_unit`)."""
        if not profiles:
            return {}
        top = max(profiles, key=lambda p: p.limit_W)
        energy_J = np.array([p.energy_per_step_J for p in profiles], dtype=float)
        time_s = np.array([p.time_per_step_s for p in profiles], dtype=float)
        values = self.cost_of(energy_J, time_s, top.limit_W, top.time_per_step_s)
        return {p.limit_W: float(v) for p, v in zip(profiles, values)}

    def cost_of(self, energy_per_step_J, time_per_step_s, top_limit_W: int, top_time_per_step_s: float | None = None):
        """The cost (unit :attr:`cost_unit`) of per-step energies (J) and times (s), measured or bounded.

        ``top_limit_W``: the highest profiled limit (ZeusCost's MaxPower is it times :attr:`max_power_ranks`);
        ``top_time_per_step_s``: the time per step there (the max-slowdown reference).
        """
        energy_J, time_s = np.asarray(energy_per_step_J, dtype=float), np.asarray(time_per_step_s, dtype=float)
        if self.selector == "energy":
            return energy_J
        if self.selector == "time":
            return time_s
        if self.selector == "zeus_cost":
            max_power_W = top_limit_W * self.max_power_ranks
            return self.eta_knob * energy_J + (1.0 - self.eta_knob) * max_power_W * time_s
        if top_time_per_step_s is None:
            raise ValueError("the max-slowdown cost needs the time per step at the highest profiled limit")
        return time_s / top_time_per_step_s


class ExhaustiveSweep:
    """Zeus's search: every limit of the grid, highest first; the choice is the selector's (``objective``)."""

    name = "exhaustive"
    needs_measurements = False

    def __init__(self, grid: list[int], objective: Objective | None = None) -> None:
        if not grid:
            raise ValueError("the limit grid is empty")
        self.grid = sorted(grid, reverse=True)
        self.objective = objective

    def choose(self, profiled: Mapping[int, LimitProfile]) -> int:
        """The limit to train at (W): Zeus's selector over the profiled limits."""
        if self.objective is None:
            raise ValueError("ExhaustiveSweep.choose needs the objective (pass `objective`)")
        return self.objective.select(sorted(profiled.values(), key=lambda p: p.limit_W, reverse=True))

    def next_limit(self, profiled: Mapping[int, LimitProfile | None], previous: int | None = None) -> int | None:
        """The next limit to profile (None: done). ``profiled`` may hold limits whose values are pending;
        ``previous`` (the limit just profiled) does not change the sweep's order."""
        return next((limit for limit in self.grid if limit not in profiled), None)

    def plan(self) -> dict:
        return {"search": self.name, "first_limits_W": list(self.grid), "min_limits": len(self.grid),
                "max_limits": len(self.grid), "calibration_windows": 0, "repeat_budget": 0,
                "confirmation_windows": 0}

    def fell_back(self, profiled: Mapping[int, LimitProfile | None]) -> bool:
        return False


class AdaptiveSearch:
    """Fewer profiled limits by branch and bound on monotonic time and power; repeats settle near-ties.

    Order: the maximum limit (as Zeus starts), on grids of :data:`SMALL_GRID_LIMITS` limits or more the same
    limit again (no limit change: it measures the run-to-run noise), the minimum; then, while anything could
    still beat the best profiled limit by more than ``tolerance`` (allowing for noise), the most promising of:

    - a gap between two profiled limits ``lo < hi`` holding unprofiled ones: its lower bound on the cost
      (time per step at least ``T(hi)``, mean power at least ``P(lo)``, each less its noise margin) is
      below the best cost; its middle limit is profiled. For ``time`` a gap beside the fastest profile is
      always bisected (:data:`NEIGHBOUR_GAIN`): its bound is that profile's own time, a fact only a limit
      inside can refute (a thermal top slower than the limits below it);
    - a grid neighbour of the best profiled limit not yet profiled and not inside a gap already worth a
      bisection (:data:`NEIGHBOUR_GAIN`): the bounds beside the best rest on the best's own monotonic facts;
    - a profiled limit whose cost is within noise of the best (:data:`CONFIDENCE_Z` standard deviations):
      a limit between the two when there is one (another candidate: on a flat stretch the sweep's edge is
      its many near-equal candidates), else the one of the pair with fewer windows again (a limit gets at
      most ``1 + max_repeats`` windows). Both count against ``repeat_budget``; once it is spent, repeats
      (not new limits) go on from ``settle_budget``;
    - when nothing else is left, the pick itself if it rests on one window: the lowest of several noisy
      single windows is biased low (the winner's curse), a second window is not. This confirmation needs
      no budget (at most one per limit, only for the pick), so a limit profiled late is never chosen on
      its one window because the budgets were spent.

    Among the windows worth profiling the one with the most possible gain per step is taken: told the
    limit just profiled (``previous``), a repeat there costs no warm-up, ``1 + warmup_share`` times less.

    Gaps are bounded by the monotonic facts and, while the profile looks convex, by a third one: a limit
    only picks the clock, so every operating point (mean power, time per step) lies on one curve, and time
    against power on it is convex (time goes as 1/clock, power is convex increasing in the clock; the
    throttled limits below a clock floor are one point of it). Time inside a gap is then above the secants
    through its ends and their outer neighbours, which rules out far gaps of a smooth curve. The search
    stops when no gap and no near-tie is left, when the budgets are spent, or when the next window would take
    its profiling past the sweep's (every limit once after a limit change, in profile windows
    ``len(grid) * (1 + warmup_share)``: :meth:`sweep_cost`, against :attr:`spent_windows`).

    For max slowdown: a bisection for the lowest limit whose time meets the constraint, repeating the pick
    while it may truly break the constraint by more than ``tolerance``, and the limit below while it may
    truly meet it and save more than ``tolerance`` in energy (from either budget). Profiles that break
    monotonic time (or, for cost selectors, power) by more than :data:`FALLBACK_Z` standard deviations make
    it fall back to Zeus's exhaustive sweep. :meth:`choose` is always Zeus's selector over the profiled
    limits.

    Args:
        grid: the candidate limits (W).
        objective: what is minimised (or, for max slowdown, the time constraint).
        tolerance: a pick within this fraction of the optimum is good enough: gaps and rivals that cannot
            beat the best by more are not profiled (max slowdown: a pick may break the constraint by this
            fraction of the time, and a limit below it saving less energy is not worth settling).
        noise: the assumed relative standard deviation of one window's energy and time (pooled with
            what repeated windows show).
        max_repeats: most extra windows per limit.
        repeat_budget: most extra windows while exploring: the noise calibration, limits profiled to split
            a near-tie, repeats.
        settle_budget: most further repeats once ``repeat_budget`` is spent (near-ties of the choice, limits
            near the max-slowdown threshold).
        warmup_share: warm-up steps after a limit change over profile steps per window: windows worth
            profiling are ranked by possible gain per step, so a repeat of the limit just profiled (no
            warm-up) is preferred to an equally promising window elsewhere.
        model_pruning: on grids of at least :data:`MODEL_MIN_LIMITS` limits and cost selectors, once four limits
            are profiled, let the DVFS model (:mod:`lightning_energy.optimize.power_limit.dvfs_model`) fitted to
            every profile choose the windows while it holds (:meth:`_model_step`): its optimum is profiled, then the
            pick's grid neighbours (the pick is a measured local minimum), and a pick the model costs beyond
            ``tolerance`` of its optimum is profiled again; then the search stops. A profile beyond
            :data:`MODEL_FIT_Z` standard deviations of the fit, or a limit profiled on the model's prediction beyond
            :data:`MODEL_CHECK_Z` of it, abandons the model for good and branch and bound goes on
            (:attr:`model_state`; what broke it: :attr:`model_abandoned_by`). Off by default
            (:data:`DEFAULT_MODEL_PRUNING`).

    Grids of fewer than :data:`SMALL_GRID_LIMITS` limits, where the cap is barely every limit once: energy,
    ZeusCost and max slowdown profile every limit once in Zeus's order (:attr:`sweeps_small_grid`, the
    equal-budget rule); there is no calibration window (:attr:`calibrates`); for time a never-profiled limit goes
    before any repeat, then the most promising (not the ones beside the best profile: which profile looks best is
    itself noise there).
    """

    name = "adaptive"
    needs_measurements = True

    def __init__(self, grid: list[int], objective: Objective, tolerance: float = DEFAULT_TOLERANCE,
                 noise: float = DEFAULT_NOISE, max_repeats: int = DEFAULT_MAX_REPEATS,
                 repeat_budget: int = DEFAULT_REPEAT_BUDGET, settle_budget: int = DEFAULT_SETTLE_BUDGET,
                 warmup_share: float = DEFAULT_WARMUP_SHARE, model_pruning: bool = DEFAULT_MODEL_PRUNING) -> None:
        if not grid:
            raise ValueError("the limit grid is empty")
        if not isinstance(model_pruning, bool):
            raise ValueError(f"`model_pruning` must be True or False, got {model_pruning!r}")
        self.model_pruning = model_pruning
        self._model_state = "unfitted"  # "unfitted", "trusted" (guides) or "abandoned" (profiles broke it)
        self._model_predictions: dict[int, tuple[float, float]] = {}  # limit: (J, s per step) predicted before it
        self._model_abandoned_by: str | None = None  # what broke the model (:attr:`model_abandoned_by`)
        if isinstance(warmup_share, bool) or not isinstance(warmup_share, (int, float)) or not warmup_share >= 0:
            raise ValueError(f"`warmup_share` must be a number >= 0, got {warmup_share!r}")
        self.warmup_share = float(warmup_share)
        self._previous: int | None = None
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
            raise ValueError(f"`tolerance` must be a number in [0, 1), got {tolerance!r}")
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0.0 <= noise < 0.5:
            raise ValueError(f"`noise` must be a number in [0, 0.5), got {noise!r}")
        if isinstance(max_repeats, bool) or not isinstance(max_repeats, int) or max_repeats < 0:
            raise ValueError(f"`max_repeats` must be an integer >= 0, got {max_repeats!r}")
        self.grid = sorted(grid, reverse=True)
        self.objective = objective
        self.tolerance = float(tolerance)
        self.noise = float(noise)
        self.max_repeats = max_repeats
        if isinstance(repeat_budget, bool) or not isinstance(repeat_budget, int) or repeat_budget < 0:
            raise ValueError(f"`repeat_budget` must be an integer >= 0, got {repeat_budget!r}")
        if isinstance(settle_budget, bool) or not isinstance(settle_budget, int) or settle_budget < 0:
            raise ValueError(f"`settle_budget` must be an integer >= 0, got {settle_budget!r}")
        self.repeat_budget = repeat_budget
        self.settle_budget = settle_budget
        self._repeats_left = repeat_budget
        self._settles_left = settle_budget
        self._split_limits: set[int] = set()  # limits profiled to split a near-tie (they count as repeats)
        self._spent = 0.0  # profiling spent so far, in profile windows (warm-ups as ``warmup_share`` of one)
        self._counted_windows = 0  # windows counted into ``_spent``
        self._last_counted: int | None = None  # the limit of the last window counted
        self.first = [self.grid[0], self.grid[-1]] if len(self.grid) > 1 else [self.grid[0]]

    @property
    def calibrates(self) -> bool:
        """Whether the maximum is profiled twice first (the run-to-run noise, no limit change)."""
        return self.max_repeats > 0 and self.repeat_budget > 0 and len(self.grid) >= SMALL_GRID_LIMITS

    @property
    def sweeps_small_grid(self) -> bool:
        """Whether this search profiles every limit once in Zeus's order (the equal-budget rule): on a grid of fewer
        than :data:`SMALL_GRID_LIMITS` limits for every selector but time, where the cap (the sweep's profiling) is
        barely every limit once. Branch and bound saved at most 7 % of the steps there and lost success against the
        sweep (``benchmarks/power_limit_search.py``, 50-100 paired repetitions: held-out issue 30, 7 limits, ZeusCost
        0.5 at 5 % noise, 44 % against 55 %; the tuned families, 7 limits, max slowdown 1.1, 72.9 % against 76.0 %);
        the time search keeps its bounds (no loss there)."""
        return len(self.grid) < SMALL_GRID_LIMITS and self.objective.selector != "time"

    @property
    def uses_model(self) -> bool:
        """Whether the DVFS model may guide the search on this grid and selector."""
        return self.model_pruning and len(self.grid) >= MODEL_MIN_LIMITS and not self.objective.is_threshold

    @property
    def model_state(self) -> str:
        """``"off"`` (not used here), ``"unfitted"`` (fewer than 4 limits profiled), ``"trusted"`` (every
        profile fits it within noise: it guides the search) or ``"abandoned"`` (profiles broke it: branch and bound
        only)."""
        return self._model_state if self.uses_model else "off"

    @property
    def model_abandoned_by(self) -> str | None:
        """What made the search drop the DVFS model (None while it has not): ``"monotonic"`` (profiles break
        monotonic time or power: the fallback to the sweep), ``"fit"`` (a profile beyond :data:`MODEL_FIT_Z`
        standard deviations of the fit), ``"prediction"`` (a limit profiled on the model's prediction measured
        beyond :data:`MODEL_CHECK_Z` of it) or ``"no fit"`` (no model runs at every profiled limit)."""
        return self._model_abandoned_by if self.uses_model else None

    def _abandon_model(self, reason: str) -> None:
        if self._model_state != "abandoned":
            self._model_state, self._model_abandoned_by = "abandoned", reason

    def plan(self) -> dict:
        calibration = int(self.calibrates)
        if self.sweeps_small_grid:  # the equal-budget rule: every limit once, Zeus's order
            return {"search": self.name, "first_limits_W": list(self.grid), "min_limits": len(self.grid),
                    "max_limits": len(self.grid), "calibration_windows": 0, "repeat_budget": 0,
                    "confirmation_windows": 0}
        return {"search": self.name, "first_limits_W": list(self.first), "min_limits": len(self.first),
                "max_limits": len(self.grid), "calibration_windows": calibration,
                "repeat_budget": self.repeat_budget + self.settle_budget if self.max_repeats > 0 else 0,
                "confirmation_windows": len(self.grid) if self.max_repeats > 0 and len(self.grid) > 2 else 0}

    # ---------------------------------------------------------------- noise
    def noise_level(self, profiled: Mapping[int, LimitProfile]) -> float:
        """Relative standard deviation of one window: repeated windows' spread pooled with the prior."""
        squares, dof = 0.0, 0.0
        for p in profiled.values():
            windows = p.windows
            if len(windows) < 2:
                continue
            for column in (0, 1):  # energy and time per step (a handful of windows: plain floats are faster)
                values = [w[column] / w[2] for w in windows]
                mean = sum(values) / len(values)
                squares += sum((v / mean - 1.0) ** 2 for v in values)
                dof += len(values) - 1
        return math.sqrt((squares + PRIOR_DOF * self.noise**2) / (dof + PRIOR_DOF))

    # ---------------------------------------------------------------- the next window
    def next_limit(self, profiled: Mapping[int, LimitProfile | None], previous: int | None = None) -> int | None:
        """The next limit to profile, possibly one already profiled (a repeat); None when done.

        Every value in ``profiled`` must be known (merged windows of each limit). ``previous``: the limit of
        the window just profiled (W; None: unknown): another window there needs no warm-up, so among
        windows worth profiling it costs ``1 + warmup_share`` times less."""
        if any(p is None for p in profiled.values()):
            raise ValueError("the adaptive search needs the measurements of every profiled limit")
        self._previous = previous  # the limit just profiled: a repeat there needs no warm-up
        self._count_spent(profiled, previous)
        limit = self._next_uncapped(profiled)
        if limit is not None and self._spent + self._window_cost(limit) > self.sweep_cost() * (1.0 + 1e-9):
            return None  # the sweep's profiling is a hard cap: the choice is made from what is measured
        return limit

    def sweep_cost(self) -> float:
        """What Zeus's sweep profiles, in profile windows: every limit once, each after a limit change."""
        return len(self.grid) * (1.0 + self.warmup_share)

    @property
    def spent_windows(self) -> float:
        """Profiling spent so far in profile windows (a warm-up counts ``warmup_share`` of one)."""
        return self._spent

    def _count_spent(self, profiled: Mapping[int, LimitProfile], previous: int | None) -> None:
        """Adds the windows profiled since the last call to :attr:`spent_windows`: a window right after one at
        the same limit costs 1, any other ``1 + warmup_share`` (also every window of unknown order, e.g. a
        profile given at once: never less than was spent)."""
        total = sum(p.window_count for p in profiled.values())
        if total < self._counted_windows:  # a fresh search on the same object
            self._spent, self._counted_windows, self._last_counted = 0.0, 0, None
            self._model_state, self._model_abandoned_by = "unfitted", None
            self._model_predictions = {}
        new = total - self._counted_windows
        if new == 1 and previous is not None:
            self._spent += 1.0 if previous == self._last_counted else 1.0 + self.warmup_share
        else:
            self._spent += new * (1.0 + self.warmup_share)
        if new:
            self._last_counted = previous
        self._counted_windows = total

    def _next_uncapped(self, profiled: Mapping[int, LimitProfile]) -> int | None:
        self._split_limits &= set(profiled)  # a fresh search on the same object starts again
        spent = sum(p.window_count - 1 for p in profiled.values()) + len(self._split_limits)
        self._repeats_left = self.repeat_budget - spent
        self._settles_left = self.settle_budget - max(spent - self.repeat_budget, 0)
        top = self.grid[0]
        if self.sweeps_small_grid:
            # equal budget: the cap is every limit once, which only the sweep's own order can spend without a loss
            return next((limit for limit in self.grid if limit not in profiled), None)
        if top not in profiled:
            return top
        if self.calibrates and profiled[top].window_count < 2:
            return top  # the same limit again: the run-to-run noise, without a limit change
        bottom = self.grid[-1]
        if bottom not in profiled:
            return bottom
        if self.fell_back(profiled):
            self._abandon_model("monotonic")
            rest = self._fallback_next(profiled)
            return rest if rest is not None else self._settle(profiled)
        if self.objective.is_threshold:
            return self._threshold_step(profiled)
        return self._cost_step(profiled)

    @staticmethod
    def _noise_free(done: list[LimitProfile]) -> bool:
        """True when repeated windows were measured and every one repeats its limit's first exactly (to
        :data:`EXACT_REL`): the measurements show no noise, so equal costs are an exact tie, not a near-tie to
        settle (with any run-to-run noise two windows never agree to that precision)."""
        repeated = False
        for p in done:
            windows = p.windows
            if len(windows) < 2:
                continue
            repeated = True
            e0, t0 = windows[0][0] / windows[0][2], windows[0][1] / windows[0][2]
            for e, t, n in windows[1:]:
                if abs(e / n - e0) > EXACT_REL * e0 or abs(t / n - t0) > EXACT_REL * t0:
                    return False
        return repeated

    def _fallback_next(self, profiled: Mapping[int, LimitProfile]) -> int | None:
        """The sweep's next limit once the bounds fail. Every limit is profiled while the cap allows; the
        calibration window may leave one out, so for a cost the limits beside the cheapest profiled ones come
        first (a valley the coarse points missed is found before a limit between two costly ones)."""
        rest = [limit for limit in self.grid if limit not in profiled]
        if not rest or self.objective.is_threshold:
            return rest[0] if rest else None
        done = sorted(profiled)
        costs = self.objective.costs([profiled[limit] for limit in done])

        def neighbour_cost(limit: int) -> float:  # the cheapest profiled limit next to it on the grid
            i = self.grid.index(limit)
            beside = [self.grid[j] for j in (i - 1, i + 1) if 0 <= j < len(self.grid) and self.grid[j] in costs]
            return min((costs[x] for x in beside), default=math.inf)

        return min(rest, key=lambda limit: (neighbour_cost(limit), -limit))

    def _window_cost(self, limit: int) -> float:
        """The cost of a window at ``limit`` in profile windows: 1, plus the warm-up after a limit change."""
        return 1.0 if limit == self._previous else 1.0 + self.warmup_share

    def _margin(self, sigma: float, p: LimitProfile) -> float:
        return GAP_Z * sigma / math.sqrt(p.window_count)

    def _can_repeat(self, p: LimitProfile) -> bool:
        """Whether ``p`` may get another window: under ``max_repeats``, from the exploration budget or, once
        that is spent, the settle budget."""
        return p.window_count < 1 + self.max_repeats and (self._repeats_left > 0 or self._settles_left > 0)

    def _cost_step(self, profiled: Mapping[int, LimitProfile], gaps: bool = True) -> int | None:
        """The most promising window: a gap's middle limit (``gaps``) or a repeat of a near-tie; None: done."""
        done = [profiled[limit] for limit in sorted(profiled)]
        costs = self.objective.costs(done)
        best = min(reversed(done), key=lambda p: costs[p.limit_W])  # ties: the highest limit, as Zeus's selectors
        best_cost = costs[best.limit_W]
        sigma = self.noise_level(profiled)
        # (possible gain beyond the tolerance, limit to profile, whether it splits a near-tie, whether it is beside
        # the best profiled limit)
        actions = []
        in_play = 0.0  # the profiling the windows still worth a look would cost (a promising gap: its bisection)
        explored: set[int] = set()  # limits inside a gap worth bisecting
        if gaps and self.uses_model:
            guided = self._model_step(done, costs, best, sigma)
            if guided is not _UNGUIDED:
                return guided
        convex = gaps and self._looks_convex(done, sigma)
        for i, (lo, hi) in enumerate(zip(done, done[1:]) if gaps else ()):
            inside = [limit for limit in self.grid if lo.limit_W < limit < hi.limit_W]
            if not inside:
                continue
            bound = self._gap_bound(done, i, sigma, convex, best)
            gain = (best_cost - bound) / best_cost - self.tolerance
            if self.objective.selector == "time" and (lo is best or hi is best):
                # for time a gap beside the fastest profile is bounded by its own time alone (the monotonic fact, no
                # noise slack): the fact is tested, not trusted, by bisecting the gap (a thermal top slower than
                # the limits below it shows only there, and a small step per limit hides in a neighbour's noise)
                gain = max(gain, NEIGHBOUR_GAIN)
            if gain > 0:
                middle = (lo.limit_W + hi.limit_W) / 2
                touches = lo is best or hi is best
                actions.append((gain, min(inside, key=lambda limit: (abs(limit - middle), -limit)), False, touches))
                explored.update(inside)
                in_play += math.ceil(math.log2(len(inside) + 1)) * (1.0 + self.warmup_share)  # its bisection
        if gaps:
            # a monotonic fact is trusted only where a profile could have refuted it: the grid neighbours of the best
            # profile are measured before it is picked (a thermal top slower than the limit below it, a valley beside
            # a cliff, show nowhere else)
            position = self.grid.index(best.limit_W)
            for j in (position - 1, position + 1):
                if 0 <= j < len(self.grid) and self.grid[j] not in profiled and self.grid[j] not in explored:
                    actions.append((NEIGHBOUR_GAIN, self.grid[j], False, True))
                    in_play += 1.0 + self.warmup_share
        exact = self._noise_free(done)
        for p in done:
            if p is best:
                continue
            if exact and abs(costs[p.limit_W] - best_cost) <= EXACT_REL * best_cost:
                continue  # an exact tie (repeated windows show no noise): nothing to settle, the higher limit wins
            spread = sigma * math.hypot(best_cost / math.sqrt(best.window_count),
                                        costs[p.limit_W] / math.sqrt(p.window_count))
            gain = (best_cost - costs[p.limit_W] + CONFIDENCE_Z * spread) / best_cost - self.tolerance
            if gain <= 0:
                continue
            low, high = sorted((best.limit_W, p.limit_W))
            between = [limit for limit in self.grid if low < limit < high and limit not in profiled] if gaps else []
            if between and self._repeats_left > 0:  # a new limit between the two: another candidate (counted)
                middle = (low + high) / 2
                actions.append((gain, min(between, key=lambda limit: (abs(limit - middle), -limit)), True, True))
                in_play += 1.0 + self.warmup_share
                continue
            again = min((q for q in (best, p) if self._can_repeat(q)),  # fewer windows; ties: no warm-up first
                        key=lambda q: (q.window_count, q.limit_W != self._previous), default=None)
            if again is not None:
                actions.append((gain, again.limit_W, False, True))
                in_play += self._window_cost(again.limit_W)
        if not actions:
            # the winner's curse: the lowest of many noisy single windows is biased low, so a pick resting on one
            # window gets a second one (an unbiased look) before it is final; from no budget: a limit profiled
            # late (a gap's middle) would otherwise be chosen on its one lucky window once the budgets are spent
            confirm = best.window_count < 2 and sigma > 0 and len(done) > 2 and self.max_repeats > 0
            return best.limit_W if confirm else None
        # under the cap (the sweep's profiling) not every window worth profiling may fit: then the windows beside the
        # best profiled limit (its gaps, its near-ties) go first, so the last affordable windows look where the
        # optimum most likely is rather than at a wide gap's lower bound far from it
        pressed = in_play > self.sweep_cost() - self._spent
        if len(self.grid) < SMALL_GRID_LIMITS:
            # a small grid (only `time` gets here: the other selectors sweep it, sweeps_small_grid): the cap leaves no
            # room beyond every limit once, so a limit never profiled goes before any repeat, the most promising first
            # (which profile is "best" is itself noise here: the sweep's edge is coverage)
            _, limit, splits, _ = max(actions, key=lambda a: (a[1] not in profiled, a[0] / self._window_cost(a[1]),
                                                              a[1]))
        elif pressed:
            _, limit, splits, _ = max(actions, key=lambda a: (a[3], a[0] / self._window_cost(a[1]), a[1]))
        else:
            _, limit, splits, _ = max(actions, key=lambda a: (a[0] / self._window_cost(a[1]), a[1]))
        if splits:
            self._split_limits.add(limit)
        return limit

    def _model_step(self, done: list[LimitProfile], costs: dict[int, float], best: LimitProfile, sigma: float):
        """The next window while the DVFS model holds (:data:`_UNGUIDED`: the model does not guide this step).

        The model fitted to every profile (windows weighing by their count) predicts each limit's cost; it is
        abandoned for good once a profile lies beyond :data:`MODEL_FIT_Z` standard deviations of it, or once a
        limit profiled on its prediction measures beyond that of what it predicted (an out-of-sample check).
        While it holds: its optimum is profiled (a measured confirmation before any pick), then the grid neighbours
        of the pick (Zeus's selector over the profiles; the one the model costs less first), so the pick is a
        measured local minimum; when the pick is a limit the model costs beyond ``tolerance`` of its optimum, it
        is profiled again (a lucky window); otherwise the search stops."""
        from lightning_energy.optimize.power_limit.dvfs_model import MIN_LIMITS, fit_dvfs

        if self._model_state == "abandoned" or len(done) < MIN_LIMITS:
            return _UNGUIDED
        for p in done:  # out-of-sample: what the model predicted for a limit before it was profiled
            predicted = self._model_predictions.get(p.limit_W)
            if predicted is None:
                continue
            margin = MODEL_CHECK_Z * sigma * math.sqrt(1.0 / p.window_count + MODEL_PREDICTION_VARIANCE) + MODEL_SLACK
            if (abs(p.time_per_step_s / predicted[1] - 1.0) > margin
                    or abs(p.mean_power_W / (predicted[0] / predicted[1]) - 1.0) > margin):
                self._abandon_model("prediction")
                return _UNGUIDED
        fit = fit_dvfs([p.limit_W for p in done], [p.energy_per_step_J for p in done],
                       [p.time_per_step_s for p in done], weights=[p.window_count for p in done],
                       min_limit_W=self.grid[-1], max_limit_W=self.grid[0])
        if fit is None:
            self._abandon_model("no fit")
            return _UNGUIDED
        for p, (time_res, power_res) in zip(done, fit.residuals):
            margin = MODEL_FIT_Z * sigma / math.sqrt(p.window_count) + MODEL_SLACK
            if abs(time_res) > margin or abs(power_res) > margin:
                self._abandon_model("fit")
                return _UNGUIDED
        self._model_state = "trusted"
        grid = np.array(sorted(self.grid), dtype=float)
        energy, time = fit.model.energy_per_step_J(grid), fit.model.time_per_step_s(grid)
        top = done[-1]
        predicted = np.asarray(self.objective.cost_of(energy, time, top.limit_W, top.time_per_step_s))
        ranked = {int(limit): float(c) for limit, c in zip(grid, predicted)}
        optimum = min(sorted(ranked, reverse=True), key=lambda limit: ranked[limit])  # ties: the higher limit
        profiled = {p.limit_W: p for p in done}
        if optimum not in profiled:
            self._model_predictions[optimum] = (float(energy[list(grid).index(optimum)]),
                                                float(time[list(grid).index(optimum)]))
            return optimum
        # the pick must be a measured local minimum: its grid neighbours are profiled (a model that misses a steep
        # optimum by a limit or two is corrected by the measurements, not trusted)
        position = self.grid.index(best.limit_W)
        beside = [self.grid[j] for j in (position - 1, position + 1)
                  if 0 <= j < len(self.grid) and self.grid[j] not in profiled]
        if beside:
            nearest = min(beside, key=lambda limit: (ranked[limit], -limit))
            self._model_predictions[nearest] = (float(energy[list(grid).index(nearest)]),
                                                float(time[list(grid).index(nearest)]))
            return nearest
        if ranked[best.limit_W] > ranked[optimum] * (1.0 + self.tolerance - MODEL_SLACK):
            if self._can_repeat(best):  # the pick measured luckily low: another window shows it
                return best.limit_W
            if self._can_repeat(profiled[optimum]):
                return optimum
        return None

    def _gap_bound(self, done: list[LimitProfile], i: int, sigma: float, convex: bool,
                   best: LimitProfile | None = None) -> float:
        """A lower bound on the cost of any limit between ``done[i]`` and ``done[i + 1]`` (sorted by limit).

        Monotonic facts: power at least ``P(lo)``, time at least ``T(hi)``, each less its noise margin, except
        where that end is ``best`` (the profile the bound is compared with): its own measurement is not set
        against itself (a gap below the fastest limit cannot be faster than it, whatever the noise).
        ``convex``: the card's operating points also lie on one curve of time against power that is convex
        (a limit only picks the clock; time goes as 1/clock, power is convex increasing in the clock), so
        time inside the gap is also above the secants through the gap's ends and their outer neighbours,
        extended into the gap (with the noise margins set against the bound)."""
        lo, hi = done[i], done[i + 1]
        top = done[-1]
        power_lo = lo.mean_power_W * (1.0 - (0.0 if lo is best else math.sqrt(2.0) * self._margin(sigma, lo)))
        time_floor = hi.time_per_step_s * (1.0 - (0.0 if hi is best else self._margin(sigma, hi)))
        if not convex:
            return float(self.objective.cost_of(power_lo * time_floor, time_floor, top.limit_W, top.time_per_step_s))
        power_hi = max(hi.mean_power_W * (1.0 + math.sqrt(2.0) * self._margin(sigma, hi)), power_lo)
        power = np.linspace(power_lo, power_hi, 65)
        time = np.full_like(power, time_floor)
        lines = []
        if i >= 1:  # through the lower neighbour and lo, extended to higher power
            lines.append((done[i - 1], 1.0, lo, -1.0))
        if i + 2 < len(done):  # through hi and its upper neighbour, extended to lower power
            lines.append((hi, -1.0, done[i + 2], 1.0))
        for a, sign_a, b, sign_b in lines:
            ta = a.time_per_step_s * (1.0 + (0.0 if a is best else sign_a * self._margin(sigma, a)))
            tb = b.time_per_step_s * (1.0 + (0.0 if b is best else sign_b * self._margin(sigma, b)))
            if b.mean_power_W - a.mean_power_W <= 1e-9 * b.mean_power_W:
                continue
            slope = (tb - ta) / (b.mean_power_W - a.mean_power_W)
            anchor_P, anchor_T = (b.mean_power_W, tb) if sign_b < 0 else (a.mean_power_W, ta)
            time = np.maximum(time, anchor_T + slope * (power - anchor_P))
        costs = self.objective.cost_of(power * time, time, top.limit_W, top.time_per_step_s)
        return float(np.min(costs))

    def _looks_convex(self, done: list[LimitProfile], sigma: float) -> bool:
        """False when three operating points (power, time) break the convexity of time against power beyond
        :data:`FALLBACK_Z` standard deviations: the secant bounds are then not used."""
        points = [(p.mean_power_W, p.time_per_step_s, p.window_count) for p in done]
        for (p0, t0, n0), (p1, t1, n1), (p2, t2, n2) in zip(points, points[1:], points[2:]):
            if p2 - p0 <= 1e-9 * p2:
                continue
            chord = t0 + (t2 - t0) * (min(max(p1, p0), p2) - p0) / (p2 - p0)
            slack = FALLBACK_Z * sigma * math.sqrt(1.0 / n0 + 1.0 / n1 + 1.0 / n2)
            if t1 > chord * (1.0 + slack):
                return False
        return True

    def _settle(self, profiled: Mapping[int, LimitProfile]) -> int | None:
        """After the exhaustive fallback has profiled everything: only near-ties are repeated."""
        if self.objective.is_threshold:
            return self._threshold_repeat(profiled)
        return self._cost_step(profiled, gaps=False)

    def _threshold_step(self, profiled: Mapping[int, LimitProfile]) -> int | None:
        limit_time_s = self.objective.max_slowdown_factor * profiled[self.grid[0]].time_per_step_s
        feasible = min(limit for limit, p in profiled.items() if p.time_per_step_s <= limit_time_s)
        below = max((limit for limit in profiled if limit < feasible), default=None)
        if below is not None:
            inside = [limit for limit in self.grid if below < limit < feasible]
            if inside:
                middle = (below + feasible) / 2
                return min(inside, key=lambda limit: (abs(limit - middle), -limit))
        return self._threshold_repeat(profiled)

    def _threshold_repeat(self, profiled: Mapping[int, LimitProfile]) -> int | None:
        """A limit of the boundary pair profiled again while noise leaves the choice in doubt beyond the tolerance:
        the pick (the lowest limit measured within the constraint) while its time may truly exceed the constraint
        by more than ``tolerance``; the limit below it while it may truly meet the constraint and save more than
        ``tolerance`` of the pick's energy per step."""
        limit_time_s = self.objective.max_slowdown_factor * profiled[self.grid[0]].time_per_step_s
        sigma = self.noise_level(profiled)
        feasible = min(limit for limit, p in profiled.items() if p.time_per_step_s <= limit_time_s)
        below = max((limit for limit in profiled if limit < feasible), default=None)
        doubtful = []
        reference_windows = profiled[self.grid[0]].window_count  # the threshold's own noise: T(top) averaged
        for limit in (feasible, below):
            if limit is None or limit == self.grid[0]:
                continue
            p = profiled[limit]
            spread = sigma * math.sqrt(1.0 / p.window_count + 1.0 / reference_windows)
            over = p.time_per_step_s / limit_time_s - 1.0
            if limit == feasible:  # the pick: could it truly break the constraint by more than the tolerance?
                doubt = over + CONFIDENCE_Z * spread > self.tolerance
            else:  # the limit below: could it truly meet the constraint, saving more energy than the tolerance?
                pick = profiled[feasible]
                saving = (pick.energy_per_step_J - p.energy_per_step_J) / pick.energy_per_step_J
                energy_spread = sigma * math.sqrt(1.0 / p.window_count + 1.0 / pick.window_count)
                doubt = over - CONFIDENCE_Z * spread < 0 and saving + CONFIDENCE_Z * energy_spread > self.tolerance
            if doubt and self._can_repeat(p):
                doubtful.append((p.window_count, limit != self._previous, -limit))  # ties: no warm-up first
        return -min(doubtful)[2] if doubtful else None

    def fell_back(self, profiled: Mapping[int, LimitProfile | None]) -> bool:
        """True once the profiles break monotonic time (or, for cost selectors, mean power) beyond noise:
        the bounds do not hold, and the search profiles everything (Zeus's sweep)."""
        done = [profiled[limit] for limit in sorted(profiled) if profiled[limit] is not None]
        if len(done) < 2:
            return False
        sigma = self.noise_level({p.limit_W: p for p in done})
        for lo, hi in zip(done, done[1:]):
            slack = FALLBACK_Z * sigma * math.sqrt(1.0 / lo.window_count + 1.0 / hi.window_count)
            if hi.time_per_step_s > lo.time_per_step_s * (1.0 + slack):
                return True
            if not self.objective.is_threshold and hi.mean_power_W < lo.mean_power_W * (1.0 - slack):
                return True
        return False

    def choose(self, profiled: Mapping[int, LimitProfile]) -> int:
        """The limit to train at (W): Zeus's selector over the profiled limits (never an unprofiled one)."""
        return self.objective.select(sorted(profiled.values(), key=lambda p: p.limit_W, reverse=True))


def make_search(name: str, grid: list[int], objective: Objective, tolerance: float = DEFAULT_TOLERANCE,
                noise: float = DEFAULT_NOISE, max_repeats: int = DEFAULT_MAX_REPEATS,
                repeat_budget: int = DEFAULT_REPEAT_BUDGET, settle_budget: int = DEFAULT_SETTLE_BUDGET,
                warmup_share: float = DEFAULT_WARMUP_SHARE, model_pruning: bool = DEFAULT_MODEL_PRUNING):
    if name == "exhaustive":
        return ExhaustiveSweep(grid, objective)
    if name == "adaptive":
        return AdaptiveSearch(grid, objective, tolerance, noise, max_repeats, repeat_budget, settle_budget,
                              warmup_share, model_pruning)
    raise ValueError(f"`search` must be one of {SEARCHES}, got {name!r}")


# ---------------------------------------------------------------------------------------------- files
