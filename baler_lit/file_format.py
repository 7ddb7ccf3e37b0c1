"""Reading a ``.baler`` file as untrusted input: every field checked before anything is allocated or used.

A ``.baler`` file is a zip archive (entries stored, or deflated) of ``header.json`` and one ``arrays/<name>.bin``
per array (see :mod:`baler_lit.compression` for the layout). Whoever hands us such a file controls every
byte of it, including the SHA-256 checksum, which anybody can recompute. So the reader trusts nothing:

1. the archive: at most ``MAX_ENTRIES`` entries, no duplicate names, unencrypted, every entry stored or (a file
   written with ``extra_compression``) deflated, and the inflated sizes bounded before anything is inflated: a
   stored entry's size is its size on disk, a deflated entry may declare at most ``MAX_INFLATE_RATIO`` times its
   deflated size (deflate's own ceiling, so a larger claim is forged), and the entries together at most the
   file's size (all stored) or ``MAX_INFLATE_RATIO`` times it. Every entry is then read in chunks of at most
   ``READ_CHUNK`` bytes and never past its declared size (zip's CRC-32 is checked at its end), and every
   declared size must equal what the header's shapes need;
2. the header: at most ``MAX_HEADER_BYTES``, then every field's type and range (:func:`check_header`):
   only the native little-endian numeric dtypes the writer uses (:data:`ARRAY_DTYPES`, never object or
   structured dtypes), every shape consistent with the entry's stored byte count and with the other fields
   (``n_rows`` is the latent's row count, the names and dtypes fit the sample shape), so every allocation is
   bounded by what the archive actually holds;
3. the arrays: read in order, the checksum updated while streaming, and compared before any array is used.

Format version 2 (this version writes it; version 1 files still read) adds two optional parts, checked the
same way: constant columns (``constants.count`` in the header, arrays ``constant_index`` (``<i8``, the
sample positions, strictly increasing) and ``constant_value`` (``<f8``)), restored exactly, never through the
network; and error-bound corrections (``corrections``: the bound, the count, the value dtype; arrays
``corrections_index`` and ``corrections_value`` of zlib bytes, see :mod:`baler_lit.error_bound`, whose
inflated size the header's count fixes in advance). A version 1 header must not declare either part.

The checks raise :class:`~baler_lit.errors.BalerInputError` with one line naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BalerInputError

MAGIC = "baler-lit compressed data"
FORMAT_VERSION = 2
#: Format versions this reader accepts (1: before constant columns and corrections).
READABLE_VERSIONS = (1, 2)
HEADER = "header.json"

#: Latent storage dtypes: name → (torch dtype's name, numpy dtype of the stored bytes); names, not torch
#: objects, so reading a file's header needs no torch (``getattr(torch, name)`` gives the dtype).
LATENT_DTYPES: dict[str, tuple[str, np.dtype]] = {
    "float64": ("float64", np.dtype("<f8")),
    "float32": ("float32", np.dtype("<f4")),
    "float16": ("float16", np.dtype("<f2")),
    "bfloat16": ("bfloat16", np.dtype("<u2")),
}
#: Model names a file may describe: the registry :data:`baler_lit.models.MODELS` (a test keeps the two equal),
#: written out here so that reading a header needs no torch.
MODEL_NAMES = (
    "AE", "AE_Dropout_BN", "CFD_dense_AE", "ConvAE", "PJ_Conv_AE", "TransformerAE", "Conv_AE", "Conv_AE_GDN", "Conv_AE_3D",
    "FPGA_prototype_model",
)  # fmt: skip
#: The only array dtypes a ``.baler`` file may declare (numpy ``dtype.str``): float latents and weights,
#: bfloat16 bit patterns (``<u2``) and BatchNorm's step counter (``<i8``). Anything else, an object dtype
#: ("|O") above all, is refused before an array is allocated.
ARRAY_DTYPES = frozenset({"<f8", "<f4", "<f2", "<u2", "<i8", "|u1"})
#: Column dtypes a restored table may have (numpy names).
COLUMN_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"}
)
#: Model parameter dtypes (as written in the header's ``model.dtype``).
MODEL_DTYPES = {"float32": "<f4", "float64": "<f8"}
#: Fixed arrays besides the decoder's parameters.
FIXED_ARRAYS = ("latent", "norm_min", "norm_scale", "data_min", "data_max")
#: Arrays of format version 2 that a file holds only when it uses the feature.
CONSTANT_ARRAYS = ("constant_index", "constant_value")
CORRECTION_ARRAYS = ("corrections_index", "corrections_value")
#: Most values (rows × values per sample) a file with corrections may describe (keeps flat indices in int64).
MAX_CORRECTED_VALUES = 2**46
#: Largest ``header.json`` accepted (bytes): the names of ~20,000 columns.
MAX_HEADER_BYTES = 2**20
#: Most entries an archive may hold (a dense AE has ~10 decoder arrays, a ConvAE a few more).
MAX_ENTRIES = 1024
#: Largest dimension or count accepted in a header (keeps products of shapes in exact integer range).
MAX_COUNT = 2**40
#: Bytes read per step when streaming an array.
READ_CHUNK = 2**20
#: Most bytes a deflated entry may inflate to per byte it occupies: deflate's own limit (a 258-byte match coded in
#: 2 bits, about 1032:1), so a larger declared size cannot be genuine.
MAX_INFLATE_RATIO = 1032
#: Zip compression methods an entry may use: stored, or deflated (files written with ``extra_compression``).
ENTRY_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}


def canonical_header(header: dict[str, Any]) -> bytes:
    """The header's bytes covered by the checksum (the checksum field left out, keys sorted)."""
    body = {k: v for k, v in header.items() if k != "checksum_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def checksum(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 (hex) over the canonical header and every array's name and bytes, arrays in name order."""
    digest = hashlib.sha256(canonical_header(header))
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))
    return digest.hexdigest()


