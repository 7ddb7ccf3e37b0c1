"""One core, four front ends: a Lightning Trainer fit, a Fabric loop and a plain-PyTorch loop of the same work
with the same sensors give the same step, loop and epoch figures and the same report (fake time: every step and
validation batch moves the clock by an exact amount, and the power trace changes inside steps)."""

from __future__ import annotations

import json
import math
import warnings

import lightning as L
import pytest
import torch

from conftest import FakeTimeSteps, RecordingLogger, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, EnergyMeter, EnergyMonitor, SimulatedSensor
from power_limit_helpers import install_fake_time

STEP_S, VAL_S = 0.01, 0.004
EPOCHS, TRAIN_ROWS, VAL_ROWS, BATCH = 2, 160, 48, 16  # 10 steps and 3 validation batches an epoch
# power changes inside steps and inside validation (s from the sensor's opening, W)
DEVICE_TRACE = [(0.0, 100.0), (0.037, 220.0), (0.0915, 60.0), (0.1553, 180.0), (0.2011, 90.0)]
HOST_TRACE = [(0.0, 30.0), (0.0642, 45.0), (0.171, 25.0)]


def fake_time_sensors(clock):
    return [SimulatedSensor("device", DEVICE_TRACE, kind="energy", clock=clock),
            SimulatedSensor("host", HOST_TRACE, scope="host", kind="energy", clock=clock)]


def logged(metrics: list[tuple[int, dict]], name: str) -> list[tuple[int, float]]:
    return [(step, values[name]) for step, values in metrics if name in values]


def trainer_run(tmp_path, clock):
    logger = RecordingLogger(tmp_path / "trainer")
    callback = EnergyCallback(sensors=fake_time_sensors(clock), verbose=False)
    trainer = L.Trainer(callbacks=[callback], logger=logger,
                        **trainer_kwargs(tmp_path / "trainer", max_epochs=EPOCHS, log_every_n_steps=1,
                                         num_sanity_val_steps=0))
    trainer.fit(FakeTimeSteps(clock, STEP_S, VAL_S), tiny_loader(TRAIN_ROWS, BATCH), tiny_loader(VAL_ROWS, BATCH))
    return logger.metrics, callback.report


def train_by_hand(meter, clock, model, optimizer) -> None:
    """The same work as the Trainer's fit: 10 steps, then 3 validation batches, per epoch."""
    for _ in range(EPOCHS):
        for x, y in tiny_loader(TRAIN_ROWS, BATCH):
            clock.advance(STEP_S)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter.step()
        with meter.loop("val"), torch.no_grad():
            for x, y in tiny_loader(VAL_ROWS, BATCH):
                clock.advance(VAL_S)
                model(x)
        meter.epoch()


def plain_run(tmp_path, clock):
    recorded: list[tuple[int, dict]] = []
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with EnergyMeter(log_dir=tmp_path / "plain", writer=lambda name, value, step: recorded.append((step, {name: value})),
                     sensors=fake_time_sensors(clock), verbose=False) as meter:
        train_by_hand(meter, clock, model, optimizer)
    return recorded, meter.report


def fabric_run(tmp_path, clock):
    logger = RecordingLogger(tmp_path / "fabric")
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=logger)
    fabric.launch()
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    with EnergyMonitor(fabric, sensors=fake_time_sensors(clock), verbose=False) as energy:
        train_by_hand(energy, clock, model, optimizer)
    return logger.metrics, energy.report


@pytest.fixture
def runs(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    monkeypatch.setattr("lightning_energy.plain.get_sampler", lambda: clock.sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"trainer": trainer_run(tmp_path, clock), "plain": plain_run(tmp_path, clock),
                "fabric": fabric_run(tmp_path, clock)}


STEP_METRICS = ("energy/step_J", "power/step_W", "time/step_s")
EPOCH_METRICS = ("energy/epoch_J", "power/epoch_W", "time/epoch_s", "edp/epoch_Js", "energy/epoch_between_steps_J",
                 "energy/sensor/device/epoch_J", "energy/sensor/host/epoch_J", "energy/val_epoch_J",
                 "time/val_epoch_s", "power/val_epoch_W")


@pytest.mark.parametrize("front_end", ["plain", "fabric"])
def test_a_loop_by_hand_logs_the_trainers_step_and_epoch_figures(runs, front_end):
    trainer_metrics, _ = runs["trainer"]
    metrics, _ = runs[front_end]
    for name in STEP_METRICS + EPOCH_METRICS:
        expected = logged(trainer_metrics, name)
        assert expected, name
        got = logged(metrics, name)
        assert [s for s, _ in got] == [s for s, _ in expected], name  # the same steps
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-12, abs=1e-12), name
    # the power trace changes inside steps: the figures differ step to step (the check is not vacuous)
    assert len({round(v, 9) for _, v in logged(trainer_metrics, "energy/step_J")}) > 3


