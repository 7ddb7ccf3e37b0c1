"""DDP on two CPU ranks: device sensors of both ranks plus the host sensor counted once."""

import csv
import json
import re
import os
from pathlib import Path

import pytest
import torch

from ddp_checks import DEVICE_W, HOST_W, check_each_device_per_rank_and_the_host_once, run_two_ranks

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_ddp_total_is_device_of_both_ranks_plus_host_once(tmp_path):
    report_path, report = run_two_ranks("ddp_fit.py", tmp_path)
    check_each_device_per_rank_and_the_host_once(report, steps_per_epoch=2 * 10)  # 320 rows / 2 ranks / batch 16
    assert (report_path.parent / "energy_trace.csv").exists()
    assert (report_path.parent / "energy_trace_rank1.csv").exists()
    # energy/total_J is all ranks' and logged at epoch ends only; the step-level figure is rank 0's, by name
    with open(report_path.parent / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    totals = [float(r["energy/total_J"]) for r in rows if r["energy/total_J"]]
    assert totals == pytest.approx([e["total_J"] for e in report["epochs"]] + [report["total_J"]], rel=1e-9)
    rank0 = [(int(r["step"]), float(r["energy/rank0_total_J"])) for r in rows if r["energy/rank0_total_J"]]
    assert len(rank0) == 10 and [j for _, j in rank0] == sorted(j for _, j in rank0)  # 20 steps, every 2nd
    epoch0_end_step = next(int(r["step"]) for r in rows if r["energy/total_J"])
    assert max(j for step, j in rank0 if step <= epoch0_end_step) < totals[0]  # one rank's share only
    # the mid-epoch checkpoint holds all ranks' energy up to the moment of saving
    saved = torch.load(tmp_path / "ckpt" / "step=15.ckpt", weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("EnergyCallback"))
    assert state["open_epoch"] == 1 and len(state["epochs"]) == 1
    assert report["epochs"][0]["total_J"] < state["total_J"] < report["epochs"][1]["total_J"]
    # duration_s is the slowest rank's: each sensor ran at most that long, the slowest rank's device all of it
    assert DEVICE_W * state["duration_s"] <= state["total_J"] <= (2 * DEVICE_W + HOST_W) * state["duration_s"] * (1 + 1e-9)


@pytest.fixture(scope="module")
def epoch_fit(tmp_path_factory, rank_zygote) -> tuple[Path, dict, str]:
    """One launch of ddp_epoch_fit.py (validation after every second epoch, a card both ranks read) for the tests
    below: (the report's path, the report, the fit's stderr). It used to be three launches (with validation,
    without, and the shared card): a launch costs two interpreters, Lightning's import and gloo's start."""
    out = tmp_path_factory.mktemp("ddp_epoch_fit")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Lightning's warnings reach stderr
    env["OMP_NUM_THREADS"] = "1"
    run = rank_zygote.run(HERE / "ddp_epoch_fit.py", [out, "mixed", "card"], out / "ranks", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    (report_path,) = out.rglob("energy_report.json")
    return report_path, json.loads(report_path.read_text()), run.stderr


@pytest.mark.slow
def test_ddp_epoch_power_is_the_sum_of_the_sensors_whatever_rank_0_does_at_epoch_end(epoch_fit):
    """Rank 0 works longer at each epoch end, so the other rank starts each next epoch early. Every all-rank
    figure is measured over one common interval: the epoch's power is the sensors' exact sum, in the epochs that
    end with a validation loop and in those without one."""
    from ddp_epoch_fit import CARD_W as C, DEVICE_W as D, EPOCHS, HOST_W as H, VALIDATE_EVERY

    every = VALIDATE_EVERY["mixed"]

    report_path, report, stderr = epoch_fit
    # the figures are all-rank already and go through the loggers: no `sync_dist` advice from Lightning
    # about ours (the model's own `val/loss` may get it)
    assert not re.search(r"self\.log\('(energy|power|time|edp)/", stderr), stderr[-2000:]
    power_W = 2 * D + H + C  # a device per rank, the host and the shared card once
    validated = [(epoch + 1) % every == 0 for epoch in range(EPOCHS)]
    assert [e["epoch"] for e in report["epochs"]] == list(range(EPOCHS))
    for epoch, with_validation in zip(report["epochs"], validated):
        assert epoch["power_W"] == pytest.approx(power_W, rel=1e-9), epoch
        assert epoch["per_sensor_J"]["device"] == pytest.approx(2 * D * epoch["train_s"], rel=1e-9)
        assert epoch["per_sensor_J"]["host"] == pytest.approx(H * epoch["train_s"], rel=1e-9)
        assert (epoch["validation_J"] > 0) == with_validation
    with open(report_path.parent / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    powers = [float(r["power/epoch_W"]) for r in rows if r.get("power/epoch_W")]
    assert powers == pytest.approx([power_W] * EPOCHS, rel=1e-9)
    val = [(float(r["energy/val_epoch_J"]), float(r["time/val_epoch_s"])) for r in rows if r.get("energy/val_epoch_J")]
    assert len(val) == sum(validated) and all(j == pytest.approx(power_W * s, rel=1e-9) for j, s in val)


@pytest.mark.slow
def test_two_ranks_reading_one_card_count_it_once(epoch_fit):
    """Both ranks' card sensors name one card: every all-rank figure and the report count it once (rank 0's)."""
    from ddp_epoch_fit import CARD_W, DEVICE_W, HOST_W

    _, report, _ = epoch_fit
    for epoch in report["epochs"]:
        assert epoch["per_sensor_J"]["card"] == pytest.approx(CARD_W * epoch["train_s"], rel=1e-9)
    counted = {(s["name"], s["rank"]): s.get("counted", True) for s in report["sensors"]}
    assert counted == {("card", 0): True, ("card", 1): False, ("device", 0): True, ("device", 1): True,
                       ("host", 0): True}
    d0, d1 = (r["duration_s"] for r in sorted(report["ranks"], key=lambda r: r["rank"]))
    assert report["total_J"] == pytest.approx((CARD_W + HOST_W) * d0 + DEVICE_W * (d0 + d1), rel=1e-9)
