"""``lightning-energy compare RUN_DIR...``: runs on an even grid, mean ± std curves, EDP, a summary table.

Each run's cumulative energy is resampled from fit start to fit end (linearly, ``--rate-hz``, default
4 Hz) and its power derived from it (the mean power over each grid interval: never outside the power
the samples hold), padded to the longest run, and averaged per group (the power over the runs still going,
drawn below the curves as n(t); the cumulative energy holding a finished run at its total, so the mean curve
ends at the table's mean): with ``--by ATTR``
(a run attribute such as precision, batch_size or power_limit_W, from the run dir's
``run_attributes.json``, ``hparams.yaml``, LightningCLI's ``config.yaml`` or ``energy_report.json``) the
runs sharing a value, so repetitions are averaged; without it each run is its own group (unrelated runs
are never averaged). Legends name a group by the attribute (``batch_size=128 (n=2)``). A fit
boundary up to two sampling intervals outside the samples continues the nearest sample's power (the
``extrapolated_s`` column); further out is an error. Writes ``compare.json``, ``compare_power.png`` and
``compare_energy.png`` into ``--out``. A rate that would put more than ``MAX_GRID_POINTS``
(:mod:`lightning_energy.analysis.resample`) on a run is refused before anything is allocated. Runs that carry
EnergyToAccuracy's figures (``energy_to_target_J``,
``time_to_target_s`` in ``run_attributes.json``: CatalogCallback writes them, e.g. in the runs of
``lightning-energy recommend``) also get a table per group and ``compare_frontier.png``: energy vs time
to target per run, and the frontier of the runs no other beats in both.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning_energy.analysis import DEFAULT_RATE_HZ
from lightning_energy.cli.commands.common import check_plotting, load_runs_or_fail, table

HELP = "compare runs: resampled mean ± std power and energy curves, EDP per run, summary table"


def add_arguments(parser) -> None:
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="log dirs of fits")
    parser.add_argument("--by", default=None, metavar="ATTR", help="group runs by this attribute and average each group (default: one group per run)")
    parser.add_argument("--rate-hz", type=float, default=DEFAULT_RATE_HZ, help="resampling rate (default 4 Hz)")
    parser.add_argument("--out", type=Path, default=Path("energy_compare"),
                        help="output folder (default ./energy_compare)")
    parser.add_argument("--no-plots", action="store_true", help="print the tables only")


def run(args) -> int:
    from lightning_energy.analysis import plots
    from lightning_energy.analysis.compare import compare_runs
    from lightning_energy.analysis.resample import grid_points
    from lightning_energy.analysis.runs import RunError
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.provenance import word

    check_plotting(args)
    if not args.rate_hz > 0 or not math.isfinite(args.rate_hz):
        raise CommandError(f"--rate-hz must be a finite number > 0, got {args.rate_hz}")
    runs = load_runs_or_fail(args.run_dirs)
    for loaded in runs:  # every run's grid bounded before any curve is allocated
        try:
            grid_points(loaded.duration_s, args.rate_hz)
        except ValueError as err:
            raise CommandError(f"--rate-hz {args.rate_hz:g} is too fine for run {loaded.name}: {err}") from None
    for loaded in runs:
        for note in loaded.notes:
            print(f"note: run {loaded.name}: {note}")
    try:
        result = compare_runs(runs, args.by, args.rate_hz)
    except (RunError, ValueError) as err:
        raise CommandError(str(err)) from None
    print(table(["run", "group", "time s", "energy J", "energy is", "mean W", "EDP J*s"],
                [[r["run"], r["group"], r["duration_s"], r["energy_J"], word(r["provenance"]), r["mean_power_W"],
                  r["edp_Js"]] for r in result["runs"]]))
    print()
    print(table([args.by or "group", "runs", "energy J", "± std", "energy is", "time s", "± std", "EDP J*s", "± std"],
                [[key, g["runs"], g["energy_J_mean"], g["energy_J_std"], word(g["provenance"]), g["duration_s_mean"],
                  g["duration_s_std"], g["edp_Js_mean"], g["edp_Js_std"]] for key, g in result["groups"].items()]))
    reached = [r for r in result["runs"] if r["energy_to_target_J"] is not None]
    if reached:
        print()
        print(table([args.by or "group", "reached", "energy to target J", "± std", "time to target s", "± std"],
                    [[key, g["reached_target"], g["energy_to_target_J_mean"], g["energy_to_target_J_std"],
                      g["time_to_target_s_mean"], g["time_to_target_s_std"]] for key, g in result["groups"].items()]))
        print("frontier (no run reaches the target both faster and for less energy): " +
              ", ".join(r["run"] for r in sorted(reached, key=lambda r: r["time_to_target_s"]) if r["on_frontier"]))
    files: dict[Path, bytes | str] = {args.out / "compare.json": json.dumps(result, indent=1) + "\n"}
    if not args.no_plots:
        how = result["provenance"]
        files[args.out / "compare_power.png"] = plots.band_figure(
            result["groups"], "power_W", "power (W)", "power of the runs still going, mean ± std", how, args.by)
        files[args.out / "compare_energy.png"] = plots.band_figure(
            result["groups"], "energy_J", "cumulative energy (J)",
            "cumulative energy (a finished run held at its total), mean ± std", how, args.by)
        if reached:
            files[args.out / "compare_frontier.png"] = plots.frontier_figure(result["runs"], args.by, how)
    for path in plots.write_files(files):
        print(f"wrote {path}")
    return 0
