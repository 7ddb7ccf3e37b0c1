"""Power-limit search on curves it was not tuned to: success and profiling steps per curve family and selector.

Curve families (``FAMILIES``), each on three simulated cards (V100 150-300 W as in the power-limit study,
A100 100-400 W, H100 200-700 W; ``lightning_energy.testing.gpu_sim``): the quadratic V100-study shape, an
interior energy optimum (the range reaches below the voltage floor), a voltage-floor kink, a memory-bound
(flat) step, a step that never reaches the upper limits (flat top), a cliff (a clock floor below which the
card throttles hard), discrete clock-bin plateaus, and a host-bound step (the card idles 40 % of a step).
Selectors: energy, time, ZeusCost with eta 0.2/0.5/0.8, max slowdown 1.1. Noise: every window's energy and
time are multiplied by independent Gaussian factors of 0, 1, 3 and 5 % (seeded, ``--reps`` repetitions;
in a repetition the k-th window at a limit gets the same draw for both searches: a paired comparison).

Steps are counted, not timed (Zeus's defaults): 1 wait step, then per window 10 warm-up steps (only after
a limit change: a repeated window right after its own limit needs none) and 40 profile steps. A pick
succeeds when its true cost (the noise-free model) is within 2 % of the true optimum over the whole grid;
for max slowdown, when it truly meets the constraint (2 % slack) with at most 2 % more energy than the
true pick.

Goal (issue 15), per family and selector: the adaptive search succeeds at least as often as the sweep with
at most half its profiling steps; where that cannot hold it should spend more steps, never pick worse.
Both are reported per family x selector (all cards and noise levels pooled) and per card.

Run: ``OMP_NUM_THREADS=1 python benchmarks/power_limit_search.py [--reps 100]``; writes
``benchmarks/results/power_limit_search.json``. Simulated clocks only: a shared machine does not disturb it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_energy.testing.gpu_sim import SimulatedGPU, StepModel  # noqa: E402
from lightning_energy.io import atomic_write_json  # noqa: E402
from lightning_energy.optimize.power_limit.search import (  # noqa: E402
    AdaptiveSearch,
    ExhaustiveSweep,
    LimitProfile,
    Objective,
    limit_grid,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "power_limit_search.json"
WAIT_STEPS, WARMUP_STEPS, PROFILE_STEPS, PL_STEP_W = 1, 10, 40, 25  # Zeus's GlobalPowerLimitOptimizer defaults
WITHIN = 0.02  # a pick is good when its true cost is within 2 % of the optimum
GOAL_STEP_RATIO = 0.5
NOISE_LEVELS = (0.0, 0.01, 0.03, 0.05)
CARDS = {  # name: (min W, max W, static W, idle W)
    "V100 150-300 W": (150, 300, 60.0, 40.0),
    "A100 100-400 W": (100, 400, 80.0, 50.0),
    "H100 200-700 W": (200, 700, 140.0, 70.0),
}
SELECTORS = [("energy", {}), ("time", {}), ("zeus_cost", {"eta_knob": 0.2}), ("zeus_cost", {"eta_knob": 0.5}),
             ("zeus_cost", {"eta_knob": 0.8}), ("max_slowdown", {"max_slowdown_factor": 1.1})]


def demand_for(draw_W: float, static_W: float) -> float:
    """Full-utilisation demand that gives a draw of ``draw_W`` at the reference batch of 256."""
    return static_W + (draw_W - static_W) / (256 / (256 + 64))


def family_gpu(family: str, card: str) -> SimulatedGPU:
    """The simulated card of one curve family (see the module docstring)."""
    low, high, static, idle = CARDS[card]
    heavy = demand_for(1.16 * high, static)
    step = StepModel(demand_W=heavy, compute_fraction=0.9)
    options: dict = {}
    if family == "interior optimum":
        options = {"voltage_floor": 0.8}
        step = dataclasses.replace(step, demand_W=demand_for(1.5 * high, static))
    elif family == "voltage-floor kink":
        options = {"voltage_floor": 0.72}
    elif family == "memory-bound (flat)":
        step = dataclasses.replace(step, compute_fraction=0.2)
    elif family == "flat top":
        step = dataclasses.replace(step, demand_W=demand_for(0.75 * high, static), compute_fraction=0.7)
    elif family == "cliff (clock floor)":
        options = {"clock_floor": 0.78, "throttle_clock": 0.35}
    elif family == "clock-bin plateaus":
        options = {"clock_bins": 10}
    elif family == "host-bound":
        step = dataclasses.replace(step, host_s=0.4 * step.full_clock_time_s(256) / 0.6)
    return SimulatedGPU(gpu_index=99, min_limit_W=low, max_limit_W=high, default_limit_W=high, step=step,
                        static_W=static, idle_W=idle, **options)


FAMILIES = ("quadratic (V100 study)", "interior optimum", "voltage-floor kink", "memory-bound (flat)", "flat top",
            "cliff (clock floor)", "clock-bin plateaus", "host-bound")


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


def run_search(search, truth: dict[int, LimitProfile], draws) -> tuple[int, int, int]:
    """Profile what the search asks for; the k-th window at a limit is the truth times ``draws(limit, k)``.

    Returns (profiling steps, windows, choice)."""
    seen: dict[int, LimitProfile] = {}
    steps, windows, previous = WAIT_STEPS, 0, None
    while (limit := search.next_limit(seen)) is not None:
        p = truth[limit]
        k = seen[limit].window_count if limit in seen else 0
        energy_factor, time_factor = draws(limit, k)
        window = LimitProfile(limit, p.energy_J * energy_factor, p.time_s * time_factor, p.steps)
        seen[limit] = seen[limit].merged(window) if limit in seen else window
        steps += PROFILE_STEPS + (WARMUP_STEPS if limit != previous else 0)
        windows += 1
        previous = limit
    return steps, windows, search.choose(seen)


def benchmark(reps: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    cases = []
    for family in FAMILIES:
        for card in CARDS:
            gpu = family_gpu(family, card)
            grid = limit_grid(gpu.min_limit_W, gpu.max_limit_W, PL_STEP_W)
            truth = true_profiles(gpu, grid)
            for selector, knobs in SELECTORS:
                objective = Objective(selector, **knobs)
                label = selector + "".join(f" {v:g}" for v in knobs.values())
                for noise in NOISE_LEVELS:
                    n = 1 if noise == 0 else reps
                    case = {"family": family, "card": card, "selector": label, "noise": noise, "reps": n,
                            "grid_limits": len(grid), "sweep": {"steps": [], "good": []},
                            "adaptive": {"steps": [], "good": [], "windows": []}}
                    for _ in range(n):
                        table = 1 + noise * rng.standard_normal((len(grid), 8, 2))
                        index = {limit: i for i, limit in enumerate(grid)}

                        def draws(limit, k, table=table, index=index):
                            return float(table[index[limit], k, 0]), float(table[index[limit], k, 1])

                        for name, search in (("sweep", ExhaustiveSweep(grid, objective)),
                                             ("adaptive", AdaptiveSearch(grid, objective))):
                            steps, windows, choice = run_search(search, truth, draws)
                            case[name]["steps"].append(steps)
                            case[name]["good"].append(good_pick(choice, truth, objective))
                            if name == "adaptive":
                                case[name]["windows"].append(windows)
                    cases.append(case)
    return cases


def block(selected: list[dict]) -> dict:
    """Success and mean profiling steps of both searches over the cases (every repetition weighs the same)."""
    out = {"cases": len(selected)}
    for name in ("sweep", "adaptive"):
        steps = [s for c in selected for s in c[name]["steps"]]
        good = [g for c in selected for g in c[name]["good"]]
        out[name] = {"success": float(np.mean(good)), "steps_mean": float(np.mean(steps))}
    out["step_ratio"] = out["adaptive"]["steps_mean"] / out["sweep"]["steps_mean"]
    out["success_not_lower"] = out["adaptive"]["success"] >= out["sweep"]["success"] - 1e-12
    out["goal_met"] = out["success_not_lower"] and out["step_ratio"] <= GOAL_STEP_RATIO
    return out


def summarise(cases: list[dict]) -> dict:
    selectors = list(dict.fromkeys(c["selector"] for c in cases))
    return {
        "by_family_and_selector": {f: {s: block([c for c in cases if c["family"] == f and c["selector"] == s])
                                       for s in selectors} for f in FAMILIES},
        "by_family_and_card": {f: {card: block([c for c in cases if c["family"] == f and c["card"] == card])
                                   for card in CARDS} for f in FAMILIES},
        "by_noise": {f"{noise:.0%}": block([c for c in cases if c["noise"] == noise]) for noise in NOISE_LEVELS},
        "all": block(cases),
    }


def format_row(label: str, b: dict) -> str:
    s, a = b["sweep"], b["adaptive"]
    verdict = "goal" if b["goal_met"] else ("more steps" if b["success_not_lower"] else "LOWER SUCCESS")
    return (f"{label:<40} {s['success']:>7.1%} {s['steps_mean']:>7.0f}   {a['success']:>7.1%} {a['steps_mean']:>7.0f}"
            f" {b['step_ratio']:>6.2f}  {verdict}")


def format_tables(summary: dict) -> str:
    header = f"{'':<40} {'sweep ok':>7} {'steps':>7}   {'adapt ok':>7} {'steps':>7} {'ratio':>6}  verdict"
    lines = []
    for family, by_selector in summary["by_family_and_selector"].items():
        lines += ["", f"== {family} (per selector; cards and noise 0-5 % pooled)", header, "-" * len(header)]
        lines += [format_row(selector, b) for selector, b in by_selector.items()]
        lines += [format_row(f"  on {card}", b) for card, b in summary["by_family_and_card"][family].items()]
    lines += ["", "== all families, per noise level", header, "-" * len(header)]
    lines += [format_row(f"noise {noise}", b) for noise, b in summary["by_noise"].items()]
    lines.append(format_row("all", summary["all"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100, help="repetitions per noisy case (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    start = time.perf_counter()
    cases = benchmark(args.reps, args.seed)
    summary = summarise(cases)
    print("power-limit search: success = the pick's true cost within 2 % of the optimum; steps = Zeus's "
          f"{WAIT_STEPS} wait + ({WARMUP_STEPS} warm-up after a limit change + {PROFILE_STEPS} profile) per window, "
          f"{PL_STEP_W} W grid; noisy cases x {args.reps}")
    print(format_tables(summary))
    pairs = summary["by_family_and_selector"]
    met = sum(b["goal_met"] for f in pairs.values() for b in f.values())
    lower = [(f, s) for f, by in pairs.items() for s, b in by.items() if not b["success_not_lower"]]
    print(f"\ngoal (success >= sweep at <= {GOAL_STEP_RATIO} of its steps) met for {met} of "
          f"{sum(len(f) for f in pairs.values())} family x selector pairs; lower success than the sweep: "
          f"{', '.join(f'{f} / {s}' for f, s in lower) or 'none'}")
    result = {
        "summary": summary,
        "cases": [{k: v for k, v in c.items() if k not in ("sweep", "adaptive")}
                  | {name: {"success": float(np.mean(c[name]["good"])), "steps_mean": float(np.mean(c[name]["steps"]))}
                     for name in ("sweep", "adaptive")} for c in cases],
        "settings": {"wait_steps": WAIT_STEPS, "warmup_steps": WARMUP_STEPS, "profile_steps": PROFILE_STEPS,
                     "pl_step_W": PL_STEP_W, "within": WITHIN, "noise_levels": list(NOISE_LEVELS), "reps": args.reps,
                     "seed": args.seed, "families": list(FAMILIES), "cards": {k: list(v) for k, v in CARDS.items()}},
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "note": "simulated clocks: counted steps, no timing"},
        "wall_s": time.perf_counter() - start,
    }
    atomic_write_json(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
