"""The ``.baler`` compressed file: everything decompression needs, in one self-contained file.

Layout: a zip archive, its entries stored (or all deflated with ``extra_compression``, Baler's option of that
name), with

- ``header.json``: magic, format and library versions, the model description (name, input shape, latent
  size, dtype, extra arguments), the training configuration, the column names and original dtypes, the row
  count, the latent dtype, an index of the arrays (dtype, shape, byte size) and a SHA-256 checksum;
- ``arrays/<name>.bin``: raw little-endian bytes of each array: ``latent`` (``n_rows × latent_dim``), the
  decoder's parameters and buffers (``decoder.<name>``), ``norm_min`` and ``norm_scale`` (the model's
  normalisation) and ``data_min``/``data_max`` (per-column range of the compressed data, used to clip
  restored integer columns and to choose the restored array's dtype); from format version 2, when used,
  ``constant_index``/``constant_value`` (sample positions whose value never changes, restored exactly) and
  ``corrections_index``/``corrections_value`` (error-bound corrections, :mod:`baler_lit.error_bound`).

Nothing is unpickled on load: arrays are rebuilt from raw bytes with the dtype and shape in the header,
after :mod:`baler_lit.file_format` has checked every field against a whitelist and against the sizes the
archive actually holds; the model described by the header is first built on PyTorch's ``meta`` device and
compared with the stored decoder, so no header field can make the reader allocate more than the file
justifies. ``bfloat16`` latents are stored as their 16-bit patterns. The checksum covers the header
(without the checksum field) and every array and is verified while the arrays stream in, before any is
used; zip's per-entry CRC-32 catches damaged bytes too. What is written is validated too: every restored
value, constant columns and corrections included, must be finite and fit its column's dtype, when
``compress`` writes the file and when ``decompress`` restores it. Files are written to a private temporary
file and renamed, so an interrupted write never leaves a partial ``.baler`` file; the temporary files of a
killed writer are removed by the next ``compress`` or ``decompress`` writing into the folder
(:func:`~baler_lit.table.remove_stale_temp_files`).

``compress`` refuses what it cannot restore: latent codes that are not finite in the chosen latent dtype
(input far outside the training range overflows float16) stop it; input outside the checkpoint's
normalisation range by more than ``NORM_RANGE_MARGIN`` gives a warning (an error with ``strict``); and it
decodes a sample of the rows it just encoded and reports their round-trip error.

Compression and decompression process rows in fixed-size chunks (:func:`chunk_rows`; compress decodes the
same chunks decompress will, so error-bound checks see the values decompress produces). ``compress`` reads
its input block by block (:mod:`baler_lit.row_source`), spools the latent codes and corrections to private
temporary files and assembles the archive at the end (header first, its checksum computed over the spooled
bytes); :func:`decompress_to_file` verifies the file, then decodes chunk by chunk into the output ``.npz``.
Time grows linearly with the rows, memory does not grow with them (``benchmarks/baler_stream.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import __version__
from .error_bound import SLACK_ULPS, CorrectionWriter, ErrorBound, out_of_bound
from .errors import BalerInputError
from .file_format import (
    CORRECTION_ARRAYS,
    FORMAT_VERSION,
    HEADER,
    LATENT_DTYPES,
    MAGIC,
    array_entry,
    canonical_header,
    checksum,
)
from .models import BalerAutoencoder
from .normalization import MinMaxNormalizer
from .compressed_file import (  # noqa: F401  (MODEL_*: named here for older callers)
    MODEL_SIZE_FACTOR, MODEL_SLACK_BYTES, CompressedFile, _numpy_dtype, read_compressed,
)
from .row_source import RowSource, as_row_source
from .table import DtypeRestorer, Table, atomic_output, npz_writer, prepare_output, write_npz

#: Rows per chunk when encoding/decoding. Small chunks keep the activations in cache and let the allocator
#: reuse their buffers (32k-row chunks measured ~2x slower here, mostly page faults on fresh buffers).
CHUNK_ROWS = 4096
#: Cap on input values per chunk, so chunks of large samples (frames) stay small too.
CHUNK_VALUES = 2**17
#: How far (in units of a column's training range) normalised input may lie outside [0, 1] before
#: ``compress`` warns (or, with ``strict``, refuses): the model never saw such values and may not restore them.
NORM_RANGE_MARGIN = 0.1
#: Rows decoded right after compressing to measure the round-trip error (evenly spread over the table).
ROUNDTRIP_ROWS = 4096
#: Bytes copied per step when spooled arrays are hashed and written into the archive.
COPY_BYTES = 2**20


_checksum = checksum  # the name the tests and older callers use


def _json_ready(value: Any) -> Any:
    """Convert tuples/numpy scalars inside ``value`` to JSON types."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def chunk_rows(sample_shape: tuple[int, ...] | list[int]) -> int:
    """Rows per encode/decode chunk for samples of ``sample_shape``."""
    return max(1, min(CHUNK_ROWS, CHUNK_VALUES // int(np.prod(sample_shape))))


@contextlib.contextmanager
def inference(model: nn.Module) -> Iterator[None]:
    """Eval mode, no autograd, and in-place activations (no fresh buffer per layer) for the block."""
    acts = [m for m in model.modules() if isinstance(m, (nn.LeakyReLU, nn.ReLU)) and not m.inplace]
    was_training = model.training
    model.eval()
    for m in acts:
        m.inplace = True
    try:
        with torch.inference_mode():
            yield
    finally:
        for m in acts:
            m.inplace = False
        model.train(was_training)


@dataclass
class CompressionResult:
    """Summary of one compression: sizes in bytes, ratio = original bytes / file bytes, time in seconds.

    ``roundtrip_*``: the error measured by decoding ``roundtrip_rows`` of the rows just compressed, as the
    file restores them: per column RMS(restored − original) / the column's range, averaged over the columns
    (``mean``) and the worst column (``max``); dimensionless. ``warnings``: lines the caller should show.
    ``constant_columns``: sample positions stored exactly in the file (not through the network);
    ``corrections``: values replaced by their originals to meet ``error_bound`` (0 without a bound),
    ``corrections_bytes`` what storing them costs in the file; ``n_values``: rows × values per sample.
    """

    path: Path
    n_rows: int
    latent_dim: int
    latent_dtype: str
    original_bytes: int
    file_bytes: int
    latent_bytes: int
    seconds: float
    roundtrip_rows: int = 0
    roundtrip_mean_norm_rms: float = float("nan")
    roundtrip_max_norm_rms: float = float("nan")
    warnings: list[str] = field(default_factory=list)
    constant_columns: int = 0
    error_bound: ErrorBound | None = None
    corrections: int = 0
    corrections_bytes: int = 0
    n_values: int = 0

    @property
    def ratio(self) -> float:
        return self.original_bytes / self.file_bytes

    @property
    def corrected_share(self) -> float:
        """Fraction of all values replaced by a correction."""
        return self.corrections / self.n_values if self.n_values else 0.0


@dataclass
class _Scan:
    """Per sample position, the smallest and largest physical value of the input (float64, sample shape)."""

    low: np.ndarray
    high: np.ndarray


def _scan(rows: RowSource) -> _Scan:
    low = np.full(rows.sample_shape, np.inf)
    high = np.full(rows.sample_shape, -np.inf)
    for _, block in rows.blocks():
        np.minimum(low, block.min(axis=0), out=low)
        np.maximum(high, block.max(axis=0), out=high)
    return _Scan(low, high)


class _RoundTrip:
    """Accumulates RMS(restored − original) per column over evenly spread sample rows (see compress)."""

    def __init__(self, n_rows: int, width: int) -> None:
        self.rows = np.unique(np.linspace(0, n_rows - 1, min(n_rows, ROUNDTRIP_ROWS)).round().astype(np.intp))
        self.width = width
        self.squares = np.zeros(width)
        self.count = 0

    def in_block(self, start: int, n: int) -> np.ndarray:
        """Indices (within the block) of the sample rows in rows ``start .. start + n − 1``."""
        lo, hi = np.searchsorted(self.rows, [start, start + n])
        return self.rows[lo:hi] - start

    def add(self, restored: np.ndarray, original: np.ndarray, source: str) -> None:
        if not np.isfinite(restored).all():
            raise BalerInputError(
                f"decoding the latent codes of {source} gives non-finite values: the file could not be restored"
            )
        diff = (restored - original).reshape(-1, self.width)
        self.squares += np.einsum("ij,ij->j", diff, diff)
        self.count += len(diff)

    def errors(self, span: np.ndarray) -> tuple[float, float]:
        rms = np.sqrt(self.squares / max(self.count, 1))
        error = np.where(span > 0, rms / np.where(span > 0, span, 1.0), rms)
        return float(error.mean()), float(error.max())


def compress(
    model: BalerAutoencoder,
    normalizer: MinMaxNormalizer,
    table: Table | RowSource,
    output: str | os.PathLike,
    latent_dtype: str = "float32",
    config: dict[str, Any] | None = None,
    overwrite: bool = False,
    strict: bool = False,
    error_bound: ErrorBound | None = None,
    extra_compression: bool = False,
) -> CompressionResult:
    """Encode ``table`` with ``model`` and write a self-contained ``.baler`` file to ``output``.

    Refuses (:class:`BalerInputError`, nothing written) latent codes that are not finite in
    ``latent_dtype``. Input that lies outside the normaliser's range by more than ``NORM_RANGE_MARGIN``
    of a column's range gives a line in ``result.warnings``, or an error with ``strict``. The result holds
    the round-trip error measured by decoding up to ``ROUNDTRIP_ROWS`` of the rows just encoded.

    The input is read block by block twice (its ranges, then the encoding), the latent codes and the
    corrections are spooled to private temporary files and the ``.baler`` is assembled at the end, so
    memory does not grow with the row count (a :class:`~baler_lit.row_source.RowSource` streams from disk).
    Sample positions whose value never changes are stored exactly (``constant_columns``), and with
    ``error_bound`` every value the network restores worse than the bound is stored exactly too
    (see :mod:`baler_lit.error_bound`).

    Args:
        model: trained autoencoder; its decoder is stored in the file.
        normalizer: the normaliser the model was trained with.
        table: data to compress (a Table or a row source); its sample shape must match the model's input shape.
        output: target path; must not exist unless ``overwrite``.
        latent_dtype: ``"float64"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        config: training configuration to record in the header (JSON types).
        strict: refuse input outside the normalisation range instead of warning.
        error_bound: largest error allowed for every restored value (``None``: no guarantee).
        extra_compression: deflate every entry of the archive (Baler's ``extra_compression``; the reader bounds
            the inflated sizes before inflating, see :mod:`baler_lit.file_format`); otherwise entries are stored.
    """
    start_time = time.perf_counter()
    rows = as_row_source(table)
    if latent_dtype not in LATENT_DTYPES:
        raise BalerInputError(f"latent dtype must be one of {sorted(LATENT_DTYPES)}, got {latent_dtype!r}")
    if tuple(rows.sample_shape) != tuple(model.input_shape):
        raise BalerInputError(
            f"column-count mismatch: the model expects samples of shape {tuple(model.input_shape)},"
            f" {rows.source} has {tuple(rows.sample_shape)}"
        )
    if np.shape(normalizer.minimum) not in ((1,), tuple(model.input_shape)):
        raise BalerInputError(
            f"normalisation of shape {np.shape(normalizer.minimum)} does not fit samples {tuple(model.input_shape)}"
        )
    out = prepare_output(output, overwrite)
    scan = _scan(rows)
    warnings = [] if normalizer.is_identity else _range_warnings(  # raw values (apply_normalization False) have no
        (scan.low - normalizer.minimum) / normalizer.scale,    # training range to leave
        (scan.high - normalizer.minimum) / normalizer.scale, rows, strict)  # fmt: skip
    if rows.is_frames:
        data_min, data_max = np.array([scan.low.min()]), np.array([scan.high.max()])
    else:
        data_min, data_max = scan.low.astype(np.float64), scan.high.astype(np.float64)
    constants = Constants.of(scan)
    restorer = DtypeRestorer(rows.dtypes, rows.is_frames, data_min, data_max)
    value_dtype = "<f4" if restorer.storage == np.float32 else "<f8"
    param = next(model.parameters())
    with contextlib.ExitStack() as stack:
        latent_file = stack.enter_context(tempfile.TemporaryFile(dir=out.parent))
        writer = None
        if error_bound is not None:
            writer = CorrectionWriter(value_dtype, out.parent)
            stack.callback(writer.close)
        roundtrip = _RoundTrip(rows.n_rows, 1 if rows.is_frames else rows.n_columns)
        not_finite = _encode(model, normalizer, rows, latent_dtype, latent_file, restorer, constants, roundtrip,
                             error_bound, writer)  # fmt: skip
        if not_finite:
            wider = {"float16": "bfloat16 or float32", "bfloat16": "float32"}.get(latent_dtype)
            hint = f"; use --latent-dtype {wider}" if wider else ""
            cause = f" ({warnings[0]})" if warnings else ""
            total = rows.n_rows * model.latent_dim
            raise BalerInputError(
                f"{not_finite} of {total} latent codes ({100 * not_finite / total:.1f} %) are not finite"
                f" in {latent_dtype}, so the file could not be restored{hint}{cause}"
            )
        arrays: dict[str, np.ndarray] = {}
        for name, t in model.decoder.state_dict().items():
            arrays[f"decoder.{name}"] = _tensor_to_numpy(t)
        arrays.update(normalizer.to_arrays())
        arrays["data_min"], arrays["data_max"] = data_min, data_max
        arrays.update(constants.to_arrays())
        latent_spec = (latent_file, latent_file.tell(), LATENT_DTYPES[latent_dtype][1].str,
                       [rows.n_rows, model.latent_dim])  # fmt: skip
        latent_file.seek(0)
        spilled = {"latent": latent_spec}
        corrections = None
        if writer is not None:
            index_fh, index_bytes, value_fh, value_bytes = writer.finish()
            spilled["corrections_index"] = (index_fh, index_bytes, "|u1", [index_bytes])
            spilled["corrections_value"] = (value_fh, value_bytes, "|u1", [value_bytes])
            corrections = {**error_bound.to_header(), "count": writer.count, "value_dtype": value_dtype,
                           "slack_ulps": SLACK_ULPS}  # fmt: skip
        mean_error, max_error = roundtrip.errors((data_max - data_min).reshape(-1)[: roundtrip.width])
        header: dict[str, Any] = {
            "magic": MAGIC,
            "format_version": FORMAT_VERSION,
            "library_version": __version__,
            "model": {
                "name": type(model).__name__,
                "input_shape": list(model.input_shape),
                "latent_dim": model.latent_dim,
                "dtype": str(param.dtype).removeprefix("torch."),
                "kwargs": _json_ready(getattr(model, "build_kwargs", {})),
            },
            "config": _json_ready(config or {}),
            "latent_dtype": latent_dtype,
            "n_rows": rows.n_rows,
            "sample_shape": list(rows.sample_shape),
            "frames": rows.is_frames,
            "names": list(rows.names),
            "dtypes": list(rows.dtypes),
            "original_bytes": rows.original_nbytes,
            "roundtrip": {"rows": len(roundtrip.rows), "mean_norm_rms": mean_error, "max_norm_rms": max_error},
            "constants": {"count": constants.count},
            "corrections": corrections,
            "arrays": {
                **{k: {"dtype": v.dtype.str, "shape": list(v.shape), "nbytes": int(v.nbytes)} for k, v in arrays.items()},
                **{k: {"dtype": dtype, "shape": shape, "nbytes": nbytes} for k, (_, nbytes, dtype, shape) in spilled.items()},
            },  # fmt: skip
        }
        header["checksum_sha256"] = _spilled_checksum(header, arrays, spilled)
        with atomic_output(out, overwrite) as fh_out:
            method = zipfile.ZIP_DEFLATED if extra_compression else zipfile.ZIP_STORED
            with zipfile.ZipFile(fh_out, "w", compression=method) as zf:
                zf.writestr(HEADER, json.dumps(header, indent=1))
                for name, arr in arrays.items():
                    with zf.open(array_entry(name), "w", force_zip64=arr.nbytes > 2**31) as fh:
                        fh.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
                for name, (spool, nbytes, _, _) in spilled.items():
                    spool.seek(0)
                    with zf.open(array_entry(name), "w", force_zip64=nbytes > 2**31) as fh:
                        shutil.copyfileobj(spool, fh, COPY_BYTES)
    return CompressionResult(
        path=out,
        n_rows=rows.n_rows,
        latent_dim=model.latent_dim,
        latent_dtype=latent_dtype,
        original_bytes=rows.original_nbytes,
        file_bytes=out.stat().st_size,
        latent_bytes=latent_spec[1],
        seconds=time.perf_counter() - start_time,
        roundtrip_rows=len(roundtrip.rows),
        roundtrip_mean_norm_rms=mean_error,
        roundtrip_max_norm_rms=max_error,
        warnings=warnings,
        constant_columns=constants.count,
        error_bound=error_bound,
        corrections=writer.count if writer else 0,
        corrections_bytes=sum(spilled[k][1] for k in CORRECTION_ARRAYS if k in spilled),
        n_values=rows.n_rows * rows.n_columns,
    )


def _encode(model, normalizer, rows: RowSource, latent_dtype: str, latent_file, restorer: DtypeRestorer,
            constants: Constants, roundtrip: _RoundTrip, bound: ErrorBound | None,
            writer: CorrectionWriter | None) -> int:  # fmt: skip
    """The encoding pass of :func:`compress`: latent bytes to ``latent_file``; each block decoded as
    :func:`decode_blocks` will (same chunks, same dtypes) for the round-trip sample and, with ``bound``, for
    every row, whose out-of-bound values go to ``writer``. Returns the count of non-finite latent codes."""
    torch_latent = getattr(torch, LATENT_DTYPES[latent_dtype][0])
    param = next(model.parameters())
    np_model = _numpy_dtype(param.dtype)
    positions = rows.n_columns
    slack = None
    if bound is not None:
        scale = np.broadcast_to(normalizer.scale, rows.sample_shape).reshape(positions)
        slack = SLACK_ULPS * float(torch.finfo(param.dtype).eps) * scale
    not_finite = 0
    with inference(model):
        for start, block in rows.blocks(chunk_rows(rows.sample_shape)):
            z = model.encode(torch.from_numpy(normalizer.transform(block, np_model)).to(param.device)).to(torch_latent)
            bad = int(z.numel() - torch.isfinite(z).sum())
            not_finite += bad
            if not_finite:
                continue  # the file will be refused: only count the rest
            latent_file.write(memoryview(np.ascontiguousarray(_tensor_to_numpy(z))).cast("B"))
            sample = roundtrip.in_block(start, len(block))
            where = f"{rows.source}: rows {start}..{start + len(block) - 1} as the file would restore them"
            if bound is None:
                if len(sample):  # the constants are in every row: a sample shows whether they fit their dtypes
                    restored = _decode_values(model, z[torch.from_numpy(sample)], normalizer, restorer, constants)
                    roundtrip.add(restored, block[sample], rows.source)
                    restorer.check_fits(restored, rows.names, where)
                continue
            restored = _decode_values(model, z, normalizer, restorer, constants)
            flat, original = restored.reshape(len(block), positions), block.reshape(len(block), positions)
            if not np.isfinite(flat).all():
                roundtrip.add(restored, block, rows.source)  # raises: non-finite restored values
            mask = out_of_bound(flat, original, bound, slack)
            r, c = np.nonzero(mask)  # row-major: flat indices increase
            writer.add((start + r) * positions + c, original[r, c])
            flat[r, c] = original[r, c]
            restorer.check_fits(restored, rows.names, where)
            roundtrip.add(restored[sample], block[sample], rows.source)
    return not_finite


def _decode_values(model, z: torch.Tensor, normalizer: MinMaxNormalizer, restorer: DtypeRestorer | None,
                   constants: Constants | None) -> np.ndarray:  # fmt: skip
    """Stored latent codes → restored physical float64 values: decoded, denormalised, rounded to the column
    dtypes (``restorer``) and constant positions set (``constants``)."""
    param = next(model.parameters())
    values = _restore_chunk(model.decode(z.to(device=param.device, dtype=param.dtype)).cpu().numpy(), normalizer,
                            restorer)  # fmt: skip
    if constants is not None:
        constants.apply(values)
    return values


@dataclass
class Constants:
    """Sample positions (flat index into a sample) whose value never changes, and those values (float64)."""

    index: np.ndarray
    value: np.ndarray

    @classmethod
    def of(cls, scan: _Scan) -> Constants:
        index = np.flatnonzero(scan.low.reshape(-1) == scan.high.reshape(-1)).astype("<i8")
        return cls(index, scan.low.reshape(-1)[index].astype("<f8"))

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Constants:
        empty = np.empty(0)
        return cls(arrays.get("constant_index", empty.astype("<i8")), arrays.get("constant_value", empty))

    @property
    def count(self) -> int:
        return len(self.index)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"constant_index": self.index, "constant_value": self.value} if self.count else {}

    def apply(self, values: np.ndarray) -> None:
        """Set the constant positions of ``values`` (``(rows, *sample_shape)``, float64) in place."""
        if self.count:
            values.reshape(len(values), -1)[:, self.index] = self.value


def _spilled_checksum(header: dict[str, Any], arrays: dict[str, np.ndarray], spilled: dict[str, tuple]) -> str:
    """:func:`~baler_lit.file_format.checksum` over in-memory ``arrays`` and ``spilled`` temporary files."""
    digest = hashlib.sha256(canonical_header(header))
    for name in sorted([*arrays, *spilled]):
        digest.update(name.encode())
        if name in arrays:
            digest.update(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))
            continue
        spool = spilled[name][0]
        spool.seek(0)
        while chunk := spool.read(COPY_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _range_warnings(low: np.ndarray, high: np.ndarray, table: Table, strict: bool) -> list[str]:
    """A line when normalised input leaves [0, 1] by more than ``NORM_RANGE_MARGIN``; an error if ``strict``.

    ``low``/``high``: per sample position, the smallest and largest normalised input value.
    """
    beyond = np.maximum(-low, high - 1.0)
    worst = int(np.argmax(beyond))
    excess = float(beyond.flat[worst])
    if not excess > NORM_RANGE_MARGIN:
        return []
    where = f"column {table.names[worst]!r}" if not table.is_frames else f"pixel {np.unravel_index(worst, low.shape)}"
    outside = int(np.count_nonzero(beyond > NORM_RANGE_MARGIN))
    line = (
        f"{table.source} lies outside the checkpoint's normalisation range by up to {excess:.3g} x a column's"
        f" training range ({where}; {outside} of {beyond.size} positions beyond the {NORM_RANGE_MARGIN:g} margin):"
        " the model never saw such values and may restore them badly"
    )
    if strict:
        raise BalerInputError(line + " (refused: --strict)")
    return [line]


def _restore_chunk(normalised: np.ndarray, norm: MinMaxNormalizer, restorer: DtypeRestorer | None) -> np.ndarray:
    """Decoder output (normalised) → physical float64 values, rounded to the column dtypes if ``restorer``."""
    chunk = normalised.astype(np.float64)
    chunk *= norm.scale
    chunk += norm.minimum
    if restorer is not None:
        restorer.apply(chunk)
    return chunk


def decode_blocks(
    compressed: CompressedFile, latent_dtype: str | None = None, restore: bool = True
) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, float64 values)`` for consecutive chunks of :func:`chunk_rows` rows, from latent to final
    values: decoded, denormalised and, with ``restore``, rounded to the column dtypes, constant columns set and
    the corrections applied (see :func:`decode`). Reads a file opened with ``stream_latent`` block by block;
    raises :class:`BalerInputError` when its bytes are not those verified at opening, and, with ``restore``,
    when a final value (constants and corrections included) does not fit its column's dtype: not finite, not a
    whole number in an integer column, outside the dtype's range (:meth:`DtypeRestorer.check_fits`)."""
    model = compressed.decoder_model()
    norm = compressed.normalizer()
    h = compressed.header
    if latent_dtype is not None and latent_dtype not in LATENT_DTYPES:
        raise BalerInputError(f"latent dtype must be one of {sorted(LATENT_DTYPES)}, got {latent_dtype!r}")
    restorer = constants = None
    if restore:  # integer columns are clipped to the range observed in the compressed data
        restorer = DtypeRestorer(h["dtypes"], h["frames"], compressed.arrays["data_min"], compressed.arrays["data_max"])
        constants = Constants.from_arrays(compressed.arrays)
    step = chunk_rows(h["sample_shape"])
    positions = math.prod(h["sample_shape"])
    stored_as = latent_dtype or h["latent_dtype"]
    with compressed.stream() as (latent_blocks, corrections), inference(model):
        for s, z in enumerate(latent_blocks(step)):
            s *= step
            if latent_dtype is not None:
                z = z.to(getattr(torch, LATENT_DTYPES[latent_dtype][0]))
            if not torch.isfinite(z).all():
                raise BalerInputError(
                    f"{compressed.path}: latent codes of rows {s}..{s + len(z) - 1} are not finite in {stored_as};"
                    " the data cannot be restored"
                )
            values = _decode_values(model, z, norm, restorer, constants)
            if not np.isfinite(values).all():
                raise BalerInputError(
                    f"{compressed.path}: rows {s}..{s + len(z) - 1} decode to non-finite values; the data cannot"
                    " be restored"
                )
            if restore and corrections is not None:
                index, original = corrections.take_below((s + len(z)) * positions)
                values.reshape(-1)[index - s * positions] = original
            if restore:  # what is written, corrections and constants included, must fit the column dtypes
                where = f"{compressed.path} cannot be restored: rows {s}..{s + len(z) - 1}"
                restorer.check_fits(values, h["names"], where)
            yield s, values
        if restore and corrections is not None:
            corrections.finish()


