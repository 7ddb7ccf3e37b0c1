"""CarbonCallback, CatalogCallback and ForecastCallback beside an EnergyCallback, in both callback orders.

Each is paired with ``EnergyCallback(sensors=[simulated])`` in both orders of ``Trainer(callbacks=[...])``
and reads that callback's sensors (``sensors=None``). Fake time (``install_fake_time``): each training
step moves the clock by STEP_S and each validation batch by VALIDATION_STEP_S, so every window is exact
and both orders give the same step series to the last bit: the same steps, each STEP_S long. (These fits
ran in real time on steps that sleep 30 ms and compared the two orders' median step times within 5 %;
on a loaded machine a fit's steps wait for a core by several ms more or less than the other fit's, and
the medians drifted 10-20 % apart in either direction: scheduling, not the callback order.) The
callback's own figures are the timeline's windows: equal to the EnergyCallback's report to the last bits
in both orders (constant power: every joule is the power times a second).
"""

from __future__ import annotations

import lightning as L
import pytest

from conftest import FakeTimeSteps, RecordingLogger, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.callbacks.carbon import CarbonCallback
from lightning_energy.callbacks.catalog import CatalogCallback
from lightning_energy.callbacks.forecast import ForecastCallback
from lightning_energy.catalog import CATALOG_FILE, Catalog
from power_limit_helpers import install_fake_time

DEVICE_W, HOST_W = 120.0, 30.0
POWER_W = DEVICE_W + HOST_W
ORDERS = ("energy_first", "energy_last")
STEP_S = 0.03  # fake seconds per training step
VALIDATION_STEP_S = 0.02  # fake seconds per validation batch: validation is a window of its own


def fit_both_orders(tmp_path, monkeypatch, make):
    """{order: (EnergyCallback, the other callback, RecordingLogger)} for two 2-epoch fits of 10 steps each."""
    runs = {}
    for order in ORDERS:
        clock = install_fake_time(monkeypatch.setattr)
        root = tmp_path / order
        logger = RecordingLogger(root)
        energy = EnergyCallback(sensors=[SimulatedSensor("device", DEVICE_W, kind="energy", clock=clock),
                                         SimulatedSensor("host", HOST_W, scope="host", kind="energy", clock=clock)],
                                verbose=False)
        other = make()
        callbacks = [energy, other] if order == "energy_first" else [other, energy]
        trainer = L.Trainer(callbacks=callbacks, logger=logger,
                            **trainer_kwargs(root, max_epochs=2, log_every_n_steps=1))
        trainer.fit(FakeTimeSteps(clock, STEP_S, VALIDATION_STEP_S), tiny_loader(), tiny_loader(n=48))
        runs[order] = (energy, other, logger)
    assert_the_same_step_series(runs)
    return runs


def assert_the_same_step_series(runs) -> None:
    series = {}
    for order, (energy, _, logger) in runs.items():
        assert logger.steps("energy/step_J") == logger.steps("time/step_s") == list(range(20)), order
        step_J, step_s = logger.values("energy/step_J"), logger.values("time/step_s")
        assert step_s == pytest.approx([STEP_S] * 20, rel=1e-9)  # the step's own time, nothing more
        assert step_J == pytest.approx([POWER_W * s for s in step_s], rel=1e-9)
        assert logger.steps("energy/epoch_J") == [9, 19]  # where Lightning logs its epoch metrics
        series[order] = (step_s, step_J, logger.values("energy/epoch_J"))
    assert series["energy_first"] == series["energy_last"]  # fake time: the same windows, to the last bit


# ---------------------------------------------------------------------- CarbonCallback
def test_carbon_beside_energy_in_both_orders(tmp_path, monkeypatch):
    runs = fit_both_orders(tmp_path, monkeypatch, lambda: CarbonCallback(intensity_g_per_kWh=400.0, verbose=False))
    for order, (energy, carbon, logger) in runs.items():
        report, energy_report = carbon.report, energy.report
        assert report["estimated"] is False, order  # the EnergyCallback's simulated sensors, in either order
        assert report["total_J"] == pytest.approx(energy_report["total_J"], rel=1e-12), order
        assert report["duration_s"] == energy_report["duration_s"]
        assert report["total_J"] == pytest.approx(POWER_W * report["duration_s"], rel=1e-9)
        assert [r["epoch"] for r in report["epochs"]] == [0, 1]
        for row, energy_row in zip(report["epochs"], energy_report["epochs"], strict=True):
            # an epoch's carbon includes its validation: the EnergyCallback's training plus validation
            assert row["energy_J"] == pytest.approx(energy_row["train_J"] + energy_row["validation_J"], rel=1e-12)
            assert row["energy_J"] == pytest.approx(POWER_W * row["duration_s"], rel=1e-9)
            assert row["total_J"] == pytest.approx(energy_row["total_J"], rel=1e-12)
        assert logger.steps("carbon/epoch_gCO2e") == logger.steps("carbon/total_gCO2e") == [9, 19]
        assert logger.values("carbon/total_gCO2e") == pytest.approx(
            [r["total_J"] / 3.6e6 * 400.0 for r in report["epochs"]], rel=1e-12)


# ---------------------------------------------------------------------- CatalogCallback
def test_catalog_beside_energy_in_both_orders(tmp_path, monkeypatch):
    runs = fit_both_orders(tmp_path, monkeypatch, lambda: CatalogCallback(config={"experiment": "order"}))
    for order, (energy, catalog, _) in runs.items():
        stored = Catalog(tmp_path / order / CATALOG_FILE).get(catalog.record_id)
        energy_report = energy.report
        assert stored["energy_J"] == pytest.approx(energy_report["total_J"], rel=1e-12), order
        assert stored["duration_s"] == energy_report["duration_s"]
        assert {s["name"]: s["energy_J"] for s in stored["sensors"]} == pytest.approx(
            {s["name"]: s["energy_J"] for s in energy_report["sensors"]}, rel=1e-12)
        assert stored["steps"] == 20 and stored["flops_per_step"] == 1024 and stored["estimated"] is False
        assert catalog.problems == []


# ---------------------------------------------------------------------- ForecastCallback
@pytest.mark.parametrize("budget_J", [None, 1e9], ids=["no_budget", "budget"])
def test_forecast_beside_energy_in_both_orders(tmp_path, monkeypatch, budget_J):
    # with a budget the epoch's figures are settled at its end (a bounded wait); without, when they arrive
    runs = fit_both_orders(tmp_path, monkeypatch,
                           lambda: ForecastCallback(verbose=False, budget_J=budget_J, on_budget="stop"))
    for order, (energy, forecast, logger) in runs.items():
        report, energy_report = forecast.report, energy.report
        assert report["actual"]["total_J"] == pytest.approx(energy_report["total_J"], rel=1e-12), order
        assert report["actual"]["total_s"] == energy_report["duration_s"]
        assert report["actual"]["batches"] == 20 and report["actual"]["epochs"] == 2
        assert [f["epoch"] for f in report["forecasts"]] == [0, 1]
        for f, energy_row in zip(report["forecasts"], energy_report["epochs"], strict=True):
            # measured so far at the epoch's end: the EnergyCallback's running total there
            assert f["so_far_J"] == pytest.approx(energy_row["total_J"], rel=1e-12)
            assert f["so_far_J"] == pytest.approx(POWER_W * f["so_far_s"], rel=1e-9)
            assert f["J_per_batch"] == pytest.approx(POWER_W * f["s_per_batch"], rel=1e-9)
        assert logger.steps("forecast/total_J") == [9, 19]
        assert report["budget"]["decision"] is None
