"""Hostile inputs for every ``baler-lit`` file command: targeted attacks and seeded random mutations, and a runner.

Used by ``tests/test_trust_baler.py`` and ``tests/test_trust_fuzz.py`` (a seeded sample) and by
``benchmarks/fuzz.py`` (thousands); also a script that prints the ``.baler`` results table (case class x
outcome)::

    PYTHONPATH=. python tests/baler_fuzz.py [N_RANDOM_SEED]

The ``.baler`` cases (:func:`build_cases`) are files that ``decompress`` must refuse: exit code 2, exactly one
line on stderr, no output file and no temporary file left, no crash, and memory bounded (the runner sets
``RLIMIT_AS`` to its address-space size after the imports plus ``MEMORY_HEADROOM``). Random edits only touch
what the reader must check (header fields, array bytes covered by the checksum and CRC, the archive's
length), so a valid file cannot come out of them by chance: fields the reader ignores (``config``,
``library_version``) and zip metadata nobody verifies (timestamps) are left alone.

:func:`build_all_cases` adds crafted checkpoints for ``compress`` (:func:`checkpoint_cases`), crafted
``.npz`` inputs for ``compress --input`` and ``evaluate`` (:func:`npz_cases`) and re-signed corrections and
constants that do not fit their columns (:func:`written_value_cases`), and gives each ``.baler`` to ``info``
and ``evaluate --compressed`` too. :func:`verdict` names each outcome: good are a one-line refusal with exit
code 2 and nothing written, or, for a :class:`Case` whose mutation can leave a valid input (``may_pass``),
exit code 0 with valid output (:func:`written_output_problem`: a restored file's values finite and
representable in each column's dtype); bad are a traceback, a signal, an allocation beyond the limit, stray
files, bad data written, and a peak RSS beyond ``RSS_FACTOR`` x the honest input's for the same command.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fractions
import io
import json
import math
import os
import random
import struct
import subprocess
import sys
import zipfile
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
#: Where the runner imports baler_lit from (another checkout to compare, e.g. the code before the fix).
CODE = Path(os.environ.get("BALER_FUZZ_CODE", REPO))
#: Address space the runner may add to what it has after importing torch (bytes).
MEMORY_HEADROOM = 256 * 2**20
#: Uncompressed size of the deflate bomb in ``header.json`` (bytes): above the headroom, ~0.3 MB on disk.
BOMB_BYTES = 320 * 2**20

# values that are wrong for every header field the reader checks (none is a valid count, dtype, name ...)
NASTY = [-1, 0, 2**63, 10**30, 1e308, 1.5, float("nan"), "", "x" * 300, "|O", ">f8", "<c16", "object", None, True,
         [], {}, [-1], [2**41], [[1]], {"a": 1}, "float16"]
# (path in the header, whether the checksum is recomputed after the edit: an attacker can)
FIELDS = [
    ("magic",), ("format_version",), ("model", "name"), ("model", "input_shape"), ("model", "latent_dim"),
    ("model", "dtype"), ("model", "kwargs"), ("latent_dtype",), ("n_rows",), ("sample_shape",), ("frames",),
    ("names",), ("dtypes",), ("original_bytes",), ("arrays",), ("checksum_sha256",),
    ("arrays", "latent", "dtype"), ("arrays", "latent", "shape"), ("arrays", "latent", "nbytes"),
    ("arrays", "decoder.0.weight", "dtype"), ("arrays", "decoder.0.weight", "shape"),
    ("arrays", "decoder.0.weight", "nbytes"), ("arrays", "norm_min", "dtype"), ("arrays", "norm_scale", "shape"),
    ("arrays", "data_min", "shape"), ("arrays", "data_max", "dtype"), ("model", "input_shape", 0),
    ("sample_shape", 0), ("dtypes", 0), ("arrays", "latent", "shape", 0), ("arrays", "latent", "shape", 1),
    ("constants",), ("constants", "count"), ("corrections",),
]
REQUIRED = ["magic", "format_version", "model", "latent_dtype", "n_rows", "sample_shape", "frames", "names",
            "dtypes", "original_bytes", "arrays", "checksum_sha256", "constants", "corrections"]


def make_valid_file(path: Path, rows: int = 600) -> Path:
    """A valid ``.baler`` of an untrained AE over synthetic jets (format fuzzing needs no training)."""
    import torch

    from baler_lit.compression import compress
    from baler_lit.models import build_model
    from baler_lit.normalization import MinMaxNormalizer
    from baler_lit.synthetic import synthetic_cms_jets

    torch.manual_seed(0)
    table = synthetic_cms_jets(rows, seed=3)
    model = build_model("AE", table.sample_shape, 15)
    compress(model, MinMaxNormalizer.fit(table.data), table, path, "float32", {"model": "AE"})
    return path


class Archive:
    """A ``.baler`` file taken apart: entries (name -> bytes) and the parsed header."""

    def __init__(self, path: Path) -> None:
        with zipfile.ZipFile(path) as zf:
            self.entries = {n: zf.read(n) for n in zf.namelist()}
        self.header = json.loads(self.entries["header.json"])

    def arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for name, spec in self.header["arrays"].items():
            raw = self.entries.get(f"arrays/{name}.bin", b"")
            try:
                out[name] = np.frombuffer(raw, dtype=np.dtype(spec["dtype"]))
            except Exception:
                out[name] = np.frombuffer(raw, dtype=np.uint8)
        return out

    def resign(self, header: dict) -> None:
        """Recompute the checksum as an attacker would (over raw bytes, whatever the declared dtype)."""
        import hashlib

        from baler_lit.file_format import canonical_header

        digest = hashlib.sha256(canonical_header(header))
        names = header["arrays"] if isinstance(header.get("arrays"), dict) else {}
        for name in sorted(names):
            digest.update(str(name).encode())
            digest.update(self.entries.get(f"arrays/{name}.bin", b""))
        header["checksum_sha256"] = digest.hexdigest()

    def write(self, path: Path, header: dict | None = None, raw_header: bytes | None = None,
              compress: dict[str, int] | None = None) -> Path:
        entries = dict(self.entries)
        if raw_header is not None:
            entries["header.json"] = raw_header
        elif header is not None:
            entries["header.json"] = json.dumps(header).encode()
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in entries.items():
                zf.writestr(name, data, compress_type=(compress or {}).get(name, zipfile.ZIP_STORED))
        return path


def _set(header: dict, path: tuple, value) -> bool:
    node = header
    for key in path[:-1]:
        if isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            return False
    last = path[-1]
    if isinstance(node, list) and isinstance(last, int) and last < len(node) or isinstance(node, dict):
        node[last] = value
        return True
    return False


def _get(header: dict, path: tuple):
    node = header
    for key in path:
        node = node[key]
    return node


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def targeted_cases(base: Archive, valid: Path, out: Path) -> dict[str, Path]:
    """The attacks of issue 13, one file each (name -> path)."""
    cases: dict[str, Path] = {}

    def edit(name: str, change, resign: bool = True) -> None:
        header = copy.deepcopy(base.header)
        change(header)
        if resign:
            base.resign(header)
        cases[name] = base.write(out / f"{name}.baler", header)

    for array in ("latent", "decoder.0.weight", "norm_min"):
        for dtype in ("|O", ">f4", "<c16", "|V8", "<M8[s]", "<U2", "|S4", "<f4"):
            spec = base.header["arrays"][array]
            if dtype == spec["dtype"]:
                continue

            def change(h, array=array, dtype=dtype):
                h["arrays"][array]["dtype"] = dtype
                itemsize = np.dtype(dtype).itemsize
                if spec["nbytes"] % itemsize == 0:  # keep the byte count right: only the dtype is wrong
                    h["arrays"][array]["shape"] = [spec["nbytes"] // itemsize]
                    h["arrays"][array]["nbytes"] = spec["nbytes"]

            edit(f"dtype {dtype} on {array}", change)
    edit("object dtype, checksum not recomputed", lambda h: h["arrays"]["latent"].update(dtype="|O"), resign=False)
    edit("structured dtype", lambda h: h["arrays"]["latent"].update(dtype=[["a", "<f4"]]))
    edit("column dtypes object", lambda h: h.update(dtypes=["object"] * len(h["dtypes"])))
    edit("column dtypes of another table", lambda h: h.update(dtypes=h["dtypes"][:-1]))
    edit("names of another table", lambda h: h.update(names=h["names"][:-2]))
    edit("n_rows x100", lambda h: h.update(n_rows=h["n_rows"] * 100, original_bytes=h["original_bytes"] * 100))
    edit("n_rows and latent shape x100", lambda h: (
        h.update(n_rows=h["n_rows"] * 100, original_bytes=h["original_bytes"] * 100),
        h["arrays"]["latent"].update(shape=[h["n_rows"], h["model"]["latent_dim"]],
                                     nbytes=h["n_rows"] * h["model"]["latent_dim"] * 4)))
    edit("model hidden sizes 10^5", lambda h: h["model"].update(kwargs={"hidden": [100000, 100000, 50]}))
    edit("model input_shape 10^9", lambda h: (h["model"].update(input_shape=[10**9]), h.update(sample_shape=[10**9])))
    edit("model latent_dim 10^9", lambda h: h["model"].update(latent_dim=10**9))
    edit("model kwargs unknown", lambda h: h["model"].update(kwargs={"evil": 1}))
    edit("model ConvAE channels 10^6", lambda h: h["model"].update(name="ConvAE", kwargs={"channels": [10**6]}))
    edit("frames flag flipped", lambda h: h.update(frames=True))
    edit("norm shape of frames", lambda h: h["arrays"]["norm_min"].update(shape=[4, 6]))
    edit("extra array in header", lambda h: h["arrays"].update(evil={"dtype": "<f8", "shape": [1], "nbytes": 8}))
    edit("checksum field missing", lambda h: h.pop("checksum_sha256"), resign=False)
    edit("format version 3", lambda h: h.update(format_version=3))
    edit("n_rows 2^80", lambda h: h.update(n_rows=2**80))

    text = json.dumps(base.header).encode()
    cases["header not UTF-8"] = base.write(out / "nonutf8.baler", raw_header=b"\xff\xfe" + text)
    cases["header deeply nested"] = base.write(out / "nested.baler", raw_header=b"[" * 200000 + b"]" * 200000)
    rows = f'"n_rows": {base.header["n_rows"]}'.encode()
    cases["header 5000-digit integer"] = base.write(
        out / "digits.baler", raw_header=text.replace(rows, b'"n_rows": ' + b"9" * 5000, 1))
    cases["header a list"] = base.write(out / "list.baler", raw_header=b"[1, 2]")
    cases["header 2 MB of names"] = base.write(
        out / "bignames.baler",
        raw_header=json.dumps({**base.header, "names": ["n" * 100] * 21000}).encode())
    cases["deflate bomb in header.json"] = _bomb(base, out / "bomb_header.baler", "header.json", BOMB_BYTES)
    cases["deflate bomb in latent"] = _bomb(base, out / "bomb_latent.baler", "arrays/latent.bin", 2**25)
    cases["duplicate entry"] = _with_extra(base, out / "dup.baler", "arrays/latent.bin",
                                           base.entries["arrays/latent.bin"])
    cases["extra entry"] = _with_extra(base, out / "extra.baler", "evil.bin", b"\0" * 8)
    cases["no header.json"] = _without(base, out / "noheader.baler", "header.json")
    cases["no latent entry"] = _without(base, out / "nolatent.baler", "arrays/latent.bin")
    cases["empty file"] = _raw(out / "empty.baler", b"")
    cases["not a zip"] = _raw(out / "text.baler", b"hello " * 100)
    cases["latent not finite (re-signed)"] = _nonfinite_latent(base, out / "inf_latent.baler")
    cases["norm scale zero (re-signed)"] = _array_values(base, out / "zero_scale.baler", "norm_scale", 0.0)
    cases["data range NaN (re-signed)"] = _array_values(base, out / "nan_range.baler", "data_min", float("nan"))
    return cases


def _bomb(base: Archive, path: Path, entry: str, size: int) -> Path:
    """``entry`` replaced by ``size`` bytes of blanks, deflated (~1000:1), with correct CRC and sizes.

    The deflate stream repeats one fully flushed block, so building it costs no compression time.
    """
    block = b" " * 2**22
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH)
    repeats = size // len(block)
    crc = 0
    for _ in range(repeats):
        crc = zlib.crc32(block, crc)
    members = [(n, zipfile.ZIP_STORED, zlib.crc32(d), d, len(d)) for n, d in base.entries.items() if n != entry]
    members.append((entry, zipfile.ZIP_DEFLATED, crc, piece * repeats + packer.flush(), len(block) * repeats))
    return _zip_by_hand(path, members)


def _zip_by_hand(path: Path, members: list[tuple[str, int, int, bytes, int]]) -> Path:
    """A zip archive of (name, method, CRC-32, stored bytes, uncompressed size) members, written field by field."""
    local, central = bytearray(), bytearray()
    for name, method, crc, data, size in members:
        raw = name.encode()
        central += struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, method, 0, 33, crc, len(data), size,
                               len(raw), 0, 0, 0, 0, 0, len(local)) + raw
        local += struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, method, 0, 33, crc, len(data), size, len(raw),
                             0) + raw + data
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(local), 0)
    path.write_bytes(bytes(local + central + end))
    return path


def _with_extra(base: Archive, path: Path, name: str, data: bytes) -> Path:
    base.write(path)
    with warnings_ignored(), zipfile.ZipFile(path, "a") as zf:
        zf.writestr(name, data)
    return path


@contextlib.contextmanager
def warnings_ignored():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _without(base: Archive, path: Path, name: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in base.entries.items():
            if n != name:
                zf.writestr(n, data)
    return path


def _raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _resigned_with(base: Archive, path: Path, entries: dict[str, bytes]) -> Path:
    clone = copy.copy(base)
    clone.entries = {**base.entries, **entries}
    header = copy.deepcopy(base.header)
    clone.resign(header)
    return clone.write(path, header)


def _nonfinite_latent(base: Archive, path: Path) -> Path:
    latent = base.arrays()["latent"].copy()
    latent[::7] = np.inf
    return _resigned_with(base, path, {"arrays/latent.bin": latent.tobytes()})


def _array_values(base: Archive, path: Path, name: str, value: float) -> Path:
    arr = base.arrays()[name].copy()
    arr[:] = value
    return _resigned_with(base, path, {f"arrays/{name}.bin": arr.tobytes()})


def random_cases(base: Archive, valid: Path, out: Path, seed: int = 13) -> dict[str, Path]:
    """Seeded random mutations: header field edits and deletions (re-signed), byte flips, truncations."""
    rng = random.Random(seed)
    blob = valid.read_bytes()
    cases: dict[str, Path] = {}
    for i in range(70):
        field = rng.choice(FIELDS)
        header = copy.deepcopy(base.header)
        try:
            old = _get(header, field)
        except (KeyError, IndexError, TypeError):
            continue
        value = rng.choice([v for v in NASTY if not _same(v, old)])
        if not _set(header, field, value):
            continue
        if field != ("checksum_sha256",):
            base.resign(header)
        cases[f"edit {'.'.join(map(str, field))} = {str(value)[:12]} #{i}"] = base.write(out / f"edit{i}.baler", header)
    for i in range(20):
        header = copy.deepcopy(base.header)
        key = rng.choice(REQUIRED)
        header.pop(key)
        if key != "checksum_sha256":
            base.resign(header)
        cases[f"delete {key} #{i}"] = base.write(out / f"del{i}.baler", header)
    for i in range(20):
        header = copy.deepcopy(base.header)
        name = rng.choice(sorted(header["arrays"]))
        header["arrays"][name][rng.choice(["dtype", "shape", "nbytes"])] = rng.choice(
            [rng.randrange(1, 2**45), [rng.randrange(0, 10**7)], [rng.randrange(1, 5000), rng.randrange(1, 5000)],
             rng.choice(["<f8", "<f2", "<i8", "<u2", "|u1", "<f4"])])
        base.resign(header)
        if _same(header["arrays"][name], base.header["arrays"][name]):
            continue
        cases[f"size field of {name} #{i}"] = base.write(out / f"size{i}.baler", header)
    with zipfile.ZipFile(valid) as zf:
        spans = [(i.header_offset + 30 + len(i.filename), i.file_size) for i in zf.infolist()]
    for i in range(30):  # flipped bytes inside entries (covered by CRC-32 and the checksum)
        data = bytearray(blob)
        start, size = rng.choice(spans)
        for _ in range(rng.randint(1, 4)):
            data[start + rng.randrange(size)] ^= 1 << rng.randrange(8)
        cases[f"flipped bits #{i}"] = _raw(out / f"flip{i}.baler", bytes(data))
    for i in range(60):
        keep = rng.randrange(0, len(blob) - 1)
        cases[f"truncated at {keep} #{i}"] = _raw(out / f"cut{i}.baler", blob[:keep])
    return cases


def kind(name: str) -> str:
    """The class of a case for the results table."""
    for prefix, label in (("edit ", "random header edit (re-signed)"), ("delete ", "field deleted (re-signed)"),
                          ("size field", "dtype/shape/size field (re-signed)"), ("flipped", "flipped bits in entries"),
                          ("truncated", "truncation"), ("dtype ", "non-whitelisted dtype"),
                          ("object", "non-whitelisted dtype"), ("structured", "non-whitelisted dtype"),
                          ("model ", "model size/description"), ("n_rows", "row count vs archive"),
                          ("deflate", "deflate bomb"), ("header", "malformed header.json"),
                          ("column", "names/dtypes vs data"), ("names", "names/dtypes vs data")):
        if name.startswith(prefix):
            return label
    return "other crafted archive"


def build_cases(folder: Path, seed: int = 13) -> tuple[Path, dict[str, Path]]:
    folder.mkdir(parents=True, exist_ok=True)
    valid = make_valid_file(folder / "valid.baler")
    base = Archive(valid)
    cases_dir = folder / "cases"
    cases_dir.mkdir(exist_ok=True)
    cases = {**targeted_cases(base, valid, cases_dir), **random_cases(base, valid, cases_dir, seed)}
    return valid, cases


# -- the other inputs: checkpoints for `compress`, npz files for `compress` and `evaluate` ---------------------
#: Rows of the honest table (synthetic CMS jets, seed 3: the table of :func:`make_valid_file`).
HONEST_ROWS = 600
#: Uncompressed size of the deflate bomb in an npz's ``data.npy`` (bytes): above the headroom, ~0.8 MB on disk;
#: a whole number of 4 MiB blocks and of 24-column float64 rows.
NPZ_BOMB_BYTES = 3 * 2**28
#: Values written over error-bound corrections and constant columns: each lands outside some column's dtype
#: (not finite in float32, a fraction or beyond the range in int32) or, like 0.25 in a float column, is harmless.
HOSTILE_VALUES = [1e300, -1e300, 3.5e38, 0.5, 0.25, 3e9, 2.0**31, -(2.0**31) - 1, 1e39, float("inf"), float("nan")]


@dataclasses.dataclass
class Case:
    """One hostile input: the command it is given to (a key of :data:`COMMANDS`), its file, and whether the
    command may accept it (``may_pass``: the mutation can leave a valid input, e.g. a weight's bits flipped;
    then rc 0 is fine if what is written is valid)."""

    command: str
    path: Path
    may_pass: bool = False


@dataclasses.dataclass
class Honest:
    """The unmutated inputs every mutation starts from."""

    npz: Path  #: the table (.npz) the checkpoint and the .baler were made for
    ckpt: Path  #: a checkpoint as BalerModule saves it
    baler: Path  #: a .baler without corrections
    corrected: Path  #: a .baler with a constant column and error-bound corrections


def honest_table():
    from baler_lit.synthetic import synthetic_cms_jets

    return synthetic_cms_jets(HONEST_ROWS, seed=3)


def make_checkpoint(path: Path, table) -> Path:
    """A checkpoint of an untrained AE as ``BalerModule`` saves one: ``state_dict`` (``model.`` keys),
    ``hyper_parameters`` and the ``baler`` section (normaliser, column names and dtypes)."""
    import torch

    from baler_lit.models import build_model
    from baler_lit.normalization import MinMaxNormalizer

    torch.manual_seed(0)
    model = build_model("AE", table.sample_shape, 15)
    norm = MinMaxNormalizer.fit(table.data)
    torch.save({
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "hyper_parameters": {"input_shape": list(table.sample_shape), "model": "AE", "latent_dim": 15,
                             "compression_ratio": 1.6, "dtype": "float32", "model_kwargs": None},
        "baler": {"norm_min": norm.minimum.tolist(), "norm_scale": norm.scale.tolist(), "names": list(table.names),
                  "dtypes": list(table.dtypes)},
    }, path)  # fmt: skip
    return path


def make_corrected_file(path: Path, table) -> Path:
    """A valid ``.baler`` with one constant integer column and error-bound corrections (absolute 0.01)."""
    import torch

    from baler_lit.compression import compress
    from baler_lit.error_bound import ErrorBound
    from baler_lit.models import build_model
    from baler_lit.normalization import MinMaxNormalizer
    from baler_lit.table import Table

    data = table.data.copy()
    data[:, table.dtypes.index("int32")] = 7
    constant = Table(data, names=table.names, dtypes=table.dtypes, source="constant column")
    torch.manual_seed(0)
    model = build_model("AE", table.sample_shape, 15)
    compress(model, MinMaxNormalizer.fit(data), constant, path, "float32", {"model": "AE"},
             error_bound=ErrorBound(None, 0.01))
    return path


def make_honest(folder: Path) -> Honest:
    from baler_lit.table import save_npz

    folder.mkdir(parents=True, exist_ok=True)
    table = honest_table()
    return Honest(save_npz(folder / "original.npz", table), make_checkpoint(folder / "model.ckpt", table),
                  make_valid_file(folder / "valid.baler", HONEST_ROWS), make_corrected_file(folder / "corrected.baler",
                                                                                             table))


def _edited_checkpoint(ckpt: dict, section: str, key, value) -> dict:
    edited = copy.copy(ckpt)
    edited[section] = {**ckpt[section]}
    if value is _DELETE:
        edited[section].pop(key, None)
    else:
        edited[section][key] = value
    return edited


_DELETE = object()
#: (hyper-parameter, hostile value, whether a loader may accept it): sizes that would allocate gigabytes, wrong types
CHECKPOINT_HPARAMS = [
    # latent_dim deleted: compression_ratio 1.6 gives the same 15 (valid)
    ("model_kwargs", {"hidden": [60000, 60000, 50]}, False), ("model_kwargs", {"hidden": [10**5]}, False),
    ("model_kwargs", {"hidden": [7000, 7000, 50]}, False), ("model_kwargs", {"hidden": [-1]}, False),
    ("model_kwargs", {"hidden": ["x"]}, False), ("model_kwargs", {"hidden": 1.5}, False),
    ("model_kwargs", {"evil": 1}, False), ("model_kwargs", [1, 2], False), ("latent_dim", 10**9, False),
    ("latent_dim", -1, False), ("latent_dim", 0, False), ("latent_dim", 1.5, False), ("latent_dim", "x", False),
    ("latent_dim", 2**70, False), ("input_shape", [10**9], False), ("input_shape", [10**6, 10**6], False),
    ("input_shape", [], False), ("input_shape", [-24], False), ("input_shape", ["a"], False),
    ("input_shape", "24", False), ("input_shape", [2**64], False), ("model", "Evil", False), ("model", 3, False),
    ("dtype", "object", False), ("dtype", "int8", False), ("dtype", "complex64", False), ("dtype", "x", False),
    ("dtype", "float64", True), ("latent_dim", _DELETE, True), ("input_shape", _DELETE, False),
]
#: (section key, hostile value) of the checkpoint's ``baler`` section (the normaliser and the columns)
CHECKPOINT_COLUMNS = [
    ("norm_min", [0.0] * 23), ("norm_min", "x"), ("norm_min", [[1.0]] * 24), ("norm_min", [float("nan")] * 24),
    ("norm_scale", [0.0] * 24), ("norm_scale", [-1.0] * 24), ("norm_scale", [float("inf")] * 24),
    ("norm_scale", [1e308] * 24), ("names", ["a"] * 23), ("names", 5), ("names", None), ("dtypes", ["object"] * 24),
    ("dtypes", ["x"] * 24), ("dtypes", ["float32"] * 23), ("dtypes", 7), ("norm_min", _DELETE), ("names", _DELETE),
]
#: ``baler`` section keys ``compress`` may ignore: an input .npz that states its own dtypes wins over the checkpoint's
IGNORED_WITH_STATED_DTYPES = ("dtypes",)


def checkpoint_cases(ckpt_path: Path, out: Path, seed: int = 13, n_random: int = 60) -> dict[str, Case]:
    """Crafted checkpoints for ``compress``: hostile hyper-parameters (model sizes that would allocate
    gigabytes), state-dict tensors of other shapes and dtypes, a damaged ``baler`` section, broken
    structure, and seeded random truncations and flipped bits."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    ckpt = torch.load(ckpt_path, weights_only=True)
    cases: dict[str, Case] = {}

    def save(name: str, obj, may_pass: bool = False) -> None:
        path = out / f"ckpt{len(cases)}.ckpt"
        torch.save(obj, path)
        cases[f"ckpt: {name}"] = Case("compress", path, may_pass)

    for key, value, may_pass in CHECKPOINT_HPARAMS:
        shown = "deleted" if value is _DELETE else json.dumps(value)[:40]
        save(f"hyper-parameter {key} = {shown}", _edited_checkpoint(ckpt, "hyper_parameters", key, value), may_pass)
    for key, value in CHECKPOINT_COLUMNS:
        shown = "deleted" if value is _DELETE else json.dumps(value)[:30]
        save(f"baler section {key} = {shown}", _edited_checkpoint(ckpt, "baler", key, value),
             may_pass=key in IGNORED_WITH_STATED_DTYPES)
    weights = sorted(ckpt["state_dict"])
    for key in weights[:2] + weights[-2:]:
        tensor = ckpt["state_dict"][key]
        for label, changed, may_pass in (
            ("transposed", tensor.T.contiguous() if tensor.dim() == 2 else tensor.repeat(2), False),
            ("one row more", torch.cat([tensor, tensor[:1]]), False),
            ("float64", tensor.double(), True), ("int8", tensor.to(torch.int8), True),
            ("complex64", tensor.to(torch.complex64), False), ("NaN", torch.full_like(tensor, float("nan")), False),
            ("4096 times larger", tensor.repeat(4096, *[1] * (tensor.dim() - 1)), False),
        ):  # fmt: skip
            save(f"weight {key} {label}", _edited_checkpoint(ckpt, "state_dict", key, changed), may_pass)
    save("weight missing", _edited_checkpoint(ckpt, "state_dict", weights[0], _DELETE))
    save("weight extra", _edited_checkpoint(ckpt, "state_dict", "model.evil", torch.zeros(3)))
    save("not a dict", [1, 2, 3])
    save("state_dict a list", {**ckpt, "state_dict": [1]})
    save("no hyper_parameters", {k: v for k, v in ckpt.items() if k != "hyper_parameters"})
    save("no baler section", {k: v for k, v in ckpt.items() if k != "baler"})
    save("baler section a string", {**ckpt, "baler": "x"})
    with contextlib.suppress(Exception):
        save("a pickled object (weights_only refuses it)", {**ckpt, "evil": fractions.Fraction(1, 3)})
    cases["ckpt: empty file"] = Case("compress", _raw(out / "empty.ckpt", b""))
    cases["ckpt: not a zip"] = Case("compress", _raw(out / "text.ckpt", b"hello " * 100))
    blob = ckpt_path.read_bytes()
    rng = random.Random(seed)
    for i in range(n_random):
        if rng.random() < 0.5:
            keep = rng.randrange(0, len(blob) - 1)
            cases[f"ckpt: truncated at {keep} #{i}"] = Case("compress", _raw(out / f"cut{i}.ckpt", blob[:keep]))
        else:  # torch does not check the CRC of tensor data: a flipped weight can load and compress validly
            data = bytearray(blob)
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            cases[f"ckpt: flipped bits #{i}"] = Case("compress", _raw(out / f"flip{i}.ckpt", bytes(data)), True)
    return cases


