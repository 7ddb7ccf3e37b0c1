"""The sampler under the faults a real node brings (issue 26, items 6-10 and 13).

Readings stamped at their own read time, device marks known before the readings of their tick, a
device boundary reached after the wait bound, a clock or meter that raises on the sampling thread, a
slow sensor beside a healthy one, a read that hangs near the fit's end, transient read errors, and the
threads left after release. Time is a fake clock driven by hand wherever a thread is not the point;
where it is, the tests wait on events, never on durations.
"""

from __future__ import annotations

import threading

import pytest

from conftest import FakeClock
from lightning_energy.measure import sampler as sampling
from lightning_energy.measure.meter import Meter, measure
from lightning_energy.measure.sampler import Sampler
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.simulate.simulated_sensor import SimulatedSensor

EVENT_BOUND_S = 10.0  # longest a test waits for another thread's event (a bound, never a measured duration)
TICK_S = 0.05
BUSY_W, IDLE_W = 150.0, 50.0


# ----------------------------------------------------------------------------- stand-ins
class Steps:
    """The work of a fit on the fake clock: steps from each of ``boundaries`` (s) on, busy and idle in
    turn, idle before the first. ``advance_to`` moves the clock and takes a mark at every boundary passed,
    as the training thread would while the sampler reads."""

    def __init__(self, clock: FakeClock, boundaries: list[float]) -> None:
        self.clock = clock
        self.boundaries = boundaries
        self.meter: Meter | None = None
        self.marks = []

    def power_w(self, t: float) -> float:
        passed = sum(1 for b in self.boundaries if b <= t)
        return IDLE_W if passed == 0 else (BUSY_W if passed % 2 == 1 else IDLE_W)

    def energy_J(self, t: float) -> float:
        """The exact energy from the first boundary to ``t`` (J)."""
        edges = [b for b in self.boundaries if b < t] + [t]
        return sum(self.power_w(a) * (b - a) for a, b in zip(edges, edges[1:]))

    def advance_to(self, t: float) -> None:
        for b in self.boundaries[len(self.marks):]:
            if b > t:
                break
            self.clock.t = b
            self.marks.append(self.meter.mark())
        self.clock.t = max(self.clock.t, t)

    def step_errors(self, name: str) -> list[float]:
        """Relative error of each step's energy against the truth."""
        errors = []
        for k, (start, end) in enumerate(zip(self.marks, self.marks[1:])):
            truth = (BUSY_W if k % 2 == 0 else IDLE_W) * (self.boundaries[k + 1] - self.boundaries[k])
            errors.append(abs(measure(start, end).energy_J[name] - truth) / truth)
        return errors


class SquareWave(Sensor):
    """A power sensor reading the steps' power at the moment it is read (the fake clock's time)."""

    def __init__(self, name: str, steps: Steps) -> None:
        super().__init__(name, "device")
        self.steps = steps
        self.read_at: list[float] = []

    def power_w(self) -> float:
        t = self.steps.clock()
        self.read_at.append(t)
        return self.steps.power_w(t)


class SquareWaveCounter(Sensor):
    """An energy counter exact at every read (RAPL-like) of the steps' energy."""

    def __init__(self, name: str, steps: Steps) -> None:
        super().__init__(name, "host")
        self.steps = steps

    def energy_j(self) -> float:
        return self.steps.energy_J(self.steps.clock())


class SlowRead(Sensor):
    """A constant-power sensor whose every read takes ``read_s`` of fake time (an NVML PCIe query)."""

    def __init__(self, name: str, steps: Steps, read_s: float) -> None:
        super().__init__(name, "host")
        self.steps = steps
        self.read_s = read_s

    def power_w(self) -> float:
        self.steps.advance_to(self.steps.clock() + self.read_s)
        return 20.0


class DeviceClock:
    """Stands in for ``CudaEventClock``: ``record`` gives a token, ``resolve`` its host time once the
    'device' has reached it (``lag_s`` after the call, on the fake clock) and None before, ``wait`` blocks
    (moves the fake clock) until it has."""

    asynchronous = True

    def __init__(self, clock: FakeClock, lag_s: float = 0.0) -> None:
        self.clock = clock
        self.lag_s = lag_s
        self.queries = 0

    def record(self) -> float:
        return self.clock() + self.lag_s

    def resolve(self, token: float) -> float | None:
        self.queries += 1
        return token if self.clock() >= token else None

    def wait(self, token: float) -> float:
        if self.clock() < token:
            self.clock.t = token  # blocked until the device got there
        return token

    def reanchor(self) -> None:
        pass


