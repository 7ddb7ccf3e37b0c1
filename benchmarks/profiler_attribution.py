"""Time of the EnergyProfiler's per-window attribution on a GPU trace, by trace size.

The profiler annotates each window's trace on the training thread once per window, so this work is
bounded per window, not per step. A synthetic Kineto trace of ``steps`` training steps (per step: on the
main thread ``aten::linear > aten::addmm > cudaLaunchKernel`` with its ``ac2g`` flow, an ``aten::mul`` on
the autograd thread, and the gemm kernel on a GPU stream; 8 events a step) is attributed with the GPU
rule (``device=0``: device sensor to kernels, host sensor to CPU threads, launches linked) and, for
reference, with every sensor on the CPU threads (``device=None``, no kernels, no links). Medians of
``--reps`` runs, side by side in one process.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profiler_attribution.py [--reps 5]``.
Writes ``benchmarks/results/profiler_attribution.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info, write_json_atomic  # noqa: E402

from lightning_energy.outputs.op_energy import EnergyCurve, attribute_energy  # noqa: E402

STEP_US = 1000.0
SIZES = (1_000, 10_000, 50_000)


def synthetic_trace(steps: int) -> list[dict]:
    events = []
    for k in range(steps):
        t = k * STEP_US
        corr = k + 1
        events += [
            {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": t, "dur": 400.0,
             "args": {"External id": 2 * corr}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 1, "ts": t + 50, "dur": 300.0,
             "args": {"External id": 2 * corr + 1}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t + 100,
             "dur": 20.0, "args": {"correlation": corr, "cbid": 211}},
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": corr, "pid": 1, "tid": 1, "ts": t + 100},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 2, "ts": t + 500, "dur": 200.0,
             "args": {"External id": 10 * steps + corr}},
            {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "pid": 0, "tid": 7, "ts": t + 130, "dur": 600.0,
             "args": {"device": 0, "stream": 7, "correlation": corr, "External id": 2 * corr + 1}},
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": corr, "pid": 0, "tid": 7, "ts": t + 130, "bp": "e"},
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "pid": 1, "tid": 1, "ts": t,
             "dur": STEP_US},
        ]
    return events


def curve(steps: int) -> EnergyCurve:
    end_s = steps * STEP_US / 1e6
    samples = [(t, {"gpu": (300.0 * t, 300.0), "cpu": (50.0 * t, 50.0)})
               for t in (end_s * i / 100 for i in range(1, 100))]
    return EnergyCurve.from_window(0.0, {"gpu": 0.0, "cpu": 0.0}, end_s, {"gpu": 300.0 * end_s, "cpu": 50.0 * end_s},
                                   samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    scopes = {"gpu": "device", "cpu": "host"}
    rows = []
    for steps in SIZES:
        events, c = synthetic_trace(steps), curve(steps)
        times = {"gpu_rule": [], "cpu_only": []}
        for _ in range(args.reps):
            for name, device in (("gpu_rule", 0), ("cpu_only", None)):
                start = time.perf_counter()
                attribute_energy(events, c, 0.0, scopes=scopes, device=device)
                times[name].append(time.perf_counter() - start)
        gpu, cpu = statistics.median(times["gpu_rule"]), statistics.median(times["cpu_only"])
        rows.append({"steps": steps, "events": len(events), "gpu_rule_s": gpu, "cpu_only_s": cpu,
                     "ratio": gpu / cpu, "gpu_rule_us_per_event": gpu / len(events) * 1e6, "raw": times})
    print(f"{'steps':>7} {'events':>8} {'GPU rule (s)':>13} {'CPU only (s)':>13} {'ratio':>6} {'us/event':>9}")
    for r in rows:
        print(f"{r['steps']:>7} {r['events']:>8} {r['gpu_rule_s']:>13.3f} {r['cpu_only_s']:>13.3f} "
              f"{r['ratio']:>6.2f} {r['gpu_rule_us_per_event']:>9.2f}")
    out = Path(__file__).resolve().parent / "results" / "profiler_attribution.json"
    load = os.getloadavg()
    write_json_atomic(out, {"rows": rows, "reps": args.reps, "machine": machine_info(load_average=load)})
    print(f"wrote {out} (load average {load[0]:.1f}: a shared machine inflates these times)")


if __name__ == "__main__":
    main()
