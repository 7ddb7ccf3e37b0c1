"""``lightning-energy recommend --test-data FILE``: after the search, the config as given and the pick trained again
with fresh seeds and tested on FILE; both test losses (with their spread) and the verdict in the printed table and
in recommend.json; bad input is one line and exit 2 before any run. The runs are fakes (no training)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml

from lightning_energy.cli.main import main
from lightning_energy.optimize.recommend import HeldOutRun, RunOutcome, find_levers, heldout_metric_for, parse_seeds
from lightning_energy.optimize.recommend_config import ConfigError, HeldOutConfigRunner, heldout_overlay

BASE_J = 100.0
FACTORS = {"batch_size": {128: 0.5, 256: 0.8, 1024: 1.3}, "lr": {0.003: 0.7, 0.01: 1.1, 0.03: 3.0}}


def config_file(tmp_path, data_path, **extra) -> Path:
    config = {"seed_everything": 0,
              "trainer": {"max_epochs": 25, "accelerator": "cpu"},
              "model": {"model": "AE", "lr": 0.001},
              "data": {"path": str(data_path), "batch_size": 512, "eval_batch_size": None, "val_fraction": 0.2},
              **extra}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def files(tmp_path):
    search, test = tmp_path / "search.npz", tmp_path / "test.npz"
    search.write_bytes(b"search rows")
    test.write_bytes(b"test rows")
    return config_file(tmp_path, search), search, test


class FakeSearchRunner:
    """ConfigRunner's interface: energy to target = BASE_J x the factors of the settings (no training)."""

    def __init__(self, base, levers, target, out_dir, cli, timeout_s=None, power=None):
        self.base = base

    def __call__(self, settings, name, budget_J):
        energy = BASE_J * math.prod(FACTORS.get(k, {}).get(v, 1.0) for k, v in settings.items())
        if budget_J is not None and energy > budget_J:
            return RunOutcome(False, budget_J, 1.0, "energy budget", provenance="estimated")
        return RunOutcome(True, energy, energy / 10, epochs=5, provenance="estimated")


def fake_heldout(test_losses: dict[str, float], made: list):
    """HeldOutConfigRunner's interface: the pick spends a quarter of the defaults' energy; test losses as given
    (per configuration, +- 0.01 by seed)."""

    class FakeHeldOut:
        def __init__(self, base, levers, target, out_dir, test_overlay, cli, test_metric, timeout_s=None,
                     defaults_max_epochs=None):
            made.append({"overlay": test_overlay, "metric": test_metric, "defaults_max_epochs": defaults_max_epochs,
                         "base_max_epochs": base["trainer"]["max_epochs"], "out_dir": out_dir})

        def __call__(self, settings, name, seed, stop_at_target):
            key = "recommended" if stop_at_target else "defaults"
            energy = 40.0 if stop_at_target else 160.0
            return HeldOutRun("", seed, energy, energy / 8, energy / 10, test_losses[key] + 0.01 * (seed - 2),
                              epochs=5 if stop_at_target else 25, reached=True, provenance="estimated",
                              load_average=1.0)

    return FakeHeldOut


def install(monkeypatch, test_losses):
    made: list = []
    monkeypatch.setattr("lightning_energy.optimize.recommend_config.ConfigRunner", FakeSearchRunner)
    monkeypatch.setattr("lightning_energy.optimize.recommend_config.HeldOutConfigRunner",
                        fake_heldout(test_losses, made))
    return made


def recommend(config, out, *extra):
    return main(["recommend", "--config", str(config), "--target", "val/loss=1.0", "--cli", "user.cli",
                 "--levers", "batch_size,lr", "--out", str(out), *extra])


