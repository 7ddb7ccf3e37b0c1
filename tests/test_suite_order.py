"""The whole suite in one Trainer, in one order and in the reverse order: the same figures.

Acceptance test of the one-timeline design (issue 12): every callback of the suite reports each boundary
first thing in its hooks and the first report places the mark, so no order of ``Trainer(callbacks=[...])``
changes a step's window. Fake time (``install_fake_time``): each training step moves the clock by STEP_S
on constant simulated power, so every step figure is power x STEP_S exactly and the two orders' step
series are equal to the last bit. (In real time, on steps that sleep 30 ms, two fits' median step times
drifted 5-20 % apart on a loaded machine: scheduling, not the order.) The callbacks that read the
timeline's fit and epoch windows agree with EnergyCallback's report exactly.
"""

from __future__ import annotations

import statistics

import lightning as L
import pytest

from conftest import FakeTimeSteps, RecordingLogger, tiny_loader, trainer_kwargs
from lightning_energy import (BatchSampleEstimate, CarbonCallback, CatalogCallback, EnergyCallback,
                              EnergyPredictionCheck, FlopsCallback, ForecastCallback, SimulatedSensor)
from lightning_energy.catalog import CATALOG_FILE, Catalog
from power_limit_helpers import install_fake_time

DEVICE_W, HOST_W = 120.0, 30.0
POWER_W = DEVICE_W + HOST_W
STEP_S = 0.03  # fake seconds per training step


def suite(root, clock):
    """EnergyCallback (the simulated sensors every other callback then reads) and the suite's measuring callbacks."""
    energy = EnergyCallback(sensors=[SimulatedSensor("device", DEVICE_W, kind="energy", clock=clock),
                                     SimulatedSensor("host", HOST_W, scope="host", kind="energy", clock=clock)],
                            verbose=False)
    others = [CarbonCallback(intensity_g_per_kWh=300.0, verbose=False), CatalogCallback(root / CATALOG_FILE),
              ForecastCallback(verbose=False), BatchSampleEstimate(n_batches=5, skip_batches=2),
              FlopsCallback(peak_flops_per_s=1e9), EnergyPredictionCheck(0.01)]
    return energy, others


@pytest.mark.slow
def test_the_whole_suite_gives_the_same_figures_in_reverse_order(tmp_path, monkeypatch):
    runs = {}
    for order in ("forward", "reverse"):
        clock = install_fake_time(monkeypatch.setattr)
        root = tmp_path / order
        energy, others = suite(root, clock)
        callbacks = [energy, *others] if order == "forward" else [*reversed(others), energy]
        logger = RecordingLogger(root)
        trainer = L.Trainer(callbacks=callbacks, logger=logger, **trainer_kwargs(root, max_epochs=2, log_every_n_steps=1))
        trainer.fit(FakeTimeSteps(clock, STEP_S), tiny_loader(), tiny_loader(n=48))
        runs[order] = (energy, {type(c).__name__: c for c in others}, logger)

    series = {}
    for order, (energy, others, logger) in runs.items():
        assert logger.steps("energy/step_J") == logger.steps("time/step_s") == list(range(20)), order
        step_J, step_s = logger.values("energy/step_J"), logger.values("time/step_s")
        assert step_J == pytest.approx([POWER_W * s for s in step_s], rel=1e-9)
        assert step_s == pytest.approx([STEP_S] * 20, rel=1e-9)  # the step's own time, nothing more
        series[order] = (step_s, step_J)
        report = energy.report
        assert [e["steps"] for e in report["epochs"]] == [10, 10]
        for row in report["epochs"]:
            assert row["power_W"] == pytest.approx(POWER_W, rel=1e-9)
        # the callbacks reading the timeline's windows agree with the EnergyCallback to the last bits
        carbon = others["CarbonCallback"].report
        assert carbon["total_J"] == pytest.approx(report["total_J"], rel=1e-12), order
        stored = Catalog(tmp_path / order / CATALOG_FILE).get(others["CatalogCallback"].record_id)
        assert stored["energy_J"] == pytest.approx(report["total_J"], rel=1e-12), order
        flops_steps_J = sum(row["steps_J"] for row in others["FlopsCallback"].epochs)
        assert flops_steps_J == pytest.approx(sum(e["steps_J"] for e in report["epochs"]) - step_J[0], rel=1e-9)
        prediction = others["EnergyPredictionCheck"].result
        assert prediction["measured_J"] == pytest.approx(sum(e["steps_J"] for e in report["epochs"]), rel=1e-9)
        assert others["BatchSampleEstimate"].batch_J_mean == pytest.approx(statistics.fmean(step_J[2:7]), rel=1e-9)
    assert series["forward"] == series["reverse"]  # fake time: the same windows, to the last bit