class RaisingDeviceClock(DeviceClock):
    """A device clock whose queries raise ``failures`` times first (a CUDA error in ``Event.query()``)."""

    def __init__(self, clock: FakeClock, failures: int = 1) -> None:
        super().__init__(clock)
        self.failures = failures

    def resolve(self, token: float) -> float | None:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return super().resolve(token)


def square_wave_fit(clock: FakeClock, sensors_for, device_clock=None, phase_s: float = 0.035) -> Steps:
    """Hand-driven ticks every 50 ms on ``clock``, twelve 100 ms steps whose boundaries fall ``phase_s``
    after a tick's start; returns the steps, their marks resolved."""
    steps = Steps(clock, [])
    sampler = Sampler(clock=clock)
    names = sampler.acquire("fit", sensors_for(steps), interval_s=TICK_S, start_thread=False)
    steps.meter = Meter(sampler, names, device_clock)
    if device_clock is None:
        steps.meter.clock.record = clock
    sampler.add_meter(steps.meter)
    next_tick = clock() + TICK_S
    steps.boundaries = [next_tick + 4 * TICK_S + phase_s + 0.1 * k for k in range(12)]
    while next_tick < steps.boundaries[-1] + 0.5:
        steps.advance_to(next_tick)
        sampler.sample_once()
        next_tick += TICK_S
    assert all(m.resolved for m in steps.marks)
    sampler.release("fit")
    return steps


# ----------------------------------------------------------------------------- item 6
def test_each_reading_is_stamped_at_its_own_read_not_at_the_start_of_its_tick():
    """A power sensor read after a 20 ms read of another sensor: its readings sit at their own read
    times, so steps that switch during the other sensor's read are exact (stamped at the tick's start
    they are off by up to the whole switch)."""
    clock = FakeClock()

    def sensors(steps):
        steps.slow, steps.power = SlowRead("pcie", steps, read_s=0.02), SquareWave("gpu", steps)
        return [steps.slow, steps.power]

    steps = square_wave_fit(clock, sensors, phase_s=0.01)  # 10 ms into a tick: inside the slow read
    # every boundary falls during the slow read, 10 ms before the power sensor is read
    assert all(any(0.0 < t - b <= 0.01 + 1e-9 for t in steps.power.read_at) for b in steps.boundaries)
    assert max(steps.step_errors("gpu")) < 1e-9  # 0.00 %


def test_the_listeners_see_every_energy_of_a_tick_at_the_ticks_time():
    """The series stamps the later read at its own time; the trace's row (one time per tick) gets that power
    sensor's cumulative energy at the row's time, the series' own figure there."""
    clock = FakeClock()
    seen = []
    steps = Steps(clock, [clock() + 10.0])
    sampler = Sampler(clock=clock)
    sensors = [SlowRead("pcie", steps, read_s=0.02), SquareWave("gpu", steps)]
    sampler.acquire("fit", sensors, start_thread=False)
    sampler.add_listener(lambda t, readings: seen.append((t, {r.name: (r.t_s, r.energy_J) for r in readings})))
    steps.meter = Meter(sampler, ["gpu"])
    clock.advance(TICK_S)
    tick_s = clock()
    sampler.sample_once()
    series = sampler.series["gpu"]
    assert series.last_read_s == sensors[1].read_at[-1] == tick_s + 0.02
    (row_s, row), = seen
    assert row_s == tick_s and row["pcie"][0] == tick_s and row["gpu"][0] == tick_s
    assert row["gpu"][1] == series.energy_at(tick_s) and series.energy_at(tick_s) < series.energies[-1]


