"""Invariants of sampling and attribution, on simulated sensors and a hand-driven clock."""

from __future__ import annotations

import math

import pytest

from conftest import scaled_interval
from lightning_energy.measure.meter import Meter, measure
from lightning_energy.measure.sampler import KEEP_POINTS, Sampler
from lightning_energy.simulate.simulated_sensor import SimulatedSensor


def setup_meter(sampler: Sampler, clock, sensors) -> Meter:
    names = sampler.acquire("test", sensors, interval_s=0.01, start_thread=False)
    meter = Meter(sampler, names)
    meter.clock.record = clock  # marks on the fake clock
    sampler.add_meter(meter)
    return meter


def tick(sampler, clock, seconds, every=0.01):
    """Advance the fake clock by ``seconds`` sampling every ``every`` s."""
    steps = round(seconds / every)
    for _ in range(steps):
        clock.advance(every)
        sampler.sample_once()


@pytest.mark.parametrize("kind", ["power", "energy"])
def test_constant_power_gives_power_times_time(manual_sampler, clock, kind):
    sensor = SimulatedSensor("s", 250.0, kind=kind, clock=clock)
    meter = setup_meter(manual_sampler, clock, [sensor])
    tick(manual_sampler, clock, 0.5)
    start = meter.mark()
    clock.advance(0.0037)  # a boundary between two samples
    tick(manual_sampler, clock, 2.0)
    end = meter.mark()
    tick(manual_sampler, clock, 0.05)
    m = measure(start, end)
    assert m.duration_s == pytest.approx(2.0037, abs=1e-9)
    assert m.energy_J["s"] == pytest.approx(250.0 * m.duration_s, rel=1e-12)
    assert m.mean_power_W == pytest.approx(250.0, rel=1e-12)


def test_steps_plus_gaps_equal_epoch_on_a_varying_trace(manual_sampler, clock):
    trace = [(0.0, 80.0), (0.31, 300.0), (0.77, 120.0), (1.4, 260.0)]
    sensors = [
        SimulatedSensor("gpu", trace, kind="energy", counter_update_period_s=0.1, clock=clock),
        SimulatedSensor("cpu", [(0.0, 40.0), (0.5, 65.0)], scope="host", clock=clock),
    ]
    meter = setup_meter(manual_sampler, clock, sensors)
    epoch_start = meter.mark()
    steps, gaps = [], []
    previous_end = epoch_start
    for i in range(12):
        clock.advance(0.013)  # between-step gap (data loading)
        manual_sampler.sample_once()
        start = meter.mark()
        gaps.append((previous_end, start))
        tick(manual_sampler, clock, 0.07 + 0.01 * (i % 3))
        clock.advance(0.004)
        end = meter.mark()
        steps.append((start, end))
        meter.add_window(start, end, tag="epoch")
        previous_end = end
    clock.advance(0.02)
    epoch_end = meter.mark()
    gaps.append((previous_end, epoch_end))
    tick(manual_sampler, clock, 0.3)
    epoch = measure(epoch_start, epoch_end)
    step_sum = sum(measure(a, b).total_J for a, b in steps)
    gap_sum = sum(measure(a, b).total_J for a, b in gaps)
    assert step_sum + gap_sum == pytest.approx(epoch.total_J, rel=1e-12)
    assert meter.totals["epoch"].total_J == pytest.approx(step_sum, rel=1e-12)
    assert meter.totals["epoch"].count == 12
    assert 0 < step_sum < epoch.total_J
    # the counter is only read every 0.1 s, yet the epoch matches the exact integral closely
    exact = sensors[0].energy_at(epoch_end.t - sensors[0]._origin) - sensors[0].energy_at(epoch_start.t - sensors[0]._origin)
    assert epoch.energy_J["gpu"] == pytest.approx(exact, rel=0.05)


