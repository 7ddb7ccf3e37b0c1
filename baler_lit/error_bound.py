"""Error-bounded compression: exact corrections for every value the network restores worse than a bound.

Baler's ``save_error_bounded_deltas`` stores deltas for the values whose relative error exceeds
``error_bounded_requirement`` (in the original, at 10 % the share of values over the bound drops from
30.8 % to 4.6 %, not to 0). Here the bound holds for **every** value: ``compress`` decodes each chunk
exactly as ``decompress`` will, and every value ``v`` restored as ``r`` with

    |r − v| > max(absolute, relative × |v|) − slack

is replaced by ``v`` itself on decompression (a correction restores the original value exactly). ``slack``
(:data:`SLACK_ULPS` units of the model dtype's precision times the column's normalisation range, in the
column's units) holds back a margin for a decoder whose arithmetic differs in the last bits on another
machine (another BLAS, another thread count), so a value that just met the bound here still meets it
there. With only a relative bound a value of 0 must come back exactly 0.

Storage, inside the ``.baler`` file (two arrays of bytes, indexed and checksummed like the others):
``corrections_index`` is a zlib stream of little-endian uint64 gaps between the corrected values' flat
indices (``row × values per sample + position``; gap = index − previous index − 1, the first previous
index being −1, so indices strictly increase by construction); ``corrections_value`` a zlib stream of
the replacement values (float32 when the restored data is float32, else float64). Both streams are
written and read incrementally, so neither side holds more than a block of corrections in memory, and
the reader inflates at most the byte count the header declares.
"""

from __future__ import annotations

import math
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .errors import BalerInputError

#: Margin held back from the bound, in units of the model dtype's machine epsilon times the column's
#: normalisation range (float32: 64 × 1.2e-7 ≈ 7.6e-6 of the range).
SLACK_ULPS = 64
#: Corrections inflated per step when reading.
READ_BATCH = 65536
#: Compressed bytes read from the file per step.
READ_BYTES = 2**20
#: zlib level of the correction streams (6: zlib's default; 9 saved < 2 % here at 3x the time).
ZLIB_LEVEL = 6
#: Dtypes a correction value may be stored in.
VALUE_DTYPES = ("<f4", "<f8")


