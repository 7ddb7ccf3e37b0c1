"""The calibrated pre-run estimate: a short measured probe of the run, extrapolated to the plan (issue 30, item 8).

The fits run on fake time (``power_limit_helpers``' threadless sampler and hand-driven clock): every batch,
validation batch and epoch end of the simulated run draws known watts for known seconds on an exact energy
counter, so the probe's figures and the prediction are exact, whatever the machine's load.
"""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy.cli.main import main
from lightning_energy.measure.meter import Meter
from lightning_energy.predict.probe_run import ProbeFigures, RunMarks, RunPlan, predict_from_probe
from power_limit_helpers import FakeHostClock, SamplingClock, ThreadlessSampler
from precision_helpers import ClockedEnergyCounter

BATCH_W, BATCH_S = 100.0, 0.01  # a training batch: 1 J
VAL_W, VAL_S = 50.0, 0.004  # a validation batch: 0.2 J
EPOCH_END_W, EPOCH_END_S = 20.0, 0.05  # an epoch end: 1 J
START_W, START_S = 10.0, 0.3  # once, at the start of training: 3 J


class SimulatedRun(L.Callback):
    """The run's costs on the fake clock (after RunMarks in the callback list: costs fall after its marks)."""

    def __init__(self, counter: ClockedEnergyCounter, noise: list[float] | None = None) -> None:
        self.counter, self.noise, self.batches = counter, list(noise or []), 0

    def on_train_start(self, trainer, pl_module):
        self.counter.run(START_W, START_S)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        factor = self.noise[self.batches % len(self.noise)] if self.noise else 1.0
        self.batches += 1
        self.counter.run(BATCH_W, BATCH_S * factor)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.counter.run(VAL_W, VAL_S)

    def on_train_epoch_end(self, trainer, pl_module):
        self.counter.run(EPOCH_END_W, EPOCH_END_S)


@pytest.fixture
def meter():
    clock = SamplingClock()
    sampler = ThreadlessSampler(clock=clock)
    clock.sampler = sampler
    counter = ClockedEnergyCounter(clock)
    owner = object()
    names = sampler.acquire(owner, [counter], 0.002)
    meter = Meter(sampler, names, FakeHostClock(clock))
    sampler.add_meter(meter)
    yield meter, counter
    sampler.remove_meter(meter)
    sampler.release(owner)


def run(tmp_path, meter, counter, epochs, train_batches, val_batches, noise=None, warmup=2):
    marks = RunMarks(meter, warmup_batches=warmup)
    trainer = L.Trainer(callbacks=[marks, SimulatedRun(counter, noise)], num_sanity_val_steps=0,
                        **trainer_kwargs(tmp_path, max_epochs=epochs, limit_train_batches=train_batches,
                                         limit_val_batches=val_batches, logger=False))
    trainer.fit(TinyRegressor(), tiny_loader(n=16 * 40), tiny_loader(n=16 * 10))
    return marks


def test_the_probe_extrapolated_to_the_plan_matches_the_measured_run_exactly(tmp_path, meter):
    meter, counter = meter
    probe = run(tmp_path / "probe", meter, counter, epochs=2, train_batches=12, val_batches=3).figures("simulated")
    assert probe.batch_J == pytest.approx(BATCH_W * BATCH_S) and probe.steady_batches == 9 + 11
    assert probe.val_batch_J == pytest.approx(VAL_W * VAL_S) and probe.val_batches == 6
    assert probe.epoch_end_J == pytest.approx(EPOCH_END_W * EPOCH_END_S, abs=1e-9)
    assert probe.batch_s_sd == pytest.approx(0, abs=1e-12)
    plan = RunPlan(epochs=5, train_batches=30, val_batches=8)
    estimate = predict_from_probe(probe, plan, margin=0.0)
    real = run(tmp_path / "real", meter, counter, epochs=5, train_batches=30, val_batches=8)
    measured_J, _ = real.total()
    expected = START_W * START_S + 5 * (30 * 1.0 + 8 * VAL_W * VAL_S + EPOCH_END_W * EPOCH_END_S)
    assert measured_J == pytest.approx(expected)
    assert estimate.predicted_J == pytest.approx(measured_J, rel=1e-9)
    assert estimate.bound_J == pytest.approx(0, abs=1e-9)  # no spread, no bound
    assert "simulated" in estimate.format() and estimate.as_dict()["provenance"] == "simulated"


