"""Issue 30: the sweep's profiling is a hard cap for the adaptive search, and exact ties end the settling."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_energy.optimize.power_limit.search import AdaptiveSearch, LimitProfile, Objective, limit_grid

WARMUP_SHARE = 10 / 40  # Zeus's 10 warm-up and 40 profile steps


def drive(search, truth, factors=None):
    """Profile what the search asks for (the k-th window at a limit: the truth times ``factors(limit, k)``);
    returns the limits in order, the merged profiles, the choice and the steps counted as Zeus counts them."""
    seen, order, steps = {}, [], 0
    while (limit := search.next_limit(seen, order[-1] if order else None)) is not None:
        steps += 40 + (10 if not order or order[-1] != limit else 0)
        order.append(limit)
        assert len(order) < 200
        p = truth[limit]
        e, t = factors(limit, seen[limit].window_count if limit in seen else 0) if factors else (1.0, 1.0)
        window = LimitProfile(limit, p.energy_J * e, p.time_s * t, p.steps)
        seen[limit] = seen[limit].merged(window) if limit in seen else window
    return order, seen, search.choose(seen), steps


def staircase(grid: list[int], bins: int) -> dict[int, LimitProfile]:
    """A clock staircase: ``bins`` plateaus of exactly equal energy and time (the 4-bin case of issue 30)."""
    out = {}
    for i, limit in enumerate(sorted(grid)):
        level = i * bins // len(grid)
        out[limit] = LimitProfile(limit, (100.0 + 3.0 * level) * 40, (1.6 - 0.15 * level) * 40, 40)
    return out


@pytest.mark.parametrize("selector,knobs", [("energy", {}), ("zeus_cost", {"eta_knob": 0.5}),
                                            ("zeus_cost", {"eta_knob": 0.2}), ("max_slowdown", {})])
@pytest.mark.parametrize("grid", [limit_grid(150, 300, 25), limit_grid(200, 350, 25), limit_grid(100, 400, 25)])
def test_never_more_profiling_steps_than_the_sweep_at_5_percent_noise(selector, knobs, grid):
    rng = np.random.default_rng(3)
    truth = staircase(grid, 4)
    sweep_steps = len(grid) * 50
    for _ in range(25):
        table = 1 + 0.05 * rng.standard_normal((len(grid), 12, 2))
        search = AdaptiveSearch(grid, Objective(selector, **knobs), warmup_share=WARMUP_SHARE)
        order, seen, chosen, steps = drive(search, truth, lambda x, k, t=table: tuple(t[grid.index(x), k]))
        assert steps <= sweep_steps and chosen in seen, order
        assert search.spent_windows * 40 == pytest.approx(steps)


def test_exact_ties_end_the_settling_on_a_staircase_without_noise():
    """621 steps against the sweep's 351 on a 4-bin staircase at 0 % noise (issue 30): the 3 % prior made the exact
    ties of each plateau look like near-ties. Windows that repeat exactly show there is no noise to settle."""
    grid = limit_grid(150, 300, 25)
    truth = staircase(grid, 4)
    for objective in (Objective("energy"), Objective("zeus_cost", eta_knob=0.5)):
        search = AdaptiveSearch(grid, objective, warmup_share=WARMUP_SHARE)
        order, seen, chosen, steps = drive(search, truth)
        assert steps <= 351, order
        assert chosen == objective.select(list(truth.values())), order
        assert all(p.window_count <= 2 for p in seen.values()), order  # no plateau settled by repeats


def test_the_cap_counts_windows_of_unknown_order_as_limit_changes():
    """A profile handed over at once (no ``previous``): every window is counted with its warm-up."""
    grid = limit_grid(150, 300, 25)
    truth = staircase(grid, 7)
    search = AdaptiveSearch(grid, Objective("energy"), warmup_share=WARMUP_SHARE)
    profiled = {x: truth[x] for x in grid[:-1]}
    search.next_limit(profiled)
    assert search.spent_windows == pytest.approx(6 * (1 + WARMUP_SHARE))
    assert search.sweep_cost() == pytest.approx(7 * (1 + WARMUP_SHARE))


def flat_slope_cliff(grid: list[int]) -> dict[int, LimitProfile]:
    """Issue 30's held-out shape on 7 limits: flat above 250 W, 3 % slower per 25 W below, a cliff below 175 W
    (time x 2.5, 90 % of the limit drawn). ZeusCost 0.5: only 175 W is within 2 % of the optimum."""
    out = {}
    for limit in grid:
        time = 2.5 if limit < 175 else 1.0 + 0.03 * max(250 - limit, 0) / 25
        power = 0.9 * limit if limit < 175 else min(limit, 250)
        out[limit] = LimitProfile(limit, power * time * 40, time * 40, 40)
    return out


def test_on_seven_limits_the_capped_search_is_not_less_successful_than_the_sweep_beside_a_cliff():
    """Issue 30: on 7 limits the calibration window and the cap leave at most 6 limits; preferring the gaps beside
    the (noisy) best profile spent them above it and left out 175 W (59.5 % against the sweep's 71.4 %). Under
    the cap on a small grid the most promising gap goes first. Paired draws at 3 % noise: no loss beyond 2 SE."""
    grid = limit_grid(150, 300, 25)
    truth = flat_slope_cliff(grid)
    objective = Objective("zeus_cost", eta_knob=0.5)
    costs = objective.costs(list(truth.values()))
    best = min(costs.values())
    rng = np.random.default_rng(30)
    diffs = []
    for _ in range(150):
        table = 1 + 0.03 * rng.standard_normal((len(grid), 12, 2))
        factors = lambda x, k, t=table: tuple(t[grid.index(x), k])  # noqa: E731
        sweep_pick = objective.select([LimitProfile(x, truth[x].energy_J * factors(x, 0)[0],
                                                    truth[x].time_s * factors(x, 0)[1], 40) for x in grid])
        order, seen, chosen, steps = drive(AdaptiveSearch(grid, objective, warmup_share=WARMUP_SHARE), truth, factors)
        assert steps <= len(grid) * 50
        diffs.append(float(costs[chosen] <= 1.02 * best) - float(costs[sweep_pick] <= 1.02 * best))
    diffs = np.array(diffs)
    assert diffs.mean() >= -2 * diffs.std(ddof=1) / np.sqrt(len(diffs)), diffs.mean()
