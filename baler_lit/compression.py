"""The ``.baler`` compressed file: everything decompression needs, in one self-contained file.

Layout: an uncompressed (stored) zip archive with

- ``header.json``: magic, format and library versions, the model description (name, input shape, latent
  size, dtype, extra arguments), the training configuration, the column names and original dtypes, the row
  count, the latent dtype, an index of the arrays (dtype, shape, byte size) and a SHA-256 checksum;
- ``arrays/<name>.bin``: raw little-endian bytes of each array: ``latent`` (``n_rows × latent_dim``), the
  decoder's parameters and buffers (``decoder.<name>``), ``norm_min`` and ``norm_scale`` (the model's
  normalisation) and ``data_min``/``data_max`` (per-column range of the compressed data, used to clip
  restored integer columns and to choose the restored array's dtype).

Nothing is unpickled on load: arrays are rebuilt from raw bytes with the dtype and shape in the header,
after :mod:`baler_lit.file_format` has checked every field against a whitelist and against the sizes the
archive actually holds; the model described by the header is first built on PyTorch's ``meta`` device and
compared with the stored decoder, so no header field can make the reader allocate more than the file
justifies. ``bfloat16`` latents are stored as their 16-bit patterns. The checksum covers the header
(without the checksum field) and every array and is verified while the arrays stream in, before any is
used; zip's per-entry CRC-32 catches damaged bytes too. Files are written to a private temporary file and
renamed, so an interrupted write never leaves a partial ``.baler`` file.

``compress`` refuses what it cannot restore: latent codes that are not finite in the chosen latent dtype
(input far outside the training range overflows float16) stop it; input outside the checkpoint's
normalisation range by more than ``NORM_RANGE_MARGIN`` gives a warning (an error with ``strict``); and it
decodes a sample of the rows it just encoded and reports their round-trip error.

Compression and decompression process rows in fixed-size chunks into preallocated arrays, so time and
memory grow linearly with the number of rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import __version__
from .errors import BalerInputError
from .file_format import (
    FORMAT_VERSION,
    HEADER,
    LATENT_DTYPES,
    MAGIC,
    MODEL_DTYPES,
    check_archive,
    check_header,
    check_values,
    checksum,
    read_arrays,
    read_header,
)
from .models import BalerAutoencoder, build_model
from .normalization import MinMaxNormalizer
from .sources import existing_file
from .table import DtypeRestorer, Table, atomic_output, check_output, write_npz

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
#: A model rebuilt from a file may hold at most this many times the bytes of its stored decoder (its
#: encoder mirrors the decoder) plus ``MODEL_SLACK_BYTES``: header fields cannot make the reader allocate more.
MODEL_SIZE_FACTOR = 3
MODEL_SLACK_BYTES = 2**20


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
class CompressedFile:
    """A parsed ``.baler`` file: its header and its arrays (by name)."""

    path: Path
    header: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def n_rows(self) -> int:
        return int(self.header["n_rows"])

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def latent(self) -> torch.Tensor:
        """Latent codes as stored, as a torch tensor in the storage dtype."""
        return _latent_tensor(self.arrays["latent"], self.header["latent_dtype"])

    def normalizer(self) -> MinMaxNormalizer:
        return MinMaxNormalizer.from_arrays(self.arrays)

    def decoder_model(self) -> BalerAutoencoder:
        """Rebuild the model and load the stored decoder weights (the encoder stays untrained).

        The model is first built on the ``meta`` device (no memory): its decoder must match the stored
        arrays name for name, shape for shape and dtype for dtype, and the whole model may hold at most
        ``MODEL_SIZE_FACTOR`` times the stored decoder's bytes, before it is built for real.
        """
        spec = self.header["model"]
        stored = {n.removeprefix("decoder."): arr for n, arr in self.arrays.items() if n.startswith("decoder.")}
        with torch.device("meta"):
            blueprint = self._build(spec)
        expected = blueprint.decoder.state_dict()
        if set(expected) != set(stored):
            missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
            raise BalerInputError(
                f"{self.path}: decoder weights do not fit the model description (missing {missing[:3]},"
                f" unexpected {extra[:3]})"
            )
        for name, t in expected.items():
            want = MODEL_DTYPES[spec["dtype"]] if t.is_floating_point() else _numpy_dtype(t.dtype).str
            if tuple(t.shape) != stored[name].shape or stored[name].dtype.str != want:
                raise BalerInputError(
                    f"{self.path}: decoder weight {name!r} is {stored[name].dtype.str} {stored[name].shape},"
                    f" the model description needs {want} {tuple(t.shape)}"
                )
        model_bytes = sum(t.numel() * t.element_size() for t in [*blueprint.parameters(), *blueprint.buffers()])
        decoder_bytes = sum(arr.nbytes for arr in stored.values())
        if model_bytes > MODEL_SIZE_FACTOR * decoder_bytes + MODEL_SLACK_BYTES:
            raise BalerInputError(
                f"{self.path}: the model description needs {model_bytes} bytes of weights for a stored decoder"
                f" of {decoder_bytes} bytes"
            )
        model = self._build(spec)
        state = {name: torch.from_numpy(arr) for name, arr in stored.items()}
        try:
            model.decoder.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise BalerInputError(f"{self.path}: decoder weights do not fit the model description: {exc}") from None
        return model.eval()

    def _build(self, spec: dict[str, Any]) -> BalerAutoencoder:
        try:
            return build_model(
                spec["name"], spec["input_shape"], spec["latent_dim"], dtype=spec["dtype"], model_kwargs=spec["kwargs"]
            )
        except BalerInputError as exc:
            raise BalerInputError(f"{self.path}: the model description is invalid: {exc}") from None
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise BalerInputError(f"{self.path}: the model description is invalid ({type(exc).__name__})") from None


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


@dataclass
class CompressionResult:
    """Summary of one compression: sizes in bytes, ratio = original bytes / file bytes, time in seconds.

    ``roundtrip_*``: the error measured by decoding ``roundtrip_rows`` of the rows just compressed, as the
    file restores them: per column RMS(restored − original) / the column's range, averaged over the columns
    (``mean``) and the worst column (``max``); dimensionless. ``warnings``: lines the caller should show.
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

    @property
    def ratio(self) -> float:
        return self.original_bytes / self.file_bytes


