"""DDP on two CPU ranks: device sensors of both ranks plus the host sensor counted once."""

import csv
import json
import re
import os
import subprocess
import sys
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


@pytest.mark.slow
@pytest.mark.parametrize("validation", ["val", "noval"])
def test_ddp_epoch_power_is_the_sum_of_the_sensors_whatever_rank_0_does_at_epoch_end(tmp_path, validation):
    """Rank 0 works 0.3 s more at each epoch end, so the other rank starts each next epoch early. Every
    all-rank figure is measured over one common interval: the epoch's power is the sensors' exact sum."""
    from ddp_epoch_fit import DEVICE_W as D, HOST_W as H

    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Lightning's warnings reach stderr
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run([sys.executable, str(HERE / "ddp_epoch_fit.py"), str(tmp_path), validation],
                         capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    # the figures are all-rank already and go through the loggers: no `sync_dist` advice from Lightning
    # about ours (the model's own `val/loss` may get it)
    assert not re.search(r"self\.log\('(energy|power|time|edp)/", run.stderr), run.stderr[-2000:]
    (report_path,) = tmp_path.rglob("energy_report.json")
    report = json.loads(report_path.read_text())
    assert len(report["epochs"]) == 4
    for epoch in report["epochs"]:
        assert epoch["power_W"] == pytest.approx(2 * D + H, rel=1e-9), epoch
        assert epoch["per_sensor_J"]["device"] == pytest.approx(2 * D * epoch["train_s"], rel=1e-9)
        assert epoch["per_sensor_J"]["host"] == pytest.approx(H * epoch["train_s"], rel=1e-9)
        assert (epoch["validation_J"] > 0) == (validation == "val")
    with open(report_path.parent / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    powers = [float(r["power/epoch_W"]) for r in rows if r.get("power/epoch_W")]
    assert powers == pytest.approx([2 * D + H] * 4, rel=1e-9)
    if validation == "val":
        val = [(float(r["energy/val_epoch_J"]), float(r["time/val_epoch_s"])) for r in rows if r.get("energy/val_epoch_J")]
        assert len(val) == 4 and all(j == pytest.approx((2 * D + H) * s, rel=1e-9) for j, s in val)


@pytest.mark.slow
def test_two_ranks_reading_one_card_count_it_once(tmp_path):
    """Both ranks' device sensors name one card: every all-rank figure and the report count it once (rank 0's)."""
    from ddp_shared_card_fit import CARD_W, HOST_W

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(HERE / "ddp_shared_card_fit.py"), str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    (report_path,) = tmp_path.rglob("energy_report.json")
    report = json.loads(report_path.read_text())
    for epoch in report["epochs"]:
        assert epoch["per_sensor_J"]["device"] == pytest.approx(CARD_W * epoch["train_s"], rel=1e-9)
        assert epoch["power_W"] == pytest.approx(CARD_W + HOST_W, rel=1e-9)
    counted = {(s["name"], s["rank"]): s.get("counted", True) for s in report["sensors"]}
    assert counted == {("device", 0): True, ("device", 1): False, ("host", 0): True}
    d0 = next(r["duration_s"] for r in report["ranks"] if r["rank"] == 0)
    assert report["total_J"] == pytest.approx((CARD_W + HOST_W) * d0, rel=1e-9)
