"""Time and energy to the ORIGINAL Baler's reconstruction quality, on a held-out split (issue 31, item 6).

The data: Baler's CMS example kind of data, real CMS Open Data jets (``nanoAOD_2015_CMS_Open_Data_ttbar.root``
in the shared data folder: 537 jets × 40 ``Jet_*`` columns), the constant columns left out (the original's min-max
divides 0/0 there and trains on NaN), min-max normalised over all rows as the original does, split as the
original splits (``train_test_split(test_size=0.2, random_state=1)``, its ``helper.process``). Both tools train
on the same normalised training rows, in this one process, timed the same way, the runs interleaved:

- **target**: the original as it ships for the CMS example (its ``AE``, float64, its DataLoader, Adam lr 1e-3,
  batch 512, its per-epoch ``training.fit``) for its default ``--original-epochs`` (the CMS example's 25; more
  targets with e.g. ``--original-epochs 25,500``); its quality is the held-out mean squared error per value
  (normalised units) of its final model, and its time the wall time of those epochs;
- **ours**: ``BalerModule`` in a Lightning Trainer with EnergyCallback (no logger, no progress bar; the lean
  profiler ``baler-lit fit`` installs, :mod:`baler_lit.lean_loop`) under each
  configuration of ``lightning-energy recommend``'s levers that apply here (:data:`CONFIGS`: dtype float64 ->
  float32, learning rate ×3/×10, batch ÷4, shuffling), stopping at the first epoch whose held-out error is at or
  below the target (at most ``--max-epochs``). Time to quality: wall seconds from the start of training to the end
  of that epoch.

The held-out error is computed the same way for both after every epoch, and its own time is taken out of both
(the original's training never evaluates it; its energy stays in both windows, a few per cent). Energy: ``EnergyMeter`` windows (lightning-energy's plain front
end) over each run for both tools, with whatever sensors this machine has; each figure carries its provenance
(``measured`` from RAPL, ``estimated`` from the CPU model otherwise). Goal: ours ≥ 3× less time than the original.

Run: ``OMP_NUM_THREADS=1 python benchmarks/baler_time_to_quality.py [--reps 3] [--original-epochs 25]``
(a few minutes on 2 cores). Writes ``benchmarks/results/baler_time_to_quality.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))
DATA_DIR = Path(os.environ.get("BALER_LIT_DATA", REPO.parent / "shared" / "data"))
JETS = "nanoAOD_2015_CMS_Open_Data_ttbar.root"
RESULTS = BENCHMARKS / "results" / "baler_time_to_quality.json"
GOAL_TIME_RATIO = 3.0
#: recommend's levers that apply to this model on a CPU: (name, dtype, lr, batch size, shuffle)
CONFIGS = [
    ("parity (float64, lr 1e-3, batch 512)", "float64", 1e-3, 512, False),
    ("float32", "float32", 1e-3, 512, False),
    ("float32, lr x10", "float32", 1e-2, 512, False),
    ("float32, lr x3, batch /4", "float32", 3e-3, 128, False),
    ("float32, lr x3, batch /4, shuffled", "float32", 3e-3, 128, True),
]


def load_split(original_checkout: Path):
    """The jets' non-constant columns, normalised over all rows, split as the original splits (train, held-out)."""
    import numpy as np
    from sklearn.model_selection import train_test_split

    from baler_lit.sources import load_table

    table = load_table(str(DATA_DIR / JETS), root_prefix="Jet_")
    data = table.data.astype(np.float64)
    keep = data.max(0) > data.min(0)
    data = data[:, keep]
    data = (data - data.min(0)) / (data.max(0) - data.min(0))  # the original's min-max (over all rows)
    train, held_out = train_test_split(data, test_size=0.2, random_state=1)
    return train, held_out, [n for n, k in zip(table.names, keep) if k]


def held_out_mse(model, held_out) -> float:
    """Mean squared error per value of ``model`` on the held-out rows (normalised units)."""
    import torch

    with torch.no_grad():
        dtype = next(model.parameters()).dtype
        x = torch.as_tensor(held_out, dtype=dtype)
        was_training = model.training
        model.eval()
        error = float(((model(x) - x) ** 2).mean())
        model.train(was_training)
    return error