def compress(
    model: BalerAutoencoder,
    normalizer: MinMaxNormalizer,
    table: Table,
    output: str | os.PathLike,
    latent_dtype: str = "float32",
    config: dict[str, Any] | None = None,
    overwrite: bool = False,
    strict: bool = False,
) -> CompressionResult:
    """Encode ``table`` with ``model`` and write a self-contained ``.baler`` file to ``output``.

    Refuses (:class:`BalerInputError`, nothing written) latent codes that are not finite in
    ``latent_dtype``. Input that lies outside the normaliser's range by more than ``NORM_RANGE_MARGIN``
    of a column's range gives a line in ``result.warnings``, or an error with ``strict``. The result holds
    the round-trip error measured by decoding up to ``ROUNDTRIP_ROWS`` of the rows just encoded.

    Args:
        model: trained autoencoder; its decoder is stored in the file.
        normalizer: the normaliser the model was trained with.
        table: data to compress; its sample shape must match the model's input shape.
        output: target path; must not exist unless ``overwrite``.
        latent_dtype: ``"float64"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        config: training configuration to record in the header (JSON types).
        strict: refuse input outside the normalisation range instead of warning.
    """
    start = time.perf_counter()
    if latent_dtype not in LATENT_DTYPES:
        raise BalerInputError(f"latent dtype must be one of {sorted(LATENT_DTYPES)}, got {latent_dtype!r}")
    if tuple(table.sample_shape) != tuple(model.input_shape):
        raise BalerInputError(
            f"column-count mismatch: the model expects samples of shape {tuple(model.input_shape)},"
            f" {table.source} has {tuple(table.sample_shape)}"
        )
    if np.shape(normalizer.minimum) not in ((1,), tuple(model.input_shape)):
        raise BalerInputError(
            f"normalisation of shape {np.shape(normalizer.minimum)} does not fit samples {tuple(model.input_shape)}"
        )
    check_output(output, overwrite)
    torch_latent, np_latent = LATENT_DTYPES[latent_dtype]
    param = next(model.parameters())
    model_dtype, device = param.dtype, param.device
    np_model = _numpy_dtype(model_dtype)
    latent = np.empty((table.n_rows, model.latent_dim), dtype=np_latent)
    step = chunk_rows(table.sample_shape)
    low = np.full(table.sample_shape, np.inf)
    high = np.full(table.sample_shape, -np.inf)
    not_finite = 0
    with inference(model):
        for s in range(0, table.n_rows, step):
            chunk = normalizer.transform(table.data[s : s + step], np_model)
            np.minimum(low, chunk.min(axis=0), out=low)
            np.maximum(high, chunk.max(axis=0), out=high)
            z = model.encode(torch.from_numpy(chunk).to(device)).to(torch_latent)
            not_finite += int(z.numel() - torch.isfinite(z).sum())
            latent[s : s + len(chunk)] = _tensor_to_numpy(z)
    warnings = _range_warnings(low, high, table, strict)
    if not_finite:
        wider = {"float16": "bfloat16 or float32", "bfloat16": "float32"}.get(latent_dtype)
        hint = f"; use --latent-dtype {wider}" if wider else ""
        cause = f" ({warnings[0]})" if warnings else ""
        raise BalerInputError(
            f"{not_finite} of {latent.size} latent codes ({100 * not_finite / latent.size:.1f} %) are not finite"
            f" in {latent_dtype}, so the file could not be restored{hint}{cause}"
        )

    arrays: dict[str, np.ndarray] = {"latent": latent}
    for name, t in model.decoder.state_dict().items():
        arrays[f"decoder.{name}"] = _tensor_to_numpy(t)
    arrays.update(normalizer.to_arrays())
    axis = None if table.is_frames else 0
    arrays["data_min"] = np.atleast_1d(table.data.min(axis=axis)).astype(np.float64)
    arrays["data_max"] = np.atleast_1d(table.data.max(axis=axis)).astype(np.float64)
    rows, mean_error, max_error = _roundtrip_error(model, normalizer, table, latent, latent_dtype, arrays)
    header: dict[str, Any] = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "model": {
            "name": type(model).__name__,
            "input_shape": list(model.input_shape),
            "latent_dim": model.latent_dim,
            "dtype": str(model_dtype).removeprefix("torch."),
            "kwargs": _json_ready(getattr(model, "build_kwargs", {})),
        },
        "config": _json_ready(config or {}),
        "latent_dtype": latent_dtype,
        "n_rows": table.n_rows,
        "sample_shape": list(table.sample_shape),
        "frames": table.is_frames,
        "names": list(table.names),
        "dtypes": list(table.dtypes),
        "original_bytes": table.original_nbytes,
        "roundtrip": {"rows": rows, "mean_norm_rms": mean_error, "max_norm_rms": max_error},
        "arrays": {
            k: {"dtype": v.dtype.str, "shape": list(v.shape), "nbytes": int(v.nbytes)} for k, v in arrays.items()
        },
    }
    header["checksum_sha256"] = _checksum(header, arrays)
    with atomic_output(output, overwrite) as fh_out:
        with zipfile.ZipFile(fh_out, "w", compression=zipfile.ZIP_STORED) as zf:
            zf.writestr(HEADER, json.dumps(header, indent=1))
            for name, arr in arrays.items():
                with zf.open(f"arrays/{name}.bin", "w", force_zip64=arr.nbytes > 2**31) as fh:
                    fh.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
    out = Path(output)
    return CompressionResult(
        path=out,
        n_rows=table.n_rows,
        latent_dim=model.latent_dim,
        latent_dtype=latent_dtype,
        original_bytes=table.original_nbytes,
        file_bytes=out.stat().st_size,
        latent_bytes=int(latent.nbytes),
        seconds=time.perf_counter() - start,
        roundtrip_rows=rows,
        roundtrip_mean_norm_rms=mean_error,
        roundtrip_max_norm_rms=max_error,
        warnings=warnings,
    )


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


