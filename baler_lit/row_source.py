"""Input rows read block by block, so ``compress`` needs memory bounded by a block, not by the file.

A :class:`RowSource` describes an input (rows, sample shape, column names and dtypes, where it came from) and
yields its rows as float64 blocks, each checked for NaN/inf. Four kinds:

- :class:`TableRows`: a :class:`~baler_lit.table.Table` already in memory (ROOT files, Baler's examples);
- :class:`MappedRows`: a ``.npy`` file, or an uncompressed (``np.savez``) member of an ``.npz`` file, read
  through a memory map of one block at a time (each map is closed before the next is made, so the
  resident file pages stay those of one block);
- :class:`StreamedRows`: a deflated (``np.savez_compressed``) ``.npz`` member, decompressed block by block
  (so a "zip bomb" of zeros never sits in memory inflated);
- :class:`RootRows`: numeric branches of a ROOT TTree, read with ``uproot.iterate`` (uproot imported lazily).

:func:`open_rows` picks one from the file's suffix. The npy header is a trust boundary like the rest: only
numeric dtypes, Fortran order only where the file is mapped (a deflated member streams rows, which a
column-major array does not hold together), and the declared size must fit in the bytes the file actually holds
before anything is mapped or allocated (the ``names`` and ``dtypes`` members too, at most
:data:`MAX_LABELS_BYTES`). :meth:`RowSource.to_table` is how every ``.npz`` is read whole
(:func:`~baler_lit.sources.load_npz`): a table too large to allocate is one error line, not a traceback.
"""

from __future__ import annotations

import math
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .errors import BalerInputError, existing_file
from .table import Table, check_finite, column_dtype_names, dtypes_from_whole, whole_number_columns

#: Rows read per block when the caller states no block size (bounded further by :data:`BLOCK_VALUES`).
BLOCK_ROWS = 65536
#: Most values in one block (float64: 16 MiB).
BLOCK_VALUES = 2**21
#: Bytes of branch data ``uproot.iterate`` reads per step from a ROOT file.
ROOT_STEP = "32 MB"
#: :class:`RootRows` keeps the first row number of one entry in this many (what a random read starts from).
ENTRY_INDEX_STRIDE = 256
#: Most bytes the ``names`` or ``dtypes`` member of an npz file may take (100k columns of 160-character names).
MAX_LABELS_BYTES = 64 * 2**20
#: Fixed part of a zip local file header (bytes).
ZIP_LOCAL_HEADER = struct.Struct("<4s5H3L2H")


class RowSource:
    """Rows of one input, block by block (see the module docstring). Subclasses implement :meth:`_raw_blocks`."""

    source: str
    n_rows: int
    sample_shape: tuple[int, ...]
    names: list[str]
    dtypes: list[str]
    dtypes_inferred: bool = False

    @property
    def is_frames(self) -> bool:
        return len(self.sample_shape) == 2

    @property
    def n_columns(self) -> int:
        return math.prod(self.sample_shape)

    @property
    def original_nbytes(self) -> int:
        """Bytes of the values in their original dtypes (as :attr:`Table.original_nbytes`)."""
        if self.is_frames:
            return self.n_rows * self.n_columns * np.dtype(self.dtypes[0]).itemsize
        return self.n_rows * sum(np.dtype(d).itemsize for d in self.dtypes)

    def _raw_blocks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        raise NotImplementedError

    def blocks(self, rows: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, float64 values of shape (n, *sample_shape))`` for consecutive blocks of exactly ``rows``
        rows (the last may be shorter, whatever sizes the reader delivers); raises naming the columns and rows
        where a block holds NaN or inf, and when the input holds another number of rows than it declared."""
        step = rows or block_rows(self.sample_shape)
        pending: list[np.ndarray] = []
        held = emitted = 0
        for _, raw in self._raw_blocks(step):
            pending.append(raw)
            held += len(raw)
            while held >= step or (held and emitted + held == self.n_rows):
                values = np.concatenate(pending) if len(pending) > 1 else pending[0]
                block, rest = values[:step], values[step:]
                pending, held = ([rest], len(rest)) if len(rest) else ([], 0)
                block = block.astype(np.float64)
                check_finite(block, self.names, self.source, emitted)
                yield emitted, block
                emitted += len(block)
        if emitted != self.n_rows or held:
            raise BalerInputError(f"{self.source} changed while it was read: {emitted + held} rows, not {self.n_rows}")

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as float64 (checked for NaN/inf), read at random (streaming training); only
        sources that can seek do: in-memory tables, memory-mapped ``.npy``/uncompressed ``.npz`` data and ROOT."""
        raise BalerInputError(
            f"{self.source}: streamed training reads chunks in random order, which this input cannot do (a"
            " deflated .npz member is inflated front to back); save the array with np.save or np.savez"
            " (uncompressed), or set data.streaming: false"
        )

    def to_table(self) -> Table:
        """All rows in memory, as a :class:`Table` (float64: 8 bytes per value, filled block by block)."""
        try:
            data = np.empty((self.n_rows, *self.sample_shape))
        except MemoryError:
            raise BalerInputError(
                f"{self.source}: {self.n_rows} rows of shape {self.sample_shape} need"
                f" {self.n_rows * self.n_columns * 8} bytes in memory as float64, more than can be allocated here"
            ) from None
        for start, values in self.blocks():
            data[start : start + len(values)] = values
        return Table(data, names=list(self.names), dtypes=list(self.dtypes), source=self.source,
                     dtypes_inferred=self.dtypes_inferred)  # fmt: skip


