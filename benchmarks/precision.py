"""Precision modes on the Baler autoencoder: time per step, energy per step and loss after a fixed budget.

The model is ``baler_lit.models.AE`` (24→200→100→50→15→50→100→200→24, LeakyReLU 0.01) trained on the
synthetic CMS-jet table of ``baler_lit.synthetic`` (min-max normalised to [0, 1]) with Baler's settings:
Adam lr 1e-3, batch 512, no shuffling, loss per batch Σ(x̂−x)² / n_columns. Every mode trains the same
number of steps from the same initial weights on the same batches, in a fixed mode of ``PrecisionSwitch``:

- time per step: median over the steps after warm-up (time between consecutive batch starts);
- energy per step: the shared meter's energy over the mode's steps divided by the steps (auto-detected
  sensors: NVML on a CUDA GPU; on a machine without counters a CPU estimate, labelled as such);
- final loss: the trained model in float64 on held-out rows (mean squared error per value), the same
  yardstick for every mode; ``gap`` is the mean relative training-loss gap to ``32-true`` that the callback
  measured along the way (every 50 steps).

A last run lets ``PrecisionSwitch`` choose among the candidate modes (profile, pick, guard) under the same
budget. Modes a device lacks (``tf32`` off CUDA) are listed as skipped.

Pick stability: ``--repeats`` fits (default 5) of one and the same config, ``PrecisionSwitch`` choosing between
``32-true`` and ``bf16-mixed`` (warm-up 5, 20 profiled steps a mode), for each batch size of
``--stability-batches``, and once more as an A/A test at batch 512 (``--no-aa`` leaves it out): the model
turns autocast off inside ``training_step``, so both "modes" run the same float32 arithmetic and are at
parity by construction; only the machine's timing noise tells them apart. Three rules, run alternately in
the same process: the pick beyond the A/A noise floor (the default: 32-true profiled again at the end of
every round, 95 % Student-t bound over the larger of the per-step, round and A/A window spread, up to 3
rounds, else 32-true), the pick beyond noise without the floor (one 32-true window a round, per-step and
round spread only: the previous rule) and the mean of one round (the first rule: the lower mean wins,
whatever the noise; ``confidence`` ~0, one round). A rule is stable when
every repeat picks the same mode.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py [--steps 200] [--modes 32-true bf16-mixed]
[--repeats 5] [--stability-only]``. Writes ``benchmarks/results/precision.json`` (per-mode figures, the
automatic choice, the stability fits, machine). Timings depend on what else runs on the machine.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one CPU thread, set before torch is imported
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baler_lit.models import AE  # noqa: E402
from baler_lit.synthetic import synthetic_cms_jets  # noqa: E402
from lightning_energy.callbacks.precision import PrecisionSwitch  # noqa: E402
from lightning_energy.io import atomic_write_json  # noqa: E402
from lightning_energy.optimize.precision.modes import MODE_NAMES, MODES, unavailable_reason  # noqa: E402

torch.set_num_threads(1)
with contextlib.suppress(RuntimeError):
    torch.set_num_interop_threads(1)

N_COLUMNS = 24
LATENT = 15  # ceil(24 / 1.6), Baler's compression ratio 1.6
BATCH = 512  # Baler's batch size
LR = 1e-3  # Baler's Adam learning rate
EVAL_ROWS = 8192
WARMUP_STEPS = 10  # steps per fit left out of the time statistics
CHECK_EVERY = 50  # PrecisionSwitch guard checks (the loss gap is measured at each)
AUTO_CANDIDATES = ("32-true", "tf32", "bf16-mixed", "16-mixed")  # 16-mixed-noscale: fixed-mode rows only (issue 30)
STABILITY_CANDIDATES = ("32-true", "bf16-mixed")
STABILITY_WARMUP, STABILITY_PROFILE, STABILITY_ROUNDS = 5, 20, 3
RULES = {  # PrecisionSwitch arguments of each pick rule
    "A/A floor": {"confidence": 0.95, "max_profile_rounds": STABILITY_ROUNDS, "noise_floor": True},
    "beyond noise": {"confidence": 0.95, "max_profile_rounds": STABILITY_ROUNDS, "noise_floor": False},
    # a bound of ~0: the lower mean wins
    "mean of one round": {"confidence": 1e-9, "max_profile_rounds": 1, "noise_floor": False},
}
# enough steps for every round of the longest rule: the candidates and 32-true's A/A window
STABILITY_STEPS = STABILITY_ROUNDS * (len(STABILITY_CANDIDATES) + 1) * (STABILITY_WARMUP + STABILITY_PROFILE) + 10
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "precision.json"


class BalerLit(LightningModule):
    """Baler's AE with Baler's loss (Σ(x̂−x)² / n_columns per batch) and optimiser.

    ``same_arithmetic``: autocast off inside the step, so every precision mode computes in float32 (A/A test).
    """

    def __init__(self, same_arithmetic: bool = False) -> None:
        super().__init__()
        self.model = AE((N_COLUMNS,), LATENT)
        self.same_arithmetic = same_arithmetic

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        with torch.autocast(x.device.type, enabled=not self.same_arithmetic and torch.is_autocast_enabled(x.device.type)):
            loss = (self.model(x) - x).square().sum() / N_COLUMNS
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


class Batches:
    """Pre-built in-memory batches served in order (Baler never shuffles)."""

    def __init__(self, data: torch.Tensor, batch: int = BATCH) -> None:
        self.batches = [(b,) for b in data.split(batch) if len(b) == batch]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class StepTimer(Callback):
    """Wall-clock time at every batch start (s)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def median_step_s(self) -> float:
        times = [b - a for a, b in zip(self.starts[WARMUP_STEPS:], self.starts[WARMUP_STEPS + 1:])]
        return statistics.median(times) if times else float("nan")


