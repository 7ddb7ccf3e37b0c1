"""Samples/s and energy per epoch of the ORIGINAL Baler and of baler-lit on the same GPU, batch 512 (issue 31, item 5).

Offline-ready: nothing is downloaded. The data are synthetic CMS-jet rows (``baler_lit.synthetic``, 24 columns), the
original is imported from its checkout (``--baler-original``: the folder holding its ``baler/`` package, Apache-2.0;
only ``baler/modules`` is used). Both tools run **in one process**, timed the same way, the sides interleaved
(``--reps`` repetitions, the order of the sides rotated each time):

- ``original_f64``: the original as it ships: its ``AE`` (float64, hard-coded), its ``DataLoader`` over the
  device tensor (per-sample indexing and collate, ``shuffle=False``), ``torch.optim.Adam`` and its per-epoch
  ``baler.modules.training.fit`` (its tqdm bar to /dev/null).
- ``original_f32``: the same loop with the model and the data cast to float32 (nothing else changed): the
  original's speed at our dtype.
- ``ours_f32`` / ``ours_bf16``: baler-lit as shipped (``BalerModule`` + ``BalerDataModule``, Trainer with
  EnergyCallback, BalerCheckpoint, the default TensorBoard logger and progress bar), Baler's order, precision
  ``32-true`` / ``bf16-mixed``.

Per epoch: wall seconds between the epoch's start and end, each boundary after ``torch.cuda.synchronize()``, and
the card's energy over that window from NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``,
mJ, whole card, updated every ~100 ms: epochs should last ≥ 1 s; the rows are sized for that). The counter is
only READ: nothing here sets a clock, a power limit, persistence or MIG. Energy figures are labelled
``measured`` (``simulated`` in a dry run). Samples/s and J/epoch are medians over epochs after the first; the
reported loss is the last epoch's mean of Baler's per-batch Σ(x̂−x)²/24 (the accuracy guard beside bf16).

Goals (issue 31): ours ≥ 10× the original's samples/s on the same card; ≥ 2 M samples/s on an H100/H200.

Run on a GPU machine::

    python benchmarks/baler_gpu.py --baler-original .baler-original [--out benchmarks/results/baler_gpu_<card>.json]

``--dry-run`` (here, on a CPU): the fake NVML of ``tests/fakes_nvml.py`` as ``pynvml``, the CPU as the device,
tiny sizes; results go to ``benchmarks/results/dry/`` unless ``--out`` says otherwise. ``--quick``: one
repetition, fewer rows and epochs. A side that fails (e.g. the original's checkout or one of its imports is
missing) is recorded with its error and the others go on.
"""

from __future__ import annotations

import os

