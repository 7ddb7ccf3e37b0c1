"""ROOT files through uproot (imported lazily): one TTree's numeric branches, selected and checked, as
columns. Used by the whole-table reader (:mod:`baler_lit.sources`) and the streaming one
(:mod:`baler_lit.row_source`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import BalerInputError

#: ROOT leaf type names (as uproot spells them) that map to numeric columns.
ROOT_NUMERIC_TYPES = {
    "bool", "int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t",
    "float", "double",
}  # fmt: skip


def _tree_names(rootfile) -> list[str]:
    return sorted({k.split(";")[0] for k, cls in rootfile.classnames().items() if cls in ("TTree", "TNtuple")})


def open_root(p: Path):
    """``uproot.open(p)``, a damaged or foreign file turned into one error line."""
    from lightning_energy.extras import require

    uproot = require("uproot", "reading ROOT files", extra="baler")

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
