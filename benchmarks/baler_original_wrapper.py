"""Run the ORIGINAL Baler (baler-collaboration/baler) unchanged and time it: a wrapper that only times.

Started by ``benchmarks/baler_speed.py`` with the original's own interpreter (a venv with torch, numpy, tqdm,
matplotlib, scikit-learn, scipy), never imported by baler_lit. It writes a Baler project (config module and
output folders) into a temporary workspace, changes into it (Baler resolves ``workspaces/<ws>/<project>``
relative to the working directory), imports ``baler`` from ``--baler-original`` and calls the same functions
``baler --mode train|compress|decompress`` calls, timing each with ``time.perf_counter``. Baler's own prints and
tqdm bars go to /dev/null (stdout and stderr); one JSON line goes to the real stdout at the end.

One compatibility shim, nothing else: torch 2.13's ``ReduceLROnPlateau`` no longer takes ``verbose``, which
Baler passes (its LR scheduler raises otherwise); the wrapper drops that one argument. And one bug shim, for
``save_error_bounded_deltas`` only: the original's ``save_error_bounded_requirement`` raises
``UnboundLocalError`` for a batch with no value over the bound (its ``deltas`` list is only made when there is
one); the wrapper returns that batch's empty deltas instead, and counts such batches
(``empty_delta_batches``). Numpy >= 1.24 refuses to make an array of the per-batch delta lists (they differ in
length), which ``np.save`` of the deltas needs; older numpy made an object array of them, and the wrapper
hands ``np.save`` that object array (what the original's ``decompress`` reads back).

Per-epoch times come from a hook on ``baler.modules.training.fit`` (the function Baler calls once per epoch):
the wrapper records the wall time between consecutive calls, the thread CPU time of each call and the loss
each returns, without changing what it computes.

Usage (normally through baler_speed.py)::

    python baler_original_wrapper.py --baler-original /work/baler-original --input data.npz --config '{...}'
        [--phases train,compress,decompress] [--threads 1] [--reuse-output DIR]

``--reuse-output`` copies an earlier run's ``output`` folder (its ``model.pt`` and normalisation) into the new
project first, so ``compress``/``decompress`` run again on the same trained model with another config (the
corrections benchmark compresses one model with and without ``save_error_bounded_deltas``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

WORKSPACE, PROJECT = "bench", "run"


def _write_project(root: Path, input_path: Path, config: dict) -> Path:
    project = root / "workspaces" / WORKSPACE / PROJECT
    for sub in ("config", "output/compressed_output", "output/decompressed_output", "output/plotting", "output/training"):
        (project / sub).mkdir(parents=True, exist_ok=True)
    for pkg in (root / "workspaces", root / "workspaces" / WORKSPACE, project, project / "config"):
        (pkg / "__init__.py").touch()
    lines = ["def set_config(c):", f"    c.input_path = {str(input_path)!r}"]
    lines += [f"    c.{key} = {value!r}" for key, value in config.items()]
    (project / "config" / f"{PROJECT}_config.py").write_text("\n".join(lines) + "\n")
    return project / "output"


@contextlib.contextmanager
def _silenced():
    """Send Baler's prints and progress bars to /dev/null for the block (file descriptors 1 and 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _drop_scheduler_verbose(torch) -> None:
    """Let Baler's ``ReduceLROnPlateau(..., verbose=True)`` run on torch versions without ``verbose``."""
    base = torch.optim.lr_scheduler.ReduceLROnPlateau

    class ReduceLROnPlateau(base):
        def __init__(self, *a, verbose=None, **kw):
            super().__init__(*a, **kw)

    torch.optim.lr_scheduler.ReduceLROnPlateau = ReduceLROnPlateau


def _tolerate_batches_without_deltas(helper) -> list[int]:
    """Let a batch with no value over the error bound through (see the module docstring); returns a counter."""
    import numpy as np

    original = helper.save_error_bounded_requirement
    count = [0]

    def save_error_bounded_requirement(config, decoded_output, data_batch):
        try:
            return original(config, decoded_output, data_batch)
        except UnboundLocalError:
            count[0] += 1
            empty = np.array([], dtype=np.int64)
            return [], (empty, empty)

    helper.save_error_bounded_requirement = save_error_bounded_requirement
    return count


