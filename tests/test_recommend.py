"""lightning-energy recommend: the search on a known cost model, the budget that stops a bad configuration, the
table, the recommended YAML, the target syntax; EnergyToAccuracy's budget and the catalog's energy to target."""

from __future__ import annotations

import math

import lightning as L
import pytest
import yaml

from conftest import trainer_kwargs
from lightning_energy.callbacks.catalog import CatalogCallback
from lightning_energy.callbacks.energy_to_accuracy import EnergyToAccuracy
from lightning_energy.catalog import Catalog
from lightning_energy.cli.main import main
from lightning_energy.cli.commands.recommend import format_effects, format_table
from lightning_energy.simulate.gpu_sim import SimulatedGPU, SimulatedWorkload
from lightning_energy.optimize.recommend import (
    RunOutcome, Search, SearchError, Target, find_levers, parse_target, select_levers,
)
from lightning_energy.optimize.recommend_config import (
    load_configs, merge, outcome_of, recommended_yaml, run_config, sensor_failures, with_levers,
)
from power_limit_helpers import ROWS, AccuracyModule, install_fake_time

# A Baler-like LightningCLI config (the keys of configs/cms_ae.yaml + configs/baler_parity.yaml)
BALER_LIKE = {
    "seed_everything": 0,
    "trainer": {"max_epochs": 20, "accelerator": "cpu", "callbacks": [
        {"class_path": "lightning_energy.EnergyCallback", "init_args": {"interval_s": 0.05}},
        {"class_path": "some_package.module.UserCheckpoint", "init_args": {"filename": "best"}}]},
    "model": {"model": "AE", "dtype": "float64", "loss": "sum", "lr": 0.001, "lr_patience": 50},
    "data": {"batch_size": 512, "val_fraction": 0.2, "shuffle": False},
}
BASE_J = 100.0  # the baseline's energy to target in the cost model
BASE_S = 10.0
# the cost model: each lever value multiplies the energy to target (1.0: the baseline's value)
FACTORS = {
    ("precision", "bf16-mixed"): 5.0,  # bf16 without hardware support: the bad configuration
    ("dtype", "float32"): 0.4,  # so the winners without it cost 2.5x the winners: stopped at the budget
    ("batch_size", 128): 0.6, ("batch_size", 256): 0.8, ("batch_size", 1024): 1.3,
    ("lr", 0.003): 0.7, ("lr", 0.01): 1.1, ("lr", 0.03): 3.0,
    ("lr_schedule", 3): 1.05,
    ("shuffle", True): 0.9,
    ("compile", True): 1.4,
}
CHEAPEST = {"dtype": "float32", "batch_size": 128, "lr": 0.003, "shuffle": True}
UNLISTED = 1.5  # a value the table does not list (a refinement's step, e.g. batch 64): costs more