def test_the_heldout_check_reports_both_test_losses_with_spread_and_the_verdict(files, tmp_path, monkeypatch,
                                                                                 capsys):
    config, _, test = files
    made = install(monkeypatch, {"defaults": 0.50, "recommended": 0.49})
    out = tmp_path / "out"
    assert recommend(config, out, "--test-data", str(test), "--max-epochs", "50") == 0
    printed = capsys.readouterr().out
    assert made == [{"overlay": {"data": {"path": str(test)}}, "metric": "test/loss", "defaults_max_epochs": 25,
                     "base_max_epochs": 50, "out_dir": out / "heldout"}]  # the defaults train their own 25 epochs
    document = json.loads((out / "recommend.json").read_text())
    held = document["heldout"]
    assert held["test_data"] == str(test) and held["seeds"] == [1, 2, 3] and held["metric"] == "test/loss"
    assert held["defaults"]["test_loss"]["median"] == pytest.approx(0.50)
    assert held["defaults"]["test_loss"]["pm"] == pytest.approx(0.01)
    assert held["recommended"]["test_loss"]["median"] == pytest.approx(0.49)
    assert held["test_no_worse"] and held["test_no_worse_strict"]
    assert held["energy_ratio"] == pytest.approx(4.0) and held["cpu_ratio"] == pytest.approx(4.0)
    assert len(held["runs"]) == 6 and {r["seed"] for r in held["runs"]} == {1, 2, 3}
    assert document["recommended"]["settings"]["batch_size"] == 128
    line = next(s for s in printed.splitlines() if s.startswith("held out: test/loss"))
    assert "0.49 ± 0.01 (recommended) vs 0.5 ± 0.01 (config as given): no worse than the config as given" in line
    assert "4 x less energy (estimated), 4 x less CPU time" in line
    assert "config as given" in printed and "recommended" in printed and "test/loss" in printed
    assert "held out: test/loss" in (out / "recommended.yaml").read_text()  # the YAML's header says it too


def test_a_pick_worse_on_the_test_rows_is_said_so(files, tmp_path, monkeypatch, capsys):
    config, _, test = files
    install(monkeypatch, {"defaults": 0.50, "recommended": 0.60})
    assert recommend(config, tmp_path / "out", "--test-data", str(test), "--test-seeds", "4,5") == 0
    held = json.loads((tmp_path / "out" / "recommend.json").read_text())["heldout"]
    assert held["seeds"] == [4, 5] and not held["test_no_worse"] and not held["test_no_worse_strict"]
    assert "WORSE than the config as given" in capsys.readouterr().out


def test_without_test_data_there_is_no_heldout_check(files, tmp_path, monkeypatch):
    config, _, _ = files
    made = install(monkeypatch, {"defaults": 0.5, "recommended": 0.5})
    assert recommend(config, tmp_path / "out") == 0
    assert made == [] and "heldout" not in json.loads((tmp_path / "out" / "recommend.json").read_text())


