"""A Fabric DDP loop (2 CPU ranks) measured by EnergyMonitor holds to the same exact relations as the Trainer's
DDP fit (test_ddp.py): each device once per rank, the host once, epochs over one common interval."""

from __future__ import annotations

import csv

import pytest

from ddp_checks import check_each_device_per_rank_and_the_host_once, run_two_ranks


def test_a_fabric_ddp_loop_counts_each_device_per_rank_and_the_host_once(tmp_path, rank_zygote):
    report_path, report = run_two_ranks("fabric_ddp_fit.py", tmp_path, rank_zygote)
    check_each_device_per_rank_and_the_host_once(report, steps_per_epoch=2 * 10)  # 320 rows / 2 ranks / batch 16
    assert len(report["epochs"]) == 2 and all(e["validation_J"] > 0 for e in report["epochs"])
    assert (report_path.parent / "energy_trace.csv").exists()
    assert (report_path.parent / "energy_trace_rank1.csv").exists()
    (metrics_path,) = tmp_path.rglob("metrics.csv")
    with open(metrics_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    totals = [float(r["energy/total_J"]) for r in rows if r.get("energy/total_J")]
    assert totals == pytest.approx([e["total_J"] for e in report["epochs"]] + [report["total_J"]], rel=1e-9)
    rank0 = [float(r["energy/rank0_total_J"]) for r in rows if r.get("energy/rank0_total_J")]
    assert len(rank0) == 10 and rank0 == sorted(rank0)  # 20 steps, every 2nd logged


def test_a_plain_torch_distributed_loop_counts_each_device_per_rank_and_the_host_once(tmp_path):
    """EnergyMeter takes its ranks from torch.distributed's default group: no Lightning in the loop."""
    report_path, report = run_two_ranks("plain_ddp_fit.py", tmp_path)
    check_each_device_per_rank_and_the_host_once(report, steps_per_epoch=2 * 10)
    assert len(report["epochs"]) == 2 and all(e["validation_J"] > 0 for e in report["epochs"])
    assert (report_path.parent / "energy_trace_rank1.csv").exists()
