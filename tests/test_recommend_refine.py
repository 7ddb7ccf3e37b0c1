"""lightning-energy recommend's refinement: coordinate descent from the best confirmed configuration, one lever
moved at a time, each candidate's budget the best's energy to target (a cost model: no training)."""

from __future__ import annotations

import math

import pytest

from lightning_energy.optimize.recommend import Lever, RunOutcome, Search, find_levers, most_runs, select_levers

BALER_LIKE = {
    "trainer": {"max_epochs": 20, "accelerator": "cpu"},
    "model": {"model": "AE", "dtype": "float64", "loss": "sum", "lr": 0.001, "lr_patience": 50},
    "data": {"batch_size": 512, "val_fraction": 0.2, "shuffle": False},
}
BEST_BATCH, BEST_LR = 32, 0.003  # the bowl's bottom: 32 rows is beyond the screened batch sizes (128, 256, 1024)


class BowlRunner:
    """Energy to target (J) = 100 x (0.5 in float32) x (1 + 0.5 d²), d the distance from (32 rows, lr 0.003) in
    steps of x2 rows and x3 rate: levers interact, and the cheapest batch is beyond the screened values. A run past
    its budget stops there, as EnergyToAccuracy does."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, str, float | None]] = []

    def energy(self, settings: dict) -> float:
        batch, lr = settings.get("batch_size", 512), settings.get("lr", 0.001)
        d2 = math.log2(batch / BEST_BATCH) ** 2 + (math.log(lr / BEST_LR) / math.log(3)) ** 2
        return 100.0 * (0.5 if settings.get("dtype") == "float32" else 1.0) * (1 + 0.5 * d2)

    def __call__(self, settings, name, budget_J):
        self.calls.append((dict(settings), name, budget_J))
        energy_J = self.energy(settings)
        if budget_J is not None and energy_J > budget_J:
            return RunOutcome(False, budget_J, budget_J / 10, "energy budget", provenance="simulated")
        return RunOutcome(True, energy_J, energy_J / 10, "target", epochs=5, provenance="simulated")


def levers(names=("dtype", "batch_size", "lr")):
    return select_levers(find_levers(BALER_LIKE, device="cpu")[0], list(names))


def test_the_refinement_walks_past_the_screened_values_to_a_cheaper_configuration():
    runner = BowlRunner()
    result = Search(levers(), runner, repeats=2, screen_repeats=1, seed=1).run()  # the default: 2 rounds
    # screening and combination alone end at float32, batch 128, lr 0.003 (d² = 4): 150 J
    combined = next(t for t in result.trials if t.stage == "combined")
    assert combined.settings == {"dtype": "float32", "batch_size": 128, "lr": 0.003}
    assert combined.median("energy_J") == pytest.approx(150.0)
    # two rounds move one lever each, each time to the cheapest neighbour that beat the best: 64, then 32 rows
    pick = result.recommended
    assert pick.stage == "refine 2" and pick.complete(2)
    assert pick.settings == {"dtype": "float32", "batch_size": BEST_BATCH, "lr": BEST_LR}
    assert pick.median("energy_J") == pytest.approx(50.0)
    assert pick.median("energy_J") < combined.median("energy_J")
    row = next(r for r in result.rows() if r["status"] == "recommended")
    assert row["energy_ratio"] == pytest.approx(runner.energy({}) / pick.median("energy_J"))


def test_enough_rounds_reach_the_bottom_and_a_round_without_a_better_neighbour_ends_it():
    result = Search(levers(), BowlRunner(), repeats=2, screen_repeats=1, seed=2, refine_rounds=10).run()
    assert result.recommended.settings == {"dtype": "float32", "batch_size": BEST_BATCH, "lr": BEST_LR}
    stages = {t.stage for t in result.trials}
    assert "refine 3" in stages and "refine 4" not in stages  # two moves, then a round that found nothing


def test_each_candidate_must_beat_the_best_so_its_budget_is_the_best_energy():
    runner = BowlRunner()
    result = Search(levers(), runner, repeats=2, screen_repeats=1, seed=3).run()
    budget_of = {name: budget for _, name, budget in runner.calls}
    budgets = {}  # round -> the budgets of its candidates' screening runs
    for trial in result.trials:
        if trial.stage.startswith("refine"):
            name, outcome = trial.runs[0]
            budgets.setdefault(trial.stage, set()).add(budget_of[name])
            assert outcome.reached == (runner.energy(trial.settings) < budget_of[name])
    # one budget per round: the best's lowest energy to target when the round began (150 J, then 75 J)
    assert {stage: [round(b, 9) for b in found] for stage, found in budgets.items()} == {
        "refine 1": [150.0], "refine 2": [75.0]}
    lost = [t for t in result.trials if t.stage.startswith("refine") and t.lost]
    assert lost and all("(budget: the best's (" in t.lost for t in lost)


def test_the_refinement_keeps_to_the_run_budget_and_the_bound_on_runs():
    for cap in (17, 20, 23):
        result = Search(levers(), BowlRunner(), repeats=2, screen_repeats=1, budget_runs=cap).run()
        assert result.runs <= cap
    uncapped = Search(levers(), BowlRunner(), repeats=2, screen_repeats=1, refine_rounds=3).run()
    assert uncapped.runs <= most_runs(levers(), 1, 2, 3)
    assert most_runs(levers(), 1, 2, 0) == 1 * (1 + 7) + 2 * (3 + 3) - 2  # the confirmation's bound, unchanged
    assert most_runs(levers(), 1, 2, 2) == most_runs(levers(), 1, 2, 0) + 2 * (1 + 2 + 2 + 1)


def test_refine_rounds_zero_is_the_search_without_refinement():
    result = Search(levers(), BowlRunner(), repeats=2, screen_repeats=1, refine_rounds=0).run()
    assert not any(t.stage.startswith("refine") for t in result.trials)
    assert result.recommended.settings == {"dtype": "float32", "batch_size": 128, "lr": 0.003}
    with pytest.raises(ValueError, match="refine_rounds"):
        Search(levers(), BowlRunner(), refine_rounds=-1)


def test_neighbours_of_each_kind_of_lever():
    by_name = {lv.name: lv for lv in find_levers(BALER_LIKE, device="cpu")[0]}
    assert by_name["batch_size"].neighbours(128) == (64, 256)
    assert by_name["batch_size"].neighbours(8) == (16,)  # never under 8 rows
    assert by_name["batch_size"].neighbours(9) == (18,)  # 4 rows: too few
    assert by_name["lr"].neighbours(0.003) == (0.001, 0.009)
    assert by_name["dtype"].neighbours("float32") == ("float64",)
    assert by_name["precision"].neighbours("32-true") == ("bf16-mixed",)
    assert Lever("power_limit_W", None, None, (200.0, 250.0), "W").neighbours(200.0) == (None, 250.0)
    search = Search(levers(), BowlRunner())
    moved = search.neighbours({"batch_size": 128, "lr": 0.003})
    # a lever moved back to its baseline value leaves the settings; keys in the levers' order
    assert {"dtype": "float32", "batch_size": 128, "lr": 0.003} in moved
    assert {"lr": 0.003} not in moved and {"batch_size": 256, "lr": 0.003} in moved
    assert {"batch_size": 128} in moved  # lr 0.003 / 3 = the baseline's 0.001
    assert all(list(s) == [k for k in ("dtype", "batch_size", "lr") if k in s] for s in moved)


def test_the_command_says_how_many_runs_refinement_can_add(tmp_path, capsys):
    import yaml

    from lightning_energy.cli.main import main

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(BALER_LIKE))
    command = ["recommend", "--config", str(config), "--target", "val/loss=0.1", "--cli", "user.cli",
               "--levers", "dtype,batch_size,lr", "--dry-run"]
    assert main(command) == 0
    assert (f"1 run(s) each screened, 2 confirmed, 2 refinement round(s); at most {most_runs(levers(), 1, 2, 2)} runs"
            in capsys.readouterr().out)
    assert main(command + ["--refine-rounds", "0"]) == 0
    assert f"0 refinement round(s); at most {most_runs(levers(), 1, 2, 0)} runs" in capsys.readouterr().out
    assert main(command + ["--refine-rounds", "-1"]) == 2
    assert "--refine-rounds must be >= 0, got -1" in capsys.readouterr().err