@pytest.mark.parametrize("front_end", ["plain", "fabric"])
def test_a_loop_by_hand_reports_what_the_trainer_reports(runs, front_end):
    _, expected = runs["trainer"]
    _, report = runs[front_end]
    for key in ("total_J", "train_J", "validation_J", "other_J", "duration_s", "measured_J", "simulated_J"):
        assert report[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-12), key
    assert len(report["epochs"]) == len(expected["epochs"]) == EPOCHS
    for row, want in zip(report["epochs"], expected["epochs"]):
        for key in ("train_J", "train_s", "steps", "steps_J", "validation_J", "per_sensor_J", "total_J", "bound_J"):
            assert row[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), key
    assert report["figures_cover"] == expected["figures_cover"] == ["device", "host"]


def test_the_figures_are_the_analytic_energy_of_the_power_trace(runs):
    """Not only equal to each other: the plain loop's epochs are the integral of the trace over their steps."""
    _, report = runs["plain"]

    def energy(trace, t):
        total = 0.0
        for (t0, p), (t1, _) in zip(trace, trace[1:] + [(math.inf, 0.0)]):
            total += p * max(0.0, min(t, t1) - t0)
        return total

    epoch_s = 10 * STEP_S + 3 * VAL_S
    for index, row in enumerate(report["epochs"]):
        start = index * epoch_s
        steps_end, end = start + 10 * STEP_S, start + epoch_s
        want_device = energy(DEVICE_TRACE, steps_end) - energy(DEVICE_TRACE, start)
        assert row["per_sensor_J"]["device"] == pytest.approx(want_device, rel=1e-9)
        want_val = sum(energy(trace, end) - energy(trace, steps_end) for trace in (DEVICE_TRACE, HOST_TRACE))
        assert row["validation_J"] == pytest.approx(want_val, rel=1e-9)