os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
for _path in (REPO, BENCHMARKS, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

BATCH = 512
SIDES = ("original_f64", "original_f32", "ours_f32", "ours_bf16")
GOAL_RATIO = 10.0
GOAL_SAMPLES_PER_S = 2.0e6
#: modules the original imports that its training never uses (plots, SciPy's Wasserstein distance, sklearn's
#: split): stubbed only when missing on the machine, and the JSON says which were
ORIGINAL_OPTIONAL = ("matplotlib", "matplotlib.pyplot", "matplotlib.colors", "matplotlib.ticker",
                     "matplotlib.backends", "matplotlib.backends.backend_pdf", "scipy", "scipy.stats",
                     "sklearn", "sklearn.model_selection")
DEFAULT_ORIGINAL = next((p for p in (REPO / ".baler-original", Path("/work/baler-original"),
                                     Path("/tmp/baler-original")) if (p / "baler" / "modules").is_dir()),
                        REPO / ".baler-original")


# ------------------------------------------------------------------------------------------ the card, read-only
class EnergyCounter:
    """NVML's total-energy counter of one card (J), read-only; ``None`` readings when it is not supported."""

    def __init__(self, nvml, index: int) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.note = None
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception as err:  # pre-Volta, MIG: no counter
            self.note = f"no energy counter on this card ({type(err).__name__}): energy per epoch not measured"

    def joules(self) -> float | None:
        if self.note is not None:
            return None
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0

    def describe(self) -> dict:
        def maybe(call):
            try:
                value = call()
                return value.decode() if isinstance(value, bytes) else value
            except Exception:
                return None

        n, h = self.nvml, self.handle
        return {"gpu": maybe(lambda: n.nvmlDeviceGetName(h)), "driver": maybe(n.nvmlSystemGetDriverVersion),
                "power_limit_W": maybe(lambda: n.nvmlDeviceGetPowerManagementLimit(h) / 1000)}


def open_counter(dry_run: bool, index: int) -> EnergyCounter:
    if dry_run:
        from gpu_check import fake_pynvml

        return EnergyCounter(fake_pynvml(), index)
    import pynvml

    return EnergyCounter(pynvml, index)


# ------------------------------------------------------------------------------------------ timing
class EpochWindows:
    """Epoch boundaries: wall time (``perf_counter``) and the counter's joules, each after a device sync."""

    def __init__(self, counter: EnergyCounter, sync) -> None:
        self.counter, self.sync = counter, sync
        self.wall_s: list[float] = []
        self.energy_J: list[float | None] = []
        self._start: tuple[float, float | None] | None = None

    def start(self) -> None:
        self.sync()
        self._start = (time.perf_counter(), self.counter.joules())

    def end(self) -> None:
        self.sync()
        t, j = time.perf_counter(), self.counter.joules()
        t0, j0 = self._start
        self.wall_s.append(t - t0)
        self.energy_J.append(None if j is None or j0 is None else j - j0)


def summarise(windows: EpochWindows, rows: int, loss: float) -> dict:
    wall = windows.wall_s[1:] or windows.wall_s  # the first epoch holds one-off work (allocation, kernels' setup)
    energy = [e for e in (windows.energy_J[1:] or windows.energy_J) if e is not None]
    per_epoch = statistics.median(wall)
    return {"epoch_wall_s": windows.wall_s, "epoch_energy_J": windows.energy_J, "s_per_epoch": per_epoch,
            "samples_per_s": rows / per_epoch, "J_per_epoch": statistics.median(energy) if energy else None,
            "loss": loss}  # fmt: skip


# ------------------------------------------------------------------------------------------ the original
def import_original(checkout: Path) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType, list[str]]:
    """The original's ``models``, ``training`` and ``utils`` modules; stubs for the optional imports it lacks."""
    import importlib.util

    stubbed = []
    for name in ORIGINAL_OPTIONAL:
        root = name.split(".")[0]
        if name not in sys.modules and importlib.util.find_spec(root) is None:
            module = types.ModuleType(name)
            module.__getattr__ = lambda attr, _n=name: (_ for _ in ()).throw(ImportError(f"{_n} is a stub"))
            sys.modules[name] = module
            stubbed.append(name)
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from baler.modules import models, training, utils

    return models, training, utils, stubbed


