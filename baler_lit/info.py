"""What a ``.baler`` file holds (``baler-lit info``): columns, rows, model, the size of each part, the ratio,
the round-trip error measured at compression, constant columns and error-bound corrections.

The file is verified as ``decompress`` verifies it (every header field, the checksum over every byte; the
fields only a summary reads too: :func:`~baler_lit.file_format.check_summary_fields`), but
nothing is decoded and the latent codes are not kept in memory, so ``info`` is quick and its memory does
not grow with the row count. Lightning is never imported.
"""

from __future__ import annotations

import math
import os
import zipfile
from typing import Any

import numpy as np

from .compressed_file import CompressedFile, read_compressed
from .error_bound import ErrorBound
from .file_format import HEADER, array_entry, check_summary_fields

#: Columns listed one per line in the text output before the rest are summarised.
LISTED_COLUMNS = 40
#: (array name prefix, the part of the file it belongs to), for the sizes of the parts.
PARTS = (("latent", "latent"), ("decoder.", "decoder"), ("constant_", "constant columns"),
         ("corrections_", "corrections"))  # fmt: skip


def file_info(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON-ready description of the verified ``.baler`` file at ``path`` (sizes in bytes)."""
    compressed = read_compressed(path, stream_latent=True)
    h = compressed.header
    check_summary_fields(h, compressed.path)
    sizes = {"latent": 0, "decoder": 0, "normalisation and ranges": 0, "constant columns": 0, "corrections": 0}
    with zipfile.ZipFile(compressed.path) as zf:  # bytes on disk (deflated entries with --extra-compression)
        for name in h["arrays"]:
            sizes[_part(name)] += zf.getinfo(array_entry(name)).compress_size
        sizes["header"] = zf.getinfo(HEADER).compress_size
    file_bytes = compressed.file_bytes
    sizes["archive directory and entry headers"] = file_bytes - sum(sizes.values())
    n_values = h["n_rows"] * math.prod(h["sample_shape"])
    corrections = h.get("corrections")
    return {
        "path": str(compressed.path),
        "format_version": h["format_version"],
        "written_by": f"baler-lit {h.get('library_version')}",
        "rows": h["n_rows"],
        "sample_shape": h["sample_shape"],
        "frames": h["frames"],
        "columns": _columns(compressed),
        "model": {k: h["model"][k] for k in ("name", "dtype", "latent_dim", "input_shape")},
        "latent_dtype": h["latent_dtype"],
        "original_bytes": h["original_bytes"],
        "file_bytes": file_bytes,
        "ratio": h["original_bytes"] / file_bytes,
        "parts_bytes": sizes,
        "roundtrip_error": h.get("roundtrip"),
        "constant_columns": (h.get("constants") or {}).get("count", 0),  # absent in format version 1
        "corrections": None if corrections is None else {
            "relative_bound": corrections["relative"],
            "absolute_bound": corrections["absolute"],
            "count": corrections["count"],
            "share_of_values": corrections["count"] / n_values,
            "bytes": sizes["corrections"],
        },
    }  # fmt: skip


def _part(array_name: str) -> str:
    """The part of the file an array belongs to (its name's prefix; the rest: normalisation and ranges)."""
    return next((part for prefix, part in PARTS if array_name.startswith(prefix)), "normalisation and ranges")


def _columns(compressed: CompressedFile) -> list[dict[str, Any]]:
    h = compressed.header
    constant = {}
    if "constant_index" in compressed.arrays:
        constant = dict(zip(compressed.arrays["constant_index"].tolist(), compressed.arrays["constant_value"].tolist()))
    if h["frames"]:
        return [{"name": f"frame {'x'.join(map(str, h['sample_shape']))}", "dtype": h["dtypes"][0],
                 "constant_positions": len(constant)}]  # fmt: skip
    lo, hi = compressed.arrays["data_min"], compressed.arrays["data_max"]
    out = []
    for j, (name, dtype) in enumerate(zip(h["names"], h["dtypes"])):
        row: dict[str, Any] = {"name": name, "dtype": dtype, "min": float(lo[j]), "max": float(hi[j])}
        if j in constant:
            row["constant"] = constant[j]
        out.append(row)
    return out


def format_info(info: dict[str, Any]) -> str:
    """The description of :func:`file_info` as text."""
    shape = "x".join(map(str, info["sample_shape"]))
    model = info["model"]
    lines = [
        f"{info['path']}: format version {info['format_version']}, written by {info['written_by']}",
        f"rows: {info['rows']} of {'frames' if info['frames'] else 'columns'} {shape}",
        f"model: {model['name']} ({model['dtype']}), latent {model['latent_dim']} x {info['latent_dtype']}",
        f"size: {info['file_bytes']} bytes (original {info['original_bytes']} bytes), ratio {info['ratio']:.3f}",
    ]
    for part, nbytes in info["parts_bytes"].items():
        if nbytes:
            lines.append(f"  {part:<38} {nbytes:>14} bytes  {100 * nbytes / info['file_bytes']:5.1f} %")
    rt = info["roundtrip_error"]
    if rt and rt.get("rows"):
        lines.append(f"round-trip error measured at compression on {rt['rows']} rows: mean normalised RMS"
                     f" {rt['mean_norm_rms']:.4g}, worst column {rt['max_norm_rms']:.4g}")  # fmt: skip
    lines.append(f"constant columns (stored exactly): {info['constant_columns']}")
    corr = info["corrections"]
    if corr is None:
        lines.append("error bound: none (no corrections stored)")
    else:
        bound = ErrorBound(corr["relative_bound"], corr["absolute_bound"]).describe()
        lines.append(f"error bound: {bound}, guaranteed for every value: {corr['count']} values"
                     f" corrected ({100 * corr['share_of_values']:.3g} %), {corr['bytes']} bytes")  # fmt: skip
    columns = info["columns"]
    lines.append("columns:")
    for col in columns[:LISTED_COLUMNS]:
        extra = f" constant {col['constant']!r}" if "constant" in col else ""
        if "min" in col and "constant" not in col:
            extra = f" range [{_num(col['min'])}, {_num(col['max'])}]"
        if "constant_positions" in col:
            extra = f", {col['constant_positions']} constant positions"
        lines.append(f"  {col['name']} ({col['dtype']}){extra}")
    if len(columns) > LISTED_COLUMNS:
        lines.append(f"  ... {len(columns) - LISTED_COLUMNS} more (--json lists all)")
    return "\n".join(lines)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else f"{np.float64(value):.6g}"
