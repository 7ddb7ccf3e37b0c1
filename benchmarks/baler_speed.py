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
- ``train``: 100k synthetic CMS-jet rows × 24 (``baler_lit.synthetic``; the original's CMS example file is not
  in its repository), batch 512, Baler's order (no shuffling), ``--epochs`` epochs. Ours through the CLI with
  ``configs/cms_ae.yaml`` + ``configs/baler_parity.yaml`` (EnergyCallback on) in float32 and in float64; the
  original with its CMS example settings (AE, float64). Samples/s from the median epoch after the first;
  loss = the last epoch's mean of Baler's per-batch Σ(x̂−x)²/24. Goal: ≥ 3× the original's samples/s at
  equal or lower loss.
- ``codec``: ``compress`` and ``decompress`` of the same 100k rows, end to end (process wall, imports
  included), with the models trained above; the original's in-process phase times are listed too.
- ``startup``: ``python -c "import torch"`` against ``baler-lit compress|decompress|evaluate|info`` on a 64-row
  file: start-up beyond torch's own import (goal ≤ 1 s); ``evaluate`` with and without its figures.
- ``levers``: the training step in a bare loop (100k rows, batch 512, float32 unless named) with each lever the
  issue names: fused / foreach / for-loop Adam, ``torch.compile`` (inductor) of the model, bf16 autocast (with
  the accuracy guard: loss within 5 % of float32), float64 (the original's dtype). A CUDA-graph path needs a GPU.

Run: ``OMP_NUM_THREADS=1 python benchmarks/baler_speed.py`` (about 15 minutes on a quiet 2-core machine;
``--quick`` for a short smoke run). ``--baler-original PATH`` names the original's checkout (default
/work/baler-original if present, else ``.baler-original`` in the repository root) and
``--original-python`` its interpreter (default ``.baler-original-venv/bin/python``); if either is missing the
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
DEFAULT_ORIGINAL = Path("/work/baler-original") if Path("/work/baler-original").is_dir() else REPO / ".baler-original"
DEFAULT_ORIGINAL_PYTHON = REPO / ".baler-original-venv" / "bin" / "python"
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
GOAL_SAMPLES_RATIO = 3.0
GOAL_STARTUP_S = 1.0
#: bf16 autocast is kept only if its loss stays within this factor of float32's (the accuracy guard).
BF16_LOSS_GUARD = 1.05


