"""Per-step energy of ~100 ms steps on a fake H200, over the phases of its power readings against the steps.

The fake (``tests/fakes_nvml.py``) follows what ``benchmarks/nvml_semantics.py`` measured on an H200: the
energy counter advances every 100 ms; the instant power refreshes every 100 ms on its own schedule,
``instant_phase_s`` after the counter's updates, holding the mean power over the 25 ms ending 11 ms before
its refresh. The real ``Sampler`` reads it every 50 ms + 0-2 ms (a fake clock: no real time), the ``Meter``
marks step boundaries where the power alternates 50/150 W, and each step's figure is compared with the
fake's exact energy. Two step patterns after 4 s of idle (power wandering by a watt):

- ``exact 100 ms``: steps of one counter period, their boundaries 43.7 ms after the counter's updates: the
  phase of the power readings against the boundaries stays fixed, so some phases put every window across a
  boundary at the same place (the worst case for the rule);
- ``70-130 ms``: step lengths drawn uniformly (seeded), so the phases wander as real steps' do.

For each of 19 refresh phases (0-90 ms after the counter), 1 (exact) or 6 (random) seeds, and counter reads
that return at once or take 2.4 ms (an H200's): median and largest step error. Medians over the table in the
summary. ``python benchmarks/shaping_phases.py`` (about 30 s); writes ``benchmarks/results/shaping_phases.json``.
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

from fakes_nvml import FakeClock, FakeNvml, alternating_steps_through_the_sampler, h100s  # noqa: E402
from machine import machine_info, write_json_atomic  # noqa: E402

from lightning_energy.measure.meter import measure  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "shaping_phases.json"
PHASES_S = [0.005 * k for k in range(19)]
COUNTER_READS_S = (0.0, 0.0024)


def step_errors(phase_s: float, counter_read_s: float, seed: int, random_steps: bool) -> list[float]:
    """Relative error of every step's figure (60 steps after 4 s idle)."""
    clock, rng = FakeClock(), random.Random(seed)
    gpus = h100s(1, power_W=50.0)
    gpus[0].instant_phase_s = phase_s
    fake = FakeNvml(gpus, clock)
    boundaries = [1004.0437]
    for _ in range(60):
        boundaries.append(boundaries[-1] + (rng.uniform(0.07, 0.13) if random_steps else 0.1))
    marks = alternating_steps_through_the_sampler(fake, clock, boundaries, rng, counter_read_s)
    errors = []
    for a, b in zip(marks, marks[1:]):
        exact = (fake.energy_mJ(0, b.t) - fake.energy_mJ(0, a.t)) / 1000.0
        errors.append(abs(measure(a, b).energy_J["gpu0"] - exact) / exact)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for pattern, seeds in (("exact 100 ms", 1), ("70-130 ms", 6)):
        for read_s in COUNTER_READS_S:
            for phase in PHASES_S:
                random_steps = pattern != "exact 100 ms"
                errors = [e for seed in range(seeds) for e in step_errors(phase, read_s, seed, random_steps)]
                rows.append({"steps": pattern, "counter_read_ms": read_s * 1000, "phase_ms": round(phase * 1000, 1),
                             "median_pct": 100 * statistics.median(errors), "max_pct": 100 * max(errors)})
    print(f"{'steps':<14}{'counter read':>13}{'phases':>8}{'median % (median, worst)':>28}"
          f"{'max % (median, worst)':>26}")
    summary = []
    for pattern in ("exact 100 ms", "70-130 ms"):
        for read_s in COUNTER_READS_S:
            sel = [r for r in rows if r["steps"] == pattern and r["counter_read_ms"] == read_s * 1000]
            medians, maxes = [r["median_pct"] for r in sel], [r["max_pct"] for r in sel]
            row = {"steps": pattern, "counter_read_ms": read_s * 1000, "phases": len(sel),
                   "median_of_medians_pct": statistics.median(medians), "worst_median_pct": max(medians),
                   "median_of_max_pct": statistics.median(maxes), "worst_max_pct": max(maxes)}
            summary.append(row)
            print(f"{pattern:<14}{read_s * 1000:>10.1f} ms{len(sel):>8}{row['median_of_medians_pct']:>14.2f}"
                  f"{row['worst_median_pct']:>14.2f}{row['median_of_max_pct']:>13.2f}{row['worst_max_pct']:>13.2f}")
    result = {"benchmark": "shaping_phases", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "summary": summary, "rows": rows,
              "wall_s": time.perf_counter() - started}
    write_json_atomic(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
