"""Format version 2 of the ``.baler`` file: constant columns stored exactly, error-bound corrections that hold
for every value, streaming compress/decompress, old files still read, hostile corrections refused."""

from __future__ import annotations

import json
from pathlib import Path
import zipfile
import zlib

import numpy as np
import pytest
import torch
from baler_conftest_helpers import NANOAOD, one_thread  # noqa: F401 (a fixture)

from baler_lit.compression import compress, decode, decompress, decompress_to_file, read_compressed
from baler_lit.error_bound import ErrorBound
from baler_lit.errors import BalerInputError
from baler_lit.file_format import checksum
from baler_lit.models import build_model
from baler_lit.normalization import MinMaxNormalizer
from baler_lit.row_source import open_rows
from baler_lit.synthetic import synthetic_cms_jets
from baler_lit.table import Table

pytestmark = pytest.mark.usefixtures("one_thread")


def _trained(table: Table, latent: int, steps: int = 150, model: str = "AE", **kwargs):
    """A briefly trained model (float32) and its normaliser: an imperfect reconstruction, as in real use."""
    torch.manual_seed(0)
    norm = MinMaxNormalizer.fit(table.data)
    net = build_model(model, table.sample_shape, latent, **kwargs)
    x = torch.from_numpy(norm.transform(table.data, np.float32))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.mean((net(x) - x) ** 2)
        loss.backward()
        opt.step()
    return net.eval(), norm


def _with_constant_columns(rows: int = 800) -> Table:
    """Synthetic jets plus constant columns that a network restores only approximately (large offsets,
    negative, integer, one whose float32 neighbours are far apart)."""
    jets = synthetic_cms_jets(rows, seed=5)
    constants = {"run": (297050.0, "int64"), "offset": (1.0e15 + 0.125, "float64"), "neg": (-3.75, "float32"),
                 "zero": (0.0, "float32")}  # fmt: skip
    data = np.column_stack([jets.data, *[np.full(rows, v) for v, _ in constants.values()]])
    return Table(data, names=[*jets.names, *constants], dtypes=[*jets.dtypes, *(d for _, d in constants.values())],
                 source="jets+constants")  # fmt: skip


def test_constant_columns_are_restored_exactly_not_through_the_network(tmp_path):
    table = _with_constant_columns()
    model, norm = _trained(table, latent=10)
    result = compress(model, norm, table, tmp_path / "c.baler", "float16")
    assert result.constant_columns == 4
    restored = decompress(tmp_path / "c.baler").data
    assert np.array_equal(restored[:, -4:], table.data[:, -4:])  # bit for bit, whatever the network says
    header = read_compressed(tmp_path / "c.baler").header
    assert header["constants"] == {"count": 4} and header["format_version"] == 2


def test_constant_pixels_of_frames_are_restored_exactly(tmp_path):
    rng = np.random.default_rng(1)
    frames = rng.normal(size=(40, 8, 8))
    frames[:, 0, :] = 7.5  # a wall of the flow field that never changes
    frames[:, 3, 3] = -1e9
    table = Table(frames, source="frames")
    model, norm = _trained(table, latent=8, steps=20, model="CFD_dense_AE")
    result = compress(model, norm, table, tmp_path / "f.baler", "float32")
    assert result.constant_columns == 9
    restored = decompress(tmp_path / "f.baler").data
    assert np.all(restored[:, 0, :] == 7.5) and np.all(restored[:, 3, 3] == -1e9)


