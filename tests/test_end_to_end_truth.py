"""Smoke test of the end-to-end truth benchmark (``benchmarks/end_to_end_truth.py``): the harness runs a real
``Trainer.fit`` on fake time and its truth integrates correctly. The accuracy goals are measured by the
benchmark, never asserted here."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))

import end_to_end_truth as bench  # noqa: E402
from truth_hardware import (LaggingDeviceMarks, PowerTruth, TruthClock, TruthCounterSensor, TruthNvml,  # noqa: E402
                            alternating)


def test_power_truth_integrates_ramps_and_levels_exactly():
    truth = PowerTruth(0.0, 100.0)
    truth.set(2.0, 50.0, 10.0)  # 50 W rising 10 W/s
    truth.set(5.0, 20.0)
    assert truth.power_W(1.0) == 100.0 and truth.power_W(3.0) == pytest.approx(60.0)
    # 100 W x 2 s + (50 x 3 + 10 x 3^2 / 2) + 20 W x 1 s
    assert truth.energy_between(0.0, 6.0) == pytest.approx(200.0 + 195.0 + 20.0, rel=1e-12)
    assert truth.energy_between(3.0, 4.0) == pytest.approx(65.0, rel=1e-12)  # the ramp's mean, 65 W, for 1 s
    with pytest.raises(ValueError):
        truth.set(4.0, 1.0)  # the past never changes


def test_fake_hardware_reports_the_truth():
    clock = TruthClock(10.0)
    truth = PowerTruth(0.0, 100.0)
    counter = TruthCounterSensor("c", truth, clock, phase_s=0.03, read_s=(0.01, 0.01))
    assert counter.energy_j() == pytest.approx(100.0 * 9.93, rel=1e-12)  # read answers at 10.01: update at 9.93
    assert clock() == pytest.approx(10.01)

    from fakes_nvml import h100s
    from lightning_energy.measure.sensors.nvml import NvmlGpuSensor

    nvml = TruthNvml(h100s(1), clock, [truth])
    clock.t = 10.25
    sensor = NvmlGpuSensor(0, name="gpu0", pynvml_module=nvml)
    sensor.open()
    assert sensor.energy_j() == pytest.approx(100.0 * 0.2, abs=1e-3)  # loaded at 10.01: updates every 100 ms

    marks = LaggingDeviceMarks(clock, lag_s=0.5, block_until=lambda t: setattr(clock, "t", t))
    token = marks.record()
    assert marks.resolve(token) is None
    assert marks.wait(token) == pytest.approx(10.75) and marks.resolve(token) == pytest.approx(10.75)


def test_a_fit_runs_on_fake_time_and_its_truth_is_the_analytic_integral(tmp_path):
    pattern = alternating(150.0, 50.0)
    case = bench.Case("smoke", "smoke", bench.one_sensor("power", pattern), bench.fixed(0.1), steps_per_epoch=4,
                      epochs=1, seed=1, validation_batches=0)
    run = bench.run_case(case, tmp_path)
    assert run.error is None
    h = run.harness
    steps = h.steps
    assert len(steps) == 4 and all(s["end"] - s["start"] == pytest.approx(0.1) for s in steps)
    # Lightning's two marks per boundary: the next step starts 0.5-3 ms (or a data-loader gap) after the last ended
    assert all(b["start"] - a["end"] >= 0.0005 - 1e-12 for a, b in zip(steps, steps[1:]))
    # the truth, independently: idle until the first step, then each step's power held until the next one starts
    starts = [s["start"] for s in steps] + [h.fit["end"]]
    expected = pattern.idle_W * (starts[0] - h.fit["start"])
    expected += sum((150.0 if k % 2 == 0 else 50.0) * (starts[k + 1] - starts[k]) for k in range(4))
    assert h.truth_J(["power"], h.fit["start"], h.fit["end"]) == pytest.approx(expected, rel=1e-12)
    # the sampler ticked every 50-52 ms of fake time through the fit, without its thread
    assert run.driver.ticks >= (h.fit["end"] - h.fit["start"]) / 0.052
    # the product's figures were read and compared (values not asserted: the benchmark measures them)
    result = bench.evaluate(case, tmp_path / "again")
    rows = {row["figure"]: row for row in result["rows"]}
    assert rows["step (logged energy/step_J)"]["n"] == 4
    assert rows["fit (report total_J)"]["n"] == 1 and math.isfinite(rows["fit (report total_J)"]["median_pct"])
    assert "foreign_sensors_in_figures" in result["checks"] and result["error"] is None


def test_the_driver_defers_a_tick_whose_reads_would_pass_the_known_truth():
    clock = TruthClock(0.0)
    driver = bench.FakeTimeDriver(clock, random.Random(0), max_tick_read_s=0.02)

    class Ticks:
        interval_s = 0.05
        seen: list = []

        def sample_once(self):
            self.seen.append(clock())
            clock.advance(0.02)

    driver.sampler = Ticks()
    driver.advance(0.06)  # the tick at 0.05 could read until 0.07: not yet
    assert Ticks.seen == [] and clock() == pytest.approx(0.06)
    driver.advance(0.02)
    assert Ticks.seen == [pytest.approx(0.05)] and clock() == pytest.approx(0.08)  # the training thread's time
