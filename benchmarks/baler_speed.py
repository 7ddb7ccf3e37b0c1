"""Speed of baler-lit against the ORIGINAL Baler (baler-collaboration/baler), side by side, one CPU thread.

The original runs unchanged, in its own virtual environment, through ``benchmarks/baler_original_wrapper.py``
(a wrapper that only times; see its docstring for the one torch-2.13 compatibility shim). Every measurement
runs in a fresh process, ours and the original's interleaved (A B A B ...), so a machine shared with other
work slows both alike: the ratios are meaningful even where absolute times are not. Reported per process: wall
seconds and CPU seconds (user + system of the child, which a busy machine inflates far less than wall time).

Sections:

- ``cfd``: Baler's CFD example end to end, 2000 epochs: ``baler-lit fit --config configs/cfd_dense_ae.yaml``
  (CFD_dense_AE, EnergyCallback, BalerCheckpoint, TensorBoard) against the original's ``CFD_project_animation``
  config (CFD_dense_AE, batch 6000 = one batch, 2000 epochs). Goal: ours ≤ 1.2 × the original's wall time.
- ``train``: synthetic CMS-jet rows × 24 (``baler_lit.synthetic``; the original's CMS example file is not in its
  repository; ``--rows``, default 34,000), batch 512, Baler's order (no shuffling), ``--epochs`` epochs, ``--reps``
  (default 3) interleaved repetitions, the order of the tools rotated each repetition. Every run is a whole
  process, timed the same way for both tools: the process's wall and CPU seconds (``getrusage`` of the child),
  and samples/s from the median epoch period after the first, an epoch period being the wall time from one epoch's
  start to the next one's (ours: a callback at ``on_train_epoch_start``; the original: the wrapper's hook on its
  per-epoch ``fit``; both include the per-epoch scheduler and early-stopping work). Sides: the original (its CMS
  example settings: AE, float64, through ``baler_original_wrapper.py``); ours **as shipped**, through the CLI with
  ``configs/cms_ae.yaml`` + ``configs/baler_parity.yaml`` (EnergyCallback, BalerCheckpoint, the default
  TensorBoard logger and progress bar, and what ``baler-lit fit`` adds: :mod:`baler_lit.lean_loop`'s profiler and
  throttled bar), in float64 and in float32; ours as a **bare Lightning** Trainer (no callback, logger or progress
  bar; Lightning's default profiler) and as a **pure-torch loop** of the same model, batch and fused Adam, in
  float32 and float64 (the floor: its speed over the original is the ceiling of any run of this model and batch).
  ``os.getloadavg()`` is recorded before and after every run. Goals (medians): float64 as shipped ≥ 1.1× the
  original's samples/s, float32 as shipped ≥ 2.5×, as shipped within 1.2× of the pure-torch loop.
- ``components``: what each shipped part costs, each variant a whole process of the same float32 training as
  ``train`` (``--reps`` interleaved): bare Lightning; + EnergyCallback; + TensorBoard logger; + both; + both
  without the power figure; + BalerCheckpoint; + Lightning's default progress bar (Rich, if installed);
  the lean progress bar and the lean profiler alone; the shipped parts with Lightning's default bar and profiler;
  all shipped parts as ``baler-lit fit`` runs them. Per variant: samples/s (median epoch period after the first)
  and the process CPU seconds per epoch (every thread: sampler, figure drawing, progress-bar refresh), beside bare
  Lightning. Goal: the shipped parts together ≤ 5 % over bare Lightning.
- ``codec``: ``compress`` and ``decompress`` of the same 100k rows, end to end (process wall, imports
  included), with the models trained above; the original's in-process phase times are listed too.
- ``startup``: ``python -c "import torch"`` against ``baler-lit compress|decompress|evaluate|info`` on a 64-row
  file: start-up beyond torch's own import (goal ≤ 1 s); ``evaluate`` with and without its figures.
- ``levers``: the training step in a bare loop (100k rows, batch 512, float32 unless named) with each lever the
  issue names: fused / foreach / for-loop Adam, ``torch.compile`` (inductor) of the model, bf16 autocast (with
  the accuracy guard: loss within 5 % of float32), float64 (the original's dtype). A CUDA-graph path needs a GPU.

Every goal is printed twice: from samples/s (wall time, as the issue states them) and from CPU seconds per epoch
(which a machine shared with other work inflates far less; the original's is its training thread's, ours the
whole process's, every thread counted).

Run: ``OMP_NUM_THREADS=1 python benchmarks/baler_speed.py --sections train,components`` (the issue's table; 51
whole processes: about 25 minutes on a 2-core machine at load 4-8, less on a quiet one; every section: add
``cfd,codec,startup,levers``; ``--quick`` for a smoke run). ``--baler-original PATH`` names the original's
checkout (default
/work/baler-original if present, else ``.baler-original`` in the repository root) and
``--original-python`` its interpreter (default ``.baler-original-venv/bin/python``, else this interpreter when it
can import the original's dependencies); if either is missing the
original's rows are skipped with a note. Writes ``benchmarks/results/baler_speed.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every child process
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "baler_speed.json"
WRAPPER = REPO / "benchmarks" / "baler_original_wrapper.py"
ORIGINAL_CANDIDATES = [Path("/work/baler-original"), REPO / ".baler-original", Path("/tmp/baler-original")]
DEFAULT_ORIGINAL = next((p for p in ORIGINAL_CANDIDATES if (p / "baler" / "baler.py").is_file()), ORIGINAL_CANDIDATES[1])
DEFAULT_ORIGINAL_PYTHON = REPO / ".baler-original-venv" / "bin" / "python"
#: the original's imports (baler/modules): this interpreter runs it when they are all installed
ORIGINAL_NEEDS = ("torch", "numpy", "tqdm", "matplotlib", "sklearn", "scipy")
SHARED_DATA = Path(os.environ.get("BALER_LIT_DATA", REPO.parent / "shared" / "data"))
CFD_CANDIDATES = [SHARED_DATA / "CFD_animation.npz", Path("/work/shared/data/CFD_animation.npz")]

#: The original's CFD_project_animation config (workspaces/CFD_workspace), epochs set per run.
ORIGINAL_CFD = {
    "compression_ratio": 100, "early_stopping": False, "early_stopping_patience": 100, "min_delta": 0,
    "lr_scheduler": True, "lr_scheduler_patience": 50, "model_name": "CFD_dense_AE", "model_type": "dense",
    "custom_norm": True, "l1": True, "reg_param": 0.001, "RHO": 0.05, "lr": 0.001, "batch_size": 6000,
    "test_size": 0, "data_dimension": 2, "apply_normalization": False, "extra_compression": False,
    "intermittent_model_saving": False, "intermittent_saving_patience": 100, "activation_extraction": False,
    "deterministic_algorithm": False, "compress_to_latent_space": False, "save_error_bounded_deltas": False,
    "error_bounded_requirement": 1, "convert_to_blocks": False, "separate_model_saving": False,
}  # fmt: skip
#: The original's CMS_project_v1 config (workspaces/CMS_workspace), epochs set per run.
ORIGINAL_CMS = {
    "data_dimension": 1, "compression_ratio": 1.6, "apply_normalization": True, "model_name": "AE",
    "model_type": "dense", "lr": 0.001, "batch_size": 512, "early_stopping": True, "lr_scheduler": True,
    "save_error_bounded_deltas": False, "error_bounded_requirement": 10, "early_stopping_patience": 100,
    "min_delta": 0, "lr_scheduler_patience": 50, "custom_norm": False, "reg_param": 0.001, "RHO": 0.05,
    "test_size": 0, "l1": True, "extra_compression": False, "intermittent_model_saving": False,
    "intermittent_saving_patience": 100, "activation_extraction": False, "deterministic_algorithm": False,
    "convert_to_blocks": False, "separate_model_saving": False,
}  # fmt: skip
GOAL_CFD_WALL_RATIO = 1.2
GOAL_F64_RATIO = 1.1  # ours as shipped, float64, over the original's samples/s
GOAL_F32_RATIO = 2.5  # ours as shipped, float32, over the original's samples/s
GOAL_FLOOR_RATIO = 1.2  # the pure-torch loop's samples/s over ours as shipped (float32), at most
GOAL_PARTS_OVERHEAD = 0.05  # the shipped callbacks, logger and progress bar over bare Lightning, at most
BATCH = 512
GOAL_STARTUP_S = 1.0
#: bf16 autocast is kept only if its loss stays within this factor of float32's (the accuracy guard).
BF16_LOSS_GUARD = 1.05


# -- running things ------------------------------------------------------------------------------------------
def run_process(argv: list[str], cwd: Path | None = None, timeout: float = 3600, **env: str) -> dict:
    """Run ``argv``; return wall s, CPU s (user+system of the child), its stdout and the load average before and
    after; raise on failure."""
    load_before = _load()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "CODECARBON_LOG_LEVEL": "error", **env})  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "stdout": proc.stdout, "load_before": load_before, "load_after": _load()}


def _load() -> list[float]:
    """``os.getloadavg()`` (1, 5, 15 minutes), rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def _can_import(modules) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


