"""Per-step energy of ~100 ms steps on a fake H200, over the phases of its power readings against the steps.

The fake (``tests/fakes_nvml.py``) follows what ``benchmarks/nvml_semantics.py`` measured on an H200: the
energy counter advances every 100 ms; the instant power refreshes every 100 ms on its own schedule,
``instant_phase_s`` after the counter's updates, holding the mean power over the 25 ms ending 11 ms before
its refresh. The real ``Sampler`` reads it every 50 ms + 0-2 ms (a fake clock: no real time), a ``Meter``
marks the step boundaries, where the power alternates 50/150 W, and each step's figure is compared with the
fake's exact energy over the step's own marks (truth from the fake's integral of its power, not from the
meter). Two step patterns after 4 s of idle (power wandering by a watt):

- ``exact 100 ms``: steps of one counter period, their boundaries 43.7 ms after the counter's updates: the
  phase of the power readings against the boundaries stays fixed, so some phases put every window across a
  boundary at the same place (the worst case for the rule);
- ``70-130 ms``: step lengths drawn uniformly (seeded), so the phases wander as real steps' do.

Marks per boundary: ``1`` (one mark where the power changes) or ``2`` (as a Lightning fit places them: the
step's end where the power changes, then the next step's start 0.5-3 ms later, drawn uniformly; each step is
measured from its start mark to its end mark, the gap between two steps belongs to neither).

For each of 19 refresh phases (0-90 ms after the counter), 1 (exact) or 6 (random) seeds, and counter reads
that return at once or take 2.4 ms (an H200's): median and largest step error. Medians over the table in the
summary. ``python benchmarks/shaping_phases.py [--marks 1 2]`` (about 30 s per marks setting); writes
``benchmarks/results/shaping_phases.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from fakes_nvml import FakeClock, FakeNvml, h100s  # noqa: E402
from machine import machine_info, write_json_atomic  # noqa: E402

from lightning_energy.measure.meter import Meter, measure  # noqa: E402
from lightning_energy.measure.sampler import Sampler  # noqa: E402
from lightning_energy.measure.sensors.nvml import NvmlGpuSensor  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "shaping_phases.json"
PHASES_S = [0.005 * k for k in range(19)]
COUNTER_READS_S = (0.0, 0.0024)
PATTERNS = (("exact 100 ms", 1), ("70-130 ms", 6))  # (steps, seeds)
SECOND_MARK_S = (0.0005, 0.003)  # Lightning: a step's end and the next step's start, 0.5-3 ms apart
TICK_S, TICK_LATENESS_S = 0.05, 0.002


def steps_through_the_sampler(fake: FakeNvml, clock: FakeClock, boundaries: list[float], rng: random.Random,
                              counter_read_s: float, marks_per_boundary: int) -> list[tuple]:
    """Drive the real ``Sampler`` (no thread: a tick every 50 ms + 0-2 ms on ``clock``) and a ``Meter`` over
    GPU 0 of ``fake``: idle until the first boundary (the power wandering by a watt), then 150 W and 50 W in
    turn from each boundary. One mark at each boundary, or two (the second 0.5-3 ms later). Returns each
    step's (start mark, end mark), resolved."""
    fake.latency_s["nvmlDeviceGetTotalEnergyConsumption"] = counter_read_s
    sampler = Sampler(clock=clock)
    names = sampler.acquire("steps", [NvmlGpuSensor(0, pynvml_module=fake)], interval_s=TICK_S, start_thread=False)
    meter = Meter(sampler, names)
    meter.clock.record = clock
    sampler.add_meter(meter)
    events = []  # (time, changes the power)
    for b in boundaries:
        events.append((b, True))
        if marks_per_boundary == 2:
            events.append((b + rng.uniform(*SECOND_MARK_S), False))
    next_tick, steps, start, changes = clock() + TICK_S, [], None, 0
    for at, change in [*events, (boundaries[-1] + 1.0, None)]:
        while next_tick + counter_read_s < at:  # each tick done by the mark
            clock.t = next_tick
            if not changes:
                fake.set_power(0, 50.0 + rng.uniform(-1.0, 1.0))
            sampler.sample_once()
            next_tick += TICK_S + rng.uniform(0.0, TICK_LATENESS_S)
        if change is None:
            break
        clock.t = at
        if change:
            fake.set_power(0, 150.0 if changes % 2 == 0 else 50.0)
            changes += 1
        mark = meter.mark()
        if change and start is not None:
            steps.append((start, mark))  # a step ends where the power changes
        if marks_per_boundary == 1 or not change:
            start = mark  # the next step starts here
    sampler.release("steps")
    return steps