def _roundtrip_error(
    model: BalerAutoencoder,
    normalizer: MinMaxNormalizer,
    table: Table,
    latent: np.ndarray,
    latent_dtype: str,
    arrays: dict[str, np.ndarray],
) -> tuple[int, float, float]:
    """Decode up to ``ROUNDTRIP_ROWS`` evenly spread stored latent rows as ``decode`` will; return
    (rows, mean and max over columns of RMS(restored − original) / column range). Refuses non-finite output."""
    idx = np.unique(np.linspace(0, table.n_rows - 1, min(table.n_rows, ROUNDTRIP_ROWS)).round().astype(np.intp))
    restorer = DtypeRestorer(table.dtypes, table.is_frames, arrays["data_min"], arrays["data_max"])
    stored = _latent_tensor(latent[idx], latent_dtype)
    param = next(model.parameters())
    restored = np.empty((len(idx), *table.sample_shape))
    step = chunk_rows(table.sample_shape)
    with inference(model):
        for s in range(0, len(idx), step):
            z = stored[s : s + step].to(device=param.device, dtype=param.dtype)
            restored[s : s + len(z)] = _restore_chunk(model.decode(z).cpu().numpy(), normalizer, restorer)
    if not np.isfinite(restored).all():
        raise BalerInputError(
            f"decoding the latent codes of {table.source} gives non-finite values: the file could not be restored"
        )
    width = 1 if table.is_frames else table.n_columns
    original = table.data[idx].reshape(-1, width)
    span = (arrays["data_max"] - arrays["data_min"]).reshape(-1)[:width]
    rms = np.sqrt(np.mean((restored.reshape(-1, width) - original) ** 2, axis=0))
    error = np.where(span > 0, rms / np.where(span > 0, span, 1.0), rms)
    return len(idx), float(error.mean()), float(error.max())


