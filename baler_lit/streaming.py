"""Training on data larger than memory: batches read from disk chunk by chunk (``data.streaming: true``).

The input's rows are cut into *chunks* of ``chunk_rows`` consecutive rows in file order; chunk ``k`` holds rows
``[k·chunk_rows, min((k+1)·chunk_rows, n))``.

- **Normaliser.** One scanning pass over the input's blocks (:meth:`~baler_lit.row_source.RowSource.blocks`:
  one memory-mapped block at a time) keeps a running per-column minimum and maximum
  (:meth:`~baler_lit.normalization.MinMaxNormalizer.fit_blocks`); min and max are exact, so it equals the
  in-memory normaliser bit for bit.
- **Validation split** (:func:`chunk_split`). Chunk ``k`` holds ``round(stop·f) − round(start·f)``
  validation rows (``f`` = ``val_fraction``), drawn by a generator seeded with ``(seed, k)``: deterministic,
  memory of one chunk, and ``round(n·f)`` rows in all, as the in-memory split (which rows differ: this split
  is stratified by chunk).
- **Epoch** (:class:`ChunkedBatches`). A generator seeded with ``(seed, epoch)`` permutes the chunk order;
  the chunks are read ``window_chunks`` at a time (random access: :meth:`RowSource.read_rows`), the window's
  rows of the split are normalised into one tensor on the training device and permuted (shuffling within the
  window and, through the chunk order, across the file), and the batches are contiguous slices of it: the
  in-memory mode's index-sliced fast path, per window. Fewer than ``batch_size`` rows left at a window's end
  are carried into the next window, so batches stay full.
- **Data parallel.** Every rank draws the same permutations; rank ``r`` takes the rows at positions
  ``≡ r (mod world size)`` of the epoch's global row sequence (the offset carried across windows), truncated
  to ``rows // world size``. Every rank therefore runs exactly ``ceil((rows // world) / batch_size)`` batches
  (unequal counts would leave one rank waiting in the epoch-end collective forever); the
  ``rows mod world size`` rows dropped are the epoch's last, different every epoch, as in the in-memory mode.
  The price: every rank reads every chunk of its split each epoch and keeps 1/world size of its rows (the ranks
  of one node share the page cache; across nodes the reads multiply). Giving each rank its own chunks would read
  the file once, but the ranks' row counts would then differ from epoch to epoch while the loader's length must
  not.

At most ``window_chunks × chunk_rows`` rows of the input (plus fewer than ``batch_size`` carried rows) are in
memory at once, whatever the file's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from .errors import BalerInputError
from .normalization import MinMaxNormalizer
from .row_source import RowSource

#: Rows per chunk read from disk (24 float64 columns: 12.6 MB).
CHUNK_ROWS = 65536
#: Chunks mixed in one shuffling window.
WINDOW_CHUNKS = 4


def val_rows_before(row: int, val_fraction: float) -> int:
    """Validation rows among the first ``row`` rows: ``round(row · val_fraction)`` (so chunks add up exactly)."""
    return int(round(row * val_fraction))


def chunk_split(n_rows: int, chunk_rows: int, k: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) row indices local to chunk ``k``, sorted; deterministic by ``(seed, k)``."""
    start, stop = k * chunk_rows, min((k + 1) * chunk_rows, n_rows)
    n_val = val_rows_before(stop, val_fraction) - val_rows_before(start, val_fraction)
    order = np.random.default_rng([seed, k]).permutation(stop - start)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


