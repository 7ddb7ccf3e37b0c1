"""Normalisation, the synthetic generator, the fast batch path, the data module and the file readers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from baler_conftest_helpers import CFD, HZZ, NANOAOD, ZMUMU, one_thread, requires  # noqa: F401 (fixture)

from baler_lit.data import BalerDataModule, TensorBatches
from baler_lit.errors import BalerInputError
from baler_lit.normalization import MinMaxNormalizer
from baler_lit.sources import load_table
from baler_lit.synthetic import COLUMNS, synthetic_cms_jets

pytestmark = pytest.mark.usefixtures("one_thread")


# -- normalisation -------------------------------------------------------------------------------------------
def test_minmax_round_trip_numpy_and_torch():
    rng = np.random.default_rng(1)
    data = np.column_stack([rng.normal(100, 30, 500), rng.uniform(-5, 5, 500), np.full(500, 7.0)])
    norm = MinMaxNormalizer.fit(data)
    scaled = norm.transform(data)
    assert scaled[:, :2].min(axis=0) == pytest.approx([0, 0]) and scaled[:, :2].max(axis=0) == pytest.approx([1, 1])
    assert np.all(scaled[:, 2] == 0)  # constant column: range stored as 1, maps to 0
    np.testing.assert_allclose(norm.inverse(scaled), data, rtol=0, atol=1e-12)
    back = norm.inverse_torch(torch.from_numpy(scaled))
    np.testing.assert_allclose(back.numpy(), data, rtol=0, atol=1e-12)
    restored = MinMaxNormalizer.from_arrays(norm.to_arrays())
    np.testing.assert_array_equal(restored.minimum, norm.minimum)


def test_minmax_global_for_frames():
    frames = np.random.default_rng(0).normal(size=(4, 5, 6))
    norm = MinMaxNormalizer.fit(frames, per_column=False)
    assert norm.minimum.shape == (1,)
    scaled = norm.transform(frames)
    assert scaled.min() == pytest.approx(0) and scaled.max() == pytest.approx(1)
    np.testing.assert_allclose(norm.inverse(scaled), frames, atol=1e-12)


# -- synthetic data -------------------------------------------------------------------------------------------
def test_synthetic_jets_are_deterministic_and_cms_like():
    a, b, c = synthetic_cms_jets(5000, seed=3), synthetic_cms_jets(5000, seed=3), synthetic_cms_jets(5000, seed=4)
    np.testing.assert_array_equal(a.data, b.data)
    assert not np.array_equal(a.data, c.data)
    assert a.data.shape == (5000, 24) and a.names == COLUMNS
    assert a.dtypes.count("float32") == 15 and a.dtypes.count("int32") == 9
    ints = a.data[:, a.integer_mask]
    assert np.all(ints == np.round(ints)) and ints.min() >= 0
    pt = a.data[:, a.names.index("pt")]
    assert pt.min() >= 20.0 and pt.max() / np.median(pt) > 10  # heavy tail


# -- fast batch path -----------------------------------------------------------------------------------------
def test_tensor_batches_cover_every_row_once_and_reshuffle_each_epoch():
    data = torch.arange(1000, dtype=torch.float32).unsqueeze(1)
    loader = TensorBatches(data, batch_size=128, shuffle=True, seed=5)
    assert len(loader) == 8
    epoch1 = torch.cat(list(loader)).squeeze(1)
    epoch2 = torch.cat(list(loader)).squeeze(1)
    assert sorted(epoch1.tolist()) == list(range(1000))
    assert sorted(epoch2.tolist()) == list(range(1000))
    assert not torch.equal(epoch1, epoch2) and not torch.equal(epoch1, data.squeeze(1))
    again = torch.cat(list(TensorBatches(data, 128, True, seed=5))).squeeze(1)
    assert torch.equal(again, epoch1)  # same seed, same order


def test_tensor_batches_are_views_not_copies():
    data = torch.rand(300, 4)
    batches = list(TensorBatches(data, 100, shuffle=False))
    assert [len(b) for b in batches] == [100, 100, 100]
    assert all(b.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() for b in batches)


def test_tensor_batches_split_across_ranks():
    data = torch.arange(10, dtype=torch.float32).unsqueeze(1)
    parts = [torch.cat(list(TensorBatches(data, 2, True, seed=1, rank=r, num_replicas=2))) for r in range(2)]
    rows = sorted(torch.cat(parts).squeeze(1).tolist())
    assert rows == list(range(10)) and len(parts[0]) == len(parts[1]) == 5


def test_datamodule_split_normalisation_and_device_tensors():
    dm = BalerDataModule(synthetic_rows=1000, val_fraction=0.25, batch_size=64)
    assert dm.input_shape == (24,)
    train_idx, val_idx = dm.split_indices()
    assert len(val_idx) == 250 and len(train_idx) == 750 and not set(train_idx) & set(val_idx)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 12 and batches[0].dtype == torch.float32
    everything = torch.cat(batches)
    assert float(everything.min()) >= 0.0 and float(everything.max()) <= 1.0
    assert sum(len(b) for b in dm.val_dataloader()) == 250


def test_datamodule_without_validation_has_no_val_loader():
    dm = BalerDataModule(synthetic_rows=100, val_fraction=0.0)
    assert not dm.has_validation
    with pytest.raises(BalerInputError, match="val_fraction"):
        dm.val_dataloader()


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"val_fraction": 1.0}, {"val_fraction": -0.1}])
def test_datamodule_arguments_are_validated(kwargs):
    with pytest.raises(BalerInputError):
        BalerDataModule(**kwargs)


# -- readers -------------------------------------------------------------------------------------------------
@requires(NANOAOD)
def test_nanoaod_jets_one_row_per_jet():
    table = load_table(NANOAOD, root_prefix="Jet_")
    assert table.data.shape == (537, 40)
    assert all(n.startswith("Jet_") for n in table.names)
    assert table.dtypes[table.names.index("Jet_pt")] == "float32"
    assert table.dtypes[table.names.index("Jet_nConstituents")] == "uint8"
    assert table.dtypes[table.names.index("Jet_jetId")] == "int32"
    picked = load_table(NANOAOD, root_branches=["Jet_pt", "Jet_eta"])
    np.testing.assert_array_equal(picked.data[:, 0], table.data[:, table.names.index("Jet_pt")])


@requires(ZMUMU)
def test_root_flat_branches_one_row_per_entry():
    table = load_table(ZMUMU, root_branches=["E1", "px1", "Q1", "M"])
    assert table.data.shape == (2304, 4) and table.dtypes == ["float64", "float64", "int32", "float64"]


@requires(HZZ)
def test_root_mixed_or_unequal_collections_are_rejected():
    with pytest.raises(BalerInputError, match="cannot mix flat branches"):
        load_table(HZZ)
    with pytest.raises(BalerInputError, match="different numbers of objects"):
        load_table(HZZ, root_branches=["Jet_Px", "Muon_Px"])
    with pytest.raises(BalerInputError, match="no branch"):
        load_table(HZZ, root_branches=["Jet_Nope"])


@requires(CFD)
def test_cfd_frames_load_as_frames():
    table = load_table(CFD)
    assert table.is_frames and table.data.shape == (60, 50, 50) and table.names == [] and table.dtypes == ["float64"]


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(BalerInputError, match="does not exist"):
        load_table(tmp_path / "missing.npz")
    np.savez(tmp_path / "nodata.npz", values=np.zeros((3, 2)))
    with pytest.raises(BalerInputError, match="no array 'data'"):
        load_table(tmp_path / "nodata.npz")
    bad = np.ones((4, 3))
    bad[2, 1] = np.nan
    np.savez(tmp_path / "nan.npz", data=bad, names=np.array(["a", "b", "c"]))
    with pytest.raises(BalerInputError, match=r"non-finite.*'b'"):
        load_table(tmp_path / "nan.npz")
    bad[2, 1] = np.inf
    np.savez(tmp_path / "inf.npz", data=bad)
    with pytest.raises(BalerInputError, match="non-finite"):
        load_table(tmp_path / "inf.npz")
    np.savez(tmp_path / "names.npz", data=np.ones((4, 3)), names=np.array(["a", "b"]))
    with pytest.raises(BalerInputError, match="column-count mismatch"):
        load_table(tmp_path / "names.npz")
    (tmp_path / "text.npz").write_text("not a zip file")
    with pytest.raises(BalerInputError, match="cannot read"):
        load_table(tmp_path / "text.npz")
    np.savez(tmp_path / "obj.npz", data=np.array([{"a": 1}], dtype=object))
    with pytest.raises(BalerInputError, match="cannot read"):
        load_table(tmp_path / "obj.npz")  # object arrays would need unpickling
    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(BalerInputError, match="unsupported format"):
        load_table(tmp_path / "data.csv")
    (tmp_path / "junk.root").write_bytes(b"\x00" * 64)
    with pytest.raises(BalerInputError, match="ROOT"):
        load_table(tmp_path / "junk.root")


def test_restored_dtypes_round_ints_and_pick_an_exact_storage_dtype():
    from baler_lit.table import restore_dtypes

    values = np.array([[0.4, 2.6, 1.2345678901], [1.49, -0.7, 2.0]])
    dtypes = ["int32", "uint8", "float32"]
    out = restore_dtypes(values.copy(), dtypes, frames=False, lo=np.array([0, 0, 1]), hi=np.array([1, 3, 2]))
    assert out.dtype == np.float32  # small integers and float32 fit float32 exactly
    np.testing.assert_array_equal(out[:, 0], [0, 1])  # rounded, not truncated
    np.testing.assert_array_equal(out[:, 1], [3, 0])  # clipped to the observed range / uint8
    assert out[0, 2] == np.float32(1.2345678901)
    big = restore_dtypes(values.copy(), dtypes, frames=False, lo=np.array([0, 0, 1]), hi=np.array([2**25, 3, 2]))
    assert big.dtype == np.float64  # an int32 column beyond 2^24 needs float64
    assert restore_dtypes(values[:, :2].copy(), ["int32", "int16"], frames=False).dtype == np.int32