def _npy(array_header: dict | str | bytes, payload: bytes = b"") -> bytes:
    """An ``.npy`` file of the given header (a dict is written as numpy writes one) and payload bytes."""
    if isinstance(array_header, dict):
        text = repr(array_header).encode()
    else:
        text = array_header if isinstance(array_header, bytes) else array_header.encode()
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + payload


def _npz(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _npz_bomb(path: Path, members: dict[str, bytes], rows: int) -> Path:
    """``data.npy`` declaring ``rows`` x 24 float64 zeros, deflated (~1000:1), CRC and sizes right."""
    header = _npy({"descr": "<f8", "fortran_order": False, "shape": (rows, 24)})
    block = bytes(2**22)
    total = rows * 24 * 8
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    start = packer.compress(header) + packer.flush(zlib.Z_FULL_FLUSH)
    piece = packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH)  # a full flush: the piece stands alone
    crc = zlib.crc32(header)
    for _ in range(total // len(block)):
        crc = zlib.crc32(block, crc)
    stream = start + piece * (total // len(block)) + packer.flush()
    others = [(n, zipfile.ZIP_STORED, zlib.crc32(d), d, len(d)) for n, d in members.items() if n != "data.npy"]
    return _zip_by_hand(path, [("data.npy", zipfile.ZIP_DEFLATED, crc, stream, len(header) + total), *others])


def npz_cases(npz_path: Path, out: Path, seed: int = 13, n_random: int = 60) -> dict[str, Case]:
    """Crafted ``.npz`` inputs for ``compress --input`` and ``evaluate --original``: deflate bombs, headers
    declaring huge shapes, wrong and object dtypes, truncated members, damaged ``names``/``dtypes``, and
    seeded random header edits, truncations and flipped bits."""
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(npz_path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    with np.load(npz_path) as npz:
        data = npz["data"]
    cases: dict[str, Case] = {}
    payload = data.tobytes()

    def add(name: str, changed: dict[str, bytes | None], may_pass: bool = False) -> None:
        entries = {n: d for n, d in {**members, **changed}.items() if d is not None}
        cases[f"npz: {name}"] = Case("evaluate --original", _npz(out / f"npz{len(cases)}.npz", entries), may_pass)

    def header(**fields) -> dict:
        return {"descr": data.dtype.str, "fortran_order": False, "shape": data.shape, **fields}

    cases["npz: deflate bomb in data.npy"] = Case("evaluate --original", _npz_bomb(
        out / "bomb.npz", members, NPZ_BOMB_BYTES // (24 * 8)))
    for shape in ((10**12, 24), (2**40, 24), (2**62, 2**62), (600, 10**12), (10**9,), (-1, 24), (600, 24, 10**9)):
        add(f"header declares shape {shape}", {"data.npy": _npy(header(shape=shape), payload)})
    for descr in ("|O", "<c16", "<U8", "|S8", "|b1", "<M8[s]", "|V8", "<m8[s]", [("a", "<f8")], ">f8", "<f2", "|i1"):
        itemsize = np.dtype(descr).itemsize
        rows = len(payload) // (24 * itemsize)
        add(f"data dtype {descr}", {"data.npy": _npy(header(descr=descr, shape=(rows, 24)),
                                                     payload[:rows * 24 * itemsize])},
            may_pass=np.dtype(descr).kind in "fib")
    add("object array of pickles", {"data.npy": _npy(header(descr="|O"), b"\x80\x04N.")})
    add("data.npy truncated", {"data.npy": members["data.npy"][: len(members["data.npy"]) // 2]})
    add("data.npy header only", {"data.npy": _npy(header())})
    add("header length beyond the member", {"data.npy": b"\x93NUMPY\x01\x00\xff\xff{'descr'"})
    add("header not a dict", {"data.npy": _npy("[1, 2, 3]", payload)})
    add("header an expression", {"data.npy": _npy("__import__('os').system('true')", payload)})
    add("header 10^6 nested lists", {"data.npy": b"\x93NUMPY\x02\x00" + struct.pack("<I", 2 * 10**6 + 1)
                                     + b"[" * 10**6 + b"]" * 10**6 + b"\n"})
    add("fortran order", {"data.npy": _npy(header(fortran_order=True), np.asfortranarray(data).tobytes("F"))}, True)
    add("data 1-D", {"data.npy": _npy(header(shape=(data.size,)), payload)})
    add("data 4-D", {"data.npy": _npy(header(shape=(HONEST_ROWS, 2, 3, 4)), payload)})
    add("data 0-D", {"data.npy": _npy(header(shape=()), payload[:8])})
    add("zero rows", {"data.npy": _npy(header(shape=(0, 24)))})
    add("NaN values", {"data.npy": _npy(header(), np.full_like(data, np.nan).tobytes())})
    add("inf values", {"data.npy": _npy(header(), np.full_like(data, np.inf).tobytes())})
    add("no data member", {"data.npy": None})
    add("names of 23 columns", {"names.npy": _npy_of(np.array(["n"] * 23))})
    add("names numbers", {"names.npy": _npy_of(np.arange(24))})
    add("names object", {"names.npy": _npy({"descr": "|O", "fortran_order": False, "shape": (24,)}, b"\x80\x04N.")})
    add("names 2-D", {"names.npy": _npy_of(np.array([["n"] * 24] * 2))})
    add("dtypes object", {"dtypes.npy": _npy_of(np.array(["object"] * 24))})
    add("dtypes garbage", {"dtypes.npy": _npy_of(np.array(["x"] * 24))})
    add("dtypes of 23 columns", {"dtypes.npy": _npy_of(np.array(["float32"] * 23))})
    add("dtypes numbers", {"dtypes.npy": _npy_of(np.arange(24.0))})
    add("dtypes int8 for float data", {"dtypes.npy": _npy_of(np.array(["int8"] * 24))}, may_pass=True)
    # numpy reads a member's declared bytes and stops: zipfile checks the CRC-32 only at a member's end, so a
    # wrong CRC over intact data may pass (rc 0 with the true data is then fine)
    crc_wrong = [(n, zipfile.ZIP_STORED, zlib.crc32(d) ^ (n == "data.npy"), d, len(d)) for n, d in members.items()]
    cases["npz: data.npy CRC-32 wrong"] = Case("evaluate --original", _zip_by_hand(out / "crc.npz", crc_wrong), True)
    cases["npz: empty file"] = Case("evaluate --original", _raw(out / "empty.npz", b""))
    cases["npz: not a zip"] = Case("evaluate --original", _raw(out / "text.npz", b"hello " * 100))
    cases["npz: an .npy named .npz"] = Case("evaluate --original", _raw(out / "single.npz", members["data.npy"]))

    rng = random.Random(seed)
    blob = npz_path.read_bytes()
    for i in range(n_random):
        pick = rng.random()
        if pick < 0.4:
            shape = rng.choice([(rng.randrange(1, 2**50), 24), (HONEST_ROWS, rng.randrange(1, 10**7)),
                                (rng.randrange(0, 10**5),), (rng.randrange(1, 3000), rng.randrange(1, 3000))])
            descr = rng.choice(["<f8", "<f4", "<i8", "|u1", ">f8", "<f2", "|O", "<c8", "<U3"])
            add(f"random header shape {shape} dtype {descr} #{i}", {"data.npy": _npy(header(descr=descr, shape=shape),
                                                                                     payload)},
                may_pass=np.dtype(descr).kind in "fi" and shape[0] * np.dtype(descr).itemsize * math.prod(shape[1:])
                == len(payload) and len(shape) == 2 and shape[-1] == 24)
        elif pick < 0.7:
            keep = rng.randrange(0, len(blob) - 1)
            truncated = _raw(out / f"cut{i}.npz", blob[:keep])
            cases[f"npz: truncated at {keep} #{i}"] = Case("evaluate --original", truncated)
        else:  # zipfile checks each member's CRC-32; a flip in zip metadata nobody reads can leave a valid file
            flipped = bytearray(blob)
            for _ in range(rng.randint(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            cases[f"npz: flipped bits #{i}"] = Case("evaluate --original", _raw(out / f"flip{i}.npz", bytes(flipped)),
                                                    True)
    return cases


def _npy_of(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def written_value_cases(corrected: Path, out: Path, seed: int = 13, n_random: int = 20) -> dict[str, Case]:
    """Re-signed ``.baler`` files whose error-bound corrections or constant-column values do not fit the
    columns (1e300 overflows float32, 0.5 is no int32): ``decompress`` must refuse them or write only values
    each column's dtype can hold (:func:`restored_data_problem`)."""
    out.mkdir(parents=True, exist_ok=True)
    base = Archive(corrected)
    spec = base.header["corrections"]
    value_dtype = np.dtype(spec["value_dtype"])
    stored = np.frombuffer(zlib.decompress(base.entries["arrays/corrections_value.bin"]), dtype=value_dtype)
    constants = np.frombuffer(base.entries["arrays/constant_value.bin"], dtype="<f8")
    cases: dict[str, Case] = {}

    def resigned(name: str, entry: str, values: np.ndarray) -> None:
        raw = zlib.compress(values.tobytes()) if entry == "corrections_value" else values.tobytes()
        header = copy.deepcopy(base.header)
        header["arrays"][entry].update(shape=[len(raw)] if entry == "corrections_value" else [len(values)],
                                       nbytes=len(raw))
        clone = copy.copy(base)
        clone.entries = {**base.entries, f"arrays/{entry}.bin": raw}
        clone.resign(header)
        cases[f"values: {name}"] = Case("decompress", clone.write(out / f"values{len(cases)}.baler", header), True)

    with np.errstate(over="ignore", invalid="ignore"):
        for value in HOSTILE_VALUES:
            resigned(f"every correction = {value:g}", "corrections_value", np.full_like(stored, value))
            resigned(f"constant column = {value:g}", "constant_value", np.full_like(constants, value))
        rng = random.Random(seed)
        for i in range(n_random):
            values = stored.copy()
            picks = rng.sample(range(len(values)), min(len(values), rng.randint(1, 20)))
            values[picks] = rng.choice(HOSTILE_VALUES)
            resigned(f"random corrections #{i}", "corrections_value", values)
    return cases


def baler_cases(folder: Path, seed: int = 13) -> dict[str, Case]:
    """The ``.baler`` attacks of :func:`build_cases`, each for ``decompress``."""
    _, cases = build_cases(folder, seed)
    return {name: Case("decompress", path) for name, path in cases.items()}


#: The other commands a case's file also goes to: a .baler to `info` and `evaluate --compressed`, an npz to
#: `compress --input` and `evaluate --restored`.
ALSO_GIVEN_TO = {"decompress": ("info", "evaluate"), "evaluate --original": ("compress --input", "evaluate --restored")}


#: Attacks ``info`` may accept: it verifies the file but decodes nothing and builds no model, so values that
#: only decoding checks (corrections, constants, latent codes) and the model's sizes are not its to refuse.
INFO_IGNORES = ("values: ", "model ", "latent not finite")
#: Attacks ``compress --input`` may accept: it streams its input block by block, so a deflate bomb of valid rows is
#: just a large input (bounded memory, the RSS check still applies)
STREAMED_BY_COMPRESS = ("npz: deflate bomb",)


def across_commands(cases: dict[str, Case]) -> dict[str, Case]:
    """Each case under its own command and under the other commands that read the same kind of file."""
    spread = {}
    for name, case in cases.items():
        spread[f"{name} [{case.command}]"] = case
        for command in ALSO_GIVEN_TO.get(case.command, ()):
            may_pass = (case.may_pass or (command == "info" and name.startswith(INFO_IGNORES))
                        or (command == "compress --input" and name.startswith(STREAMED_BY_COMPRESS)))
            spread[f"{name} [{command}]"] = Case(command, case.path, may_pass)
    return spread


def build_all_cases(folder: Path, seed: int = 13, n_random: int = 60) -> tuple[Honest, dict[str, Case]]:
    """Every attack on every command, named ``<class>: <what> [<command>]``, and the honest inputs."""
    honest = make_honest(folder / "honest")
    cases = {**baler_cases(folder / "baler", seed), **checkpoint_cases(honest.ckpt, folder / "ckpt", seed, n_random),
             **npz_cases(honest.npz, folder / "npz", seed, n_random),
             **written_value_cases(honest.corrected, folder / "values", seed, n_random // 3)}
    return honest, across_commands(cases)


def honest_cases(honest: Honest) -> dict[str, Case]:
    """One honest input per command: the baseline of peak RSS, and proof the limit alone refuses nothing."""
    cases = {f"honest [{command}]": Case(command, path, True) for command, path in (
        ("decompress", honest.baler), ("info", honest.baler), ("evaluate", honest.baler), ("compress", honest.ckpt),
        ("compress --input", honest.npz), ("evaluate --original", honest.npz), ("evaluate --restored", honest.npz))}
    return {**cases, "honest with corrections [decompress]": Case("decompress", honest.corrected, True)}


GOOD_REFUSAL = "refused: one line, rc 2"
GOOD_ACCEPTANCE = "accepted: rc 0, valid output"
GOOD = (GOOD_REFUSAL, GOOD_ACCEPTANCE)
#: What an allocation refused by RLIMIT_AS looks like: the code tried to allocate beyond the bound
ALLOCATION_FAILURES = ("can't allocate memory", "unable to allocate", "memoryerror", "out of memory", "bad_alloc",
                       "cannot allocate memory")
#: Peak RSS above this multiple of the honest input's (same command) is an outcome of its own
RSS_FACTOR = 2.0
EXPECTED_OUTPUT = {"decompress": ["restored.npz"], "compress": ["data.baler"], "evaluate": ["report"], "info": []}


def verdict(case: Case, result: dict | None, honest_rss: int | None) -> str:
    """The outcome class of one case: :data:`GOOD_REFUSAL`, :data:`GOOD_ACCEPTANCE` (only where
    ``case.may_pass``), or what went wrong."""
    if result is None:
        return "not run"
    program = COMMANDS[case.command][0]
    if result["crash"] and result["crash"].startswith("child died"):
        return "signal or killed" if result["rc"] < 0 else f"child died rc {result['rc']}"
    text = f"{result['crash'] or ''} {result['stderr']}".lower()
    if any(words in text for words in ALLOCATION_FAILURES):
        return "allocation beyond the memory limit"
    if result["crash"] or result["rc"] not in (0, 2):
        return "traceback or rc 1"
    left = result["left"]
    if left and (result["rc"] != 0 or left != EXPECTED_OUTPUT[program]):
        return "stray files"
    if result["rc"] == 0 and result["bad_data"]:
        return "bad data written"
    peak = result.get("peak_rss")
    if honest_rss and peak and peak > RSS_FACTOR * honest_rss:
        return f"peak RSS beyond {RSS_FACTOR:g}x the honest input's"
    if result["rc"] == 0:
        return GOOD_ACCEPTANCE if case.may_pass else "accepted a damaged input (rc 0)"
    err = result["stderr"]
    one_line = err.count("\n") == 1 and err.endswith("\n") and err.startswith(f"baler-lit {program}: error: ")
    return GOOD_REFUSAL if one_line else "rc 2, not one line"


#: (start of a case's name, its class of mutation) for the crafted checkpoints, npz files and values; first match
MUTATION_CLASSES = (
    ("ckpt: hyper-parameter model_kwargs", "ckpt model sizes (model_kwargs)"),
    ("ckpt: hyper-parameter latent_dim", "ckpt model sizes (latent_dim, input_shape)"),
    ("ckpt: hyper-parameter input_shape", "ckpt model sizes (latent_dim, input_shape)"),
    ("ckpt: hyper-parameter", "ckpt model name and dtype"), ("ckpt: baler section", "ckpt normaliser and columns"),
    ("ckpt: weight", "ckpt state-dict tensors"), ("ckpt: truncated", "ckpt truncation"),
    ("ckpt: flipped", "ckpt flipped bits"), ("ckpt: ", "ckpt structure"),
    ("npz: deflate bomb", "npz deflate bomb"), ("npz: header declares", "npz declared shape or dtype"),
    ("npz: random header", "npz declared shape or dtype"), ("npz: data dtype", "npz wrong or object dtype"),
    ("npz: object", "npz wrong or object dtype"), ("npz: data.npy truncated", "npz truncation"),
    ("npz: truncated", "npz truncation"), ("npz: data.npy header only", "npz truncation"),
    ("npz: header", "npz malformed .npy header"), ("npz: names", "npz names/dtypes members"),
    ("npz: dtypes", "npz names/dtypes members"), ("npz: flipped", "npz flipped bits"),
    ("npz: data.npy CRC", "npz flipped bits"), ("npz: data ", "npz data shape or values"),
    ("npz: zero rows", "npz data shape or values"), ("npz: NaN", "npz data shape or values"),
    ("npz: inf", "npz data shape or values"), ("npz: fortran", "npz data shape or values"),
    ("npz: ", "npz structure"), ("values: constant", "values constants"), ("values: ", "values corrections"),
    ("honest", "honest input"),
)


def case_class(name: str) -> str:
    """``<command> x <class of mutation>`` of a case named ``<what> [<command>]`` by :func:`build_all_cases`."""
    what, _, command = name.rpartition(" [")
    if not command.endswith("]"):
        what, command = name, "decompress]"
    label = next((label for prefix, label in MUTATION_CLASSES if what.startswith(prefix)), None)
    return f"{command[:-1]} x {label or 'baler ' + kind(what)}"


def run_all(cases: dict[str, Case], honest: Honest, work: Path, headroom: int = MEMORY_HEADROOM,
            timeout: float = 600) -> tuple[dict[str, dict], dict[str, str], dict[str, int]]:
    """Run the honest inputs then ``cases``; return (results, verdict by case name, honest peak RSS by command)."""
    baseline = honest_cases(honest)
    jobs = {**baseline, **cases}
    results = run_in_process({n: (c.command, c.path) for n, c in jobs.items()}, work, honest.npz, headroom, timeout,
                             honest.ckpt)
    honest_rss = {c.command: (results.get(n) or {}).get("peak_rss") or 0 for n, c in baseline.items()
                  if n == f"honest [{c.command}]"}
    verdicts = {n: verdict(c, results.get(n), honest_rss.get(c.command)) for n, c in jobs.items()}
    return results, verdicts, honest_rss


def class_table(verdicts: dict[str, str], results: dict[str, dict]) -> dict[str, dict]:
    """Per ``command x mutation class``: the case count, outcome counts, rc counts, signals, the largest peak RSS
    (MiB) and the cases that left stray files."""
    rows: dict[str, dict] = {}
    for name, outcome_class in verdicts.items():
        row = rows.setdefault(case_class(name), {"n": 0, "outcomes": Counter(), "rc": Counter(), "signals": 0,
                                                  "max_peak_rss_mb": 0.0, "stray_files": 0})
        result = results.get(name) or {}
        row["n"] += 1
        row["outcomes"][outcome_class] += 1
        row["rc"][str(result.get("rc"))] += 1
        row["signals"] += int((result.get("rc") or 0) < 0)
        row["max_peak_rss_mb"] = max(row["max_peak_rss_mb"], (result.get("peak_rss") or 0) / 2**20)
        row["stray_files"] += int(outcome_class == "stray files")
    return {k: {**v, "outcomes": dict(v["outcomes"]), "rc": dict(v["rc"])} for k, v in sorted(rows.items())}


def format_class_table(rows: dict[str, dict]) -> str:
    outcomes = sorted({o for row in rows.values() for o in row["outcomes"]}, key=lambda o: (o not in GOOD, o))
    width = max(len(k) for k in rows)
    lines = [f"{'command x mutation class':<{width}}  {'n':>4}  {'peak MB':>7}  " + "  ".join(outcomes)]
    for key, row in rows.items():
        lines.append(f"{key:<{width}}  {row['n']:>4}  {row['max_peak_rss_mb']:>7.0f}  "
                     + "  ".join(f"{row['outcomes'].get(o, 0):>{len(o)}}" for o in outcomes))
    return "\n".join(lines)


RUNNER = r"""
import contextlib, io, json, os, resource, sys, warnings
import baler_lit.cli, baler_lit.compression, baler_lit.evaluate, baler_lit.info  # the limit is on top of the imports
from pathlib import Path
from baler_lit.cli import run_tool
sys.path.insert(0, sys.argv[5])
from baler_fuzz import written_output_problem

def status_bytes(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

def reset_peak_rss():
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM back to the current RSS (Linux >= 4.0)

limit = status_bytes("VmSize") + int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
cases = json.loads(Path(sys.argv[1]).read_text())
log = open(Path(sys.argv[2]) / "results.jsonl", "a")
for index, (name, argv) in enumerate(cases.items()):
    log.write(json.dumps({"started": name}) + "\n")
    log.flush()
    out = Path(sys.argv[2]) / f"out-{os.getpid()}-{index}"
    out.mkdir()
    err = io.StringIO()
    reset_peak_rss()
    try:
        # fresh warning filters per case: a warning shows as in a process of its own, not only the first time
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("default")
            rc = run_tool([a.replace("{out}", str(out)) for a in argv])
        crash = None
    except BaseException as exc:
        rc, crash = 1, f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    peak = status_bytes("VmHWM")
    try:
        bad_data = written_output_problem(argv[0], out) if rc == 0 else None
    except BaseException as exc:
        bad_data = f"cannot read the output: {type(exc).__name__}: {exc}"[:200]
    result = {"rc": rc, "stderr": err.getvalue(), "crash": crash, "left": sorted(p.name for p in out.iterdir()),
              "peak_rss": peak, "bad_data": bad_data}
    log.write(json.dumps({"name": name, "result": result}) + "\n")
    log.flush()
"""

#: What each command of the runner runs (``{path}``: the case's file; ``{original}``, ``{ckpt}``: the honest
#: inputs; ``{out}``: a fresh folder per case that must stay empty unless the command succeeds).
COMMANDS = {
    "decompress": ["decompress", "--input", "{path}", "--output", "{out}/restored.npz"],
    "info": ["info", "{path}", "--json"],
    "evaluate": ["evaluate", "--original", "{original}", "--restored", "{original}", "--compressed", "{path}",
                 "--out", "{out}/report", "--no-plots"],
    "compress": ["compress", "--ckpt", "{path}", "--input", "{original}", "--output", "{out}/data.baler"],
    "compress --input": ["compress", "--ckpt", "{ckpt}", "--input", "{path}", "--output", "{out}/data.baler"],
    "evaluate --original": ["evaluate", "--original", "{path}", "--restored", "{original}", "--out", "{out}/report",
                            "--no-plots"],
    "evaluate --restored": ["evaluate", "--original", "{original}", "--restored", "{path}", "--out", "{out}/report",
                            "--no-plots"],
}


def command_argv(command: str, path: str | Path, original_npz: Path, ckpt: Path | None = None) -> list[str]:
    """The ``run_tool`` arguments of one case (``{out}`` left for the runner to fill in)."""
    values = {"{path}": str(path), "{original}": str(original_npz), "{ckpt}": str(ckpt)}
    return [values.get(a, a) for a in COMMANDS[command]]


def written_output_problem(command: str, out: Path) -> str | None:
    """What is wrong with what a command that exited 0 wrote into ``out`` (``None``: nothing).

    ``decompress``: every value finite and representable in its column's dtype (see
    :func:`restored_data_problem`); ``compress``: a ``.baler`` that verifies; ``evaluate``: a ``summary.json``.
    """
    if command == "decompress":
        return restored_data_problem(out / "restored.npz")
    if command == "compress":
        from baler_lit.compression import read_compressed

        read_compressed(out / "data.baler")
        return None
    if command == "evaluate":
        return None if (out / "report" / "summary.json").is_file() else "no summary.json"
    return None


def restored_data_problem(path: Path) -> str | None:
    """Why the restored ``.npz`` at ``path`` holds values its own column dtypes cannot hold (``None``: it can):
    a value that is not finite, one beyond a float column's range, or one that is not a whole number within
    an integer column's range."""
    with np.load(path, allow_pickle=False) as npz:
        data, dtypes = npz["data"], [str(d) for d in npz["dtypes"]]
    if data.dtype.kind not in "fiu":
        return f"data of dtype {data.dtype}"
    if not len(dtypes) or data.shape[-1] != len(dtypes):
        return f"{len(dtypes)} column dtypes for samples of shape {data.shape[1:]}"
    values = data.astype(np.float64)
    if not np.isfinite(values).all():
        return "values that are not finite"
    for i, name in enumerate(dtypes):
        column, column_dtype = values[..., i], np.dtype(name)
        if column_dtype.kind in "iu":
            limits = np.iinfo(column_dtype)
            if (column != np.round(column)).any() or (column < limits.min).any() or (column > limits.max).any():
                return f"column {i} ({name}) holds values that are not {name} integers"
        elif (np.abs(column) > np.finfo(column_dtype).max).any():
            return f"column {i} ({name}) holds values beyond {name}'s range"
    return None


def run_in_process(cases: dict[str, tuple[str, str | Path]], work: Path, original_npz: Path,
                   headroom: int = MEMORY_HEADROOM, timeout: float = 600, ckpt: Path | None = None) -> dict[str, dict]:
    """Run every case through ``baler_lit.cli.run_tool`` in a child process under ``RLIMIT_AS``.

    ``cases``: name -> (command, path), a command of :data:`COMMANDS` (``"decompress"``, ``"info"`` and
    ``"evaluate"`` take a ``.baler``; ``"compress"`` a checkpoint, run on ``original_npz``; ``"compress
    --input"``, ``"evaluate --original"`` and ``"evaluate --restored"`` an ``.npz``, beside ``ckpt`` or
    ``original_npz``). Returns the results by name: ``rc``, ``stderr``, ``crash`` (an exception that
    escaped ``run_tool``), ``left`` (the files in the case's output folder), ``peak_rss`` (bytes: the
    child's peak resident set while the case ran) and ``bad_data`` (what is wrong with what an rc-0 run
    wrote, see :func:`written_output_problem`). A child that dies (SIGSEGV) or hangs past ``timeout``
    seconds is recorded as a crash of the case it was running, and a new child goes on with the cases after it
    (so one run of the old code still gives a full table).
    """
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(CODE), "OMP_NUM_THREADS": "1"}
    results: dict[str, dict] = {}
    remaining = {name: command_argv(command, path, original_npz, ckpt) for name, (command, path) in cases.items()}
    while remaining:
        spec = work / "cases.json"
        spec.write_text(json.dumps(remaining))
        log = work / "results.jsonl"
        log.unlink(missing_ok=True)
        argv = [sys.executable, "-c", RUNNER, str(spec), str(work), str(headroom), str(original_npz),
                str(Path(__file__).resolve().parent)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=work)
            returncode, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired:  # run() has killed it
            returncode, stderr = -9, f"hung: killed after {timeout} s"
        started = None
        for line in log.read_text().splitlines() if log.exists() else []:
            record = json.loads(line)
            if "started" in record:
                started = record["started"]
            else:
                results[record["name"]] = record["result"]
                remaining.pop(record["name"])
                started = None
        if returncode == 0 and not remaining:
            break
        victim = started or next(iter(remaining))
        results[victim] = {"rc": returncode, "stderr": str(stderr)[-300:], "left": [], "peak_rss": None,
                           "bad_data": None, "crash": f"child died with return code {returncode}"}
        remaining.pop(victim)
    return results


CLI_WRAPPER = r"""
import resource, sys
import baler_lit.cli, baler_lit.compression
with open("/proc/self/status") as fh:
    vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
limit = vm + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.exit(baler_lit.cli.main(sys.argv[2:]))
"""


def run_cli(path: Path, output: Path, headroom: int = MEMORY_HEADROOM) -> subprocess.CompletedProcess:
    """``baler-lit decompress`` as its own process under ``RLIMIT_AS`` (a segfault shows as return code -11)."""
    env = {**os.environ, "PYTHONPATH": str(CODE), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CLI_WRAPPER, str(headroom), "decompress", "--input", str(path),
                           "--output", str(output)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=output.parent)


def outcome(result: dict | None) -> str:
    """A few words for a case's result: what the table counts."""
    if result is None:
        return "not run"
    if result["crash"] and result["crash"].startswith("child died"):
        return {-11: "SIGSEGV", -9: "killed"}.get(result["rc"], f"died rc {result['rc']}")
    if result["crash"]:
        return f"traceback ({result['crash'].split(':')[0]})"
    lines = result["stderr"].splitlines()
    if result["rc"] != 2:
        return f"rc {result['rc']}"
    if result["left"]:
        return "rc 2, output left"
    return "rc 2, one line" if len(lines) == 1 else f"rc 2, {len(lines)} lines"


def table(cases: dict[str, Path], results: dict) -> str:
    counts: dict[str, Counter] = {}
    for name in cases:
        counts.setdefault(kind(name), Counter())[outcome(results.get(name))] += 1
    outcomes = sorted({o for c in counts.values() for o in c})
    width = max(len(k) for k in counts)
    lines = [f"{'case class':<{width}}  {'n':>4}  " + "  ".join(outcomes)]
    for k in sorted(counts):
        lines.append(f"{k:<{width}}  {sum(counts[k].values()):>4}  "
                     + "  ".join(f"{counts[k].get(o, 0):>{len(o)}}" for o in outcomes))
    lines.append(f"{'total':<{width}}  {len(cases):>4}")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile

    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 13
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        valid, cases = build_cases(work / "files", seed)
        sys.path.insert(0, str(REPO))
        from baler_lit.table import save_npz
        from baler_lit.synthetic import synthetic_cms_jets

        original = save_npz(work / "original.npz", synthetic_cms_jets(600, seed=3))
        results = run_in_process({n: ("decompress", str(p)) for n, p in cases.items()}, work / "run", original)
        print(table(cases, results))
        bad = [(n, outcome(results.get(n)), (results.get(n) or {}).get("stderr", "")[:200]) for n in cases
               if outcome(results.get(n)) != "rc 2, one line"]
        for n, o, err in bad[:40]:
            print(f"  {n}: {o} {err!r}")