class ShapedCounter(Sensor):
    """An NVML-like counter with its power reading among the telemetry: the counter read takes 2.4 ms, the
    fast telemetry 30 us, and every ``slow_every``-th read the PCIe queries 40 ms more."""

    counter_update_period_s = 0.1
    shape_power_field, shape_window_s, shape_lag_s = "power_W", 0.025, 0.011

    def __init__(self, clock: FakeClock, slow_every: int = 4) -> None:
        super().__init__("gpu", "device")
        self.clock = clock
        self.slow_every = slow_every
        self.reads = 0

    def energy_j(self) -> float:
        self.reads += 1
        self.clock.advance(0.0024)
        return 100.0 * self.reads

    def read_fields(self) -> dict:
        self.clock.advance(0.00003)
        power = {"power_W": 1000.0 + self.reads}  # read after the counter, before the PCIe queries
        if self.reads % self.slow_every == 0:
            self.clock.advance(0.04)
        return power


def test_the_read_end_is_taken_before_slow_telemetry_and_after_the_shape_power_reading(manual_sampler, clock):
    """Review 5.9: a read's end came after all its telemetry, so once a second NVML's two PCIe queries
    (~20 ms each) widened the interval in which the counter was seen to move by 40 ms."""
    sensor = ShapedCounter(clock)
    manual_sampler.acquire("fit", [sensor], interval_s=TICK_S, start_thread=False)
    series = manual_sampler.series["gpu"]
    calls = []
    add_reading = series.add_reading

    def recorded(t, value, breakpoints=(), shape_w=None, read_end_s=None, **more):
        calls.append((round(read_end_s - t, 6), shape_w, value))
        add_reading(t, value, breakpoints, shape_w=shape_w, read_end_s=read_end_s, **more)

    series.add_reading = recorded
    for _ in range(4):
        clock.advance(TICK_S)
        manual_sampler.sample_once()
    # reads 2, 3: the end after the power reading; read 4 (PCIe): right after the counter, not 40 ms later
    assert calls == [(0.00243, 1002.0, 200.0), (0.00243, 1003.0, 300.0), (0.0024, 1004.0, 400.0),
                     (0.00243, 1005.0, 500.0)]


# ----------------------------------------------------------------------------- item 7
def test_device_marks_reached_by_a_tick_are_boundaries_for_its_readings():
    """CUDA-like marks at zero lag: the steps of a power sensor and of a RAPL-like counter are exact, as
    with host marks (the device time was learnt only after the readings were added: 9.7 % and 5.2 %
    median per step through a fit)."""
    clock = FakeClock()
    steps = square_wave_fit(clock, lambda steps: [SquareWave("gpu", steps), SquareWaveCounter("rapl", steps)],
                            device_clock=DeviceClock(clock))
    for name in ("gpu", "rapl"):
        errors = steps.step_errors(name)
        assert len(errors) == 11 and max(errors) < 1e-9, name


# ----------------------------------------------------------------------------- item 8
class TickWhenAsked(Sampler):
    """A sampling thread stand-in: every request for a sample is one tick, 10 ms later on the fake clock."""

    def request_sample(self) -> None:
        self.clock.advance(0.01)
        self.sample_once()


def test_a_device_mark_reached_after_the_wait_bound_is_measured_not_extrapolated():
    clock = FakeClock()
    sampler = TickWhenAsked(clock=clock)
    sensor = SimulatedSensor("gpu", 100.0, clock=clock)
    names = sampler.acquire("fit", [sensor], interval_s=0.01, start_thread=False)
    meter = Meter(sampler, names, DeviceClock(clock, lag_s=0.8))  # the GPU runs 0.8 s behind Python
    sampler.add_meter(meter)
    clock.advance(0.1)
    sampler.sample_once()
    mark = meter.mark()
    assert meter.wait(mark, timeout_s=0.02) is mark  # the bound runs out long before the device gets there
    assert mark.resolved and mark.t == pytest.approx(1000.9, abs=1e-12)
    assert not mark.extrapolated and mark.extrapolated_sensors == ()
    assert mark.energy["gpu"] == pytest.approx(100.0 * (mark.t - 1000.0), rel=1e-12)


