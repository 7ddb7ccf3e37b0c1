"""``lightning-energy validate RUN_DIR --reference METER.csv``: the run's energy beside your own meter's.

The meter's log (a wall plug, PDU, PSU or SPEC PTDaemon log; CSV with a time column and a power or
energy-counter column, or PTDaemon's ``Time,...,Watts,...`` lines) is aligned with the run's trace (the
clock offset found by cross-correlating the two power curves, or given with ``--offset``) and compared:
the fit's and each epoch's energy and error %, the phases (training, validation, before and after the
fit), MLPerf Training's power rules (a reading at least every second, at least 60 readings, a log covering
the run, the 5 % Olympic accuracy test) and our attribution bound (``bound_J``). Prints the tables and
writes ``validation.json`` and ``validation_power.png`` (both power curves, aligned) into ``--out``.
Formats, units and limits: :mod:`lightning_energy.analysis.reference_log`; the comparison:
:mod:`lightning_energy.analysis.validate`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning_energy.cli.commands.common import check_plotting, load_runs_or_fail, table
from lightning_energy.provenance import tagged

HELP = ("compare a run's energy with your own power meter's log (wall plug, PDU, PSU, PTDaemon): errors, "
        "MLPerf's power rules, a plot")
OUT_DEFAULT = "energy_validate"
DEFAULT_MAX_OFFSET_S = 120.0  # lightning_energy.analysis.align.DEFAULT_MAX_OFFSET_S, here without numpy


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="the fit's log dir (holding energy_trace.csv)")
    parser.add_argument("--reference", type=Path, required=True, metavar="METER_LOG",
                        help="the meter's log: CSV (a time column and a power or energy column) or a PTDaemon log")
    parser.add_argument("--columns", default=None, metavar="TIME,VALUE",
                        help="the time and value columns: header names or 1-based numbers; in a file without a "
                             "header, names for its first columns (time,watts; time,kWh)")
    parser.add_argument("--unit", default=None, metavar="UNIT",
                        help="the value column's unit when its name does not say: W, kW, mW (power); J, kJ, MJ, Wh, "
                             "kWh, mWh (an energy counter)")
    parser.add_argument("--offset", default="auto", metavar="auto|SECONDS",
                        help="seconds added to the meter's clock to match ours (a log of relative times: its first "
                             "reading's time after the fit's start); auto (default): found by cross-correlation")
    parser.add_argument("--max-offset", type=float, default=DEFAULT_MAX_OFFSET_S, metavar="SECONDS",
                        help=f"auto: how far apart two wall clocks may be (default {DEFAULT_MAX_OFFSET_S:g} s)")
    parser.add_argument("--trust-units", action="store_true",
                        help="compare even when the meter's mean power is implausibly far from ours (a unit 1000x off)")
    parser.add_argument("--out", type=Path, default=None, help=f"output folder (default RUN_DIR/{OUT_DEFAULT})")
    parser.add_argument("--no-plots", action="store_true", help="print the tables and write the JSON only")


def _offset(text: str) -> float | None:
    from lightning_energy.cli.commands import CommandError

    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise CommandError(f"--offset must be auto or a number of seconds, got {text!r}")
    return value


def _columns(text: str | None) -> tuple[str, str] | None:
    from lightning_energy.cli.commands import CommandError

    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise CommandError(f"--columns takes TIME,VALUE (two column names or numbers), got {text!r}")
    return parts[0], parts[1]


def run(args) -> int:
    from lightning_energy.analysis import plots
    from lightning_energy.analysis.reference_log import MeterLogError, read_meter_log
    from lightning_energy.analysis.validate import read_report, validate, wall_clock_anchor
    from lightning_energy.cli.commands import CommandError

    check_plotting(args)
    offset = _offset(args.offset)
    columns = _columns(args.columns)
    if not (args.max_offset > 0 and math.isfinite(args.max_offset)):
        raise CommandError(f"--max-offset must be a finite number of seconds > 0, got {args.max_offset}")
    (loaded,) = load_runs_or_fail([args.run_dir])
    try:
        meter = read_meter_log(args.reference, columns, args.unit)
        validation = validate(loaded, meter, wall_clock_anchor(args.run_dir), offset, args.max_offset,
                              args.trust_units, read_report(args.run_dir))
    except MeterLogError as err:
        raise CommandError(str(err)) from None
    result = validation.result
    out = args.out if args.out is not None else args.run_dir / OUT_DEFAULT
    text = json.dumps(_finite(result), indent=1, allow_nan=False) + "\n"
    files: dict[Path, bytes | str] = {out / "validation.json": text}
    if not args.no_plots:
        from lightning_energy.analysis.validate_plot import validation_figure

        files[out / "validation_power.png"] = validation_figure(validation)  # rendered before anything is written
    print(format_validation(result))
    for path in plots.write_files(files):
        print(f"wrote {path}")
    return 0


def _finite(value):
    """``value`` with numpy scalars as Python numbers and NaN or infinite numbers as null (valid JSON)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _pct(value) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:+.2f}"


