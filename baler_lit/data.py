"""LightningDataModule for Baler data with a fast in-memory batch path.

The whole normalised table lives as one tensor on the training device. Each epoch draws one permutation
(shuffled, unlike Baler), gathers the table once in that order, and yields contiguous slices of it as
batches: no per-sample ``__getitem__``, no collate, no host-to-device copy per step.

Data sources, in order: ``path`` (``.npz`` or ``.root``, see :mod:`baler_lit.sources`) or, when no path is
given, the embedded synthetic CMS-jet table (:mod:`baler_lit.synthetic`). The min-max normaliser is fitted on
the whole table (as Baler does) and handed to the LightningModule, which stores it in checkpoints.

``streaming=True`` trains on data larger than memory: nothing is loaded whole; the normaliser comes from one
scanning pass and batches are read chunk by chunk (:mod:`baler_lit.streaming`). It is a setting, not chosen
automatically above a memory bound: the two modes shuffle differently (the whole table against a window of
chunks) and split differently, so a switch made by the machine's free memory would make the same config give
another model on another machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import lightning as L
import numpy as np
import torch

from .errors import BalerInputError
from .normalization import MinMaxNormalizer
from .row_source import RowSource, TableRows, open_rows
from .sources import load_table
from .streaming import CHUNK_ROWS, WINDOW_CHUNKS, ChunkedBatches, check_stream_settings
from .synthetic import synthetic_cms_jets
from .table import Table, column_dtype_names


class TensorBatches:
    """Batches of one on-device tensor by slicing a per-epoch permutation.

    Args:
        data: ``(n, *sample_shape)`` tensor, already on the training device and in the training dtype.
        batch_size: rows per batch; the last batch of an epoch may be smaller.
        shuffle: draw a new permutation at every ``iter()``; otherwise keep the stored order.
        seed: seed of the permutation generator (same seed → same sequence of epochs).
        rank, num_replicas: under data-parallel training each rank takes every ``num_replicas``-th row of the
            shared permutation, truncated so all ranks run the same number of batches.
    """

    def __init__(
        self,
        data: torch.Tensor,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        num_replicas: int = 1,
    ) -> None:
        if batch_size < 1:
            raise BalerInputError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < num_replicas:
            raise BalerInputError(f"rank {rank} outside [0, {num_replicas})")
        self.data = data
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.rank = rank
        self.num_replicas = num_replicas
        self._rows = len(data) // num_replicas
        if self._rows < 1:
            raise BalerInputError(f"{len(data)} rows cannot be split over {num_replicas} processes")
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(self._rows / self.batch_size)

    def _epoch_view(self) -> torch.Tensor:
        n = len(self.data)
        if self.shuffle:
            perm = torch.randperm(n, generator=self._generator)
            idx = perm[self.rank :: self.num_replicas][: self._rows].to(self.data.device, non_blocking=True)
            return self.data.index_select(0, idx)
        if self.num_replicas == 1:
            return self.data
        return self.data[self.rank :: self.num_replicas][: self._rows]

    def __iter__(self) -> Iterator[torch.Tensor]:
        view = self._epoch_view()
        for start in range(0, self._rows, self.batch_size):
            yield view[start : start + self.batch_size]


class BalerDataModule(L.LightningDataModule):
    """Baler's data as a LightningDataModule.

    Args:
        path: ``.npz`` or ``.root`` input; ``None`` uses the synthetic CMS-jet generator.
        batch_size: rows per training batch (Baler: 512).
        val_fraction: fraction of rows held out for validation. 0 disables validation: ``setup("fit")`` then
            sets ``trainer.limit_val_batches = 0``.
        shuffle: shuffle the training rows every epoch.
        seed: seed for the train/validation split, the shuffling and the synthetic data.
        synthetic_rows: rows of the synthetic table when ``path`` is ``None``.
        npz_key: name of the data array in an ``.npz`` file.
        root_tree, root_branches, root_prefix: TTree and branch selection for ``.root`` inputs.
        per_column: per-column min-max (default for tables); ``None`` means per column for tables and one
            global range for frames.
        eval_batch_size: batch size for validation/test/predict (defaults to ``batch_size``).
        type_list: Baler's ``type_list``: one numpy dtype name per column (``"int"``, ``"float64"``, ...) that
            overrides the dtypes read from the file; integer columns are restored rounded. Stored in the
            checkpoint, so ``baler-lit compress`` uses them for files that carry no dtypes.
        streaming: read batches from disk chunk by chunk instead of holding the table in memory (see the module
            docstring); needs random access: ``.npy``, an uncompressed (``np.savez``) ``.npz`` or ROOT.
        chunk_rows, window_chunks: rows per chunk read and chunks per shuffling window when streaming (at most
            ``chunk_rows × window_chunks`` input rows in memory at once).
        apply_normalization: Baler's ``apply_normalization``; ``False`` trains on the raw values (an identity
            normalisation, stored in the checkpoint and the ``.baler`` file like any other).

    ``test`` and ``predict`` run over the whole table in file order (the rows a compression covers).
    """

    def __init__(
        self,
        path: str | None = None,
        batch_size: int = 512,
        val_fraction: float = 0.2,
        shuffle: bool = True,
        seed: int = 0,
        synthetic_rows: int = 100_000,
        npz_key: str = "data",
        root_tree: str | None = None,
        root_branches: Sequence[str] | None = None,
        root_prefix: str | None = None,
        per_column: bool | None = None,
        eval_batch_size: int | None = None,
        type_list: Sequence[str] | None = None,
        streaming: bool = False,
        chunk_rows: int = CHUNK_ROWS,
        window_chunks: int = WINDOW_CHUNKS,
        apply_normalization: bool = True,
    ) -> None:
        super().__init__()
        check_stream_settings(batch_size, chunk_rows, window_chunks)
        if not 0.0 <= val_fraction < 1.0:
            raise BalerInputError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.path = path
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or batch_size)
        self.val_fraction = float(val_fraction)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.synthetic_rows = int(synthetic_rows)
        self.npz_key = npz_key
        self.root_tree = root_tree
        self.root_branches = list(root_branches) if root_branches else None
        self.root_prefix = root_prefix
        self.per_column = per_column
        self.type_list = [str(t) for t in type_list] if type_list else None
        self.streaming = bool(streaming)
        self.chunk_rows = int(chunk_rows)
        self.window_chunks = int(window_chunks)
        self.apply_normalization = bool(apply_normalization)
        self._rows: RowSource | None = None
        self._table: Table | None = None
        self._normalizer: MinMaxNormalizer | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    # -- data on the host -------------------------------------------------------------------------------
    @property
    def table(self) -> Table:
        """The physical data (loaded on first use and cached)."""
        if self._table is None:
            if self.path is None:
                self._table = synthetic_cms_jets(self.synthetic_rows, self.seed)
            else:
                self._table = load_table(
                    self.path, self.npz_key, self.root_tree, self.root_branches, self.root_prefix
                )
            if self.type_list is not None:
                self._table.set_dtypes(self.type_list)
                self._table.dtypes_inferred = False
        return self._table

    @property
    def rows(self) -> RowSource:
        """The input described (rows, sample shape, names, dtypes, source) and readable block by block: the file
        itself when streaming (nothing loaded), else the in-memory table."""
        if self._rows is None:
            if not self.streaming:
                self._rows = TableRows(self.table)
            elif self.path is None:
                self._rows = TableRows(synthetic_cms_jets(self.synthetic_rows, self.seed))
            else:
                self._rows = open_rows(self.path, self.npz_key, self.root_tree, self.root_branches, self.root_prefix)
            if self.streaming and self.type_list is not None:
                self._rows.dtypes = column_dtype_names(self.type_list, len(self._rows.dtypes), self._rows.source)
                if not isinstance(self._rows, TableRows):
                    self._rows.dtypes_inferred = False
        return self._rows

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample: ``(n_columns,)`` or ``(H, W)``; the CLI links it to ``model.input_shape``."""
        return self.rows.sample_shape

    @property
    def normalizer(self) -> MinMaxNormalizer:
        """Min-max normaliser fitted on the whole input (streaming: one scanning pass, one chunk in memory); the
        identity with ``apply_normalization=False``."""
        if self._normalizer is None and not self.apply_normalization:
            self._normalizer = MinMaxNormalizer.identity()
        if self._normalizer is None:
            rows = self.rows
            per_column = (not rows.is_frames) if self.per_column is None else self.per_column
            if self.streaming:
                blocks = (values for _, values in rows.blocks(self.chunk_rows))
                self._normalizer = MinMaxNormalizer.fit_blocks(blocks, per_column=per_column)
            else:
                self._normalizer = MinMaxNormalizer.fit(self.table.data, per_column=per_column)
        return self._normalizer

    @property
    def has_validation(self) -> bool:
        return self.val_fraction > 0 and self._n_val() > 0

    def _n_val(self) -> int:
        n = self.rows.n_rows
        n_val = int(round(n * self.val_fraction))
        if self.val_fraction > 0 and n_val >= n:
            raise BalerInputError(f"val_fraction {self.val_fraction} leaves no training rows out of {n}")
        return n_val

    def split_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """Deterministic (by ``seed``) train and validation row indices."""
        n = self.table.n_rows
        order = np.random.default_rng(self.seed).permutation(n)
        n_val = self._n_val()
        return np.sort(order[n_val:]), np.sort(order[:n_val])

    # -- tensors on the device --------------------------------------------------------------------------
    def _device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        trainer = self.trainer
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        module = trainer.lightning_module if trainer is not None else None
        dtype = module.dtype if module is not None and module.dtype.is_floating_point else torch.float32
        return device, dtype

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def setup(self, stage: str) -> None:
        """Forget tensors of an earlier run; they are built when the loops first ask for a loader.

        Building them lazily (after Lightning has restored a checkpoint) lets test/predict runs normalise with
        the normaliser stored in the checkpoint rather than one fitted on the new data.
        """
        if stage == "fit" and not self.has_validation and self.trainer is not None:
            # no validation split: switch the validation loop off (an empty loader would make Lightning warn)
            self.trainer.limit_val_batches = 0
        self._tensors = {}

    def _active_normalizer(self) -> MinMaxNormalizer:
        module = self.trainer.lightning_module if self.trainer is not None else None
        stored = getattr(module, "normalizer", None)
        return stored if stored is not None else self.normalizer

    def _tensor(self, split: str) -> torch.Tensor:
        """Normalise once and place the split on the training device in the module's dtype."""
        if split not in self._tensors:
            device, dtype = self._device_and_dtype()
            np_dtype = torch.empty((), dtype=dtype).numpy().dtype
            normalised = self._active_normalizer().transform(self.table.data, np_dtype)
            if split in ("train", "val"):
                train_idx, val_idx = self.split_indices()
                self._tensors["train"] = torch.from_numpy(normalised[train_idx]).to(device)
                if len(val_idx):
                    self._tensors["val"] = torch.from_numpy(normalised[val_idx]).to(device)
            else:
                self._tensors["all"] = torch.from_numpy(normalised).to(device)
        return self._tensors[split]

    def _chunked(self, split: str, batch_size: int, shuffle: bool, distributed: bool = True) -> ChunkedBatches:
        device, dtype = self._device_and_dtype()
        rank, world = self._rank() if distributed else (0, 1)
        return ChunkedBatches(self.rows, self._active_normalizer(), split, batch_size, self.val_fraction,
                              self.chunk_rows, self.window_chunks, shuffle, self.seed, rank, world, device,
                              dtype)  # fmt: skip

    def train_dataloader(self) -> TensorBatches | ChunkedBatches:
        if self.streaming:
            return self._chunked("train", self.batch_size, self.shuffle)
        rank, world = self._rank()
        return TensorBatches(self._tensor("train"), self.batch_size, self.shuffle, self.seed, rank, world)

    def val_dataloader(self) -> TensorBatches | ChunkedBatches:
        if not self.has_validation:
            raise BalerInputError(
                f"no validation rows (data.val_fraction={self.val_fraction}); set a val_fraction > 0 to validate"
            )
        if self.streaming:
            return self._chunked("val", self.eval_batch_size, False)
        rank, world = self._rank()
        return TensorBatches(self._tensor("val"), self.eval_batch_size, False, self.seed, rank, world)

    def test_dataloader(self) -> TensorBatches | ChunkedBatches:
        if self.streaming:
            return self._chunked("all", self.eval_batch_size, False)
        rank, world = self._rank()
        return TensorBatches(self._tensor("all"), self.eval_batch_size, False, self.seed, rank, world)

    def predict_dataloader(self) -> TensorBatches | ChunkedBatches:
        if self.streaming:
            return self._chunked("all", self.eval_batch_size, False, distributed=False)
        return TensorBatches(self._tensor("all"), self.eval_batch_size, False, self.seed)