def _latent_tensor(latent: np.ndarray, latent_dtype: str) -> torch.Tensor:
    """Stored latent bytes as a torch tensor of the latent dtype (bfloat16 bit patterns reinterpreted)."""
    t = torch.from_numpy(np.ascontiguousarray(latent))
    return t.view(torch.bfloat16) if LATENT_DTYPES[latent_dtype][0] == torch.bfloat16 else t


def _restore_chunk(normalised: np.ndarray, norm: MinMaxNormalizer, restorer: DtypeRestorer | None) -> np.ndarray:
    """Decoder output (normalised) → physical float64 values, rounded to the column dtypes if ``restorer``."""
    chunk = normalised.astype(np.float64)
    chunk *= norm.scale
    chunk += norm.minimum
    if restorer is not None:
        restorer.apply(chunk)
    return chunk


def read_compressed(path: str | os.PathLike) -> CompressedFile:
    """Open and verify a ``.baler`` file; raise :class:`BalerInputError` naming what is wrong.

    Checks, in order (see :mod:`baler_lit.file_format`): the archive's entries, the header's size and
    every field, then the arrays while the checksum is computed; memory is bounded by the file's size.
    """
    p = existing_file(path, "compressed file")
    try:
        file_bytes = p.stat().st_size
        zf = zipfile.ZipFile(p)
    except zipfile.BadZipFile:
        raise BalerInputError(f"{p} is truncated or not a baler-lit compressed file (no valid zip directory)") from None
    except (OSError, ValueError, EOFError) as exc:
        raise BalerInputError(f"cannot read compressed file {p}: {_one_line(exc)}") from None
    with zf:
        try:
            check_archive(zf, p, file_bytes)
            header = read_header(zf, p)
            check_header(header, p, {info.filename: info.file_size for info in zf.infolist()})
            arrays = read_arrays(zf, header, p)
        except BalerInputError:
            raise
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, TypeError, KeyError, zlib.error) as exc:
            raise BalerInputError(f"{p} is truncated or corrupted: {_one_line(exc)}") from None
    check_values(arrays, p)
    compressed = CompressedFile(path=p, header=header, arrays=arrays)
    compressed.normalizer()  # its own checks: finite, range > 0
    return compressed


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] if text else type(exc).__name__