# -- running things ------------------------------------------------------------------------------------------
def run_process(argv: list[str], cwd: Path | None = None, timeout: float = 3600, **env: str) -> dict:
    """Run ``argv``; return wall s, CPU s (user+system of the child) and its stdout; raise on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "CODECARBON_LOG_LEVEL": "error", **env})  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "stdout": proc.stdout}


def baler_lit_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "baler_lit.cli", *args]


class Original:
    """The original Baler through the timing wrapper; ``None``-like when its checkout or venv is missing."""

    def __init__(self, checkout: Path, python: Path) -> None:
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
        result.update(wall_s=timed["wall_s"], cpu_s=timed["cpu_s"], epoch_s=[b - a for a, b in zip(ends, ends[1:])])
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


def train_section(original: Original, data: Path, rows: int, epochs: int, reps: int, tmp: Path) -> dict:
    sides = {"baler_lit_f32": [], "baler_lit_f64": [], "original": []}
    ckpts: dict[str, Path] = {}
    for rep in range(reps):
        for dtype in ("float32", "float64"):
            root = tmp / f"train_{dtype}_{rep}"
            times = tmp / f"epochs_{dtype}_{rep}.json"
            run = run_process(baler_lit_cli("fit", "--config", str(REPO / "configs" / "cms_ae.yaml"),
                                            "--config", str(REPO / "configs" / "baler_parity.yaml"),
                                            "--data.path", str(data), "--model.dtype", dtype,
                                            "--trainer.default_root_dir", str(root),
                                            "--trainer.callbacks+=benchmarks.baler_speed_timer.EpochTimes",
                                            "--trainer.max_epochs", str(epochs)),
                              BALER_SPEED_EPOCH_TIMES=str(times))  # fmt: skip
            epoch_times = json.loads(times.read_text())
            per_epoch = median_after_first(epoch_times["wall_s"])
            cpu_epoch = median_after_first(epoch_times["cpu_s"])
            sides["baler_lit_f32" if dtype == "float32" else "baler_lit_f64"].append(
                {"wall_s": run["wall_s"], "cpu_s": run["cpu_s"], "s_per_epoch": per_epoch,
                 "samples_per_s": rows / per_epoch, "cpu_s_per_epoch": cpu_epoch,
                 "samples_per_cpu_s": rows / cpu_epoch, "loss": last_train_loss(root)}  # fmt: skip
            )
            ckpts[dtype] = next(root.glob("lightning_logs/version_*/checkpoints/best.ckpt"))
        if original:
            orig = original.run(data, {**ORIGINAL_CMS, "epochs": epochs}, phases="train,compress,decompress")
            per_epoch = median_after_first(orig["epoch_s"])
            cpu_epoch = median_after_first(orig["epoch_cpu_s"])
            sides["original"].append({
                "wall_s": orig["wall_s"], "cpu_s": orig["cpu_s"], "s_per_epoch": per_epoch,
                "samples_per_s": rows / per_epoch, "cpu_s_per_epoch": cpu_epoch,
                "samples_per_cpu_s": rows / cpu_epoch, "loss": orig["losses"][-1],
                "compress_s": orig.get("compress_s"), "decompress_s": orig.get("decompress_s"),
                "import_s": orig["import_s"] + orig["torch_import_s"],
                "files_bytes": orig.get("model_bytes", 0) + orig.get("compressed_bytes", 0),
            })  # fmt: skip
    keys = ("wall_s", "cpu_s", "s_per_epoch", "samples_per_s", "cpu_s_per_epoch", "samples_per_cpu_s", "loss")
    med = {side: {k: statistics.median(r[k] for r in runs) for k in keys} for side, runs in sides.items() if runs}
    ratio = {}
    if sides["original"]:
        for side in ("baler_lit_f32", "baler_lit_f64"):
            ratio[side] = {
                "samples_per_s": med[side]["samples_per_s"] / med["original"]["samples_per_s"],
                "samples_per_cpu_s": med[side]["samples_per_cpu_s"] / med["original"]["samples_per_cpu_s"],
                "loss": med[side]["loss"] / med["original"]["loss"],
            }
    return {"rows": rows, "epochs": epochs, "runs": sides, "median": med, "ratio_ours_over_original": ratio,
            "checkpoints": {k: str(v) for k, v in ckpts.items()}}  # fmt: skip


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
        print(f"\nTraining, {t['rows']} rows × 24, batch 512, Baler's order, {t['epochs']} epochs, EnergyCallback on")
        print(f"{'':<15} {'s/epoch':>9} {'samples/s':>10} {'CPU s/ep':>9} {'samples/CPU s':>13} {'loss':>9}"
              f" {'wall s':>8} {'CPU s':>8}")  # fmt: skip
        for side, med in t["median"].items():
            print(f"{side:<15} {med['s_per_epoch']:9.3f} {med['samples_per_s']:10.0f} {med['cpu_s_per_epoch']:9.3f}"
                  f" {med['samples_per_cpu_s']:13.0f} {med['loss']:9.4f} {med['wall_s']:8.2f} {med['cpu_s']:8.2f}")
        for side, q in t["ratio_ours_over_original"].items():
            print(f"{side} / original: samples/s {q['samples_per_s']:.2f}x, per training-thread CPU second"
                  f" {q['samples_per_cpu_s']:.2f}x (goal ≥ {GOAL_SAMPLES_RATIO}x), loss {q['loss']:.2f}x (goal ≤ 1)")
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
    p.add_argument("--sections", default="cfd,train,codec,startup,levers")
    p.add_argument("--cfd-epochs", type=int, default=2000)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions of each comparison")
    p.add_argument("--quick", action="store_true", help="smoke run: 100 CFD epochs, 20k rows, 3 epochs, 1 rep")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker-lever", choices=LEVERS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_lever:
        print(json.dumps(lever_worker(args.worker_lever, args.rows, args.epochs)))
        return 0
    if args.quick:
        args.cfd_epochs, args.rows, args.epochs, args.reps = 100, 20_000, 3, 1
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
        if ckpt is not None and "codec" in sections:
            results["codec"] = codec_section(jets, ckpt, args.reps, tmp)
        if ckpt is not None and "startup" in sections:
            results["startup"] = startup_section(ckpt, max(3, args.reps), tmp)
        if "levers" in sections:
            results["levers"] = levers_section(args.rows, args.epochs)
    import torch

    results["machine"] = machine_info(torch=torch.__version__, threads=1, load_start=load_start,
                                      load_end=[round(x, 2) for x in os.getloadavg()])  # fmt: skip
    print_report(results)
    write_json_atomic(args.out, results)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