def baler_lit_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "baler_lit.cli", *args]


class Original:
    """The original Baler through the timing wrapper; ``None``-like when its checkout or venv is missing."""

    def __init__(self, checkout: Path, python: Path) -> None:
        if not python.exists() and _can_import(ORIGINAL_NEEDS):
            python = Path(sys.executable)  # this venv has everything the original imports
        self.checkout, self.python = checkout, python
        missing = [str(p) for p in (checkout / "baler" / "baler.py", python) if not p.exists()]
        self.note = f"original Baler skipped: {', '.join(missing)} not found" if missing else None

    def __bool__(self) -> bool:
        return self.note is None

    def run(self, data: Path, config: dict, phases: str = "train", reuse_output: Path | None = None) -> dict:
        reuse = ["--reuse-output", str(reuse_output)] if reuse_output is not None else []
        timed = run_process([str(self.python), str(WRAPPER), "--baler-original", str(self.checkout),
                             "--input", str(data), "--config", json.dumps(config), "--phases", phases,
                             *reuse])  # fmt: skip
        result = json.loads(timed["stdout"].strip().splitlines()[-1])
        ends = result.pop("epoch_end_s", [])
        result.update(wall_s=timed["wall_s"], cpu_s=timed["cpu_s"], epoch_s=[b - a for a, b in zip(ends, ends[1:])],
                      load_before=timed["load_before"], load_after=timed["load_after"])
        result["epoch_cpu_s"] = result.get("epoch_cpu_s", [])[1:]
        return result


def energy_epochs(root: Path) -> list[float]:
    """Per-epoch training seconds from the EnergyCallback report of the last run below ``root``."""
    reports = sorted(root.glob("lightning_logs/version_*/energy_report.json"))
    return [e["train_s"] for e in json.loads(reports[-1].read_text())["epochs"]]