def array_entry(name: str) -> str:
    return f"arrays/{name}.bin"


def check_archive(zf: zipfile.ZipFile, path: Path, file_bytes: int) -> None:
    """Entry count, duplicate names, stored or deflated entries, inflated sizes bounded (see the module docstring)
    before any entry is read."""
    infos = zf.infolist()
    if len(infos) > MAX_ENTRIES:
        raise BalerInputError(f"{path} has {len(infos)} archive entries (at most {MAX_ENTRIES})")
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        raise BalerInputError(f"{path} is corrupted: an archive entry name appears twice")
    total = 0
    deflated = False
    for info in infos:
        if info.compress_type not in ENTRY_METHODS:
            raise BalerInputError(
                f"{path} is corrupted: entry {info.filename!r} uses zip compression method {info.compress_type};"
                " the format stores or deflates its entries"
            )
        if info.flag_bits & 0x1:
            raise BalerInputError(f"{path} is corrupted: entry {info.filename!r} is encrypted")
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise BalerInputError(
                f"{path} is corrupted: stored entry {info.filename!r} declares {info.file_size} bytes but holds"
                f" {info.compress_size}"
            )
        if info.compress_type == zipfile.ZIP_DEFLATED:
            deflated = True
            if info.file_size > MAX_INFLATE_RATIO * max(info.compress_size, 1):
                raise BalerInputError(
                    f"{path} is corrupted: deflated entry {info.filename!r} declares {info.file_size} bytes from"
                    f" {info.compress_size}, more than deflate's {MAX_INFLATE_RATIO}:1 allows"
                )
        total += info.file_size
    limit = MAX_INFLATE_RATIO * file_bytes if deflated else file_bytes
    if total > limit:
        raise BalerInputError(
            f"{path} is corrupted: its entries declare {total} bytes, more than the file's {file_bytes} bytes"
            + (f" allow when inflated ({MAX_INFLATE_RATIO}:1)" if deflated else "")
        )


def read_header(zf: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    """The parsed ``header.json`` (size bounded, magic and format version checked)."""
    try:
        info = zf.getinfo(HEADER)
    except KeyError:
        raise BalerInputError(f"{path} is not a baler-lit compressed file (no {HEADER})") from None
    if info.file_size > MAX_HEADER_BYTES:
        raise BalerInputError(f"{path}: {HEADER} is {info.file_size} bytes (at most {MAX_HEADER_BYTES})")
    try:
        with zf.open(info) as fh:
            raw = fh.read(MAX_HEADER_BYTES + 1)
        header = json.loads(raw.decode("utf-8"))
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, RecursionError) as exc:
        raise BalerInputError(f"{path} is corrupted: cannot read its header ({_short(exc)})") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise BalerInputError(f"{path} is not a baler-lit compressed file (wrong magic)")
    version = header.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        from . import __version__

        raise BalerInputError(
            f"{path} was written in format version {_short(version)}"
            f" (baler-lit {_short(header.get('library_version'))});"
            f" this baler-lit {__version__} reads format versions {', '.join(map(str, READABLE_VERSIONS))} only:"
            " decompress it with the baler-lit that wrote it"
        )
    return header