class CostModelRunner:
    """A runner that trains nothing: energy to target = BASE_J x the factors of the settings, with a small
    alternating spread over repeats; honours the budget as EnergyToAccuracy does (stops at the budget)."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, str, float | None]] = []

    def __call__(self, settings, name, budget_J):
        repeat = sum(1 for done, _, _ in self.calls if done == settings)
        self.calls.append((dict(settings), name, budget_J))
        factor = math.prod(FACTORS.get((k, v), UNLISTED) for k, v in settings.items())
        wobble = 1.0 + 0.01 * (-1) ** repeat  # +-1 % between a configuration's repeats, never enough to reorder
        energy_J, time_s = BASE_J * factor * wobble, BASE_S * factor * wobble
        if budget_J is not None and energy_J > budget_J:
            return RunOutcome(False, budget_J, time_s * budget_J / energy_J, "energy budget", provenance="simulated")
        return RunOutcome(True, energy_J, time_s, "target", epochs=5, gCO2e=energy_J / 3.6e6 * 475.0,
                          provenance="simulated")


def baler_levers(names=None):
    levers, notes = find_levers(BALER_LIKE, device="cpu")
    return select_levers(levers, names), notes


def test_levers_of_a_baler_like_config_and_the_power_limit_note():
    levers, notes = baler_levers()
    found = {lever.name: (lever.path, lever.baseline, lever.alternatives) for lever in levers}
    assert found == {
        "precision": ("trainer.precision", "32-true", ("bf16-mixed",)),
        "dtype": ("model.dtype", "float64", ("float32",)),
        "batch_size": ("data.batch_size", 512, (128, 256, 1024)),
        "lr": ("model.lr", 0.001, (0.003, 0.01, 0.03)),
        "lr_schedule": ("model.lr_patience", 50, (3,)),
        "shuffle": ("data.shuffle", False, (True,)),
        "compile": (None, False, (True,)),
    }
    assert any(n.startswith("power limit: not explored (training runs on the CPU") for n in notes)
    gpu_levers, _ = find_levers(BALER_LIKE, device="cuda", power_limits_W=[200.0, 250.0])
    assert [lv.alternatives for lv in gpu_levers if lv.name == "power_limit_W"] == [(200.0, 250.0)]
    assert [lv.alternatives for lv in gpu_levers if lv.name == "precision"] == [("bf16-mixed", "16-mixed")]
    with pytest.raises(ValueError, match="unknown lever"):
        select_levers(levers, ["warp_drive"])


def test_the_search_recommends_the_cheapest_combination_and_stops_the_bad_one_early():
    levers, _ = baler_levers()
    runner = CostModelRunner()
    # the screening and confirmation stages alone (the refinement is tested below)
    result = Search(levers, runner, repeats=2, beta=2.0, seed=3, target=Target("val/loss", 0.1, "min"),
                    screen_repeats=1, refine_rounds=0).run()
    assert result.recommended.settings == CHEAPEST
    assert result.winners == CHEAPEST
    # the baseline ran first, alone, and never had a budget; a screened lever's budget was the baseline's
    # energy (past it, it cannot win); a combination's was 2 x the best finished so far (Zeus's rule)
    assert runner.calls[0] == ({}, "r000_baseline", None)
    outcomes = {name: outcome for trial in result.trials for name, outcome in trial.runs}
    assert [name for _, name, _ in runner.calls] == result.order
    baseline_J = best = outcomes["r000_baseline"].energy_J
    screening = 1 + 11  # the baseline, then the 11 alternatives once each
    for index, (settings, name, budget) in enumerate(runner.calls[1:], start=1):
        expected = None if settings == {} else baseline_J if index < screening else 2.0 * best
        assert budget == (expected if expected is None else pytest.approx(expected, rel=1e-12))
        best = min(best, outcomes[name].energy_J) if outcomes[name].reached else best
    # bf16 (5x the baseline's energy) passed the budget: stopped at it, never repeated
    bf16 = next(t for t in result.trials if t.settings == {"precision": "bf16-mixed"})
    assert len(bf16.runs) == 1 and not bf16.runs[0][1].reached
    assert bf16.lost == f"energy budget after {baseline_J:.4g} J (budget: the baseline's {baseline_J:.4g} J)"
    # shuffling helps a little (0.9x) and dtype a lot (0.4x): shuffle still made it into the combination
    # confirmation: the baseline, the combination and each leave-one-out ran `repeats` times
    confirmed = {t.name: t for t in result.trials if t.stage in ("baseline", "combined", "leave one out")}
    without_dtype = confirmed.pop("batch_size=128, lr=0.003, shuffle=True")
    assert len(without_dtype.runs) == 1 and without_dtype.lost.startswith("energy budget")
    assert len(confirmed) == 1 + len(CHEAPEST) and all(len(t.runs) == 2 for t in confirmed.values())
    # the best single change (0.4x) is confirmed too: at 2.5x the winners' energy its run stops at the budget
    best_single = next(t for t in result.trials if t.settings == {"dtype": "float32"})
    assert len(best_single.runs) == 2 and best_single.runs[1][1].stopped == "energy budget"
    assert result.runs == 1 + 11 + 1 + 2 + 2 * len(CHEAPEST) - 1 + 1  # baseline + 11 screened; confirmation
    rows = {r["config"]: r for r in result.rows()}
    best_row = rows["dtype=float32, batch_size=128, lr=0.003, shuffle=True"]
    assert best_row["status"] == "recommended" and best_row["provenance"] == "simulated"
    assert best_row["energy_ratio"] == pytest.approx(1 / (0.4 * 0.6 * 0.7 * 0.9), rel=0.03)
    assert best_row["energy_J_pm"] == pytest.approx(0.01 * best_row["energy_J"], rel=0.05)
    # what each lever gave, alone and left out of the combination
    effects = {(e["lever"], e["value"]): e for e in result.lever_effects()}
    assert effects[("dtype", "float32")]["alone_x"] == pytest.approx(2.5, rel=0.03)
    assert effects[("dtype", "float32")]["in_combination_x"] == pytest.approx(2.0, rel=0.03)  # its budget
    assert effects[("dtype", "float32")]["in_combination_at_least"] is True
    assert effects[("lr", 0.003)]["in_combination_x"] == pytest.approx(1 / 0.7, rel=0.03)
    assert effects[("lr", 0.003)]["in_combination_at_least"] is False
    assert effects[("batch_size", 256)]["winner"] is False
    text = format_table(result.rows())
    for column in ("energy J", "time s", "gCO2e", "±", "energy is", "status"):
        assert column in text.splitlines()[0]
    assert "lost: energy budget" in text and "simulated" in text
    assert "left out: x more J" in format_effects(result.lever_effects())


def test_the_run_order_is_random_but_the_recommendation_is_not():
    levers, _ = baler_levers(["dtype", "batch_size", "lr"])
    orders, picks = [], []
    for seed in (0, 1, 2):
        result = Search(levers, CostModelRunner(), repeats=2, seed=seed).run()
        orders.append([n.split("_", 1)[1] for n in result.order])
        picks.append(result.recommended.settings)
    assert len({tuple(o) for o in orders}) > 1
    assert picks == [{"dtype": "float32", "batch_size": 128, "lr": 0.003}] * 3


def test_a_baseline_that_never_reaches_the_target_is_an_error():
    def never(settings, name, budget_J):
        return RunOutcome(False, 50.0, 5.0, "max epochs")

    with pytest.raises(SearchError, match="baseline did not reach the target"):
        Search(baler_levers()[0], never).run()


def test_the_run_budget_caps_the_runs():
    result = Search(baler_levers()[0], CostModelRunner(), repeats=2, budget_runs=5).run()
    assert result.runs == 5 and result.budget_exhausted


def test_confirmation_runs_in_rounds_so_a_short_budget_still_measures_the_combination():
    # screening: 12 runs; round one of confirmation: baseline, best single, combination, 4 leave-one-out
    result = Search(baler_levers()[0], CostModelRunner(), repeats=2, screen_repeats=1, budget_runs=12 + 7).run()
    combined = next(t for t in result.trials if t.stage == "combined")
    leave_one_out = [t for t in result.trials if t.stage == "leave one out"]
    assert result.budget_exhausted and len(combined.runs) >= 1 and all(len(t.runs) >= 1 for t in leave_one_out)


def test_recommended_yaml_round_trips_with_the_chosen_values():
    levers = {lv.name: lv for lv in baler_levers()[0]}
    settings = {"dtype": "float32", "batch_size": 128, "compile": True}
    text = recommended_yaml(BALER_LIKE, levers, settings, Target("val/loss", 0.25, "min"), ["chosen: x"])
    assert text.startswith("# chosen: x\n")
    config = yaml.safe_load(text)
    assert config["model"]["dtype"] == "float32" and config["data"]["batch_size"] == 128
    assert config["model"]["lr"] == 0.001 and config["data"]["shuffle"] is False  # the rest as given
    names = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert names == ["lightning_energy.EnergyCallback", "some_package.module.UserCheckpoint",
                     "lightning_energy.EnergyToAccuracy", "lightning_energy.CompileModel"]
    assert config["trainer"]["callbacks"][0]["init_args"] == {"interval_s": 0.05}  # the user's sensors kept
    assert config["trainer"]["callbacks"][2]["init_args"] == {"monitor": "val/loss", "target": 0.25, "mode": "min",
                                                              "stop": True}
    assert BALER_LIKE["model"]["dtype"] == "float64"  # the user's config is not modified


def test_recommended_yaml_is_a_config_lightning_cli_runs(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    base = {"seed_everything": 0, "trainer": {"max_epochs": 3, "accelerator": "cpu", "logger": False,
                                              "enable_checkpointing": False, "enable_progress_bar": False},
            "model": {"class_path": "lightning_energy.simulate.example_model.TinyAutoencoder",
                      "init_args": {"n_train": 64, "n_val": 32, "batch_size": 32, "lr": 0.001}}}
    levers = {lv.name: lv for lv in find_levers(base)[0]}
    assert levers["batch_size"].path == "model.init_args.batch_size"
    path = tmp_path / "recommended.yaml"
    path.write_text(recommended_yaml(base, levers, {"lr": 0.01, "batch_size": 16}, Target("val/loss", 0.5, "min"), []))
    monkeypatch.setattr("sys.argv", ["recommended"])
    cli = LightningCLI(subclass_mode_model=True, run=False, args=["--config", str(path)], save_config_callback=None)
    assert cli.model.hparams.lr == 0.01 and cli.model.hparams.batch_size == 16
    eta = next(c for c in cli.trainer.callbacks if isinstance(c, EnergyToAccuracy))
    assert (eta.monitor, eta.target, eta.mode, eta.stop) == ("val/loss", 0.5, "min", True)


def test_a_run_config_names_the_run_sets_its_budget_and_folder(tmp_path):
    levers = {lv.name: lv for lv in baler_levers()[0]}
    config = run_config(BALER_LIKE, levers, {"lr": 0.01}, Target("val/loss", 0.2, "min"), 12.5, tmp_path / "r1",
                        tmp_path / "cat.sqlite", "r001_lr-0.01")
    callbacks = {c["class_path"].rpartition(".")[2]: c.get("init_args") for c in config["trainer"]["callbacks"]}
    assert callbacks["EnergyToAccuracy"]["budget_J"] == 12.5
    assert callbacks["CatalogCallback"]["config"]["recommend_run"] == "r001_lr-0.01"
    assert callbacks["CatalogCallback"]["config"]["lr"] == 0.01
    assert callbacks["CatalogCallback"]["config"]["batch_size"] == 512  # the baseline's value, for compare --by
    assert "CompileModel" not in callbacks and config["trainer"]["default_root_dir"] == str(tmp_path / "r1")
    # a config without an EnergyCallback gets one
    bare = with_levers({"model": {"lr": 0.1}}, {}, {}, Target("val/loss", 1.0, "min"))
    assert bare["trainer"]["callbacks"][0] == {"class_path": "lightning_energy.EnergyCallback"}


def test_configs_merge_as_lightning_cli_merges_them(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("trainer:\n  max_epochs: 5\n  callbacks:\n    - class_path: x.A\n"
                     "model:\n  lr: 0.1\n  dtype: float32\n")
    second.write_text("trainer:\n  callbacks+:\n    - class_path: x.B\nmodel:\n  dtype: float64\n")
    merged = load_configs([first, second])
    assert merged == {"trainer": {"max_epochs": 5, "callbacks": [{"class_path": "x.A"}, {"class_path": "x.B"}]},
                      "model": {"lr": 0.1, "dtype": "float64"}}
    assert merge({"a": [1]}, {"a": [2]}) == {"a": [2]}  # a list replaces


def test_outcome_of_a_catalog_record():
    common = {"id": 7, "provenance": "estimated", "intensity_g_per_kWh": 400.0, "pue": 1.5, "energy_J": 90.0,
              "duration_s": 9.0}
    reached = outcome_of({**common, "metrics": {"energy_to_target_J": 72.0, "time_to_target_s": 6.0,
                                                "epochs_to_target": 4.0}})
    assert (reached.reached, reached.energy_J, reached.time_s, reached.epochs) == (True, 72.0, 6.0, 4)
    assert reached.gCO2e == pytest.approx(72.0 / 3.6e6 * 400.0 * 1.5) and reached.provenance == "estimated"
    gave_up = outcome_of({**common, "metrics": {"target_budget_exceeded": 1.0, "energy_at_give_up_J": 30.0,
                                                "time_at_give_up_s": 3.0}})
    assert (gave_up.reached, gave_up.stopped, gave_up.energy_J) == (False, "energy budget", 30.0)
    nothing = outcome_of({**common, "metrics": {"energy_to_target_J": 0.0, "time_to_target_s": 12.1,
                                                "epochs_to_target": 48.0}})  # a sensor hung from the start
    assert not nothing.reached and nothing.stopped == "failed: 0 J to the target: nothing measured"
    ran_out = outcome_of({**common, "metrics": {"val/loss": 0.3}})
    assert (ran_out.reached, ran_out.stopped, ran_out.energy_J) == (False, "max epochs", 90.0)


@pytest.mark.parametrize("text", ["val/loss", "val/loss=abc", "val/acc=0.9", "=0.1", "val/loss=inf"])
def test_bad_target_is_one_line_and_exit_2(tmp_path, capsys, text):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  lr: 0.1\n")
    assert main(["recommend", "--config", str(config), "--target", text, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lightning-energy recommend: error: --target")
    assert not (tmp_path / "o").exists()


def test_target_forms():
    assert parse_target("val/loss=0.01") == Target("val/loss", 0.01, "min")
    assert parse_target("val/acc>=0.9") == Target("val/acc", 0.9, "max")
    assert parse_target(" val/loss <= 2e-3 ") == Target("val/loss", 0.002, "min")
    assert str(parse_target("val/loss=0.01")) == "val/loss<=0.01"


def test_dry_run_lists_the_levers(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(BALER_LIKE))
    assert main(["recommend", "--config", str(config), "--target", "val/loss=0.1", "--cli", "user.cli",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dtype" in out and "float64 -> float32" in out and "power limit: not explored" in out


# ---------------------------------------------------------------- EnergyToAccuracy's budget, on fake time
BATCH = 64  # 16 steps per epoch of AccuracyModule (val/acc 0.2, 0.4, ... per epoch)


def fit_with_budget(tmp_path, monkeypatch, eta, epochs, catalog=None):
    clock = install_fake_time(monkeypatch.setattr)
    gpu = SimulatedGPU(clock=clock)
    eta._user_sensors = [gpu.energy_sensor()]
    extra = [catalog] if catalog is not None else []
    if catalog is not None:
        catalog._user_sensors = eta._user_sensors
    trainer = L.Trainer(callbacks=[eta, SimulatedWorkload(gpu=gpu), *extra], **trainer_kwargs(
        tmp_path, max_epochs=epochs, logger=False, num_sanity_val_steps=0))
    trainer.fit(AccuracyModule(batch_size=BATCH))
    return trainer, gpu


def test_budget_ends_a_run_that_has_not_reached_the_target(tmp_path, monkeypatch):
    epoch_J = ROWS // BATCH * SimulatedGPU().step_energy_J(300, BATCH)  # the model's figure: no validation cost
    eta = EnergyToAccuracy("val/acc", target=0.95, stop=True, budget_J=1.5 * epoch_J)
    catalog = CatalogCallback(tmp_path / "cat.sqlite", count_flops=False)
    trainer, gpu = fit_with_budget(tmp_path, monkeypatch, eta, epochs=5, catalog=catalog)
    assert trainer.current_epoch == 2 and eta.result is None  # epoch 1: under the budget; epoch 2: past it
    assert eta.gave_up["energy_J"] == pytest.approx(2 * epoch_J, rel=1e-9)
    assert eta.gave_up["epochs"] == 2 and "energy" in eta.gave_up["reason"]
    record = Catalog(tmp_path / "cat.sqlite").list()[-1]
    assert record["metrics"]["target_budget_exceeded"] == 1.0
    assert record["metrics"]["energy_at_give_up_J"] == pytest.approx(2 * epoch_J, rel=1e-9)


def test_budget_leaves_a_run_that_reaches_the_target_alone_and_the_catalog_keeps_its_figures(tmp_path, monkeypatch):
    eta = EnergyToAccuracy("val/acc", target=0.5, stop=True, budget_J=1e9)
    catalog = CatalogCallback(tmp_path / "cat.sqlite", count_flops=False)
    trainer, gpu = fit_with_budget(tmp_path, monkeypatch, eta, epochs=5, catalog=catalog)
    steps = 3 * ROWS // BATCH
    assert trainer.current_epoch == 3 and eta.gave_up is None
    record = Catalog(tmp_path / "cat.sqlite").list()[-1]
    assert record["metrics"]["energy_to_target_J"] == pytest.approx(steps * gpu.step_energy_J(300, BATCH), rel=1e-9)
    assert record["metrics"]["epochs_to_target"] == 3.0 and "target_budget_exceeded" not in record["metrics"]


# ---------------------------------------------------------------- compare --by: the frontier of the runs
def test_frontier_keeps_the_runs_no_other_beats_in_time_and_energy():
    from lightning_energy.analysis.compare import frontier

    points = [(5.0, 10.0), (3.0, 12.0), (4.0, 11.0), (6.0, 9.0), (4.5, 12.0), (None, 1.0), (3.0, 12.0)]
    assert frontier(points) == [1, 2, 0, 3]  # fastest first; (4.5, 12) dominated, None never, the tie once


def test_compare_by_shows_energy_vs_time_to_target(tmp_path, capsys):
    from workbench_helpers import write_run

    # (config, watts, seconds, seconds to target or None)
    runs = [("baseline", 100.0, 4.0, 4.0), ("baseline", 100.0, 4.0, 3.5), ("lr=0.01", 50.0, 4.0, 1.0),
            ("bf16", 200.0, 2.0, None)]
    dirs = []
    for i, (config, watts, seconds, to_target_s) in enumerate(runs):
        figures = {} if to_target_s is None else {"energy_to_target_J": watts * to_target_s,
                                                  "time_to_target_s": to_target_s}
        dirs.append(str(write_run(tmp_path / f"r{i}", {"cpu": watts}, duration_s=seconds, dt_s=0.5,
                                  attributes={"recommend_config": config, **figures})))
    assert main(["compare", *dirs, "--by", "recommend_config", "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "energy to target J" in out and "frontier (no run reaches the target both faster" in out
    assert out.rstrip().splitlines()[-1].endswith("compare_frontier.png")
    result = __import__("json").loads((tmp_path / "cmp" / "compare.json").read_text())
    groups = result["groups"]
    assert groups["baseline"]["reached_target"] == 2
    assert groups["baseline"]["energy_to_target_J_mean"] == pytest.approx(375.0)
    assert groups["baseline"]["energy_to_target_J_std"] == pytest.approx(25.0)
    assert groups["bf16"]["reached_target"] == 0 and groups["bf16"]["energy_to_target_J_mean"] is None
    assert [r["run"] for r in result["runs"] if r["on_frontier"]] == ["r2"]  # 1 s and 50 J beats them all
    assert (tmp_path / "cmp" / "compare_frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_without_targets_draws_no_frontier(tmp_path, capsys):
    from workbench_helpers import write_run

    run = write_run(tmp_path / "r0", {"cpu": 10.0}, duration_s=1.0, attributes={"x": 1})
    assert main(["compare", str(run), "--out", str(tmp_path / "cmp")]) == 0
    assert "frontier" not in capsys.readouterr().out and not (tmp_path / "cmp" / "compare_frontier.png").exists()


# ---------------------------------------------------------------- one run in its own process
def test_config_runner_applies_the_power_limit_and_reads_the_catalog_record(tmp_path, monkeypatch):
    import contextlib
    import subprocess
    from pathlib import Path

    from lightning_energy.optimize.recommend_config import ConfigRunner

    events = []

    class FakeLimits:  # GpuPowerLimits' interface: the limit in force while the run trains
        @contextlib.contextmanager
        def applied(self, limit_W):
            events.append(("set", limit_W))
            yield
            events.append(("restored", limit_W))

    def fake_fit(command, **kwargs):  # what `python -m CLI fit --config FILE` leaves behind: a catalog record
        events.append(("fit", command[1:4]))
        config = yaml.safe_load(Path(command[-1]).read_text())
        catalog = next(c["init_args"] for c in config["trainer"]["callbacks"]
                       if c["class_path"] == "lightning_energy.CatalogCallback")
        if catalog["config"]["recommend_run"] == "r002_crash":
            kwargs["stdout"].write(b"Traceback ...\nRuntimeError: out of memory\n")
            return subprocess.CompletedProcess(command, 1)
        Catalog(catalog["catalog_path"]).add({
            "model": "m", "energy_J": 30.0, "duration_s": 3.0, "provenance": "measured", "sensors": [],
            "intensity_g_per_kWh": 360.0, "pue": 1.0, "config": {"run": catalog["config"]},
            "metrics": {"energy_to_target_J": 18.0, "time_to_target_s": 2.0, "epochs_to_target": 3.0}})
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", fake_fit)
    levers = {lv.name: lv for lv in find_levers(BALER_LIKE, device="cuda", power_limits_W=[200.0])[0]}
    runner = ConfigRunner(BALER_LIKE, levers, Target("val/loss", 0.1, "min"), tmp_path, cli="user.cli",
                          power_limits=FakeLimits())
    outcome = runner({"power_limit_W": 200.0}, "r001_pl", 50.0)
    assert events == [("set", 200.0), ("fit", ["-m", "user.cli", "fit"]), ("restored", 200.0)]
    assert (outcome.reached, outcome.energy_J, outcome.time_s, outcome.epochs) == (True, 18.0, 2.0, 3)
    assert outcome.gCO2e == pytest.approx(18.0 / 3.6e6 * 360.0) and outcome.provenance == "measured"
    written = yaml.safe_load((tmp_path / "runs" / "r001_pl" / "recommend_run.yaml").read_text())
    eta = next(c["init_args"] for c in written["trainer"]["callbacks"] if c["class_path"].endswith("EnergyToAccuracy"))
    assert eta["budget_J"] == 50.0 and written["trainer"]["default_root_dir"] == str(tmp_path / "runs" / "r001_pl")
    (tmp_path / "runs" / "r001_pl" / "energy_report.json").write_text(
        '{"sensors": [{"name": "cpu_estimate", "failure": "read did not return within 2 s (hung)"}]}')
    failure = sensor_failures(tmp_path / "runs" / "r001_pl")
    assert failure == "cpu_estimate failed: read did not return within 2 s (hung)"
    assert sensor_failures(tmp_path / "nowhere") is None
    crashed = runner({}, "r002_crash", None)
    assert not crashed.reached and crashed.stopped == ("failed: exit code 1, no catalog record: "
                                                       "RuntimeError: out of memory")


@pytest.mark.parametrize("content, message", [
    (None, "config {path} does not exist"),
    ("- a\n- b\n", "{path}: a LightningCLI config is a mapping"),
    ("model: [unclosed\n", "config {path} is not valid YAML"),
    ("# " + "x" * (1 << 20) + "\n", "config {path} has 1048579 bytes; a config has at most 1048576"),
])
def test_a_bad_config_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "c.yaml"
    if content is not None:
        path.write_text(content)
    assert main(["recommend", "--config", str(path), "--target", "val/loss=0.1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(path=path) in err
    assert not (tmp_path / "o").exists()


def test_compile_model_compiles_the_layers_with_parameters_once():
    from torch import nn

    from lightning_energy.callbacks.compile_model import CompileModel
    from lightning_energy.simulate.example_model import TinyAutoencoder

    module = TinyAutoencoder()
    module.criterion = nn.MSELoss()  # no parameters: left alone
    callback = CompileModel(backend="eager")  # compiling happens lazily, at the first call: none here
    callback.setup(None, module, "validate")
    assert callback.compiled == [] and module.encoder._compiled_call_impl is None
    callback.setup(None, module, "fit")
    assert callback.compiled == ["encoder", "decoder"]
    assert module.encoder._compiled_call_impl is not None and module.decoder._compiled_call_impl is not None
    assert module.criterion._compiled_call_impl is None
    assert list(module.state_dict()) == list(TinyAutoencoder().state_dict())  # checkpoint keys unchanged


def test_a_config_without_class_path_needs_its_cli(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(BALER_LIKE))
    assert main(["recommend", "--config", str(config), "--target", "val/loss=0.1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cli" in err and "class_path" in err