def last_train_loss(root: Path) -> float:
    """The last ``train/loss`` scalar TensorBoard recorded below ``root``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = sorted(root.glob("lightning_logs/version_*"))[-1]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return acc.Scalars("train/loss")[-1].value


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


# -- sections ------------------------------------------------------------------------------------------------
def cfd_section(original: Original, data: Path, epochs: int, reps: int, tmp: Path) -> dict:
    rows: dict[str, list[dict]] = {"baler_lit": [], "original": []}
    for rep in range(reps):
        root, times = tmp / f"cfd_{rep}", tmp / f"cfd_epochs_{rep}.json"
        ours = run_process(baler_lit_cli("fit", "--config", str(REPO / "configs" / "cfd_dense_ae.yaml"),
                                         "--data.path", str(data), "--trainer.default_root_dir", str(root),
                                         "--trainer.callbacks+=benchmarks.baler_speed_timer.EpochTimes",
                                         "--trainer.max_epochs", str(epochs)),
                           BALER_SPEED_EPOCH_TIMES=str(times))  # fmt: skip
        ours.pop("stdout")
        epoch_times = json.loads(times.read_text())
        ours["s_per_epoch"] = median_after_first(epoch_times["wall_s"])
        ours["cpu_s_per_epoch"] = median_after_first(epoch_times["cpu_s"])
        ours["loss"] = last_train_loss(root)
        rows["baler_lit"].append(ours)
        if original:
            orig = original.run(data, {**ORIGINAL_CFD, "epochs": epochs})
            rows["original"].append({"wall_s": orig["wall_s"], "cpu_s": orig["cpu_s"],
                                     "s_per_epoch": median_after_first(orig["epoch_s"]),
                                     "cpu_s_per_epoch": median_after_first(orig["epoch_cpu_s"]),
                                     "loss": orig["losses"][-1]})  # fmt: skip
    return {"epochs": epochs, "runs": rows, **_ratios(rows, ("wall_s", "cpu_s", "s_per_epoch", "cpu_s_per_epoch"))}


def _ratios(rows: dict[str, list[dict]], keys) -> dict:
    """Median of each key per side, and ours/original."""
    med = {side: {k: statistics.median(r[k] for r in runs) for k in keys} for side, runs in rows.items() if runs}
    ratio = {k: med["baler_lit"][k] / med["original"][k] for k in keys} if "original" in med else {}
    return {"median": med, "ratio_ours_over_original": ratio}


def _periods(starts: list[float]) -> list[float]:
    """Epoch periods (s) from epoch start times (and a final end time)."""
    return [b - a for a, b in zip(starts, starts[1:])]


def _side_row(run: dict, rows: int, periods: list[float], loss: float, **extra) -> dict:
    """``periods``: the epoch periods (s) from the second epoch on (the first holds one-off work: allocations,
    the first figure); samples/s from their median."""
    per_epoch = statistics.median(periods)
    return {"wall_s": run["wall_s"], "cpu_s": run["cpu_s"], "s_per_epoch": per_epoch,
            "samples_per_s": rows / per_epoch, "epoch_periods_s": periods, "loss": loss,
            "load_before": run["load_before"], "load_after": run["load_after"], **extra}  # fmt: skip


def run_ours_shipped(data: Path, dtype: str, epochs: int, root: Path, rows: int) -> dict:
    """``baler-lit fit --config cms_ae --config baler_parity`` as a user runs it, plus the epoch clock."""
    times = root.with_suffix(".json")
    run = run_process(baler_lit_cli("fit", "--config", str(REPO / "configs" / "cms_ae.yaml"),
                                    "--config", str(REPO / "configs" / "baler_parity.yaml"),
                                    "--data.path", str(data), "--model.dtype", dtype,
                                    "--trainer.default_root_dir", str(root),
                                    "--trainer.callbacks+=benchmarks.baler_speed.EpochClock",
                                    "--trainer.max_epochs", str(epochs)),
                      BALER_SPEED_EPOCH_TIMES=str(times))  # fmt: skip
    clock = json.loads(times.read_text())
    return _side_row(run, rows, _periods(clock["start_s"])[1:], last_train_loss(root),
                     epoch_cpu_s=clock["process_cpu_s"], dtype=dtype,
                     checkpoint=str(next(root.glob("lightning_logs/version_*/checkpoints/best.ckpt"))))


def run_worker(variant: str, data: Path, dtype: str, epochs: int, rows: int) -> dict:
    """One :func:`variant_worker` run in a fresh process."""
    run = run_process([sys.executable, __file__, "--worker-variant", variant, "--worker-data", str(data),
                       "--worker-dtype", dtype, "--epochs", str(epochs)])  # fmt: skip
    out = json.loads(run["stdout"].strip().splitlines()[-1])
    return _side_row(run, rows, _periods(out["start_s"])[1:], out["loss"], epoch_cpu_s=out["process_cpu_s"],
                     dtype=dtype, variant=variant)


def train_section(original: Original, data: Path, rows: int, epochs: int, reps: int, tmp: Path) -> dict:
    sides: dict[str, list[dict]] = {"original": [], "shipped_f64": [], "shipped_f32": [], "bare_f32": [],
                                    "torch_f32": [], "torch_f64": []}
    order = list(sides)
    for rep in range(reps):
        for side in order[rep % len(order):] + order[: rep % len(order)]:  # rotated: no side always first
            if side == "original":
                if not original:
                    continue
                orig = original.run(data, {**ORIGINAL_CMS, "epochs": epochs}, phases="train")
                # epoch_s: from one fit() end to the next (fit k+1 starts where fit k ends), epochs 2..N
                sides[side].append(_side_row(orig, rows, orig["epoch_s"], orig["losses"][-1],
                                             epoch_cpu_s=orig["epoch_cpu_s"], dtype="float64"))
            elif side.startswith("shipped"):
                dtype = "float64" if side.endswith("f64") else "float32"
                sides[side].append(run_ours_shipped(data, dtype, epochs, tmp / f"{side}_{rep}", rows))
            else:
                variant, dtype = side.rsplit("_", 1)
                sides[side].append(run_worker(variant, data, {"f32": "float32", "f64": "float64"}[dtype], epochs, rows))
    keys = ("wall_s", "cpu_s", "s_per_epoch", "samples_per_s", "loss")
    med = {side: {k: statistics.median(r[k] for r in runs) for k in keys} for side, runs in sides.items() if runs}
    goals = {}
    if "original" in med:
        f64 = med["shipped_f64"]["samples_per_s"] / med["original"]["samples_per_s"]
        f32 = med["shipped_f32"]["samples_per_s"] / med["original"]["samples_per_s"]
        goals["f64_shipped_over_original"] = {"value": f64, "goal": f">= {GOAL_F64_RATIO}", "met": f64 >= GOAL_F64_RATIO}
        goals["f32_shipped_over_original"] = {"value": f32, "goal": f">= {GOAL_F32_RATIO}", "met": f32 >= GOAL_F32_RATIO}
        goals["process_cpu_f64_original_over_shipped"] = {
            "value": med["original"]["cpu_s"] / med["shipped_f64"]["cpu_s"], "goal": "none (whole process, imports)"}
    goals["cpu_based"] = cpu_ratios(sides)
    goals["cpu_based_goals"] = cpu_goals(goals["cpu_based"])
    floor = med["torch_f32"]["samples_per_s"] / med["shipped_f32"]["samples_per_s"]
    goals["torch_over_shipped_f32"] = {"value": floor, "goal": f"<= {GOAL_FLOOR_RATIO}", "met": floor <= GOAL_FLOOR_RATIO}
    goals["bare_over_shipped_f32"] = {"value": med["bare_f32"]["samples_per_s"] / med["shipped_f32"]["samples_per_s"],
                                      "goal": f"<= {1 + GOAL_PARTS_OVERHEAD} (see components)"}
    return {"rows": rows, "epochs": epochs, "batch_size": BATCH, "reps": reps, "runs": sides, "median": med,
            "goals": goals, "checkpoints": {r["dtype"]: r["checkpoint"] for r in sides["shipped_f32"][-1:] +
                                            sides["shipped_f64"][-1:]}}  # fmt: skip


def cpu_ratios(sides: dict[str, list[dict]]) -> dict:
    """The same comparisons from CPU seconds per epoch (median over runs of each run's median from the second epoch
    on), which a machine shared with other work inflates far less than wall time. Ours: the process's CPU (every
    thread); the original: its training thread's CPU in ``fit`` (its other threads are not counted, in its favour)."""
    cpu = {side: statistics.median(median_after_first(r["epoch_cpu_s"]) for r in runs)
           for side, runs in sides.items() if runs}  # fmt: skip
    out = {"cpu_s_per_epoch": cpu}
    if "original" in cpu:
        out["f64_shipped_over_original"] = cpu["original"] / cpu["shipped_f64"]
        out["f32_shipped_over_original"] = cpu["original"] / cpu["shipped_f32"]
    out["shipped_f32_over_torch"] = cpu["shipped_f32"] / cpu["torch_f32"]
    out["shipped_f32_over_bare"] = cpu["shipped_f32"] / cpu["bare_f32"]
    if "torch_f64" in cpu:
        out["shipped_f64_over_torch_f64"] = cpu["shipped_f64"] / cpu["torch_f64"]
    if "original" in cpu:  # the floor's speed-up: the most any training loop of this model and batch reaches here
        out["ceiling_f32_torch_over_original"] = cpu["original"] / cpu["torch_f32"]
        if "torch_f64" in cpu:
            out["ceiling_f64_torch_over_original"] = cpu["original"] / cpu["torch_f64"]
    return out


