"""DDP on two CPU ranks: device sensors of both ranks plus the host sensor counted once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEVICE_W, HOST_W = 80.0, 25.0  # as in ddp_fit.py


@pytest.mark.slow
def test_ddp_total_is_device_of_both_ranks_plus_host_once(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(HERE / "ddp_fit.py"), str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    (report_path,) = tmp_path.rglob("energy_report.json")
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 2
    owners = sorted((s["name"], s["rank"]) for s in report["sensors"])
    assert owners == [("device", 0), ("device", 1), ("host", 0)]  # host read by local rank 0 only
    d0, d1 = (r["duration_s"] for r in sorted(report["ranks"], key=lambda r: r["rank"]))
    assert report["total_J"] == pytest.approx(DEVICE_W * (d0 + d1) + HOST_W * d0, rel=1e-9)
    for epoch in report["epochs"]:
        per_sensor = epoch["per_sensor_J"]
        # the all-reduced epoch: device seconds of both ranks, host seconds of rank 0, time of the slowest rank
        assert per_sensor["device"] / DEVICE_W == pytest.approx(2 * epoch["train_s"], rel=0.25)
        assert per_sensor["host"] / HOST_W <= epoch["train_s"] * (1 + 1e-9)
        assert epoch["train_J"] == pytest.approx(per_sensor["device"] + per_sensor["host"], rel=1e-12)
        assert epoch["steps"] == 2 * 10  # 320 rows / 2 ranks / batch 16, summed over ranks
    assert (report_path.parent / "energy_trace.csv").exists()
    assert (report_path.parent / "energy_trace_rank1.csv").exists()