def _adversarial(rows: int = 1500) -> Table:
    """Values a bounded-error compressor must get right: heavy tails, signs, values near and at zero, a huge
    dynamic range inside one column, a single far outlier, integers and float32 columns."""
    rng = np.random.default_rng(13)
    cols = {
        "cauchy": rng.standard_cauchy(rows),
        "tiny": rng.normal(size=rows) * 1e-6,
        "zeros_and_ones": (rng.random(rows) < 0.5).astype(float),
        "span_1e-3_to_1e6": np.exp(rng.uniform(np.log(1e-3), np.log(1e6), rows)) * rng.choice([-1, 1], rows),
        "outlier": np.where(np.arange(rows) == rows // 2, 1e8, rng.normal(size=rows)),
        "counts": rng.poisson(3, rows).astype(float),
        "f32": rng.normal(100, 5, rows).astype(np.float32).astype(float),
    }
    return Table(np.column_stack(list(cols.values())), names=list(cols),
                 dtypes=["float64", "float64", "int32", "float64", "float64", "int64", "float32"],
                 source="adversarial")  # fmt: skip


@pytest.mark.parametrize("bound", [ErrorBound(relative=0.1), ErrorBound(absolute=0.05),
                                   ErrorBound(relative=0.01, absolute=1e-3), ErrorBound(relative=0.0)])  # fmt: skip
def test_error_bound_holds_for_every_value(tmp_path, bound):
    table = _adversarial()
    model, norm = _trained(table, latent=3, steps=60)
    path = tmp_path / "bounded.baler"
    result = compress(model, norm, table, path, "float16", error_bound=bound)
    restored = decompress(path).data
    allowed = bound.allowed(table.data)
    assert np.all(np.abs(restored - table.data) <= allowed)  # every value, not most
    # the network alone misses the bound somewhere (else the test would prove nothing) ...
    unbounded = decompress_values(model, norm, table, tmp_path / "plain.baler")
    missed = np.abs(unbounded - table.data) > allowed
    assert missed.any()
    # ... and the file stores corrections for those values only, compactly, and says what they cost
    assert 0 < result.corrections <= result.n_values == table.data.size
    assert result.corrections >= missed.sum()  # the same decoder output: every miss is corrected
    assert result.corrected_share == pytest.approx(result.corrections / table.data.size)
    header = read_compressed(path).header
    spec = header["corrections"]
    assert spec["count"] == result.corrections and spec["relative"] == bound.relative
    stored = header["arrays"]["corrections_index"]["nbytes"] + header["arrays"]["corrections_value"]["nbytes"]
    assert result.corrections_bytes == stored < result.corrections * 16  # zlib beats raw index + float64


def decompress_values(model, norm, table, path) -> np.ndarray:
    compress(model, norm, table, path, "float16", overwrite=True)
    return decompress(path).data


def test_a_loose_bound_corrects_nothing_and_a_zero_bound_restores_the_data_exactly(tmp_path):
    table = _adversarial(400)
    model, norm = _trained(table, latent=3, steps=30)
    loose = compress(model, norm, table, tmp_path / "loose.baler", "float16", error_bound=ErrorBound(absolute=1e12))
    assert loose.corrections == 0
    assert np.array_equal(decompress(tmp_path / "loose.baler").data, decompress_values(model, norm, table,
                                                                                       tmp_path / "p.baler"))
    exact = compress(model, norm, table, tmp_path / "exact.baler", error_bound=ErrorBound(absolute=0.0))
    assert np.array_equal(decompress(tmp_path / "exact.baler").data, table.data)
    assert exact.corrections > 0.5 * table.data.size


def test_streaming_decompress_writes_what_decompress_returns(tmp_path):
    table = _adversarial(5000)  # several decode chunks (4096 rows each)
    model, norm = _trained(table, latent=3, steps=30)
    compress(model, norm, table, tmp_path / "s.baler", error_bound=ErrorBound(relative=0.05))
    in_memory = decompress(tmp_path / "s.baler")
    result = decompress_to_file(tmp_path / "s.baler", tmp_path / "s.npz")
    with np.load(tmp_path / "s.npz", allow_pickle=False) as npz:
        assert np.array_equal(npz["data"], in_memory.data.astype(npz["data"].dtype))
        assert list(npz["names"]) == table.names and list(npz["dtypes"]) == table.dtypes
    assert result.n_rows == 5000


@pytest.mark.parametrize("layout", ["npy", "npz", "npz_compressed"])
def test_compress_from_a_streamed_file_equals_compress_from_memory(tmp_path, layout):
    table = synthetic_cms_jets(9000, seed=2)
    model, norm = _trained(table, latent=8, steps=10)
    data = table.data.astype(np.float32)
    path = tmp_path / f"in.{layout.split('_')[0]}"
    if layout == "npy":
        np.save(path, data)
    else:
        save = np.savez_compressed if layout == "npz_compressed" else np.savez
        save(path, data=data, names=np.array(table.names))
    rows = open_rows(path)
    assert rows.n_rows == 9000 and rows.names == (table.names if layout != "npy" else rows.names)
    compress(model, norm, rows, tmp_path / "streamed.baler", error_bound=ErrorBound(relative=0.1))
    reference = Table(data, names=table.names if layout != "npy" else [], source="memory",
                      dtypes=rows.dtypes)  # fmt: skip
    compress(model, norm, reference, tmp_path / "memory.baler", error_bound=ErrorBound(relative=0.1))
    a, b = read_compressed(tmp_path / "streamed.baler"), read_compressed(tmp_path / "memory.baler")
    assert np.array_equal(a.arrays["latent"], b.arrays["latent"])
    assert a.header["corrections"]["count"] == b.header["corrections"]["count"]
    assert np.array_equal(decode(a), decode(b))


def test_streamed_input_with_nan_names_the_column_and_rows(tmp_path):
    data = np.ones((100, 3))
    data[70, 1] = np.nan
    np.savez(tmp_path / "nan.npz", data=data, names=np.array(["a", "b", "c"]))
    table = synthetic_cms_jets(50)
    model = build_model("AE", (3,), 2)
    norm = MinMaxNormalizer.fit(np.ones((4, 3)) * np.arange(4)[:, None])
    with pytest.raises(BalerInputError, match=r"'b'.*rows 0\.\.99"):
        compress(model, norm, open_rows(tmp_path / "nan.npz"), tmp_path / "x.baler")
    assert not (tmp_path / "x.baler").exists() and table.n_rows == 50


# -- old files, hostile corrections ------------------------------------------------------------------------
def _entries(path):
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _write(path, entries, header):
    arrays = {n: np.frombuffer(entries[f"arrays/{n}.bin"], dtype=np.dtype(spec["dtype"]))
              for n, spec in header["arrays"].items()}  # fmt: skip
    header["checksum_sha256"] = checksum(header, arrays)
    entries = {**entries, "header.json": json.dumps(header).encode()}
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def bounded_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounded")
    table = _adversarial(600)
    model, norm = _trained(table, latent=3, steps=30)
    compress(model, norm, table, tmp / "b.baler", error_bound=ErrorBound(relative=0.1))
    return table, tmp / "b.baler"


def test_format_version_1_files_still_read(tmp_path):
    table = synthetic_cms_jets(300, seed=4)
    model, norm = _trained(table, latent=6, steps=5)
    compress(model, norm, table, tmp_path / "v2.baler")
    entries = _entries(tmp_path / "v2.baler")
    header = json.loads(entries["header.json"])
    assert header["constants"]["count"] == 0 and header["corrections"] is None
    for key in ("constants", "corrections"):
        header.pop(key)
    header["format_version"] = 1  # exactly what version 1 wrote
    old = _write(tmp_path / "v1.baler", entries, header)
    assert np.array_equal(decompress(old).data, decompress(tmp_path / "v2.baler").data)


def test_version_1_file_cannot_smuggle_version_2_parts(bounded_file, tmp_path):
    _, path = bounded_file
    entries = _entries(path)
    header = json.loads(entries["header.json"])
    header["format_version"] = 1
    with pytest.raises(BalerInputError, match="corrections_index.*not an array of the format"):
        decompress(_write(tmp_path / "smuggled.baler", entries, header))


def _resigned_corrections(path, tmp_path, name, index=None, values=None, edit=None):
    entries = _entries(path)
    header = json.loads(entries["header.json"])
    for key, blob in (("corrections_index", index), ("corrections_value", values)):
        if blob is not None:
            entries[f"arrays/{key}.bin"] = blob
            header["arrays"][key].update(shape=[len(blob)], nbytes=len(blob))
    if edit:
        edit(header)
    return _write(tmp_path / f"{name}.baler", entries, header)


@pytest.mark.parametrize("case", ["beyond the data", "count too large", "count too small", "not zlib",
                                  "trailing bytes", "nan value", "count beyond values"])  # fmt: skip
def test_hostile_corrections_are_refused_with_one_line_and_no_output(bounded_file, tmp_path, case):
    table, path = bounded_file
    header = read_compressed(path).header
    count = header["corrections"]["count"]
    n_values = table.data.size
    gaps = np.zeros(count, dtype="<u8")
    cases = {
        "beyond the data": dict(index=zlib.compress(np.concatenate([gaps[:-1], [n_values]]).astype("<u8").tobytes())),
        "count too large": dict(edit=lambda h: h["corrections"].update(count=count + 1)),
        "count too small": dict(edit=lambda h: h["corrections"].update(count=count - 1)),
        "not zlib": dict(index=b"\x00" * 64),
        "trailing bytes": dict(index=_entries(path)["arrays/corrections_index.bin"] + b"\x00"),
        "nan value": dict(values=zlib.compress(np.full(count, np.nan, dtype=header["corrections"]["value_dtype"])
                                               .tobytes())),  # fmt: skip
        "count beyond values": dict(edit=lambda h: h["corrections"].update(count=n_values + 1)),
    }
    bad = _resigned_corrections(path, tmp_path, "bad", **cases[case])
    out = tmp_path / "out.npz"
    for restore in (lambda: decompress(bad, out), lambda: decompress_to_file(bad, out)):
        with pytest.raises(BalerInputError, match="corrupted|invalid header") as info:
            restore()
        assert "\n" not in str(info.value)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(not NANOAOD.is_file(), reason=f"needs {NANOAOD}")
def test_root_input_streams_in_batches_with_the_rows_of_the_in_memory_reader(tmp_path, monkeypatch):
    import baler_lit.row_source as row_source
    from baler_lit.sources import load_table

    monkeypatch.setattr(row_source, "ROOT_STEP", 37)  # entries per uproot batch: many batches of uneven row counts
    table = load_table(NANOAOD, root_prefix="Jet_")
    rows = open_rows(NANOAOD, root_prefix="Jet_")
    assert isinstance(rows, row_source.RootRows)
    assert (rows.n_rows, rows.names, rows.dtypes) == (table.n_rows, table.names, table.dtypes)
    blocks = list(rows.blocks(64))
    assert [s for s, _ in blocks] == list(range(0, table.n_rows, 64))
    assert np.array_equal(np.concatenate([b for _, b in blocks]), table.data)
    model, norm = _trained(table, latent=10, steps=20)
    compress(model, norm, rows, tmp_path / "streamed.baler")
    compress(model, norm, table, tmp_path / "memory.baler")
    a, b = read_compressed(tmp_path / "streamed.baler"), read_compressed(tmp_path / "memory.baler")
    assert np.array_equal(a.arrays["latent"], b.arrays["latent"]) and a.header["dtypes"] == b.header["dtypes"]


def _save_checkpoint(path, model, norm, table) -> None:
    """A checkpoint in BalerModule's layout (what ``load_checkpoint`` reads), without a Lightning fit."""
    hp = {"input_shape": list(table.sample_shape), "model": "AE", "latent_dim": model.latent_dim,
          "dtype": "float32", "model_kwargs": None}  # fmt: skip
    baler = {"norm_min": norm.minimum.tolist(), "norm_scale": norm.scale.tolist(), "names": table.names,
             "dtypes": table.dtypes}  # fmt: skip
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "hyper_parameters": hp,
                "baler": baler}, path)  # fmt: skip


