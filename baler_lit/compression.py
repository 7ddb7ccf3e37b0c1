"""The ``.baler`` compressed file: everything decompression needs, in one self-contained file.

Layout: an uncompressed (stored) zip archive with

- ``header.json``: magic, format and library versions, the model description (name, input shape, latent
  size, dtype, extra arguments), the training configuration, the column names and original dtypes, the row
  count, the latent dtype, an index of the arrays (dtype, shape, byte size) and a SHA-256 checksum;
- ``arrays/<name>.bin``: raw little-endian bytes of each array: ``latent`` (``n_rows × latent_dim``), the
  decoder's parameters and buffers (``decoder.<name>``), ``norm_min`` and ``norm_scale`` (the model's
  normalisation) and ``data_min``/``data_max`` (per-column range of the compressed data, used to clip
  restored integer columns and to choose the restored array's dtype).

Nothing is unpickled on load: arrays are rebuilt from raw bytes with the dtype and shape in the header.
``bfloat16`` latents are stored as their 16-bit patterns. The checksum covers the header (without the
checksum field) and every array; zip's per-entry CRC-32 catches damaged bytes too. Files are written to a
temporary name and renamed, so an interrupted write never leaves a partial ``.baler`` file.

Compression and decompression process rows in fixed-size chunks into preallocated arrays, so time and
memory grow linearly with the number of rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import __version__
from .errors import BalerInputError
from .models import BalerAutoencoder, build_model
from .normalization import MinMaxNormalizer
from .sources import existing_file
from .table import DtypeRestorer, Table, atomic_output, check_output, write_npz

MAGIC = "baler-lit compressed data"
FORMAT_VERSION = 1
HEADER = "header.json"
#: Rows per chunk when encoding/decoding. Small chunks keep the activations in cache and let the allocator
#: reuse their buffers (32k-row chunks measured ~2x slower here, mostly page faults on fresh buffers).
CHUNK_ROWS = 4096
#: Cap on input values per chunk, so chunks of large samples (frames) stay small too.
CHUNK_VALUES = 2**17

#: Latent storage dtypes: name → (torch dtype, numpy dtype of the stored bytes).
LATENT_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float64": (torch.float64, np.dtype("<f8")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
}


def _json_ready(value: Any) -> Any:
    """Convert tuples/numpy scalars inside ``value`` to JSON types."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _canonical(header: dict[str, Any]) -> bytes:
    body = {k: v for k, v in header.items() if k != "checksum_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _checksum(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256(_canonical(header))
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))
    return digest.hexdigest()


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
        torch_dtype, _ = LATENT_DTYPES[self.header["latent_dtype"]]
        t = torch.from_numpy(self.arrays["latent"])
        return t.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else t

    def normalizer(self) -> MinMaxNormalizer:
        return MinMaxNormalizer.from_arrays(self.arrays)

    def decoder_model(self) -> BalerAutoencoder:
        """Rebuild the model and load the stored decoder weights (the encoder stays untrained)."""
        spec = self.header["model"]
        model = build_model(
            spec["name"], spec["input_shape"], spec["latent_dim"], dtype=spec["dtype"], model_kwargs=spec["kwargs"]
        )
        state = {
            name.removeprefix("decoder."): torch.from_numpy(arr)
            for name, arr in self.arrays.items()
            if name.startswith("decoder.")
        }
        try:
            model.decoder.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise BalerInputError(f"{self.path}: decoder weights do not fit the model description: {exc}") from None
        return model.eval()


