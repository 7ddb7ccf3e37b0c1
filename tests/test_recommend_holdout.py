"""recommend's held-out check: the test rows are read by the test runs only (never by the target, the stopping rule,
the screening or the pick), the report carries both configurations' test losses with their spread, and a smaller
training batch does not shrink the validation loss it is judged by."""

from __future__ import annotations

import json
import math

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from torch import nn

from conftest import trainer_kwargs
from lightning_energy.optimize.recommend import (
    DEFAULTS, RECOMMENDED, HeldOutRun, RunOutcome, Search, Target, compare_heldout, find_levers, heldout_check,
)
from lightning_energy.optimize.recommend_config import (
    heldout_fit_config, heldout_test_config, run_config, with_levers, write_holdout_npz,
)

TARGET = Target("val/loss", 1.0, "min")
N_ROWS = 200


def baler_like(search_file) -> dict:
    return {"seed_everything": 0,
            "trainer": {"max_epochs": 5, "accelerator": "cpu",
                        "callbacks": [{"class_path": "lightning_energy.EnergyCallback"}]},
            "model": {"model": "AE", "dtype": "float64", "loss": "sum", "lr": 0.001, "lr_patience": 50},
            "data": {"path": str(search_file), "batch_size": 64, "eval_batch_size": None, "val_fraction": 0.2,
                     "shuffle": False, "seed": 0}}


@pytest.fixture
def split(tmp_path):
    """A table whose first column is the row's id, split into a search file and a test file."""
    rng = np.random.default_rng(0)
    data = np.column_stack([np.arange(N_ROWS, dtype=np.float64), rng.normal(size=(N_ROWS, 3))])
    search, test, search_idx, test_idx = write_holdout_npz(data, tmp_path / "data", 0.25, 7,
                                                           ["row_id", "a", "b", "c"], ["float64"] * 4)
    return search, test, search_idx, test_idx


def rows_read(config: dict, stage: str) -> set[int]:
    """The row ids a BalerDataModule built from ``config['data']`` reads at ``stage`` (fit: train + validation
    rows; test: the test loader's rows), read back from the file the config names: the instrumented phase."""
    from baler_lit.data import BalerDataModule

    module = BalerDataModule(**config["data"])
    ids = module.table.data[:, 0]
    if stage == "fit":
        train, val = module.split_indices()
        return set(ids[train].astype(int)) | set(ids[val].astype(int))
    return set(ids.astype(int))


def test_the_split_is_disjoint_and_covers_every_row(split):
    search, test, search_idx, test_idx = split
    assert set(search_idx).isdisjoint(test_idx) and len(search_idx) + len(test_idx) == N_ROWS
    assert len(test_idx) == 50
    with np.load(test) as f:
        assert sorted(f["data"][:, 0].astype(int)) == sorted(test_idx) and list(f["names"])[0] == "row_id"


@pytest.mark.parametrize("fraction", [0.0, 1.0, 0.001])
def test_a_split_leaving_one_side_empty_is_refused(tmp_path, fraction):
    with pytest.raises(ValueError, match="leaves no test or no search rows"):
        write_holdout_npz(np.zeros((10, 2)), tmp_path, fraction, 0)


def test_target_stop_screen_and_pick_never_read_a_test_row(split, tmp_path):
    """Every phase instrumented: the rows each run's data module reads, by the id column."""
    search, test, _, test_idx = split
    base = baler_like(search)
    levers_list, _ = find_levers(base)
    levers = {lv.name: lv for lv in levers_list}
    read_by_search: set[int] = set()

    def runner(settings, name, budget_J):  # the search's runs (target, stop, screening, pick)
        config = run_config(base, levers, settings, TARGET, budget_J, tmp_path / name, tmp_path / "cat.sqlite", name)
        assert str(test) not in yaml.safe_dump(config)
        read_by_search.update(rows_read(config, "fit"))
        cost = 10.0 * (0.5 if settings.get("lr") == 0.003 else 1.0)
        return RunOutcome(True, cost, cost, epochs=3, provenance="estimated")

    result = Search(levers_list, runner, repeats=2, screen_repeats=1, target=TARGET).run()
    assert read_by_search and read_by_search.isdisjoint(test_idx)

    read_by_heldout_fit: set[int] = set()
    read_by_test: set[int] = set()

    def heldout(settings, name, seed, stop_at_target):
        fit = heldout_fit_config(base, levers, settings, TARGET, tmp_path / name, tmp_path / "c.sqlite", name, seed,
                                 stop_at_target)
        read_by_heldout_fit.update(rows_read(fit, "fit"))
        evaluate = heldout_test_config(base, levers, settings, {"data": {"path": str(test), "val_fraction": 0.0}},
                                       tmp_path / name)
        read_by_test.update(rows_read(evaluate, "test"))
        return HeldOutRun("", seed, 5.0, 1.0, 1.0, 0.5, 3, 4.0, True, "estimated", 0.5)

    heldout_check(heldout, result.recommended.settings, [1, 2, 3])
    assert read_by_heldout_fit.isdisjoint(test_idx)
    assert read_by_test == set(int(i) for i in test_idx)  # the test runs read the test rows, all of them


