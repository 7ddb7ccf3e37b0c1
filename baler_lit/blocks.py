"""``baler-lit blocks``: Baler's ``convert_to_blocks``: the same values reshaped into samples of another shape.

Baler's ``convert_to_blocks = [_, b1, b2]`` reshapes the whole data array, in memory order, into
``(total / (b1·b2), b1, b2)`` before training and compressing (so a table's rows become 2-D frames for the
convolutional models, or 60 frames of 50×50 become 4 blocks of 15 stacked frames for ``Conv_AE_3D``), and the
decompressed blocks back into the original shape. Here that is a file tool run before ``fit``/``compress`` and
after ``decompress``::

    baler-lit blocks --input data.npz --shape 10 25 --output blocks.npz      # (60, 50, 50) → (600, 10, 25)
    baler-lit blocks --input restored_blocks.npz --like data.npz --output restored.npz   # back, names and dtypes too

The values are never changed, only their grouping. All columns must share one dtype (a frame has one).
The input is read whole (its own loader's bounds apply); the output is written atomically.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import BalerInputError

#: Most dimensions of a sample after reshaping (a table row or a 2-D frame).
MAX_SAMPLE_DIMS = 2


def block_shape(total_values: int, sample_shape: Sequence[int], source: str) -> tuple[int, ...]:
    """``(n_samples, *sample_shape)`` holding ``total_values`` values; refused unless the sizes divide exactly."""
    shape = tuple(int(s) for s in sample_shape)
    if not 1 <= len(shape) <= MAX_SAMPLE_DIMS or any(s < 1 for s in shape):
        raise BalerInputError(f"--shape must be 1 or 2 positive sizes (a row or a frame), got {list(sample_shape)}")
    per_sample = math.prod(shape)
    if total_values % per_sample:
        raise BalerInputError(
            f"{source} holds {total_values} values, which do not divide into samples of {shape} ({per_sample} values"
            f" each): choose sizes whose product divides {total_values}"
        )
    return (total_values // per_sample, *shape)


def reshape_file(
    input_path: str | os.PathLike,
    output: str | os.PathLike,
    shape: Sequence[int] | None = None,
    like: str | os.PathLike | None = None,
    overwrite: bool = False,
    npz_key: str = "data",
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Write ``input_path``'s values as samples of ``shape`` (or of the file ``like``'s sample shape, with its
    column names and dtypes) to ``output``; return (input array shape, output array shape)."""
    from .row_source import open_rows
    from .sources import load_table
    from .table import check_output, write_npz

    if (shape is None) == (like is None):
        raise BalerInputError("give --shape or --like (the file whose sample shape, names and dtypes to take)")
    check_output(output, overwrite)
    names: list[str] = []
    dtypes: list[str] | None = None
    if like is not None:
        model = open_rows(like)
        shape = model.sample_shape
        if not model.is_frames:
            names, dtypes = list(model.names), list(model.dtypes)
    table = load_table(input_path, npz_key)
    common = sorted(set(table.dtypes))
    if len(common) != 1:
        raise BalerInputError(f"{input_path} has columns of dtypes {common}: blocks need one dtype for all values")
    target = block_shape(table.data.size, shape, str(input_path))
    frames = len(target) == 3
    if frames:
        names, dtypes = [], [common[0]]
    else:
        names = names or [f"col_{i}" for i in range(target[1])]
        dtypes = dtypes or [common[0]] * target[1]
    stored = np.result_type(*[np.dtype(d) for d in dtypes])
    values = table.data.reshape(target)
    if stored.kind in "iub":
        values = np.rint(values)
    write_npz(output, values.astype(stored), names, dtypes, overwrite)
    return table.data.shape, target


def describe(before: tuple[int, ...], after: tuple[int, ...], output: str | os.PathLike) -> str:
    return f"reshaped {list(before)} → {list(after)} (values unchanged, in memory order) → {Path(output)}"
