"""Helpers shared by the analysis commands: loading runs with one-line errors, plain-text tables."""

from __future__ import annotations

import math
from pathlib import Path


def load_runs_or_fail(run_dirs: list[Path]):
    """The runs, or a CommandError naming the first bad run dir."""
    from lightning_energy.analysis.runs import RunError, load_runs
    from lightning_energy.cli.commands import CommandError

    try:
        return load_runs(run_dirs)
    except RunError as err:
        raise CommandError(str(err)) from None


def check_plotting(args) -> None:
    """Before the command prints or writes anything: matplotlib (the ``analysis`` extra) unless ``--no-plots``;
    :class:`~lightning_energy.extras.MissingExtra` (one line, exit 2) without it."""
    from lightning_energy.extras import check_installed

    if not args.no_plots:
        check_installed("matplotlib", "its plots (--no-plots prints the tables only)")


def table(header: list[str], rows: list[list]) -> str:
    """A fixed-width text table: numbers right-aligned with 4 significant digits or 2 decimals."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def cell(value) -> str:
    """A value as the tables print it: numbers with 4 significant digits, or 2 decimals from 100 up."""
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan"
        return f"{value:.2f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)