def cpu_goals(c: dict) -> dict:
    """The issue's goals read from CPU seconds per epoch (``cpu_ratios``), met or not."""
    goals = {}
    if "f64_shipped_over_original" in c:
        goals["f64_shipped_over_original"] = (c["f64_shipped_over_original"], f">= {GOAL_F64_RATIO}",
                                              c["f64_shipped_over_original"] >= GOAL_F64_RATIO)
        goals["f32_shipped_over_original"] = (c["f32_shipped_over_original"], f">= {GOAL_F32_RATIO}",
                                              c["f32_shipped_over_original"] >= GOAL_F32_RATIO)
    goals["shipped_f32_over_torch"] = (c["shipped_f32_over_torch"], f"<= {GOAL_FLOOR_RATIO}",
                                       c["shipped_f32_over_torch"] <= GOAL_FLOOR_RATIO)
    return {k: {"value": v, "goal": g, "met": m} for k, (v, g, m) in goals.items()}


#: component variants: what each adds to bare Lightning (all float32, same data and model as ``train``)
COMPONENTS = {
    "bare": (),
    "energy": ("energy",),
    "logger": ("logger",),
    "energy+logger": ("energy", "logger"),
    "energy+logger, no power figure": ("energy", "logger", "nofigure"),
    "checkpoint": ("checkpoint",),
    "default progress bar": ("bar",),
    "lean progress bar": ("leanbar",),
    "lean profiler": ("leanprof",),
    "shipped parts, Lightning's bar+profiler": ("energy", "logger", "checkpoint", "bar"),
    "shipped (all of them)": ("energy", "logger", "checkpoint", "leanbar", "leanprof"),
}
#: what ``baler-lit fit`` adds to the Trainer besides the configured callbacks (:mod:`baler_lit.lean_loop`)
SHIPPED_PARTS = COMPONENTS["shipped (all of them)"]


