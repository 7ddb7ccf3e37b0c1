"""``lightning-energy fit RUN_DIR... --by ATTR``: energy, time and EDP vs a numeric run attribute.

Each of the three is fitted with a least-squares quadratic (y = a x² + b x + c) and its R²; the
power-limit study found such fits close to exact for compute-heavy networks. Writes ``fit.json`` and
``fit.png`` into ``--out``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning_energy.cli.commands.common import load_runs_or_fail, table

HELP = "energy, time and EDP vs a numeric run attribute, with quadratic fits and R², plotted"
QUANTITIES = {"energy": ("J", "total_J"), "time": ("s", "duration_s"), "edp": ("J*s", "edp_Js")}


def add_arguments(parser) -> None:
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="log dirs of fits")
    parser.add_argument("--by", required=True, metavar="ATTR", help="numeric run attribute, e.g. power_limit_W")
    parser.add_argument("--out", type=Path, default=Path("energy_fit"), help="output folder (default ./energy_fit)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")


def fit_runs(runs, by: str) -> dict:
    """Quadratic fits of energy, time and EDP against attribute ``by`` (RunError / ValueError on bad input)."""
    from lightning_energy.analysis.fit import quadratic_fit
    from lightning_energy.analysis.runs import require_attribute
    from lightning_energy.provenance import combine

    x = []
    for run, value in zip(runs, require_attribute(runs, by)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"attribute {by!r} of run {run.name} is {value!r}, not a finite number")
        x.append(float(value))
    points, fits = {}, {}
    for name, (unit, prop) in QUANTITIES.items():
        y = [getattr(run, prop) for run in runs]
        points[name] = (x, y, unit)
        fits[name] = quadratic_fit(x, y)
    return {"by": by, "points": points, "fits": fits, "provenance": combine(run.provenance for run in runs),
            "runs": [{"run": r.name, by: xi, **{n: points[n][1][i] for n in QUANTITIES}, "provenance": r.provenance}
                     for i, (r, xi) in enumerate(zip(runs, x))]}


def run(args) -> int:
    from lightning_energy.analysis import plots
    from lightning_energy.analysis.runs import RunError
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.provenance import word

    runs = load_runs_or_fail(args.run_dirs)
    try:
        result = fit_runs(runs, args.by)
    except (RunError, ValueError) as err:
        raise CommandError(str(err)) from None
    fits = result["fits"]
    print(table(["run", args.by, "energy J", "energy is", "time s", "EDP J*s"],
                [[r["run"], r[args.by], r["energy"], word(r["provenance"]), r["time"], r["edp"]]
                 for r in result["runs"]]))
    print()
    print(table(["quantity", "a (x²)", "b (x)", "c", "R²"],
                [[f"{name} ({QUANTITIES[name][0]})", f.a, f.b, f.c, f.r2] for name, f in fits.items()]))
    document = {"by": args.by, "provenance": result["provenance"], "runs": result["runs"],
                "fits": {name: f.as_dict() for name, f in fits.items()}}
    files: dict[Path, bytes | str] = {args.out / "fit.json": json.dumps(document, indent=1) + "\n"}
    if not args.no_plots:
        files[args.out / "fit.png"] = plots.fit_figure(args.by, result["points"], fits, result["provenance"])
    for path in plots.write_files(files):
        print(f"wrote {path}")
    return 0