@pytest.mark.slow
def test_compress_many_shards_the_inputs_over_two_ddp_ranks(tmp_path):
    import os
    import subprocess
    import sys

    from baler_lit.cli import load_checkpoint
    from baler_lit.table import save_npz

    table = synthetic_cms_jets(2000, seed=1)
    model, norm = _trained(table, latent=8, steps=10)
    _save_checkpoint(tmp_path / "ae.ckpt", model, norm, table)
    inputs = []
    for i in range(3):
        inputs.append(tmp_path / f"part{i}.npz")
        save_npz(inputs[-1], synthetic_cms_jets(700 + 100 * i, seed=10 + i))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "baler_lit.cli", "compress-many", "--ckpt", str(tmp_path / "ae.ckpt"),
                          "--inputs", *map(str, inputs), "--output-dir", str(out), "--devices", "2",
                          "--max-relative-error", "0.2"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert manifest["checkpoint"] == _checkpoint_identity(tmp_path / "ae.ckpt")
    assert [f["input"] for f in manifest["files"]] == list(map(str, inputs))  # each input exactly once
    assert [f["rank"] for f in manifest["files"]] == [0, 1, 0]  # input i on rank i mod 2
    trained = load_checkpoint(tmp_path / "ae.ckpt")
    for i, path in enumerate(inputs):
        single = compress(trained.model, trained.normalizer, open_rows(path), tmp_path / f"single{i}.baler",
                          "float16", error_bound=ErrorBound(relative=0.2))  # fmt: skip
        ranked = read_compressed(out / f"part{i}.baler")
        assert np.array_equal(ranked.arrays["latent"], read_compressed(single.path).arrays["latent"])
        assert manifest["files"][i]["rows"] == 700 + 100 * i == ranked.n_rows
        assert np.array_equal(decode(ranked), decode(read_compressed(single.path)))


