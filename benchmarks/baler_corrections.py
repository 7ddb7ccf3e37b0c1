"""Error-bounded corrections: what they cost in baler-lit and in the ORIGINAL Baler, same data, comparable model.

The original's ``save_error_bounded_deltas`` / ``error_bounded_requirement`` (percent) stores, for every value
whose relative error in the *normalised* domain exceeds the requirement, the float16 difference (decoded −
original) and its batch/row/column index in two gzipped pickled npz files beside ``compressed.npz`` and
``model.pt``; values of 0 are skipped (their relative error is undefined). baler-lit's ``--max-relative-error``
stores the original value of every value that misses the bound in physical units (zlib-compressed index gaps
and values inside the one ``.baler`` file).

Data: the CMS NanoAOD ttbar file's jets (``Jet_*`` branches of ``nanoAOD_2015_CMS_Open_Data_ttbar.root`` in
the shared data folder, one row per jet: 537 × 40) less its constant columns (the original's min-max
normalisation divides them by zero, and the NaN reaches every restored value through the network), written
once as Baler's plain ``.npz`` (``data`` float64 + ``names``) that both tools read. Models: the original with its CMS example config (AE, compression ratio 1.6,
float64, batch 512, Adam 1e-3, early stopping / LR schedule, ``--epochs``), through
``benchmarks/baler_original_wrapper.py`` (unchanged code, own venv); ours with ``configs/cms_ae.yaml`` +
``configs/baler_parity.yaml`` (the same AE and settings, float64, ``--epochs``). Each tool compresses its own
model twice: without corrections and with a 10 % relative bound (the original: ``error_bounded_requirement =
10``; the same trained ``model.pt`` reused, ``--reuse-output``), then decompresses.

Reported per tool and run: the share of values over the bound in the restored file, in physical units, two
ways: ``over``: ``|restored − x| > 0.1·|x|`` over all values (a 0 must come back as 0), and ``over≠0``: the
same among values ``x ≠ 0`` (the original's own criterion skips zeros); the corrections' bytes; the bytes a
user needs to decompress (original: ``compressed.npz`` + ``model.pt`` + the two delta files; ours: the
``.baler`` file, latent stored as float16, its default); and the original data's size in its column dtypes.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/baler_corrections.py [--epochs 200] [--bound 0.1]``
(a few minutes). ``--baler-original`` / ``--original-python`` as in ``baler_speed.py``. Writes
``benchmarks/results/baler_corrections.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baler_speed import (  # noqa: E402
    DEFAULT_ORIGINAL, DEFAULT_ORIGINAL_PYTHON, ORIGINAL_CMS, REPO, SHARED_DATA, Original, baler_lit_cli, run_process,
)  # fmt: skip

RESULT = REPO / "benchmarks" / "results" / "baler_corrections.json"
NANOAOD_NAME = "nanoAOD_2015_CMS_Open_Data_ttbar.root"
NANOAOD = next((d / NANOAOD_NAME for d in (SHARED_DATA, Path("/work/shared/data")) if (d / NANOAOD_NAME).exists()),
               SHARED_DATA / NANOAOD_NAME)  # fmt: skip
ORIGINAL_DELTA_FILES = ("compressed_deltas.npz.gz", "compressed_batch_index_metadata.npz.gz")


def over_bound(restored: np.ndarray, original: np.ndarray, bound: float) -> dict[str, float]:
    """Share of values whose error exceeds ``bound`` × |value|: over all values, and over the non-zero ones."""
    x = original.reshape(len(original), -1)
    restored = restored.reshape(x.shape)
    miss = ~(np.abs(restored - x) <= bound * np.abs(x))  # a NaN or inf restored value is over the bound too
    nonzero = x != 0
    lo, span = x.min(axis=0), np.ptp(x, axis=0)  # the original's criterion: min-max normalised values
    xn, rn = (x - lo) / span, (restored - lo) / span
    miss_n = ~(np.abs(rn - xn) <= bound * np.abs(xn))
    return {"over": float(miss.mean()), "over_nonzero": float(miss[nonzero].mean()),
            "over_normalised_nonzero": float(miss_n[xn != 0].mean()), "zeros": float(1 - nonzero.mean()),
            "non_finite": int((~np.isfinite(restored)).sum())}  # fmt: skip


def original_side(original: Original, data: Path, x: np.ndarray, epochs: int, bound: float) -> dict:
    config = {**ORIGINAL_CMS, "epochs": epochs}
    plain = original.run(data, config, phases="train,compress,decompress")
    output = Path(plain["workspace"]) / "workspaces" / "bench" / "run" / "output"
    bounded = original.run(data, {**config, "save_error_bounded_deltas": True,
                                  "error_bounded_requirement": 100 * bound},
                           phases="compress,decompress", reuse_output=output)  # fmt: skip
    rows = {}
    for name, run in (("plain", plain), ("bounded", bounded)):
        restored = np.load(run["decompressed_path"])["data"]
        out = Path(run["decompressed_path"]).parents[1] / "compressed_output"
        deltas = sum((out / f).stat().st_size for f in ORIGINAL_DELTA_FILES if (out / f).exists())
        rows[name] = {**over_bound(restored, x, bound), "corrections_bytes": deltas,
                      "file_bytes": run["compressed_bytes"] + run["model_bytes"] + deltas}  # fmt: skip
    rows["loss"] = plain["losses"][-1]
    rows["epochs_run"] = len(plain["losses"])
    return rows


def ours_side(data: Path, x: np.ndarray, epochs: int, bound: float, tmp: Path) -> dict:
    from baler_lit.checkpoint import adopt_training_dtypes, load_checkpoint
    from baler_lit.compression import compress, decompress
    from baler_lit.error_bound import ErrorBound
    from baler_lit.row_source import open_rows

    root = tmp / "ours"
    run_process(baler_lit_cli("fit", "--config", str(REPO / "configs" / "cms_ae.yaml"), "--config",
                              str(REPO / "configs" / "baler_parity.yaml"), "--data.path", str(data),
                              "--trainer.default_root_dir", str(root), "--trainer.max_epochs", str(epochs)))  # fmt: skip
    ckpt = next(root.glob("lightning_logs/version_*/checkpoints/best.ckpt"))
    trained = load_checkpoint(ckpt)
    rows = {}
    for name, error_bound in (("plain", None), ("bounded", ErrorBound(relative=bound))):
        source = open_rows(data)
        adopt_training_dtypes(source, trained.column_dtypes)
        result = compress(trained.model, trained.normalizer, source, tmp / f"{name}.baler",
                          error_bound=error_bound)  # fmt: skip
        restored = decompress(tmp / f"{name}.baler").data
        rows[name] = {**over_bound(restored, x, bound), "corrections_bytes": result.corrections_bytes,
                      "file_bytes": result.file_bytes, "original_bytes": result.original_bytes}  # fmt: skip
    metrics = sorted(root.glob("lightning_logs/version_*/energy_report.json"))
    rows["epochs_run"] = len(json.loads(metrics[-1].read_text())["epochs"]) if metrics else None
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baler-original", type=Path, default=DEFAULT_ORIGINAL)
    p.add_argument("--original-python", type=Path, default=DEFAULT_ORIGINAL_PYTHON)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--bound", type=float, default=0.1, help="relative bound (fraction; the original's percent / 100)")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)
    from machine import machine_info, write_json_atomic

    from baler_lit.sources import load_root
    from baler_lit.table import Table

    if not NANOAOD.exists():
        raise SystemExit(f"{NANOAOD} not found (set BALER_LIT_DATA)")
    original = Original(args.baler_original, args.original_python)
    jets = load_root(NANOAOD, prefix="Jet_")
    constant = np.ptp(jets.data, axis=0) == 0
    # the original's min-max divides constant columns by 0: NaN in every restored value; they are left out
    table = Table(np.ascontiguousarray(jets.data[:, ~constant]), names=[n for n, c in zip(jets.names, constant) if not c],
                  dtypes=[d for d, c in zip(jets.dtypes, constant) if not c], source=jets.source)  # fmt: skip
    results: dict = {"benchmark": "baler_corrections", "data": f"{NANOAOD.name} Jet_* ({table.n_rows} x "
                     f"{table.n_columns})", "epochs": args.epochs, "bound": args.bound,
                     "original_note": original.note,
                     "constant_columns_left_out": [n for n, c in zip(jets.names, constant) if c]}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="baler_corrections_") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "jets.npz"
        np.savez(data, data=table.data, names=np.array(table.names))  # Baler's plain layout, float64
        results["ours"] = ours_side(data, table.data, args.epochs, args.bound, tmp)
        if original:
            results["original"] = original_side(original, data, table.data, args.epochs, args.bound)
    results["original_bytes"] = table.original_nbytes
    print_table(results)
    results["machine"] = machine_info(threads=1)
    write_json_atomic(args.out, results)
    print(f"written {args.out}")
    return 0


def print_table(r: dict) -> None:
    pct = 100 * r["bound"]
    print(f"\n{r['data']} less {len(r['constant_columns_left_out'])} constant columns, {r['epochs']} epochs, bound {pct:g} % relative; original data {r['original_bytes']} bytes")
    print(f"{'tool':<12} {'corrections':<11} {'over %':>7} {'over≠0 %':>9} {'norm≠0 %':>9} {'corr. bytes':>11}"
          f" {'file bytes':>10} {'ratio':>6}")  # fmt: skip
    for tool in ("original", "ours"):
        if tool not in r:
            continue
        for name in ("plain", "bounded"):
            row = r[tool][name]
            print(f"{tool:<12} {'no' if name == 'plain' else 'yes':<11} {100 * row['over']:7.2f}"
                  f" {100 * row['over_nonzero']:9.2f} {100 * row['over_normalised_nonzero']:9.2f}"
                  f" {row['corrections_bytes']:11d} {row['file_bytes']:10d}"
                  f" {r['original_bytes'] / row['file_bytes']:6.3f}")  # fmt: skip
        added = r[tool]["bounded"]["file_bytes"] - r[tool]["plain"]["file_bytes"]
        print(f"{'':<12} the corrections add {added:+d} bytes; epochs run {r[tool]['epochs_run']}")
    print("over: |restored - x| > bound*|x| among all values (a zero must come back exactly); over≠0: among x != 0"
          " (the original skips zeros); norm≠0: the original's criterion, on min-max normalised values; file bytes: what decompressing needs (original: compressed.npz + model.pt"
          " + delta files; ours: the .baler file, float16 latent)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
