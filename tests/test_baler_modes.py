"""Baler's modes and fields with no counterpart before: ``extra_compression`` (a deflated ``.baler`` read under the
same trust rules), ``convert_to_blocks`` (``baler-lit blocks``), ``emd`` (in ``evaluate``), raw values
(``apply_normalization = False``: an identity normalisation) and ``convert_with_hls4ml``."""

from __future__ import annotations

import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch
from baler_conftest_helpers import one_thread  # noqa: F401 (fixture)

from baler_lit.cli import main
from baler_lit.compression import compress, decompress, read_compressed
from baler_lit.errors import BalerInputError
from baler_lit.evaluate import earth_movers_distance
from baler_lit.file_format import MAX_INFLATE_RATIO
from baler_lit.models import build_model
from baler_lit.normalization import MinMaxNormalizer
from baler_lit.synthetic import synthetic_cms_jets
from baler_lit.table import Table, save_npz

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def deflated(tmp_path_factory):
    """A deflated (extra_compression) and a stored .baler of the same 300 rows."""
    torch.manual_seed(0)
    table = synthetic_cms_jets(300, 0)
    folder = tmp_path_factory.mktemp("deflate")
    model, norm = build_model("AE", (24,)), MinMaxNormalizer.fit(table.data)
    compress(model, norm, table, folder / "stored.baler", "float16")
    compress(model, norm, table, folder / "deflated.baler", "float16", extra_compression=True)
    return folder / "deflated.baler", folder / "stored.baler", table


def test_a_deflated_file_restores_what_the_stored_one_does(deflated):
    path, stored, _ = deflated
    assert path.stat().st_size < stored.stat().st_size
    np.testing.assert_array_equal(decompress(path).data, decompress(stored).data)


def _central_entries(raw: bytes):
    """(offset of each central-directory record, its file name) of a zip archive."""
    pos = 0
    while (pos := raw.find(b"PK\x01\x02", pos)) >= 0:
        n = struct.unpack_from("<H", raw, pos + 28)[0]
        yield pos, raw[pos + 46 : pos + 46 + n].decode()
        pos += 46


def _with_declared_size(raw: bytes, entry: str, size: int) -> bytes:
    """The archive with ``entry``'s uncompressed size changed in its central-directory record (what zipfile reads)."""
    out = bytearray(raw)
    for pos, name in _central_entries(raw):
        if name == entry:
            struct.pack_into("<I", out, pos + 24, size)
    return bytes(out)


def test_a_deflate_bomb_is_refused_before_anything_is_inflated(deflated, tmp_path, monkeypatch):
    path, _, _ = deflated
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("arrays/latent.bin")
    inflated = []
    real = zlib.decompressobj
    monkeypatch.setattr(zlib, "decompressobj", lambda *a, **k: inflated.append(1) or real(*a, **k))
    bomb = tmp_path / "bomb.baler"
    bomb.write_bytes(_with_declared_size(raw, "arrays/latent.bin", MAX_INFLATE_RATIO * info.compress_size + 1))
    with pytest.raises(BalerInputError, match="more than deflate's 1032:1 allows"):
        read_compressed(bomb)
    assert not inflated, "an entry was inflated before its declared size was checked"


def test_a_deflated_entry_declaring_another_size_than_the_header_is_refused(deflated, tmp_path):
    path, _, _ = deflated
    with zipfile.ZipFile(path) as zf:
        size = zf.getinfo("arrays/latent.bin").file_size
    lying = tmp_path / "lying.baler"
    lying.write_bytes(_with_declared_size(path.read_bytes(), "arrays/latent.bin", size - 2))
    with pytest.raises(BalerInputError, match="truncated or corrupted"):
        decompress(lying)


def test_other_zip_methods_and_damaged_deflate_streams_are_refused(deflated, tmp_path):
    path, _, _ = deflated
    raw = bytearray(path.read_bytes())
    bzip = bytearray(raw)
    for pos, _ in _central_entries(bytes(raw)):
        struct.pack_into("<H", bzip, pos + 10, zipfile.ZIP_BZIP2)
    (tmp_path / "bzip.baler").write_bytes(bytes(bzip))
    with pytest.raises(BalerInputError, match="compression method 12"):
        read_compressed(tmp_path / "bzip.baler")
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("arrays/norm_min.bin")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start] ^= 0xFF
    (tmp_path / "damaged.baler").write_bytes(bytes(raw))
    with pytest.raises(BalerInputError, match="corrupted"):
        read_compressed(tmp_path / "damaged.baler")


def test_compress_parses_extra_compression_and_a_percentage():
    from baler_lit.cli import _tool_parser

    args = _tool_parser().parse_args(["compress", "--ckpt", "c", "--input", "i", "--output", "o",
                                      "--extra-compression", "--max-relative-error", "5%"])  # fmt: skip
    assert args.extra_compression and args.max_relative_error == pytest.approx(0.05)