def _checkpoint_identity(path: Path) -> dict:
    import hashlib

    return {"path": str(path.resolve()), "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}  # fmt: skip


def test_compress_many_manifest_names_the_checkpoint_by_path_and_sha256(tmp_path):
    """A manifest says which weights made its files: another checkpoint (one weight changed) gives another hash."""
    from baler_lit.compress_many import MANIFEST, compress_many

    table = synthetic_cms_jets(300, seed=1)
    model, norm = _trained(table, latent=8, steps=5)
    _save_checkpoint(tmp_path / "ae.ckpt", model, norm, table)
    data = tmp_path / "part.npz"
    from baler_lit.table import save_npz

    save_npz(data, table)
    out = tmp_path / "out"
    out.mkdir()
    compress_many(str(tmp_path / "ae.ckpt"), [str(data)], str(out))
    first = json.loads((out / MANIFEST).read_text())["checkpoint"]
    assert first == _checkpoint_identity(tmp_path / "ae.ckpt")
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    _save_checkpoint(tmp_path / "ae.ckpt", model, norm, table)
    compress_many(str(tmp_path / "ae.ckpt"), [str(data)], str(out), overwrite=True)
    second = json.loads((out / MANIFEST).read_text())["checkpoint"]
    assert second == _checkpoint_identity(tmp_path / "ae.ckpt") and second["sha256"] != first["sha256"]
    assert second["path"] == first["path"] == str((tmp_path / "ae.ckpt").resolve())


@pytest.mark.parametrize("layout", ["npy", "npz"])
def test_a_fortran_ordered_array_streams_the_same_rows_as_its_c_ordered_copy(tmp_path, layout):
    """``np.save`` keeps a Fortran-contiguous array (a transpose, many pandas frames' values) column-major; the
    in-memory reader accepts it, so the streamed readers must too, row for row (blocks and random reads)."""
    data = np.asfortranarray(synthetic_cms_jets(3000, seed=4).data)
    assert data.flags.f_contiguous and not data.flags.c_contiguous
    path = tmp_path / f"f.{layout}"
    np.save(path, data) if layout == "npy" else np.savez(path, data=data)
    rows = open_rows(path)
    assert (rows.n_rows, rows.sample_shape) == (3000, (24,))
    streamed = np.concatenate([block for _, block in rows.blocks(700)])
    assert np.array_equal(streamed, data)
    assert np.array_equal(rows.read_rows(1234, 2001), data[1234:2001])


def test_a_fortran_ordered_array_in_a_compressed_npz_is_refused_in_one_line(tmp_path):
    np.savez_compressed(tmp_path / "f.npz", data=np.asfortranarray(np.arange(60.0).reshape(20, 3)))
    with pytest.raises(BalerInputError, match=r"Fortran-ordered array in a compressed \.npz.*np\.savez"):
        open_rows(tmp_path / "f.npz")
