"""`make demo` chain (python -m baler_lit.demo) on a small synthetic table with the EnergyCallback attached."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from baler_conftest_helpers import one_thread  # noqa: F401 (fixture)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from baler_lit import demo

pytestmark = pytest.mark.usefixtures("one_thread")


def test_demo_runs_whole_chain_and_reports(tmp_path, capsys):
    start = time.perf_counter()
    assert demo.main(["--out", str(tmp_path), "--rows", "3000", "--epochs", "3"]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    for text in ("compression ratio", "reconstruction error", "energy:", "lightning-energy report"):
        assert text in out, text
    assert re.search(r"^energy: [0-9.]+ J \((measured|[A-Z+]+)\) for the whole fit", out, re.M), out  # provenance

    with np.load(tmp_path / "data.npz", allow_pickle=False) as orig, np.load(tmp_path / "restored.npz") as rest:
        assert orig["data"].shape == rest["data"].shape == (3000, 24)
    assert (tmp_path / "data.baler").stat().st_size > 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["compression_ratio"] > 1.0 and 0 < summary["mean_norm_rms"] < 0.2
    assert len(summary["tradeoff"]) == 4
    run = tmp_path / "tb" / "version_0"
    report = json.loads((run / "energy_report.json").read_text())
    assert report["total_J"] > 0 and report["sensors"]

    events = EventAccumulator(str(run), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "val/loss", "evaluate/mean_norm_rms"} <= set(tags["scalars"])
    assert any(t.startswith("energy/") for t in tags["scalars"])
    assert {"evaluate/residual_boxplot", "evaluate/histograms", "evaluate/response"} <= set(tags["images"])
    assert elapsed < 60  # the full-size demo must stay under 2 minutes; this small one is far quicker