def decode(compressed: CompressedFile, latent_dtype: str | None = None, restore: bool = True) -> np.ndarray:
    """Decode all rows into ``(n_rows, *sample_shape)`` physical values.

    With ``restore`` (default) the result has the common storage dtype of the original columns, integer
    columns rounded (see :class:`~baler_lit.table.DtypeRestorer`), constant columns exactly as stored and
    error-bound corrections applied; otherwise it is float64 as decoded.
    ``latent_dtype`` re-rounds the stored latent to another storage dtype first (for trade-off studies).
    Rows are processed in chunks (:func:`chunk_rows`) from latent to final values, so each chunk's work
    stays in cache and the time grows linearly with the row count. Latent codes or decoded values that are
    not finite, and restored values their column's dtype cannot hold, raise :class:`BalerInputError` (such a
    file cannot be restored).
    """
    h = compressed.header
    storage = compressed.storage_dtype() if restore else np.dtype(np.float64)
    out = np.empty((compressed.n_rows, *h["sample_shape"]), dtype=storage)
    for s, values in decode_blocks(compressed, latent_dtype, restore):
        out[s : s + len(values)] = values
    return out


def decompress(
    path: str | os.PathLike, output: str | os.PathLike | None = None, overwrite: bool = False
) -> Table:
    """Restore the table stored in ``path`` in memory; write it as ``.npz`` to ``output`` if given.

    Integer columns are rounded to the nearest integer (Baler truncates) and every column gets its original
    dtype back; the npz ``data`` array has the columns' common dtype, ``dtypes`` lists each column's.
    Everything is checked (file, decoded and restored values, the table) before the output is written.
    :func:`decompress_to_file` writes the same file with memory bounded independent of the row count.
    """
    if output is not None:
        prepare_output(output, overwrite)
    compressed = read_compressed(path)
    h = compressed.header
    values = decode(compressed)
    table = Table(values, names=list(h["names"]), dtypes=list(h["dtypes"]), source=str(path))
    if output is not None:
        write_npz(output, values, list(h["names"]), list(h["dtypes"]), overwrite=overwrite)
    return table


