"""``lightning-energy fit RUN_DIR... --by ATTR[,GROUP]``: energy, time and EDP vs a numeric run attribute.

Each of the three is fitted with a least-squares quadratic (y = a x² + b x + c); the power-limit study
found such fits close to exact for compute-heavy networks. R² is shown only where spare points test the
fit (more runs than the quadratic's 3 parameters, :mod:`lightning_energy.analysis.goodness`): through 3
runs the quadratic is exact by construction, and the output says so instead. With a second attribute
(``--by power_limit_W,precision``) the runs are fitted per value of it, one curve per group. Writes
``fit.json`` and ``fit.png`` into ``--out``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning_energy.cli.commands.common import check_plotting, load_runs_or_fail, table

HELP = "energy, time and EDP vs a numeric run attribute, with quadratic fits (R² where spare runs test them)"
QUANTITIES = {"energy": ("J", "total_J"), "time": ("s", "duration_s"), "edp": ("J*s", "edp_Js")}


def add_arguments(parser) -> None:
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="log dirs of fits")
    parser.add_argument("--by", required=True, metavar="ATTR[,GROUP]",
                        help="numeric run attribute, e.g. power_limit_W; a second one after a comma fits each "
                             "group of runs sharing its value apart (power_limit_W,precision)")
    parser.add_argument("--out", type=Path, default=Path("energy_fit"), help="output folder (default ./energy_fit)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")


def split_by(by: str) -> tuple[str, str | None]:
    """``"x"`` -> (x, None); ``"x,group"`` -> (x, group); ValueError for anything else."""
    names = [name.strip() for name in by.split(",")]
    if len(names) > 2 or not all(names):
        raise ValueError(f"--by takes one attribute or two separated by a comma (ATTR[,GROUP]), got {by!r}")
    return names[0], names[1] if len(names) == 2 else None


def fit_runs(runs, by: str, group_by: str | None = None) -> dict:
    """Quadratic fits of energy, time and EDP against attribute ``by``, per value of ``group_by`` when given
    (RunError / ValueError on bad input). ``groups``: group name (``"all"`` without ``group_by``) ->
    ``{"points": {quantity: (x, y, unit)}, "fits": {quantity: QuadraticFit}}``."""
    from lightning_energy.analysis.fit import quadratic_fit
    from lightning_energy.analysis.runs import require_attribute
    from lightning_energy.provenance import combine

    x = []
    for run, value in zip(runs, require_attribute(runs, by)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"attribute {by!r} of run {run.name} is {value!r}, not a finite number")
        x.append(float(value))
    labels = ["all"] * len(runs) if group_by is None else [str(v) for v in require_attribute(runs, group_by)]
    groups = {}
    for label in dict.fromkeys(labels):
        members = [i for i, own in enumerate(labels) if own == label]
        xs = [x[i] for i in members]
        points = {name: (xs, [getattr(runs[i], prop) for i in members], unit)
                  for name, (unit, prop) in QUANTITIES.items()}
        try:
            fits = {name: quadratic_fit(xs, ys) for name, (_, ys, _) in points.items()}
        except ValueError as err:
            where = "" if group_by is None else f"group {group_by}={label}: "
            raise ValueError(f"{where}{err}") from None
        groups[label] = {"points": points, "fits": fits}
    return {"by": by, "group_by": group_by, "groups": groups, "provenance": combine(run.provenance for run in runs),
            "runs": [{"run": r.name, by: xi, **({group_by: label} if group_by else {}),
                      **{n: getattr(r, prop) for n, (_, prop) in QUANTITIES.items()}, "provenance": r.provenance}
                     for r, xi, label in zip(runs, x, labels)]}


def fit_document(fit) -> dict:
    """A fit as written to fit.json: its coefficients, ``r2`` only where spare points test it (else null, with
    ``r2_note`` saying why) and ``spare_points``."""
    from lightning_energy.analysis.goodness import describe_r2, spare_points, tested_r2

    return {**fit.as_dict(), "r2": tested_r2(fit.r2, fit.n), "spare_points": spare_points(fit.n),
            "r2_note": describe_r2(fit.r2, fit.n)}


def run(args) -> int:
    from lightning_energy.analysis import plots
    from lightning_energy.analysis.goodness import describe_r2
    from lightning_energy.analysis.runs import RunError
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.provenance import word

    check_plotting(args)
    runs = load_runs_or_fail(args.run_dirs)
    try:
        by, group_by = split_by(args.by)
        result = fit_runs(runs, by, group_by)
    except (RunError, ValueError) as err:
        raise CommandError(str(err)) from None
    grouped = group_by is not None
    print(table(["run", by, *([group_by] if grouped else []), "energy J", "energy is", "time s", "EDP J*s"],
                [[r["run"], r[by], *([r[group_by]] if grouped else []), r["energy"], word(r["provenance"]),
                  r["time"], r["edp"]] for r in result["runs"]]))
    print()
    print(table([*([group_by] if grouped else []), "quantity", "a (x²)", "b (x)", "c", "goodness of fit"],
                [[*([label] if grouped else []), f"{name} ({QUANTITIES[name][0]})", f.a, f.b, f.c,
                  describe_r2(f.r2, f.n)]
                 for label, group in result["groups"].items() for name, f in group["fits"].items()]))
    fits = {label: {name: fit_document(f) for name, f in group["fits"].items()}
            for label, group in result["groups"].items()}
    document = {"by": by, "provenance": result["provenance"], "runs": result["runs"],
                **({"group_by": group_by, "groups": fits} if grouped else {"fits": fits["all"]})}
    files: dict[Path, bytes | str] = {args.out / "fit.json": json.dumps(document, indent=1) + "\n"}
    if not args.no_plots:
        files[args.out / "fit.png"] = plots.fit_figure(by, result["groups"], result["provenance"], group_by)
    for path in plots.write_files(files):
        print(f"wrote {path}")
    return 0
