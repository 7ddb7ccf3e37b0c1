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
from pathlib import Path

import numpy as np

from .errors import BalerInputError
from .table import Table

#: ROOT leaf type names (as uproot spells them) that map to numeric columns.
ROOT_NUMERIC_TYPES = {
    "bool", "int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t",
    "float", "double",
}  # fmt: skip


def existing_file(path: str | os.PathLike, what: str = "input file") -> Path:
    """``path`` as a Path if it is a readable file; else a BalerInputError naming ``what`` and the problem."""
    p = Path(path)
    if not p.exists():
        raise BalerInputError(f"{what} {p} does not exist")
    if not p.is_file():
        raise BalerInputError(f"{what} {p} is not a file")
    if not os.access(p, os.R_OK):
        raise BalerInputError(f"{what} {p} is not readable")
    return p


def load_table(
    path: str | os.PathLike,
    npz_key: str = "data",
    root_tree: str | None = None,
    root_branches: Sequence[str] | None = None,
    root_prefix: str | None = None,
) -> Table:
    """Read ``path`` (``.npz``, ``.root``, or ``example:<name>``: see :mod:`baler_lit.examples`) into a :class:`Table`."""
    from .examples import is_example, load_example

    if is_example(path):
        return load_example(str(path))
    p = existing_file(path)
    suffix = p.suffix.lower()
    if suffix == ".npz":
        return load_npz(p, npz_key)
    if suffix == ".root":
        return load_root(p, root_tree, root_branches, root_prefix)
    raise BalerInputError(f"input {p}: unsupported format {suffix or '(no suffix)'!r}; use .npz or .root")


def load_npz(path: str | os.PathLike, key: str = "data") -> Table:
    """Read Baler's npz layout (``data``, optional ``names`` and ``dtypes``) without unpickling.

    Read through :func:`~baler_lit.row_source.open_npz`: every member's npy header is checked against the bytes
    the member holds, and a deflated member is inflated block by block into the float64 table (so memory is the
    table's, 8 bytes per value, however well the file compresses).
    """
    from .row_source import open_npz

    return open_npz(existing_file(path), key).to_table()


def _tree_names(rootfile) -> list[str]:
    return sorted({k.split(";")[0] for k, cls in rootfile.classnames().items() if cls in ("TTree", "TNtuple")})


def load_root(
    path: str | os.PathLike,
    tree: str | None = None,
    branches: Sequence[str] | None = None,
    prefix: str | None = None,
) -> Table:
    """Read numeric branches of one TTree: flat → one row per entry, jagged → one row per object."""
    import awkward as ak

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


def open_root(p: Path):
    """``uproot.open(p)``, a damaged or foreign file turned into one error line."""
    import uproot

    try:
        return uproot.open(p)
    except Exception as exc:  # uproot raises many types for non-ROOT or damaged files
        raise BalerInputError(f"cannot read {p} as a ROOT file: {exc}") from None


def select_branches(rootfile, p: Path, tree: str | None, branches: Sequence[str] | None, prefix: str | None):
    """(the TTree, the selected numeric branches, whether they are jagged) of ``rootfile``: the branches listed,
    or all numeric ones (with ``prefix``); flat and jagged branches are not mixed."""
    trees = _tree_names(rootfile)
    if tree is None:
        if len(trees) != 1:
            raise BalerInputError(f"input {p} has {len(trees)} trees ({', '.join(trees)}); choose one with root_tree")
        tree = trees[0]
    elif tree not in trees:
        raise BalerInputError(f"input {p} has no tree {tree!r} (trees: {', '.join(trees) or 'none'})")
    ttree = rootfile[tree]
    available = list(ttree.keys())
    typenames = {b: ttree[b].typename for b in available}

    def numeric(b: str) -> bool:
        t = typenames[b]
        return t.removesuffix("[]") in ROOT_NUMERIC_TYPES

    if branches:
        missing = [b for b in branches if b not in typenames]
        if missing:
            raise BalerInputError(f"input {p}: tree {tree!r} has no branch(es) {', '.join(missing)}")
        bad = [f"{b} ({typenames[b]})" for b in branches if not numeric(b)]
        if bad:
            raise BalerInputError(f"input {p}: branch(es) {', '.join(bad)} are not numeric columns")
        selected = list(branches)
    else:
        selected = [b for b in available if (prefix is None or b.startswith(prefix)) and numeric(b)]
        if not selected:
            what = f"with prefix {prefix!r}" if prefix else "at all"
            raise BalerInputError(f"input {p}: tree {tree!r} has no numeric branches {what}")
    jagged = [b for b in selected if typenames[b].endswith("[]")]
    if jagged and len(jagged) != len(selected):
        flat = [b for b in selected if b not in jagged]
        raise BalerInputError(
            f"input {p}: cannot mix flat branches ({', '.join(flat[:3])}) with jagged ones"
            f" ({', '.join(jagged[:3])}); list branches of one kind or use a collection prefix such as 'Jet_'"
        )
    return ttree, selected, bool(jagged)


def root_columns(arrays, selected: list[str], jagged: bool, p: Path) -> list[np.ndarray]:
    """One numpy array per branch of the awkward ``arrays`` (jagged ones flattened: one row per object)."""
    import awkward as ak

    if not jagged:
        return [ak.to_numpy(arrays[b]) for b in selected]
    counts = ak.num(arrays[selected[0]], axis=1)
    for b in selected[1:]:
        if not ak.all(ak.num(arrays[b], axis=1) == counts):
            raise BalerInputError(
                f"input {p}: branches {selected[0]} and {b} have different numbers of objects per entry;"
                " choose branches of one collection"
            )
    return [ak.to_numpy(ak.flatten(arrays[b], axis=1)) for b in selected]
