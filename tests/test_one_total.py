"""One run, one total: every output that shows a fit's energy gives the meter's figure for the fit window.

The simulated sensor's power jumps every 13 ms while the sampler reads every 50 ms, so the fit's start and
end fall inside sample intervals where the power changes: the meter puts the change at the boundary,
where a re-interpolation of the samples would spread it. Before the fix the offline `report` (from the
trace) and the logged `energy/total_J` disagreed with the report JSON by percents.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import CatalogCallback, EnergyCallback, SimulatedSensor
from lightning_energy.analysis.runs import load_run
from lightning_energy.cli.main import main

JUMPY_TRACE = [(i * 0.013, 20.0 if i % 2 else 180.0) for i in range(2000)]  # 20 <-> 180 W every 13 ms


def number_after(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return float(match.group(1))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_total")
    energy = EnergyCallback(sensors=[SimulatedSensor("device", JUMPY_TRACE),
                                     SimulatedSensor("host", 15.0, scope="host")],
                            interval_s=0.05, verbose=False, log_power_figure=False)
    catalog = CatalogCallback(root / "energy_catalog.sqlite")
    trainer = L.Trainer(callbacks=[energy, catalog], logger=CSVLogger(str(root), name="csv"),
                        **trainer_kwargs(root, max_epochs=3))
    trainer.fit(TinyRegressor(), tiny_loader(n=320), tiny_loader(n=64))
    return energy.report, Path(trainer.log_dir), root


def test_every_output_gives_the_reports_total(fitted, capsys):
    report, run_dir, root = fitted
    total = report["total_J"]
    assert report["provenance"] == "simulated" and report["simulated_J"] == pytest.approx(total)

    assert main(["show-report", str(run_dir)]) == 0
    shown = number_after(capsys.readouterr().out, r"s, ([0-9.]+) J = ")
    assert shown == pytest.approx(total, abs=0.05)  # printed to 0.1 J

    assert main(["report", str(run_dir), "--out", str(root / "plots")]) == 0
    out = capsys.readouterr().out
    assert "(SIMULATED)" in out.splitlines()[0]
    recomputed = json.loads((root / "plots" / "trace_report.json").read_text())
    assert recomputed["total_J"] == pytest.approx(total, rel=1e-6)  # the trace + the events' mark energies
    assert recomputed["duration_s"] == pytest.approx(report["duration_s"], abs=2e-6)  # times written to 1 us
    assert load_run(run_dir).extrapolated_s == 0.0  # the trace starts before the fit: nothing extrapolated

    assert main(["catalog", "list", "--root", str(root)]) == 0
    listed = capsys.readouterr().out.splitlines()[2].split()
    assert float(listed[6]) == pytest.approx(total, rel=1e-3) and listed[7] == "SIMULATED"

    with open(run_dir / "metrics.csv", newline="") as fh:
        logged = [float(r["energy/total_J"]) for r in csv.DictReader(fh) if r.get("energy/total_J")]
    assert logged[-1] == pytest.approx(total, rel=1e-12)  # the last value logged is the fit's total

    assert main(["compare", str(run_dir), "--out", str(root / "cmp"), "--no-plots"]) == 0
    capsys.readouterr()
    compared = json.loads((root / "cmp" / "compare.json").read_text())
    assert compared["runs"][0]["energy_J"] == pytest.approx(total, rel=1e-6)
    (group,) = compared["groups"].values()  # one run, its own group
    assert group["curve_energy_J_mean"][-1] <= total * (1 + 1e-6)


def test_the_events_file_carries_the_meters_energy_at_the_fit_boundaries(fitted):
    report, run_dir, _ = fitted
    with open(run_dir / "energy_events.csv", newline="") as fh:
        rows = {r["event"]: r for r in csv.DictReader(fh) if r["event"] in ("fit_start", "fit_end")}
    window_J = sum(float(rows["fit_end"][f"{n}:energy_J"]) - float(rows["fit_start"][f"{n}:energy_J"])
                   for n in ("device", "host"))
    assert window_J == pytest.approx(report["total_J"], rel=1e-9)
    with open(run_dir / "energy_trace.csv", newline="") as fh:
        first_sample_s = float(next(csv.DictReader(fh))["time_s"])
    assert first_sample_s < float(rows["fit_start"]["time_s"])  # the trace covers the fit's start


def test_the_report_holds_the_fits_attribution_bound_beside_its_total(fitted):
    """``bound_J`` of the whole fit (what `lightning-energy validate` compares a wall meter's difference with): the
    sum of the counted sensors' bounds of the fit window, finite, and each sensor's own beside its energy."""
    report, _, _ = fitted
    per_sensor = [s["bound_J"] for s in report["sensors"]]
    assert all(b is not None and b >= 0.0 for b in per_sensor)
    assert report["bound_J"] == pytest.approx(sum(per_sensor))  # its size follows the machine's load: not tested
    assert math.isfinite(report["bound_J"])
