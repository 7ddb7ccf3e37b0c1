"""The whole suite in one Trainer, in one order and in the reverse order: the same figures.

Acceptance test of the one-timeline design (issue 12): every callback of the suite reports each boundary
first thing in its hooks and the first report places the mark, so no order of ``Trainer(callbacks=[...])``
changes a step's window. Steps sleep 30 ms on constant simulated power: every step figure is power x time
exactly in both orders, the step numbers are the same, and the step times' medians agree (the only
comparison that depends on real time, within 5 %: a fit's steps vary by about half a millisecond). The
callbacks that read the timeline's fit and epoch windows agree with EnergyCallback's report exactly.
"""

from __future__ import annotations

import statistics
import time

import lightning as L
import pytest

from conftest import RecordingLogger, TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import (BatchSampleEstimate, CarbonCallback, CatalogCallback, EnergyCallback,
                              EnergyPredictionCheck, FlopsCallback, ForecastCallback, SimulatedSensor)
from lightning_energy.catalog import CATALOG_FILE, Catalog

DEVICE_W, HOST_W = 120.0, 30.0
POWER_W = DEVICE_W + HOST_W
STEP_SLEEP_S = 0.03


class SleepySteps(TinyRegressor):
    def training_step(self, batch, batch_idx):
        time.sleep(STEP_SLEEP_S)
        return super().training_step(batch, batch_idx)


def suite(root):
    """EnergyCallback (the simulated sensors every other callback then reads) and the suite's measuring callbacks."""
    energy = EnergyCallback(sensors=[SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")],
                            verbose=False)
    others = [CarbonCallback(intensity_g_per_kWh=300.0, verbose=False), CatalogCallback(root / CATALOG_FILE),
              ForecastCallback(verbose=False), BatchSampleEstimate(n_batches=5, skip_batches=2),
              FlopsCallback(peak_flops_per_s=1e9), EnergyPredictionCheck(0.01)]
    return energy, others


@pytest.mark.slow
def test_the_whole_suite_gives_the_same_figures_in_reverse_order(tmp_path):
    runs = {}
    for order in ("forward", "reverse"):
        root = tmp_path / order
        energy, others = suite(root)
        callbacks = [energy, *others] if order == "forward" else [*reversed(others), energy]
        logger = RecordingLogger(root)
        trainer = L.Trainer(callbacks=callbacks, logger=logger, **trainer_kwargs(root, max_epochs=2, log_every_n_steps=1))
        trainer.fit(SleepySteps(), tiny_loader(), tiny_loader(n=48))
        runs[order] = (energy, {type(c).__name__: c for c in others}, logger)

    medians = {}
    for order, (energy, others, logger) in runs.items():
        assert logger.steps("energy/step_J") == logger.steps("time/step_s") == list(range(20)), order
        step_J, step_s = logger.values("energy/step_J"), logger.values("time/step_s")
        assert step_J == pytest.approx([POWER_W * s for s in step_s], rel=1e-9)
        assert min(step_s) >= STEP_SLEEP_S
        medians[order] = statistics.median(step_s)
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
    assert medians["forward"] == pytest.approx(medians["reverse"], rel=0.05), medians
