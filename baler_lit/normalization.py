"""Per-column min-max normalisation to [0, 1], vectorised, as Baler does it (stored minimum and range).

``minimum`` and ``scale`` (the range, max − min) are float64 arrays in the data's physical units that
broadcast against one sample: shape ``(n_columns,)`` for tables normalised per column, ``(H, W)`` for frames
normalised per pixel, ``(1,)`` for one global range. A constant column has range 0; its scale is stored as 1 so
it maps to 0 and back to its value exactly.

:meth:`MinMaxNormalizer.identity` is Baler's ``apply_normalization = False``: minimum 0 and range 1, so the model
sees the raw values. It is stored like any other normalisation (checkpoint, ``.baler`` file), so decompression
needs nothing new to restore raw-value models.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from typing import TYPE_CHECKING

import numpy as np

from .errors import BalerInputError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MinMaxNormalizer:
    """``x_norm = (x − minimum) / scale`` and back. Arrays are float64, in the data's units."""

    minimum: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, data: np.ndarray, per_column: bool = True) -> MinMaxNormalizer:
        """Fit on ``data`` of shape ``(n_samples, *sample_shape)``.

        ``per_column=True`` keeps one minimum/range per sample position (per column of a table, per pixel of a
        frame); ``False`` uses one global minimum and range.
        """
        arr = np.asarray(data)
        if arr.ndim < 2 or arr.shape[0] == 0:
            raise BalerInputError(f"normalisation needs (n_samples, ...) data with n_samples >= 1, got {arr.shape}")
        if per_column:
            lo = arr.min(axis=0).astype(np.float64)
            hi = arr.max(axis=0).astype(np.float64)
        else:
            lo = np.array([arr.min()], dtype=np.float64)
            hi = np.array([arr.max()], dtype=np.float64)
        return cls._from_range(lo, hi)

    @classmethod
    def fit_blocks(cls, blocks: Iterable[np.ndarray], per_column: bool = True) -> MinMaxNormalizer:
        """:meth:`fit` over consecutive blocks of rows (one pass, memory of one block): a running minimum and
        maximum, so the result equals :meth:`fit` on the blocks' concatenation exactly."""
        lo = hi = None
        for block in blocks:
            arr = np.asarray(block)
            if arr.ndim < 2 or arr.shape[0] == 0:
                continue
            b_lo = arr.min(axis=0) if per_column else np.array([arr.min()])
            b_hi = arr.max(axis=0) if per_column else np.array([arr.max()])
            lo = b_lo.astype(np.float64) if lo is None else np.minimum(lo, b_lo)
            hi = b_hi.astype(np.float64) if hi is None else np.maximum(hi, b_hi)
        if lo is None:
            raise BalerInputError("normalisation needs at least one row of (n_samples, ...) data")
        return cls._from_range(lo, hi)

    @classmethod
    def identity(cls) -> MinMaxNormalizer:
        """No normalisation (Baler's ``apply_normalization = False``): minimum 0, range 1, one global value."""
        return cls(minimum=np.zeros(1), scale=np.ones(1))

    @property
    def is_identity(self) -> bool:
        """True when the values pass unchanged (minimum 0 and range 1 everywhere)."""
        return bool((self.minimum == 0).all() and (self.scale == 1).all())

    @classmethod
    def _from_range(cls, lo: np.ndarray, hi: np.ndarray) -> MinMaxNormalizer:
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise BalerInputError("cannot normalise data containing NaN or inf")
        span = hi - lo
        return cls(minimum=lo, scale=np.where(span > 0, span, 1.0))

    def transform(self, data: np.ndarray, dtype: np.dtype | type = np.float64) -> np.ndarray:
        """Physical units → [0, 1] (for the fitted data), returned as ``dtype``."""
        out = np.subtract(data, self.minimum, dtype=np.float64)
        out /= self.scale
        return out.astype(dtype, copy=False)

    def inverse(self, data: np.ndarray) -> np.ndarray:
        """[0, 1] → physical units, float64."""
        out = np.multiply(data, self.scale, dtype=np.float64)
        out += self.minimum
        return out

    def inverse_torch(self, data: torch.Tensor) -> torch.Tensor:
        """Torch version of :meth:`inverse` in ``data``'s dtype and device."""
        import torch

        lo = torch.as_tensor(self.minimum, dtype=data.dtype, device=data.device)
        sc = torch.as_tensor(self.scale, dtype=data.dtype, device=data.device)
        return torch.addcmul(lo, data, sc)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Arrays for a checkpoint or a compressed file."""
        return {"norm_min": self.minimum, "norm_scale": self.scale}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> MinMaxNormalizer:
        try:
            lo = np.asarray(arrays["norm_min"], dtype=np.float64)
            sc = np.asarray(arrays["norm_scale"], dtype=np.float64)
        except KeyError as exc:
            raise BalerInputError(f"normalisation array {exc.args[0]!r} is missing") from None
        if lo.shape != sc.shape or not (np.isfinite(lo).all() and np.isfinite(sc).all()) or (sc <= 0).any():
            raise BalerInputError("stored normalisation is inconsistent (shapes differ, non-finite or range <= 0)")
        return cls(minimum=lo, scale=sc)
