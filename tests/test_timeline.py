"""The Trainer's one timeline: slow, hung, failing and counter sensors, every logger, every loop and flag.

Single-process fits with simulated sensors of known power (issue 12). The DDP cases live in test_ddp.py
and test_multinode.py.
"""

from __future__ import annotations

import csv
import threading
import time

import lightning as L
import pytest

from conftest import EPOCHS, ROWS, RecordingLogger, TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor

DEVICE_W, HOST_W = 120.0, 30.0
POWER_W = DEVICE_W + HOST_W


def sensors(**device_kwargs):
    return [SimulatedSensor("device", DEVICE_W, **device_kwargs), SimulatedSensor("host", HOST_W, scope="host")]


def last_steps_of_epochs(epochs: int) -> list[int]:
    """The global step of each epoch's last batch, for ``tiny_loader()`` (batches of 16)."""
    steps = -(-ROWS // 16)
    return [steps * (epoch + 1) - 1 for epoch in range(epochs)]


def fit(tmp_path, callbacks, logger=None, model=None, **overrides):
    logger = logger if logger is not None else RecordingLogger(tmp_path)
    trainer = L.Trainer(callbacks=callbacks, logger=logger, **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(model or TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    return trainer, logger


class WaitUntilHung(L.Callback):
    """Holds the first epoch's end until the sampler has declared ``name`` hung (its watchdog's event; no
    deadline of its own: pytest-timeout is the net)."""

    def __init__(self, energy: EnergyCallback, name: str) -> None:
        self.energy, self.name = energy, name

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            sampler = self.energy.attachment.sampler
            while self.name not in sampler.hung:
                time.sleep(0.01)


class ThreadRecording(SimulatedSensor):
    """Records the thread of every read; ``block`` makes reads wait on an event (a hung driver call)."""

    def __init__(self, *args, block_after_reads: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.readers: list[int] = []
        self.block_after_reads = block_after_reads
        self.release = threading.Event()

    def power_w(self):
        self.readers.append(threading.get_ident())
        if self.block_after_reads is not None and len(self.readers) > self.block_after_reads:
            self.release.wait()  # never set during the fit: the read never returns
        return super().power_w()


# ---------------------------------------------------------------------- the training thread never reads
def test_the_training_thread_never_reads_a_sensor(tmp_path):
    device = ThreadRecording("device", DEVICE_W)
    callback = EnergyCallback(sensors=[device], verbose=False)
    fit(tmp_path, [callback])
    assert device.readers and threading.get_ident() not in device.readers


@pytest.mark.timeout(120)
def test_a_hung_sensor_never_stalls_training_and_is_flagged(tmp_path):
    """A read that never returns: the sensor is declared hung, the others go on, training finishes."""
    device = ThreadRecording("device", DEVICE_W, block_after_reads=3)
    host = SimulatedSensor("host", HOST_W, scope="host")
    callback = EnergyCallback(sensors=[device, host], verbose=False, interval_s=0.01)
    try:
        with pytest.warns(UserWarning, match="sensor 'device' failed .*did not return"):
            # the watchdog declares the read hung on the sampler's own schedule; the fit outlasts it whatever
            # the machine's speed: its second epoch starts once the sensor is declared hung (an event, not a time)
            trainer, _ = fit(tmp_path, [callback, WaitUntilHung(callback, "device")], max_epochs=40)
    finally:
        device.release.set()
    assert trainer.current_epoch == 40
    by_name = {s["name"]: s for s in callback.report["sensors"]}
    assert "hung" in by_name["device"]["failure"]
    assert by_name["host"]["failure"] is None
    # the host sensor kept being sampled by the replacement thread: its energy covers the whole fit
    assert by_name["host"]["energy_J"] == pytest.approx(HOST_W * callback.report["duration_s"], rel=1e-9)
    assert callback.report["epochs"][-1]["missing_sensors"] == [{"sensor": "device", "rank": 0}]


def test_a_sensor_that_cannot_be_opened_is_warned_about_and_dropped(tmp_path):
    class Unopenable(SimulatedSensor):
        def open(self):
            raise OSError("Permission denied: /sys/class/powercap/intel-rapl:0/energy_uj")

    callback = EnergyCallback(sensors=[Unopenable("rapl", 50.0, scope="host"), SimulatedSensor("device", DEVICE_W)],
                              verbose=False)
    with pytest.warns(UserWarning, match="sensor 'rapl' .*could not be opened.*Permission denied"):
        trainer, _ = fit(tmp_path, [callback])
    assert trainer.current_epoch == EPOCHS
    assert [s["name"] for s in callback.report["sensors"]] == ["device"]
    assert any("rapl" in note for note in callback.report["notes"])
    assert callback.report["total_J"] == pytest.approx(DEVICE_W * callback.report["duration_s"], rel=1e-9)


# ---------------------------------------------------------------------- counters and slow sensors
def test_a_counter_sensor_adds_no_busy_loop(tmp_path):
    """NVML-like counter (0.1 s updates): waits take no extra samples; the trace has the sampling rate."""
    counter = SimulatedSensor("device", DEVICE_W, kind="energy", counter_update_period_s=0.1)
    callback = EnergyCallback(sensors=[counter], verbose=False, interval_s=0.02)
    began = time.perf_counter()
    fit(tmp_path, [callback], max_epochs=4)
    elapsed_s = time.perf_counter() - began  # the sampler runs from set-up to tear-down
    sampling = callback.report["sampling"]
    # an upper bound only: a loaded machine ticks less often, never more
    assert sampling["samples"] <= elapsed_s / sampling["interval_s"] + 5  # ticks of the thread and nothing more
    assert trace_rows(callback.trace_path) == sampling["trace_rows"] <= sampling["samples"]


def trace_rows(path) -> int:
    with open(path, newline="") as fh:
        return sum(1 for _ in csv.DictReader(fh))


class TicksAfterTheReport(L.Callback):
    """At fit end, after the EnergyCallback wrote its report, holds the teardown until the sampling thread has
    ticked ``ticks`` more times (a slow teardown on a loaded machine, made an event; no deadline of its own:
    pytest-timeout is the net)."""

    def __init__(self, energy: EnergyCallback, ticks: int = 3) -> None:
        self.energy, self.ticks = energy, ticks

    def on_fit_end(self, trainer, pl_module) -> None:
        assert self.energy.report is not None  # placed after the EnergyCallback: its report is built
        sampler = self.energy.attachment.sampler
        until = sampler.samples_taken + self.ticks
        while sampler.samples_taken < until:
            sampler.request_sample()
            time.sleep(0.001)


def test_the_trace_holds_the_samples_the_report_counts_however_long_the_teardown(tmp_path):
    """The report counts the samples at fit end; the trace ends its rows there too (it used to write on until
    the teardown: 21 rows for 18 samples on a loaded machine). The fit's end event is still written."""
    callback = EnergyCallback(sensors=sensors(), verbose=False, interval_s=0.02)
    fit(tmp_path, [callback, TicksAfterTheReport(callback)])
    sampling = callback.report["sampling"]
    assert trace_rows(callback.trace_path) == sampling["trace_rows"] <= sampling["samples"]
    with open(sampling["events_file"], newline="") as fh:
        assert [row["event"] for row in csv.DictReader(fh)][-1] == "fit_end"


def test_reads_respect_each_sensors_minimum_read_interval(tmp_path):
    """The CPU estimate is read at most every 100 ms: no forced read 1-3 ms after the previous one."""

    class Slow(SimulatedSensor):
        min_read_interval_s = 0.1

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.read_at: list[float] = []

        def power_w(self):
            self.read_at.append(time.perf_counter())
            return super().power_w()

    slow = Slow("cpu_estimate", 40.0, scope="host", estimated=True)
    callback = EnergyCallback(sensors=[slow], verbose=False, interval_s=0.01)
    fit(tmp_path, [callback], max_epochs=3)
    gaps = [b - a for a, b in zip(slow.read_at, slow.read_at[1:])]
    assert gaps and min(gaps) >= 0.1 - 1e-3


# ---------------------------------------------------------------------- loggers
def test_mlflow_tensorboard_and_csv_loggers_all_get_every_figure(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    loggers = [MLFlowLogger(experiment_name="energy", tracking_uri=f"file:{tmp_path / 'mlruns'}"),
               TensorBoardLogger(str(tmp_path), name="tb"), CSVLogger(str(tmp_path), name="csv")]
    callback = EnergyCallback(sensors=sensors(), verbose=False)
    trainer = L.Trainer(callbacks=[callback], logger=loggers, **trainer_kwargs(tmp_path))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    client = loggers[0].experiment
    run = client.get_run(loggers[0].run_id)
    for name in ("energy/epoch_J", "energy/sensor/device/epoch_J", "energy/step_J", "energy/val_epoch_J"):
        history = client.get_metric_history(run.info.run_id, name)
        assert history, name
    epoch_history = client.get_metric_history(run.info.run_id, "energy/epoch_J")
    assert [m.value for m in epoch_history] == pytest.approx([e["train_J"] for e in callback.report["epochs"]])


def test_no_metric_name_is_a_path_prefix_of_another(tmp_path):
    logger = RecordingLogger(tmp_path)
    callback = EnergyCallback(sensors=sensors(), verbose=False)
    fit(tmp_path, [callback], logger)
    names = {k for _, m in logger.metrics for k in m if k.startswith(("energy/", "power/", "time/", "edp/"))}
    assert "energy/sensor/device/epoch_J" in names
    assert not [(a, b) for a in names for b in names if b.startswith(a + "/")]


# ---------------------------------------------------------------------- steps
class Accumulating(TinyRegressor):
    pass


def test_gradient_accumulation_gives_one_step_figure_per_optimizer_step(tmp_path):
    logger = RecordingLogger(tmp_path)
    callback = EnergyCallback(sensors=sensors(), verbose=False)
    # 10 batches per epoch, 5 optimizer steps of 2 batches; log every step
    fit(tmp_path, [callback], logger, max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=1)
    steps = logger.steps("energy/step_J")
    assert steps == list(range(10))  # one figure per optimizer step, at Lightning's step numbers
    loss_steps = sorted({s for s in logger.steps("train/loss")})
    assert set(steps) <= set(loss_steps)
    assert [e["steps"] for e in callback.report["epochs"]] == [5, 5]
    for joules, seconds in zip(logger.values("energy/step_J"), logger.values("time/step_s")):
        assert joules == pytest.approx(POWER_W * seconds, rel=1e-9)


class ProbingCallback(L.Callback):
    """Not a suite callback: plain extra work inside a step is part of the step (as Lightning times it)."""


def test_work_a_suite_callback_adds_inside_a_step_is_a_sub_window_reported_apart(tmp_path, monkeypatch):
    """On fake time (steps of exactly 10 ms, a probe of exactly 20 ms inside each step's window): the step
    figures hold the step alone and the probe is reported apart, in either callback order. (In real time
    a loaded machine stretched the bare step past the probe's length: a bound on wall time tested nothing.)"""
    from conftest import FakeTimeSteps
    from lightning_energy.integration.base import MeteredCallback
    from power_limit_helpers import install_fake_time

    clock = install_fake_time(monkeypatch.setattr)
    step_s, probe_s = 0.01, 0.02

    class Probe(MeteredCallback):
        def setup(self, trainer, pl_module, stage):
            self.attach(trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            with self.timeline.extra("probe"):
                clock.advance(probe_s)

    for order in ("energy_first", "probe_first"):
        logger = RecordingLogger(tmp_path / order)
        energy = EnergyCallback(sensors=[SimulatedSensor("device", DEVICE_W, kind="energy", clock=clock),
                                         SimulatedSensor("host", HOST_W, scope="host", kind="energy", clock=clock)],
                                verbose=False)
        callbacks = [energy, Probe()] if order == "energy_first" else [Probe(), energy]
        trainer = L.Trainer(callbacks=callbacks, logger=logger,
                            **trainer_kwargs(tmp_path / order, max_epochs=1, log_every_n_steps=1))
        trainer.fit(FakeTimeSteps(clock, step_s), tiny_loader(), tiny_loader(n=48))
        step_s_logged, extra_s = logger.values("time/step_s"), logger.values("time/extra/probe_s")
        assert len(step_s_logged) == len(extra_s) == 10
        assert extra_s == pytest.approx([probe_s] * 10, rel=1e-9)
        assert step_s_logged == pytest.approx([step_s] * 10, rel=1e-9)  # the probe is never inside the step
        assert logger.values("energy/step_J") == pytest.approx([POWER_W * step_s] * 10, rel=1e-9)
        assert logger.values("energy/extra/probe_J") == pytest.approx([POWER_W * probe_s] * 10, rel=1e-9)
        assert energy.report["epochs"][0]["extras_J"]["probe"] == pytest.approx(POWER_W * probe_s * 10, rel=1e-9)


# ---------------------------------------------------------------------- loops and flags
def test_fit_twice_on_one_trainer_continues_the_totals_and_keeps_the_first_trace(tmp_path):
    logger = RecordingLogger(tmp_path)
    callback = EnergyCallback(sensors=sensors(), verbose=False)
    trainer = L.Trainer(callbacks=[callback], logger=logger, **trainer_kwargs(tmp_path, max_epochs=1))
    model = TinyRegressor()
    trainer.fit(model, tiny_loader(), tiny_loader(n=48))
    first_total, first_trace = callback.report["total_J"], callback.trace_path
    trainer.fit_loop.max_epochs = 2
    began = time.perf_counter()
    trainer.fit(model, tiny_loader(), tiny_loader(n=48))
    elapsed_s = time.perf_counter() - began  # the second fit's sampler, set-up to tear-down
    report = callback.report
    assert report["resumed"]["total_J"] == pytest.approx(first_total)
    assert report["total_J"] > first_total
    assert [e["epoch"] for e in report["epochs"]] == [0, 1]
    totals = logger.values("energy/total_J")
    assert totals == sorted(totals) and totals[-2] == pytest.approx(report["epochs"][-1]["total_J"], rel=1e-12)
    assert totals[-1] == report["total_J"]  # logged at the end of fit
    assert first_trace.exists() and callback.trace_path != first_trace and callback.trace_path.exists()
    # the second fit's samples only (an upper bound: a loaded machine ticks less often, never more)
    assert report["sampling"]["samples"] <= elapsed_s / report["sampling"]["interval_s"] + 5


class SlowSteps(TinyRegressor):
    def training_step(self, batch, batch_idx):
        time.sleep(0.01)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("flag", [dict(max_steps=3), dict(max_time={"seconds": 0.3}, max_epochs=100)])
def test_the_last_step_is_logged_when_training_stops(tmp_path, flag):
    logger = RecordingLogger(tmp_path)
    callback = EnergyCallback(sensors=sensors(), verbose=False)
    trainer, _ = fit(tmp_path, [callback], logger, model=SlowSteps(), log_every_n_steps=50, **flag)
    last = trainer.fit_loop.epoch_loop._batches_that_stepped - 1
    assert last >= 2
    assert logger.steps("energy/step_J")[-1] == last


class Predicting(TinyRegressor):
    def predict_step(self, batch, batch_idx):
        return self(batch[0])


class Silent(TinyRegressor):
    """Logs nothing (``self.log`` warns under ``barebones=True``)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return __import__("torch").nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        return None


def test_predict_is_measured(tmp_path):
    logger = RecordingLogger(tmp_path)
    callback = EnergyCallback(sensors=sensors(), verbose=False)
    trainer = L.Trainer(callbacks=[callback], logger=logger, **trainer_kwargs(tmp_path))
    trainer.predict(Predicting(), tiny_loader(n=48))
    (seconds,) = logger.values("time/predict_s")
    assert seconds > 0
    assert logger.values("energy/predict_J") == pytest.approx([POWER_W * seconds], rel=1e-9)
    assert callback.loops[-1].kind == "predict"


def test_barebones_says_why_nothing_is_logged(tmp_path):
    callback = EnergyCallback(sensors=sensors(), verbose=False, write_trace=False)
    trainer = L.Trainer(callbacks=[callback], barebones=True, max_epochs=1, accelerator="cpu", devices=1,
                        default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="barebones=True.*no step or epoch figure is logged"):
        trainer.fit(Silent(), tiny_loader(), tiny_loader(n=48))
    assert callback.report["total_J"] > 0


def test_a_sensor_failing_after_the_last_epoch_end_is_warned_about(tmp_path):
    class Breaking(SimulatedSensor):
        broken = False

        def power_w(self):
            if self.broken:
                raise RuntimeError("driver went away")
            return super().power_w()

    device = Breaking("device", DEVICE_W)

    class BreakAtTheEnd(L.Callback):
        def on_train_end(self, trainer, pl_module):
            device.broken = True

    callback = EnergyCallback(sensors=[device], verbose=False)
    with pytest.warns(UserWarning, match="sensor 'device' failed .*driver went away"):
        fit(tmp_path, [callback, BreakAtTheEnd()])
    (row,) = callback.report["sensors"]
    assert "driver went away" in row["failure"]


def test_epoch_figures_do_not_wait_for_samples(tmp_path):
    """An epoch end places one mark: its figures arrive a few steps later, exact, at the epoch's step."""
    logger = RecordingLogger(tmp_path)
    callback = EnergyCallback(sensors=sensors(), verbose=False, interval_s=0.2)  # samples far apart
    waits, training = [], threading.Event()
    from lightning_energy.measure.meter import Meter

    original = Meter.wait

    def recording_wait(self, mark, timeout_s=None):
        if training.is_set():
            waits.append(mark)
        return original(self, mark, timeout_s)

    class Training(L.Callback):
        def on_train_start(self, trainer, pl_module):
            training.set()

        def on_train_end(self, trainer, pl_module):
            training.clear()

    Meter.wait = recording_wait
    try:
        fit(tmp_path, [callback, Training()], logger, max_epochs=3)
    finally:
        Meter.wait = original
    assert waits == []  # no wait at any epoch end (only at the fit's end)
    epoch_steps = logger.steps("energy/epoch_J")
    assert epoch_steps == last_steps_of_epochs(3)  # the step of Lightning's own epoch metrics
    for row in callback.report["epochs"]:
        assert row["train_J"] == pytest.approx(POWER_W * row["train_s"], rel=1e-9)


def test_a_full_disk_at_fit_end_never_fails_the_fit(tmp_path, monkeypatch):
    """The end-of-fit reports (energy, carbon) meet a full disk: one warning each, the fit completes."""
    import errno

    from lightning_energy import io
    from lightning_energy.callbacks.carbon import CarbonCallback

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(io, "atomic_write_text", full_disk)
    energy = EnergyCallback(sensors=sensors(), verbose=False, write_trace=False)
    carbon = CarbonCallback(intensity_g_per_kWh=100.0, verbose=False)
    with pytest.warns(UserWarning, match="not written") as record:
        trainer, _ = fit(tmp_path, [energy, carbon])
    assert trainer.current_epoch == EPOCHS
    assert sum("energy_report.json" in str(w.message) for w in record) == 1
    assert sum("carbon" in str(w.message) for w in record) == 1
    assert energy.report["total_J"] > 0 and energy.report_path is None and carbon.report_path is None


def test_epochs_too_short_for_a_picture_get_no_power_figure_and_the_report_says_so(tmp_path):
    """One-batch epochs of milliseconds: no figure is drawn (matplotlib would hold the GIL for more than
    the epoch), TensorBoard has the scalars, the report's notes count the epochs left without a figure."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = EnergyCallback(sensors=sensors(), verbose=False, write_trace=False)
    trainer = L.Trainer(callbacks=[callback], logger=TensorBoardLogger(str(tmp_path), name="tb"),
                        **trainer_kwargs(tmp_path, max_epochs=20, limit_train_batches=1, limit_val_batches=0,
                                         num_sanity_val_steps=0))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    acc = EventAccumulator(str(trainer.log_dir), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert "power/trace" not in acc.Tags()["images"]
    assert len(acc.Scalars("energy/epoch_J")) == 20
    (note,) = [n for n in callback.report["notes"] if "too short" in n]
    assert note.startswith("power figure: 20 epoch(s) have none")


# ---------------------------------------------------------------------- a starved sampling thread at set-up
def test_the_fit_starts_after_a_first_sample_even_when_the_sampling_thread_starts_late(tmp_path, monkeypatch):
    """On a loaded machine the new sampling thread may wait for a core; the start mark must still fall after
    a first sample, so no part of the fit is extrapolated beyond one sampling interval (the trace's rule)."""
    from lightning_energy.measure import sampler as sampler_module
    from lightning_energy.analysis.runs import load_run

    run_thread = sampler_module.Sampler._run

    def scheduled_late(self, generation):
        time.sleep(0.2)  # the thread gets a core 200 ms after it was started (8x the old set-up bound)
        return run_thread(self, generation)

    monkeypatch.setattr(sampler_module.Sampler, "_run", scheduled_late)
    interval_s = 0.005
    callback = EnergyCallback(sensors=[SimulatedSensor("device", DEVICE_W)], verbose=False, interval_s=interval_s)
    trainer, _ = fit(tmp_path, [callback], max_epochs=2)
    run = load_run(callback.report_path.parent)
    assert run.time_s[0] - run.start_s <= interval_s  # old code: 1.3 s of the fit before the first sample


def test_an_epoch_resolved_while_steps_are_drained_is_delivered_before_the_next_epochs_steps(tmp_path, monkeypatch):
    """The sampler thread may resolve an epoch's end, and a step of the next epoch, between the moment the
    timeline asks whether the epoch is ready and the moment it drains the step results. Loggers must still
    see the epoch's figures before any step of the next epoch (CI saw `energy/total_J` go backwards).

    The race is made certain: whenever the epoch is not ready yet while a step of the next epoch has ended,
    the check waits (bounded) until the sampler has published that step, i.e. has resolved everything.
    """
    from lightning_energy.core.timeline import Timeline

    original = Timeline._epoch_ready
    raced = []

    def ready_then_sampler_catches_up(self, epoch):
        ready = original(self, epoch)
        current = self._epoch
        if not ready and current is not None and current.epoch > epoch.epoch and current.steps > 0:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and not any(
                    info[1].epoch > epoch.epoch for info, _ in list(self.meter.results)):
                time.sleep(0.005)
            raced.append(epoch.epoch)
        return ready

    monkeypatch.setattr(Timeline, "_epoch_ready", ready_then_sampler_catches_up)
    logger = RecordingLogger(tmp_path)
    callback = EnergyCallback(sensors=sensors(), verbose=False, interval_s=0.2)  # epoch ends resolve late
    fit(tmp_path, [callback], logger, max_epochs=3, log_every_n_steps=1)
    assert raced  # the race happened
    steps = [step for step, metrics in logger.metrics if "energy/total_J" in metrics]
    assert steps == sorted(steps)  # every energy figure is at a step no earlier than the one before
    totals = logger.values("energy/total_J")
    assert totals == sorted(totals)
    assert logger.steps("energy/epoch_J") == last_steps_of_epochs(3)


class GateComparison(L.Callback):
    """Compares the timeline's step gate with Lightning's own ``should_update_logs`` at every batch end;
    ``stop_at`` sets ``trainer.should_stop`` at that batch (Lightning then logs the step it stops at)."""

    def __init__(self, stop_at: int | None = None):
        self.pairs: list[tuple[bool, bool]] = []
        self.stop_at = stop_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_energy.integration.timeline import should_log_step

        if self.stop_at is not None and trainer.global_step == self.stop_at:
            trainer.should_stop = True
        self.pairs.append((should_log_step(trainer), bool(trainer._logger_connector.should_update_logs)))


@pytest.mark.parametrize("overrides", [dict(log_every_n_steps=1), dict(log_every_n_steps=3),
                                       dict(log_every_n_steps=0), dict(log_every_n_steps=2, accumulate_grad_batches=2),
                                       dict(log_every_n_steps=4, val_check_interval=5)])
@pytest.mark.parametrize("stop_at", [None, 7])
def test_the_step_gate_is_lightnings_should_update_logs_at_every_step(tmp_path, overrides, stop_at):
    gate = GateComparison(stop_at)
    fit(tmp_path, [gate], max_epochs=3, **overrides)
    assert len(gate.pairs) >= 7
    assert all(ours == lightnings for ours, lightnings in gate.pairs), gate.pairs
    if stop_at is not None and overrides["log_every_n_steps"] > 0:
        assert gate.pairs[-1] == (True, True)  # the step it stops at is logged
    assert any(lightnings for _, lightnings in gate.pairs) == (overrides["log_every_n_steps"] > 0)


def test_library_messages_go_to_the_modules_logger_on_rank_zero_only(caplog, capsys, monkeypatch):
    import logging

    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from lightning_energy.integration.base import rank_zero_info_for

    log_info = rank_zero_info_for("lightning_energy.callbacks.energy")

    def report():
        log_info("lightning-energy: report written")

    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        report()
        monkeypatch.setattr(rank_zero_only, "rank", 1)
        report()  # another rank: nothing
    (record,) = [r for r in caplog.records if r.getMessage() == "lightning-energy: report written"]
    assert (record.name, record.levelno, record.funcName) == ("lightning_energy.callbacks.energy", logging.INFO, "report")
    assert capsys.readouterr().out == ""
