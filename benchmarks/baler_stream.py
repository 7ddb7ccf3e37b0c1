"""Streaming compress/decompress: peak memory (RSS) and time of ``baler-lit compress``/``decompress`` on the
Baler profiling study's "big dataset" size, 7.7 M rows x 24 float32 columns (740 MB), and on 1/4 and 1/2 of it.

Goal (issue 14): RSS <= 1 GB at 7.7 M rows, independent of the row count; time linear in the rows.

The data are synthetic CMS jets (:func:`baler_lit.synthetic.synthetic_cms_jets`, 15 float32 + 9 integer-valued
columns stored as float32), written block by block into ``--work`` (default ``/tmp/baler_stream``; never into
the repository) as an uncompressed ``.npz`` with ``names`` and ``dtypes``. A 24 -> 200 -> 100 -> 50 -> 8 AE
is trained for a few epochs on 50k rows and saved as a checkpoint in BalerModule's layout. Each command then
runs in a fresh ``python -m baler_lit.cli`` process wrapped by this script's ``--child`` mode, which reports
its import and work times and its peak RSS (``VmHWM``: ``getrusage``'s ``ru_maxrss`` keeps the forking
parent's peak across exec). The floor row is a process
that only imports what the commands import (torch, numpy, baler_lit): what any baler-lit process costs.

Training rows (``--part train``): ``BalerDataModule(streaming=True)`` trains the same AE (float32, batch 512, no
validation) for ``--steps`` optimizer steps on the full file and on 1/4 of it, beside the in-memory mode on 1/4
(a size that fits); each fit runs in a fresh process (this script's ``--child-train`` mode) that reports its
setup time (reading/scanning the file, up to the first step), steps/s after ``WARMUP_STEPS`` warm-up steps and
its peak RSS. Goal: streamed peak RSS <= 1 GB whatever the rows.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/baler_stream.py [--rows 7700000] [--work /tmp/baler_stream]
[--part all|files|train]`` (about 8 min on one core). Writes ``benchmarks/results/baler_stream.json`` (a
``--part`` run replaces its own section and keeps the other's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported: benchmarks/machine.py
import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "baler_stream.json"
FULL_ROWS = 7_700_000
RSS_GOAL_MB = 1024
GENERATE_BLOCK = 500_000
#: Optimizer steps left out of the steps/s of a training row (first-window read, allocator warm-up).
WARMUP_STEPS = 20


def _peak_rss_mb() -> float:
    """This process's peak resident set size (MB): ``VmHWM`` of /proc/self/status, which (unlike
    ``getrusage``'s ``ru_maxrss``, which keeps the forking parent's peak across exec) counts this program only."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(argv: list[str]) -> None:
    """Run one baler-lit command in this process; print its import and work times and peak RSS (JSON)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import baler_lit.cli
    import baler_lit.compression  # noqa: F401
    import baler_lit.row_source  # noqa: F401

    imported = time.perf_counter()
    code = 0 if argv == ["imports"] else baler_lit.cli.main(argv)
    done = time.perf_counter()
    print("RESULT " + json.dumps({"code": code, "import_s": imported - start, "work_s": done - imported,
                                  "peak_rss_mb": _peak_rss_mb()}))  # fmt: skip


def _child_train(data: str, streaming: str, steps: str) -> None:
    """Train the AE for ``steps`` steps on ``data`` (streamed or in memory); print setup time, steps/s, peak RSS."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    import lightning as L
    import torch

    from baler_lit.data import BalerDataModule
    from baler_lit.module import BalerModule

    torch.manual_seed(0)
    marks: dict[str, float] = {}

    class StepClock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 0:
                marks.setdefault("first_step", time.perf_counter())
            if trainer.global_step == WARMUP_STEPS:
                marks.setdefault("warm", time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            marks["end"] = time.perf_counter()
            marks["steps"] = trainer.global_step

    imported = time.perf_counter()
    dm = BalerDataModule(data, batch_size=512, val_fraction=0.0, streaming=streaming == "streamed")
    model = BalerModule(input_shape=dm.input_shape, latent_dim=8, lr_patience=None, early_stopping_patience=None)
    trainer = L.Trainer(max_steps=int(steps), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[StepClock()],
                        default_root_dir=os.path.dirname(data))  # fmt: skip
    trainer.fit(model, dm)
    print("RESULT " + json.dumps({"code": 0, "import_s": imported - start, "setup_s": marks["first_step"] - imported,
                                  "steps": marks["steps"], "steps_per_s": (marks["steps"] - WARMUP_STEPS)
                                  / (marks["end"] - marks["warm"]), "peak_rss_mb": _peak_rss_mb()}))  # fmt: skip


def _run_child(argv: list[str], mode: str = "--child") -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, mode, *argv], capture_output=True, text=True, env=env,
                          check=False)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr[-800:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    if result["code"]:
        raise SystemExit(f"{' '.join(argv[:2])} exited {result['code']}: {done.stderr[-800:]}")
    return result


def _generate(path: Path, rows: int) -> None:
    """Synthetic jets, written block by block (the generator's memory stays that of one block)."""
    import numpy as np

    from baler_lit.synthetic import synthetic_cms_jets
    from baler_lit.table import npz_writer

    if path.exists():
        return
    first = synthetic_cms_jets(10, seed=0)
    with npz_writer(path, (rows, first.n_columns), np.float32, first.names, first.dtypes) as write:
        for i, start in enumerate(range(0, rows, GENERATE_BLOCK)):
            write(synthetic_cms_jets(min(GENERATE_BLOCK, rows - start), seed=i).data)


def _checkpoint(path: Path) -> None:
    """A briefly trained AE saved in the layout :func:`baler_lit.cli.load_checkpoint` reads."""
    import numpy as np
    import torch

    from baler_lit.models import build_model
    from baler_lit.normalization import MinMaxNormalizer
    from baler_lit.synthetic import synthetic_cms_jets

    if path.exists():
        return
    torch.manual_seed(0)
    table = synthetic_cms_jets(50_000, seed=99)
    norm = MinMaxNormalizer.fit(table.data)
    hp = {"input_shape": [24], "model": "AE", "latent_dim": 8, "dtype": "float32", "model_kwargs": None}
    model = build_model("AE", (24,), 8)
    x = torch.from_numpy(norm.transform(table.data, np.float32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(5):
        for batch in torch.split(x[torch.randperm(len(x))], 512):
            opt.zero_grad()
            torch.mean((model(batch) - batch) ** 2).backward()
            opt.step()
    baler = {"norm_min": norm.minimum.tolist(), "norm_scale": norm.scale.tolist(), "names": table.names,
             "dtypes": table.dtypes}  # fmt: skip
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": hp, "baler": baler}, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=FULL_ROWS, help="rows of the largest input")
    parser.add_argument("--work", default="/tmp/baler_stream", help="folder for the generated data (not the repo)")
    parser.add_argument("--bound", type=float, default=0.1, help="relative error bound of the bounded run")
    parser.add_argument("--keep", action="store_true", help="keep the generated inputs for a rerun")
    parser.add_argument("--part", choices=["all", "files", "train"], default="all",
                        help="compress/decompress rows, training rows, or both")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per training row")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if ROOT in work.resolve().parents or work.resolve() == ROOT:
        raise SystemExit("--work must lie outside the repository")
    result = json.loads(RESULT.read_text()) if RESULT.exists() and args.part != "all" else {}
    if args.part in ("all", "files"):
        result.update(_files_part(args, work))
    if args.part in ("all", "train"):
        result["training"] = _train_part(args, work)
    result.update({"benchmark": "baler_stream", "note": "wall times on a shared machine are noisy; RSS is not",
                   "machine": machine.machine_info(omp_num_threads=os.environ.get("OMP_NUM_THREADS"))})  # fmt: skip
    machine.write_json_atomic(RESULT, result)
    print(f"written {RESULT}")
    if not args.keep:
        for p in work.glob("jets_*"):
            p.unlink()


def _train_part(args: argparse.Namespace, work: Path) -> dict:
    """Streamed training on the full file and on 1/4 of it, in-memory training on 1/4: steps/s and peak RSS."""
    quarter = args.rows // 4
    runs = []
    for rows, mode in ((quarter, "in-memory"), (quarter, "streamed"), (args.rows, "streamed")):
        data = work / f"jets_{rows}.npz"
        _generate(data, rows)
        result = _run_child([str(data), mode, str(args.steps)], "--child-train")
        runs.append({"mode": mode, "rows": rows, **result})
        print(f"  train {mode:<10} {rows:>10} rows: setup {result['setup_s']:6.2f} s, {result['steps_per_s']:7.1f}"
              f" steps/s, peak RSS {result['peak_rss_mb']:7.0f} MB", flush=True)  # fmt: skip
    print()
    print(f"{'training (batch 512, AE 24->8)':<32} {'rows':>10} {'setup s':>8} {'steps/s':>8} {'peak RSS MB':>11}")
    for r in runs:
        print(f"{r['mode']:<32} {r['rows']:>10} {r['setup_s']:8.2f} {r['steps_per_s']:8.1f} {r['peak_rss_mb']:11.0f}")
    memory, streamed_q, streamed_full = runs
    summary = {
        "streamed_over_in_memory_steps_per_s": streamed_q["steps_per_s"] / memory["steps_per_s"],
        "streamed_peak_rss_mb_at_full": streamed_full["peak_rss_mb"],
        "streamed_rss_growth_mb_quarter_to_full": streamed_full["peak_rss_mb"] - streamed_q["peak_rss_mb"],
        "meets_rss_goal": streamed_full["peak_rss_mb"] <= RSS_GOAL_MB,
    }
    print(f"streamed/in-memory steps/s at {quarter} rows: x{summary['streamed_over_in_memory_steps_per_s']:.2f};"
          f" streamed peak RSS {streamed_full['peak_rss_mb']:.0f} MB at {args.rows} rows (goal <= {RSS_GOAL_MB}),"
          f" {summary['streamed_rss_growth_mb_quarter_to_full']:+.0f} MB from 1/4 of the rows")  # fmt: skip
    return {"steps": args.steps, "warmup_steps": WARMUP_STEPS, "batch_size": 512, "runs": runs, "summary": summary}


def _files_part(args: argparse.Namespace, work: Path) -> dict:
    """Streaming compress/decompress at 1/4, 1/2 and all of the rows, and an error-bounded compress."""
    ckpt = work / "ae.ckpt"
    _checkpoint(ckpt)
    floor = _run_child(["imports"])
    runs = []
    sizes = [args.rows // 4, args.rows // 2, args.rows]
    for rows in sizes:
        data = work / f"jets_{rows}.npz"
        _generate(data, rows)
        baler, restored = work / f"jets_{rows}.baler", work / f"jets_{rows}_restored.npz"
        for cmd, argv in (
            ("compress", ["compress", "--ckpt", str(ckpt), "--input", str(data), "--output", str(baler),
                          "--overwrite"]),
            ("decompress", ["decompress", "--input", str(baler), "--output", str(restored), "--overwrite"]),
        ):  # fmt: skip
            result = _run_child(argv)
            runs.append({"command": cmd, "rows": rows, **result, "input_bytes": data.stat().st_size,
                         "file_bytes": baler.stat().st_size})  # fmt: skip
            print(f"  {cmd:<22} {rows:>10} rows: {result['work_s']:8.2f} s, peak RSS {result['peak_rss_mb']:7.0f} MB",
                  flush=True)  # fmt: skip
        restored.unlink()
    rows = sizes[0]
    bounded = work / f"jets_{rows}_bounded.baler"
    result = _run_child(["compress", "--ckpt", str(ckpt), "--input", str(work / f"jets_{rows}.npz"), "--output",
                         str(bounded), "--overwrite", "--max-relative-error", str(args.bound)])  # fmt: skip
    runs.append({"command": f"compress --max-relative-error {args.bound:g}", "rows": rows, **result,
                 "file_bytes": bounded.stat().st_size})  # fmt: skip
    result = _run_child(["decompress", "--input", str(bounded), "--output", str(work / "b.npz"), "--overwrite"])
    runs.append({"command": "decompress (bounded file)", "rows": rows, **result, "file_bytes": bounded.stat().st_size})
    (work / "b.npz").unlink()

    print()
    print(f"{'command':<32} {'rows':>10} {'work s':>8} {'us/row':>7} {'peak RSS MB':>11} {'file MB':>8}")
    print(f"{'(floor: imports only)':<32} {'':>10} {floor['import_s']:8.2f} {'':>7} {floor['peak_rss_mb']:11.0f}")
    for r in runs:
        print(f"{r['command']:<32} {r['rows']:>10} {r['work_s']:8.2f} {1e6 * r['work_s'] / r['rows']:7.2f}"
              f" {r['peak_rss_mb']:11.0f} {r['file_bytes'] / 1e6:8.1f}")  # fmt: skip
    print("work s: the command's own time after its imports (the floor row's time is the imports)")
    summary = {}
    for cmd in ("compress", "decompress"):
        mine = [r for r in runs if r["command"] == cmd]
        summary[cmd] = {
            "peak_rss_mb_at_full": mine[-1]["peak_rss_mb"],
            "rss_growth_mb_quarter_to_full": mine[-1]["peak_rss_mb"] - mine[0]["peak_rss_mb"],
            "time_full_over_quarter": mine[-1]["work_s"] / mine[0]["work_s"],
            "rows_full_over_quarter": mine[-1]["rows"] / mine[0]["rows"],
            "meets_rss_goal": mine[-1]["peak_rss_mb"] <= RSS_GOAL_MB,
        }
        s = summary[cmd]
        print(f"{cmd}: peak RSS {s['peak_rss_mb_at_full']:.0f} MB at {mine[-1]['rows']} rows (goal <= {RSS_GOAL_MB}),"
              f" {s['rss_growth_mb_quarter_to_full']:+.0f} MB from 1/4 of the rows; work time x"
              f"{s['time_full_over_quarter']:.2f} for x{s['rows_full_over_quarter']:.0f} rows")  # fmt: skip
    return {"rows": sizes, "columns": 24, "input_dtype": "float32", "floor": floor, "runs": runs,
            "summary": summary, "rss_goal_mb": RSS_GOAL_MB}  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--child-train":
        _child_train(*sys.argv[2:])
    else:
        main()