class ChunkedBatches:
    """Batches of one split of a :class:`RowSource`, read chunk by chunk (see the module docstring).

    Args:
        source: the input; it must allow random access (:meth:`RowSource.read_rows`).
        normalizer: maps the physical rows to the model's [0, 1] inputs.
        split: ``"train"``, ``"val"`` or ``"all"`` (every row, for test and predict).
        batch_size: rows per batch; the last batch of an epoch may be smaller.
        val_fraction: the split's validation share (:func:`chunk_split`).
        chunk_rows, window_chunks: rows per chunk and chunks per shuffling window.
        shuffle: permute the chunk order and the rows within each window, a new permutation every ``iter()``.
        seed: seed of the split and of the permutations.
        rank, num_replicas: this process's rank and the world size.
        device, dtype: where and in which dtype the batches are made.
    """

    def __init__(self, source: RowSource, normalizer: MinMaxNormalizer, split: str, batch_size: int,
                 val_fraction: float = 0.0, chunk_rows: int = CHUNK_ROWS, window_chunks: int = WINDOW_CHUNKS,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, num_replicas: int = 1,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        if split not in ("train", "val", "all"):
            raise BalerInputError(f"split must be 'train', 'val' or 'all', got {split!r}")
        check_stream_settings(batch_size, chunk_rows, window_chunks)
        if not 0 <= rank < num_replicas:
            raise BalerInputError(f"rank {rank} outside [0, {num_replicas})")
        self.source = source
        self.normalizer = normalizer
        self.split = split
        self.batch_size = int(batch_size)
        self.val_fraction = float(val_fraction) if split != "all" else 0.0
        self.chunk_rows = int(chunk_rows)
        self.window_chunks = int(window_chunks)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank = rank
        self.num_replicas = num_replicas
        self.device = torch.device(device)
        self.dtype = dtype
        self._np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self.n_chunks = math.ceil(source.n_rows / self.chunk_rows)
        n_val = val_rows_before(source.n_rows, self.val_fraction)
        split_rows = {"train": source.n_rows - n_val, "val": n_val, "all": source.n_rows}[split]
        self.rows_per_rank = split_rows // num_replicas
        if self.rows_per_rank < 1:
            raise BalerInputError(f"{split_rows} {split} rows cannot be split over {num_replicas} processes")
        self._epoch = 0

    def __len__(self) -> int:
        return math.ceil(self.rows_per_rank / self.batch_size)

    def _window_rows(self, chunks: np.ndarray) -> np.ndarray:
        """The split's rows of ``chunks`` (in that order), physical units, float64."""
        parts = []
        for k in chunks.tolist():
            start = k * self.chunk_rows
            values = self.source.read_rows(start, min(start + self.chunk_rows, self.source.n_rows))
            if self.split != "all":
                train, val = chunk_split(self.source.n_rows, self.chunk_rows, k, self.val_fraction, self.seed)
                values = values[train if self.split == "train" else val]
            parts.append(values)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def __iter__(self) -> Iterator[torch.Tensor]:
        rng = np.random.default_rng([self.seed, self._epoch])
        self._epoch += 1
        order = rng.permutation(self.n_chunks) if self.shuffle else np.arange(self.n_chunks)
        position = taken = 0  # rows of the epoch's global sequence before this window; rows this rank took
        carry: torch.Tensor | None = None
        for w in range(0, self.n_chunks, self.window_chunks):
            if taken == self.rows_per_rank:
                break
            values = self._window_rows(order[w : w + self.window_chunks])
            n = len(values)
            local = rng.permutation(n) if self.shuffle else np.arange(n)
            mine = local[(self.rank - position) % self.num_replicas :: self.num_replicas][: self.rows_per_rank - taken]
            position += n
            taken += len(mine)
            window = torch.from_numpy(self.normalizer.transform(values, self._np_dtype)).to(self.device)
            del values
            view = window.index_select(0, torch.from_numpy(mine).to(self.device))
            if carry is not None:
                view, carry = torch.cat([carry, view]), None
            full = len(view) - len(view) % self.batch_size
            for start in range(0, full, self.batch_size):
                yield view[start : start + self.batch_size]
            if full < len(view):
                carry = view[full:]
        if carry is not None:
            yield carry


def check_stream_settings(batch_size: int, chunk_rows: int, window_chunks: int) -> None:
    """Refuse a batch size, chunk size or window that cannot work (one line naming the setting)."""
    for name, value in (("batch_size", batch_size), ("chunk_rows", chunk_rows), ("window_chunks", window_chunks)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise BalerInputError(f"{name} must be an integer >= 1, got {value!r}")