@dataclass(frozen=True)
class ErrorBound:
    """Largest error allowed for each restored value: ``max(absolute, relative × |value|)``.

    ``relative``: a fraction (0.1 = 10 %, Baler's ``error_bounded_requirement`` is in percent);
    ``absolute``: in the column's own units. At least one must be given; both must be finite and >= 0.
    """

    relative: float | None = None
    absolute: float | None = None

    def __post_init__(self) -> None:
        if self.relative is None and self.absolute is None:
            raise BalerInputError("an error bound needs a relative or an absolute limit")
        for name in ("relative", "absolute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):  # fmt: skip
                raise BalerInputError(f"the {name} error bound must be a finite number >= 0, got {value!r}")

    def allowed(self, original: np.ndarray) -> np.ndarray:
        """The allowed absolute error of each value of ``original`` (same shape, float64)."""
        allowed = np.abs(original) * (self.relative or 0.0)
        if self.absolute:
            np.maximum(allowed, self.absolute, out=allowed)
        return allowed

    def describe(self) -> str:
        parts = []
        if self.relative is not None:
            parts.append(f"{100 * self.relative:g} % of the value")
        if self.absolute is not None:
            parts.append(f"{self.absolute:g} (absolute)")
        return "max(" + ", ".join(parts) + ")" if len(parts) > 1 else parts[0]

    def to_header(self) -> dict[str, Any]:
        return {"relative": self.relative, "absolute": self.absolute}


def out_of_bound(restored: np.ndarray, original: np.ndarray, bound: ErrorBound, slack: np.ndarray) -> np.ndarray:
    """Boolean mask of the values to correct: ``|restored − original| > max(allowed − slack, 0)``.

    ``slack`` broadcasts against one sample (per position, the column's units).
    """
    limit = bound.allowed(original)
    limit -= slack
    np.maximum(limit, 0.0, out=limit)
    return np.abs(restored - original) > limit


class CorrectionWriter:
    """Appends corrections (flat indices in increasing order, replacement values) to two zlib streams, each
    spooled to a private temporary file, so memory stays bounded whatever their number."""

    def __init__(self, value_dtype: str, directory: Path) -> None:
        self.value_dtype = np.dtype(value_dtype)
        self.count = 0
        self._previous = -1
        self.index_file = tempfile.TemporaryFile(dir=directory)
        self.value_file = tempfile.TemporaryFile(dir=directory)
        self._index_z = zlib.compressobj(ZLIB_LEVEL)
        self._value_z = zlib.compressobj(ZLIB_LEVEL)

    def add(self, flat_index: np.ndarray, values: np.ndarray) -> None:
        """``flat_index``: increasing int64, all above the previous call's; ``values``: the originals there."""
        if not len(flat_index):
            return
        gaps = np.diff(flat_index, prepend=self._previous) - 1
        self._previous = int(flat_index[-1])
        self.count += len(flat_index)
        self.index_file.write(self._index_z.compress(gaps.astype("<u8").tobytes()))
        self.value_file.write(self._value_z.compress(np.asarray(values).astype(self.value_dtype).tobytes()))

    def finish(self) -> tuple[BinaryIO, int, BinaryIO, int]:
        """Flush both streams; return (index file, its bytes, value file, its bytes), both rewound."""
        self.index_file.write(self._index_z.flush())
        self.value_file.write(self._value_z.flush())
        sizes = []
        for fh in (self.index_file, self.value_file):
            sizes.append(fh.tell())
            fh.seek(0)
        return self.index_file, sizes[0], self.value_file, sizes[1]

    def close(self) -> None:
        self.index_file.close()
        self.value_file.close()


class _Inflater:
    """Inflates a zlib stream from ``fh`` piece by piece, never more than ``total`` bytes in all."""

    def __init__(self, fh: BinaryIO, total: int, fail) -> None:
        self.fh = fh
        self.left = total
        self.fail = fail
        self.z = zlib.decompressobj()

    def read(self, nbytes: int) -> bytes:
        out = bytearray()
        try:
            while len(out) < nbytes:
                data = self.z.unconsumed_tail or self.fh.read(READ_BYTES)
                if not data or self.z.eof:
                    raise self.fail("ends early")
                out += self.z.decompress(data, nbytes - len(out))
        except zlib.error:
            raise self.fail("is not a valid zlib stream") from None
        self.left -= nbytes
        return bytes(out)

    def check_end(self) -> None:
        """The stream must end exactly here: no further output, no bytes after it."""
        try:
            while not self.z.eof:
                data = self.z.unconsumed_tail or self.fh.read(READ_BYTES)
                if not data or self.z.decompress(data, 1):
                    raise self.fail("holds more or fewer values than the header says")
        except zlib.error:
            raise self.fail("is not a valid zlib stream") from None
        if self.z.unused_data or self.fh.read(1):
            raise self.fail("has bytes after its end")


class CorrectionReader:
    """The corrections of a file in index order: :meth:`take_below` hands out those of the next rows."""

    def __init__(self, index_fh: BinaryIO, value_fh: BinaryIO, count: int, value_dtype: str, n_values: int,
                 path: Path) -> None:  # fmt: skip
        self.count_left = count
        self.value_dtype = np.dtype(value_dtype)
        self.n_values = n_values
        self.path = path
        self._index = _Inflater(index_fh, count * 8, lambda why: self._fail("corrections_index", why))
        self._values = _Inflater(value_fh, count * self.value_dtype.itemsize,
                                 lambda why: self._fail("corrections_value", why))  # fmt: skip
        self._previous = -1
        self._buf_index = np.empty(0, dtype=np.int64)
        self._buf_values = np.empty(0, dtype=np.float64)
        if not count:
            self._index.check_end()
            self._values.check_end()

    def _fail(self, what: str, why: str) -> BalerInputError:
        return BalerInputError(f"{self.path} is corrupted: {what} {why}")

    def _pull(self) -> None:
        n = min(READ_BATCH, self.count_left)
        gaps = np.frombuffer(self._index.read(8 * n), dtype="<u8")
        if (gaps >= self.n_values).any():
            raise self._fail("corrections_index", "points beyond the data")
        index = self._previous + np.cumsum(gaps.astype(np.int64) + 1)
        if index[-1] >= self.n_values:
            raise self._fail("corrections_index", "points beyond the data")
        values = np.frombuffer(self._values.read(n * self.value_dtype.itemsize), dtype=self.value_dtype)
        if not np.isfinite(values).all():
            raise self._fail("corrections_value", "holds values that are not finite")
        self._previous = int(index[-1])
        self.count_left -= n
        if not self.count_left:
            self._index.check_end()
            self._values.check_end()
        self._buf_index = np.concatenate([self._buf_index, index])
        self._buf_values = np.concatenate([self._buf_values, values.astype(np.float64)])

    def take_below(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices, values) of the not yet handed out corrections with index < ``end``."""
        while self.count_left and (not len(self._buf_index) or self._buf_index[-1] < end):
            self._pull()
        k = int(np.searchsorted(self._buf_index, end))
        taken = self._buf_index[:k], self._buf_values[:k]
        self._buf_index, self._buf_values = self._buf_index[k:], self._buf_values[k:]
        return taken

    def finish(self) -> None:
        """All corrections must have been handed out (the decoder saw every row)."""
        if self.count_left or len(self._buf_index):
            raise self._fail("corrections_index", "holds corrections beyond the last row")