def test_the_bound_grows_with_the_batch_spread_and_holds_the_real_run(tmp_path, meter):
    meter, counter = meter
    noise = [0.8, 1.2, 1.0, 0.9, 1.1]  # time per batch varies by +-20 %; power constant
    probe = run(tmp_path / "probe", meter, counter, epochs=2, train_batches=12, val_batches=3,
                noise=noise).figures()
    assert probe.batch_s_sd > 0
    estimate = predict_from_probe(probe, RunPlan(epochs=4, train_batches=40, val_batches=5), margin=0.0)
    counter_before = len(noise)
    measured_J, _ = run(tmp_path / "real", meter, counter, epochs=4, train_batches=40, val_batches=5,
                        noise=noise).total()
    assert counter_before == 5
    assert 0 < estimate.relative_bound < 0.2
    assert abs(estimate.predicted_J - measured_J) <= estimate.bound_J


def test_predict_from_probe_on_plain_numbers():
    probe = ProbeFigures(total_J=30.0, total_s=3.0, epochs=2, batch_J=1.0, batch_s=0.1, batch_s_sd=0.01,
                         steady_batches=16, train_batches=20, val_batch_J=0.5, val_batches=4, epoch_end_J=2.0)
    plan = RunPlan(epochs=10, train_batches=100, val_batches=20, val_every_n_epochs=2)
    estimate = predict_from_probe(probe, plan, margin=0.0)
    extra_batches, extra_val, extra_epochs = 1000 - 20, 5 * 20 - 4, 10 - 2
    assert estimate.parts_J == {"probe": 30.0, "training batches": extra_batches * 1.0,
                                "validation batches": extra_val * 0.5, "epoch ends": extra_epochs * 2.0}
    assert estimate.predicted_J == pytest.approx(30 + 980 + 48 + 16)
    from scipy import stats

    sd = 0.1 * 1.0  # 10 % of a batch's energy
    variance = (980 * sd / 4) ** 2 + (8 * math.sqrt(10) * sd) ** 2 + (96 * 0.1 * 0.5 / 2) ** 2
    assert estimate.bound_J == pytest.approx(stats.t.ppf(0.975, 15) * math.sqrt(variance))
    assert estimate.statistical_J == estimate.bound_J
    wide = predict_from_probe(probe, plan)  # the default run-to-run margin, in quadrature
    assert wide.bound_J == pytest.approx(math.hypot(estimate.bound_J, 0.25 * estimate.predicted_J))
    with pytest.raises(ValueError, match="margin"):
        predict_from_probe(probe, plan, margin=-1)
    with pytest.raises(ValueError, match="epochs"):
        RunPlan(epochs=0, train_batches=1)
    with pytest.raises(ValueError, match="confidence"):
        predict_from_probe(probe, plan, confidence=1.0)


LINEAR_ARGS = ["torch.nn.Linear", "--init-args", '{"in_features": 8, "out_features": 4}', "--input-shape", "16,8"]


def test_estimate_probe_prints_a_calibrated_prediction_and_labels_the_theory_relative(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    assert main(["estimate", *LINEAR_ARGS, "--epochs", "3", "--steps-per-epoch", "20", "--val-batches", "2",
                 "--probe", "--probe-batches", "3", "--no-empirical", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "RELATIVE comparison between models, NOT the joules to expect" in printed
    assert "calibrated (" in printed and "95% bound" in printed
    data = json.loads(out.read_text())["calibrated"]
    assert data["plan"] == {"epochs": 3, "train_batches": 20, "val_batches": 2, "val_every_n_epochs": 1}
    assert data["probe"]["train_batches"] == 2 * (2 + 3) and data["probe"]["val_batches"] == 2 * 2
    assert data["predicted_J"] > 0 and data["bound_J"] >= 0 and data["provenance"] in (
        "measured", "estimated", "simulated")


@pytest.mark.parametrize("argv, message", [
    (["--probe", "--probe-batches", "1"], "--probe-batches must be >= 2"),
    (["--probe", "--val-batches", "-1"], "--val-batches must be >= 0"),
])
def test_estimate_probe_arguments_are_checked(tmp_path, capsys, argv, message):
    assert main(["estimate", *LINEAR_ARGS, "--steps", "5", "--no-empirical", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_the_synthetic_probe_leaves_the_models_weights_as_they_were():
    from lightning_energy import SimulatedSensor
    from lightning_energy.predict.probe_run import synthetic_probe

    model = torch.nn.Linear(8, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate = synthetic_probe(model, torch.randn(16, 8), RunPlan(1, 10), probe_batches=2,
                               sensors=[SimulatedSensor("sim", 5.0)])
    assert estimate.probe.provenance == "simulated"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
