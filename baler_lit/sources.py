"""Readers for Baler's ``.npz`` layout and for ROOT files (through uproot, imported lazily).

``.npz``: array ``data`` (``(n_rows, n_columns)`` or ``(n_frames, H, W)``), optional ``names`` (one string per
column; an empty array is allowed) and optional ``dtypes`` (one dtype name per column, written by
``baler-lit decompress`` so mixed integer/float tables keep their column types). Without ``dtypes`` (Baler's
plain layout), integer-valued float columns are detected (:func:`~baler_lit.table.infer_column_dtypes`) and
restored rounded. Arrays are loaded with ``allow_pickle=False``.

ROOT: one TTree; the branches are listed explicitly or selected by a name prefix (for example ``Jet_``).
Flat branches give one row per entry; jagged branches of one collection (NanoAOD ``Jet_*``) give one row per
object. Branches of different collections, or flat mixed with jagged, are rejected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from . import examples
from .errors import BalerInputError, existing_file  # noqa: F401  (existing_file: named here for its callers)
from .root_files import open_root, root_columns, select_branches
from .row_source import open_npz
from .table import Table



def load_table(
    path: str | os.PathLike,
    npz_key: str = "data",
    root_tree: str | None = None,
    root_branches: Sequence[str] | None = None,
    root_prefix: str | None = None,
) -> Table:
    """Read ``path`` (``.npz``, ``.root``, or ``example:<name>``: see :mod:`baler_lit.examples`) into a :class:`Table`."""
    if examples.is_example(path):
        return load_example(str(path))
    p = existing_file(path)
    suffix = p.suffix.lower()
    if suffix == ".npz":
        return load_npz(p, npz_key)
    if suffix == ".root":
        return load_root(p, root_tree, root_branches, root_prefix)
    raise BalerInputError(f"input {p}: unsupported format {suffix or '(no suffix)'!r}; use .npz or .root")


def load_example(path: str, seed: int = 0) -> Table:
    """The example named by ``example:<name>``: a generated table (``CMS_synthetic``), or Baler's file where
    :func:`~baler_lit.examples.find_example` finds it, else the synthetic stand-in (warned)."""
    name = examples.example_name(path)
    table = examples.generated(name)
    if table is not None:
        return table
    found = examples.find_example(name)
    return load_npz(found) if found is not None else examples.stand_in(name, seed)


def load_npz(path: str | os.PathLike, key: str = "data") -> Table:
    """Read Baler's npz layout (``data``, optional ``names`` and ``dtypes``) without unpickling.

    Read through :func:`~baler_lit.row_source.open_npz`: every member's npy header is checked against the bytes
    the member holds, and a deflated member is inflated block by block into the float64 table (so memory is the
    table's, 8 bytes per value, however well the file compresses).
    """
    return open_npz(existing_file(path), key).to_table()


def load_root(
    path: str | os.PathLike,
    tree: str | None = None,
    branches: Sequence[str] | None = None,
    prefix: str | None = None,
) -> Table:
    """Read numeric branches of one TTree: flat → one row per entry, jagged → one row per object."""
    p = existing_file(path)
    with open_root(p) as rootfile:
        ttree, selected, jagged = select_branches(rootfile, p, tree, branches, prefix)
        try:
            arrays = ttree.arrays(selected, library="ak")
        except Exception as exc:
            raise BalerInputError(f"cannot read branches from {p}: {exc}") from None
    columns = root_columns(arrays, selected, jagged, p)
    n_rows = len(columns[0])
    if n_rows == 0:
        raise BalerInputError(f"input {p}: the selected branches hold no values")
    data = np.empty((n_rows, len(columns)), dtype=np.float64)
    for j, col in enumerate(columns):
        data[:, j] = col
    return Table(data, names=list(selected), dtypes=[c.dtype.name for c in columns], source=str(p))