def test_the_heldout_check_trains_fresh_seeds_both_ways_in_a_random_order():
    calls = []

    def runner(settings, name, seed, stop_at_target):
        calls.append((dict(settings), seed, stop_at_target))
        return HeldOutRun("", seed, 1.0, 1.0, 1.0, 0.1)

    runs = heldout_check(runner, {"lr": 0.003}, [1, 2, 3, 4, 5], order_seed=3)
    assert [(r.config, r.seed) for r in runs].count((DEFAULTS, 1)) == 1 and len(runs) == 10
    assert all(stop == bool(settings) for settings, _, stop in calls)  # the pick stops at the target, defaults not
    assert {seed for _, seed, _ in calls} == {1, 2, 3, 4, 5}
    firsts = {tuple(c[0]) for c in calls[::2]}
    assert len(firsts) == 2  # sometimes the defaults first, sometimes the pick
    with pytest.raises(ValueError):
        heldout_check(runner, {}, [])


def run(config, seed, energy, cpu, test_loss, ok=True):
    return HeldOutRun(config, seed, energy, cpu, cpu * 1.1, test_loss if ok else math.nan, 10, None, True,
                      "estimated", 1.0)


def test_the_report_carries_both_test_losses_with_their_spread_and_the_ratios():
    runs = [run(DEFAULTS, 1, 100.0, 10.0, 0.50), run(RECOMMENDED, 1, 20.0, 2.0, 0.49),
            run(DEFAULTS, 2, 110.0, 11.0, 0.54), run(RECOMMENDED, 2, 25.0, 2.5, 0.52),
            run(DEFAULTS, 3, 90.0, 9.0, 0.52), run(RECOMMENDED, 3, 22.0, 2.2, 0.53)]
    report = compare_heldout(runs)
    d, p = report[DEFAULTS], report[RECOMMENDED]
    assert d["test_loss"]["median"] == pytest.approx(0.52) and d["test_loss"]["pm"] == pytest.approx(0.02)
    assert p["test_loss"]["median"] == pytest.approx(0.52) and p["test_loss"]["pm"] == pytest.approx(0.02)
    assert report["energy_ratio"] == pytest.approx(100.0 / 22.0)
    assert report["cpu_ratio"] == pytest.approx(10.0 / 2.2)
    assert report["test_no_worse"] and report["test_no_worse_strict"]
    assert p["provenance"] == "estimated" and d["runs"] == p["runs"] == 3
    json.dumps(report)  # the benchmark writes it as it is


def test_a_worse_pick_or_a_failed_run_is_not_called_no_worse():
    worse = [run(DEFAULTS, s, 100.0, 10.0, 0.50 + 0.01 * s) for s in (1, 2, 3)]
    worse += [run(RECOMMENDED, s, 10.0, 1.0, 0.60) for s in (1, 2, 3)]
    assert not compare_heldout(worse)["test_no_worse"]
    failed = [run(DEFAULTS, s, 100.0, 10.0, 0.5) for s in (1, 2, 3)]
    failed += [run(RECOMMENDED, 1, 10.0, 1.0, 0.4), run(RECOMMENDED, 2, 10.0, 1.0, 0.4, ok=False),
               run(RECOMMENDED, 3, 10.0, 1.0, 0.4)]
    report = compare_heldout(failed)
    assert report[RECOMMENDED]["complete"] == 2 and not report["test_no_worse"]


def test_a_smaller_training_batch_keeps_the_baselines_validation_batch(split):
    """Baler's loss is summed per batch: validation batches of the training batch size would make batch 16 look
    4x better than batch 64 at the same model."""
    search, *_ = split
    base = baler_like(search)
    levers = {lv.name: lv for lv in find_levers(base)[0]}
    config = with_levers(base, levers, {"batch_size": 16}, TARGET)
    assert config["data"]["batch_size"] == 16 and config["data"]["eval_batch_size"] == 64
    given = dict(base, data=dict(base["data"], eval_batch_size=100))  # the user's own value is kept
    assert with_levers(given, levers, {"batch_size": 16}, TARGET)["data"]["eval_batch_size"] == 100
    without = dict(base, data={k: v for k, v in base["data"].items() if k != "eval_batch_size"})
    assert "eval_batch_size" not in with_levers(without, levers, {"batch_size": 16}, TARGET)["data"]
    assert any("eval_batch_size" in note for note in find_levers(without)[1])
    assert not any("eval_batch_size" in note for note in find_levers(base)[1])


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)
        self.x = torch.randn(32, 3, generator=torch.Generator().manual_seed(0))

    def _loader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x), batch_size=8)

    train_dataloader = val_dataloader = test_dataloader = _loader

    def _loss(self, batch):
        return (self.layer(batch[0]) - batch[0]).square().mean()

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit_probe_and_test_metrics_write_once_the_loops_end(tmp_path):
    from lightning_energy.callbacks.fit_probe import FitProbe
    from lightning_energy.callbacks.test_metrics import TestMetrics

    probe = FitProbe(str(tmp_path / "probe.json"), str(tmp_path / "final.ckpt"))
    module = _Tiny()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[probe], logger=False))
    trainer.fit(module)
    found = json.loads((tmp_path / "probe.json").read_text())
    assert found["cpu_s"] >= 0 and found["epochs"] == 2 and (tmp_path / "final.ckpt").is_file()
    tester = L.Trainer(**trainer_kwargs(tmp_path, callbacks=[TestMetrics(str(tmp_path / "test.json"))], logger=False))
    tester.test(_Tiny(), ckpt_path=str(tmp_path / "final.ckpt"))
    metrics = json.loads((tmp_path / "test.json").read_text())
    with torch.no_grad():
        expected = float(module._loss((module.x,)))
    assert metrics["test/loss"] == pytest.approx(expected, rel=1e-5)
