"""``lightning-energy report RUN_DIR``: the energy report of one run, computed from its trace and events.

Prints the energy per sensor and the per-epoch table and writes ``power.png`` (power over time with
epoch markers), ``cumulative_energy.png``, ``epoch_boxplots.png`` (per-epoch energy and time) and
``trace_report.json`` into ``--out`` (default ``RUN_DIR/energy_plots``).
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning_energy.cli.commands.common import check_plotting, load_runs_or_fail, table
from lightning_energy.provenance import tagged

HELP = "energy report of one run from its trace: totals per sensor, per-epoch table, PNG plots"
OUT_DEFAULT = "energy_plots"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="the fit's log dir (holding energy_trace.csv)")
    parser.add_argument("--out", type=Path, default=None, help=f"folder for the plots (default RUN_DIR/{OUT_DEFAULT})")
    parser.add_argument("--no-plots", action="store_true", help="print the tables only")


def build(run) -> dict:
    """The report of a loaded run as a JSON-ready dict."""
    totals = run.sensor_totals_J()
    total = run.total_J
    return {
        "run": run.name,
        "run_dir": str(run.path),
        "duration_s": run.duration_s,
        "total_J": total,
        "provenance": run.provenance,
        "mean_power_W": total / run.duration_s if run.duration_s > 0 else None,
        "edp_Js": run.edp_Js,
        "extrapolated_s": run.extrapolated_s,
        "notes": list(run.notes),
        "sensors": [{"name": name, "energy_J": joules, "share": joules / total if total else None,
                     "mean_power_W": joules / run.duration_s if run.duration_s > 0 else None}
                    for name, joules in totals.items()],
        "epochs": [e.as_dict() for e in run.epochs()],
        "attributes": run.attributes,
    }


def format_report(report: dict) -> str:
    total = tagged(f"{report['total_J']:.2f} J", report["provenance"])
    lines = [f"run {report['run']}: {report['duration_s']:.2f} s, {total}, "
             f"mean {report['mean_power_W'] or float('nan'):.2f} W, EDP {report['edp_Js']:.4g} J*s"]
    lines += [f"note: {note}" for note in report["notes"]]
    if report["extrapolated_s"] > 0:
        lines.append(f"note: {report['extrapolated_s']:.3f} s of the fit lie outside the samples; "
                     "their energy continues the nearest sample's power")
    lines.append("")
    lines.append(table(["sensor", "energy J", "share %", "mean W"],
                       [[s["name"], s["energy_J"], 100 * (s["share"] or 0.0), s["mean_power_W"]]
                        for s in report["sensors"]]))
    if report["epochs"]:
        lines += ["", table(["epoch", "time s", "energy J", "train J", "valid J", "mean W", "EDP J*s"],
                            [[e["epoch"], e["duration_s"], e["energy_J"], e["train_J"], e["validation_J"],
                              e["mean_power_W"], e["edp_Js"]] for e in report["epochs"]])]
    else:
        lines += ["", "no complete epoch in the events file"]
    return "\n".join(lines)


def run(args) -> int:
    from lightning_energy.analysis import plots

    check_plotting(args)
    (loaded,) = load_runs_or_fail([args.run_dir])
    report = build(loaded)
    out = args.out if args.out is not None else args.run_dir / OUT_DEFAULT
    print(format_report(report))
    if args.no_plots:
        return 0
    files: dict[Path, bytes | str] = {
        out / "power.png": plots.power_figure(loaded),
        out / "cumulative_energy.png": plots.cumulative_energy_figure(loaded),
    }
    if report["epochs"]:
        files[out / "epoch_boxplots.png"] = plots.epoch_boxplots_figure(loaded, report["epochs"])
    files[out / "trace_report.json"] = json.dumps(report, indent=2) + "\n"
    for path in plots.write_files(files):
        print(f"wrote {path}")
    return 0
