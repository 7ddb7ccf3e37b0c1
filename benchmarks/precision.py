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

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py [--steps 200] [--modes 32-true bf16-mixed]``.
Writes ``benchmarks/results/precision.json`` (per-mode figures, the automatic choice, machine).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one CPU thread, set before torch is imported
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")

import argparse  # noqa: E402
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
from lightning_energy.precision import MODE_NAMES, MODES, unavailable_reason  # noqa: E402

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
AUTO_CANDIDATES = ("32-true", "tf32", "bf16-mixed", "16-mixed", "16-mixed-noscale")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "precision.json"


class BalerLit(LightningModule):
    """Baler's AE with Baler's loss (Σ(x̂−x)² / n_columns per batch) and optimiser."""

    def __init__(self) -> None:
        super().__init__()
        self.model = AE((N_COLUMNS,), LATENT)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = (self.model(x) - x).square().sum() / N_COLUMNS
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


class Batches:
    """Pre-built in-memory batches served in order (Baler never shuffles)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.batches = [(b,) for b in data.split(BATCH) if len(b) == BATCH]

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

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_model": cpu,
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
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    if args.steps <= 2 * WARMUP_STEPS + CHECK_EVERY:
        parser.error(f"--steps must be > {2 * WARMUP_STEPS + CHECK_EVERY}")

    quiet_lightning()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    train, held_out = make_data(args.steps * BATCH)
    print(f"precision benchmark: Baler AE, batch {BATCH}, {args.steps} steps per mode on {device_type}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    results: dict[str, dict] = {}
    for name in args.modes:
        if reason := unavailable_reason(MODES[name], device_type):
            results[name] = {"skipped": reason}
            continue
        callback = PrecisionSwitch(mode=name, check_every_n_steps=CHECK_EVERY, verbose=False)
        results[name] = fit_once(callback, args.steps, train, held_out)
        print(f"  {name}: {results[name]['step_s'] * 1e3:.2f} ms/step", flush=True)
    auto = None
    if not args.no_auto:
        candidates = [m for m in AUTO_CANDIDATES if unavailable_reason(MODES[m], device_type) is None]
        callback = PrecisionSwitch(candidates=candidates, tolerance=0.02, check_every_n_steps=CHECK_EVERY,
                                   verbose=False)
        auto = fit_once(callback, args.steps, train, held_out)
        auto.update(chosen=callback.chosen, final_mode=callback.plugin.mode_name, decision=callback.decision,
                    candidates=candidates)
    measured = [r for r in results.values() if "skipped" not in r] + ([auto] if auto else [])
    estimated = any(r["energy_estimated"] for r in measured)
    label = "CPU estimate" if estimated else "measured"
    print(format_table(results, auto, label), flush=True)
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
        "machine": machine_info(),
    }
    path = atomic_write_json(args.out, out)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
