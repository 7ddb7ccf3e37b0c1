"""``lightning-energy catalog list|show ID|compare ID ID|export FILE``: the run catalog of every fit.

The catalog is ``energy_catalog.sqlite`` in the run root (``--root``, default ``./runs`` or ``.``),
or the file given with ``--catalog``. Fits are recorded by ``CatalogCallback`` and by
``lightning-energy sweep``.

A damaged record (a column holding a value of the wrong type, a JSON column that is not an object) makes
every action refuse with one line naming the file, the fit and the column, exit code 2 and nothing printed
or written: ``list`` does not print the other fits either, since a listing that quietly leaves a fit out
reads as complete (``show ID`` of a sound fit still works).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_energy.cli.commands.common import cell, table
from lightning_energy.provenance import of_entry, word

HELP = "the run catalog (SQLite) of every fit: list, show ID, compare ID ID, export CSV"
COMPARED = ("model", "parameters", "flops_per_step", "hardware", "precision", "batch_size", "steps", "epochs",
            "duration_s", "energy_J", "provenance", "gCO2e", "intensity_g_per_kWh", "pue", "checkpoint_path")


def add_arguments(parser) -> None:
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--root", type=Path, default=None, help="run root holding energy_catalog.sqlite")
    where.add_argument("--catalog", type=Path, default=None, help="the catalog file itself")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", parents=[where], help="one line per fit")
    show = actions.add_parser("show", parents=[where], help="everything recorded about one fit")
    show.add_argument("id", type=int)
    show.add_argument("--json", action="store_true", help="print the record as JSON")
    compare = actions.add_parser("compare", parents=[where], help="two fits side by side")
    compare.add_argument("ids", type=int, nargs=2, metavar="ID")
    export = actions.add_parser("export", parents=[where], help="all fits as CSV")
    export.add_argument("csv", type=Path, help="the CSV file to write ('-' for stdout)")


def run(args) -> int:
    from lightning_energy.catalog import Catalog, CatalogError, find_catalog
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.io import atomic_write_text

    try:
        catalog = Catalog(find_catalog(args.root, args.catalog))
        if args.action == "list":
            fits = catalog.list()
            print(table(["id", "model", "precision", "batch", "steps", "time s", "energy J", "energy is", "gCO2e"],
                        [[f["id"], f["model"].rsplit(".", 1)[-1], f["precision"], f["batch_size"], f["steps"],
                          f["duration_s"], f["energy_J"], word(f["provenance"]), f["gCO2e"]] for f in fits]))
        elif args.action == "show":
            fit = catalog.get(args.id)
            print(json.dumps(fit, indent=2, sort_keys=True) if args.json else format_fit(fit))
        elif args.action == "compare":
            first, second = (catalog.get(i) for i in args.ids)
            print(format_comparison(first, second))
        else:
            text = catalog.export_csv()
            if str(args.csv) == "-":
                print(text, end="")
            else:
                print(f"wrote {atomic_write_text(args.csv, text)}")
    except CatalogError as err:
        raise CommandError(str(err)) from None
    except OSError as err:
        raise CommandError(f"cannot write {args.csv}: {err.strerror or err}") from None
    return 0


def format_fit(fit: dict) -> str:
    """``catalog show``: every recorded field (numbers rounded as in the tables, ``-`` for none), the energy
    per sensor, the final metrics and the config."""
    lines = [f"fit {fit['id']}: {fit['model']}"]
    for key in COMPARED[1:] + ("intensity_label", "run_dir"):
        lines.append(f"  {key:<20} {cell(fit[key])}")  # numbers rounded as in the tables
    lines.append("  energy per sensor:")
    for s in fit["sensors"]:
        how = word(of_entry(s))
        lines.append(f"    {s['name']:<16} rank {s['rank']}  {s['energy_J']:.2f} J  ({how}; {s['source']})")
    if fit["metrics"]:
        lines.append("  final metrics:")
        lines += [f"    {k:<32} {v:.6g}" for k, v in sorted(fit["metrics"].items())]
    lines.append(f"  config: {json.dumps(fit['config'], sort_keys=True)}")
    return "\n".join(lines)


def format_comparison(first: dict, second: dict) -> str:
    rows = []
    for key in COMPARED:
        a, b = first[key], second[key]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        rows.append([key, a, b, b / a if numbers and a else None])
    metrics = sorted(set(first["metrics"]) | set(second["metrics"]))
    for name in metrics:
        a, b = first["metrics"].get(name), second["metrics"].get(name)
        rows.append([name, a, b, b / a if a and b is not None else None])
    return table(["", f"fit {first['id']}", f"fit {second['id']}", "ratio"], rows)