def components_section(data: Path, rows: int, epochs: int, reps: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in COMPONENTS}
    names = list(COMPONENTS)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            runs[name].append(run_worker("component:" + name, data, "float32", epochs, rows))
    med = {}
    for name, rs in runs.items():
        med[name] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                     "process_cpu_s_per_epoch": statistics.median(median_after_first(r["epoch_cpu_s"]) for r in rs),
                     "wall_s": statistics.median(r["wall_s"] for r in rs),
                     "cpu_s": statistics.median(r["cpu_s"] for r in rs)}  # fmt: skip
    base = med["bare"]
    for m in med.values():
        m["time_over_bare"] = base["samples_per_s"] / m["samples_per_s"] - 1
        m["process_cpu_over_bare"] = m["process_cpu_s_per_epoch"] / base["process_cpu_s_per_epoch"] - 1
    shipped = med["shipped (all of them)"]["time_over_bare"]
    shipped_cpu = med["shipped (all of them)"]["process_cpu_over_bare"]
    return {"rows": rows, "epochs": epochs, "batch_size": BATCH, "dtype": "float32", "reps": reps, "runs": runs,
            "median": med, "goal": {"shipped_over_bare": shipped, "goal": f"<= {GOAL_PARTS_OVERHEAD}",
                                    "met": shipped <= GOAL_PARTS_OVERHEAD},
            "goal_cpu": {"shipped_over_bare": shipped_cpu, "goal": f"<= {GOAL_PARTS_OVERHEAD}",
                         "met": shipped_cpu <= GOAL_PARTS_OVERHEAD}}  # fmt: skip


def variant_worker(variant: str, data: Path, dtype: str, epochs: int) -> dict:
    """Train the AE on ``data`` (Baler's order, batch 512) one way; epoch start times and per-epoch process CPU."""
    import torch

    torch.set_num_threads(1)
    if variant == "torch":
        return _torch_loop(data, dtype, epochs)
    import warnings

    warnings.filterwarnings("ignore")
    parts = COMPONENTS[variant.split(":", 1)[1]] if variant.startswith("component:") else ()
    with tempfile.TemporaryDirectory(prefix="baler_speed_worker_") as tmp_name:
        return _fit_variant(parts, data, dtype, epochs, Path(tmp_name))


