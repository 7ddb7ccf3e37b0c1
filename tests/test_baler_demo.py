"""`make demo` chain (python -m baler_lit.demo) on a small synthetic table with the EnergyCallback attached."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from baler_conftest_helpers import one_thread  # noqa: F401 (fixture)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from baler_lit import demo

pytestmark = pytest.mark.usefixtures("one_thread")


def test_demo_runs_whole_chain_and_reports(tmp_path, capsys):
    result = demo.run(tmp_path, rows=3000, epochs=3)  # what `demo.main` prints, and the figures behind it
    out = capsys.readouterr().out
    for text in ("compression ratio", "reconstruction error", "energy:", "lightning-energy report",
                 "worst columns by rms/range:"):
        assert text in out, text
    assert re.search(r"^energy: [0-9.]+ J \((measured|[A-Z+]+)\) for the whole fit", out, re.M), out  # provenance
    # what the tool is for, beside the ratio: CO2e at a stated offline intensity, and the forecast
    (carbon,) = [line for line in out.splitlines() if line.startswith("CO2e:")]
    assert "Switzerland (CHE)" in carbon and "offline" in carbon
    intensity = result["carbon_intensity"]["g_per_kWh"]
    assert result["carbon_gCO2e"] == pytest.approx(result["energy_J"] / 3.6e6 * intensity, rel=1e-6)
    (forecast,) = [line for line in out.splitlines() if line.startswith("forecast after epoch 1 of 3:")]
    assert f"the fit took {result['forecast']['actual']['total_J']:.1f} J" in forecast

    with np.load(tmp_path / "data.npz", allow_pickle=False) as orig, np.load(tmp_path / "restored.npz") as rest:
        assert orig["data"].shape == rest["data"].shape == (3000, 24)
    assert (tmp_path / "data.baler").stat().st_size > 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["compression_ratio"] > 1.0 and 0 < summary["mean_norm_rms"] < 0.2
    assert len(summary["tradeoff"]) == 4
    run = tmp_path / "tb" / "version_0"
    report = json.loads((run / "energy_report.json").read_text())
    assert report["total_J"] > 0 and report["sensors"]

    events = EventAccumulator(str(run), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "val/loss"} <= set(tags["scalars"])
    assert not [t for t in tags["scalars"] if t.startswith("evaluate/")]  # no single-point cards per column
    (text,) = [t for t in tags["tensors"] if t.startswith("evaluate/")]
    table = events.Tensors(text)[0].tensor_proto.string_val[0].decode()
    assert table.count("\n| ") == 24 + 1 and "med\\|r\\|/range" in table  # header + one row per column
    assert any(t.startswith("energy/") for t in tags["scalars"])
    assert {"evaluate/residual_boxplot", "evaluate/histograms", "evaluate/response"} <= set(tags["images"])