def test_a_window_measures_a_block_and_says_what_it_is(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    monkeypatch.setattr("lightning_energy.plain.get_sampler", lambda: clock.sampler)
    meter = EnergyMeter(log_dir=tmp_path, sensors=[SimulatedSensor("device", 50.0, kind="energy", clock=clock)],
                        verbose=False)
    with meter.window("eval") as figures:  # outside a run: the meter runs for the block
        clock.advance(0.25)
    assert figures.energy_J == pytest.approx(12.5, rel=1e-12)
    assert figures.duration_s == pytest.approx(0.25, rel=1e-12)
    assert figures.power_W == pytest.approx(50.0, rel=1e-12)
    assert figures.provenance == "simulated" and figures.bound_J == pytest.approx(0.0, abs=1e-9)
    assert json.loads((tmp_path / "energy_report.json").read_text())["total_J"] == pytest.approx(12.5, rel=1e-12)


def test_a_run_that_raises_still_writes_its_report(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    monkeypatch.setattr("lightning_energy.plain.get_sampler", lambda: clock.sampler)
    with pytest.raises(KeyError):
        with EnergyMeter(log_dir=tmp_path, sensors=[SimulatedSensor("device", 40.0, kind="energy", clock=clock)],
                         verbose=False) as meter:
            clock.advance(0.5)
            meter.step()
            raise KeyError("the user's bug")
    report = json.loads((tmp_path / "energy_report.json").read_text())
    assert report["total_J"] == pytest.approx(20.0, rel=1e-12)
    assert "exception" in (tmp_path / "energy_events.csv").read_text()


def test_the_meter_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="interval_s"):
        EnergyMeter(log_dir=tmp_path, interval_s=0)
    with pytest.raises(TypeError, match="writer"):
        EnergyMeter(log_dir=tmp_path, writer=42)
    with pytest.raises(RuntimeError, match="not running"):
        EnergyMeter(log_dir=tmp_path).step()
    with pytest.raises(TypeError, match="from the Fabric object"):
        EnergyMonitor(L.Fabric(accelerator="cpu", devices=1), device="cpu")


# ---------------------------------------------------------------------- GPU telemetry as logged metrics
class TelemetrySensor(SimulatedSensor):
    """A device sensor whose telemetry ramps with (fake) time: utilisation 40 % + 1000 %/s since opening."""

    def __init__(self, clock) -> None:
        super().__init__("device", 100.0, kind="energy", clock=clock)
        self.fake_clock, self.reads = clock, 0

    def read_fields(self) -> dict[str, float]:
        self.reads += 1
        since = self.fake_clock() - self._origin  # since the sensor opened
        return {"gpu_util_pct": 40.0 + 1000.0 * since, "sm_clock_MHz": 1980.0, "power_W": 100.0}


def telemetry_fit(tmp_path, clock, telemetry: bool):
    logger = RecordingLogger(tmp_path)
    sensor = TelemetrySensor(clock)
    callback = EnergyCallback(sensors=[sensor], verbose=False, telemetry=telemetry, interval_s=0.001)
    trainer = L.Trainer(callbacks=[callback], logger=logger,
                        **trainer_kwargs(tmp_path, max_epochs=1, log_every_n_steps=1, num_sanity_val_steps=0))
    trainer.fit(FakeTimeSteps(clock, STEP_S, VAL_S), tiny_loader(TRAIN_ROWS, BATCH), tiny_loader(VAL_ROWS, BATCH))
    return logger.metrics, sensor


def test_telemetry_is_logged_per_step_and_epoch_from_what_the_sampler_read(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics, sensor = telemetry_fit(tmp_path / "on", clock, telemetry=True)
        plain_metrics, plain_sensor = telemetry_fit(tmp_path / "off", clock, telemetry=False)
    steps = [v for _, v in logged(metrics, "telemetry/device/step/gpu_util_pct")]
    # each step's mean is the reading at its start, held over the step (the fake clock samples at step ends)
    assert steps == pytest.approx([40.0 + 1000.0 * STEP_S * i for i in range(10)], rel=1e-9)
    assert [v for _, v in logged(metrics, "telemetry/device/step/sm_clock_MHz")] == pytest.approx([1980.0] * 10)
    (epoch,) = [v for _, v in logged(metrics, "telemetry/device/epoch/gpu_util_pct")]
    assert epoch == pytest.approx(sum(steps) / 10, rel=1e-9)  # validation left out, as from the epoch's energy
    assert not any(name.startswith("telemetry/") for _, values in plain_metrics for name in values)
    assert not any(name.endswith("power_W") and name.startswith("telemetry/") for _, v in metrics for name in v)
    assert sensor.reads == plain_sensor.reads  # no extra device read for the telemetry


def test_a_window_mean_in_the_thinned_history_stays_close(monkeypatch):
    """Past RECENT_POINTS the older history is thinned: an epoch-long mean there is still the mean."""
    from lightning_energy.core import telemetry as telemetry_module
    from lightning_energy.measure.sampler import Reading

    monkeypatch.setattr(telemetry_module, "RECENT_POINTS", 100)
    recorder = telemetry_module.TelemetryRecorder(["gpu"])
    for i in range(1000):  # 1000 readings, 0.1 s apart, alternating 0 / 100 %
        recorder(i * 0.1, [Reading("gpu", 0.0, 0.0, {"gpu_util_pct": 100.0 * (i % 2)}, i * 0.1)])
    assert len(recorder.history[("gpu", "gpu_util_pct")].points[0]) <= 200 + 100
    assert recorder.means(0.0, 80.0)["gpu"]["gpu_util_pct"] == pytest.approx(50.0, abs=0.2)
    assert recorder.means(95.0, 96.0)["gpu"]["gpu_util_pct"] == pytest.approx(50.0, rel=1e-12)  # recent: exact