def make_data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows) of the synthetic CMS-jet table, min-max normalised with training statistics."""
    table = np.asarray(synthetic_cms_jets(rows + EVAL_ROWS, seed=0).data, dtype=np.float64)
    train, held_out = table[:rows], table[rows:]
    low, span = train.min(axis=0), np.ptp(train, axis=0)
    span[span == 0] = 1.0
    return tuple(torch.from_numpy((a - low) / span).to(torch.float32) for a in (train, held_out))


def held_out_mse(module: BalerLit, held_out: torch.Tensor) -> float:
    """Mean squared error per value of the trained model in float64 on the held-out rows."""
    model = AE((N_COLUMNS,), LATENT).double()
    model.load_state_dict({k: v.detach().double().cpu() for k, v in module.model.state_dict().items()})
    with torch.no_grad():
        x = held_out.double()
        return float((model(x) - x).square().mean())


def fit_once(callback: PrecisionSwitch, steps: int, train: torch.Tensor, held_out: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(0)
    module = BalerLit()
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            max_steps=steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0,
            callbacks=[timer, callback],
        )
        started = time.perf_counter()
        trainer.fit(module, Batches(train))
        wall_s = time.perf_counter() - started
    report = callback.report
    rows = {row["mode"]: row for row in report["modes"]}
    trained = [row for row in rows.values() if row["trained_steps"]]
    steps_done = sum(row["trained_steps"] for row in trained)
    gaps = [c["loss_gap"] for c in callback.checks if c["loss_gap"] is not None]
    return {
        "steps": steps_done,
        "step_s": timer.median_step_s(),
        "step_J": sum(row["trained_J"] for row in trained) / steps_done if steps_done else None,
        "train_loss_last": float(trainer.callback_metrics.get("train/loss", float("nan"))),
        "held_out_mse": held_out_mse(module, held_out),
        "loss_gap": statistics.fmean(gaps) if gaps else None,
        "skipped_steps": report["skipped_steps"],
        "wall_s": wall_s,
        "energy_estimated": report["energy_estimated"],
        "device": str(trainer.strategy.root_device),
        "report": report,
    }


def stability_fit(rule: str, batch: int, train: torch.Tensor, same_arithmetic: bool = False) -> dict[str, Any]:
    """One fit in which PrecisionSwitch picks between STABILITY_CANDIDATES under ``rule``."""
    steps = STABILITY_STEPS
    callback = PrecisionSwitch(candidates=list(STABILITY_CANDIDATES), tolerance=0.02, warmup_steps=STABILITY_WARMUP,
                               profile_steps=STABILITY_PROFILE, check_every_n_steps=0, verbose=False, **RULES[rule])
    torch.manual_seed(0)
    module = BalerLit(same_arithmetic)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(max_steps=steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                          num_sanity_val_steps=0, callbacks=[callback])
        trainer.fit(module, Batches(train, batch))
    profiles = {name: {k: row[k] for k in ("steps", "step_J", "step_J_se", "step_s", "step_s_se", "loss_gap")}
                for name, row in callback.profiles.items()}
    return {"rule": rule, "batch": batch, "config": f"AE {batch}" + (" A/A" if same_arithmetic else ""),
            "chosen": callback.chosen, "rounds": callback.profile_rounds,
            "decision": callback.decision, "profiles": profiles, "energy_estimated": callback.report["energy_estimated"]}


def stability(configs: list[tuple[int, bool]], repeats: int) -> list[dict]:
    """``repeats`` fits per (batch, same_arithmetic) config and rule, the rules alternating (the same machine
    state for both)."""
    steps = STABILITY_STEPS
    fits = []
    for batch, same_arithmetic in configs:
        train, _ = make_data(steps * batch)
        for repeat in range(repeats):
            for rule in RULES:
                fit = stability_fit(rule, batch, train, same_arithmetic)
                fit["repeat"] = repeat
                fits.append(fit)
                print(f"  {fit['config']} repeat {repeat + 1}/{repeats} {rule}: {fit['chosen']} after {fit['rounds']} "
                      f"round(s); bf16/32 J per step {_ratio(fit)}", flush=True)
    return fits


def _ratio(fit: dict) -> str:
    p = fit["profiles"]
    if "bf16-mixed" not in p or not p["32-true"]["step_J"] or p["bf16-mixed"]["step_J"] is None:
        return "-"
    return f"{p['bf16-mixed']['step_J'] / p['32-true']['step_J']:.3f}"


def format_stability(fits: list[dict]) -> str:
    lines = [f"{'config':<12}{'rule':<18}{'picks':<34}{'stable':>7}{'rounds':>8}{'bf16/32 J (median)':>20}"]
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for fit in fits:
        groups[(fit["config"], fit["rule"])].append(fit)
    for (config, rule), group in groups.items():
        picks = collections.Counter(f["chosen"] for f in group)
        ratios = [float(_ratio(f)) for f in group if _ratio(f) != "-"]
        rounds = statistics.median(f["rounds"] for f in group)
        lines.append(f"{config:<12}{rule:<18}{', '.join(f'{m} x{n}' for m, n in picks.most_common()):<34}"
                     f"{'yes' if len(picks) == 1 else 'no':>7}{rounds:>8g}"
                     f"{(f'{statistics.median(ratios):.3f}' if ratios else '-'):>20}")
    return "\n".join(lines)


def format_table(results: dict[str, dict], auto: dict | None, label: str) -> str:
    lines = [f"{'mode':<18}{'ms/step':>9}{f'J/step ({label})':>22}{'held-out MSE':>14}{'loss gap':>10}"
             f"{'skipped':>9}"]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"{name:<18}  skipped: {r['skipped']}")
            continue
        lines.append(f"{name:<18}{r['step_s'] * 1e3:>9.2f}{_fmt(r['step_J']):>22}{r['held_out_mse']:>14.4e}"
                     f"{_fmt(r['loss_gap']):>10}{r['skipped_steps']:>9}")
    if auto is not None:
        lines.append(f"{'auto -> ' + str(auto['chosen']):<18}{auto['step_s'] * 1e3:>9.2f}{_fmt(auto['step_J']):>22}"
                     f"{auto['held_out_mse']:>14.4e}{'':>10}{auto['skipped_steps']:>9}"
                     f"   final {auto['final_mode']}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def machine_info() -> dict[str, Any]:
    import lightning

    cpu, flags = platform.processor(), []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == platform.processor():
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:  # the features that decide bf16 speed on a CPU
                flags = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx", "avx2")))
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_model": cpu, "cpu_flags": flags,
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "lightning": lightning.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_energy"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*lightning-energy.*")
    warnings.filterwarnings("ignore", message=".*RAPL.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message="PrecisionSwitch: candidate .* dropped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per mode (default 200)")
    parser.add_argument("--modes", nargs="+", default=list(MODE_NAMES), choices=MODE_NAMES, metavar="MODE",
                        help=f"modes to run (default: all of {', '.join(MODE_NAMES)})")
    parser.add_argument("--no-auto", action="store_true", help="skip the run where PrecisionSwitch chooses")
    parser.add_argument("--repeats", type=int, default=5, help="fits per rule and batch size for pick stability")
    parser.add_argument("--stability-batches", type=int, nargs="+", default=[BATCH, 64], metavar="B",
                        help=f"batch sizes of the stability fits (default {BATCH} 64)")
    parser.add_argument("--stability-only", action="store_true", help="only the pick-stability fits")
    parser.add_argument("--no-aa", action="store_true", help="leave out the A/A stability config")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(b < 1 for b in args.stability_batches):
        parser.error("--repeats and --stability-batches must be >= 1")
    if args.steps <= 2 * WARMUP_STEPS + CHECK_EVERY:
        parser.error(f"--steps must be > {2 * WARMUP_STEPS + CHECK_EVERY}")

    quiet_lightning()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    train, held_out = make_data(args.steps * BATCH)
    print(f"precision benchmark: Baler AE, batch {BATCH}, {args.steps} steps per mode on {device_type}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    results: dict[str, dict] = {}
    for name in ([] if args.stability_only else args.modes):
        if reason := unavailable_reason(MODES[name], device_type):
            results[name] = {"skipped": reason}
            continue
        callback = PrecisionSwitch(mode=name, check_every_n_steps=CHECK_EVERY, verbose=False)
        results[name] = fit_once(callback, args.steps, train, held_out)
        print(f"  {name}: {results[name]['step_s'] * 1e3:.2f} ms/step", flush=True)
    auto = None
    if not (args.no_auto or args.stability_only):
        candidates = [m for m in AUTO_CANDIDATES if unavailable_reason(MODES[m], device_type) is None]
        callback = PrecisionSwitch(candidates=candidates, tolerance=0.02, check_every_n_steps=CHECK_EVERY,
                                   verbose=False)
        auto = fit_once(callback, args.steps, train, held_out)
        auto.update(chosen=callback.chosen, final_mode=callback.plugin.mode_name, decision=callback.decision,
                    candidates=candidates)
    print(f"pick stability: {args.repeats} fits per rule and batch size, {' vs '.join(STABILITY_CANDIDATES)}",
          flush=True)
    configs = [(b, False) for b in args.stability_batches] + ([] if args.no_aa else [(BATCH, True)])
    fits = stability(configs, args.repeats)
    measured = [r for r in results.values() if "skipped" not in r] + ([auto] if auto else []) + fits
    estimated = any(r["energy_estimated"] for r in measured)
    # on a GPU the energy is NVML's (measured) plus the host's (a CPU estimate without RAPL): say both
    label = ("measured" if not estimated else
             "NVML GPU measured + CPU estimate" if device_type == "cuda" else "CPU estimate")
    if results or auto:
        print(format_table(results, auto, label), flush=True)
    print(f"pick stability (energy per step, {label}):\n" + format_stability(fits), flush=True)
    for r in results.values():
        r.pop("report", None)  # the auto run keeps its report: the profiled per-mode table
    out = {
        "benchmark": "precision modes on the Baler AE",
        "created_unix_s": time.time(),
        "config": {"steps": args.steps, "batch": BATCH, "lr": LR, "latent": LATENT, "eval_rows": EVAL_ROWS,
                   "warmup_steps_untimed": WARMUP_STEPS, "check_every_n_steps": CHECK_EVERY,
                   "data": "baler_lit.synthetic.synthetic_cms_jets(seed=0), min-max normalised"},
        "energy_label": label,
        "modes": results,
        "auto": auto,
        "stability": {"candidates": list(STABILITY_CANDIDATES), "warmup_steps": STABILITY_WARMUP,
                      "profile_steps": STABILITY_PROFILE, "rules": RULES, "repeats": args.repeats,
                      "configs": [{"batch": b, "same_arithmetic": a} for b, a in configs], "fits": fits},
        "machine": machine_info(),
    }
    path = atomic_write_json(args.out, out)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