def test_window_shorter_than_counter_update_is_interpolated(manual_sampler, clock):
    sensor = SimulatedSensor("gpu", 200.0, kind="energy", counter_update_period_s=0.1, clock=clock)
    meter = setup_meter(manual_sampler, clock, [sensor])
    tick(manual_sampler, clock, 0.32)
    start = meter.mark()
    tick(manual_sampler, clock, 0.03)  # a 30 ms window inside one 100 ms counter period
    end = meter.mark()
    tick(manual_sampler, clock, 0.3)
    m = measure(start, end)
    assert m.energy_J["gpu"] == pytest.approx(200.0 * 0.03, rel=1e-6)
    assert m.energy_J["gpu"] not in (0.0, pytest.approx(20.0))  # neither 0 J nor the whole 100 ms jump


def test_counter_at_zero_power_still_resolves(manual_sampler, clock):
    sensor = SimulatedSensor("idle", 0.0, kind="energy", counter_update_period_s=0.1, clock=clock)
    meter = setup_meter(manual_sampler, clock, [sensor])
    start = meter.mark()
    tick(manual_sampler, clock, 0.5)
    assert start.resolved and start.energy["idle"] == 0.0


def test_failed_sensor_is_flagged_and_others_go_on(manual_sampler, clock):
    good = SimulatedSensor("good", 100.0, clock=clock)
    bad = SimulatedSensor("bad", 50.0, clock=clock, fail_after_s=0.2)
    meter = setup_meter(manual_sampler, clock, [good, bad])
    start = meter.mark()
    tick(manual_sampler, clock, 0.5)
    end = meter.mark()
    tick(manual_sampler, clock, 0.05)
    assert [f.name for f in manual_sampler.failures] == ["bad"]
    assert "simulated failure" in manual_sampler.failures[0].message
    m = measure(start, end)
    assert m.energy_J["good"] == pytest.approx(50.0, rel=1e-9)
    assert m.missing == ("bad",)
    # the energy before the failure stays: the exact integral up to the last good sample (~0.2 s after open)
    last_good_s = manual_sampler.series["bad"].last_time_s
    assert 0.19 - 1e-9 <= last_good_s - bad._origin <= 0.2
    assert m.energy_J["bad"] == pytest.approx(bad.energy_at(last_good_s - bad._origin), rel=1e-12)


def test_a_failure_never_lowers_the_running_total(manual_sampler, clock):
    good = SimulatedSensor("good", 100.0, clock=clock)
    bad = SimulatedSensor("bad", 50.0, kind="energy", clock=clock, fail_after_s=0.25)
    meter = setup_meter(manual_sampler, clock, [good, bad])
    fit_start = meter.mark()
    steps = []
    for _ in range(10):  # ten 0.1 s steps; the sensor fails in the third
        start = meter.mark()
        tick(manual_sampler, clock, 0.1)
        steps.append((start, meter.mark()))
    tick(manual_sampler, clock, 0.02)
    end = steps[-1][1]
    windows = [measure(a, b) for a, b in steps]
    running = [measure(fit_start, b).total_J for _, b in steps]
    assert running == sorted(running) and running[-1] > running[2]
    last_good_s = manual_sampler.series["bad"].last_time_s
    assert measure(fit_start, end).energy_J["bad"] == pytest.approx(50.0 * (last_good_s - fit_start.t), rel=1e-12)
    assert [("bad" in w.missing, "bad" in w.energy_J) for w in windows[:2]] == [(False, True)] * 2
    assert windows[2].missing == ("bad",) and windows[2].energy_J["bad"] > 0  # partial: up to the last sample
    assert all(w.missing == ("bad",) and "bad" not in w.energy_J for w in windows[3:])  # nothing after it
    assert all(w.energy_J["good"] == pytest.approx(10.0, rel=1e-9) for w in windows)


def test_unresolved_mark_is_extrapolated_when_forced(manual_sampler, clock):
    sensor = SimulatedSensor("s", 100.0, clock=clock)
    meter = setup_meter(manual_sampler, clock, [sensor])
    tick(manual_sampler, clock, 0.1)
    clock.advance(0.05)
    mark = meter.mark()  # no sample after it
    assert not mark.resolved
    manual_sampler.force_resolve(meter, mark)
    assert mark.resolved and mark.extrapolated
    assert mark.energy["s"] == pytest.approx(100.0 * 0.15, rel=1e-9)