@dataclass
class CompressionResult:
    """Summary of one compression: sizes in bytes, ratio = original bytes / file bytes, time in seconds."""

    path: Path
    n_rows: int
    latent_dim: int
    latent_dtype: str
    original_bytes: int
    file_bytes: int
    latent_bytes: int
    seconds: float

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
) -> CompressionResult:
    """Encode ``table`` with ``model`` and write a self-contained ``.baler`` file to ``output``.

    Args:
        model: trained autoencoder; its decoder is stored in the file.
        normalizer: the normaliser the model was trained with.
        table: data to compress; its sample shape must match the model's input shape.
        output: target path; must not exist unless ``overwrite``.
        latent_dtype: ``"float64"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        config: training configuration to record in the header (JSON types).
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
    np_model = torch.empty((), dtype=model_dtype).numpy().dtype
    latent = np.empty((table.n_rows, model.latent_dim), dtype=np_latent)
    step = chunk_rows(table.sample_shape)
    with inference(model):
        for s in range(0, table.n_rows, step):
            chunk = normalizer.transform(table.data[s : s + step], np_model)
            z = model.encode(torch.from_numpy(chunk).to(device))
            stored = z.to(torch_latent)
            if not bool(torch.isfinite(stored).all()) and bool(torch.isfinite(z).all()):
                largest = float(z.abs().max())
                raise BalerInputError(
                    f"latent values reach {largest:.4g}, beyond the range of {latent_dtype}"
                    f" (±{float(torch.finfo(torch_latent).max):.4g}); use --latent-dtype bfloat16 or float32"
                )
            latent[s : s + len(chunk)] = _tensor_to_numpy(stored)

    arrays: dict[str, np.ndarray] = {"latent": latent}
    for name, t in model.decoder.state_dict().items():
        arrays[f"decoder.{name}"] = _tensor_to_numpy(t)
    arrays.update(normalizer.to_arrays())
    axis = None if table.is_frames else 0
    arrays["data_min"] = np.atleast_1d(table.data.min(axis=axis)).astype(np.float64)
    arrays["data_max"] = np.atleast_1d(table.data.max(axis=axis)).astype(np.float64)
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
        "arrays": {
            k: {"dtype": v.dtype.str, "shape": list(v.shape), "nbytes": int(v.nbytes)} for k, v in arrays.items()
        },
    }
    header["checksum_sha256"] = _checksum(header, arrays)
    with atomic_output(output, overwrite) as tmp:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
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
    )


def read_compressed(path: str | os.PathLike) -> CompressedFile:
    """Open and verify a ``.baler`` file; raise :class:`BalerInputError` naming what is wrong."""
    p = existing_file(path, "compressed file")
    try:
        zf = zipfile.ZipFile(p)
    except zipfile.BadZipFile:
        raise BalerInputError(f"{p} is truncated or not a baler-lit compressed file (no valid zip directory)") from None
    except OSError as exc:
        raise BalerInputError(f"cannot read compressed file {p}: {exc}") from None
    with zf:
        try:
            header = json.loads(zf.read(HEADER))
        except KeyError:
            raise BalerInputError(f"{p} is not a baler-lit compressed file (no {HEADER})") from None
        except (zipfile.BadZipFile, EOFError, ValueError, OSError) as exc:
            raise BalerInputError(f"{p} is corrupted: cannot read its header ({exc})") from None
        if not isinstance(header, dict) or header.get("magic") != MAGIC:
            raise BalerInputError(f"{p} is not a baler-lit compressed file (wrong magic)")
        version = header.get("format_version")
        if version != FORMAT_VERSION:
            raise BalerInputError(
                f"{p} was written in format version {version} (baler-lit {header.get('library_version')});"
                f" this baler-lit {__version__} reads format version {FORMAT_VERSION} only"
            )
        arrays: dict[str, np.ndarray] = {}
        try:
            for name, spec in header["arrays"].items():
                arr = np.empty(spec["shape"], dtype=np.dtype(spec["dtype"]))
                with zf.open(f"arrays/{name}.bin") as fh:
                    view = memoryview(arr).cast("B") if arr.nbytes else memoryview(bytearray())
                    got = fh.readinto(view) if arr.nbytes else 0
                    if got != arr.nbytes or fh.read(1):
                        raise BalerInputError(f"{p} is corrupted: array {name!r} has the wrong size")
                arrays[name] = arr
        except BalerInputError:
            raise
        except KeyError as exc:
            raise BalerInputError(f"{p} is truncated or corrupted: missing entry {exc}") from None
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, TypeError, zlib.error) as exc:
            raise BalerInputError(f"{p} is truncated or corrupted: {exc}") from None
    if _checksum(header, arrays) != header.get("checksum_sha256"):
        raise BalerInputError(f"{p} is corrupted: checksum mismatch")
    return CompressedFile(path=p, header=header, arrays=arrays)


def decode(compressed: CompressedFile, latent_dtype: str | None = None, restore: bool = True) -> np.ndarray:
    """Decode all rows into ``(n_rows, *sample_shape)`` physical values.

    With ``restore`` (default) the result has the common storage dtype of the original columns, integer
    columns rounded (see :class:`~baler_lit.table.DtypeRestorer`); otherwise it is float64 as decoded.
    ``latent_dtype`` re-rounds the stored latent to another storage dtype first (for trade-off studies).
    Rows are processed in chunks (:func:`chunk_rows`) from latent to final values, so each chunk's work
    stays in cache and the time grows linearly with the row count.
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
    with inference(model):
        for s in range(0, n, step):
            z = latent[s : s + step].to(param.dtype)
            chunk = model.decode(z).cpu().numpy().astype(np.float64)
            chunk *= norm.scale
            chunk += norm.minimum
            if restorer is not None:
                restorer.apply(chunk)
            out[s : s + len(chunk)] = chunk
    return out


def decompress(
    path: str | os.PathLike, output: str | os.PathLike | None = None, overwrite: bool = False
) -> Table:
    """Restore the table stored in ``path``; write it as ``.npz`` to ``output`` if given.

    Integer columns are rounded to the nearest integer (Baler truncates) and every column gets its original
    dtype back; the npz ``data`` array has the columns' common dtype, ``dtypes`` lists each column's.
    """
    if output is not None:
        check_output(output, overwrite)
    compressed = read_compressed(path)
    h = compressed.header
    values = decode(compressed)
    if output is not None:
        write_npz(output, values, list(h["names"]), list(h["dtypes"]), overwrite=overwrite)
    return Table(values, names=list(h["names"]), dtypes=list(h["dtypes"]), source=str(path))


def describe(compressed: CompressedFile) -> str:
    """One-paragraph human summary of a compressed file."""
    h = compressed.header
    return (
        f"{compressed.path}: {h['n_rows']} rows × {h['sample_shape']} → latent {h['model']['latent_dim']}"
        f" ({h['latent_dtype']}), model {h['model']['name']} ({h['model']['dtype']}),"
        f" {compressed.file_bytes} bytes, ratio {h['original_bytes'] / compressed.file_bytes:.2f}"
    )