# ----------------------------------------------------------------------------- item 9
def test_a_clock_that_raises_is_recorded_and_sampling_goes_on(manual_sampler, clock):
    sensor = SimulatedSensor("gpu", 100.0, clock=clock)
    names = manual_sampler.acquire("fit", [sensor], interval_s=0.01, start_thread=False)
    device_clock = RaisingDeviceClock(clock, failures=1)
    meter = Meter(manual_sampler, names, device_clock)
    manual_sampler.add_meter(meter)
    first = meter.mark()
    clock.advance(0.01)
    manual_sampler.sample_once()  # the query raises: recorded, the tick goes on
    later = []
    for _ in range(5):
        later.append(meter.mark())
        clock.advance(0.01)
        manual_sampler.sample_once()
    assert [f.name for f in manual_sampler.failures] == [repr(meter)]
    assert "Meter(sensors=['gpu']" in repr(meter) and "DeviceClock" in repr(meter)
    assert "operation not permitted" in manual_sampler.failures[0].message
    assert manual_sampler.error_counts == {repr(meter): 1}
    assert manual_sampler.series["gpu"].live
    for mark in [first, *later]:
        assert mark.resolved and not mark.extrapolated
        assert mark.energy["gpu"] == pytest.approx(100.0 * (mark.t - 1000.0), rel=1e-9)


def test_one_meters_failing_clock_does_not_stop_another_meter(manual_sampler, clock):
    sensor = SimulatedSensor("gpu", 100.0, clock=clock)
    names = manual_sampler.acquire("fit", [sensor], interval_s=0.01, start_thread=False)
    broken = Meter(manual_sampler, names, RaisingDeviceClock(clock, failures=10**6))
    healthy = Meter(manual_sampler, names, DeviceClock(clock))
    manual_sampler.add_meter(broken)
    manual_sampler.add_meter(healthy)
    broken.mark()
    marks = []
    for _ in range(20):
        marks.append(healthy.mark())
        clock.advance(0.01)
        manual_sampler.sample_once()
    assert all(m.resolved and not m.extrapolated for m in marks)
    assert manual_sampler.error_counts[repr(broken)] == 40  # two queries a tick: both recorded
    assert len(manual_sampler.failures) == sampling.ERRORS_KEPT_PER_SOURCE  # the record stays bounded


def test_the_sampling_thread_survives_a_clock_error_and_later_marks_are_measured():
    sampler = Sampler()
    sensor = SimulatedSensor("gpu", 100.0)
    names = sampler.acquire("fit", [sensor], interval_s=0.005)
    try:
        clock_that_raises = RaisingDeviceClock(sampler.clock, failures=1)
        meter = Meter(sampler, names, clock_that_raises)
        sampler.add_meter(meter)
        meter.mark()
        sampler.request_sample()
        mark = meter.mark()
        assert meter.wait(mark, timeout_s=EVENT_BOUND_S) is mark
        assert sampler.running
        assert mark.resolved and not mark.extrapolated
        assert [f.name for f in sampler.failures] == [repr(meter)]
    finally:
        sampler.release("fit")


# ----------------------------------------------------------------------------- item 10
class Gated(Sensor):
    """A power sensor whose reads from the ``block_from``-th on wait for ``gate`` (a read that hangs in the
    driver), after setting ``blocked``; each read takes ``read_s`` of the fake clock."""

    def __init__(self, name: str, clock: FakeClock, block_from: int, read_s: float = 0.0) -> None:
        super().__init__(name, "device")
        self.clock = clock
        self.block_from = block_from
        self.read_s = read_s
        self.reads = 0
        self.blocked = threading.Event()
        self.gate = threading.Event()

    def power_w(self) -> float:
        self.reads += 1
        self.clock.advance(self.read_s)
        if self.reads >= self.block_from:
            self.blocked.set()
            self.gate.wait(EVENT_BOUND_S)
        return 100.0


class Counting(Sensor):
    """A healthy power sensor that sets ``reached`` once it has been read ``target`` times."""

    def __init__(self, name: str, clock: FakeClock) -> None:
        super().__init__(name, "host")
        self.clock = clock
        self.reads = 0
        self.target: int | None = None
        self.reached = threading.Event()

    def power_w(self) -> float:
        self.reads += 1
        self.clock.advance(0.001)
        if self.target is not None and self.reads >= self.target:
            self.reached.set()
        return 30.0