def test_a_wait_on_a_starved_sampling_thread_never_reads_a_sensor_itself():
    """A wait is bounded and never reads a sensor on the calling thread (the training thread): past the
    bound the mark is extrapolated from the samples at hand and says so."""
    import threading

    readers = []

    class Recording(SimulatedSensor):
        def power_w(self):
            readers.append(threading.get_ident())
            return super().power_w()

    sampler = Sampler()
    sampler._run = lambda generation: sampler._stop.wait()  # a thread that never gets to sample (a loaded machine)
    names = sampler.acquire("starved", [Recording("s", 100.0)], interval_s=0.001)
    try:
        assert sampler.running
        meter = Meter(sampler, names)
        sampler.add_meter(meter)
        mark = meter.mark()
        assert meter.wait(mark, timeout_s=0.02) is mark and mark.resolved
        assert mark.extrapolated and mark.extrapolated_sensors == ("s",)
        assert threading.get_ident() not in readers
    finally:
        sampler.release("starved")
    assert not sampler.running


def test_memory_stays_bounded_over_many_samples(manual_sampler, clock):
    sensor = SimulatedSensor("s", 10.0, clock=clock)
    meter = setup_meter(manual_sampler, clock, [sensor])
    start = meter.mark()
    tick(manual_sampler, clock, 60.0, every=0.001)  # 60 000 samples
    series = manual_sampler.series["s"]
    assert len(series.times) <= 2 * KEEP_POINTS
    assert start.resolved
    end = meter.mark()
    tick(manual_sampler, clock, 0.01)
    assert measure(start, end).energy_J["s"] == pytest.approx(600.0, rel=1e-9)


def test_release_stops_thread_and_closes_sensors(clock):
    closed = []

    class Closing(SimulatedSensor):
        def close(self):
            closed.append(self.name)

    sampler = Sampler()
    sampler.acquire("a", [Closing("x", 1.0)], interval_s=0.005)
    sampler.acquire("b", [Closing("y", 1.0)], interval_s=0.01)
    assert sampler.running and sampler.interval_s == scaled_interval(0.005)  # the shortest asked for
    sampler.release("a")
    assert closed == ["x"] and sampler.running and sampler.interval_s == scaled_interval(0.01)
    sampler.release("b")
    assert closed == ["x", "y"] and not sampler.running


def test_callbacks_share_a_name_only_between_sensors_that_read_the_same_thing(manual_sampler, clock):
    first = SimulatedSensor("device", 80.0, clock=clock)
    manual_sampler.acquire("energy", [first], start_thread=False)
    twin = SimulatedSensor("device", 80.0, clock=clock)  # what a second callback's own detection would build
    assert manual_sampler.acquire("flops", [twin], start_thread=False) == ["device"]
    assert manual_sampler.series["device"].sensor is first
    with pytest.raises(ValueError, match="two different sensors are named 'device'.*distinct name"):
        manual_sampler.acquire("switch", [SimulatedSensor("gpu", 1.0), SimulatedSensor("device", 500.0)],
                               start_thread=False)
    assert "switch" not in manual_sampler._owners and "gpu" not in manual_sampler.series  # nothing half-registered
    manual_sampler.release("flops")
    assert manual_sampler.series["device"].sensor is first  # still held by "energy"


def test_sensors_of_one_name_on_different_hardware_are_told_apart(manual_sampler):
    from lightning_energy.measure.sensors.cpu_model import CpuEstimateSensor
    from lightning_energy.measure.sensors.nvml import NvmlGpuSensor

    class OpenedNvml(NvmlGpuSensor):
        def open(self):
            self._mode = "power"  # what opening a pre-Volta card settles

    assert NvmlGpuSensor(0, name="gpu").identity() == NvmlGpuSensor(0, name="gpu").identity()
    first = OpenedNvml(0, name="gpu")
    manual_sampler.acquire("a", [first, CpuEstimateSensor(tdp_w=65.0)], start_thread=False)
    assert manual_sampler.acquire("b", [OpenedNvml(0, name="gpu")], start_thread=False) == ["gpu"]
    with pytest.raises(ValueError, match="named 'gpu'"):
        manual_sampler.acquire("c", [OpenedNvml(1, name="gpu")], start_thread=False)
    with pytest.raises(ValueError, match="named 'cpu_estimate'"):
        manual_sampler.acquire("d", [CpuEstimateSensor(tdp_w=125.0)], start_thread=False)


