"""Issue 30 item 2: the DVFS model guides the adaptive search (``model_pruning=True``) while it holds: its optimum and
the pick's grid neighbours are measured before the pick, and a limit that measures off the model's prediction of it
abandons the model for branch and bound."""

from __future__ import annotations

import pytest

from lightning_energy.optimize.power_limit.dvfs_model import DvfsModel
from lightning_energy.optimize.power_limit.search import AdaptiveSearch, LimitProfile, Objective, limit_grid
from test_power_limit_search_cap import drive  # the search driven as the callback drives it, Zeus's step count

GRID = limit_grid(100, 400, 25)  # 13 limits
WARMUP_SHARE = 10 / 40
SWEEP_STEPS = len(GRID) * 50  # every limit once: 10 warm-up + 40 profile steps
CARD = DvfsModel(80.0, 480.0, 0.7, 0.01, 0.09)  # a DVFS curve with an interior energy optimum


def profiles(model: DvfsModel, off: dict[int, float] | None = None) -> dict[int, LimitProfile]:
    """Every grid limit's profile of ``model``; ``off``: limits whose time (and so energy) is scaled."""
    out = {}
    for x in GRID:
        scale = (off or {}).get(x, 1.0)
        out[x] = LimitProfile(x, float(model.energy_per_step_J(x)) * 40 * scale,
                              float(model.time_per_step_s(x)) * 40 * scale, 40)
    return out


@pytest.mark.parametrize("selector,knobs", [("energy", {}), ("zeus_cost", {"eta_knob": 0.5}),
                                            ("zeus_cost", {"eta_knob": 0.2}), ("time", {})])
def test_on_a_dvfs_curve_the_model_picks_a_measured_local_minimum_in_at_most_six_tenths_of_the_sweeps_steps(
        selector, knobs):
    truth = profiles(CARD)
    objective = Objective(selector, **knobs)
    search = AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True)
    order, seen, chosen, steps = drive(search, truth)
    assert search.model_state == "trusted", order
    assert steps <= 0.6 * SWEEP_STEPS, order
    costs = objective.costs(list(truth.values()))
    assert costs[chosen] <= min(costs.values()) * 1.02, (order, chosen)
    position = GRID.index(chosen)  # both grid neighbours of the pick were measured
    assert all(GRID[j] in seen for j in (position - 1, position + 1) if 0 <= j < len(GRID)), order
    # the branch and bound alone profiles more
    _, _, _, plain_steps = drive(AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE), truth)
    assert steps <= plain_steps


def test_a_limit_that_measures_off_the_models_prediction_abandons_the_model_and_branch_and_bound_finds_the_dip():
    objective = Objective("energy")
    guided = AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True)
    order, _, _, _ = drive(guided, profiles(CARD))
    first_guess = order[4]  # after the maximum twice, the minimum and two bisections: the model's first optimum
    truth = profiles(CARD, off={limit: 0.85 for limit in GRID if limit not in order[:4]})  # a dip the fit never saw
    search = AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True)
    order, seen, chosen, steps = drive(search, truth)
    assert first_guess in order and search.model_state == "abandoned", order
    costs = objective.costs(list(truth.values()))
    assert costs[chosen] <= min(costs.values()) * 1.02, (order, chosen)
    assert steps <= SWEEP_STEPS


def test_a_fresh_search_on_the_same_object_forgets_the_models_predictions():
    search = AdaptiveSearch(GRID, Objective("energy"), warmup_share=WARMUP_SHARE, model_pruning=True)
    first = drive(search, profiles(CARD))
    again = drive(search, profiles(CARD))
    assert first[0] == again[0] and search.model_state == "trusted"


def test_the_search_says_what_broke_the_model():
    """``model_abandoned_by``: "fit" or "prediction" on a clock-floor cliff, "prediction" for a limit that measured off
    what the model predicted before it was profiled (the model's optimum 13 % slower than its curve), "monotonic" when a lower limit runs
    faster (the fallback to the sweep), None while the model holds."""
    objective = Objective("energy")
    smooth = AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True)
    drive(smooth, profiles(CARD))
    assert smooth.model_state == "trusted" and smooth.model_abandoned_by is None

    def cliff(x):  # below 175 W time x 2.5 (a clock floor): the bottom limit breaks the DVFS fit
        return 2.5 if x < 175 else 1.0 + 0.03 * max(300 - x, 0) / 25

    truth = {x: LimitProfile(x, (0.9 * x if x < 175 else min(x, 300)) * cliff(x) * 40, cliff(x) * 40, 40)
             for x in GRID}
    broken = AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True)
    drive(broken, truth)
    assert broken.model_state == "abandoned" and broken.model_abandoned_by in ("fit", "prediction")
    # the minimum limit runs 30 % faster than the maximum: time is not monotonic (the fallback to the sweep)
    faster_low = profiles(CARD, off={GRID[-1]: 0.7 * CARD.time_per_step_s(GRID[0]) / CARD.time_per_step_s(GRID[-1])})
    reversed_ = AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True)
    drive(reversed_, faster_low)
    assert reversed_.model_abandoned_by == "monotonic"
    order, _, _, _ = drive(AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True),
                           profiles(CARD))
    first_guess = list(dict.fromkeys(order))[4]  # the model's optimum after its first fit (four limits)
    slower = profiles(CARD, off={first_guess: 1.13})  # 13 % slower there (same power) than the DVFS curve
    surprised = AdaptiveSearch(GRID, objective, warmup_share=WARMUP_SHARE, model_pruning=True)
    drive(surprised, slower)
    assert surprised.model_abandoned_by == "prediction"
    assert AdaptiveSearch(GRID, objective).model_abandoned_by is None  # no model: never abandoned