class _Fields:
    """Typed access to header fields; every failure names the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, field: str, why: str) -> BalerInputError:
        return BalerInputError(f"{self.path} has an invalid header: {field} {why}")

    def get(self, mapping: Any, key: str, field: str) -> Any:
        if not isinstance(mapping, dict) or key not in mapping:
            raise self.fail(field, "is missing")
        return mapping[key]

    def count(self, value: Any, field: str, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
            raise self.fail(field, f"must be an integer in [{minimum}, 2^40], got {_short(value)}")
        return value

    def shape(self, value: Any, field: str, minimum: int = 1, max_dims: int = 4, min_dims: int = 1) -> list[int]:
        if not isinstance(value, list) or not min_dims <= len(value) <= max_dims:
            raise self.fail(field, f"must be a list of {min_dims} to {max_dims} sizes, got {_short(value)}")
        return [self.count(v, f"{field}[{i}]", minimum) for i, v in enumerate(value)]

    def bound(self, value: Any, field: str) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise self.fail(field, f"must be null or a finite number >= 0, got {_short(value)}")
        return float(value)

    def choice(self, value: Any, field: str, allowed) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise self.fail(field, f"must be one of {sorted(allowed)}, got {_short(value)}")
        return value

    def strings(self, value: Any, field: str, length: int, allowed=None) -> list[str]:
        if not isinstance(value, list) or len(value) != length:
            got = len(value) if isinstance(value, list) else _short(value)
            raise self.fail(field, f"must be a list of {length} strings, got {got}")
        for i, v in enumerate(value):
            if allowed is None:
                if not isinstance(v, str):
                    raise self.fail(f"{field}[{i}]", f"must be a string, got {_short(v)}")
            else:
                self.choice(v, f"{field}[{i}]", allowed)
        return value


def check_header(header: dict[str, Any], path: Path, entry_sizes: dict[str, int]) -> None:
    """Every field the reader uses: types, ranges and consistency with each other and with the archive.

    ``entry_sizes`` maps the archive's entry names to their stored sizes (bytes).
    """
    f = _Fields(path)
    model = f.get(header, "model", "model")
    f.choice(f.get(model, "name", "model.name"), "model.name", MODEL_NAMES)
    input_shape = f.shape(f.get(model, "input_shape", "model.input_shape"), "model.input_shape", max_dims=3)
    latent_dim = f.count(f.get(model, "latent_dim", "model.latent_dim"), "model.latent_dim")
    f.choice(f.get(model, "dtype", "model.dtype"), "model.dtype", MODEL_DTYPES)
    if not isinstance(f.get(model, "kwargs", "model.kwargs"), dict):
        raise f.fail("model.kwargs", "must be an object")
    latent_dtype = f.choice(f.get(header, "latent_dtype", "latent_dtype"), "latent_dtype", LATENT_DTYPES)
    n_rows = f.count(f.get(header, "n_rows", "n_rows"), "n_rows")
    sample_shape = f.shape(f.get(header, "sample_shape", "sample_shape"), "sample_shape", max_dims=2)
    if sample_shape != input_shape:
        raise f.fail("sample_shape", f"{sample_shape} differs from model.input_shape {input_shape}")
    frames = f.get(header, "frames", "frames")
    if frames is not (len(sample_shape) == 2):
        raise f.fail("frames", f"must be {str(len(sample_shape) == 2).lower()} for samples of shape {sample_shape}")
    n_columns = math.prod(sample_shape)
    f.strings(f.get(header, "names", "names"), "names", 0 if frames else n_columns)
    dtypes = f.strings(f.get(header, "dtypes", "dtypes"), "dtypes", 1 if frames else n_columns, COLUMN_DTYPES)
    itemsizes = np.dtype(dtypes[0]).itemsize * n_columns if frames else sum(np.dtype(d).itemsize for d in dtypes)
    original = f.get(header, "original_bytes", "original_bytes")
    if original != n_rows * itemsizes or isinstance(original, bool):
        raise f.fail("original_bytes", f"must be {n_rows * itemsizes} for {n_rows} rows of {dtypes[:3]}..., got "
                     f"{_short(original)}")
    if not isinstance(header.get("checksum_sha256"), str):
        raise f.fail("checksum_sha256", "is missing")

    arrays = f.get(header, "arrays", "arrays")
    if not isinstance(arrays, dict):
        raise f.fail("arrays", "must be an object")
    optional = _check_optional_parts(header, f, n_rows, n_columns)
    expected_entries = {HEADER}
    for name, spec in arrays.items():
        field = f"arrays[{name!r}]"
        if name not in FIXED_ARRAYS and name not in optional and not name.startswith("decoder."):
            raise f.fail(field, "is not an array of the format")
        dtype = f.choice(f.get(spec, "dtype", f"{field}.dtype"), f"{field}.dtype", ARRAY_DTYPES)
        # 0 dimensions: a scalar buffer (BatchNorm's num_batches_tracked in AE_Dropout_BN's and Conv_AE's decoders)
        shape = f.shape(f.get(spec, "shape", f"{field}.shape"), f"{field}.shape", minimum=0, max_dims=6, min_dims=0)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if f.get(spec, "nbytes", f"{field}.nbytes") != nbytes:
            raise f.fail(f"{field}.nbytes", f"must be {nbytes} for shape {shape} of {dtype}")
        entry = array_entry(name)
        if entry_sizes.get(entry) != nbytes:
            raise BalerInputError(
                f"{path} is truncated or corrupted: entry {entry} holds {entry_sizes.get(entry, 'no')} bytes,"
                f" the header says {nbytes}"
            )
        expected_entries.add(entry)
    for name in (*FIXED_ARRAYS, *optional):
        f.get(arrays, name, f"arrays[{name!r}]")
    if not any(name.startswith("decoder.") for name in arrays):
        raise f.fail("arrays", "hold no decoder parameters")
    extra = sorted(set(entry_sizes) - expected_entries)
    if extra:
        raise BalerInputError(f"{path} is corrupted: unexpected archive entry {extra[0]!r}")
    for name in ("constants", "corrections") if header["format_version"] == 1 else ():
        if header.get(name) is not None:  # readers of the file would take it for the version-2 part
            raise f.fail(name, "must be absent in format version 1 (the part came with version 2)")

    expect = {
        "latent": (LATENT_DTYPES[latent_dtype][1].str, [[n_rows, latent_dim]]),
        "norm_min": ("<f8", [[1], sample_shape]),
        "norm_scale": ("<f8", [[1], sample_shape]),
        "data_min": ("<f8", [[1] if frames else [n_columns]]),
        "data_max": ("<f8", [[1] if frames else [n_columns]]),
        **{name: (dtype, [[size]]) for name, (dtype, size) in optional.items()},
    }
    for name, (dtype, shapes) in expect.items():
        spec = arrays[name]
        if spec["dtype"] != dtype or spec["shape"] not in shapes:
            raise f.fail(f"arrays[{name!r}]", f"must be {dtype} of shape {' or '.join(map(str, shapes))}, got "
                         f"{spec['dtype']} of shape {spec['shape']}")
    if arrays["norm_min"]["shape"] != arrays["norm_scale"]["shape"]:
        raise f.fail("arrays['norm_scale']", "must have the shape of norm_min")


def _check_optional_parts(header: dict[str, Any], f: _Fields, n_rows: int, n_positions: int) -> dict[str, tuple]:
    """The version-2 parts a header declares: array name → (dtype, length) the archive must hold."""
    if header["format_version"] == 1:
        return {}
    parts: dict[str, tuple] = {}
    constants = f.get(header, "constants", "constants")
    k = f.count(f.get(constants, "count", "constants.count"), "constants.count", minimum=0)
    if k > n_positions:
        raise f.fail("constants.count", f"must be at most {n_positions}, got {k}")
    if k:
        parts.update(constant_index=("<i8", k), constant_value=("<f8", k))
    corrections = f.get(header, "corrections", "corrections")
    if corrections is not None:
        rel = f.bound(f.get(corrections, "relative", "corrections.relative"), "corrections.relative")
        absolute = f.bound(f.get(corrections, "absolute", "corrections.absolute"), "corrections.absolute")
        if rel is None and absolute is None:
            raise f.fail("corrections", "must state a relative or an absolute bound")
        n_values = n_rows * n_positions
        if n_values > MAX_CORRECTED_VALUES:
            raise f.fail("corrections", f"cannot index {n_values} values (at most 2^46)")
        count = f.count(f.get(corrections, "count", "corrections.count"), "corrections.count", minimum=0)
        if count > n_values:
            raise f.fail("corrections.count", f"must be at most {n_values}, got {count}")
        from .error_bound import VALUE_DTYPES

        f.choice(f.get(corrections, "value_dtype", "corrections.value_dtype"), "corrections.value_dtype",
                 VALUE_DTYPES)  # fmt: skip
        for name in CORRECTION_ARRAYS:
            spec = f.get(f.get(header, "arrays", "arrays"), name, f"arrays[{name!r}]")
            shape = f.shape(f.get(spec, "shape", f"arrays[{name!r}].shape"), f"arrays[{name!r}].shape", 0, 1)
            parts[name] = ("|u1", shape[0])
    return parts


def check_summary_fields(header: dict[str, Any], path: Path) -> None:
    """The fields only a summary reads (``baler-lit info``), which :func:`check_header` leaves alone because
    decompressing does not use them: ``library_version`` (a string) and ``roundtrip`` (null or ``rows`` a
    count, ``mean_norm_rms`` and ``max_norm_rms`` numbers >= 0, NaN allowed: a file with a damaged summary
    still decompresses)."""
    f = _Fields(path)
    version = header.get("library_version")
    if version is not None and not isinstance(version, str):
        raise f.fail("library_version", f"must be a string, got {_short(version)}")
    roundtrip = header.get("roundtrip")
    if roundtrip is None:
        return
    if not isinstance(roundtrip, dict):
        raise f.fail("roundtrip", f"must be null or an object, got {_short(roundtrip)}")
    f.count(f.get(roundtrip, "rows", "roundtrip.rows"), "roundtrip.rows", minimum=0)
    for key in ("mean_norm_rms", "max_norm_rms"):
        value = f.get(roundtrip, key, f"roundtrip.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise f.fail(f"roundtrip.{key}", f"must be a number >= 0, got {_short(value)}")


def read_arrays(zf: zipfile.ZipFile, header: dict[str, Any], path: Path) -> dict[str, np.ndarray]:
    """The arrays of a checked header, the checksum verified while streaming (before any array is returned)."""
    return verify_arrays(zf, header, path)[0]


def verify_arrays(
    zf: zipfile.ZipFile, header: dict[str, Any], path: Path, skip: frozenset[str] = frozenset()
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The arrays of a checked header, the checksum verified while streaming (before any array is returned).

    Arrays named in ``skip`` are read and checksummed but not kept (a caller streams them later): for each,
    the second result holds the SHA-256 of its bytes, which the later read must reproduce.
    """
    digest = hashlib.sha256(canonical_header(header))
    arrays: dict[str, np.ndarray] = {}
    skipped: dict[str, str] = {}
    for name in sorted(header["arrays"]):
        spec = header["arrays"][name]
        nbytes = spec["nbytes"]
        keep = name not in skip
        arr = np.empty(spec["shape"] if keep else 0, dtype=np.dtype(spec["dtype"]))
        view = memoryview(arr.reshape(-1).view(np.uint8))
        own = hashlib.sha256()
        digest.update(name.encode())
        with zf.open(array_entry(name)) as fh:
            filled = 0
            while filled < nbytes:
                chunk = fh.read(min(READ_CHUNK, nbytes - filled))
                if not chunk:
                    break
                digest.update(chunk)
                if keep:
                    view[filled : filled + len(chunk)] = chunk
                else:
                    own.update(chunk)
                filled += len(chunk)
            if filled != nbytes or fh.read(1):
                raise BalerInputError(f"{path} is truncated or corrupted: array {name!r} has the wrong size")
        if keep:
            arrays[name] = arr
        else:
            skipped[name] = own.hexdigest()
    if digest.hexdigest() != header["checksum_sha256"]:
        raise BalerInputError(f"{path} is corrupted: checksum mismatch")
    return arrays, skipped


def check_values(arrays: dict[str, np.ndarray], path: Path, n_positions: int | None = None) -> None:
    """The stored ranges are finite and ordered, constant columns lie within the ``n_positions`` values of a
    sample (the normaliser's own check follows when it is built)."""
    lo, hi = arrays["data_min"], arrays["data_max"]
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()) or (lo > hi).any():
        raise BalerInputError(f"{path} is corrupted: the stored data range is not finite or min > max")
    if "constant_index" in arrays:
        index, value = arrays["constant_index"], arrays["constant_value"]
        if (np.diff(index) <= 0).any() or index[0] < 0 or (n_positions is not None and index[-1] >= n_positions):
            raise BalerInputError(f"{path} is corrupted: constant_index is not increasing within the sample")
        if not np.isfinite(value).all():
            raise BalerInputError(f"{path} is corrupted: constant_value holds values that are not finite")


def _short(value: Any, limit: int = 60) -> str:
    """``repr`` cut to ``limit`` characters, for error lines that quote hostile input."""
    text = value if isinstance(value, str) and not isinstance(value, bool) else repr(value)
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
