"""Training on data larger than memory (``data.streaming: true``): the normaliser from one scanning pass, every
training row once per epoch, equal batch counts on every rank, a bounded number of rows in memory, bad input
refused by the CLI."""

from __future__ import annotations

import json
import os
import sys
import weakref
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from baler_conftest_helpers import NANOAOD, REPO, one_thread, requires, single_thread  # noqa: F401 (a fixture)

from baler_lit.cli import main
from baler_lit.data import BalerDataModule
from baler_lit.errors import BalerInputError
from baler_lit.row_source import TableRows
from baler_lit.streaming import ChunkedBatches, chunk_split
from baler_lit.synthetic import synthetic_cms_jets
from baler_lit.table import Table

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).resolve().parent


def _indexed(rows: int, seed: int = 3) -> Table:
    """Synthetic jets whose column 0 is the row number (so a batch says which rows it holds)."""
    jets = synthetic_cms_jets(rows, seed=seed)
    jets.data[:, 0] = np.arange(rows)
    return jets


def _row_numbers(batch: torch.Tensor, loader: ChunkedBatches) -> np.ndarray:
    return np.rint(loader.normalizer.inverse(batch[:, :1].numpy())[:, 0]).astype(int)


def _split_rows(n: int, chunk_rows: int, val_fraction: float, seed: int) -> tuple[set[int], set[int]]:
    train, val = set(), set()
    for k in range(-(-n // chunk_rows)):
        t, v = chunk_split(n, chunk_rows, k, val_fraction, seed)
        train.update((t + k * chunk_rows).tolist())
        val.update((v + k * chunk_rows).tolist())
    return train, val


@pytest.mark.parametrize("per_column", [True, False])
def test_streamed_normaliser_equals_the_in_memory_one_on_the_same_file(tmp_path, per_column):
    """Min and max are exact operations: a running min/max over 997-row chunks gives the same bits."""
    data = synthetic_cms_jets(5003, seed=7).data.astype(np.float32)
    data[4321, 5] = -1.0e6  # extremes inside a late chunk, not the first
    data[2500, 7] = 3.5e7
    np.save(tmp_path / "jets.npy", data)
    np.savez(tmp_path / "jets.npz", data=data)
    streamed = BalerDataModule(str(tmp_path / "jets.npy"), streaming=True, chunk_rows=997, per_column=per_column)
    in_memory = BalerDataModule(str(tmp_path / "jets.npz"), per_column=per_column)
    assert np.array_equal(streamed.normalizer.minimum, in_memory.normalizer.minimum)
    assert np.array_equal(streamed.normalizer.scale, in_memory.normalizer.scale)
    assert streamed.rows.dtypes == in_memory.table.dtypes and streamed.input_shape == in_memory.input_shape


@requires(NANOAOD)
def test_random_reads_of_a_root_file_open_it_once_per_copy(monkeypatch):
    """Opening a NanoAOD file and its tree took ~0.3 s, longer than a chunk's read: the source keeps it open
    for its reads; a pickled copy (a DataLoader worker's) opens its own."""
    import pickle

    from baler_lit import root_files
    from baler_lit.row_source import open_rows

    rows = open_rows(str(NANOAOD), root_prefix="Jet_")
    opened, real_open = [], root_files.open_root
    monkeypatch.setattr(root_files, "open_root", lambda path: opened.append(path) or real_open(path))
    first = [rows.read_rows(start, start + 20) for start in (0, 100, 300)]
    assert len(opened) == 1
    copy = pickle.loads(pickle.dumps(rows))
    assert np.array_equal(copy.read_rows(100, 120), first[1]) and len(opened) == 2
    rows.close()
    copy.close()
    assert np.array_equal(rows.read_rows(0, 20), first[0]) and len(opened) == 3  # closed: opened again


@requires(NANOAOD)
def test_root_jets_stream_rows_read_at_random_as_the_table_holds_them(monkeypatch):
    """One row per jet: a random read finds its entries from every 7th entry's first row (a small stride, so
    reads start and end between marks), and the streamed normaliser equals the in-memory one."""
    from baler_lit import row_source
    from baler_lit.sources import load_root

    monkeypatch.setattr(row_source, "ENTRY_INDEX_STRIDE", 7)
    table = load_root(NANOAOD, prefix="Jet_")
    dm = BalerDataModule(str(NANOAOD), root_prefix="Jet_", streaming=True, chunk_rows=50, val_fraction=0.2)
    rows = dm.rows
    assert isinstance(rows, row_source.RootRows) and rows.n_rows == table.n_rows > rows.n_entries
    rng = np.random.default_rng(0)
    for _ in range(12):
        start = int(rng.integers(0, rows.n_rows))
        stop = int(rng.integers(start + 1, rows.n_rows + 1))
        assert np.array_equal(rows.read_rows(start, stop), table.data[start:stop])
    in_memory = BalerDataModule(str(NANOAOD), root_prefix="Jet_")
    assert np.array_equal(dm.normalizer.minimum, in_memory.normalizer.minimum)
    assert np.array_equal(dm.normalizer.scale, in_memory.normalizer.scale)
    loader = ChunkedBatches(rows, dm.normalizer, "train", 32, 0.2, 50, 3, seed=0, dtype=torch.float64)
    seen = loader.normalizer.inverse(np.concatenate([b.numpy() for b in loader]))
    train_rows, _ = _split_rows(table.n_rows, 50, 0.2, seed=0)
    expected = table.data[sorted(train_rows)]
    by_row = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731 (rows in one canonical order)
    assert len(seen) == len(expected) == table.n_rows - round(0.2 * table.n_rows)
    assert np.allclose(by_row(seen), by_row(expected), rtol=1e-9, atol=1e-9 * np.abs(table.data).max())


def test_every_training_row_once_per_epoch_and_validation_rows_never(tmp_path):
    n, chunk, f = 10_007, 1000, 0.15
    np.save(tmp_path / "jets.npy", _indexed(n).data)
    dm = BalerDataModule(str(tmp_path / "jets.npy"), batch_size=64, val_fraction=f, seed=4, streaming=True,
                         chunk_rows=chunk, window_chunks=3)  # fmt: skip
    train_rows, val_rows = _split_rows(n, chunk, f, seed=4)
    assert len(val_rows) == round(n * f) and not train_rows & val_rows and len(train_rows | val_rows) == n
    loader = ChunkedBatches(dm.rows, dm.normalizer, "train", 64, f, chunk, 3, seed=4, dtype=torch.float64)
    orders = []
    for _ in range(3):
        batches = list(loader)
        assert len(batches) == len(loader) == -(-len(train_rows) // 64)
        assert all(len(b) == 64 for b in batches[:-1])  # rows carried across windows keep batches full
        seen = np.concatenate([_row_numbers(b, loader) for b in batches])
        assert len(seen) == len(train_rows) and set(seen.tolist()) == train_rows  # each exactly once
        orders.append(seen)
    assert not np.array_equal(orders[0], orders[1])  # a new permutation every epoch
    val = ChunkedBatches(dm.rows, dm.normalizer, "val", 50, f, chunk, 3, shuffle=False, seed=4, dtype=torch.float64)
    seen_val = np.concatenate([_row_numbers(b, val) for b in val])
    assert sorted(seen_val.tolist()) == sorted(val_rows)
    again = ChunkedBatches(dm.rows, dm.normalizer, "train", 64, f, chunk, 3, seed=4, dtype=torch.float64)
    assert np.array_equal(np.concatenate([_row_numbers(b, again) for b in again]), orders[0])  # seeded


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_runs_the_same_number_of_batches_when_rows_do_not_divide(world):
    n, chunk, batch = 4212, 97, 16  # 3791 training rows: not divisible by 2 or 3
    table = _indexed(n)
    source = TableRows(table)
    from baler_lit.normalization import MinMaxNormalizer

    norm = MinMaxNormalizer.fit(table.data)
    loaders = [ChunkedBatches(source, norm, "train", batch, 0.1, chunk, 2, seed=1, rank=r, num_replicas=world,
                              dtype=torch.float64) for r in range(world)]  # fmt: skip
    train_rows, _ = _split_rows(n, chunk, 0.1, seed=1)
    assert len(train_rows) % world
    for _ in range(2):
        per_rank = [[_row_numbers(b, loader) for b in loader] for loader in loaders]
        counts = [len(batches) for batches in per_rank]
        assert counts == [len(loaders[0])] * world  # equal: no rank waits in the epoch-end collective
        rows = np.concatenate([np.concatenate(batches) for batches in per_rank])
        assert len(rows) == len(set(rows.tolist())) == world * (len(train_rows) // world)  # no row twice
        assert set(rows.tolist()) <= train_rows and len(train_rows) - len(rows) < world


class CountingRows(TableRows):
    """An instrumented reader: records every read and how many rows it handed out are still alive at once."""

    def __init__(self, table: Table) -> None:
        super().__init__(table)
        self.reads: list[int] = []
        self.alive = 0
        self.most_alive = 0

    def _released(self, n: int) -> None:
        self.alive -= n

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        values = np.array(self.table.data[start:stop])  # a copy, as a memory map's read is
        self.reads.append(len(values))
        self.alive += len(values)
        self.most_alive = max(self.most_alive, self.alive)
        weakref.finalize(values, self._released, len(values))
        return values


@pytest.mark.parametrize("rows", [20_000, 80_000])
def test_rows_in_memory_at_once_stay_within_the_chunk_bound_whatever_the_rows(rows):
    chunk, window = 1000, 3
    source = CountingRows(_indexed(rows))
    dm = BalerDataModule(streaming=True, chunk_rows=chunk, window_chunks=window, val_fraction=0.2,
                         batch_size=128)  # fmt: skip
    dm._rows = source  # the data module's reader, instrumented
    for split in ("train", "val"):
        loader = dm._chunked(split, 128, split == "train")
        for batch in loader:
            assert len(batch) <= 128
    assert sum(source.reads) == 2 * rows  # each split read every chunk once
    assert max(source.reads) <= chunk
    assert 0 < source.most_alive <= chunk * window  # never more than one window of the input, 4x rows or not
    assert source.alive == 0


def _fit(root: Path, *extra) -> int:
    root.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setattr(sys, "argv", ["baler-lit"])
        return main(["fit", "--seed_everything", "0", "--model.latent_dim", "4", "--model.lr_patience", "null", "--data.streaming", "true",
                     "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
                     "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
                     "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(root),
                     *extra])  # fmt: skip


def _hostile_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    data = _indexed(600).data
    cases = {}
    np.save(tmp_path / "full.npy", data)
    raw = (tmp_path / "full.npy").read_bytes()
    (tmp_path / "truncated.npy").write_bytes(raw[: len(raw) // 2])
    cases["truncated"] = (tmp_path / "truncated.npy", "truncated")
    nan = data.copy()
    nan[555, 3] = np.nan  # in the last chunk: the scanning pass finds it before any training
    np.save(tmp_path / "nan.npy", nan)
    cases["nan"] = (tmp_path / "nan.npy", "non-finite")
    np.savez_compressed(tmp_path / "deflated.npz", data=data)
    cases["deflated"] = (tmp_path / "deflated.npz", "random order")
    np.save(tmp_path / "objects.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    cases["objects"] = (tmp_path / "objects.npy", "numeric")
    with zipfile.ZipFile(tmp_path / "nodata.npz", "w") as zf:
        zf.writestr("other.npy", raw)
    cases["no data member"] = (tmp_path / "nodata.npz", "no array 'data'")
    return cases


def test_cli_streamed_fit_refuses_bad_input_with_one_line_and_exit_2(tmp_path, capsys):
    for name, (path, expected) in _hostile_inputs(tmp_path).items():
        code = _fit(tmp_path / name, "--data.path", str(path), "--data.chunk_rows", "128")
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, name
        assert len(err) == 1 and err[0].startswith("baler-lit: error:") and expected in err[0], (name, err)
    assert _fit(tmp_path / "zero", "--data.path", str(tmp_path / "full.npy"), "--data.chunk_rows", "0") == 2
    assert "chunk_rows must be an integer >= 1" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.ckpt"))


def test_cli_streamed_fit_trains_and_checkpoints_the_streamed_normaliser(tmp_path):
    from baler_lit.cli import load_checkpoint

    np.save(tmp_path / "jets.npy", _indexed(900).data.astype(np.float32))
    code = _fit(tmp_path / "run", "--data.path", str(tmp_path / "jets.npy"), "--data.chunk_rows", "256",
                "--data.batch_size", "64", "--trainer.enable_checkpointing", "true",
                "--trainer.callbacks+=baler_lit.module.BalerCheckpoint", "--trainer.callbacks.filename", "best")
    assert code == 0
    (ckpt,) = tmp_path.rglob("best.ckpt")
    trained = load_checkpoint(ckpt)
    expected = BalerDataModule(str(tmp_path / "jets.npy"), streaming=True).normalizer
    assert np.array_equal(trained.normalizer.minimum, expected.minimum) and trained.column_dtypes[1] == "float32"


def test_streaming_settings_are_checked_when_the_module_is_made():
    with pytest.raises(BalerInputError, match="window_chunks must be an integer >= 1"):
        BalerDataModule(streaming=True, window_chunks=0)


@pytest.mark.slow
def test_two_ddp_ranks_stream_equal_batch_counts_and_disjoint_rows(tmp_path, rank_zygote):
    sys.path.insert(0, str(HERE))
    import baler_stream_ddp_fit as script

    np.save(tmp_path / "jets.npy", _indexed(script.ROWS).data)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    run = rank_zygote.run(HERE / "baler_stream_ddp_fit.py", [tmp_path, tmp_path / "jets.npy"], tmp_path / "ranks",
                          env=env, timeout_s=300)  # a rank stuck in a collective would time out here
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    train_rows, _ = _split_rows(script.ROWS, script.CHUNK_ROWS, script.VAL_FRACTION, seed=0)
    assert len(train_rows) % 2  # the case that needs care
    for epoch in range(script.EPOCHS):
        e0, e1 = (r["epochs"][epoch] for r in ranks)
        assert e0["batches"] == e1["batches"] == e0["num_training_batches"] == -(-(len(train_rows) // 2) // script.BATCH)
        rows = e0["rows"] + e1["rows"]
        assert len(rows) == len(set(rows)) == len(train_rows) - 1 and set(rows) <= train_rows