def _save_ragged_lists_as_object_arrays(np) -> None:
    """``np.save(file, list_of_unequal_lists)`` as numpy < 1.24 did it: an object array of the lists."""
    save = np.save

    def tolerant_save(file, arr, *a, **kw):
        if isinstance(arr, list):
            try:
                np.asanyarray(arr)
            except ValueError:
                ragged = np.empty(len(arr), dtype=object)
                for i, item in enumerate(arr):
                    ragged[i] = item
                arr = ragged
        return save(file, arr, *a, **kw)

    np.save = tolerant_save


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baler-original", required=True, type=Path)
    p.add_argument("--input", required=True, type=Path)
    p.add_argument("--config", required=True, help="JSON object of Baler config attributes (c.<name> = value)")
    p.add_argument("--phases", default="train,compress,decompress")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reuse-output", type=Path, default=None, help="an earlier run's output folder to start from")
    args = p.parse_args()
    start_process = time.perf_counter()

    import torch

    torch.set_num_threads(args.threads)
    _drop_scheduler_verbose(torch)
    t_torch = time.perf_counter()
    sys.path.insert(0, str(args.baler_original.resolve()))
    root = Path(tempfile.mkdtemp(prefix="baler-original-"))
    output = _write_project(root, args.input.resolve(), json.loads(args.config))
    if args.reuse_output is not None:
        shutil.copytree(args.reuse_output, output, dirs_exist_ok=True)
    os.chdir(root)
    sys.path.insert(0, str(root))
    with _silenced():
        from baler import baler
        from baler.modules import helper, training
    t_import = time.perf_counter()

    epoch_ends: list[float] = []
    epoch_cpu: list[float] = []
    losses: list[float] = []
    original_fit = training.fit

    def timed_fit(*a, **kw):
        cpu = time.thread_time()
        result = original_fit(*a, **kw)
        epoch_cpu.append(time.thread_time() - cpu)
        epoch_ends.append(time.perf_counter())
        losses.append(float(result[0]))
        return result

    training.fit = timed_fit
    empty_delta_batches = _tolerate_batches_without_deltas(helper)
    import numpy

    _save_ragged_lists_as_object_arrays(numpy)
    importlib_config = __import__(f"workspaces.{WORKSPACE}.{PROJECT}.config.{PROJECT}_config", fromlist=["set_config"])
    config = helper.Config
    importlib_config.set_config(config)

    result: dict = {"import_s": t_import - t_torch, "torch_import_s": t_torch - start_process, "workspace": str(root)}
    phases = args.phases.split(",")
    with _silenced():
        if "train" in phases:
            t = time.perf_counter()
            baler.perform_training(str(output), config, verbose=False)
            result["train_s"] = time.perf_counter() - t
            result["epoch_end_s"] = [e - t for e in epoch_ends]
            result["losses"] = losses
            result["epoch_cpu_s"] = epoch_cpu
        if "compress" in phases:
            t = time.perf_counter()
            baler.perform_compression(str(output), config, verbose=False)
            result["compress_s"] = time.perf_counter() - t
        if "decompress" in phases:
            t = time.perf_counter()
            baler.perform_decompression(str(output), config, verbose=False)
            result["decompress_s"] = time.perf_counter() - t
    files = {
        "model_bytes": output / "compressed_output" / "model.pt",
        "compressed_bytes": output / "compressed_output" / "compressed.npz",
        "decompressed_path": output / "decompressed_output" / "decompressed.npz",
    }
    for key, path in files.items():
        if path.exists():
            result[key] = str(path) if key.endswith("_path") else path.stat().st_size
    result["empty_delta_batches"] = empty_delta_batches[0]
    result["process_s"] = time.perf_counter() - start_process
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