@dataclass
class DecompressionResult:
    """What :func:`decompress_to_file` wrote: rows, sample shape, column names and dtypes, seconds."""

    path: Path
    n_rows: int
    sample_shape: tuple[int, ...]
    names: list[str]
    dtypes: list[str]
    seconds: float


def decompress_to_file(
    path: str | os.PathLike, output: str | os.PathLike, overwrite: bool = False
) -> DecompressionResult:
    """Restore ``path`` into the ``.npz`` file ``output`` (same content as :func:`decompress`), streaming.

    The file is verified first (checksum over every byte, latent codes not kept), then decoded chunk by chunk
    into the ``data`` member of a private temporary ``.npz`` that is renamed onto ``output`` only when every
    row is written and the re-read bytes match the verified ones: memory stays bounded independent of the
    row count, and a failure leaves no output.
    """
    start = time.perf_counter()
    prepare_output(output, overwrite)
    compressed = read_compressed(path, stream_latent=True)
    h = compressed.header
    shape = (compressed.n_rows, *h["sample_shape"])
    with npz_writer(output, shape, compressed.storage_dtype(), list(h["names"]), list(h["dtypes"]),
                    overwrite) as write:  # fmt: skip
        for _, values in decode_blocks(compressed):
            write(values)
    return DecompressionResult(Path(output), compressed.n_rows, tuple(h["sample_shape"]), list(h["names"]),
                               list(h["dtypes"]), time.perf_counter() - start)  # fmt: skip


def describe(compressed: CompressedFile) -> str:
    """One-paragraph human summary of a compressed file."""
    h = compressed.header
    return (
        f"{compressed.path}: {h['n_rows']} rows × {h['sample_shape']} → latent {h['model']['latent_dim']}"
        f" ({h['latent_dtype']}), model {h['model']['name']} ({h['model']['dtype']}),"
        f" {compressed.file_bytes} bytes, ratio {h['original_bytes'] / compressed.file_bytes:.2f}"
    )