def test_a_slow_sensor_is_read_on_its_own_thread_and_never_delays_the_others():
    clock = FakeClock()
    slow = Gated("bmc", clock, block_from=2, read_s=0.1)  # 100 ms reads; the second one never returns
    healthy = Counting("cpu", clock)
    sampler = Sampler(clock=clock)
    sampler.acquire("fit", [slow, healthy], interval_s=0.01)
    try:
        assert slow.blocked.wait(EVENT_BOUND_S)  # the slow sensor's second read does not return ...
        healthy.target = healthy.reads + 5
        assert healthy.reached.wait(EVENT_BOUND_S)  # ... and the healthy sensor is read all the same
        assert sampler.series["cpu"].live and not sampler.failures
        assert sampler.slow_sensors["bmc"] == pytest.approx(0.1)  # its first read took 100 ms
        assert sampler._readers["bmc"].thread.name == "lightning-energy-reader-bmc"
    finally:
        slow.gate.set()
        sampler.release("fit")


def test_a_read_hung_near_the_end_is_declared_hung_at_the_forced_resolution(manual_sampler, clock):
    """A read that started 1 s before the fit-end flush and has not returned: the sensor is declared hung
    (failed, frozen at its last sample, reported), not extrapolated to the end as if it were merely late."""
    stuck = Gated("gpu", clock, block_from=3)
    names = manual_sampler.acquire("fit", [stuck], interval_s=0.01, start_thread=False)
    meter = Meter(manual_sampler, names)
    meter.clock.record = clock
    manual_sampler.add_meter(meter)
    clock.advance(0.01)
    manual_sampler.sample_once()
    last_good_s = clock()
    clock.advance(0.01)
    tick = threading.Thread(target=manual_sampler.sample_once, name="lightning-energy-test-tick")
    tick.start()  # the sampling thread's third read of the sensor never returns
    try:
        assert stuck.blocked.wait(EVENT_BOUND_S)
        clock.advance(1.0)
        end = meter.mark()
        manual_sampler.force_resolve(meter, end)
        series = manual_sampler.series["gpu"]
        assert series.failure is not None and "hung" in series.failure and "gpu" in manual_sampler.hung
        assert [f.name for f in manual_sampler.failures] == ["gpu"]
        assert end.resolved and end.stale == ("gpu",) and end.extrapolated_sensors == ()
        assert end.energy["gpu"] == pytest.approx(100.0 * (last_good_s - 1000.0), rel=1e-12)
    finally:
        stuck.gate.set()
        tick.join(EVENT_BOUND_S)
    assert series.last_time_s == last_good_s  # what the stuck read returned was discarded


class Flaky(Sensor):
    """A power sensor whose reads numbered in ``failing`` raise, as NVML does with TIMEOUT under load."""

    def __init__(self, clock: FakeClock, failing: set[int]) -> None:
        super().__init__("gpu", "device")
        self.clock = clock
        self.failing = failing
        self.reads = 0

    def power_w(self) -> float:
        self.reads += 1
        if self.reads in self.failing:
            raise TimeoutError("NVML_ERROR_TIMEOUT")
        return 100.0


def drive(sampler: Sampler, clock: FakeClock, ticks: int) -> list:
    meter = Meter(sampler, list(sampler.series))
    meter.clock.record = clock
    sampler.add_meter(meter)
    marks = []
    for _ in range(ticks):
        marks.append(meter.mark())
        clock.advance(0.01)
        sampler.sample_once()
    return marks


def test_one_transient_read_error_is_recorded_and_the_sensor_stays(manual_sampler, clock):
    manual_sampler.acquire("fit", [Flaky(clock, failing={4})], interval_s=0.01, start_thread=False)
    marks = drive(manual_sampler, clock, 20)
    assert manual_sampler.series["gpu"].live and not manual_sampler.failures
    assert [(e.name, e.message) for e in manual_sampler.read_errors] == [("gpu", "TimeoutError: NVML_ERROR_TIMEOUT")]
    assert manual_sampler.read_error_counts == {"gpu": 1}
    assert all(m.resolved and not m.extrapolated and not m.stale for m in marks)
    assert measure(marks[0], marks[-1]).energy_J["gpu"] == pytest.approx(100.0 * 0.19, rel=1e-9)


STREAK_LIMIT = getattr(sampling, "READ_ERROR_STREAK_LIMIT", 5)
WINDOW_LIMIT = getattr(sampling, "READ_ERROR_WINDOW_LIMIT", 20)