def step_errors(phase_s: float, counter_read_s: float, seed: int, random_steps: bool,
                marks_per_boundary: int) -> list[float]:
    """Relative error of every step's figure (60 steps after 4 s idle)."""
    clock, rng = FakeClock(), random.Random(seed)
    gpus = h100s(1, power_W=50.0)
    gpus[0].instant_phase_s = phase_s
    fake = FakeNvml(gpus, clock)
    boundaries = [1004.0437]
    for _ in range(60):
        boundaries.append(boundaries[-1] + (rng.uniform(0.07, 0.13) if random_steps else 0.1))
    errors = []
    for a, b in steps_through_the_sampler(fake, clock, boundaries, rng, counter_read_s, marks_per_boundary):
        exact = (fake.energy_mJ(0, b.t) - fake.energy_mJ(0, a.t)) / 1000.0
        errors.append(abs(measure(a, b).energy_J["gpu0"] - exact) / exact)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--marks", type=int, nargs="+", choices=(1, 2), default=[1, 2],
                        help="marks per step boundary: 1, 2 (as Lightning places them) or both (default)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for marks in args.marks:
        for pattern, seeds in PATTERNS:
            for read_s in COUNTER_READS_S:
                for phase in PHASES_S:
                    random_steps = pattern != "exact 100 ms"
                    errors = [e for seed in range(seeds) for e in step_errors(phase, read_s, seed, random_steps, marks)]
                    rows.append({"marks_per_boundary": marks, "steps": pattern, "counter_read_ms": read_s * 1000,
                                 "phase_ms": round(phase * 1000, 1), "median_pct": 100 * statistics.median(errors),
                                 "max_pct": 100 * max(errors)})
    print(f"{'marks':>5}  {'steps':<14}{'counter read':>13}{'phases':>8}{'median % (median, worst)':>28}"
          f"{'max % (median, worst)':>26}")
    summary = []
    for marks in args.marks:
        for pattern, _ in PATTERNS:
            for read_s in COUNTER_READS_S:
                sel = [r for r in rows if r["marks_per_boundary"] == marks and r["steps"] == pattern
                       and r["counter_read_ms"] == read_s * 1000]
                medians, maxes = [r["median_pct"] for r in sel], [r["max_pct"] for r in sel]
                row = {"marks_per_boundary": marks, "steps": pattern, "counter_read_ms": read_s * 1000,
                       "phases": len(sel), "median_of_medians_pct": statistics.median(medians),
                       "worst_median_pct": max(medians), "median_of_max_pct": statistics.median(maxes),
                       "worst_max_pct": max(maxes)}
                summary.append(row)
                print(f"{marks:>5}  {pattern:<14}{read_s * 1000:>10.1f} ms{len(sel):>8}"
                      f"{row['median_of_medians_pct']:>14.2f}{row['worst_median_pct']:>14.2f}"
                      f"{row['median_of_max_pct']:>13.2f}{row['worst_max_pct']:>13.2f}")
    result = {"benchmark": "shaping_phases", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "second_mark_s": list(SECOND_MARK_S), "summary": summary, "rows": rows,
              "wall_s": time.perf_counter() - started}
    write_json_atomic(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