def format_validation(result: dict) -> str:
    """The tables ``validate`` prints."""
    ref, alignment, fit = result["reference"], result["alignment"], result["fit"]
    ours_how = result["provenance"]["ours"]
    rate = 1.0 / ref["median_interval_s"] if ref["median_interval_s"] > 0 else math.nan
    lines = [f"run {result['run']} vs meter {ref['file']}: {ref['format']} log, {ref['kind']} in {ref['unit']} "
             f"(column {ref['value_column']!r}), {rate:.3g} Hz, {ref['rows']} readings, "
             f"{'wall clock' if ref['clock'] == 'wall' else 'relative times'}"]
    how = {"auto": "found by cross-correlation", "given": "given", "assumed": "assumed (nothing to correlate)"}
    align_line = f"alignment: offset {alignment['offset_s']:+.3f} s, {how[alignment['how']]}"
    if alignment["correlation"] is not None:
        align_line += f" (r = {alignment['correlation']:.3f}"
        if alignment["runner_up_correlation"] is not None:
            align_line += (f"; next best r = {alignment['runner_up_correlation']:.3f} at "
                           f"{alignment['runner_up_offset_s']:+.3f} s")
        align_line += ")"
    if alignment["drift_ppm"]:
        align_line += f"; our clock runs {alignment['drift_ppm']:+.0f} ppm against the meter's (corrected)"
    lines.append(align_line)
    bound = f", our bound {fit['bound_J']:.4g} J" if fit.get("bound_J") is not None else ""
    ours = tagged(f"{fit['ours_J']:.2f} J", ours_how)
    lines.append(f"fit ({fit['duration_s']:.2f} s): ours {ours}, meter "
                 f"{fit['meter_J']:.2f} J (measured), error {_pct(fit['error_pct'])} %, meter - ours "
                 f"{fit['difference_W']:+.2f} W on average{bound}")
    lines.append("")
    gaps = bool(result["gaps"])
    rows = [[e["epoch"], e["duration_s"], e["ours_J"], e["meter_J"], _pct(e["error_pct"]), e["difference_W"],
             e["bound_J"], {True: "yes", False: "no", None: "-"}[e["within_bound"]], e["meter_readings"],
             *([e["gap_s"]] if gaps else [])]
            for e in result["epochs"] if e.get("covered", True)]
    if rows:
        lines.append(table(["epoch", "time s", "ours J", "meter J", "error %", "meter-ours W", "bound J",
                            "in bound", "readings", *(["gap s"] if gaps else [])], rows))
        lines.append("")
    uncovered = [str(e["epoch"]) for e in result["epochs"] if not e.get("covered", True)]
    if uncovered:
        lines.append(f"epoch(s) {', '.join(uncovered)}: not covered by the meter's log")
        lines.append("")
    lines.append(table(["phase", "time s", "ours J", "meter J", "error %", "ours W", "meter W"],
                       [[p["phase"], p["duration_s"], p["ours_J"], p["meter_J"], _pct(p["error_pct"]), p["ours_W"],
                         p["meter_W"]] for p in result["phases"]]))
    lines.append("")
    lines.append("MLPerf Training power rules, over the fit:")
    for check in result["mlperf"]["checks"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[check["passed"]]
        lines.append(f"  {verdict}  {check['rule']}: {check['detail']}")
    if result["gaps"]:
        lines.append(f"note: {len(result['gaps'])} gap(s) in the meter's log (intervals over 1.5x its median), "
                     f"{sum(g['end_s'] - g['start_s'] for g in result['gaps']):.1f} s in all; see gaps in the JSON")
    lines += [f"note: {note}" for note in result["notes"]]
    scopes = sorted({s["scope"] for s in result["sensors"] if s.get("scope")})
    if scopes:
        lines.append(f"note: our sensors' scope: {', '.join(scopes)}; a meter at the wall also sees what they do not "
                     "(fans, PSU losses, disks): meter - ours W is that part")
    return "\n".join(lines)