def _fit_variant(parts, data: Path, dtype: str, epochs: int, tmp: Path) -> dict:
    import lightning as L

    from baler_lit.data import BalerDataModule
    from baler_lit.module import BalerCheckpoint, BalerModule

    L.seed_everything(0, verbose=False)
    datamodule = BalerDataModule(path=str(data), batch_size=BATCH, val_fraction=0.0, shuffle=False)
    model = BalerModule(input_shape=datamodule.input_shape, dtype=dtype)  # Baler's defaults, as the parity config
    clock = _epoch_clock_class()()
    callbacks: list = []
    if "energy" in parts:
        from lightning_energy import EnergyCallback

        callbacks.append(EnergyCallback(log_power_figure="nofigure" not in parts))
    if "checkpoint" in parts:
        callbacks.append(BalerCheckpoint(filename="best"))
    if "leanbar" in parts:
        from baler_lit.lean_loop import lean_progress_bar

        callbacks.append(lean_progress_bar())
    callbacks.append(clock)
    profiler = None
    if "leanprof" in parts:
        from baler_lit.lean_loop import LeanProfiler

        profiler = LeanProfiler()
    trainer = L.Trainer(max_epochs=epochs, callbacks=callbacks, default_root_dir=str(tmp), log_every_n_steps=50,
                        logger=None if "logger" in parts else False, enable_checkpointing="checkpoint" in parts,
                        enable_progress_bar=bool({"bar", "leanbar"} & set(parts)), profiler=profiler,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(model, datamodule)
    return {"start_s": clock.start_s, "process_cpu_s": clock.process_cpu_s,
            "loss": float(trainer.callback_metrics["train/loss"])}


def _torch_loop(data: Path, dtype: str, epochs: int) -> dict:
    """The floor: the same model, loss, batches and fused Adam in a plain loop (no Lightning)."""
    import numpy as np
    import torch

    from baler_lit.losses import BalerLoss
    from baler_lit.models import build_model
    from baler_lit.normalization import MinMaxNormalizer

    table = np.load(data)["data"]
    np_dtype = np.float64 if dtype == "float64" else np.float32
    x = torch.from_numpy(MinMaxNormalizer.fit(table, per_column=True).transform(table, np_dtype))
    torch.manual_seed(0)
    model = build_model("AE", (x.shape[1],), None, 1.6, dtype)
    criterion = BalerLoss("sum")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    starts, cpu, losses = [], [], []
    for _ in range(epochs):
        starts.append(time.perf_counter())
        c = time.process_time()
        total, n = torch.zeros((), dtype=x.dtype), 0
        for s in range(0, len(x), BATCH):
            loss, recon = criterion(model, x[s : s + BATCH])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += recon.detach()
            n += 1
        losses.append(float(total) / n)
        cpu.append(time.process_time() - c)
    starts.append(time.perf_counter())
    return {"start_s": starts, "process_cpu_s": cpu, "loss": losses[-1]}


def __getattr__(name: str):
    # ``benchmarks.baler_speed.EpochClock`` on the CLI: the class is made on first use, so that importing this
    # module (the benchmark's own process) does not import Lightning
    if name == "EpochClock":
        globals()["EpochClock"] = cls = _epoch_clock_class()
        return cls
    raise AttributeError(name)


def _epoch_clock_class():
    import lightning as L

    class EpochClock(L.Callback):
        """Wall time (``perf_counter``) at every training epoch's start and at the end of training, and the
        process CPU seconds (all threads) of each epoch; written to ``$BALER_SPEED_EPOCH_TIMES`` at fit end
        when that is set."""

        def __init__(self) -> None:
            self.start_s: list[float] = []
            self.process_cpu_s: list[float] = []
            self._cpu = 0.0

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            now, cpu = time.perf_counter(), time.process_time()
            if self.start_s:
                self.process_cpu_s.append(cpu - self._cpu)
            self.start_s.append(now)
            self._cpu = cpu

        def on_train_end(self, trainer, pl_module) -> None:
            self.on_train_epoch_start(trainer, pl_module)  # the last epoch's period ends here

        def on_fit_end(self, trainer, pl_module) -> None:
            path = os.environ.get("BALER_SPEED_EPOCH_TIMES")
            if path:
                Path(path).write_text(json.dumps({"start_s": self.start_s, "process_cpu_s": self.process_cpu_s}))

    return EpochClock


def codec_section(data: Path, ckpt: Path, reps: int, tmp: Path) -> dict:
    comp, decomp = [], []
    for rep in range(reps):
        out, restored = tmp / f"c{rep}.baler", tmp / f"r{rep}.npz"
        c = run_process(baler_lit_cli("compress", "--ckpt", str(ckpt), "--input", str(data), "--output", str(out)))
        d = run_process(baler_lit_cli("decompress", "--input", str(out), "--output", str(restored)))
        comp.append(c["wall_s"])
        decomp.append(d["wall_s"])
    return {"compress_wall_s": statistics.median(comp), "decompress_wall_s": statistics.median(decomp),
            "file_bytes": (tmp / "c0.baler").stat().st_size}  # fmt: skip


def startup_section(ckpt: Path, reps: int, tmp: Path) -> dict:
    from baler_lit.synthetic import synthetic_cms_jets
    from baler_lit.table import save_npz

    small = tmp / "small.npz"
    save_npz(small, synthetic_cms_jets(64, seed=9))
    times: dict[str, list[float]] = {"import torch": [], "compress": [], "decompress": [], "evaluate": [],
                                     "evaluate --no-plots": [], "info": []}
    for rep in range(reps):
        times["import torch"].append(run_process([sys.executable, "-c", "import torch"])["wall_s"])
        out, restored = tmp / f"s{rep}.baler", tmp / f"s{rep}.npz"
        times["compress"].append(run_process(baler_lit_cli("compress", "--ckpt", str(ckpt), "--input", str(small),
                                                           "--output", str(out)))["wall_s"])  # fmt: skip
        times["decompress"].append(run_process(baler_lit_cli("decompress", "--input", str(out),
                                                             "--output", str(restored)))["wall_s"])  # fmt: skip
        times["evaluate"].append(run_process(baler_lit_cli("evaluate", "--original", str(small), "--restored",
                                                           str(restored), "--out", str(tmp / f"e{rep}")))["wall_s"])
        times["evaluate --no-plots"].append(run_process(baler_lit_cli(
            "evaluate", "--original", str(small), "--restored", str(restored), "--out", str(tmp / f"n{rep}"),
            "--no-plots"))["wall_s"])  # fmt: skip
        times["info"].append(run_process(baler_lit_cli("info", str(out)))["wall_s"])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_wall_s": med, "beyond_torch_s": {k: med[k] - med["import torch"] for k in times if k != "import torch"}}


LEVERS = ("fused", "foreach", "for-loop", "compile", "bf16_autocast", "float64")


def lever_worker(lever: str, rows: int, epochs: int) -> dict:
    """One lever in a bare training loop over index-sliced batches; CPU s per epoch (thread time) and loss."""
    import torch
    import torch.nn.functional as F

    from baler_lit.models import build_model
    from baler_lit.synthetic import synthetic_cms_jets

    torch.set_num_threads(1)
    table = synthetic_cms_jets(rows, seed=0)
    lo, hi = table.data.min(0), table.data.max(0)
    dtype = torch.float64 if lever == "float64" else torch.float32
    x = torch.from_numpy((table.data - lo) / (hi - lo)).to(dtype)
    torch.manual_seed(0)
    model = build_model("AE", (24,), dtype="float64" if lever == "float64" else "float32")
    adam = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}}.get(lever, {"fused": True})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, **adam)
    forward = torch.compile(model) if lever == "compile" else model
    epoch_s, losses = [], []
    for _ in range(epochs):
        start, total, n = time.thread_time(), torch.zeros((), dtype=torch.float64), 0
        for s in range(0, rows, 512):
            b = x[s : s + 512]
            if lever == "bf16_autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = forward(b)
                loss = F.mse_loss(out.float(), b, reduction="sum") / 24
            else:
                loss = F.mse_loss(forward(b), b, reduction="sum") / 24
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            n += 1
        epoch_s.append(time.thread_time() - start)
        losses.append(float(total) / n)
    return {"lever": lever, "cpu_s_per_epoch": median_after_first(epoch_s), "epoch_cpu_s": epoch_s, "loss": losses[-1]}


