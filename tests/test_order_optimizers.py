"""Callback order: PowerLimitOptimizer, BatchSizeSearch and ZeusBatchSizeOptimizer share the Trainer's one
timeline with an EnergyCallback, so in either order of ``Trainer(callbacks=[...])`` the step figures are the
same and so are theirs.

Fake time (``install_fake_time``): the simulated GPU's steps move the clock, every window is an exact
integral, and the two orders are compared exactly. ``SimulatedWorkload`` comes first, so each simulated step
lies inside the timeline's step window (see ``test_power_limit.py`` for what holds when it comes later). The
EnergyCallback also reads a second device sensor of its own: each optimizer must count its own sensors only.
One real-time fit (simulated constant-power sensors, steps that sleep ~20 ms, figures arriving late from the
sampling thread) checks the power-limit windows where only what no delay can break is asserted (each window
holds its sleeps; constant power times its own duration), never how long anything took.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import lightning as L
import pytest

from conftest import RecordingLogger, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.callbacks.batch_size import BatchSizeSearch
from lightning_energy.callbacks.zeus_batch_size import ZeusBatchSizeOptimizer
from lightning_energy.callbacks.power_limit import PowerLimitOptimizer
from lightning_energy.simulate.gpu_sim import SimulatedGPU, SimulatedWorkload
from power_limit_helpers import ROWS, AccuracyModule, SimModule, install_fake_time, loader
from test_batch_size import CANDIDATES, HparamsModule, known_best, per_sample

ORDERS = ("energy_first", "callback_first")
OTHER_W = 50.0  # the EnergyCallback's second device sensor: in its figures, in no optimizer's


@dataclass
class Run:
    trainer: L.Trainer
    energy: EnergyCallback
    callback: L.Callback
    logger: RecordingLogger
    gpu: SimulatedGPU

    def series(self, key: str) -> dict[int, float]:
        return dict(zip(self.logger.steps(key), self.logger.values(key)))

    def logged(self, prefix: str) -> list[tuple[int, dict]]:
        return [(step, {k: v for k, v in m.items() if k.startswith(prefix)}) for step, m in self.logger.metrics
                if any(k.startswith(prefix) for k in m)]


def fake_time_fits(tmp_path, monkeypatch, make, module, fit_args=(), **overrides) -> dict[str, Run]:
    """One fit per order of ``[EnergyCallback, make(gpu)]`` after ``SimulatedWorkload``, on fake time."""
    runs = {}
    for order in ORDERS:
        clock = install_fake_time(monkeypatch.setattr)
        gpu = SimulatedGPU(clock=clock)
        other = SimulatedSensor("other_device", OTHER_W, kind="energy", clock=clock)
        energy = EnergyCallback(sensors=[gpu.energy_sensor(), other], verbose=False, write_trace=False)
        callback = make(gpu)
        pair = [energy, callback] if order == "energy_first" else [callback, energy]
        logger = RecordingLogger(tmp_path / order)
        trainer = L.Trainer(callbacks=[SimulatedWorkload(gpu=gpu), *pair], logger=logger,
                            **trainer_kwargs(tmp_path / order, log_every_n_steps=1, **overrides))
        trainer.fit(module(), *fit_args)
        runs[order] = Run(trainer, energy, callback, logger, gpu)
    first, second = (runs[order] for order in ORDERS)
    for key in ("energy/step_J", "time/step_s", "energy/epoch_J"):
        assert first.series(key) == second.series(key), key  # fake time: the same to the last bit
    return runs


def limit_at(gpu: SimulatedGPU, step: int) -> int:
    """The limit in force during ``step`` (0-based): the last set before the card ran it."""
    limit = gpu.default_limit_W
    for steps_run, watts in gpu.limit_events:
        if steps_run <= step:
            limit = watts
    return limit


# ---------------------------------------------------------------------- PowerLimitOptimizer
def test_power_limit_windows_and_choice_are_the_same_in_either_order(tmp_path, monkeypatch):
    runs = fake_time_fits(
        tmp_path, monkeypatch,
        lambda gpu: PowerLimitOptimizer(selector="zeus_cost", wait_steps=1, warmup_steps=1, profile_steps=3,
                                        gpu=gpu, log_figure=False),
        SimModule, (loader(40),), max_epochs=1)
    for run in runs.values():
        gpu, callback = run.gpu, run.callback
        assert callback.chosen_limit_W == 225 and callback.limits_profiled == [300, 275, 250, 225, 200, 175, 150]
        for limit, p in callback.profiles.items():  # the card's own energy, not the other device sensor's
            assert p.energy_per_step_J == pytest.approx(gpu.step_energy_J(limit, 256), rel=1e-9)
            assert p.time_per_step_s == pytest.approx(gpu.step_time_s(limit, 256), rel=1e-9)
        step_J, step_s = run.series("energy/step_J"), run.series("time/step_s")
        assert list(step_J) == list(range(40))
        for step, joules in step_J.items():  # every step at the limit in force, the other sensor beside it
            limit = limit_at(gpu, step)
            assert step_s[step] == pytest.approx(gpu.step_time_s(limit, 256), rel=1e-9)
            assert joules == pytest.approx(gpu.step_energy_J(limit, 256) + OTHER_W * step_s[step], rel=1e-9)
    first, second = (runs[order] for order in ORDERS)
    assert first.gpu.limit_events == second.gpu.limit_events  # the same limits at the same steps
    assert first.callback.profiles == second.callback.profiles
    assert first.logged("power_limit/") == second.logged("power_limit/")


def test_power_limit_in_either_order_in_real_time(tmp_path):
    """The threaded sampler: step figures come late, the final choice waits for its window. Constant-power
    sensors: every window's energy is the device sensor's power times its duration, exactly."""
    device_W, host_W = 120.0, 30.0
    grid = [300, 150]  # pl_step_W=150: two limits
    decision_step = 1 + 2 * (1 + 3)  # wait, then warm-up and profile per limit: the choice at this step
    runs = {}
    for order in ORDERS:
        device, host = SimulatedSensor("device", device_W), SimulatedSensor("host", host_W, scope="host")
        gpu = SimulatedGPU(gpu_index=5)  # real time: each step sleeps ~21 ms (27 ms at 150 W)
        energy = EnergyCallback(sensors=[device, host], verbose=False, write_trace=False)
        callback = PowerLimitOptimizer(selector="time", wait_steps=1, warmup_steps=1, profile_steps=3, pl_step_W=150,
                                       gpu=gpu, sensors=[device], log_figure=False)
        pair = [energy, callback] if order == "energy_first" else [callback, energy]
        logger = RecordingLogger(tmp_path / order)
        trainer = L.Trainer(callbacks=[SimulatedWorkload(gpu=gpu), *pair], logger=logger,
                            **trainer_kwargs(tmp_path / order, max_epochs=1, log_every_n_steps=1))
        trainer.fit(SimModule(), loader(16))
        run = runs[order] = Run(trainer, energy, callback, logger, gpu)
        assert callback.limits_profiled == grid and sorted(callback.profiles) == sorted(grid)
        assert callback.chosen_limit_W in grid and gpu.power_limit_W == 300
        for limit, p in callback.profiles.items():
            assert p.energy_J == pytest.approx(device_W * p.time_s, rel=1e-9)  # one window of the device sensor
            assert p.time_per_step_s >= gpu.step_time_s(limit, 256)  # each step sleeps at least this long
        step_J, step_s = run.series("energy/step_J"), run.series("time/step_s")
        assert list(step_J) == list(step_s) == list(range(16))
        for step, seconds in step_s.items():
            assert seconds >= gpu.step_time_s(limit_at(gpu, step), 256)  # the simulated step is inside it
            assert step_J[step] == pytest.approx((device_W + host_W) * seconds, rel=1e-9)
    first, second = (runs[order] for order in ORDERS)
    profiling = [[e for e in run.gpu.limit_events if e[0] < decision_step] for run in (first, second)]
    assert profiling[0] == profiling[1] == [(5, 150)]  # the second limit, set at the same step in both orders
    # how long the steps took is the machine's business (a loaded one stretches them): that the two orders give
    # the same step figures is checked exactly on fake time (test_power_limit_windows_and_choice_are_the_same_...)


# ---------------------------------------------------------------------- BatchSizeSearch
def test_batch_size_search_is_the_same_in_either_order(tmp_path, monkeypatch):
    runs = fake_time_fits(
        tmp_path, monkeypatch,
        lambda gpu: BatchSizeSearch(CANDIDATES, method="per_sample", cost="zeus_cost", gpu=gpu, warmup_steps=1,
                                    steps=3),
        HparamsModule, max_epochs=1, limit_train_batches=3)
    for run in runs.values():
        gpu, search = run.gpu, run.callback
        best = known_best(gpu, "zeus_cost")
        assert search.chosen_batch_size == best
        for row in search.results[:-1]:  # the card's own energy per sample, not the other device sensor's
            e, t = per_sample(gpu, row["batch_size"])
            assert row["energy_per_sample_J"] == pytest.approx(e, rel=1e-9)
            assert row["time_per_sample_s"] == pytest.approx(t, rel=1e-9)
        # the trials are no steps of the timeline: the three training steps only, at the chosen size
        step_J = run.series("energy/step_J")
        assert list(step_J) == [0, 1, 2]
        for joules in step_J.values():
            seconds = gpu.step_time_s(300, best)
            assert joules == pytest.approx(gpu.step_energy_J(300, best) + OTHER_W * seconds, rel=1e-9)
    first, second = (runs[order] for order in ORDERS)
    assert first.callback.results == second.callback.results
    assert first.logged("batch_size/") == second.logged("batch_size/")


# ---------------------------------------------------------------------- ZeusBatchSizeOptimizer
def test_bso_reports_are_the_same_in_either_order(tmp_path, monkeypatch, bso_server):
    url, _ = bso_server

    def client(gpu):  # a new job per fit: its first trial is the default batch size
        return ZeusBatchSizeOptimizer(url, job_id_prefix="lightning-energy-test",
                                      job_id=f"lightning-energy-test-{uuid.uuid4().hex[:8]}", batch_sizes=[32, 64],
                                      default_batch_size=64, monitor="val/acc", target_metric=0.5, max_epochs=5,
                                      gpu=gpu)

    runs = fake_time_fits(tmp_path, monkeypatch, client, AccuracyModule, max_epochs=10, num_sanity_val_steps=0)
    steps_per_epoch = ROWS // 64
    for run in runs.values():
        gpu, reports = run.gpu, run.callback.reports
        assert run.trainer.current_epoch == 3 and [r["current_epoch"] for r in reports] == [1, 2, 3]
        for epochs, report in enumerate(reports, start=1):  # the card's energy only, from the start of training
            steps = epochs * steps_per_epoch
            assert report["energy"] == pytest.approx(steps * gpu.step_energy_J(300, 64), rel=1e-9)
            assert report["time"] == pytest.approx(steps * gpu.step_time_s(300, 64), rel=1e-9)
        assert list(run.series("energy/step_J")) == list(range(3 * steps_per_epoch))
    first, second = (runs[order] for order in ORDERS)
    keys = ("batch_size", "time", "energy", "metric", "current_epoch", "cost", "stop_train", "converged")
    assert [{k: r[k] for k in keys} for r in first.callback.reports] == \
        [{k: r[k] for k in keys} for r in second.callback.reports]
    assert first.logged("bso/") == second.logged("bso/")