def run_original(checkout: Path, x, dtype, epochs: int, windows: EpochWindows, device) -> float:
    """The original's training loop, as its ``training.train`` sets it up, one ``fit`` per epoch."""
    import torch
    from torch.utils.data import DataLoader

    models, training, utils, _ = import_original(checkout)
    model = models.AE(x.shape[1], math.ceil(x.shape[1] / 1.6)).to(device)  # 24 columns -> 15, as Baler
    model = model.to(dtype)
    train_ds = torch.tensor(x, dtype=dtype, device=device)
    train_dl = DataLoader(train_ds, batch_size=BATCH, shuffle=False, drop_last=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = types.SimpleNamespace()  # fit reads only `custom_loss_function`, absent: Baler's mse_sum_loss_l1
    loss = float("nan")
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        for _ in range(epochs):
            windows.start()
            loss, *_ = training.fit(config, model, train_dl, list(model.children()), 0.001, optimizer,
                                    model.z_dim, 0.05, True, 1)  # fmt: skip
            windows.end()
    return float(loss)


# ------------------------------------------------------------------------------------------ ours
def run_ours(data: Path, precision: str, epochs: int, windows: EpochWindows, accelerator: str, root: Path) -> float:
    """baler-lit as shipped (EnergyCallback, BalerCheckpoint, TensorBoard, progress bar), Baler's order."""
    import warnings

    import lightning as L

    from baler_lit.data import BalerDataModule
    from baler_lit.module import BalerCheckpoint, BalerModule
    from lightning_energy import EnergyCallback

    warnings.filterwarnings("ignore")

    class Windows(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            windows.start()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            windows.end()

    L.seed_everything(0, verbose=False)
    datamodule = BalerDataModule(path=str(data), batch_size=BATCH, val_fraction=0.0, shuffle=False)
    model = BalerModule(input_shape=datamodule.input_shape, dtype="float32")
    trainer = L.Trainer(max_epochs=epochs, accelerator=accelerator, devices=1, precision=precision,
                        default_root_dir=str(root), log_every_n_steps=50,
                        callbacks=[Windows(), EnergyCallback(verbose=False), BalerCheckpoint(filename="best")])  # fmt: skip
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        trainer.fit(model, datamodule)
    return float(trainer.callback_metrics["train/loss"])


# ------------------------------------------------------------------------------------------ the benchmark
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baler-original", type=Path, default=DEFAULT_ORIGINAL)
    p.add_argument("--rows", type=int, default=None, help="rows of synthetic jets (default 400,000; dry run 2,048)")
    p.add_argument("--epochs-original", type=int, default=None, help="epochs per original run (default 3)")
    p.add_argument("--epochs-ours", type=int, default=None, help="epochs per run of ours (default 10)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--nvml-index", type=int, default=0, help="the NVML index of the card torch uses")
    p.add_argument("--dry-run", action="store_true", help="fake NVML, the CPU as device, tiny sizes")
    p.add_argument("--quick", action="store_true", help="one repetition, 100k rows, 2 and 4 epochs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        p.error(f"unknown side(s) {unknown}; choose from {list(SIDES)}")
    rows = args.rows or (2048 if args.dry_run else 100_000 if args.quick else 400_000)
    epochs_original = args.epochs_original or (2 if args.dry_run or args.quick else 3)
    epochs_ours = args.epochs_ours or (2 if args.dry_run else 4 if args.quick else 10)
    reps = 1 if args.quick else args.reps
    if rows < BATCH or min(epochs_original, epochs_ours) < 2 or reps < 1:
        p.error("need rows >= 512, epochs >= 2 and reps >= 1")

    import numpy as np
    import torch

    from baler_lit.normalization import MinMaxNormalizer
    from baler_lit.synthetic import synthetic_cms_jets
    from machine import machine_info, write_json_atomic

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("baler_gpu: no CUDA device (use --dry-run to rehearse on a CPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    counter = open_counter(args.dry_run, args.nvml_index)
    out = args.out or (BENCHMARKS / "results" / ("dry" if args.dry_run else "") / "baler_gpu.json")

    table = synthetic_cms_jets(rows, seed=0)
    x = MinMaxNormalizer.fit(table.data, per_column=True).transform(table.data, np.float64)  # Baler's min-max
    results: dict = {"benchmark": "baler_gpu", "dry_run": args.dry_run,
                     "energy_provenance": "simulated" if args.dry_run else "measured",
                     "settings": {"rows": rows, "columns": int(x.shape[1]), "batch_size": BATCH,
                                  "epochs_original": epochs_original, "epochs_ours": epochs_ours, "reps": reps,
                                  "sides": sides, "shuffle": False, "device": str(device)},
                     "timing": "both tools in this one process, the sides interleaved (order rotated per "
                               "repetition); epoch windows between device syncs; medians over epochs after the first",
                     "card": counter.describe(), "notes": [n for n in [counter.note] if n],
                     "runs": {s: [] for s in sides}, "errors": {}}  # fmt: skip
    if "cuda" in str(device):
        results["card"]["torch_device"] = torch.cuda.get_device_name(0)
    if any(s.startswith("original") for s in sides):
        try:
            results["original_stubbed_imports"] = import_original(args.baler_original)[3]
        except Exception as err:
            results["errors"]["original import"] = f"{type(err).__name__}: {err}"
    with tempfile.TemporaryDirectory(prefix="baler_gpu_") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "jets.npz"
        np.savez(data, data=table.data, names=np.array(table.names))
        for rep in range(reps):
            for side in sides[rep % len(sides):] + sides[: rep % len(sides)]:
                if side.startswith("original") and "original import" in results["errors"]:
                    continue
                windows = EpochWindows(counter, sync)
                try:
                    if side.startswith("original"):
                        dtype = torch.float64 if side.endswith("f64") else torch.float32
                        loss = run_original(args.baler_original, x, dtype, epochs_original, windows, device)
                    else:
                        precision = "bf16-mixed" if side.endswith("bf16") else "32-true"
                        loss = run_ours(data, precision, epochs_ours, windows, "gpu" if cuda else "cpu",
                                        tmp / f"{side}_{rep}")
                except Exception as err:  # one side failing never stops the others
                    results["errors"][f"{side} rep {rep}"] = "".join(traceback.format_exception_only(err)).strip()
                    continue
                results["runs"][side].append(summarise(windows, rows, loss))
                print(f"rep {rep} {side:<13} {results['runs'][side][-1]['samples_per_s']:12.0f} samples/s", flush=True)
    med = {}
    for side, runs in results["runs"].items():
        if runs:
            joules = [r["J_per_epoch"] for r in runs if r["J_per_epoch"] is not None]
            med[side] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
                         "J_per_epoch": statistics.median(joules) if joules else None,
                         "loss": statistics.median(r["loss"] for r in runs)}  # fmt: skip
            if med[side]["J_per_epoch"] is not None:
                med[side]["J_per_sample"] = med[side]["J_per_epoch"] / rows
    results["median"] = med
    goals = {}
    for ours in ("ours_f32", "ours_bf16"):
        if ours in med and "original_f64" in med:
            ratio = med[ours]["samples_per_s"] / med["original_f64"]["samples_per_s"]
            goals[f"{ours}_over_original_f64"] = {"value": ratio, "goal": f">= {GOAL_RATIO}", "met": ratio >= GOAL_RATIO}
        if ours in med:
            sps = med[ours]["samples_per_s"]
            goals[f"{ours}_samples_per_s"] = {"value": sps, "goal": f">= {GOAL_SAMPLES_PER_S:.0f} on an H100/H200",
                                              "met": sps >= GOAL_SAMPLES_PER_S}
    results["goals"] = goals
    results["machine"] = machine_info(torch=torch.__version__)
    print_report(results)
    write_json_atomic(out, results)
    print(f"written to {out}")
    return 0


def print_report(r: dict) -> None:
    s = r["settings"]
    card = r["card"].get("gpu") or "?"
    print(f"\nBaler AE on {card}{' (DRY RUN: fake NVML, CPU)' if r['dry_run'] else ''}: {s['rows']} rows × "
          f"{s['columns']}, batch {s['batch_size']}, {s['reps']} repetition(s), energy {r['energy_provenance']}")
    print(f"{'':<14} {'samples/s':>12} {'J/epoch':>10} {'µJ/sample':>10} {'loss':>10}")
    for side, m in r["median"].items():
        joules = "-" if m["J_per_epoch"] is None else f"{m['J_per_epoch']:10.1f}"
        per_sample = "-" if m.get("J_per_sample") is None else f"{m['J_per_sample'] * 1e6:10.2f}"
        print(f"{side:<14} {m['samples_per_s']:12.0f} {joules:>10} {per_sample:>10} {m['loss']:10.4f}")
    for name, g in r["goals"].items():
        print(f"{name}: {g['value']:.3g} (goal {g['goal']}): {'met' if g['met'] else 'NOT met'}")
    for key, err in r["errors"].items():
        print(f"error: {key}: {err}")


if __name__ == "__main__":
    sys.exit(main())