def test_a_sensor_fails_after_a_streak_of_errors_from_the_first_of_them(manual_sampler, clock):
    first_failing = 6  # the acquire's read is the first
    manual_sampler.acquire("fit", [Flaky(clock, failing=set(range(first_failing, 100)))], interval_s=0.01,
                           start_thread=False)
    series = manual_sampler.series["gpu"]
    drive(manual_sampler, clock, first_failing + STREAK_LIMIT - 3)  # reads 2 to 9: four errors
    assert series.live  # one error short of the limit
    first_error_s = manual_sampler.read_errors[0].t
    marks = drive(manual_sampler, clock, 10)
    assert not series.live and f"{STREAK_LIMIT} reads in a row failed" in series.failure
    assert "NVML_ERROR_TIMEOUT" in series.failure
    assert manual_sampler.read_error_counts["gpu"] == STREAK_LIMIT  # never read once failed
    assert [(f.name, f.t) for f in manual_sampler.failures] == [("gpu", first_error_s)]  # from its first error
    assert all(m.resolved and not m.extrapolated for m in marks)


def test_a_sensor_failing_too_often_is_failed_even_between_successes(manual_sampler, clock):
    manual_sampler.acquire("fit", [Flaky(clock, failing=set(range(2, 200, 2)))], interval_s=0.01,
                           start_thread=False)
    series = manual_sampler.series["gpu"]
    drive(manual_sampler, clock, 2 * WINDOW_LIMIT - 1)  # reads 2..2*WINDOW_LIMIT: WINDOW_LIMIT errors
    assert series.live
    drive(manual_sampler, clock, 2)
    assert not series.live and f"{WINDOW_LIMIT + 1} of its last" in series.failure
    assert manual_sampler.read_error_counts["gpu"] == WINDOW_LIMIT + 1


# ----------------------------------------------------------------------------- item 13
def lightning_energy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("lightning-energy") and t.is_alive()}


class LateToLeave(Sampler):
    """A sampler whose watchdog takes a moment to end after being stopped (a thread not yet scheduled)."""

    def _watch(self) -> None:
        super()._watch()
        threading.Event().wait(0.2)


def test_release_of_the_last_owner_leaves_no_thread_alive():
    before = lightning_energy_threads()
    sampler = LateToLeave()
    sampler.acquire("a", [SimulatedSensor("gpu", 100.0)], interval_s=0.01)
    sampler.acquire("b", [SimulatedSensor("cpu", 30.0, scope="host")], interval_s=0.01)
    started = lightning_energy_threads() - before
    assert {"lightning-energy-sampler", "lightning-energy-watchdog"} <= {t.name for t in started}
    sampler.release("a")
    assert all(t.is_alive() for t in started)
    sampler.release("b")
    assert not (lightning_energy_threads() - before)


def test_a_slow_sensors_reader_thread_ends_when_its_sensor_is_released():
    before = lightning_energy_threads()
    sampler = Sampler()
    slow = SimulatedSensor("bmc", 40.0, scope="host")
    slow.power_w = lambda: threading.Event().wait(0.02) or 40.0  # a 20 ms read (a BMC over the network)
    sampler.acquire("a", [slow], interval_s=0.01)
    sampler.acquire("b", [SimulatedSensor("gpu", 100.0)], interval_s=0.01)
    assert "bmc" in sampler.slow_sensors
    reader = sampler._readers["bmc"].thread
    assert reader.name == "lightning-energy-reader-bmc" and reader.is_alive()
    sampler.release("a")
    assert not reader.is_alive() and sampler.running
    sampler.release("b")
    assert not (lightning_energy_threads() - before)


# ----------------------------------------------------------------------------- second review
class TickOnSecondRequest(Sampler):
    """The first request for a sample (the wait's first bound) brings nothing; the next one is a tick 10 ms
    later on the fake clock: a device boundary learnt just before the first bound ran out."""

    requests = 0

    def request_sample(self) -> None:
        self.requests += 1
        if self.requests >= 2:
            self.clock.advance(0.01)
            self.sample_once()


