"""The two-rank DDP runs of the Trainer (ddp_fit.py) and of Fabric (fabric_ddp_fit.py): run one, and check the
relations an exact meter must hold whatever the front end (each device once per rank, the host once, epochs over
one common interval)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEVICE_W, HOST_W = 80.0, 25.0  # the simulated sensors of both scripts


def run_two_ranks(script: str, out: Path, zygote=None) -> tuple[Path, dict]:
    """Run ``script`` as a user would (it launches its second rank itself), or, given the ``rank_zygote``
    fixture, as two ranks forked from it (rank_zygote.py); (the report's path, the report)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    if zygote is None:
        run = subprocess.run([sys.executable, str(HERE / script), str(out)], capture_output=True, text=True,
                             env=env, timeout=240)
    else:
        run = zygote.run(HERE / script, [out], out / "ranks", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    (report_path,) = out.rglob("energy_report.json")
    return report_path, json.loads(report_path.read_text())


def check_each_device_per_rank_and_the_host_once(report: dict, steps_per_epoch: int) -> None:
    assert report["world_size"] == 2
    owners = sorted((s["name"], s["rank"]) for s in report["sensors"])
    assert owners == [("device", 0), ("device", 1), ("host", 0)]  # host read by local rank 0 only
    d0, d1 = (r["duration_s"] for r in sorted(report["ranks"], key=lambda r: r["rank"]))
    assert report["total_J"] == pytest.approx(DEVICE_W * (d0 + d1) + HOST_W * d0, rel=1e-9)
    # the all-rank training and validation energy once, not once per rank
    assert report["train_J"] == pytest.approx(sum(e["train_J"] for e in report["epochs"]), rel=1e-9)
    assert report["validation_J"] == pytest.approx(sum(e["validation_J"] for e in report["epochs"]), rel=1e-9)
    for epoch in report["epochs"]:
        per_sensor = epoch["per_sensor_J"]
        # one common interval on every rank: both devices and rank 0's host over exactly train_s
        assert per_sensor["device"] == pytest.approx(2 * DEVICE_W * epoch["train_s"], rel=1e-9)
        assert per_sensor["host"] == pytest.approx(HOST_W * epoch["train_s"], rel=1e-9)
        assert epoch["power_W"] == pytest.approx(2 * DEVICE_W + HOST_W, rel=1e-9)
        assert epoch["train_J"] == pytest.approx(per_sensor["device"] + per_sensor["host"], rel=1e-12)
        assert epoch["steps"] == steps_per_epoch  # summed over ranks
        assert epoch["steps_J"] > 0  # every step's energy counts in its epoch (both ranks' steps)
