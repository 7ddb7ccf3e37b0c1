"""Issue 30 item 2: the DVFS model of power capping, its fit, and the adaptive search's model pruning (safe path:
the model is abandoned when profiles break it, a pick is always a measured limit, never more than the sweep)."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_energy.optimize.power_limit.dvfs_model import DvfsModel, consistent_predictions, fit_dvfs
from lightning_energy.optimize.power_limit.search import AdaptiveSearch, LimitProfile, Objective, limit_grid
from test_power_limit_search_cap import drive  # the search driven as the callback drives it, Zeus's step count

GRID = limit_grid(100, 400, 25)  # 13 limits
WARMUP_SHARE = 10 / 40


def profiles_of(energy, time, grid=GRID) -> dict[int, LimitProfile]:
    return {x: LimitProfile(x, float(energy(x)) * 40, float(time(x)) * 40, 40) for x in grid}


def model_profiles(model: DvfsModel, grid=GRID) -> dict[int, LimitProfile]:
    return profiles_of(model.energy_per_step_J, model.time_per_step_s, grid)


def cliff_profiles() -> dict[int, LimitProfile]:
    """A flat top, a gentle slope, and below 175 W a clock-floor cliff (time x 2.5, 90 % of the limit drawn)."""
    def time(x):
        return 2.5 if x < 175 else 1.0 + 0.03 * max(300 - x, 0) / 25

    def energy(x):
        return (0.9 * x if x < 175 else min(x, 300)) * time(x)
    return profiles_of(energy, time)


def plateau_profiles() -> dict[int, LimitProfile]:
    """Four clock bins: limits in one bin run the same clock and draw the same (plateaus of equal cost)."""
    def level(x):
        return min((x - 100) * 4 // 301, 3)

    return profiles_of(lambda x: (150 + 60 * level(x)) * (1.6 - 0.15 * level(x)), lambda x: 1.6 - 0.15 * level(x))


def thermal_profiles() -> dict[int, LimitProfile]:
    """A smooth curve whose top limits run hot: 8 % slower at the top than at 325 W."""
    def time(x):
        base = 1.0 + 0.6 * (max(355 - x, 0) / 255) ** 2
        return base * (1.0 + 0.08 * max(x - 325, 0) / 75)
    return profiles_of(lambda x: 0.97 * min(x, 355) * time(x), time)


KNOWN = [DvfsModel(80.0, 480.0, 0.7, 0.01, 0.09), DvfsModel(60.0, 300.0, 0.0, 0.05, 0.05),
         DvfsModel(70.0, 350.0, 0.8, 0.02, 0.08)]  # the last: uncapped above 350 W (a flat top)


@pytest.mark.parametrize("known", KNOWN)
def test_the_fit_recovers_known_parameters_from_a_synthetic_dvfs_curve(known):
    limits = [400, 350, 300, 250, 200, 150, 100]
    fit = fit_dvfs(limits, known.energy_per_step_J(np.array(limits)), known.time_per_step_s(np.array(limits)),
                   min_limit_W=100, max_limit_W=400)
    got = fit.model
    assert fit.max_residual < 2e-3
    assert got.compute_share == pytest.approx(known.compute_share, abs=0.03)
    assert got.static_W == pytest.approx(known.static_W, abs=10.0)
    if known.demand_W < 400:  # uncapped at the top: the demand is what the card draws there
        assert got.demand_W == pytest.approx(known.demand_W, rel=0.02)
    every = np.array(GRID, dtype=float)
    assert np.allclose(got.energy_per_step_J(every), known.energy_per_step_J(every), rtol=5e-3)
    assert np.allclose(got.time_per_step_s(every), known.time_per_step_s(every), rtol=5e-3)


def test_consistent_predictions_hold_a_dvfs_curve_and_reject_a_cliff_a_plateau_and_a_thermal_curve():
    limits = [400, 300, 250, 175, 150, 100]
    margins = [0.03] * len(limits)  # a window of 1 % noise at the search's 2.5 standard deviations, plus slack
    smooth = model_profiles(KNOWN[0])
    figures = lambda t: ([t[x].energy_per_step_J for x in limits], [t[x].time_per_step_s for x in limits])  # noqa: E731
    assert consistent_predictions(limits, *figures(smooth), margins, GRID) is not None
    for broken in (cliff_profiles(), plateau_profiles(), thermal_profiles()):
        assert consistent_predictions(limits, *figures(broken), margins, GRID) is None


@pytest.mark.parametrize("truth,states", [(model_profiles(KNOWN[0]), {"trusted"}),
                                          # one profiled limit below the cliff: the fit can absorb it (static power
                                          # just under the lowest limit); the pick must still be right (below)
                                          (cliff_profiles(), {"abandoned", "trusted"}),
                                          (plateau_profiles(), {"abandoned"}),
                                          # a hump at the one profiled top limit is within the noise margin
                                          (thermal_profiles(), {"abandoned", "trusted"})])
def test_the_search_abandons_the_model_on_shapes_it_does_not_capture_and_keeps_the_safe_path(truth, states):
    for objective in (Objective("energy"), Objective("zeus_cost", eta_knob=0.5), Objective("zeus_cost", eta_knob=0.2)):
        search = AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True)
        order, seen, chosen, steps = drive(search, truth)
        assert search.model_state in states, order
        assert chosen in seen and steps <= len(GRID) * 50, order
        best = objective.select(list(truth.values()))
        costs = objective.costs(list(truth.values()))
        assert costs[chosen] <= costs[best] * 1.02, (order, chosen, best)


@pytest.mark.parametrize("selector,knobs", [("energy", {}), ("zeus_cost", {"eta_knob": 0.5}), ("time", {})])
def test_with_model_pruning_a_pick_is_measured_and_the_steps_never_pass_the_sweeps_at_5_percent_noise(selector,
                                                                                                      knobs):
    rng = np.random.default_rng(11)
    for truth in (model_profiles(KNOWN[0]), cliff_profiles()):
        for _ in range(10):
            table = 1 + 0.05 * rng.standard_normal((len(GRID), 12, 2))
            search = AdaptiveSearch(GRID, Objective(selector, **knobs), warmup_share=WARMUP_SHARE,
                                    model_pruning=True)
            order, seen, chosen, steps = drive(search, truth, lambda x, k, t=table: tuple(t[GRID.index(x), k]))
            assert chosen in seen and steps <= len(GRID) * 50, order


def test_model_pruning_is_a_keyword_with_a_default_and_off_below_nine_limits():
    assert AdaptiveSearch(GRID, Objective("energy")).model_pruning is False
    assert AdaptiveSearch(limit_grid(150, 300, 25), Objective("energy"), model_pruning=True).model_state == "off"
    assert AdaptiveSearch(GRID, Objective("max_slowdown"), model_pruning=True).model_state == "off"
    with pytest.raises(ValueError, match="model_pruning"):
        AdaptiveSearch(GRID, Objective("energy"), model_pruning="yes")
