"""Hostile ``.baler`` files: targeted attacks and seeded random mutations of a valid file, and a runner.

Used by ``tests/test_trust_baler.py``; also a script that prints the results table (case class x outcome)::

    PYTHONPATH=. python tests/baler_fuzz.py [N_RANDOM_SEED]

Every case is a file that ``baler-lit decompress`` must refuse: exit code 2, exactly one line on stderr, no
output file and no temporary file left, no crash, and memory bounded (the runner sets ``RLIMIT_AS`` to its
address-space size after the imports plus ``MEMORY_HEADROOM``). Random edits only touch what the reader
must check (header fields, array bytes covered by the checksum and CRC, the archive's length), so a valid
file cannot come out of them by chance: fields the reader ignores (``config``, ``library_version``) and
zip metadata nobody verifies (timestamps) are left alone.
"""

from __future__ import annotations

import contextlib
import copy
import json
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
    cases["header.json deflated"] = base.write(out / "deflated_header.baler",
                                               compress={"header.json": zipfile.ZIP_DEFLATED})
    cases["latent deflated"] = base.write(out / "deflated_latent.baler",
                                          compress={"arrays/latent.bin": zipfile.ZIP_DEFLATED})
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


RUNNER = r"""
import contextlib, io, json, os, resource, sys
import baler_lit.cli, baler_lit.compression, baler_lit.evaluate  # the imports first: the limit is on top of them
from pathlib import Path
from baler_lit.cli import run_tool

def vm_bytes():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))

limit = vm_bytes() + int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
cases = json.loads(Path(sys.argv[1]).read_text())
log = open(Path(sys.argv[2]) / "results.jsonl", "a")
for index, (name, (command, path)) in enumerate(cases.items()):
    log.write(json.dumps({"started": name}) + "\n")
    log.flush()
    out = Path(sys.argv[2]) / f"out-{os.getpid()}-{index}"
    out.mkdir()
    target = out / ("restored.npz" if command == "decompress" else "report")
    argv = (["decompress", "--input", path, "--output", str(target)] if command == "decompress" else
            ["evaluate", "--original", sys.argv[4], "--restored", sys.argv[4], "--compressed", path,
             "--out", str(target)])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = run_tool(argv)
        crash = None
    except BaseException as exc:
        rc, crash = 1, f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    result = {"rc": rc, "stderr": err.getvalue(), "crash": crash, "left": sorted(p.name for p in out.iterdir())}
    log.write(json.dumps({"name": name, "result": result}) + "\n")
    log.flush()
"""


def run_in_process(cases: dict[str, tuple[str, str]], work: Path, original_npz: Path,
                   headroom: int = MEMORY_HEADROOM, timeout: float = 600) -> dict[str, dict]:
    """Run every case through ``baler_lit.cli.run_tool`` in a child process under ``RLIMIT_AS``.

    ``cases``: name -> (``"decompress"`` or ``"evaluate"``, path). Returns the results by name. A child
    that dies (SIGSEGV) is recorded as a crash of the case it was running, and a new child goes on with
    the cases after it (so one run of the old code still gives a full table).
    """
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(CODE), "OMP_NUM_THREADS": "1"}
    results: dict[str, dict] = {}
    remaining = dict(cases)
    while remaining:
        spec = work / "cases.json"
        spec.write_text(json.dumps(remaining))
        log = work / "results.jsonl"
        log.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec), str(work), str(headroom), str(original_npz)],
                              capture_output=True, text=True, env=env, timeout=timeout, cwd=work)
        started = None
        for line in log.read_text().splitlines() if log.exists() else []:
            record = json.loads(line)
            if "started" in record:
                started = record["started"]
            else:
                results[record["name"]] = record["result"]
                remaining.pop(record["name"])
                started = None
        if proc.returncode == 0 and not remaining:
            break
        victim = started or next(iter(remaining))
        results[victim] = {"rc": proc.returncode, "stderr": proc.stderr[-300:], "left": [],
                           "crash": f"child died with return code {proc.returncode}"}
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