def test_interval_is_validated(manual_sampler):
    with pytest.raises(ValueError, match="interval_s"):
        manual_sampler.acquire("x", [], interval_s=0.0, start_thread=False)


def test_trapezoid_on_a_power_ramp_is_exact_at_samples(manual_sampler, clock):
    class Ramp(SimulatedSensor):
        def power_w(self):
            return 10.0 * self.elapsed_s()

    sensor = Ramp("ramp", clock=clock)
    meter = setup_meter(manual_sampler, clock, [sensor])
    start = meter.mark()
    tick(manual_sampler, clock, 1.0)
    end = meter.mark()
    manual_sampler.sample_once()
    assert measure(start, end).energy_J["ramp"] == pytest.approx(5.0, rel=1e-9)  # ∫10t dt from 0 to 1
    assert not math.isnan(manual_sampler.series["ramp"].power_w)


class FakeAsyncClock:
    """Stands in for CUDA events: a boundary's time is known only once the 'GPU' reaches it."""

    asynchronous = True

    def __init__(self, clock):
        self.clock = clock
        self.gpu_time = None  # the GPU has completed work up to this host time

    def record(self):
        return self.clock() + 0.05  # the GPU reaches this boundary 50 ms after the Python call

    def resolve(self, token):
        return token if self.gpu_time is not None and self.gpu_time >= token else None

    def wait(self, token):
        self.gpu_time = max(self.gpu_time or token, token)  # blocking on the event: the GPU gets there
        return token

    def reanchor(self):
        pass


def test_asynchronous_boundaries_resolve_to_device_time(manual_sampler, clock):
    sensor = SimulatedSensor("gpu", [(0.0, 50.0), (0.1, 300.0)], clock=clock)
    names = manual_sampler.acquire("test", [sensor], interval_s=0.01, start_thread=False)
    async_clock = FakeAsyncClock(clock)
    meter = Meter(manual_sampler, names, async_clock)
    manual_sampler.add_meter(meter)
    start = meter.mark()  # host t=0, device t=0.05
    clock.advance(0.01)
    end = meter.mark()  # host t=0.01, device t=0.06
    tick(manual_sampler, clock, 0.2)
    assert not start.resolved  # the device has not reported reaching the boundary
    async_clock.gpu_time = clock()
    manual_sampler.sample_once()
    assert start.t == pytest.approx(1000.05) and end.t == pytest.approx(1000.06)
    assert measure(start, end).energy_J["gpu"] == pytest.approx(50.0 * 0.01, rel=1e-6)  # device window, not host


def test_a_lagging_device_mark_is_waited_for_never_given_host_time(manual_sampler, clock):
    """The device is 0.5 s behind the host at the epoch end: past the wait's bound the mark is still put at
    the moment the device reaches it (the clock's blocking wait), never at the host's time of asking."""
    sensor = SimulatedSensor("gpu", 100.0, clock=clock)
    names = manual_sampler.acquire("test", [sensor], interval_s=0.01, start_thread=False)
    async_clock = FakeAsyncClock(clock)
    meter = Meter(manual_sampler, names, async_clock)
    manual_sampler.add_meter(meter)
    tick(manual_sampler, clock, 0.1)
    mark = meter.mark()  # the device reaches it at host time 1000.15
    clock.advance(0.5)
    meter.wait(mark, timeout_s=0.01)
    assert mark.resolved and mark.t == pytest.approx(1000.15, abs=1e-12)
    assert mark.energy["gpu"] == pytest.approx(100.0 * (mark.t - 1000.0), rel=1e-9)


def test_a_broken_listener_is_dropped_and_sampling_goes_on(manual_sampler, clock):
    sensor = SimulatedSensor("s", 10.0, clock=clock)
    meter = setup_meter(manual_sampler, clock, [sensor])

    def broken(t, readings):
        raise OSError("No space left on device")

    manual_sampler.add_listener(broken)
    start = meter.mark()
    tick(manual_sampler, clock, 0.1)
    assert start.resolved
    assert any("No space left" in f.message for f in manual_sampler.failures)