def block_rows(sample_shape: tuple[int, ...]) -> int:
    return max(1, min(BLOCK_ROWS, BLOCK_VALUES // math.prod(sample_shape)))


class TableRows(RowSource):
    """A :class:`Table` in memory as a row source (its dtypes and names are shared, not copied)."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.source = table.source
        self.n_rows = table.n_rows
        self.sample_shape = table.sample_shape
        self.names = table.names

    @property
    def dtypes(self) -> list[str]:  # the caller may describe the table's columns anew (training dtypes)
        return self.table.dtypes

    @dtypes.setter
    def dtypes(self, value: list[str]) -> None:
        self.table.dtypes = value

    @property
    def dtypes_inferred(self) -> bool:
        return self.table.dtypes_inferred

    def blocks(self, rows: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        step = rows or block_rows(self.sample_shape)
        for start in range(0, self.n_rows, step):
            yield start, self.table.data[start : start + step]  # float64 and finite already

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        return self.table.data[start:stop]

    def to_table(self) -> Table:
        return self.table


def as_row_source(data: Table | RowSource) -> RowSource:
    return data if isinstance(data, RowSource) else TableRows(data)


class _NpyArray(RowSource):
    """Shared description of an on-disk npy array: shape, dtype, names and dtypes (stated or inferred)."""

    def _describe(self, shape: tuple[int, ...], dtype: np.dtype, names: list[str], dtypes: list[str]) -> None:
        if len(shape) not in (2, 3):
            raise BalerInputError(f"{self.source}: data must be 2-D (rows, columns) or 3-D (frames, H, W), got "
                                  f"shape {shape}")  # fmt: skip
        if 0 in shape:
            raise BalerInputError(f"{self.source}: data is empty (shape {shape})")
        if dtype.kind not in "fiub" or dtype.fields is not None or dtype.subdtype is not None:
            raise BalerInputError(f"{self.source}: data must be numeric, got dtype {dtype}")
        self.n_rows = int(shape[0])
        self.sample_shape = tuple(int(s) for s in shape[1:])
        self.dtype = dtype
        n = 1 if self.is_frames else self.n_columns
        if self.is_frames:
            names = []
        elif not names:
            names = [f"col_{i}" for i in range(n)]
        elif len(names) != n:
            raise BalerInputError(f"{self.source}: {len(names)} column names for {n} columns (column-count mismatch)")
        self.names = names
        if dtypes:
            self.dtypes = column_dtype_names(dtypes, n, self.source)
        else:  # Baler's plain layout: the array's dtype, integer-valued float columns detected (one pass)
            self.dtypes = self._infer_dtypes() if dtype.kind == "f" else [dtype.name] * n
            self.dtypes_inferred = True

    def _infer_dtypes(self) -> list[str]:
        whole = np.ones(1 if self.is_frames else self.n_columns, dtype=bool)
        for _, raw in self._raw_blocks(block_rows(self.sample_shape)):
            whole &= whole_number_columns(raw, self.is_frames)
        return dtypes_from_whole(self.dtype, whole)


def _read_npy_header(fh, source: str, available: int) -> tuple[tuple[int, ...], np.dtype, int, bool]:
    """(shape, dtype, header bytes, Fortran order) of the numeric npy stream at ``fh``'s position; the data must
    fit in ``available`` bytes."""
    shape, dtype, header_bytes, fortran = _read_any_npy_header(fh, source, available)
    if dtype.kind not in "fiub" or dtype.fields is not None or dtype.hasobject:
        raise BalerInputError(f"cannot read {source}: data must be numeric, got dtype {dtype}")
    if len(shape) not in (2, 3):
        raise BalerInputError(f"{source}: data must be 2-D (rows, columns) or 3-D (frames, H, W), got shape {shape}")
    return shape, dtype, header_bytes, fortran


def _read_any_npy_header(fh, source: str, available: int) -> tuple[tuple[int, ...], np.dtype, int, bool]:
    """As :func:`_read_npy_header` for an array of any dtype and dimension."""
    start = fh.tell()
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"npy format version {version} is not supported")
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise BalerInputError(f"cannot read {source} as .npy: {' '.join(str(exc).split())[:200]}") from None
    header_bytes = fh.tell() - start
    if any(not isinstance(s, int) or s < 0 for s in shape):
        raise BalerInputError(f"{source}: the array's header declares an invalid shape {shape}")
    if math.prod(shape) * dtype.itemsize > available - header_bytes:
        raise BalerInputError(f"{source} is truncated: its header declares {shape} of {dtype}, more than the file holds")
    return tuple(shape), dtype, header_bytes, bool(fortran)


class MappedRows(_NpyArray):
    """An npy array at ``offset`` in ``path``, mapped one block at a time. A C-ordered array maps just the
    block's bytes; a Fortran-ordered one (``np.save`` of a transposed array or of many pandas frames' values)
    maps the whole array and reads the block's rows from each column, so the pages read are still one block's."""

    def __init__(self, path: Path, offset: int, available: int, source: str, names: list[str],
                 dtypes: list[str]) -> None:  # fmt: skip
        self.path = path
        self.source = source
        with open(path, "rb") as fh:
            fh.seek(offset)
            shape, dtype, header_bytes, self.fortran = _read_npy_header(fh, source, available)
        self.data_offset = offset + header_bytes
        self._describe(shape, dtype, names, dtypes)

    def _map(self, start: int, stop: int) -> tuple[np.memmap, np.ndarray]:
        """(the map to close, the rows ``start:stop`` in it)."""
        if self.fortran:
            mapped = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.data_offset, order="F",
                               shape=(self.n_rows, *self.sample_shape))  # fmt: skip
            return mapped, mapped[start:stop]
        row_bytes = self.n_columns * self.dtype.itemsize
        mapped = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.data_offset + start * row_bytes,
                           shape=(stop - start, *self.sample_shape))  # fmt: skip
        return mapped, mapped

    def _raw_blocks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, self.n_rows, rows):
            mapped, block = self._map(start, min(start + rows, self.n_rows))
            try:
                yield start, block
            finally:
                mapped._mmap.close()  # unmap now: the resident pages stay those of one block
                del mapped, block

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        try:
            mapped, block = self._map(start, stop)
        except (ValueError, OSError) as exc:  # the file shrank or vanished since it was opened
            raise BalerInputError(f"{self.source} changed while it was read (rows {start}..{stop - 1}):"
                                  f" {' '.join(str(exc).split())[:120]}") from None  # fmt: skip
        try:
            values = np.array(block, dtype=np.float64)
        finally:
            mapped._mmap.close()
            del mapped, block
        check_finite(values, self.names, self.source, start)
        return values


class StreamedRows(_NpyArray):
    """A deflated npz member, decompressed block by block (one pass per :meth:`blocks` call)."""

    def __init__(self, path: Path, member: str, source: str, names: list[str], dtypes: list[str]) -> None:
        self.path = path
        self.member = member
        self.source = source
        with zipfile.ZipFile(path) as zf, zf.open(member) as fh:
            shape, dtype, self.header_bytes, fortran = _read_npy_header(fh, source, zf.getinfo(member).file_size)
        if fortran:
            raise BalerInputError(f"{source}: a Fortran-ordered array in a compressed .npz cannot be read row by "
                                  "row; save it with np.savez (uncompressed) or in C order (np.ascontiguousarray)")
        self._describe(shape, dtype, names, dtypes)

    def _raw_blocks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        row_bytes = self.n_columns * self.dtype.itemsize
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as fh:
            fh.read(self.header_bytes)
            for start in range(0, self.n_rows, rows):
                n = min(rows, self.n_rows - start)
                raw = fh.read(n * row_bytes)
                if len(raw) != n * row_bytes:
                    raise BalerInputError(f"{self.source} is truncated at row {start}")
                yield start, np.frombuffer(raw, dtype=self.dtype).reshape(n, *self.sample_shape)


class RootRows(RowSource):
    """Numeric branches of one TTree read with ``uproot.iterate`` (``ROOT_STEP`` at a time): flat branches give
    one row per entry, jagged branches of one collection one row per object (as :func:`load_root`)."""

    def __init__(self, path: Path, tree: str | None, branches, prefix: str | None) -> None:
        from .root_files import open_root, select_branches

        self.path = path
        self.source = str(path)
        with open_root(path) as rootfile:
            ttree, self.branches, self.jagged = select_branches(rootfile, path, tree, branches, prefix)
            self.tree = ttree.object_path
            n_rows, n_entries, dtypes = 0, 0, None
            row_at = [0]  # rows before entry 0, ENTRY_INDEX_STRIDE, 2·ENTRY_INDEX_STRIDE, ... (for read_rows)
            for counts, columns in self._columns(ttree):
                before = n_rows + np.concatenate([[0], np.cumsum(counts)])  # rows before each entry of the step
                stride = ENTRY_INDEX_STRIDE
                row_at += before[(n_entries // stride + 1) * stride - n_entries :: stride].tolist()
                n_rows += len(columns[0])
                n_entries += len(counts)
                dtypes = dtypes or [c.dtype.name for c in columns]
        self.n_entries = n_entries
        self._row_at = np.array(row_at, dtype=np.int64)
        if not n_rows:
            raise BalerInputError(f"input {path}: the selected branches hold no values")
        self.n_rows = n_rows
        self.sample_shape = (len(self.branches),)
        self.names = list(self.branches)
        self.dtypes = dtypes
        self._reader = None  # (the open file, its TTree) for read_rows: see _tree_for_reads

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_reader"] = None  # a copy (a DataLoader worker's) opens its own
        return state

    def _tree_for_reads(self):
        """The TTree, opened on the first :meth:`read_rows` and kept: opening a NanoAOD file and its tree (header,
        streamers, ~1,000 branch descriptions) took ~0.3 s, longer than a chunk's read."""
        if self._reader is None:
            from .root_files import open_root

            rootfile = open_root(self.path)
            self._reader = (rootfile, rootfile[self.tree])
        return self._reader[1]

    def close(self) -> None:
        """Close the file :meth:`read_rows` keeps open (a later read opens it again)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader[0].close()

    def _columns(self, ttree, **entries) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
        """(rows of each entry, one array per branch) for every ``ROOT_STEP`` of the tree (within ``entries``:
        ``entry_start``/``entry_stop``)."""
        import awkward as ak

        from .root_files import root_columns

        try:
            for arrays in ttree.iterate(self.branches, step_size=ROOT_STEP, library="ak", **entries):
                first = arrays[self.branches[0]]
                counts = ak.to_numpy(ak.num(first, axis=1)) if self.jagged else np.ones(len(first), dtype=np.int64)
                yield counts, root_columns(arrays, self.branches, self.jagged, self.path)
        except BalerInputError:
            raise
        except Exception as exc:  # uproot raises many types for damaged files
            raise BalerInputError(f"cannot read branches from {self.path}: {exc}") from None

    def _raw_blocks(self, rows: int, **entries) -> Iterator[tuple[int, np.ndarray]]:
        from .root_files import open_root

        start = 0
        with open_root(self.path) as rootfile:
            for _, columns in self._columns(rootfile[self.tree], **entries):
                block = _block(columns)
                yield start, block
                start += len(block)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)``: the entries that hold them (found from every ``ENTRY_INDEX_STRIDE``-th entry's
        first row, so up to that many entries more on each side are read and dropped) through ``uproot.iterate``."""
        first = int(np.searchsorted(self._row_at, start, side="right")) - 1
        last = int(np.searchsorted(self._row_at, stop, side="left"))
        entry_start, entry_stop = first * ENTRY_INDEX_STRIDE, min(last * ENTRY_INDEX_STRIDE, self.n_entries)
        blocks = [_block(columns) for _, columns in self._columns(self._tree_for_reads(), entry_start=entry_start,
                                                                  entry_stop=entry_stop)]
        offset = start - int(self._row_at[first])
        values = np.concatenate(blocks)[offset : offset + stop - start] if blocks else np.empty((0, self.n_columns))
        if len(values) != stop - start:
            raise BalerInputError(f"{self.source} changed while it was read (rows {start}..{stop - 1})")
        check_finite(values, self.names, self.source, start)
        return values


def _block(columns: list[np.ndarray]) -> np.ndarray:
    """One float64 array, a column per branch."""
    block = np.empty((len(columns[0]), len(columns)))
    for j, col in enumerate(columns):
        block[:, j] = col
    return block


def _member_data_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where a stored zip member's bytes start in the file (after its local header, whose extra field may differ
    from the central directory's)."""
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        fields = ZIP_LOCAL_HEADER.unpack(fh.read(ZIP_LOCAL_HEADER.size))
    if fields[0] != b"PK\x03\x04":
        raise BalerInputError(f"{path} is corrupted: bad local header for {info.filename}")
    return info.header_offset + ZIP_LOCAL_HEADER.size + fields[9] + fields[10]


def _npz_strings(zf: zipfile.ZipFile, key: str, path: Path) -> list[str]:
    """The strings of member ``key`` (``names``, ``dtypes``) of an npz archive, or ``[]`` without one; its npy
    header must declare a string array that fits in the member's stated size before it is read."""
    member = f"{key}.npy"
    if member not in zf.namelist():
        return []
    info = zf.getinfo(member)
    if info.file_size > MAX_LABELS_BYTES:
        raise BalerInputError(f"input {path}: {key!r} takes {info.file_size} bytes, more than {MAX_LABELS_BYTES}")
    with zf.open(info) as fh:
        shape, dtype, _, _ = _read_any_npy_header(fh, f"{path} ({key!r})", info.file_size)
    if math.prod(shape) and dtype.kind not in "US":
        raise BalerInputError(f"input {path}: {key!r} must be strings, got dtype {dtype}")
    with zf.open(info) as fh:
        arr = np.lib.format.read_array(fh, allow_pickle=False)
    return [str(v) for v in arr.tolist()]


def open_rows(
    path: str | os.PathLike,
    npz_key: str = "data",
    root_tree: str | None = None,
    root_branches=None,
    root_prefix: str | None = None,
) -> RowSource:
    """A row source for ``path``: ``.npy``, ``.npz`` and ``.root`` stream (see the module docstring);
    ``example:<name>`` is a generated table (``CMS_synthetic``) in memory, or Baler's file where
    :func:`~baler_lit.examples.find_example` finds it, else its synthetic stand-in (warned), in memory."""
    from . import examples

    if examples.is_example(path):
        name = examples.example_name(str(path))
        table = examples.generated(name)
        if table is not None:
            return TableRows(table)
        found = examples.find_example(name)
        return open_npz(found, npz_key) if found is not None else TableRows(examples.stand_in(name))
    p = existing_file(path)
    suffix = p.suffix.lower()
    if suffix not in (".npy", ".npz", ".root"):
        raise BalerInputError(f"input {p}: unsupported format {suffix or '(no suffix)'!r}; use .npz or .root")
    if suffix == ".root":
        return RootRows(p, root_tree, root_branches, root_prefix)
    if suffix == ".npy":
        return MappedRows(p, 0, p.stat().st_size, str(p), [], [])
    return open_npz(p, npz_key)


def open_npz(p: Path, npz_key: str = "data") -> MappedRows | StreamedRows:
    """A row source for array ``npz_key`` of Baler's npz layout (with optional ``names`` and ``dtypes``); every
    member's npy header is checked against the member's size before anything of it is read."""
    try:
        if not zipfile.is_zipfile(p):
            raise BalerInputError(f"cannot read {p} as .npz: not a zip archive (np.savez writes one)")
        with zipfile.ZipFile(p) as zf:
            arrays = [n.removesuffix(".npy") for n in zf.namelist() if n.endswith(".npy")]
            if npz_key not in arrays:
                raise BalerInputError(f"input {p} has no array {npz_key!r} (arrays: {', '.join(arrays) or 'none'})")
            names, dtypes = _npz_strings(zf, "names", p), _npz_strings(zf, "dtypes", p)
            info = zf.getinfo(f"{npz_key}.npy")
        if info.compress_type == zipfile.ZIP_STORED:
            return MappedRows(p, _member_data_offset(p, info), info.file_size, str(p), names, dtypes)
        return StreamedRows(p, info.filename, str(p), names, dtypes)
    except BalerInputError:
        raise
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, NotImplementedError) as exc:
        raise BalerInputError(f"cannot read {p} as .npz: {' '.join(str(exc).split())[:200]}") from None
