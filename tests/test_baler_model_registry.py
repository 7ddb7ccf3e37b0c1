"""Every model in the registry (:data:`baler_lit.models.MODELS`), Baler's names included, gets the same tests:
built from its ``example`` sample shape, trained a few steps by the Lightning module, compressed and decompressed
(stored and ``extra_compression`` files), and its file refused once a byte of it is changed. A model added to the
registry is covered here without a test of its own."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch
from baler_conftest_helpers import one_thread, quick_trainer  # noqa: F401 (fixture)

from baler_lit.compression import compress, decompress, read_compressed
from baler_lit.data import BalerDataModule
from baler_lit.errors import BalerInputError
from baler_lit.file_format import MODEL_NAMES
from baler_lit.models import MODELS, BalerAutoencoder, build_model
from baler_lit.module import BalerModule
from baler_lit.table import Table, save_npz

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = 48
LATENT = 4
BALER_NAMES = ("AE", "AE_Dropout_BN", "CFD_dense_AE", "Conv_AE", "Conv_AE_GDN", "Conv_AE_3D", "FPGA_prototype_model",
               "PJ_Conv_AE", "TransformerAE")  # fmt: skip


def test_baler_s_model_names_are_all_accepted():
    """The names Baler's README and models.py use build (Conv_AE was refused by name before)."""
    assert set(BALER_NAMES) <= set(MODELS)
    assert MODEL_NAMES == tuple(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_names_an_example_it_accepts(name):
    cls = MODELS[name]
    assert issubclass(cls, BalerAutoencoder)
    shape, kwargs = cls.example
    model = build_model(name, shape, LATENT, model_kwargs=kwargs)
    x = torch.rand(3, *shape)
    assert model.encode(x).shape == (3, model.latent_dim)
    assert model(x).shape == (3, *shape)


def _example_data(name: str, tmp_path) -> tuple[Table, object]:
    shape, _ = MODELS[name].example
    rng = np.random.default_rng(0)
    values = rng.normal(10.0, 3.0, size=(ROWS, *shape))
    table = Table(values, source=name)
    path = tmp_path / "data.npz"
    save_npz(path, table)
    return table, path


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_trains_compresses_decompresses_and_its_file_is_checked(name, tmp_path):
    shape, kwargs = MODELS[name].example
    table, path = _example_data(name, tmp_path)
    torch.manual_seed(0)
    module = BalerModule(input_shape=shape, model=name, latent_dim=LATENT, model_kwargs=kwargs,
                         early_stopping_patience=None, lr_patience=None)  # fmt: skip
    data = BalerDataModule(path=str(path), batch_size=16, val_fraction=0.0, shuffle=False)
    before = [p.detach().clone() for p in module.model.parameters()]
    quick_trainer(max_steps=3, max_epochs=None).fit(module, datamodule=data)
    after = list(module.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), "no step changed a weight"
    assert torch.isfinite(torch.cat([p.detach().reshape(-1) for p in after])).all()

    model = module.model.eval()
    for extra in (False, True):
        out = tmp_path / f"{name}_{extra}.baler"
        result = compress(model, data.normalizer, table, out, "float32", {"model": name}, extra_compression=extra)
        assert result.n_rows == ROWS
        with zipfile.ZipFile(out) as zf:
            kinds = {info.compress_type for info in zf.infolist()}
        assert kinds == ({zipfile.ZIP_DEFLATED} if extra else {zipfile.ZIP_STORED})
        restored = decompress(out)
        assert restored.data.shape == (ROWS, *shape) and np.isfinite(restored.data).all()
        assert read_compressed(out).decoder_model().latent_dim == model.latent_dim

        raw = bytearray(out.read_bytes())
        with zipfile.ZipFile(out) as zf:
            info = zf.getinfo("arrays/latent.bin")
        data_start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        raw[data_start + info.compress_size // 2] ^= 0x5A
        tampered = tmp_path / f"{name}_{extra}_tampered.baler"
        tampered.write_bytes(bytes(raw))
        with pytest.raises(BalerInputError, match="corrupted|truncated"):
            decompress(tampered)
