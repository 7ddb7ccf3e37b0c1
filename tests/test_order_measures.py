"""Callback order: EnergyToAccuracy, EnergyPredictionCheck, BatchSampleEstimate, FlopsCallback and
EnergyProfiler read the Trainer's one timeline, so beside an EnergyCallback, in either order of
``Trainer(callbacks=[...])``, the step figures are the same and so are theirs.

Fake time (``install_fake_time``) on simulated constant-power sensors (energy = power x time exactly):
each training step moves the clock by STEP_S, so the two orders' step series are compared exactly.
(These fits ran in real time on steps that sleep 30 ms and compared two fits' median step times within
15 %; on a loaded machine one fit's steps wait for a core longer than the other's and the medians drifted
apart by more: scheduling, not the callback order.) One real-time fit (accumulated steps) asserts only
relations between figures of the same windows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import lightning as L
import pytest

from conftest import FakeTimeSteps, RecordingLogger, TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.callbacks.batch_sample_estimate import BatchSampleEstimate
from lightning_energy.callbacks.energy_to_accuracy import EnergyToAccuracy
from lightning_energy.callbacks.flops import FlopsCallback
from lightning_energy.callbacks.prediction_check import EnergyPredictionCheck
from lightning_energy.callbacks.profiler import EnergyProfiler
from power_limit_helpers import install_fake_time

DEVICE_W, HOST_W = 120.0, 30.0
POWER_W = DEVICE_W + HOST_W
STEP_SLEEP_S = 0.03  # real seconds per step of the real-time fit
STEP_S = 0.03  # fake seconds per training step
ORDERS = ("energy_first", "callback_first")


def sensors(clock=None):
    if clock is None:
        return [SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")]
    return [SimulatedSensor("device", DEVICE_W, kind="energy", clock=clock),
            SimulatedSensor("host", HOST_W, scope="host", kind="energy", clock=clock)]


class SleepySteps(TinyRegressor):
    def training_step(self, batch, batch_idx):
        time.sleep(STEP_SLEEP_S)
        return super().training_step(batch, batch_idx)


def timed_steps(clock) -> FakeTimeSteps:
    return FakeTimeSteps(clock, STEP_S)


class TimedAccuracy(FakeTimeSteps):
    """Steps of STEP_S fake seconds; ``val/acc`` = 0.2 x (epoch + 1): 0.4 after the second epoch."""

    def __init__(self, clock) -> None:
        super().__init__(clock, STEP_S)

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", 0.2 * (self.current_epoch + 1))


@dataclass
class Run:
    trainer: L.Trainer
    energy: EnergyCallback
    callback: L.Callback
    logger: RecordingLogger

    def step_J(self) -> dict[int, float]:
        return dict(zip(self.logger.steps("energy/step_J"), self.logger.values("energy/step_J")))

    def step_s(self) -> dict[int, float]:
        return dict(zip(self.logger.steps("time/step_s"), self.logger.values("time/step_s")))


def both_orders(tmp_path, monkeypatch, make, model=timed_steps, steps: int = 20, **overrides) -> dict[str, Run]:
    """Fit with ``[EnergyCallback, make(clock)]`` and ``[make(clock), EnergyCallback]`` on fake time; check
    that the step series are every step's STEP_S and the same in both orders. Two epochs of 10 steps unless
    ``overrides`` say otherwise (fake time: no length of fit is more telling than another here)."""
    overrides.setdefault("max_epochs", 2)
    runs = {}
    for order in ORDERS:
        clock = install_fake_time(monkeypatch.setattr)
        energy, callback = EnergyCallback(sensors=sensors(clock), verbose=False, write_trace=False), make(clock)
        logger = RecordingLogger(tmp_path / order)
        callbacks = [energy, callback] if order == "energy_first" else [callback, energy]
        trainer = L.Trainer(callbacks=callbacks, logger=logger,
                            **trainer_kwargs(tmp_path / order, log_every_n_steps=1, **overrides))
        trainer.fit(model(clock), tiny_loader(n=160), tiny_loader(n=48))
        runs[order] = Run(trainer, energy, callback, logger)
    for run in runs.values():
        assert list(run.step_J()) == list(run.step_s()) == list(range(steps))  # every step, at its step number
        assert list(run.step_s().values()) == pytest.approx([STEP_S] * steps, rel=1e-9)  # the step, nothing more
        for joules, seconds in zip(run.step_J().values(), run.step_s().values()):
            assert joules == pytest.approx(POWER_W * seconds, rel=1e-9)
    first, second = (runs[order] for order in ORDERS)
    assert (first.step_s(), first.step_J()) == (second.step_s(), second.step_J())  # to the last bit
    return runs


# ---------------------------------------------------------------------- EnergyPredictionCheck
def test_prediction_check_measures_the_energy_callbacks_steps_in_either_order(tmp_path, monkeypatch):
    runs = both_orders(tmp_path, monkeypatch, lambda clock: EnergyPredictionCheck(0.01))
    for run in runs.values():
        result = run.callback.result
        assert result["steps"] == 20 and result["predicted_J"] == pytest.approx(20 * 0.01)
        # the same windows as energy/step_J and the report's steps_J, not a second set of marks
        assert result["measured_J"] == pytest.approx(sum(run.step_J().values()), rel=1e-9)
        assert result["measured_J"] == pytest.approx(sum(e["steps_J"] for e in run.energy.report["epochs"]), rel=1e-9)
        assert result["fit_J"] == pytest.approx(run.energy.report["total_J"], rel=1e-9)
        assert result["fit_s"] == pytest.approx(run.energy.report["duration_s"], rel=1e-9)
        assert run.logger.steps("prediction/measured_J") == [20]


# ---------------------------------------------------------------------- BatchSampleEstimate
def test_batch_sample_takes_the_step_figures_in_either_order(tmp_path, monkeypatch):
    runs = both_orders(tmp_path, monkeypatch, lambda clock: BatchSampleEstimate(n_batches=5, skip_batches=2))
    for run in runs.values():
        sample = run.callback
        assert sample.batches == 20 and sample.sampled == 5
        assert sample.batch_J == pytest.approx([run.step_J()[step] for step in range(2, 7)], rel=1e-12)
        assert sample.estimate_J == pytest.approx(20 * sample.batch_J_mean, rel=1e-12)
    first, second = (runs[order].callback for order in ORDERS)
    assert first.batch_J == second.batch_J == pytest.approx([POWER_W * STEP_S] * 5, rel=1e-9)


def test_batch_sample_shares_an_accumulated_step_among_its_batches(tmp_path):
    logger = RecordingLogger(tmp_path)
    energy, sample = EnergyCallback(sensors=sensors(), verbose=False, write_trace=False), BatchSampleEstimate(3, 1)
    trainer = L.Trainer(callbacks=[sample, energy], logger=logger,
                        **trainer_kwargs(tmp_path, max_epochs=1, log_every_n_steps=1, accumulate_grad_batches=2))
    trainer.fit(SleepySteps(), tiny_loader(), tiny_loader(n=48))
    steps = logger.values("energy/step_J")
    assert len(steps) == 5 and sample.batches == 10
    # batches 1, 2, 3: the second half of step 0 and both halves of step 1
    assert sample.batch_J == pytest.approx([steps[0] / 2, steps[1] / 2, steps[1] / 2], rel=1e-12)
    assert sample.estimate_J == pytest.approx(10 * sum(sample.batch_J) / 3, rel=1e-12)


# ---------------------------------------------------------------------- FlopsCallback
def test_flops_epoch_figures_are_the_step_figures_in_either_order(tmp_path, monkeypatch):
    runs = both_orders(tmp_path, monkeypatch, lambda clock: FlopsCallback(peak_flops_per_s=1e9))
    for run in runs.values():
        step_J, step_s = run.step_J(), run.step_s()
        first, second = run.callback.epochs
        epochs = [(first, range(1, 10)), (second, range(10, 20))]  # step 0 was counted: left out
        for row, steps in epochs:
            assert row["steps_J"] == pytest.approx(sum(step_J[s] for s in steps), rel=1e-9)
            assert row["steps_s"] == pytest.approx(sum(step_s[s] for s in steps), rel=1e-9)
            assert row["energy/J_per_GFLOP"] == pytest.approx(row["steps_J"] / row["flops/epoch_GFLOP"], rel=1e-12)
        assert run.logger.steps("flops/mfu") == [9, 19]  # at the epoch's last step, like energy/epoch_J
        assert run.logger.values("flops/mfu") == pytest.approx([first["flops/mfu"], second["flops/mfu"]])
    a, b = (runs[order].callback.epochs for order in ORDERS)
    assert [row["flops/epoch_GFLOP"] for row in a] == [row["flops/epoch_GFLOP"] for row in b]


# ---------------------------------------------------------------------- EnergyToAccuracy
def test_energy_to_accuracy_reads_the_fit_start_of_the_timeline_in_either_order(tmp_path, monkeypatch):
    runs = both_orders(tmp_path, monkeypatch, lambda clock: EnergyToAccuracy("val/acc", target=0.35),
                       model=TimedAccuracy, steps=30, max_epochs=3)
    for run in runs.values():
        result, epochs = run.callback.result, run.energy.report["epochs"]
        assert result["epochs_to_target"] == 2
        assert result["energy_to_target_J"] == pytest.approx(POWER_W * result["time_to_target_s"], rel=1e-9)
        # from the fit's start, as energy/total_J: past the first epoch's end, not past the second's
        assert epochs[0]["total_J"] < result["energy_to_target_J"] <= epochs[1]["total_J"]
        assert run.logger.steps("energy_to_target_J") == [19]  # the step the second validation ran at


def test_energy_to_accuracy_in_either_order_on_fake_time(tmp_path, monkeypatch):
    """Fake time: every window is exact, so the two orders agree to the last bit."""
    from lightning_energy.simulate.gpu_sim import SimulatedGPU, SimulatedWorkload
    from power_limit_helpers import ROWS, AccuracyModule

    results = {}
    for order in ORDERS:
        clock = install_fake_time(monkeypatch.setattr)
        gpu = SimulatedGPU(clock=clock)
        energy = EnergyCallback(sensors=[gpu.energy_sensor()], verbose=False, write_trace=False)
        eta = EnergyToAccuracy("val/acc", target=0.5)
        logger = RecordingLogger(tmp_path / order)
        mine = [energy, eta] if order == "energy_first" else [eta, energy]
        # the simulated step runs first in on_train_batch_end: every step window holds it
        trainer = L.Trainer(callbacks=[SimulatedWorkload(gpu=gpu), *mine], logger=logger, **trainer_kwargs(
            tmp_path / order, max_epochs=4, log_every_n_steps=1, num_sanity_val_steps=0))
        trainer.fit(AccuracyModule(batch_size=64))
        steps = 3 * ROWS // 64  # val/acc: 0.2, 0.4, 0.6 -> reached after the third epoch
        assert eta.result["energy_to_target_J"] == pytest.approx(steps * gpu.step_energy_J(300, 64), rel=1e-9)
        assert logger.values("energy/step_J") == pytest.approx([gpu.step_energy_J(300, 64)] * 4 * 16, rel=1e-9)
        results[order] = (eta.result, logger.values("energy/step_J"), logger.values("time/step_s"))
    assert results["energy_first"] == results["callback_first"]


# ---------------------------------------------------------------------- EnergyProfiler
FLUSH_S = 0.3  # fake seconds of the trace annotation: 10 steps' worth, no step could hide it


class SlowFlush(EnergyProfiler):
    """The trace annotation takes FLUSH_S more fake seconds (a big trace on a slow disk)."""

    def __init__(self, clock, **kwargs) -> None:
        super().__init__(**kwargs)
        self.clock = clock

    def _annotate(self, *args, **kwargs):
        self.clock.advance(FLUSH_S)
        return super()._annotate(*args, **kwargs)


def test_the_profiler_flush_is_never_inside_a_step_in_either_order(tmp_path, monkeypatch):
    # both_orders: every step is STEP_S exactly, so the export after step 4 is in no step's figures
    runs = both_orders(tmp_path, monkeypatch, lambda clock: SlowFlush(clock, wait=1, warmup=1, active=3,
                                                                      interval_s=0.002), steps=10, max_epochs=1)
    for run in runs.values():
        (row,) = run.energy.report["epochs"]
        assert row["extras_J"]["profiler_flush"] == pytest.approx(POWER_W * FLUSH_S, rel=1e-9)  # reported apart
        (window,) = run.callback.windows
        assert window.step == 5
        assert window.window_J == pytest.approx(POWER_W * window.window_s, rel=1e-9)  # the shared sensors only
        assert window.window_s == pytest.approx(3 * STEP_S, rel=1e-9)  # the three active steps, without the flush
