"""What ``decompress`` writes and what ``info`` reads, from crafted ``.baler`` files (issue 29, items 3, 6a, 7a).

- Constants and corrections are applied after the network's values are checked: a crafted (re-signed) file
  whose constant or correction does not fit its column's dtype (0.5 in an int32 column, 1e300 in a float32
  array) must be refused, one line, exit code 2, no output file; before, it wrote 0.5 or inf with rc 0.
- ``info`` reads header fields decompress does not use (``roundtrip``, ``library_version``): a wrong type is one
  line and rc 2, not a traceback; a version-1 header must not declare the version-2 parts.
- A writer killed by SIGKILL leaves its temporary file: the next ``decompress``/``compress`` into that folder
  removes it when its writer is dead, and leaves alone the one of a live writer.
"""

from __future__ import annotations

import copy
import fcntl
import os
import re
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from baler_conftest_helpers import REPO, one_thread  # noqa: F401 (fixture)
from baler_fuzz import Archive

from baler_lit.cli import run_tool
from baler_lit.compression import compress, decompress
from baler_lit.error_bound import ErrorBound
from baler_lit.errors import BalerInputError
from baler_lit.models import build_model
from baler_lit.normalization import MinMaxNormalizer
from baler_lit.table import Table

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS = 120


def _table(float_storage: str) -> Table:
    """Columns x (float), n (int16, varying), k (int16, constant 7), y (float): restored as ``float_storage``."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=ROWS), rng.normal(size=ROWS)
    if float_storage == "float32":
        x, y = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    data = np.column_stack([x, rng.integers(0, 100, ROWS), np.full(ROWS, 7.0), y])
    return Table(data, names=["x", "n", "k", "y"], dtypes=[float_storage, "int16", "int16", float_storage])


@pytest.fixture(scope="module", params=["float64", "float32"])
def bounded(request, tmp_path_factory) -> tuple[Path, Archive]:
    """A valid file with one constant column (k) and corrections (an untrained AE, a tight error bound)."""
    table = _table(request.param)
    torch.manual_seed(0)
    model = build_model("AE", table.sample_shape, 2)
    path = tmp_path_factory.mktemp("bounded") / "valid.baler"
    compress(model, MinMaxNormalizer.fit(table.data), table, path, error_bound=ErrorBound(relative=1e-3))
    archive = Archive(path)
    assert archive.header["constants"]["count"] == 1 and archive.header["corrections"]["count"] > 0
    return path, archive


def _resigned(archive: Archive, path: Path, entries: dict[str, bytes], edit=None) -> Path:
    """``archive`` with ``entries`` replaced, the header's sizes, checksum (and zip CRCs) made valid again."""
    clone = copy.copy(archive)
    clone.entries = {**archive.entries, **entries}
    header = copy.deepcopy(archive.header)
    for entry, data in entries.items():
        name = entry.removeprefix("arrays/").removesuffix(".bin")
        if header["arrays"][name]["dtype"] == "|u1":
            header["arrays"][name].update(shape=[len(data)], nbytes=len(data))
    if edit is not None:
        edit(header)
    clone.resign(header)
    return clone.write(path, header)


def _with_constant(archive: Archive, path: Path, value: float) -> Path:
    return _resigned(archive, path, {"arrays/constant_value.bin": np.array([value], "<f8").tobytes()})


def _with_correction(archive: Archive, path: Path, column: int, value: float) -> Path:
    """The first correction in ``column`` set to ``value``, the values stored as float64 (``<f8``, a dtype
    the header may name whatever the restored array's dtype) and re-deflated."""
    header = archive.header
    gaps = np.frombuffer(zlib.decompress(archive.entries["arrays/corrections_index.bin"]), "<u8")
    stored = np.dtype(header["corrections"]["value_dtype"])
    values = np.frombuffer(zlib.decompress(archive.entries["arrays/corrections_value.bin"]), stored).astype("<f8")
    index = np.cumsum(gaps.astype(np.int64) + 1) - 1
    assert len(index) == header["corrections"]["count"]
    (positions,) = header["sample_shape"]
    values[int(np.flatnonzero(index % positions == column)[0])] = value
    return _resigned(archive, path, {"arrays/corrections_value.bin": zlib.compress(values.tobytes())},
                     lambda h: h["corrections"].__setitem__("value_dtype", "<f8"))


def _refused(path: Path, out: Path, match: str, capsys) -> None:
    """Decompressing ``path`` into ``out`` gives one line naming ``match``, exit code 2 and no output."""
    code = run_tool(["decompress", "--input", str(path), "--output", str(out)])
    err = capsys.readouterr().err
    first_row = np.load(out)["data"][0].tolist() if out.exists() else None
    assert code == 2, f"rc {code}, wrote {out} (first row {first_row})"
    assert err.count("\n") == 1 and err.startswith("baler-lit decompress: error: ") and match in err, err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(BalerInputError, match=re.escape(match)):
        decompress(path)