@pytest.mark.parametrize("extra, message", [
    (["--test-data", "{tmp}/missing.npz"], "--test-data {tmp}/missing.npz does not exist"),
    (["--test-data", "{tmp}"], "--test-data {tmp} is not a file"),
    (["--test-data", "{tmp}/search.npz"], "is the file the search trains on (data.path)"),
    (["--test-data", "{tmp}/test.npz", "--test-seeds", "1,x"], "--test-seeds '1,x': expected integers"),
    (["--test-data", "{tmp}/test.npz", "--test-seeds", "2,2"], "expected distinct integers"),
    (["--test-data", "{tmp}/test.npz", "--test-seeds", "0,1"], "0 is the config's seed_everything"),
    (["--test-seeds", "1,2"], "--test-seeds needs --test-data FILE"),
    (["--test-metric", "test/loss"], "--test-metric needs --test-data FILE"),
])
def test_bad_heldout_input_is_one_line_and_exit_2_before_any_run(files, tmp_path, monkeypatch, capsys, extra,
                                                                  message):
    config, _, _ = files
    made = install(monkeypatch, {"defaults": 0.5, "recommended": 0.5})
    argv = [a.format(tmp=tmp_path) for a in extra]
    assert recommend(config, tmp_path / "out", *argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message.format(tmp=tmp_path) in captured.err
    assert captured.out == "" and not (tmp_path / "out").exists() and made == []


def test_a_config_naming_no_data_file_or_no_validation_metric_is_refused(tmp_path, capsys):
    test = tmp_path / "test.npz"
    test.write_bytes(b"rows")
    config = config_file(tmp_path, "x")
    raw = yaml.safe_load(config.read_text())
    del raw["data"]["path"]
    config.write_text(yaml.safe_dump(raw))
    assert recommend(config, tmp_path / "o", "--test-data", str(test)) == 2
    assert "the config names no data file" in capsys.readouterr().err
    good = config_file(tmp_path, tmp_path / "search.npz")
    assert main(["recommend", "--config", str(good), "--target", "acc>=0.9", "--cli", "user.cli",
                 "--test-data", str(test), "--out", str(tmp_path / "o")]) == 2
    assert "--test-metric: acc names no validation metric" in capsys.readouterr().err


def test_dry_run_says_what_the_heldout_check_adds(files, tmp_path, capsys):
    config, _, test = files
    assert recommend(config, tmp_path / "out", "--test-data", str(test), "--dry-run") == 0
    assert f"held-out check on {test}" in capsys.readouterr().out and not (tmp_path / "out").exists()


def test_seeds_metric_and_overlay_helpers(tmp_path):
    assert parse_seeds("3, 1,2", search_seed=0) == [3, 1, 2]
    with pytest.raises(ValueError, match="fresh seeds"):
        parse_seeds("7", search_seed=7)
    with pytest.raises(ValueError):
        parse_seeds("")
    assert heldout_metric_for("val/loss") == "test/loss" and heldout_metric_for("val_acc") == "test_acc"
    assert heldout_metric_for("validation/mse") == "test/mse" and heldout_metric_for("train/loss") is None
    nested = {"data": {"class_path": "m.D", "init_args": {"data_path": str(tmp_path / "s.npz")}}}
    expected = {"data": {"init_args": {"data_path": str(tmp_path / "t.npz")}}}
    assert heldout_overlay(nested, tmp_path / "t.npz") == expected
    (tmp_path / "s.npz").write_bytes(b"x")
    (tmp_path / "link.npz").symlink_to(tmp_path / "s.npz")
    with pytest.raises(ConfigError, match="the file the search trains on"):
        heldout_overlay(nested, tmp_path / "link.npz")


def test_the_defaults_train_their_own_epochs_and_the_pick_the_searchs(tmp_path, monkeypatch):
    """HeldOutConfigRunner: ``defaults_max_epochs`` sets the fit of the run that does not stop at the target."""
    base = {"seed_everything": 0, "trainer": {"max_epochs": 50, "accelerator": "cpu"},
            "model": {"lr": 0.001}, "data": {"path": "s.npz", "batch_size": 512}}
    fits = []

    def fake_run(command, **kwargs):  # the fit leaves nothing behind: the run is reported failed, after its config
        if command[3] == "fit":
            fits.append(yaml.safe_load(Path(command[5]).read_text()))
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(subprocess, "run", fake_run)
    levers = {lv.name: lv for lv in find_levers(base)[0]}
    from lightning_energy.optimize.recommend import Target

    runner = HeldOutConfigRunner(base, levers, Target("val/loss", 1.0, "min"), tmp_path, {"data": {"path": "t"}},
                                 "user.cli", defaults_max_epochs=25)
    defaults = runner({}, "d", 1, False)
    pick = runner({"lr": 0.003}, "p", 1, True)
    assert [f["trainer"]["max_epochs"] for f in fits] == [25, 50]
    assert [f["seed_everything"] for f in fits] == [1, 1]
    assert not defaults.ok and defaults.stopped.startswith("fit failed (exit code 1)") and not pick.ok
