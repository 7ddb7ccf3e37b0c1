"""Power-limit profiling without Lightning: candidate limits, selectors, search strategies, the profile file.

Selection is Zeus's: the final choice is made by ``zeus.optimizer.power_limit``'s selectors (``Energy``,
``Time``, ``ZeusCost`` with eta, ``MaxSlowdownConstraint``) over ``PowerLimitMeasurement`` objects, and
the profile file keeps Zeus's ``{"measurements": [{"power_limit", "energy", "time"}]}`` layout (extra keys
of ours beside them), so Zeus's ``GlobalPowerLimitOptimizer(profile_path=...)`` can read our files and
we read its files.

Search: Zeus profiles every limit from the maximum down in ``pl_step`` watts (:class:`ExhaustiveSweep`).
:class:`AdaptiveSearch` profiles the maximum, the minimum and the middle, fits energy and time per step
each by a quadratic in the limit (the V100 study: both quadratic, R² ≈ 1), derives the selector's cost
from the fitted energy and time, and profiles a further limit only where the fit is uncertain: a limit
predicted to beat the best profiled one by more than ``tolerance``, a gap around the best wider than
:data:`TRUSTED_GAP_W`, or a possible hook at the lowest limit. For a cost selector it trains at the
fit's optimum where that lies between profiled limits. When the profiled costs are not unimodal (or, for
the max-slowdown selector, times not monotonic) it falls back to the exhaustive sweep. It can only see
a bump among the limits it profiles: a second valley between them goes unnoticed.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from lightning_energy.io import atomic_write_json

SELECTORS = ("energy", "time", "zeus_cost", "max_slowdown")
SEARCHES = ("exhaustive", "adaptive")
PROFILE_FILE = "power_limit_profile.json"
FIGURE_FILE = "power_limit_profile.png"
PROFILE_FORMAT = "lightning-energy power-limit profile 1"
DEFAULT_TOLERANCE = 0.02  # a check must promise a gain above 2 % (the benchmark's "within 2 %")
# The V100 study found energy and time quadratic over 150-300 W, three points 75 W apart: the search trusts
# the model between profiled limits at most this far apart and halves wider gaps around the best limit.
TRUSTED_GAP_W = 75
MONOTONIC_TOLERANCE = 0.02  # time may rise by 2 % towards a higher limit before it counts as noise


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
    """One profiled limit: energy (J, summed over ranks) and time (s, slowest rank) of ``steps`` steps."""

    limit_W: int
    energy_J: float
    time_s: float
    steps: int

    @property
    def energy_per_step_J(self) -> float:
        return self.energy_J / self.steps

    @property
    def time_per_step_s(self) -> float:
        return self.time_s / self.steps

    def to_json(self, cost: float | None = None) -> dict:
        """Zeus's measurement keys (``power_limit`` W, ``energy`` J and ``time`` s of the window) and ours."""
        row = {"power_limit": self.limit_W, "energy": self.energy_J, "time": self.time_s, "steps": self.steps,
               "energy_per_step_J": self.energy_per_step_J, "time_per_step_s": self.time_per_step_s}
        if cost is not None:
            row["cost"] = cost
        return row