def decode(compressed: CompressedFile, latent_dtype: str | None = None, restore: bool = True) -> np.ndarray:
    """Decode all rows into ``(n_rows, *sample_shape)`` physical values.

    With ``restore`` (default) the result has the common storage dtype of the original columns, integer
    columns rounded (see :class:`~baler_lit.table.DtypeRestorer`); otherwise it is float64 as decoded.
    ``latent_dtype`` re-rounds the stored latent to another storage dtype first (for trade-off studies).
    Rows are processed in chunks (:func:`chunk_rows`) from latent to final values, so each chunk's work
    stays in cache and the time grows linearly with the row count. Latent codes or decoded values that are
    not finite raise :class:`BalerInputError` (such a file cannot be restored).
    """
    model = compressed.decoder_model()
    norm = compressed.normalizer()
    h = compressed.header
    param = next(model.parameters())
    latent = compressed.latent
    if latent_dtype is not None:
        if latent_dtype not in LATENT_DTYPES:
            raise BalerInputError(f"latent dtype must be one of {sorted(LATENT_DTYPES)}, got {latent_dtype!r}")
        latent = latent.to(LATENT_DTYPES[latent_dtype][0])
    restorer = None
    if restore:  # integer columns are clipped to the range observed in the compressed data
        restorer = DtypeRestorer(h["dtypes"], h["frames"], compressed.arrays["data_min"], compressed.arrays["data_max"])
    n = compressed.n_rows
    out = np.empty((n, *h["sample_shape"]), dtype=restorer.storage if restorer else np.float64)
    step = chunk_rows(h["sample_shape"])
    stored_as = latent_dtype or h["latent_dtype"]
    with inference(model):
        for s in range(0, n, step):
            z = latent[s : s + step]
            if not torch.isfinite(z).all():
                raise BalerInputError(
                    f"{compressed.path}: latent codes of rows {s}..{s + len(z) - 1} are not finite in {stored_as};"
                    " the data cannot be restored"
                )
            decoded = model.decode(z.to(param.dtype)).cpu().numpy()
            if not np.isfinite(decoded).all():
                raise BalerInputError(
                    f"{compressed.path}: rows {s}..{s + len(z) - 1} decode to non-finite values; the data cannot"
                    " be restored"
                )
            out[s : s + len(z)] = _restore_chunk(decoded, norm, restorer)
    return out


def decompress(
    path: str | os.PathLike, output: str | os.PathLike | None = None, overwrite: bool = False
) -> Table:
    """Restore the table stored in ``path``; write it as ``.npz`` to ``output`` if given.

    Integer columns are rounded to the nearest integer (Baler truncates) and every column gets its original
    dtype back; the npz ``data`` array has the columns' common dtype, ``dtypes`` lists each column's.
    Everything is checked (file, decoded values, the table) before the output is written.
    """
    if output is not None:
        check_output(output, overwrite)
    compressed = read_compressed(path)
    h = compressed.header
    values = decode(compressed)
    table = Table(values, names=list(h["names"]), dtypes=list(h["dtypes"]), source=str(path))
    if output is not None:
        write_npz(output, values, list(h["names"]), list(h["dtypes"]), overwrite=overwrite)
    return table


def describe(compressed: CompressedFile) -> str:
    """One-paragraph human summary of a compressed file."""
    h = compressed.header
    return (
        f"{compressed.path}: {h['n_rows']} rows × {h['sample_shape']} → latent {h['model']['latent_dim']}"
        f" ({h['latent_dtype']}), model {h['model']['name']} ({h['model']['dtype']}),"
        f" {compressed.file_bytes} bytes, ratio {h['original_bytes'] / compressed.file_bytes:.2f}"
    )