def levers_section(rows: int, epochs: int) -> dict:
    results = {}
    for lever in LEVERS:
        out = run_process([sys.executable, __file__, "--worker-lever", lever, "--rows", str(rows),
                           "--epochs", str(epochs)])  # fmt: skip
        results[lever] = json.loads(out["stdout"].strip().splitlines()[-1])
    base = results["fused"]
    for r in results.values():
        r["speed_vs_fused"] = base["cpu_s_per_epoch"] / r["cpu_s_per_epoch"]
        r["loss_vs_fused"] = r["loss"] / base["loss"]
    guard = results["bf16_autocast"]["loss_vs_fused"] <= BF16_LOSS_GUARD
    results["bf16_autocast"]["accuracy_guard"] = f"loss within {BF16_LOSS_GUARD}x of float32: {guard}"
    return results


# -- report ----------------------------------------------------------------------------------------------------
def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"\nbaler-lit vs the original Baler — {m['cpu_model']} ({', '.join(m['cpu_features']) or 'no AVX-512/AMX'}),"
          f" {m['cpu_count']} cores, 1 thread; load average {m['load_start']} → {m['load_end']}")  # fmt: skip
    if r.get("original_note"):
        print(f"NOTE: {r['original_note']}")
    if "cfd" in r:
        c = r["cfd"]
        print(f"\nBaler's CFD example, {c['epochs']} epochs, end to end (median of runs)")
        print(f"{'':<12} {'wall s':>9} {'CPU s':>9} {'s/epoch':>9} {'CPU s/ep':>9} {'loss':>10}")
        for side, runs in c["runs"].items():
            if runs:
                med = c["median"][side]
                loss = statistics.median(x["loss"] for x in runs)
                print(f"{side:<12} {med['wall_s']:9.2f} {med['cpu_s']:9.2f} {med['s_per_epoch']:9.4f}"
                      f" {med['cpu_s_per_epoch']:9.4f} {loss:10.5f}")  # fmt: skip
        if c["ratio_ours_over_original"]:
            q = c["ratio_ours_over_original"]
            print(f"ours / original: wall {q['wall_s']:.2f}x, process CPU {q['cpu_s']:.2f}x, s/epoch"
                  f" {q['s_per_epoch']:.2f}x, thread CPU/epoch {q['cpu_s_per_epoch']:.2f}x"
                  f" (goal: wall ≤ {GOAL_CFD_WALL_RATIO}x)")  # fmt: skip
    if "train" in r:
        t = r["train"]
        print(f"\nTraining, {t['rows']} rows × 24, batch {t['batch_size']}, Baler's order, {t['epochs']} epochs, "
              f"{t['reps']} interleaved repetitions, every run a whole process (median of runs)")
        print(f"{'':<13} {'s/epoch':>8} {'samples/s':>10} {'loss':>9} {'process wall s':>15} {'process CPU s':>14}"
              f"  load avg before → after (1 min, per run)")  # fmt: skip
        for side, med in t["median"].items():
            loads = ", ".join(f"{x['load_before'][0]}→{x['load_after'][0]}" for x in t["runs"][side])
            print(f"{side:<13} {med['s_per_epoch']:8.3f} {med['samples_per_s']:10.0f} {med['loss']:9.4f}"
                  f" {med['wall_s']:15.2f} {med['cpu_s']:14.2f}  {loads}")  # fmt: skip
        for name, g in t["goals"].items():
            if name.startswith("cpu_based"):
                continue
            met = "" if "met" not in g else ("  met" if g["met"] else "  NOT met")
            print(f"{name}: {g['value']:.2f}x (goal {g['goal']}){met}")
        c = t["goals"]["cpu_based"]
        print("from CPU seconds per epoch (" + ", ".join(f"{k} {v:.3f}" for k, v in c["cpu_s_per_epoch"].items())
              + "): " + ", ".join(f"{k} {v:.2f}x" for k, v in c.items() if k != "cpu_s_per_epoch"))
        for name, g in t["goals"].get("cpu_based_goals", {}).items():
            print(f"  CPU-based {name}: {g['value']:.2f}x (goal {g['goal']})  {'met' if g['met'] else 'NOT met'}")
        if "ceiling_f32_torch_over_original" in c:
            print(f"  ceiling: a plain torch loop of the same model and batch is {c['ceiling_f32_torch_over_original']:.2f}x"
                  f" the original in float32" + (f", {c['ceiling_f64_torch_over_original']:.2f}x in float64"
                                                 if "ceiling_f64_torch_over_original" in c else "")
                  + " (no Lightning run can pass it)")
        print("shipped = baler-lit fit --config cms_ae --config baler_parity (EnergyCallback, BalerCheckpoint, "
              "TensorBoard, progress bar); bare = Lightning Trainer without callbacks, logger, progress bar; "
              "torch = a plain loop of the same model, batches and fused Adam")
    if "components" in r:
        c = r["components"]
        print(f"\nWhat each shipped part costs: float32, {c['rows']} rows, batch {c['batch_size']}, {c['epochs']} epochs, "
              f"{c['reps']} interleaved repetitions, whole processes (median)")
        print(f"{'':<32} {'samples/s':>10} {'time vs bare':>13} {'process CPU s/epoch':>20} {'vs bare':>8}")
        for name, m in c["median"].items():
            print(f"{name:<32} {m['samples_per_s']:10.0f} {m['time_over_bare']:+12.1%} "
                  f"{m['process_cpu_s_per_epoch']:20.3f} {m['process_cpu_over_bare']:+8.1%}")
        g = c["goal"]
        print(f"shipped parts over bare Lightning, samples/s: {g['shipped_over_bare']:+.1%} (goal {g['goal']}): "
              f"{'met' if g['met'] else 'NOT met'}")
        if "goal_cpu" in c:
            g = c["goal_cpu"]
            print(f"shipped parts over bare Lightning, process CPU per epoch: {g['shipped_over_bare']:+.1%} "
                  f"(goal {g['goal']}): {'met' if g['met'] else 'NOT met'}")
    if "codec" in r:
        k = r["codec"]
        print(f"\ncompress / decompress of the same rows, end to end: ours {k['compress_wall_s']:.2f} s /"
              f" {k['decompress_wall_s']:.2f} s, file {k['file_bytes']} bytes")  # fmt: skip
        o = r.get("train", {}).get("runs", {}).get("original") or []
        if o:
            print(f"original: compress {statistics.median(x['compress_s'] for x in o):.2f} s + imports"
                  f" {statistics.median(x['import_s'] for x in o):.2f} s, decompress"
                  f" {statistics.median(x['decompress_s'] for x in o):.2f} s + imports; model.pt + compressed.npz"
                  f" {statistics.median(x['files_bytes'] for x in o):.0f} bytes")  # fmt: skip
    if "startup" in r:
        s = r["startup"]
        beyond = ", ".join(f"{k} {v:.2f} s" for k, v in s["beyond_torch_s"].items())
        print(f"\nstart-up: import torch {s['median_wall_s']['import torch']:.2f} s; beyond it (64-row file): {beyond}"
              f" (goal ≤ {GOAL_STARTUP_S} s)")  # fmt: skip
    if "levers" in r:
        print("\nLevers (bare loop, thread CPU s per epoch, loss after the same epochs)")
        for name, v in r["levers"].items():
            print(f"{name:<14} {v['cpu_s_per_epoch']:8.3f} s  speed {v['speed_vs_fused']:5.2f}x  loss {v['loss']:.4f}"
                  f" ({v['loss_vs_fused']:.3f}x)" + (f"  {v['accuracy_guard']}" if "accuracy_guard" in v else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baler-original", type=Path, default=DEFAULT_ORIGINAL)
    p.add_argument("--original-python", type=Path, default=DEFAULT_ORIGINAL_PYTHON)
    p.add_argument("--sections", default="cfd,train,components,codec,startup,levers")
    p.add_argument("--cfd-epochs", type=int, default=2000)
    p.add_argument("--rows", type=int, default=34_000)
    p.add_argument("--epochs", type=int, default=8, help="epochs per run; per-epoch figures are medians from the second")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of each comparison (>= 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 100 CFD epochs, 5k rows, 3 epochs, 1 rep")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker-lever", choices=LEVERS, help=argparse.SUPPRESS)
    p.add_argument("--worker-variant", help=argparse.SUPPRESS)
    p.add_argument("--worker-data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-dtype", default="float32", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_variant:
        print(json.dumps(variant_worker(args.worker_variant, args.worker_data, args.worker_dtype, args.epochs)))
        return 0
    if args.worker_lever:
        print(json.dumps(lever_worker(args.worker_lever, args.rows, args.epochs)))
        return 0
    if args.quick:
        args.cfd_epochs, args.rows, args.epochs, args.reps = 100, 5_000, 3, 1
    sys.path.insert(0, str(REPO / "benchmarks"))
    from machine import machine_info, write_json_atomic

    from baler_lit.synthetic import synthetic_cms_jets

    sections = args.sections.split(",")
    original = Original(args.baler_original, args.original_python)
    results: dict = {"benchmark": "baler_speed", "original_note": original.note,
                     "original_checkout": str(args.baler_original), "settings": vars(args) | {"out": str(args.out)}}
    results["settings"] = {k: str(v) for k, v in results["settings"].items()}
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="baler_speed_") as tmp_name:
        tmp = Path(tmp_name)
        if "cfd" in sections:
            cfd = next((c for c in CFD_CANDIDATES if c.exists()), None)
            if cfd is None:
                results["cfd_note"] = "CFD_animation.npz not found (set BALER_LIT_DATA)"
            else:
                results["cfd"] = cfd_section(original, cfd, args.cfd_epochs, args.reps, tmp)
        jets = tmp / "jets.npz"
        table = synthetic_cms_jets(args.rows, seed=0)
        import numpy as np

        np.savez(jets, data=table.data, names=np.array(table.names))  # Baler's plain layout
        ckpt = None
        if "train" in sections:
            results["train"] = train_section(original, jets, args.rows, args.epochs, args.reps, tmp)
            ckpt = Path(results["train"]["checkpoints"]["float32"])
        if "components" in sections:
            results["components"] = components_section(jets, args.rows, args.epochs, args.reps)
        if ckpt is not None and "codec" in sections:
            results["codec"] = codec_section(jets, ckpt, args.reps, tmp)
        if ckpt is not None and "startup" in sections:
            results["startup"] = startup_section(ckpt, max(3, args.reps), tmp)
        if "levers" in sections:
            results["levers"] = levers_section(args.rows, args.epochs)
    import torch

    results["machine"] = machine_info(torch=torch.__version__, threads=1, load_start=load_start,
                                      load_end=[round(x, 2) for x in os.getloadavg()])  # fmt: skip
    results["timing"] = ("every run a whole process, ours and the original's timed the same way (process wall and "
                         "CPU from getrusage; samples/s from the median epoch period from the second epoch on); "
                         f"{args.reps} interleaved repetitions; load average before/after each run in its row")
    print_report(results)
    write_json_atomic(args.out, results)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
