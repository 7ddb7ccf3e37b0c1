"""In-memory data set (:class:`Table`) and safe file writing shared by the data module and compression.

A :class:`Table` holds physical values as float64 plus what is needed to restore the original file:
column names and the original numpy dtype of every column. Tables are 2-D ``(n_rows, n_columns)``;
frames (for example CFD snapshots) are ``(n_frames, H, W)`` with one dtype for the whole array and no names.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .errors import BalerInputError, BalerOutputError, output_error


@dataclass
class Table:
    """Physical values (float64) with their column names and original dtypes.

    Attributes:
        data: ``(n_rows, n_columns)`` or ``(n_frames, H, W)`` float64 array.
        names: column names (tables) or ``[]`` (frames).
        dtypes: numpy dtype names, one per column (tables) or one for the whole array (frames).
        source: where the data came from, for error messages.
        dtypes_inferred: True when no file or caller stated the dtypes (they follow the data array, with
            integer-valued float columns detected by :func:`infer_column_dtypes`).
    """

    data: np.ndarray
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    source: str = "<memory>"
    dtypes_inferred: bool = False

    def __post_init__(self) -> None:
        self.data = np.asarray(self.data)
        if self.data.ndim not in (2, 3):
            raise BalerInputError(
                f"{self.source}: data must be 2-D (rows, columns) or 3-D (frames, H, W), got shape {self.data.shape}"
            )
        if self.data.shape[0] < 1 or 0 in self.data.shape:
            raise BalerInputError(f"{self.source}: data is empty (shape {self.data.shape})")
        if self.data.dtype.kind not in "fiub":
            raise BalerInputError(f"{self.source}: data must be numeric, got dtype {self.data.dtype}")
        if not self.dtypes:
            n = 1 if self.is_frames else self.n_columns
            self.dtypes = [self.data.dtype.name] * n
            self.dtypes_inferred = True
        if self.data.dtype != np.float64:
            self.data = self.data.astype(np.float64)
        self.set_dtypes(self.dtypes)
        if self.is_frames:
            self.names = []
        elif not self.names:
            self.names = [f"col_{i}" for i in range(self.n_columns)]
        elif len(self.names) != self.n_columns:
            raise BalerInputError(
                f"{self.source}: {len(self.names)} column names for {self.n_columns} columns (column-count mismatch)"
            )
        self._check_finite()

    def set_dtypes(self, dtypes: list[str]) -> None:
        """Describe the columns with ``dtypes`` (numpy numeric type names, Baler's ``type_list`` spelling:
        ``"int"``, ``"float64"``, ...), one per column (one for frames); raise naming a bad or missing one."""
        self.dtypes = column_dtype_names(dtypes, 1 if self.is_frames else self.n_columns, self.source)

    def _check_finite(self) -> None:
        check_finite(self.data, self.names, self.source)

    @property
    def is_frames(self) -> bool:
        return self.data.ndim == 3

    @property
    def n_rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def n_columns(self) -> int:
        """Columns of a table; pixels per frame for frames."""
        return int(np.prod(self.data.shape[1:]))

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.data.shape[1:])

    @property
    def integer_mask(self) -> np.ndarray:
        """Boolean per dtype entry: True where the original dtype is an integer or bool type."""
        return np.array([np.dtype(d).kind in "iub" for d in self.dtypes], dtype=bool)

    @property
    def original_nbytes(self) -> int:
        """Bytes of the values in their original dtypes (the denominator-free size used for ratios)."""
        if self.is_frames:
            return self.data.size * np.dtype(self.dtypes[0]).itemsize
        return self.n_rows * sum(np.dtype(d).itemsize for d in self.dtypes)

    def storage_dtype(self) -> np.dtype:
        """One dtype that holds every column exactly (float32 + int32 → float64)."""
        return np.result_type(*[np.dtype(d) for d in self.dtypes])


def column_dtype_names(dtypes: list[str], expected: int, source: str) -> list[str]:
    """``dtypes`` as numpy type names (Baler's ``type_list`` spelling accepted: ``"int"``, ``"float64"``, ...);
    raise naming the source when one is unknown or not numeric, or when there are not ``expected`` of them."""
    if len(dtypes) != expected:
        raise BalerInputError(f"{source}: {len(dtypes)} dtypes given for {expected} columns")
    names = []
    for d in dtypes:
        try:
            kind = np.dtype(str(d))
        except TypeError:
            raise BalerInputError(f"{source}: unknown column dtype {d!r}") from None
        if kind.kind not in "fiub":
            raise BalerInputError(f"{source}: column dtype {d!r} is not numeric")
        names.append(kind.name)
    return names


def check_finite(values: np.ndarray, names: list[str], source: str, first_row: int | None = None) -> None:
    """Raise naming the columns (tables, ``names`` given) when ``values`` holds NaN or inf.

    ``first_row``: the row number of ``values[0]`` in the whole input, named in the message of a streamed block.
    """
    finite = np.isfinite(values)
    if finite.all():
        return
    bad = int((~finite).sum())
    where = "" if first_row is None else f" (in rows {first_row}..{first_row + len(values) - 1})"
    if values.ndim == 3 or not names:
        raise BalerInputError(f"{source}: data contains {bad} non-finite values (NaN/inf){where}")
    cols = np.flatnonzero(~finite.all(axis=0))
    named = ", ".join(repr(names[i]) for i in cols[:5])
    raise BalerInputError(f"{source}: data contains {bad} non-finite values (NaN/inf) in column(s) {named}{where}")


#: Largest integer magnitude float32 represents exactly (2^24).
FLOAT32_EXACT_INT = 2**24
#: Largest integer magnitude each float type represents exactly (2^(mantissa bits + 1)).
EXACT_INT_LIMIT = {2: 2**11, 4: 2**24, 8: 2**53}


def infer_column_dtypes(data: np.ndarray, frames: bool) -> list[str]:
    """Per-column dtype names for data that came without any: integer-valued float columns become integers.

    A float column whose every value is a whole number within the float type's exact-integer range is taken as
    an integer column of the same width (float64 → int64, float32 → int32, float16 → int16), so restored values
    are rounded while the original size, and so the printed ratio, stays that of the stored array. Frames get
    one dtype for the whole array. Integer and bool arrays keep their dtype.
    """
    arr = np.asarray(data)
    kind = arr.dtype
    n = 1 if frames else int(np.prod(arr.shape[1:]))
    if kind.kind != "f":
        return [kind.name] * n
    return dtypes_from_whole(kind, whole_number_columns(arr, frames))


def whole_number_columns(data: np.ndarray, frames: bool) -> np.ndarray:
    """Per column (one entry for frames): True when every value of the float array ``data`` is a whole number
    within its float type's exact-integer range."""
    limit = EXACT_INT_LIMIT.get(data.dtype.itemsize, 2**53)
    flat = data.reshape(data.shape[0], -1) if not frames else data.reshape(-1, 1)
    whole = np.ones(flat.shape[1], dtype=bool)
    for start in range(0, flat.shape[0], 65536):  # bounded temporaries on large tables
        block = flat[start : start + 65536]
        whole &= np.all((block == np.rint(block)) & (np.abs(block) <= limit), axis=0)
    return whole


def dtypes_from_whole(kind: np.dtype, whole: np.ndarray) -> list[str]:
    """Column dtype names for a float array of ``kind``: an integer of the same width where ``whole``."""
    as_int = np.dtype(f"int{8 * kind.itemsize}").name
    return [as_int if w else kind.name for w in whole]


class DtypeRestorer:
    """Casts float64 physical values back to the original column dtypes, chunk by chunk, in place.

    Integer and bool columns are rounded to the nearest integer (Baler truncates) and clipped to the dtype's
    range and, when known, to the column's observed range ``[lo, hi]``; float16/float32 columns are rounded
    to their precision. :attr:`storage` is the smallest dtype that holds every column exactly, used for the
    single restored ``data`` array: float32 when every float column is at most float32 and every integer
    column's observed range lies within ±2^24, otherwise the common type (float32 + int32 → float64).
    """

    def __init__(
        self, dtypes: list[str], frames: bool, lo: np.ndarray | None = None, hi: np.ndarray | None = None
    ) -> None:
        kinds = [np.dtype(d) for d in dtypes]
        self.frames = frames
        self._kinds = kinds
        n = len(kinds)
        lo_arr = None if lo is None else np.broadcast_to(np.asarray(lo, dtype=np.float64).ravel()[:n], (n,))
        hi_arr = None if hi is None else np.broadcast_to(np.asarray(hi, dtype=np.float64).ravel()[:n], (n,))
        if frames and lo is not None:
            lo_arr = np.array([np.min(lo)])
            hi_arr = np.array([np.max(hi)])
        self.storage = _storage_dtype(kinds, lo_arr, hi_arr)
        ints = [j for j, k in enumerate(kinds) if k.kind in "iub"]
        self._int_idx = np.array(ints, dtype=np.intp)
        limits = [_int_range(kinds[j]) for j in ints]
        self._int_lo = np.array([lim[0] for lim in limits], dtype=np.float64)
        self._int_hi = np.array([lim[1] for lim in limits], dtype=np.float64)
        self._dtype_lo, self._dtype_above = self._int_lo.copy(), self._int_hi + 1  # the dtypes' own ranges
        if lo_arr is not None and ints:
            self._int_lo = np.maximum(self._int_lo, np.floor(lo_arr[ints]))
            self._int_hi = np.minimum(self._int_hi, np.ceil(hi_arr[ints]))
        self._float_groups = [
            (k, np.array([j for j, kj in enumerate(kinds) if kj == k], dtype=np.intp))
            for k in sorted({k for k in kinds if k.kind == "f" and k.itemsize < 8}, key=str)
        ]

    def apply(self, values: np.ndarray) -> None:
        """Round ``values`` (float64, ``(rows, columns)`` or frames) in place to what the dtypes can hold."""
        if self.frames:
            kind = self._kinds[0]
            if kind.kind in "iub":
                np.rint(values, out=values)
                np.clip(values, self._int_lo[0], self._int_hi[0], out=values)
            elif kind.itemsize < 8:
                with np.errstate(over="ignore", invalid="ignore"):  # beyond the dtype: inf, refused by check_fits
                    values[...] = values.astype(kind)
            return
        if self._int_idx.size:
            sub = np.rint(values[:, self._int_idx])
            np.clip(sub, self._int_lo, self._int_hi, out=sub)
            values[:, self._int_idx] = sub
        with np.errstate(over="ignore", invalid="ignore"):  # beyond the dtype: inf, refused by check_fits
            for kind, idx in self._float_groups:
                values[:, idx] = values[:, idx].astype(kind)

    def check_fits(self, values: np.ndarray, names: list[str], where: str) -> None:
        """Raise :class:`BalerInputError` (one line: ``where``, the column, the value, the problem) unless every
        value of ``values`` (float64, ``(rows, columns)`` or frames, as they are about to be written) is finite and
        held by its column's dtype and by :attr:`storage`: integer and bool columns whole numbers within the
        dtype's range (and exact in a float32 storage dtype), float columns within their dtype's finite range."""
        flat = values.reshape(-1, 1) if self.frames else values
        if self._all_fit(flat):
            return
        for j, kind in enumerate(self._kinds):  # find the first offending column and value for the message
            column = flat[:, j]
            problem = _unfit(column, kind, self.storage)
            if problem is not None:
                bad, why = problem
                name = "the frames" if self.frames else f"column {names[j]!r}" if j < len(names) else f"column {j}"
                raise BalerInputError(f"{where}: {name} ({kind.name}) would get {float(column[bad])!r}, {why}")

    def _all_fit(self, flat: np.ndarray) -> bool:
        """The checks of :meth:`check_fits` on all columns at once (the common case: everything fits)."""
        if not np.isfinite(flat).all():
            return False
        if self._int_idx.size:
            ints = flat[:, self._int_idx]
            whole = (np.rint(ints) == ints).all()
            if not (whole and (ints >= self._dtype_lo).all() and (ints < self._dtype_above).all()):
                return False
            if self.storage.kind == "f" and self.storage.itemsize < 8 and (ints.astype(self.storage) != ints).any():
                return False
        return all((np.abs(flat[:, idx]) <= np.finfo(kind).max).all() for kind, idx in self._float_groups)


def _unfit(column: np.ndarray, kind: np.dtype, storage: np.dtype) -> tuple[int, str] | None:
    """(position of the first value of ``column`` that ``kind`` or ``storage`` cannot hold, why), or ``None``.
    The checks run in order, each on values that passed the ones before (no cast overflows)."""
    checks = [(lambda: ~np.isfinite(column), "not a finite number")]
    if kind.kind in "iub":
        low, high = _int_range(kind)
        checks += [(lambda: np.rint(column) != column, "not a whole number"),
                   (lambda: (column < low) | (column >= float(high) + 1),
                    f"outside {kind.name}'s range [{low}, {high}]")]
        if storage.kind == "f" and storage.itemsize < 8:  # float32: integers beyond 2^24 are not all exact
            checks.append((lambda: column.astype(storage) != column, f"not exact in the restored {storage.name} array"))
    else:  # the storage dtype is at least as wide as every float column (their common type)
        checks.append((lambda: np.abs(column) > float(np.finfo(kind).max), f"beyond {kind.name}'s largest value"))
    for bad, why in checks:
        mask = bad()
        if mask.any():
            return int(np.argmax(mask)), why
    return None


def _storage_dtype(kinds: list[np.dtype], lo: np.ndarray | None, hi: np.ndarray | None) -> np.dtype:
    common = np.result_type(*kinds)
    if common != np.float64 or lo is None:
        return common
    fits = all(
        (k.kind == "f" and k.itemsize <= 4)
        or (k.kind in "iub" and max(abs(lo[j]), abs(hi[j])) <= FLOAT32_EXACT_INT)
        for j, k in enumerate(kinds)
    )
    return np.dtype(np.float32) if fits else common


def _int_range(kind: np.dtype) -> tuple[int, int]:
    if kind.kind == "b":
        return 0, 1
    info = np.iinfo(kind)
    return int(info.min), int(info.max)


def restore_dtypes(
    values: np.ndarray, dtypes: list[str], frames: bool, lo: np.ndarray | None = None, hi: np.ndarray | None = None
) -> np.ndarray:
    """Round float64 ``values`` in place to the original dtypes; return them in the storage dtype."""
    restorer = DtypeRestorer(dtypes, frames, lo, hi)
    restorer.apply(values)
    return values.astype(restorer.storage, copy=False)


def check_output(path: str | os.PathLike, overwrite: bool) -> Path:
    """Validate an output file path before any work: parent exists and is writable, no silent overwrite."""
    out = Path(path)
    if out.exists() and not overwrite:
        raise BalerInputError(f"output {out} already exists; pass --overwrite to replace it")
    if out.exists() and out.is_dir():
        raise BalerInputError(f"output {out} is a directory")
    if not out.parent.is_dir():
        raise BalerInputError(f"output directory {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise BalerOutputError(f"output directory {out.parent} is not writable")
    return out


def process_umask() -> int:
    """This process's umask (read from /proc where it can be, so it is never changed, even briefly)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask


def new_file_mode() -> int:
    """The mode a newly created file gets here: ``0o666`` less the process's umask."""
    return 0o666 & ~process_umask()


@contextlib.contextmanager
def removed_on_termination() -> Iterator[None]:
    """Inside the block, SIGTERM raises ``SystemExit(143)`` (in the main thread, when SIGTERM had its
    default action), so ``finally`` clauses remove temporary files as they do on SIGINT (KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


#: Our temporary output files: ``.<output name>.baler-lit-<writer's pid>-<random>.tmp`` next to the output.
TEMP_PREFIX = ".{name}.baler-lit-{pid}-"
TEMP_SUFFIX = ".tmp"
_TEMP_NAME = re.compile(r"\..+\.baler-lit-([0-9]{1,7})-[A-Za-z0-9_]+\.tmp")


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of :func:`atomic_output` in ``directory`` that a killed writer left behind
    (SIGKILL, power loss: nothing ran its cleanup); return their paths.

    A file is removed only when it has our naming pattern (:data:`TEMP_PREFIX`), belongs to this user, the
    process named in it is gone (no process of that pid here) and no process holds its ``flock`` (every
    writer holds one while it writes: this keeps a writer alive in another pid namespace or on another host of
    a shared file system safe). A file whose pid is alive is left alone, even when the pid was reused.
    Nothing here raises: a folder that cannot be listed or a file that vanished is skipped.
    """
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.fullmatch(entry.name) if ".baler-lit-" in entry.name else None  # a quick test first
        try:
            if (match is None or not entry.is_file(follow_symlinks=False)
                    or entry.stat(follow_symlinks=False).st_uid != os.getuid() or _process_exists(int(match[1]))):
                continue
            if _unlink_unless_locked(entry.path):
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def _process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists here (pid 0 names no single process: counted as existing)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, another user's
        return True
    return True


def _unlink_unless_locked(path: str) -> bool:
    """Remove ``path`` unless a live writer holds its ``flock``; whether it was removed."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        if not _try_lock(fd):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting (released when the process ends, however it
    ends); whether it was taken. Without ``fcntl`` (not POSIX) nothing is locked and this says True."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def prepare_output(path: str | os.PathLike, overwrite: bool) -> Path:
    """:func:`check_output`, then :func:`remove_stale_temp_files` next to it: the start of a command that
    writes ``path`` (``compress``, ``decompress``)."""
    out = check_output(path, overwrite)
    remove_stale_temp_files(out.parent)
    return out


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, overwrite: bool) -> Iterator[BinaryIO]:
    """Yield a private temporary file (binary, open for writing) next to ``path``; rename it onto ``path``
    only if the block succeeds.

    The temporary file is created exclusively under an unpredictable name with our pattern and this process's
    pid (:data:`TEMP_PREFIX`; :func:`tempfile.mkstemp`: ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600, so a
    planted file or symlink is never written through), locked (``flock``) while it is written, written through
    its descriptor, flushed, given the mode a new file gets (:func:`new_file_mode`) and renamed. A failure,
    SIGINT or SIGTERM removes it and leaves ``path`` as it was; one left by SIGKILL is removed by the next
    ``compress`` or ``decompress`` writing into that folder (:func:`remove_stale_temp_files`). An ``OSError``
    is re-raised as :class:`BalerOutputError` (one line naming ``path``; still an ``OSError``).
    """
    out = check_output(path, overwrite)
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX.format(name=out.name, pid=os.getpid()), suffix=TEMP_SUFFIX,
                                   dir=out.parent)  # fmt: skip
    except OSError as exc:
        raise output_error(out, exc) from None
    _try_lock(fd)  # a fresh file: nobody else holds its lock
    try:
        with removed_on_termination(), os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fchmod(fh.fileno(), new_file_mode())
        os.replace(tmp, out)
    except BalerOutputError:
        raise
    except OSError as exc:
        raise output_error(out, exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_npz(
    path: str | os.PathLike, data: np.ndarray, names: list[str], dtypes: list[str], overwrite: bool = False
) -> Path:
    """Write Baler's npz layout (``data``, ``names``) plus ``dtypes``, atomically; ``data`` is written as is."""
    if np.asarray(data).dtype.kind not in "fiub":
        raise BalerInputError(f"refusing to write {path}: data of dtype {np.asarray(data).dtype} is not numeric")
    with atomic_output(path, overwrite) as fh:
        np.savez(fh, data=data, names=np.array(names, dtype=str), dtypes=np.array(dtypes, dtype=str))
    return Path(path)


@contextlib.contextmanager
def npz_writer(
    path: str | os.PathLike, shape: tuple[int, ...], dtype: np.dtype, names: list[str], dtypes: list[str],
    overwrite: bool = False,
) -> Iterator:
    """Write the npz of :func:`write_npz` block by block: yields ``write(block)``, which appends rows (cast to
    ``dtype``) to the ``data`` member; the file appears (atomically) only when all ``shape[0]`` rows are in."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "fiub":
        raise BalerInputError(f"refusing to write {path}: data of dtype {dtype} is not numeric")
    written = 0

    def write(block: np.ndarray) -> None:
        nonlocal written
        member.write(memoryview(np.ascontiguousarray(block, dtype=dtype)).cast("B"))
        written += len(block)

    with atomic_output(path, overwrite) as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, values in (("names", names), ("dtypes", dtypes)):
            with zf.open(f"{key}.npy", "w") as small:
                np.lib.format.write_array(small, np.array(values, dtype=str), allow_pickle=False)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        with zf.open("data.npy", "w", force_zip64=nbytes > 2**31) as member:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
            np.lib.format.write_array_header_1_0(member, header)
            yield write
            if written != shape[0]:
                raise BalerInputError(f"{path}: {written} of {shape[0]} rows were written")


def save_npz(path: str | os.PathLike, table: Table, overwrite: bool = False) -> Path:
    """Write ``table`` with its original dtypes restored (see :func:`write_npz`)."""
    axis = None if table.is_frames else 0
    lo, hi = table.data.min(axis=axis), table.data.max(axis=axis)
    data = restore_dtypes(table.data.copy(), table.dtypes, table.is_frames, lo, hi)
    return write_npz(path, data, table.names, table.dtypes, overwrite)