class Objective:
    """A selector by name: Zeus's ``OptimumSelector`` for the choice, and the per-step cost it minimises.

    ``energy``: J per step. ``time``: s per step. ``zeus_cost``: ``eta*E + (1-eta)*MaxPower*T`` per step
    (J) with MaxPower the highest profiled limit times ``world_size`` (as Zeus's ``ZeusCost``).
    ``max_slowdown``: the lowest limit whose time is within ``max_slowdown_factor`` of the time at the
    highest profiled limit; its cost is the slowdown ratio.
    """

    def __init__(self, selector: str = "zeus_cost", eta_knob: float = 0.5, max_slowdown_factor: float = 1.1,
                 world_size: int = 1) -> None:
        if selector not in SELECTORS:
            raise ValueError(f"`selector` must be one of {SELECTORS}, got {selector!r}")
        if isinstance(eta_knob, bool) or not isinstance(eta_knob, (int, float)) or not 0.0 <= eta_knob <= 1.0:
            raise ValueError(f"`eta_knob` must be a number in [0, 1], got {eta_knob!r}")
        if (isinstance(max_slowdown_factor, bool) or not isinstance(max_slowdown_factor, (int, float))
                or not max_slowdown_factor >= 1.0):
            raise ValueError(f"`max_slowdown_factor` must be a number >= 1.0, got {max_slowdown_factor!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"`world_size` must be an integer >= 1, got {world_size!r}")
        self.selector = selector
        self.eta_knob = float(eta_knob)
        self.max_slowdown_factor = float(max_slowdown_factor)
        self.world_size = world_size

    @property
    def is_threshold(self) -> bool:
        """True for the max-slowdown constraint (a threshold on time, not a cost to minimise)."""
        return self.selector == "max_slowdown"

    @property
    def cost_unit(self) -> str:
        return {"energy": "J/step", "time": "s/step", "zeus_cost": "J/step", "max_slowdown": "x"}[self.selector]

    def describe(self) -> dict:
        out = {"name": self.selector, "world_size": self.world_size}
        if self.selector == "zeus_cost":
            out["eta_knob"] = self.eta_knob
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
            return zpl.ZeusCost(eta_knob=self.eta_knob, world_size=self.world_size)
        return zpl.MaxSlowdownConstraint(factor=self.max_slowdown_factor)

    def select(self, profiles: list[LimitProfile]) -> int:
        """The chosen limit (W) by Zeus's selector over per-step energy and time."""
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
        """The cost (unit :attr:`cost_unit`) of per-step energies (J) and times (s), measured or predicted.

        ``top_limit_W``: the highest profiled limit (ZeusCost's MaxPower is it times ``world_size``);
        ``top_time_per_step_s``: the time per step there (the max-slowdown reference).
        """
        energy_J, time_s = np.asarray(energy_per_step_J, dtype=float), np.asarray(time_per_step_s, dtype=float)
        if self.selector == "energy":
            return energy_J
        if self.selector == "time":
            return time_s
        if self.selector == "zeus_cost":
            max_power_W = top_limit_W * self.world_size
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

    def next_limit(self, profiled: Mapping[int, LimitProfile | None]) -> int | None:
        """The next limit to profile (None: done). ``profiled`` may hold limits whose values are pending."""
        return next((limit for limit in self.grid if limit not in profiled), None)

    def plan(self) -> dict:
        return {"search": self.name, "first_limits_W": list(self.grid), "min_limits": len(self.grid),
                "max_limits": len(self.grid)}

    def fell_back(self, profiled: Mapping[int, LimitProfile | None]) -> bool:
        return False


class AdaptiveSearch:
    """Fewer profiled limits: three spread limits, a quadratic model of energy and time, checks only where it pays.

    The maximum, the minimum and the middle of the grid are profiled first (highest first, as Zeus
    starts). Energy per step and time per step are each fitted by a quadratic in the limit (the V100
    study: both quadratic, R² ≈ 1; least squares beyond three points, or, where more than three points do
    not lie on one quadratic within ``tolerance``, through the three profiled limits around the best); the
    selector's cost is derived from the fitted energy and time, not fitted itself. Inside the bracket of
    the best profiled limit (its profiled neighbours: under a single valley the optimum lies there) a
    further limit is profiled only

    - where the fit predicts it to beat the best profiled limit by more than ``tolerance``;
    - or, the fit seeing no such gain, in the middle of a gap beside the best wider than
      :data:`TRUSTED_GAP_W` (the span over which the study's quadratic is trusted);
    - or, when the lowest limit is the best and the fitted cost bottoms out within a grid step of it,
      the next limit up (near the static draw energy per step turns up sharply: a hook).

    For max slowdown, the lowest limit of the bracket between the highest infeasible and the lowest
    feasible profiled limit that the fitted time puts within ``2 * tolerance`` of the constraint is
    profiled when the fitted energy promises a saving above ``tolerance``. :meth:`choose` trains at the
    fit's optimum where that lies between profiled limits (within a single valley its true cost is at
    most that of the worse bracket end), else at the selector's pick. When the profiled costs are not a
    single valley (max slowdown: times not non-increasing), the search falls back to Zeus's exhaustive
    sweep.

    Args:
        grid: the candidate limits (W).
        objective: what is minimised (or, for max slowdown, the time constraint).
        tolerance: the predicted gain (fraction of the best profiled cost or energy) that a check must
            promise; also the relative residual above which points are not taken as one quadratic and
            the step against the trend that :func:`_unimodal` counts as noise.
    """

    name = "adaptive"
    needs_measurements = True

    def __init__(self, grid: list[int], objective: Objective, tolerance: float = DEFAULT_TOLERANCE) -> None:
        if not grid:
            raise ValueError("the limit grid is empty")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
            raise ValueError(f"`tolerance` must be a number in [0, 1), got {tolerance!r}")
        self.grid = sorted(grid, reverse=True)
        self.objective = objective
        self.tolerance = float(tolerance)
        ascending = sorted(grid)
        coarse = [ascending[-1], ascending[0], ascending[(len(ascending) - 1) // 2]]
        self.coarse = list(dict.fromkeys(coarse))  # highest first, as Zeus starts

    def plan(self) -> dict:
        return {"search": self.name, "first_limits_W": list(self.coarse), "min_limits": len(self.coarse),
                "max_limits": len(self.grid)}

    def next_limit(self, profiled: Mapping[int, LimitProfile | None]) -> int | None:
        """The next limit to profile (None: done); every value in ``profiled`` must be known."""
        if any(p is None for p in profiled.values()):
            raise ValueError("the adaptive search needs the measurements of every profiled limit")
        remaining = [limit for limit in self.grid if limit not in profiled]
        if not remaining:
            return None
        first = next((limit for limit in self.coarse if limit not in profiled), None)
        if first is not None:
            return first
        if self.fell_back(profiled):
            return remaining[0]
        done = [profiled[limit] for limit in sorted(profiled)]
        if self.objective.is_threshold:
            return self._threshold_step(done, remaining)
        return self._cost_step(done, remaining)

    def fell_back(self, profiled: Mapping[int, LimitProfile | None]) -> bool:
        """True once the profiled points contradict a single valley (the sweep then profiles everything)."""
        done = [profiled[limit] for limit in sorted(profiled) if profiled[limit] is not None]
        if len(done) < 3:
            return False
        if self.objective.is_threshold:
            return not _non_increasing([p.time_per_step_s for p in done], MONOTONIC_TOLERANCE)
        costs = self.objective.costs(done)
        return not _unimodal([costs[p.limit_W] for p in done], self.tolerance)

    def fit(self, done: list[LimitProfile], around_W: int) -> tuple[np.ndarray, np.ndarray]:
        """Quadratic coefficients (highest power first) of energy (J) and time (s) per step vs the limit (W),
        fitted to the profiled limits (``done``, ascending), or, where they do not lie on one quadratic, to
        the three profiled limits around ``around_W``."""
        fit_to = done
        if len(done) > 3 and not self._quadratic(done):
            at = [p.limit_W for p in done].index(around_W)
            start = min(max(at - 1, 0), len(done) - 3)
            fit_to = done[start:start + 3]
        x = np.array([p.limit_W for p in fit_to], dtype=float)
        return (np.polyfit(x, [p.energy_per_step_J for p in fit_to], 2),
                np.polyfit(x, [p.time_per_step_s for p in fit_to], 2))

    def _quadratic(self, done: list[LimitProfile]) -> bool:
        """Whether energy and time per step each lie on one quadratic within ``tolerance`` (relative)."""
        x = np.array([p.limit_W for p in done], dtype=float)
        for y in ([p.energy_per_step_J for p in done], [p.time_per_step_s for p in done]):
            y = np.array(y, dtype=float)
            if float(np.max(np.abs(y - np.polyval(np.polyfit(x, y, 2), x)) / np.abs(y))) > self.tolerance:
                return False
        return True

    def _cost_model(self, done: list[LimitProfile], remaining: list[int]):
        """The best profiled limit, the unprofiled limits of its bracket, the fitted cost's coefficients
        (cost is linear in energy and time for these selectors, so a quadratic too) and the bracket."""
        measured = self.objective.costs(done)
        best = min(reversed(done), key=lambda p: measured[p.limit_W]).limit_W  # ties: the highest, as Zeus's selectors
        profiled = [p.limit_W for p in done]
        below = max((limit for limit in profiled if limit < best), default=None)
        above = min((limit for limit in profiled if limit > best), default=None)
        candidates = [limit for limit in remaining if (below or -math.inf) < limit < (above or math.inf)]
        energy, time_s = self.fit(done, best)
        cost = self.objective.cost_of(energy, time_s, max(profiled))
        return best, candidates, cost, (below, above)

    def _cost_step(self, done: list[LimitProfile], remaining: list[int]) -> int | None:
        best, candidates, cost, (below, above) = self._cost_model(done, remaining)
        if not candidates:
            return None
        predicted = {limit: float(np.polyval(cost, limit)) for limit in [best, *candidates]}
        pick = min(candidates, key=predicted.get)
        if predicted[pick] < predicted[best] - self.tolerance * abs(predicted[best]):
            return pick
        inward = self._hook_check(best, cost, remaining)
        if inward is not None:
            return inward
        return _untrusted_gap_middle([(below, best), (best, above)], remaining)

    def _hook_check(self, best: int, cost: np.ndarray, remaining: list[int]) -> int | None:
        """The next limit up when the lowest limit is the best and the fitted cost bottoms out above it or
        within a grid step below it: near the static draw a step's time, hence its energy, turns up sharply
        (a hook the quadratic through wider-spaced points cannot show)."""
        ascending = sorted(self.grid)
        if len(ascending) < 2 or best != ascending[0] or not cost[0] > 0:
            return None
        vertex = -cost[1] / (2 * cost[0])
        inward = ascending[1]
        return inward if vertex > best - (inward - best) and inward in remaining else None

    def choose(self, profiled: Mapping[int, LimitProfile]) -> int:
        """The limit to train at (W): for a cost selector the fit's optimum where it lies unprofiled in the
        bracket of the best profiled limit; otherwise (max slowdown, fallback, < 3 limits) Zeus's selector."""
        done = [profiled[limit] for limit in sorted(profiled)]
        zeus_pick = self.objective.select(done[::-1])
        remaining = [limit for limit in self.grid if limit not in profiled]
        if self.objective.is_threshold or len(done) < 3 or not remaining or self.fell_back(profiled):
            return zeus_pick
        best, candidates, cost, _ = self._cost_model(done, remaining)
        predicted = {limit: float(np.polyval(cost, limit)) for limit in [best, *candidates]}
        pick = min(candidates, key=predicted.get, default=best)
        return pick if predicted[pick] < predicted[best] else zeus_pick

    def _threshold_step(self, done: list[LimitProfile], remaining: list[int]) -> int | None:
        factor = self.objective.max_slowdown_factor
        top = max(done, key=lambda p: p.limit_W)
        limit_time_s = factor * top.time_per_step_s
        feasible = min(p.limit_W for p in done if p.time_per_step_s <= limit_time_s)
        floor_W = max((p.limit_W for p in done if p.limit_W < feasible), default=None)
        candidates = sorted(limit for limit in remaining if (floor_W or -math.inf) < limit < feasible)
        if not candidates:
            return None
        energy_fit, time_fit = self.fit(done, feasible)
        energy, time_s = np.polyval(energy_fit, [feasible] + candidates), np.polyval(time_fit, [feasible] + candidates)
        # the lowest limit that may meet the constraint: predicted within ``tolerance`` of it is worth a check
        fits = [limit for limit, t in zip(candidates, time_s[1:]) if t <= limit_time_s * (1.0 + 2.0 * self.tolerance)]
        if fits and energy[0] - energy[1 + candidates.index(fits[0])] > self.tolerance * abs(energy[0]):
            return fits[0]
        return _untrusted_gap_middle([(floor_W, feasible)], remaining)


def _untrusted_gap_middle(gaps: list[tuple[int | None, int | None]], remaining: list[int]) -> int | None:
    """The unprofiled limit nearest the middle of the widest gap wider than :data:`TRUSTED_GAP_W` (None: none).

    ``gaps``: (lower, upper) profiled limits (W) around the best one; ``None`` where the best is at an edge.
    """
    wide = [(upper - lower, lower, upper) for lower, upper in gaps
            if lower is not None and upper is not None and upper - lower > TRUSTED_GAP_W]
    if not wide:
        return None
    _, lower, upper = max(wide)
    inside = [limit for limit in remaining if lower < limit < upper]
    middle = (lower + upper) / 2
    return min(inside, key=lambda limit: (abs(limit - middle), limit)) if inside else None


def _unimodal(values: list[float], tolerance: float) -> bool:
    """Down then up (a single valley), steps against the trend within ``tolerance`` counted as noise."""
    if len(values) < 3:
        return True
    m = int(np.argmin(values))
    for i in range(len(values) - 1):
        a, b = values[i], values[i + 1]
        slack = tolerance * abs(a)
        if i < m and b > a + slack:
            return False
        if i >= m and b < a - slack:
            return False
    return True


def _non_increasing(values: list[float], tolerance: float) -> bool:
    return all(b <= a * (1.0 + tolerance) for a, b in zip(values, values[1:]))


def make_search(name: str, grid: list[int], objective: Objective, tolerance: float = DEFAULT_TOLERANCE):
    if name == "exhaustive":
        return ExhaustiveSweep(grid, objective)
    if name == "adaptive":
        return AdaptiveSearch(grid, objective, tolerance)
    raise ValueError(f"`search` must be one of {SEARCHES}, got {name!r}")


# ---------------------------------------------------------------------------------------------- files
def profile_document(profiles: list[LimitProfile], objective: Objective, chosen_W: int | None, **meta) -> dict:
    """The JSON document of a profile: Zeus's ``measurements`` plus costs, fits and how it was made."""
    ordered = sorted(profiles, key=lambda p: p.limit_W, reverse=True)
    costs = objective.costs(ordered)
    return {
        "format": PROFILE_FORMAT,
        **meta,
        "selector": objective.describe(),
        "cost_unit": objective.cost_unit,
        "chosen_limit_W": chosen_W,
        "measurements": [p.to_json(costs[p.limit_W]) for p in ordered],
        "fits": {name: (fit.as_dict() if fit is not None else None) for name, fit in profile_fits(ordered, objective).items()},
    }


def write_profile(path: str | os.PathLike, document: dict) -> Path:
    return atomic_write_json(path, document)


def read_profile(path: str | os.PathLike) -> tuple[list[LimitProfile], dict]:
    """Profiles and the whole document from a profile file of ours or of Zeus's ``GlobalPowerLimitOptimizer``.

    Zeus's files carry no ``steps``: their energy and time (one window each, all of the same length)
    are then compared per window.
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"power-limit profile {path} cannot be read: {err}") from err
    zpl = _zeus_power_limit()
    try:
        parsed = zpl._PowerLimitMeasurementList.parse_obj(document)
    except Exception as err:  # pydantic's ValidationError names the bad field
        raise ValueError(f"power-limit profile {path} is not a valid profile: {err}") from err
    rows = document["measurements"]
    profiles = []
    for row, m in zip(rows, parsed.measurements):
        steps = row.get("steps", 1) if isinstance(row, dict) else 1
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"power-limit profile {path}: `steps` of limit {m.power_limit} W must be an integer >= 1")
        profiles.append(LimitProfile(int(m.power_limit), float(m.energy), float(m.time), steps))
    if not profiles:
        raise ValueError(f"power-limit profile {path} holds no measurements")
    if len({p.limit_W for p in profiles}) != len(profiles):
        raise ValueError(f"power-limit profile {path} lists a power limit twice")
    return profiles, document


# ---------------------------------------------------------------------------------------------- fits and figure
FIT_QUANTITIES = ("energy_per_step_J", "time_per_step_s", "cost")


def _quantity(profiles: list[LimitProfile], objective: Objective, name: str) -> list[float]:
    if name == "cost":
        costs = objective.costs(profiles)
        return [costs[p.limit_W] for p in profiles]
    return [getattr(p, name) for p in profiles]


def profile_fits(profiles: list[LimitProfile], objective: Objective) -> dict:
    """Quadratic fit (with R²) of energy, time and cost per step vs the limit; None with < 3 limits."""
    from lightning_energy.analysis.fit import quadratic_fit

    x = [p.limit_W for p in profiles]
    fits = {}
    for name in FIT_QUANTITIES:
        fits[name] = quadratic_fit(x, _quantity(profiles, objective, name)) if len(set(x)) >= 3 else None
    return fits


def profile_figure(profiles: list[LimitProfile], objective: Objective, chosen_W: int | None):
    """A matplotlib Figure: energy, time and cost per step vs power limit, quadratic fits and R²."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ordered = sorted(profiles, key=lambda p: p.limit_W)
    fits = profile_fits(ordered, objective)
    x = np.array([p.limit_W for p in ordered], dtype=float)
    fig = Figure(figsize=(12.0, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    labels = {"energy_per_step_J": "energy per step (J)", "time_per_step_s": "time per step (s)",
              "cost": f"{objective.selector} cost ({objective.cost_unit})"}
    for ax, name in zip(axes, FIT_QUANTITIES):
        ax.plot(x, _quantity(ordered, objective, name), "o", label="profiled")
        fit = fits[name]
        if fit is not None:
            grid = np.linspace(x.min(), x.max(), 200)
            ax.plot(grid, fit(grid), "-", label=f"quadratic fit, R²={fit.r2:.3f}")
        if chosen_W is not None:
            ax.axvline(chosen_W, color="grey", ls="--", lw=1.0, label=f"chosen {chosen_W} W")
        ax.set(xlabel="power limit (W)", ylabel=labels[name])
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig


def write_figure_png(fig, path: str | os.PathLike) -> Path:
    """Save a figure as PNG through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(buffer.getvalue())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