# -- item 3: what is written must fit the columns' dtypes ------------------------------------------------------
def test_the_valid_file_decompresses(bounded, tmp_path):
    path, _ = bounded
    assert run_tool(["decompress", "--input", str(path), "--output", str(tmp_path / "out.npz")]) == 0
    data = np.load(tmp_path / "out.npz")["data"]
    assert np.isfinite(data).all() and (data[:, 2] == 7).all() and (data[:, 1] == np.rint(data[:, 1])).all()


@pytest.mark.parametrize(("value", "match"), [(0.5, "column 'k' (int16) would get 0.5, not a whole number"),
                                              (1e300, "column 'k' (int16) would get 1e+300, outside int16's range"),
                                              (40000.0, "outside int16's range [-32768, 32767]")])
def test_a_constant_that_does_not_fit_its_integer_column_is_refused(bounded, tmp_path, capsys, value, match):
    path, archive = bounded
    _refused(_with_constant(archive, tmp_path / "bad.baler", value), tmp_path / "out.npz", match, capsys)


@pytest.mark.parametrize(("value", "match"), [(0.5, "column 'n' (int16) would get 0.5, not a whole number"),
                                              (-1e300, "column 'n' (int16) would get -1e+300, outside int16's range")])
def test_a_correction_that_does_not_fit_its_integer_column_is_refused(bounded, tmp_path, capsys, value, match):
    _, archive = bounded
    _refused(_with_correction(archive, tmp_path / "bad.baler", 1, value), tmp_path / "out.npz", match, capsys)


def test_a_huge_correction_is_refused_in_a_float32_column_only(bounded, tmp_path, capsys):
    """1e300 in a float32 column became inf in the float32 array; a float64 column holds it."""
    _, archive = bounded
    crafted = _with_correction(archive, tmp_path / "huge.baler", 0, 1e300)
    out = tmp_path / "out.npz"
    if archive.header["dtypes"][0] == "float32":
        _refused(crafted, out, "column 'x' (float32) would get 1e+300, beyond float32's largest value", capsys)
    else:
        assert run_tool(["decompress", "--input", str(crafted), "--output", str(out)]) == 0
        assert 1e300 in np.load(out)["data"][:, 0]


def test_a_huge_constant_in_a_float32_array_is_refused_not_written_as_inf(tmp_path, capsys):
    table = Table(np.column_stack([np.linspace(0, 1, ROWS), np.full(ROWS, 2.0)]), names=["x", "c"],
                  dtypes=["float32", "float32"])
    torch.manual_seed(0)
    path = tmp_path / "f32.baler"
    compress(build_model("AE", table.sample_shape, 1), MinMaxNormalizer.fit(table.data), table, path)
    crafted = _with_constant(Archive(path), tmp_path / "bad.baler", 1e300)
    (tmp_path / "f32.baler").unlink()
    _refused(crafted, tmp_path / "out.npz", "column 'c' (float32) would get 1e+300, beyond float32's largest value",
             capsys)


def test_compress_refuses_to_write_a_constant_its_column_dtype_cannot_hold(tmp_path):
    table = Table(np.column_stack([np.linspace(0, 1, ROWS), np.full(ROWS, 2.5)]), names=["x", "half"],
                  dtypes=["float64", "int32"])
    torch.manual_seed(0)
    with pytest.raises(BalerInputError, match="column 'half' \\(int32\\) would get 2.5, not a whole number"):
        compress(build_model("AE", table.sample_shape, 1), MinMaxNormalizer.fit(table.data), table,
                 tmp_path / "x.baler")
    assert list(tmp_path.iterdir()) == []


