"""Profiling steps the adaptive power-limit search needs, against Zeus's exhaustive 25 W sweep, on the simulator.

For each simulated card (V100 150-300 W as in the power-limit study, A100 100-400 W, H100 200-700 W),
workload (compute-bound, memory-bound, one that never reaches the upper limits) and selector (energy,
time, ZeusCost with eta 0.2/0.5/0.8, max slowdown 1.1), both searches of ``lightning_energy.power_limit``
are driven with the simulator's per-window energy and time, exact or with multiplicative Gaussian noise
(1 % and 3 %, seeded, ``--reps`` repetitions). A search's profiling steps are Zeus's defaults: 1 wait
step plus (10 warm-up + 40 profile) steps per profiled limit. A pick succeeds when its true cost (the
noise-free model) is within 2 % of the true optimum over the whole grid; for max slowdown, when the pick
truly meets the constraint (2 % slack) with at most 2 % more energy than the true pick.

Goal (from the issue): the adaptive search needs half of the sweep's steps or fewer.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/power_limit_search.py [--reps 30]``.
Writes ``benchmarks/results/power_limit_search.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_energy.gpu_sim import SimulatedGPU, StepModel  # noqa: E402
from lightning_energy.io import atomic_write_json  # noqa: E402
from lightning_energy.power_limit import AdaptiveSearch, ExhaustiveSweep, LimitProfile, Objective, limit_grid  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "power_limit_search.json"
WAIT_STEPS, WARMUP_STEPS, PROFILE_STEPS, PL_STEP_W = 1, 10, 40, 25  # Zeus's GlobalPowerLimitOptimizer defaults
WITHIN = 0.02  # a pick is good when its true cost is within 2 % of the optimum
GOAL_STEP_RATIO = 0.5
NOISE_LEVELS = (0.0, 0.01, 0.03)
CARDS = {  # name: (min W, max W, static W); static is 20 % of the maximum as on the V100 model
    "V100 150-300 W": (150, 300, 60.0),
    "A100 100-400 W": (100, 400, 80.0),
    "H100 200-700 W": (200, 700, 140.0),
}
SELECTORS = [("energy", {}), ("time", {}), ("zeus_cost", {"eta_knob": 0.2}), ("zeus_cost", {"eta_knob": 0.5}),
             ("zeus_cost", {"eta_knob": 0.8}), ("max_slowdown", {"max_slowdown_factor": 1.1})]


def workloads(max_W: int, static_W: float) -> dict[str, StepModel]:
    """Steps of 256 samples drawing 1.16x the maximum limit (compute- or memory-bound) or 0.75x of it."""
    def demand_for(draw_W: float) -> float:  # full-utilisation demand giving that draw at a batch of 256
        return static_W + (draw_W - static_W) / (256 / (256 + 64))
    return {
        "compute-bound": StepModel(demand_W=demand_for(1.16 * max_W), compute_fraction=0.9),
        "memory-bound": StepModel(demand_W=demand_for(1.16 * max_W), compute_fraction=0.2),
        "below the top limits": StepModel(demand_W=demand_for(0.75 * max_W), compute_fraction=0.7),
    }


def true_profiles(gpu: SimulatedGPU, grid: list[int]) -> dict[int, LimitProfile]:
    return {x: LimitProfile(x, gpu.step_energy_J(x) * PROFILE_STEPS, gpu.step_time_s(x) * PROFILE_STEPS,
                            PROFILE_STEPS) for x in grid}


def good_pick(choice: int, truth: dict[int, LimitProfile], objective: Objective) -> bool:
    profiles = list(truth.values())
    best = objective.select(sorted(profiles, key=lambda p: p.limit_W, reverse=True))
    if objective.is_threshold:
        top = truth[max(truth)]
        feasible = truth[choice].time_per_step_s <= objective.max_slowdown_factor * top.time_per_step_s * (1 + WITHIN)
        return feasible and truth[choice].energy_J <= truth[best].energy_J * (1 + WITHIN)
    costs = objective.costs(profiles)
    return costs[choice] <= costs[best] * (1 + WITHIN)


def run_search(search, truth: dict[int, LimitProfile], noise: float, rng: np.random.Generator, objective: Objective):
    """Profile what the search asks for (noisy windows); returns (limits profiled, choice)."""
    seen: dict[int, LimitProfile] = {}
    while (limit := search.next_limit(seen)) is not None:
        p = truth[limit]
        e, t = p.energy_J, p.time_s
        if noise:
            e *= 1 + noise * rng.standard_normal()
            t *= 1 + noise * rng.standard_normal()
        seen[limit] = LimitProfile(limit, e, t, p.steps)
    ordered = sorted(seen.values(), key=lambda p: p.limit_W, reverse=True)
    return len(seen), objective.select(ordered)


def steps_for(limits: float) -> float:
    return WAIT_STEPS + limits * (WARMUP_STEPS + PROFILE_STEPS)


def benchmark(reps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    rows = []
    for card, (low, high, static) in CARDS.items():
        grid = limit_grid(low, high, PL_STEP_W)
        for workload, step in workloads(high, static).items():
            gpu = SimulatedGPU(gpu_index=99, min_limit_W=low, max_limit_W=high, default_limit_W=high, step=step,
                               static_W=static)
            truth = true_profiles(gpu, grid)
            for selector, knobs in SELECTORS:
                objective = Objective(selector, **knobs)
                label = selector + "".join(f" {v:g}" for v in knobs.values())
                for noise in NOISE_LEVELS:
                    n = 1 if noise == 0 else reps
                    result = {"card": card, "workload": workload, "selector": label, "noise": noise, "reps": n,
                              "grid_limits": len(grid)}
                    for name, make in (("exhaustive", lambda: ExhaustiveSweep(grid)),
                                       ("adaptive", lambda: AdaptiveSearch(grid, objective))):
                        limits, good = [], []
                        for _ in range(n):
                            count, choice = run_search(make(), truth, noise, rng, objective)
                            limits.append(count)
                            good.append(good_pick(choice, truth, objective))
                        result[f"{name}_limits"] = float(np.mean(limits))
                        result[f"{name}_steps"] = steps_for(float(np.mean(limits)))
                        result[f"{name}_success"] = float(np.mean(good))
                    result["step_ratio"] = result["adaptive_steps"] / result["exhaustive_steps"]
                    rows.append(result)
    return {"rows": rows, "summary": summarise(rows)}


def summarise(rows: list[dict]) -> dict:
    def block(selected: list[dict]) -> dict:
        return {
            "cases": len(selected),
            "exhaustive_steps_mean": float(np.mean([r["exhaustive_steps"] for r in selected])),
            "adaptive_steps_mean": float(np.mean([r["adaptive_steps"] for r in selected])),
            "step_ratio_mean": float(np.mean([r["step_ratio"] for r in selected])),
            "step_ratio_max": float(np.max([r["step_ratio"] for r in selected])),
            "exhaustive_success": float(np.mean([r["exhaustive_success"] for r in selected])),
            "adaptive_success": float(np.mean([r["adaptive_success"] for r in selected])),
        }

    out = {"all": block(rows)}
    for card in CARDS:
        out[card] = block([r for r in rows if r["card"] == card])
    for noise in NOISE_LEVELS:
        out[f"noise {noise:.0%}"] = block([r for r in rows if r["noise"] == noise])
    return out


def format_table(summary: dict) -> str:
    header = (f"{'cases':<16} {'n':>3} {'sweep steps':>11} {'adaptive steps':>14} {'ratio':>6} {'ratio max':>9} "
              f"{'sweep ok':>8} {'adaptive ok':>11}")
    lines = [header, "-" * len(header)]
    for name, b in summary.items():
        lines.append(f"{name:<16} {b['cases']:>3} {b['exhaustive_steps_mean']:>11.0f} {b['adaptive_steps_mean']:>14.0f} "
                     f"{b['step_ratio_mean']:>6.2f} {b['step_ratio_max']:>9.2f} {b['exhaustive_success']:>8.0%} "
                     f"{b['adaptive_success']:>11.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="repetitions per noisy case (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    start = time.perf_counter()
    result = benchmark(args.reps, args.seed)
    summary = result["summary"]
    print("power-limit search: profiling steps to pick a limit within 2 % of the optimum's true cost")
    print(f"(Zeus defaults: {WAIT_STEPS} wait + ({WARMUP_STEPS} warm-up + {PROFILE_STEPS} profile) steps per limit, "
          f"{PL_STEP_W} W grid; {len(SELECTORS)} selectors x 3 workloads per card; noisy cases x {args.reps})\n")
    print(format_table(summary))
    ratio = summary["all"]["step_ratio_mean"]
    met = ratio <= GOAL_STEP_RATIO
    print(f"\ngoal: adaptive/exhaustive steps {ratio:.2f} <= {GOAL_STEP_RATIO}: {'met' if met else 'NOT met'} "
          f"(per card: " + ", ".join(f"{c} {summary[c]['step_ratio_mean']:.2f}" for c in CARDS) + ")")
    result.update({
        "goal": {"step_ratio_max": GOAL_STEP_RATIO, "measured": ratio, "met": met},
        "settings": {"wait_steps": WAIT_STEPS, "warmup_steps": WARMUP_STEPS, "profile_steps": PROFILE_STEPS,
                     "pl_step_W": PL_STEP_W, "within": WITHIN, "noise_levels": list(NOISE_LEVELS), "reps": args.reps,
                     "seed": args.seed},
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "wall_s": time.perf_counter() - start,
    })
    atomic_write_json(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