class Stopwatch:
    """Training wall time with the held-out evaluations taken out."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.excluded = 0.0

    @contextlib.contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.excluded


def run_original(checkout: Path, train, held_out, epochs: int) -> dict:
    """The original's CMS example training for ``epochs``: held-out error after each, time and energy."""
    import torch
    from torch.utils.data import DataLoader

    from lightning_energy import EnergyMeter

    sys.path.insert(0, str(checkout))
    from baler.modules import models, training

    model = models.AE(train.shape[1], -(-train.shape[1] * 5 // 8))  # ceil(n / 1.6), Baler's rule
    loader = DataLoader(torch.tensor(train, dtype=torch.float64), batch_size=512, shuffle=False, drop_last=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    errors, times = [], []
    import tempfile

    log_dir = tempfile.mkdtemp(prefix="baler_ttq_")
    with EnergyMeter(log_dir=log_dir, write_trace=False, verbose=False) as meter, meter.window("train") as energy:
        watch = Stopwatch()
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            for _ in range(epochs):
                training.fit(None, model, loader, list(model.children()), 0.001, optimizer, model.z_dim, 0.05, True, 1)
                times.append(watch.elapsed())
                with watch.paused():
                    errors.append(held_out_mse(model, held_out))
    return {"time_s": times[-1], "held_out_mse": errors[-1], "errors": errors, "times_s": times,
            "energy_J": energy.energy_J, "provenance": energy.provenance}


def run_ours(train, held_out, target: float, config: tuple, max_epochs: int) -> dict:
    """BalerModule under one configuration of levers until the held-out error reaches ``target``."""
    import lightning as L
    import torch

    from baler_lit.data import TensorBatches
    from baler_lit.lean_loop import LeanProfiler
    from baler_lit.module import BalerModule
    from lightning_energy import EnergyCallback

    name, dtype, lr, batch, shuffle = config
    watch: dict = {}
    errors: list[float] = []

    class UntilTarget(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            watch["w"] = Stopwatch()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            watch["t"] = watch["w"].elapsed()
            with watch["w"].paused():
                errors.append(held_out_mse(pl_module.model, held_out))
                if errors[-1] <= target:
                    trainer.should_stop = True

    L.seed_everything(0, verbose=False)
    x = torch.as_tensor(train, dtype=torch.float64 if dtype == "float64" else torch.float32)
    module = BalerModule(input_shape=(train.shape[1],), dtype=dtype, lr=lr, monitor="train/loss")  # no val split
    energy = EnergyCallback(verbose=False, write_trace=False, log_power_figure=False)
    import tempfile

    trainer = L.Trainer(max_epochs=max_epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[energy, UntilTarget()],
                        profiler=LeanProfiler(),  # as `baler-lit fit` runs (baler_lit.lean_loop)
                        default_root_dir=tempfile.mkdtemp(prefix="baler_ttq_"))
    trainer.fit(module, train_dataloaders=TensorBatches(x, batch, shuffle=shuffle, seed=0))
    report = energy.report or {}
    reached = bool(errors) and errors[-1] <= target
    # energy to the target: the report's training energy (its epochs end at the target's epoch)
    return {"config": name, "reached": reached, "epochs": len(errors), "time_s": watch.get("t"),
            "held_out_mse": errors[-1] if errors else None, "energy_J": report.get("train_J"),
            "provenance": _provenance(report)}


def _provenance(report: dict) -> str:
    from lightning_energy.provenance import of_report

    return of_report(report) if report else "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baler-original", type=Path, default=next(
        (c for c in (REPO / ".baler-original", Path("/work/baler-original"), Path("/tmp/baler-original"))
         if (c / "baler" / "modules").is_dir()), REPO / ".baler-original"))
    p.add_argument("--original-epochs", default="25", help="comma-separated: one target per value")
    p.add_argument("--max-epochs", type=int, default=2000, help="ours stops here if the target is not reached")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not (DATA_DIR / JETS).is_file():
        p.error(f"{DATA_DIR / JETS} not found (set BALER_LIT_DATA)")
    if not (args.baler_original / "baler" / "modules").is_dir():
        p.error(f"the original Baler's checkout is not at {args.baler_original}")
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(1)
    from machine import machine_info, write_json_atomic

    train, held_out, names = load_split(args.baler_original)
    results: dict = {"benchmark": "baler_time_to_quality", "data": JETS, "columns": names,
                     "rows": {"train": len(train), "held_out": len(held_out)},
                     "settings": {"reps": args.reps, "max_epochs": args.max_epochs, "batch_original": 512,
                                  "threads": 1, "configs": [c[0] for c in CONFIGS]},
                     "timing": "both tools in this one process, timed the same way (wall time of training, held-out "
                               "evaluations taken out); runs interleaved",
                     "targets": []}  # fmt: skip
    for epochs in [int(e) for e in args.original_epochs.split(",")]:
        rows: dict[str, list[dict]] = {"original": [], **{c[0]: [] for c in CONFIGS}}
        for rep in range(args.reps):
            loads = [round(x, 2) for x in os.getloadavg()]
            original = run_original(args.baler_original, train, held_out, epochs)
            original["load_before"] = loads
            rows["original"].append(original)
            target = original["held_out_mse"]  # each repetition chases its own original run's quality
            order = CONFIGS[rep % len(CONFIGS):] + CONFIGS[: rep % len(CONFIGS)]
            for config in order:
                ours = run_ours(train, held_out, target, config, args.max_epochs)
                ours["target_mse"] = target
                rows[config[0]].append(ours)
                print(f"epochs {epochs} rep {rep} {config[0]:<40} reached {ours['reached']} in {ours['epochs']} "
                      f"epochs, {ours['time_s']:.2f} s (original {original['time_s']:.2f} s)", flush=True)
        summary = {}
        orig_time = statistics.median(r["time_s"] for r in rows["original"])
        for name, runs in rows.items():
            reached = [r for r in runs if r.get("reached", True)]
            times = [r["time_s"] for r in reached]
            energies = [r["energy_J"] for r in reached if r.get("energy_J") is not None]
            summary[name] = {"reached": f"{len(reached)}/{len(runs)}",
                             "time_s": statistics.median(times) if times else None,
                             "energy_J": statistics.median(energies) if energies else None,
                             "provenance": runs[0]["provenance"],
                             "held_out_mse": statistics.median(r["held_out_mse"] for r in runs if r["held_out_mse"] is not None)}  # fmt: skip
            if times and len(reached) == len(runs):
                summary[name]["time_ratio_original_over_ours"] = orig_time / summary[name]["time_s"]
        best = min((n for n in summary if n != "original" and "time_ratio_original_over_ours" in summary[n]),
                   key=lambda n: summary[n]["time_s"], default=None)
        results["targets"].append({"original_epochs": epochs, "runs": rows, "median": summary, "fastest": best,
                                   "goal": {"ratio": summary[best]["time_ratio_original_over_ours"] if best else None,
                                            "goal": f">= {GOAL_TIME_RATIO}"}})  # fmt: skip
    results["machine"] = machine_info(torch=torch.__version__, threads=1)
    print_report(results)
    write_json_atomic(args.out, results)
    print(f"written to {args.out}")
    return 0


def print_report(r: dict) -> None:
    print(f"\nTime to the original Baler's held-out quality: {r['data']} ({r['rows']['train']} training rows, "
          f"{r['rows']['held_out']} held out, {len(r['columns'])} columns), {r['settings']['reps']} repetitions, 1 thread")
    for t in r["targets"]:
        print(f"\ntarget: the original's held-out error after its {t['original_epochs']} epochs "
              f"(median {t['median']['original']['held_out_mse']:.5f})")
        print(f"{'':<42} {'reached':>8} {'time s':>8} {'energy J':>10} {'how':>10} {'original / ours':>16}")
        for name, m in t["median"].items():
            time_s = "-" if m["time_s"] is None else f"{m['time_s']:.3f}"
            joules = "-" if m["energy_J"] is None else f"{m['energy_J']:.2f}"
            ratio = m.get("time_ratio_original_over_ours")
            print(f"{name:<42} {m['reached']:>8} {time_s:>8} {joules:>10} {m['provenance']:>10} "
                  f"{'' if ratio is None else f'{ratio:.2f}x':>16}")
        g = t["goal"]
        if g["ratio"] is not None:
            print(f"fastest: {t['fastest']}: {g['ratio']:.2f}x less time than the original (goal {g['goal']})")


if __name__ == "__main__":
    sys.exit(main())