def test_a_device_mark_learnt_just_before_the_bound_is_waited_for_not_extrapolated():
    clock = FakeClock()
    sampler = TickOnSecondRequest(clock=clock)
    names = sampler.acquire("fit", [SimulatedSensor("gpu", 100.0, clock=clock)], interval_s=0.01,
                            start_thread=False)
    meter = Meter(sampler, names, DeviceClock(clock, lag_s=0.0))
    sampler.add_meter(meter)
    clock.advance(0.1)
    sampler.sample_once()
    clock.advance(0.005)
    mark = meter.mark()
    meter.resolve_device_times()  # the sampling thread learnt its time; no sample after it yet
    assert mark.t is not None and not mark.resolved
    assert meter.wait(mark, timeout_s=0.001) is mark
    assert mark.resolved and not mark.extrapolated and mark.extrapolated_sensors == ()


def test_a_forced_resolution_does_not_call_a_read_of_a_slow_sensor_hung_before_several_of_its_reads(
        manual_sampler, clock):
    """A BMC whose reads take 1.2 s, in its read for 1.3 s at a fit-end flush (longer than the 1 s bound):
    slow, not hung (the watchdog's 2 s still applies)."""
    bmc = Gated("bmc", clock, block_from=2)
    names = manual_sampler.acquire("fit", [bmc], interval_s=0.01, start_thread=False)
    manual_sampler.slow_sensors["bmc"] = 1.2  # what its reader thread remembers of its reads
    meter = Meter(manual_sampler, names)
    meter.clock.record = clock
    manual_sampler.add_meter(meter)
    clock.advance(0.01)
    tick = threading.Thread(target=manual_sampler.sample_once, name="lightning-energy-test-tick")
    tick.start()
    try:
        assert bmc.blocked.wait(EVENT_BOUND_S)
        clock.advance(1.3)
        end = meter.mark()
        manual_sampler.force_resolve(meter, end)
        assert manual_sampler.series["bmc"].live and "bmc" not in manual_sampler.hung
        assert end.extrapolated_sensors == ("bmc",)  # flagged as not covered, not failed
    finally:
        bmc.gate.set()
        tick.join(EVENT_BOUND_S)


class CloseRecording(Gated):
    """A gated sensor that records whether ``close`` ran while one of its reads was in flight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_read = False
        self.closed_during_read = None

    def power_w(self) -> float:
        self.in_read = True
        try:
            return super().power_w()
        finally:
            self.in_read = False

    def close(self) -> None:
        self.closed_during_read = self.in_read


def test_release_never_closes_a_sensor_under_a_read_in_flight(manual_sampler, clock):
    sensor = CloseRecording("gpu", clock, block_from=2)
    manual_sampler.acquire("fit", [sensor], interval_s=0.01, start_thread=False)
    tick = threading.Thread(target=manual_sampler.sample_once, name="lightning-energy-test-tick")
    tick.start()
    assert sensor.blocked.wait(EVENT_BOUND_S)  # the sampling thread is inside a read
    release = threading.Thread(target=manual_sampler.release, args=("fit",))
    release.start()
    release.join(0.2)  # old code: closed at once, under the read
    sensor.gate.set()
    release.join(EVENT_BOUND_S)
    tick.join(EVENT_BOUND_S)
    assert sensor.closed_during_read is False  # closed after the read returned


# ----------------------------------------------------------------------------- issue 29, item 2
class NeverOpens(Sensor):
    """A sensor whose ``open()`` never returns (a driver call that hangs) until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__("bmc", "host")
        self.release = threading.Event()
        self.closed = False

    def open(self) -> None:
        self.release.wait(EVENT_BOUND_S)

    def power_w(self) -> float:
        return 100.0

    def close(self) -> None:
        self.closed = True


def test_a_sensor_whose_open_never_returns_is_left_out_and_the_others_measured(monkeypatch, manual_sampler, clock):
    monkeypatch.setattr(sampling, "OPEN_TIMEOUT_S", 0.05)  # the bound (15 s) shortened: the open never returns
    hung = NeverOpens()
    try:
        names = manual_sampler.acquire("fit", [hung, SimulatedSensor("gpu", 100.0, clock=clock)], interval_s=0.01,
                                       start_thread=False)
        assert names == ["gpu"] and "bmc" not in manual_sampler.series
        (line,) = manual_sampler.open_failures
        assert "'bmc'" in line and "did not return" in line
        manual_sampler.release("fit")
        assert not hung.closed  # abandoned, never closed under its hung open
    finally:
        hung.release.set()
