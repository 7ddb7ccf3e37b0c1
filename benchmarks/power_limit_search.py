"""Power-limit search on curves it was not tuned to: success and profiling steps per curve family and selector.

Curve families (``FAMILIES``), each on three simulated cards (V100 150-300 W as in the power-limit study,
A100 100-400 W, H100 200-700 W; ``lightning_energy.simulate.gpu_sim``): the quadratic V100-study shape, an
interior energy optimum (the range reaches below the voltage floor), a voltage-floor kink, a memory-bound
(flat) step, a step that never reaches the upper limits (flat top), a cliff (a clock floor below which the
card throttles hard), discrete clock-bin plateaus, and a host-bound step (the card idles 40 % of a step).
Selectors: energy, time, ZeusCost with eta 0.2/0.5/0.8, max slowdown 1.1. Noise: every window's energy and
time are multiplied by independent Gaussian factors of 0, 1, 3 and 5 % (seeded per case, ``--reps``
repetitions; in a repetition the k-th window at a limit gets the same draw for both searches: a paired
comparison). Success is reported with its binomial standard error, and the paired difference (search -
sweep, per repetition) with its standard error: a difference within two of them is not a finding.

Steps are counted, not timed (Zeus's defaults): 1 wait step, then per window 10 warm-up steps (only after
a limit change: a repeated window right after its own limit needs none) and 40 profile steps. A pick
succeeds when its true cost (the noise-free model) is within 2 % of the true optimum over the whole grid;
for max slowdown, when it truly meets the constraint (2 % slack) with at most 2 % more energy than the
true pick.

Goal (issue 15), per family and selector: the adaptive search succeeds at least as often as the sweep with
at most half its profiling steps; where that cannot hold it should spend more steps, never pick worse
(verdicts: "goal", "more steps", "lower, within noise", "LOWER (significant)").
Both are reported per family x selector (all cards and noise levels pooled) and per card, for the families
above (``--sets tuned``: the search was developed against them) and for held-out families, cards and noise
seeds it was never run on while being developed (``--sets held-out``: ``HELD_OUT_FAMILIES``, seed + 1000).

Lower bound (the table "per card x selector" of each set): the fewest windows *any* search that learns
only by comparing measured costs needs in the worst case on a grid of n limits, plus the one calibration
window the adaptive search spends (the maximum twice in a row: 40 steps, no warm-up), counted in steps as
above. For a cost to minimise (energy, ZeusCost) over an arbitrary unimodal sequence this is the discrete
Fibonacci search's count (the smallest k with F(k+2) >= n+1, F(1) = F(2) = 1), computed exactly by a
game-tree recursion that also requires the pick to be measured (:func:`unimodal_min_windows`); for max
slowdown it is the maximum plus a binary search for the feasibility boundary (1 + ceil(log2 n): time never
falls at a lower limit); for time it is the maximum alone (the same fact makes it the optimum). These bound
searches that assume nothing of the curve beyond unimodality: one allowed to stop within the 2 % tolerance
on a flat curve may need fewer there, one that must survive cliffs and plateaus (not strictly unimodal)
may need more. Column "cmp 0%": the success of that worst-case optimal comparison search on the
noise-free curves of the card and selector (the pick within 2 % of the optimum); column "prior 0": the
adaptive search's steps on the noise-free curves when told ``noise=0`` (it then trusts the zero spread of
its calibration window instead of pooling it with the 3 % prior): what the noise prior costs without noise.

What a user pays (issue 30): beside each search, a sweep given the search's number of windows (Zeus's order,
stopped there, Zeus's selector over what it measured: "eq-bud"), and the energy regret of both over a run of
10^4 and 10^6 steps: every profiling window's steps at its limit and the rest of the run at the pick, against
every step at the selector's true optimum, in % of that run's energy (negative for time-weighted selectors: a
pick below the optimum saves energy and costs time). Set ``held-out issue 30``: a flat top, a gentle slope and a
clock-floor cliff written as curves (:class:`PlateauSlopeCliff`, 7 to 16 limits), never used while tuning.

Set ``held-out off-model`` (issue 30 item 2): shapes the search's DVFS model does not capture, written as curves
(:class:`OffModelCurve`: a thermal hump at the top, a memory-clock cliff with two minima, a non-DVFS power law) on
7, 13 and 25 limits. ``--model`` also runs the search with DVFS-model pruning (``model_pruning=True``) on the same
draws (columns "model"); the table "per grid size x noise x selector" gives both against the sweep.

Run: ``OMP_NUM_THREADS=1 python benchmarks/power_limit_search.py [--reps 300] [--jobs 2] [--model]``; writes
``benchmarks/results/power_limit_search.json``. Simulated clocks only: a shared machine does not disturb the
results (only the run time), and they do not depend on ``--jobs``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_energy.simulate.gpu_sim import SimulatedGPU, StepModel  # noqa: E402
from lightning_energy.io import atomic_write_text  # noqa: E402
from lightning_energy.optimize.power_limit.search import (  # noqa: E402
    AdaptiveSearch,
    ExhaustiveSweep,
    LimitProfile,
    Objective,
    limit_grid,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "power_limit_search.json"
WAIT_STEPS, WARMUP_STEPS, PROFILE_STEPS, PL_STEP_W = 1, 10, 40, 25  # Zeus's GlobalPowerLimitOptimizer defaults
WITHIN = 0.02  # a pick is good when its true cost is within 2 % of the optimum
GOAL_STEP_RATIO = 0.5
SIGNIFICANT_SE = 2.0  # a paired success difference below -2 standard errors is reported as significant
NOISE_LEVELS = (0.0, 0.01, 0.03, 0.05)
CARDS = {  # name: (min W, max W, static W, idle W)
    "V100 150-300 W": (150, 300, 60.0, 40.0),
    "A100 100-400 W": (100, 400, 80.0, 50.0),
    "H100 200-700 W": (200, 700, 140.0, 70.0),
}
SELECTORS = [("energy", {}), ("time", {}), ("zeus_cost", {"eta_knob": 0.2}), ("zeus_cost", {"eta_knob": 0.5}),
             ("zeus_cost", {"eta_knob": 0.8}), ("max_slowdown", {"max_slowdown_factor": 1.1})]


def demand_for(draw_W: float, static_W: float) -> float:
    """Full-utilisation demand that gives a draw of ``draw_W`` at the reference batch of 256."""
    return static_W + (draw_W - static_W) / (256 / (256 + 64))


def family_gpu(family: str, card: str) -> SimulatedGPU:
    """The simulated card of one curve family (see the module docstring)."""
    low, high, static, idle = CARDS[card]
    heavy = demand_for(1.16 * high, static)
    step = StepModel(demand_W=heavy, compute_fraction=0.9)
    options: dict = {}
    if family == "interior optimum":
        options = {"voltage_floor": 0.8}
        step = dataclasses.replace(step, demand_W=demand_for(1.5 * high, static))
    elif family == "voltage-floor kink":
        options = {"voltage_floor": 0.72}
    elif family == "memory-bound (flat)":
        step = dataclasses.replace(step, compute_fraction=0.2)
    elif family == "flat top":
        step = dataclasses.replace(step, demand_W=demand_for(0.75 * high, static), compute_fraction=0.7)
    elif family == "cliff (clock floor)":
        options = {"clock_floor": 0.78, "throttle_clock": 0.35}
    elif family == "clock-bin plateaus":
        options = {"clock_bins": 10}
    elif family == "host-bound":
        step = dataclasses.replace(step, host_s=0.4 * step.full_clock_time_s(256) / 0.6)
    return SimulatedGPU(gpu_index=99, min_limit_W=low, max_limit_W=high, default_limit_W=high, step=step,
                        static_W=static, idle_W=idle, **options)


FAMILIES = ("quadratic (V100 study)", "interior optimum", "voltage-floor kink", "memory-bound (flat)", "flat top",
            "cliff (clock floor)", "clock-bin plateaus", "host-bound")

# Held out: curve families, cards and noise seeds the search was never tuned on (other parameters, other ranges).
HELD_OUT_CARDS = {  # name: (min W, max W, static W, idle W)
    "A40 100-300 W": (100, 300, 70.0, 30.0),
    "RTX 4090 150-450 W": (150, 450, 90.0, 25.0),
    "L40S 200-350 W": (200, 350, 90.0, 35.0),
    # a 25-limit grid (no card's real range: an H100 SXM's floor is 200 W); static power below the floor, as the
    # simulator requires
    "wide 100-700 W": (100, 700, 90.0, 60.0),
}
HELD_OUT_FAMILIES = {  # name: (demand as a multiple of the max limit, compute fraction, host share, card options)
    "steep, low voltage floor": (1.35, 0.9, 0.0, {"voltage_floor": 0.5}),
    "deep voltage floor": (1.3, 0.9, 0.0, {"voltage_floor": 0.9}),
    "high cliff": (1.16, 0.9, 0.0, {"clock_floor": 0.88, "throttle_clock": 0.5}),
    "cliff with clock bins": (1.16, 0.85, 0.0, {"clock_floor": 0.7, "throttle_clock": 0.4, "clock_bins": 8}),
    "fine clock bins": (1.2, 0.9, 0.0, {"clock_bins": 16, "voltage_floor": 0.75}),
    "half memory-bound, host 20 %": (1.16, 0.5, 0.2, {}),
    "light step": (0.9, 0.8, 0.0, {}),
}
HELD_OUT_SEED_OFFSET = 1000


def held_out_gpu(family: str, card: str) -> SimulatedGPU:
    """The simulated card of one held-out curve family (parameters the search was not tuned on)."""
    low, high, static, idle = HELD_OUT_CARDS[card]
    demand, compute_fraction, host_share, options = HELD_OUT_FAMILIES[family]
    step = StepModel(demand_W=demand_for(demand * high, static), compute_fraction=compute_fraction)
    if host_share:
        step = dataclasses.replace(step, host_s=host_share * step.full_clock_time_s(256) / (1 - host_share))
    return SimulatedGPU(gpu_index=98, min_limit_W=low, max_limit_W=high, default_limit_W=high, step=step,
                        static_W=static, idle_W=idle, **options)


class PlateauSlopeCliff:
    """Issue 30's held-out shape, written as curves (not the simulator): a flat top (limits at or above
    ``top_W`` do not cap: same power and time), a gentle slope (below it the draw is the limit and time grows
    by ``slope`` per 25 W), then a clock-floor cliff (below ``floor_W`` the card throttles: time x ``cliff``,
    90 % of the limit drawn). Per step at the reference: 1 s, ``top_W`` W."""

    def __init__(self, low: int, high: int, top_W: float, floor_W: float, slope: float, cliff: float = 2.5) -> None:
        self.min_limit_W, self.max_limit_W = low, high
        self.top_W, self.floor_W, self.slope, self.cliff = top_W, floor_W, slope, cliff

    def step_time_s(self, limit_W: float) -> float:
        if limit_W < self.floor_W:
            return self.cliff
        return 1.0 + self.slope * max(self.top_W - limit_W, 0.0) / PL_STEP_W

    def step_energy_J(self, limit_W: float) -> float:
        power_W = 0.9 * limit_W if limit_W < self.floor_W else min(float(limit_W), self.top_W)
        return power_W * self.step_time_s(limit_W)


ISSUE30_FAMILY = "flat top, gentle slope, cliff"
ISSUE30_CARDS = {  # name: (min W, max W, flat above W, cliff below W, time slope per 25 W)
    "13 limits 100-400 W, slope 2 %": (100, 400, 300.0, 175.0, 0.02),
    "13 limits 100-400 W, slope 3 %": (100, 400, 300.0, 175.0, 0.03),
    "13 limits 100-400 W, slope 3.5 %": (100, 400, 300.0, 175.0, 0.035),
    "16 limits 150-525 W, slope 2.5 %": (150, 525, 425.0, 225.0, 0.025),
    "25 limits 100-700 W, slope 2 %": (100, 700, 550.0, 250.0, 0.02),
    "7 limits 150-300 W, slope 3 %": (150, 300, 250.0, 175.0, 0.03),
}


def issue30_gpu(family: str, card: str) -> PlateauSlopeCliff:
    return PlateauSlopeCliff(*ISSUE30_CARDS[card])


class OffModelCurve:
    """Shapes written as curves, not by the simulator, that the search's DVFS model
    (:mod:`lightning_energy.optimize.power_limit.dvfs_model`) does not capture: a smooth base (time rises as the
    square of the cut below ``knee`` of the range, up to ``1 + rise``; the card draws 97 % of the limit there and
    ``knee``'s draw above it), and on it

    - ``"thermal"``: the top limits run hot: time grows linearly above 80 % of the range to ``1 + thermal`` at
      the top (the top limit is slower than a lower one: monotonic time breaks);
    - ``"memory cliff"``: below 45 % of the range the memory clock drops: time x 1.15 and power x 0.85 there
      (two local minima of energy);
    - ``"power law"``: no cliff, but time goes as ``(max / L) ** 0.6`` below ``knee`` and the draw is 90 % of the
      limit plus 8 % of the range (a curve in the model's family only approximately).
    Per step at the top: 1 s."""

    def __init__(self, shape: str, low: int, high: int, knee: float = 0.85, rise: float = 0.6,
                 thermal: float = 0.04) -> None:
        self.shape, self.min_limit_W, self.max_limit_W = shape, low, high
        self.knee_W, self.rise, self.thermal = low + knee * (high - low), rise, thermal

    def step_time_s(self, limit_W: float) -> float:
        low, high = self.min_limit_W, self.max_limit_W
        cut = max(self.knee_W - limit_W, 0.0) / (self.knee_W - low)
        if self.shape == "power law":
            time = (self.knee_W / min(limit_W, self.knee_W)) ** 0.6
        else:
            time = 1.0 + self.rise * cut * cut
        if self.shape == "thermal" and limit_W > low + 0.8 * (high - low):
            time *= 1.0 + self.thermal * (limit_W - low - 0.8 * (high - low)) / (0.2 * (high - low))
        if self.shape == "memory cliff" and limit_W < low + 0.45 * (high - low):
            time *= 1.15
        return time

    def step_energy_J(self, limit_W: float) -> float:
        low, high = self.min_limit_W, self.max_limit_W
        capped = min(float(limit_W), self.knee_W)
        power_W = 0.9 * capped + 0.08 * (high - low) if self.shape == "power law" else 0.97 * capped
        if self.shape == "memory cliff" and limit_W < low + 0.45 * (high - low):
            power_W *= 0.85
        return power_W * self.step_time_s(limit_W)


OFF_MODEL_FAMILIES = ("thermal", "memory cliff", "power law")
OFF_MODEL_CARDS = {  # name: (min W, max W): 7, 13 and 25 limits of 25 W
    "7 limits 150-300 W": (150, 300),
    "13 limits 100-400 W": (100, 400),
    "25 limits 100-700 W": (100, 700),
}


def off_model_gpu(family: str, card: str) -> OffModelCurve:
    return OffModelCurve(family, *OFF_MODEL_CARDS[card])


CURVE_SETS = {  # name: (families, cards, card factory, seed offset)
    "tuned": (FAMILIES, CARDS, family_gpu, 0),
    "held-out": (tuple(HELD_OUT_FAMILIES), HELD_OUT_CARDS, held_out_gpu, HELD_OUT_SEED_OFFSET),
    "held-out issue 30": ((ISSUE30_FAMILY,), ISSUE30_CARDS, issue30_gpu, 2 * HELD_OUT_SEED_OFFSET),
    "held-out off-model": (OFF_MODEL_FAMILIES, OFF_MODEL_CARDS, off_model_gpu, 3 * HELD_OUT_SEED_OFFSET),
}
SEARCHES = ("sweep", "adaptive", "model")  # model: the adaptive search with DVFS-model pruning (``--model``)
CURVE_SET_IDS = {name: i for i, name in enumerate(CURVE_SETS)}
MAX_WINDOWS_PER_LIMIT = 12  # noise draws per limit and repetition (more than any search profiles one limit)


@functools.lru_cache(maxsize=None)
def _unimodal_plan(candidates: int, measured: int = -1) -> tuple[int, int]:
    """(fewest windows, the point to measure next) to find, in the worst case, the minimum of a strictly unimodal
    sequence of ``candidates`` points by comparing measured values, ending with the minimum measured.

    ``measured``: the index of the one point measured already (-1: none). Measuring point ``i`` beside the
    measured ``j`` and comparing them leaves, for ``a = min(i, j) < b = max(i, j)``, either the points below
    ``b`` (``a`` measured) or those above ``a`` (``b`` measured); the adversary picks the worse.
    """
    if candidates == 1:
        return (0, -1) if measured == 0 else (1, 0)
    best = (candidates + 1, -1)
    for i in range(candidates):
        if i == measured:
            continue
        if measured < 0:
            windows = 1 + _unimodal_plan(candidates, i)[0]
        else:
            a, b = min(i, measured), max(i, measured)
            windows = 1 + max(_unimodal_plan(b, a)[0], _unimodal_plan(candidates - a - 1, b - a - 1)[0])
        best = min(best, (windows, i))
    return best


def unimodal_min_windows(candidates: int) -> int:
    """Fewest windows that find the minimum of any strictly unimodal sequence of ``candidates`` points by
    comparisons, the minimum measured (the discrete Fibonacci search: smallest k with F(k+2) >= candidates + 1)."""
    return _unimodal_plan(candidates)[0]


def comparison_search(costs: list[float]) -> tuple[int, int]:
    """The worst-case optimal comparison search of :func:`_unimodal_plan` run on ``costs`` (ordered by limit; a
    tie goes to the higher limit): (index of its pick, windows measured). Right when ``costs`` is unimodal."""
    low, candidates, measured, windows = 0, len(costs), -1, 0
    while not (candidates == 1 and measured == 0):
        i = _unimodal_plan(candidates, measured)[1]
        windows += 1
        if measured < 0:
            measured = i
            continue
        a, b = min(i, measured), max(i, measured)
        if costs[low + a] < costs[low + b]:
            candidates, measured = b, a
        else:
            low, candidates, measured = low + a + 1, candidates - a - 1, b - a - 1
    return low, windows


def lower_bound_windows(selector: str, grid_limits: int) -> int:
    """The fewest windows (calibration excluded) a comparison-based search needs in the worst case (module
    docstring): ``selector`` is the benchmark's label ("energy", "zeus_cost 0.5", "max_slowdown 1.1", ...)."""
    if selector == "time":
        return 1
    if selector.startswith("max_slowdown"):
        return 1 + math.ceil(math.log2(grid_limits))
    return unimodal_min_windows(grid_limits)


def windows_to_steps(distinct_limit_windows: int, same_limit_windows: int = 0) -> int:
    """Profiling steps as the benchmark counts them: the wait, warm-up + profile per window at a new limit,
    profile alone for a window right after one at the same limit."""
    return WAIT_STEPS + distinct_limit_windows * (WARMUP_STEPS + PROFILE_STEPS) + same_limit_windows * PROFILE_STEPS


def true_profiles(gpu: SimulatedGPU, grid: list[int]) -> dict[int, LimitProfile]:
    return {x: LimitProfile(x, gpu.step_energy_J(x) * PROFILE_STEPS, gpu.step_time_s(x) * PROFILE_STEPS,
                            PROFILE_STEPS) for x in grid}


class PickJudge:
    """Whether a pick is good: its true cost within 2 % of the true optimum over the whole grid; for max
    slowdown, truly within the constraint (2 % slack) with at most 2 % more energy than the true pick."""

    def __init__(self, truth: dict[int, LimitProfile], objective: Objective) -> None:
        profiles = sorted(truth.values(), key=lambda p: p.limit_W, reverse=True)
        self.truth, self.objective = truth, objective
        self.best = objective.select(profiles)
        self.costs = objective.costs(profiles)

    def good(self, choice: int) -> bool:
        truth, objective = self.truth, self.objective
        if objective.is_threshold:
            top = truth[max(truth)]
            limit_s = objective.max_slowdown_factor * top.time_per_step_s * (1 + WITHIN)
            feasible = truth[choice].time_per_step_s <= limit_s
            return feasible and truth[choice].energy_J <= truth[self.best].energy_J * (1 + WITHIN)
        return self.costs[choice] <= self.costs[self.best] * (1 + WITHIN)


def run_search(search, truth: dict[int, LimitProfile], draws) -> tuple[int, int, int]:
    """Profile what the search asks for; the k-th window at a limit is the truth times ``draws(limit, k)``.

    Returns (profiling steps, windows, choice)."""
    return profile_run(search, truth, draws)[:3]


def profile_run(search, truth: dict[int, LimitProfile], draws, max_windows: float = math.inf):
    """Profile what the search asks for; the k-th window at a limit is the truth times ``draws(limit, k)``.

    Returns (profiling steps, windows, choice, the limits profiled in order); ``max_windows`` stops it early
    (the equal-budget sweep)."""
    seen: dict[int, LimitProfile] = {}
    steps, windows, previous, order = WAIT_STEPS, 0, None, []
    while windows < max_windows and (limit := search.next_limit(seen, previous)) is not None:
        order.append(limit)
        p = truth[limit]
        k = seen[limit].window_count if limit in seen else 0
        energy_factor, time_factor = draws(limit, k)
        window = LimitProfile(limit, p.energy_J * energy_factor, p.time_s * time_factor, p.steps)
        seen[limit] = seen[limit].merged(window) if limit in seen else window
        steps += PROFILE_STEPS + (WARMUP_STEPS if limit != previous else 0)
        windows += 1
        previous = limit
    return steps, windows, search.choose(seen), order


RUN_STEPS = (10_000, 1_000_000)  # training runs the energy regret is reported for


def regret_J(order: list[int], choice: int, truth: dict[int, LimitProfile], best: int, run_steps: int) -> float:
    """Energy (J) a run of ``run_steps`` steps pays beyond training every step at the true optimum ``best``:
    each profiling window's steps (warm-up + profile) at its limit, then the rest of the run at ``choice``."""
    optimum_J = truth[best].energy_per_step_J
    paid_J, steps, previous = 0.0, WAIT_STEPS, None
    for limit in order:
        window_steps = PROFILE_STEPS + (WARMUP_STEPS if limit != previous else 0)
        paid_J += window_steps * (truth[limit].energy_per_step_J - optimum_J)
        steps, previous = steps + window_steps, limit
    return paid_J + max(run_steps - steps, 0) * (truth[choice].energy_per_step_J - optimum_J)


def _case_seed(seed: int, curve_set: str, *indices: int) -> np.random.Generator:
    """An independent, reproducible noise stream per case (the same whatever the number of worker processes)."""
    return np.random.default_rng([seed, CURVE_SET_IDS[curve_set], *indices])


def _family_card_cases(args: tuple) -> list[dict]:
    """Every selector and noise level of one family on one card (one worker's share)."""
    reps, seed, curve_set, fi, ci, with_model = args
    families, cards, make_gpu, seed_offset = CURVE_SETS[curve_set]
    family, card = families[fi], list(cards)[ci]
    gpu = make_gpu(family, card)
    grid = limit_grid(gpu.min_limit_W, gpu.max_limit_W, PL_STEP_W)
    index = {limit: i for i, limit in enumerate(grid)}
    truth = true_profiles(gpu, grid)
    cases = []
    for si, (selector, knobs) in enumerate(SELECTORS):
        objective = Objective(selector, **knobs)
        label = selector + "".join(f" {v:g}" for v in knobs.values())
        judge = PickJudge(truth, objective)
        comparison_good = None
        if not objective.is_threshold:
            ascending = sorted(grid)
            costs = objective.costs([truth[x] for x in ascending])
            pick, _ = comparison_search([costs[x] for x in ascending])
            comparison_good = judge.good(ascending[pick])
        for ni, noise in enumerate(NOISE_LEVELS):
            rng = _case_seed(seed + seed_offset, curve_set, fi, ci, si, ni)
            n = 1 if noise == 0 else reps
            case = {"family": family, "card": card, "selector": label, "noise": noise, "reps": n,
                    "grid_limits": len(grid), "comparison_search_good": comparison_good,
                    "sweep": {"steps": [], "good": []},
                    "adaptive": {"steps": [], "good": [], "windows": []},
                    "model": {"steps": [], "good": []},
                    "equal_budget_sweep": {"steps": [], "good": []},
                    "regret_J": {f"{name} {n}": [] for name in SEARCHES for n in RUN_STEPS},
                    "optimum_energy_per_step_J": truth[judge.best].energy_per_step_J}
            for _ in range(n):
                table = 1 + noise * rng.standard_normal((len(grid), MAX_WINDOWS_PER_LIMIT, 2))

                def draws(limit, k, table=table):
                    return float(table[index[limit], k, 0]), float(table[index[limit], k, 1])

                runs = [("sweep", ExhaustiveSweep(grid, objective)),
                        ("adaptive", AdaptiveSearch(grid, objective, model_pruning=False))]
                if with_model:
                    runs.append(("model", AdaptiveSearch(grid, objective, model_pruning=True)))
                for name, search in runs:
                    steps, windows, choice, order = profile_run(search, truth, draws)
                    case[name]["steps"].append(steps)
                    case[name]["good"].append(judge.good(choice))
                    for run_steps in RUN_STEPS:
                        case["regret_J"][f"{name} {run_steps}"].append(
                            regret_J(order, choice, truth, judge.best, run_steps))
                    if name == "adaptive":
                        case[name]["windows"].append(windows)
                        # the sweep given the search's windows: Zeus's order, stopped there, choice from those
                        steps, _, choice, _ = profile_run(ExhaustiveSweep(grid, objective), truth, draws, windows)
                        case["equal_budget_sweep"]["steps"].append(steps)
                        case["equal_budget_sweep"]["good"].append(judge.good(choice))
            case["adaptive"]["windows_mean"] = float(np.mean(case["adaptive"]["windows"]))
            if noise == 0:  # what the noise prior costs when there is no noise: the search trusting zero spread
                trusting = AdaptiveSearch(grid, objective, noise=0.0, model_pruning=False)
                steps, _, choice = run_search(trusting, truth, lambda limit, k: (1.0, 1.0))
                case["adaptive_without_noise_prior"] = {"steps": steps, "good": judge.good(choice)}
            cases.append(case)
    return cases


def benchmark(reps: int, seed: int, curve_set: str = "tuned", jobs: int = 1, with_model: bool = False) -> list[dict]:
    """Every case of a curve set; ``jobs`` worker processes (the results do not depend on it)."""
    families, cards, _, _ = CURVE_SETS[curve_set]
    work = [(reps, seed, curve_set, fi, ci, with_model) for fi in range(len(families)) for ci in range(len(cards))]
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            parts = pool.map(_family_card_cases, work, chunksize=1)
    else:
        parts = [_family_card_cases(w) for w in work]
    return [case for part in parts for case in part]


def block(selected: list[dict]) -> dict:
    """Success (with its binomial standard error) and mean profiling steps of both searches over the cases,
    every repetition weighing the same; ``success_diff``: the paired difference adaptive - sweep (same noise
    draws) and its standard error."""
    out = {"cases": len(selected), "runs": sum(c["reps"] for c in selected)}
    for name in ("sweep", "adaptive"):
        steps = [s for c in selected for s in c[name]["steps"]]
        good = np.array([g for c in selected for g in c[name]["good"]], dtype=float)
        out[name] = {"success": float(good.mean()), "success_se": float(math.sqrt(good.mean() * (1 - good.mean())
                                                                                  / len(good))),
                     "steps_mean": float(np.mean(steps))}
    diff = np.array([a - s for c in selected for a, s in zip(c["adaptive"]["good"], c["sweep"]["good"])], dtype=float)
    out["success_diff"] = float(diff.mean())
    out["success_diff_se"] = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0
    equal = np.array([g for c in selected for g in c["equal_budget_sweep"]["good"]], dtype=float)
    out["equal_budget_sweep"] = {"success": float(equal.mean()),
                                 "success_se": float(math.sqrt(equal.mean() * (1 - equal.mean()) / len(equal))),
                                 "steps_mean": float(np.mean([s for c in selected
                                                              for s in c["equal_budget_sweep"]["steps"]]))}
    if selected[0]["model"]["steps"]:  # the search with DVFS-model pruning, paired with the sweep the same way
        good = np.array([g for c in selected for g in c["model"]["good"]], dtype=float)
        diff = np.array([a - s for c in selected for a, s in zip(c["model"]["good"], c["sweep"]["good"])], dtype=float)
        out["model"] = {"success": float(good.mean()), "success_se": float(math.sqrt(good.mean() * (1 - good.mean())
                                                                                      / len(good))),
                        "steps_mean": float(np.mean([s for c in selected for s in c["model"]["steps"]])),
                        "success_diff": float(diff.mean()),
                        "success_diff_se": float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0}
        out["model"]["step_ratio"] = out["model"]["steps_mean"] / out["sweep"]["steps_mean"]
        out["model"]["significantly_lower"] = (out["model"]["success_diff"]
                                               + SIGNIFICANT_SE * out["model"]["success_diff_se"] < 0)
    out["regret_percent"] = {}  # mean energy regret as % of the run's energy at the true optimum
    for key in selected[0]["regret_J"]:
        if not selected[0]["regret_J"][key]:
            continue
        run_steps = int(key.split()[-1])
        out["regret_percent"][key] = float(np.mean([100 * r / (run_steps * c["optimum_energy_per_step_J"])
                                                    for c in selected for r in c["regret_J"][key]]))
    out["step_ratio"] = out["adaptive"]["steps_mean"] / out["sweep"]["steps_mean"]
    out["success_not_lower"] = out["success_diff"] >= -1e-12
    out["significantly_lower"] = out["success_diff"] + SIGNIFICANT_SE * out["success_diff_se"] < 0
    out["goal_met"] = out["success_not_lower"] and out["step_ratio"] <= GOAL_STEP_RATIO
    return out


def summarise(cases: list[dict]) -> dict:
    selectors = list(dict.fromkeys(c["selector"] for c in cases))
    families = list(dict.fromkeys(c["family"] for c in cases))
    cards = list(dict.fromkeys(c["card"] for c in cases))
    return {
        "by_family_and_selector": {f: {s: block([c for c in cases if c["family"] == f and c["selector"] == s])
                                       for s in selectors} for f in families},
        "by_family_and_card": {f: {card: block([c for c in cases if c["family"] == f and c["card"] == card])
                                   for card in cards} for f in families},
        "by_selector": {s: block([c for c in cases if c["selector"] == s]) for s in selectors},
        "by_noise": {f"{noise:.0%}": block([c for c in cases if c["noise"] == noise]) for noise in NOISE_LEVELS},
        "all": block(cases),
        "by_grid_size": {f"{n} limits": {sel: block([c for c in cases if c["grid_limits"] == n and c["selector"] == sel])
                                         for sel in selectors}
                         for n in sorted({c["grid_limits"] for c in cases})},
        "by_card_and_selector": by_card_and_selector(cases),
        "by_grid_noise_selector": {
            f"{n} limits": {f"{noise:.0%}": {sel: block([c for c in cases if c["grid_limits"] == n
                                                         and c["noise"] == noise and c["selector"] == sel])
                                             for sel in selectors}
                            for noise in NOISE_LEVELS}
            for n in sorted({c["grid_limits"] for c in cases})},
    }


def format_grid_tables(summary: dict) -> str:
    """Per grid size x noise x selector: steps ratio and success against the sweep, regret (issue 30)."""
    has_model = any("model" in b for by_noise in summary["by_grid_noise_selector"].values()
                    for by_sel in by_noise.values() for b in by_sel.values())
    header = (f"{'grid':<10} {'noise':>5} {'selector':<17} {'sweep':>6} {'search':>6} {'diff':>6} {'±se':>5} "
              f"{'ratio':>5} {'rgS1e4':>6} {'rgA1e4':>6} {'rgS1e6':>6} {'rgA1e6':>6}")
    if has_model:
        header += f"  {'model':>6} {'diff':>6} {'±se':>5} {'ratio':>5} {'rgM1e4':>6}"
    lines = ["", "== per grid size x noise x selector (families and cards pooled; diff: paired, minus the sweep)",
             header, "-" * len(header)]
    for size, by_noise in summary["by_grid_noise_selector"].items():
        for noise, by_sel in by_noise.items():
            for sel, b in by_sel.items():
                r = b["regret_percent"]
                line = (f"{size:<10} {noise:>5} {sel:<17} {b['sweep']['success']:>6.1%} "
                        f"{b['adaptive']['success']:>6.1%} "
                        f"{b['success_diff']:>+6.1%} {b['success_diff_se']:>5.1%} {b['step_ratio']:>5.2f} "
                        f"{r['sweep 10000']:>6.2f} {r['adaptive 10000']:>6.2f} {r['sweep 1000000']:>6.3f} "
                        f"{r['adaptive 1000000']:>6.3f}" + ("  LOWER" if b["significantly_lower"] else ""))
                if "model" in b:
                    m = b["model"]
                    line += (f"  {m['success']:>6.1%} {m['success_diff']:>+6.1%} {m['success_diff_se']:>5.1%} "
                             f"{m['step_ratio']:>5.2f} {r['model 10000']:>6.2f}"
                             + (" LOWER" if m["significantly_lower"] else ""))
                lines.append(line)
    return "\n".join(lines)


def by_card_and_selector(cases: list[dict]) -> dict:
    """Per card and selector: the sweep's steps, half of them, the comparison lower bound (windows and steps,
    calibration included) and the adaptive search's mean steps and windows per noise level (families pooled)."""
    out: dict = {}
    for card in dict.fromkeys(c["card"] for c in cases):
        out[card] = {}
        for selector in dict.fromkeys(c["selector"] for c in cases):
            mine = [c for c in cases if c["card"] == card and c["selector"] == selector]
            grid_limits = mine[0]["grid_limits"]
            bound = lower_bound_windows(selector, grid_limits)
            sweep_steps = windows_to_steps(grid_limits)
            row = {"grid_limits": grid_limits, "sweep_steps": sweep_steps, "half_sweep_steps": sweep_steps / 2,
                   "bound_windows": bound + 1, "bound_steps": windows_to_steps(bound, 1),
                   "bound_steps_without_calibration": windows_to_steps(bound),
                   "search_steps": {}, "search_windows": {}}
            row["half_possible"] = row["bound_steps"] <= row["half_sweep_steps"]
            noise_free = [c["comparison_search_good"] for c in mine if c["noise"] == 0 and
                          c["comparison_search_good"] is not None]
            row["comparison_search_success_0"] = float(np.mean(noise_free)) if noise_free else None
            no_prior = [c["adaptive_without_noise_prior"] for c in mine if c["noise"] == 0]
            row["search_steps_without_noise_prior_0"] = float(np.mean([r["steps"] for r in no_prior]))
            row["search_success_without_noise_prior_0"] = float(np.mean([r["good"] for r in no_prior]))
            for noise in NOISE_LEVELS:
                at = [c for c in mine if c["noise"] == noise]
                row["search_steps"][f"{noise:.0%}"] = float(np.mean([np.mean(c["adaptive"]["steps"]) for c in at]))
                row["search_windows"][f"{noise:.0%}"] = float(np.mean([c["adaptive"]["windows_mean"] for c in at]))
            out[card][selector] = row
    return out


def format_bound_table(table: dict) -> str:
    header = (f"{'card':<20} {'selector':<17} {'n':>2} {'sweep':>5} {'1/2':>6} {'bound':>5} {'(win)':>5}  "
              f"{'search 0%':>9} {'(win)':>5} {'1%':>5} {'3%':>5} {'5%':>5} {'prior 0':>7} {'cmp 0%':>6}  1/2 possible")
    lines = ["", "== per card x selector: mean profiling steps (families pooled); bound: fewest windows of any "
                 "comparison-based search + 1 calibration window, (win): windows;",
             "   prior 0: the search at 0 % noise with noise=0 (trusting the calibration's zero spread, not the 3 % "
             "prior); cmp 0%: success of the worst-case optimal comparison search on the noise-free curves",
             header, "-" * len(header)]
    for card, rows in table.items():
        for selector, r in rows.items():
            steps, windows = r["search_steps"], r["search_windows"]
            success = r["comparison_search_success_0"]
            cmp_0 = "-" if success is None else f"{success:.0%}"
            lines.append(f"{card:<20} {selector:<17} {r['grid_limits']:>2} {r['sweep_steps']:>5} "
                         f"{r['half_sweep_steps']:>6.1f} {r['bound_steps']:>5} {r['bound_windows']:>5}  "
                         f"{steps['0%']:>9.0f} {windows['0%']:>5.1f} {steps['1%']:>5.0f} {steps['3%']:>5.0f} "
                         f"{steps['5%']:>5.0f} {r['search_steps_without_noise_prior_0']:>7.0f} {cmp_0:>6}  "
                         f"{'yes' if r['half_possible'] else 'NO (bound > 1/2)'}")
    return "\n".join(lines)


def format_row(label: str, b: dict) -> str:
    s, a, r = b["sweep"], b["adaptive"], b["regret_percent"]
    if b["goal_met"]:
        verdict = "goal"
    elif b["success_not_lower"]:
        verdict = "more steps"
    else:
        verdict = "LOWER (significant)" if b["significantly_lower"] else "lower, within noise"
    return (f"{label:<36} {s['success']:>6.1%} {s['success_se']:>5.1%} {s['steps_mean']:>5.0f}   {a['success']:>6.1%}"
            f" {a['success_se']:>5.1%} {a['steps_mean']:>5.0f}  {b['success_diff']:>+6.1%} {b['success_diff_se']:>5.1%}"
            f" {b['step_ratio']:>5.2f} {b['equal_budget_sweep']['success']:>6.1%}"
            f" {r['sweep 10000']:>6.2f} {r['adaptive 10000']:>6.2f} {r['sweep 1000000']:>6.3f}"
            f" {r['adaptive 1000000']:>6.3f}  {verdict}")


def format_tables(summary: dict) -> str:
    header = (f"{'':<36} {'sweep':>6} {'±se':>5} {'steps':>5}   {'search':>6} {'±se':>5} {'steps':>5}  {'diff':>6}"
              f" {'±se':>5} {'ratio':>5} {'eq-bud':>6} {'rgS1e4':>6} {'rgA1e4':>6} {'rgS1e6':>6} {'rgA1e6':>6}  verdict")
    lines = []
    for family, by_selector in summary["by_family_and_selector"].items():
        lines += ["", f"== {family} (per selector; cards and noise 0-5 % pooled; diff: paired search - sweep)",
                  header, "-" * len(header)]
        lines += [format_row(selector, b) for selector, b in by_selector.items()]
        lines += [format_row(f"  on {card}", b) for card, b in summary["by_family_and_card"][family].items()]
    lines += ["", "== all families, per selector", header, "-" * len(header)]
    lines += [format_row(selector, b) for selector, b in summary["by_selector"].items()]
    lines += ["", "== all families, per noise level", header, "-" * len(header)]
    lines += [format_row(f"noise {noise}", b) for noise, b in summary["by_noise"].items()]
    lines.append(format_row("all", summary["all"]))
    for size, by_selector in summary["by_grid_size"].items():
        lines += ["", f"== {size} (families, cards and noise 0-5 % pooled)", header, "-" * len(header)]
        lines += [format_row(selector, b) for selector, b in by_selector.items()]
    lines += ["", "eq-bud: success of a sweep stopped after the search's number of windows (Zeus's order); "
              "rgS/rgA 1e4/1e6: mean energy regret of sweep / search in % of a run of 10^4 / 10^6 steps at the true "
              "optimum (profiling windows at their limits + the rest of the run at the pick, against every step at "
              "the selector's true optimum; negative: less energy than the optimum, bought with time)"]
    return "\n".join(lines)


def goal_line(summary: dict) -> str:
    pairs = summary["by_family_and_selector"]
    met = sum(b["goal_met"] for f in pairs.values() for b in f.values())
    not_lower = sum(b["success_not_lower"] for f in pairs.values() for b in f.values())
    lower = [f"{f} / {s} ({b['success_diff']:+.1%} ± {b['success_diff_se']:.1%})"
             for f, by in pairs.items() for s, b in by.items() if not b["success_not_lower"]]
    total = sum(len(f) for f in pairs.values())
    return (f"success >= sweep in {not_lower} of {total} family x selector pairs, and at <= {GOAL_STEP_RATIO} of its "
            f"steps in {met}; lower success than the sweep: {', '.join(lower) or 'none'}")


def rounded(value, digits: int = 4):
    """``value`` with every float rounded to ``digits`` decimals (the JSON keeps summaries, not noise digits)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100, help="repetitions per noisy case (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sets", nargs="+", choices=sorted(CURVE_SETS), default=list(CURVE_SETS),
                        help="curve sets: the families the search was tuned on, and held-out families, cards and "
                             f"seeds (seed + {HELD_OUT_SEED_OFFSET})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (the results do not depend on it)")
    parser.add_argument("--model", action="store_true",
                        help="also run the adaptive search with DVFS-model pruning (model_pruning=True)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    start = time.perf_counter()
    print("power-limit search: success = the pick's true cost within 2 % of the optimum; steps = Zeus's "
          f"{WAIT_STEPS} wait + ({WARMUP_STEPS} warm-up after a limit change + {PROFILE_STEPS} profile) per window, "
          f"{PL_STEP_W} W grid; noisy cases x {args.reps}")
    results = {}
    for curve_set in args.sets:
        families, cards, _, seed_offset = CURVE_SETS[curve_set]
        cases = benchmark(args.reps, args.seed, curve_set, args.jobs, args.model)
        summary = summarise(cases)
        print(f"\n######## curve set: {curve_set} (noise seed {args.seed + seed_offset})")
        print(format_tables(summary))
        print(format_bound_table(summary["by_card_and_selector"]))
        print(format_grid_tables(summary))
        print("\n" + goal_line(summary))
        results[curve_set] = {  # summaries only (issue 30: the per-case list made the file 1.4 MB)
            "summary": summary,
            "families": list(families), "cards": {k: list(v) for k, v in cards.items()},
            "seed": args.seed + seed_offset,
        }
    result = {
        "sets": results,
        "settings": {"wait_steps": WAIT_STEPS, "warmup_steps": WARMUP_STEPS, "profile_steps": PROFILE_STEPS,
                     "pl_step_W": PL_STEP_W, "within": WITHIN, "noise_levels": list(NOISE_LEVELS), "reps": args.reps,
                     "seed": args.seed, "model_pruning_run": args.model},
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "note": "simulated clocks: counted steps, no timing"},
        "wall_s": time.perf_counter() - start,
    }
    atomic_write_text(args.out, json.dumps(rounded(result), separators=(",", ":")) + "\n")  # compact summaries
    print(f"wrote {args.out} ({result['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