# -- item 6a: info on header fields of the wrong type ------------------------------------------------------------
def _edited(archive: Archive, path: Path, edit) -> Path:
    return _resigned(archive, path, {}, edit)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("roundtrip", 3, "roundtrip must be null or an object, got 3"),
    ("roundtrip", {"rows": 5, "mean_norm_rms": "x", "max_norm_rms": 0.1}, "roundtrip.mean_norm_rms must be a number"),
    ("roundtrip", {"rows": 5, "mean_norm_rms": 0.1}, "roundtrip.max_norm_rms is missing"),
    ("roundtrip", {"rows": True, "mean_norm_rms": 0.1, "max_norm_rms": 0.1}, "roundtrip.rows must be an integer"),
    ("library_version", ["1"], "library_version must be a string"),
])
def test_info_refuses_a_summary_field_of_the_wrong_type_in_one_line(bounded, tmp_path, capsys, field, value, match):
    _, archive = bounded
    crafted = _edited(archive, tmp_path / "bad.baler", lambda h: h.__setitem__(field, value))
    for flags in ([], ["--json"]):
        assert run_tool(["info", str(crafted), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("baler-lit info: error: ") and match in err, err
    # decompressing does not use these fields: the data still restore
    assert run_tool(["decompress", "--input", str(crafted), "--output", str(tmp_path / "out.npz")]) == 0


@pytest.mark.parametrize("tool", ["info", "decompress"])
@pytest.mark.parametrize("part", ["constants", "corrections"])
def test_a_version_1_header_declaring_a_version_2_part_is_refused(bounded, tmp_path, capsys, tool, part):
    """Before: info raised AttributeError on ``"constants": 3``, decompress KeyError on a declared correction."""
    _, archive = bounded
    base = archive.header
    entries = {n: b for n, b in archive.entries.items() if "constant_" not in n and "corrections_" not in n}

    def as_version_1(h):
        h["format_version"] = 1
        h["arrays"] = {k: v for k, v in h["arrays"].items() if not k.startswith(("constant_", "corrections_"))}
        h["constants"] = 3 if part == "constants" else None
        h["corrections"] = base["corrections"] if part == "corrections" else None

    clone = copy.copy(archive)
    clone.entries = entries
    crafted = _resigned(clone, tmp_path / "v1.baler", {}, as_version_1)
    out = tmp_path / "out.npz"
    argv = ["info", str(crafted)] if tool == "info" else ["decompress", "--input", str(crafted), "--output", str(out)]
    assert run_tool(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{part} must be absent in format version 1" in err, err
    assert not out.exists()


# -- item 7a: temporary files left by a killed writer ----------------------------------------------------------------
def remove_stale_temp_files(folder: Path) -> list[Path]:
    from baler_lit.table import remove_stale_temp_files  # new in issue 29: imported here so the old code's run
                                                          # shows which other tests fail
    return remove_stale_temp_files(folder)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def _temp_name(output: str, pid: int) -> str:
    return f".{output}.baler-lit-{pid}-abcd1234.tmp"


def test_stale_temp_files_of_dead_writers_are_removed_at_the_next_decompress(bounded, tmp_path):
    path, _ = bounded
    dead = tmp_path / _temp_name("restored.npz", _dead_pid())
    other_output = tmp_path / _temp_name("other.baler", _dead_pid())
    alive = tmp_path / _temp_name("restored.npz", os.getpid())
    not_ours = tmp_path / ".restored.npz.x1y2z3.tmp"
    for p in (dead, other_output, alive, not_ours):
        p.write_bytes(b"partial")
    assert run_tool(["decompress", "--input", str(path), "--output", str(tmp_path / "restored.npz")]) == 0
    assert not dead.exists() and not other_output.exists()
    assert alive.exists() and not_ours.exists()
    assert (tmp_path / "restored.npz").is_file()


def test_a_locked_temp_file_is_left_alone_even_when_its_pid_is_gone(tmp_path):
    """A writer in another pid namespace (or host of a shared file system) holds its file's flock."""
    held = tmp_path / _temp_name("restored.npz", _dead_pid())
    held.write_bytes(b"partial")
    with open(held, "rb") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        assert remove_stale_temp_files(tmp_path) == []
        assert held.exists()
    assert remove_stale_temp_files(tmp_path) == [held]


def test_a_stale_temp_file_is_removed_at_the_next_compress(tmp_path):
    dead = tmp_path / _temp_name("data.baler", _dead_pid())
    dead.write_bytes(b"partial")
    table = Table(np.column_stack([np.linspace(0, 1, ROWS), np.linspace(1, 3, ROWS)]))
    torch.manual_seed(0)
    compress(build_model("AE", table.sample_shape, 1), MinMaxNormalizer.fit(table.data), table,
             tmp_path / "data.baler")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.baler"]


KILLED_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from baler_lit.table import atomic_output
    with atomic_output(Path(sys.argv[1]), False) as fh:
        fh.write(b"x" * 2**16)
        fh.flush()
        print("ready", flush=True)
        sys.stdin.read()  # blocks until the test kills it
""")


def test_the_temp_file_of_a_sigkilled_writer_is_found_and_removed(tmp_path):
    out = tmp_path / "restored.npz"
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        (left,) = tmp_path.iterdir()
        assert remove_stale_temp_files(tmp_path) == []  # its writer lives (and holds the lock)
    finally:
        child.kill()
        child.communicate()
    assert left.exists() and left.name.startswith(f".restored.npz.baler-lit-{child.pid}-")  # SIGKILL: no cleanup
    assert remove_stale_temp_files(tmp_path) == [left]
    assert list(tmp_path.iterdir()) == []


def test_info_on_the_valid_file_passes_the_summary_checks(bounded, capsys):
    path, _ = bounded
    assert run_tool(["info", str(path)]) == 0
    assert "round-trip error measured at compression" in capsys.readouterr().out