def test_blocks_reshape_and_come_back_like_the_original(tmp_path, capsys):
    frames = np.random.default_rng(0).random((6, 10, 10)).astype(np.float32)
    save_npz(tmp_path / "f.npz", Table(frames))
    assert main(["blocks", "--input", str(tmp_path / "f.npz"), "--shape", "5", "4", "--output",
                 str(tmp_path / "b.npz")]) == 0  # fmt: skip
    blocks = np.load(tmp_path / "b.npz")["data"]
    assert blocks.shape == (30, 5, 4) and blocks.dtype == np.float32
    np.testing.assert_array_equal(blocks.reshape(-1), frames.reshape(-1))
    assert main(["blocks", "--input", str(tmp_path / "b.npz"), "--like", str(tmp_path / "f.npz"), "--output",
                 str(tmp_path / "back.npz")]) == 0  # fmt: skip
    np.testing.assert_array_equal(np.load(tmp_path / "back.npz")["data"], frames)
    table = synthetic_cms_jets(10, 0)
    save_npz(tmp_path / "t.npz", Table(table.data[:, :4], names=table.names[:4]))
    capsys.readouterr()
    assert main(["blocks", "--input", str(tmp_path / "f.npz"), "--shape", "7", "--output",
                 str(tmp_path / "x.npz")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "600 values, which do not divide" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.npz").exists()


def test_earth_movers_distance_is_the_1d_wasserstein_distance():
    rng = np.random.default_rng(1)
    a = rng.normal(size=500)
    assert earth_movers_distance(a, a + 2.5) == pytest.approx(2.5)
    assert earth_movers_distance(a, rng.permutation(a)) == 0.0
    assert earth_movers_distance([0.0], [1.0, 3.0]) == pytest.approx(2.0)
    scipy_stats = pytest.importorskip("scipy.stats")  # the reference, where installed
    b = rng.exponential(size=77)
    assert earth_movers_distance(a, b) == pytest.approx(scipy_stats.wasserstein_distance(a, b), rel=1e-12)


def test_evaluate_reports_the_earth_mover_s_distance_per_column(tmp_path):
    from baler_lit.evaluate import evaluate

    table = synthetic_cms_jets(200, 0)
    shifted = Table(table.data + 0.5 * (table.data.max(axis=0) - table.data.min(axis=0)), names=table.names)
    summary = evaluate(table, shifted, tmp_path / "r", plots=False)
    assert [round(c["norm_emd"], 9) for c in summary["columns"]] == [0.5] * 24
    assert summary["mean_norm_emd"] == pytest.approx(0.5)


def test_raw_values_round_trip_through_an_identity_normalisation(tmp_path):
    """Baler's apply_normalization = False: the model sees the raw values; the file restores them."""
    identity = MinMaxNormalizer.identity()
    assert identity.is_identity and not MinMaxNormalizer.fit(np.array([[0.0], [2.0]])).is_identity
    frames = Table(np.random.default_rng(0).normal(5.0, 50.0, size=(20, 6, 5)))
    model = build_model("CFD_dense_AE", (6, 5), 4)
    result = compress(model, identity, frames, tmp_path / "raw.baler", "float32")
    assert result.warnings == []  # raw values have no training range to leave
    compressed = read_compressed(tmp_path / "raw.baler")
    assert compressed.normalizer().is_identity
    with torch.no_grad():
        want = model(torch.from_numpy(frames.data).float()).double().numpy()
    np.testing.assert_allclose(decompress(tmp_path / "raw.baler").data, want, rtol=1e-5, atol=1e-4)


def test_hls4ml_missing_parts_are_named_in_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util
    import shutil

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hls4ml" else real(name, *a))
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    code = main(["convert-with-hls4ml", "--ckpt", str(tmp_path / "m.ckpt"), "--output-dir", str(tmp_path / "hls"),
                 "--compile", "--build", "synth"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "hls").exists()
    assert "hls4ml (pip install hls4ml)" in err and "g++" in err and "vivado_hls" in err


def test_hls4ml_writes_the_project_of_baler_s_fpga_model(tmp_path):
    pytest.importorskip("hls4ml", reason="hls4ml is not installed (pip install hls4ml); the export needs it")
    from baler_lit.hls4ml_export import HlsSettings, convert
    from baler_lit.module import BalerModule

    module = BalerModule(input_shape=(16,), model="FPGA_prototype_model", latent_dim=8)
    module.set_data_info(MinMaxNormalizer.fit(np.random.default_rng(0).random((10, 16))), [], ["float64"] * 16)
    ckpt = tmp_path / "m.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "baler": {"norm_min": module.normalizer.minimum.tolist(), "norm_scale": module.normalizer.scale.tolist(),
                          "names": [f"c{i}" for i in range(16)], "dtypes": ["float64"] * 16}}, ckpt)  # fmt: skip
    line = convert(ckpt, tmp_path / "hls", HlsSettings(project_name="tiny"), which="encoder")
    assert "wrote the hls4ml project of the encoder" in line
    assert (tmp_path / "hls" / "firmware" / "tiny.cpp").is_file()
