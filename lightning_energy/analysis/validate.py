"""A run's energy set beside the user's own meter, as ``lightning-energy validate`` reports it.

The meter's log (:mod:`lightning_energy.analysis.reference_log`) is put on the run's time axis: its wall
clock through the trace's ``unix_time_s`` (``unix_time_s - time_s`` is the trace's wall-clock anchor), a
relative clock with its first reading at the fit's start; then shifted by the offset, given (``--offset``)
or found by cross-correlating the two power curves (:mod:`lightning_energy.analysis.align`, which also
measures a drift of the meter's clock on long enough fits).

The meter's energy follows MLPerf Training's scoring rule: each power reading times the time since the
previous reading (a counter's own joules for an energy log), cut exactly at the window's edges (MLPerf
sums whole readings). Ours is the trace's cumulative energy (the meter's marks at the fit's start and end,
as in ``energy_report.json``). For the fit, each epoch, each phase (training, validation, the rest of the
fit; before and after the fit the meter alone: the node idle, if nothing else ran) and MLPerf's one-minute
windows: both energies, the error ``(ours - meter) / meter`` in %, the mean power of each and their
difference (W: a wall meter also sees what our sensors do not: fans, PSU losses, disks), and our
attribution bound (``bound_J`` from ``energy_report.json``; it covers how the samples share energy out in
time, not the sensors' own accuracy nor what they do not see).

MLPerf Training's power rules (``mlcommons/training_policies``, ``power_measurement.adoc``) checked on the
log over the timed part (the fit): at least one reading per second (``MLPERF_MAX_INTERVAL_S``, with
``RATE_TOLERANCE`` for a logger's jitter), at least ``MLPERF_MIN_READINGS`` readings, a log that starts
before the fit and ends after it, and the 5 % accuracy test: the Olympic score (the middle three of five
one-minute windows, each meter's figures sorted on their own) of ours within 5 % of the meter's. MLPerf
asks for that test under several loads (idle and two benchmarks): one run is one load.

A log whose mean power is implausibly far from ours (outside ``PLAUSIBLE_RATIO``: a unit 1000x off, kW
read as W, Wh as J) is refused with a line naming the unit that fits, before anything is aligned.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_energy.analysis import align as aligning
from lightning_energy.analysis.reference_log import ENERGY_UNITS, POWER_UNITS, UNITS, MeterLog, MeterLogError
from lightning_energy.filenames import REPORT_FILE

GAP_FACTOR = 1.5  # an interval between readings longer than this x the median is a gap
MLPERF_MAX_INTERVAL_S = 1.0  # "Power measurement must be at least once every second"
MLPERF_MIN_READINGS = 60  # "Measure max(a run, 60 power samples)"
MLPERF_ACCURACY_PCT = 5.0  # "Target 5% Accuracy"
MLPERF_WINDOW_S = 60.0  # "5 un-overlapped timed durations of 1 minute each"
MLPERF_WINDOWS = 5
RATE_TOLERANCE = 0.02  # a 1 Hz logger's intervals jitter by a few ms; up to 1.02 s counts as once a second
PLAUSIBLE_RATIO = (1 / 30, 300.0)  # the meter's mean power / ours: a node's wall draws 1-10x its GPUs'
MIN_COVERED_SHARE = 0.5  # the aligned log must cover at least this share of the fit
MAX_REPORT_BYTES = 64 * 1024 ** 2
RELATIVE_SEARCH_S = 1e9  # a relative clock: every offset that lets the log cover the fit is searched


@dataclass
class Validation:
    """The result (``result``: JSON-ready) and the curves the plot draws: the meter's reading times on our
    axis (s), its mean power over each interval before a reading (W; the first reading's own value), and
    the run."""

    result: dict
    meter_t: np.ndarray
    meter_W: np.ndarray
    run: object
    gaps: list[tuple[float, float]]


def wall_clock_anchor(run_dir: Path) -> float:
    """``unix_time_s - time_s`` of the trace's first row (s): our trace axis plus it is Unix time."""
    from lightning_energy.outputs.trace import TRACE_FILE

    path = Path(run_dir) / TRACE_FILE
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            header = next(reader, [])
            if "time_s" not in header or "unix_time_s" not in header:
                raise MeterLogError(f"{path} has no time_s / unix_time_s columns: its samples cannot be put on a clock")
            row = next(reader, None)
            if row is None:
                raise MeterLogError(f"{path} holds no samples")
            anchor = float(row[header.index("unix_time_s")]) - float(row[header.index("time_s")])
    except (ValueError, IndexError, csv.Error) as err:
        raise MeterLogError(f"{path}: its first row gives no wall-clock time ({err})") from None
    except OSError as err:
        raise MeterLogError(f"cannot read {path}: {err.strerror or err}") from None
    if not math.isfinite(anchor):
        raise MeterLogError(f"{path}: its first row gives no wall-clock time")
    return anchor


def read_report(run_dir: Path) -> dict | None:
    """The run's ``energy_report.json`` (None without one, or where it is unreadable or over
    ``MAX_REPORT_BYTES``)."""
    path = Path(run_dir) / REPORT_FILE
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            return None
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return loaded if isinstance(loaded, dict) else None


def validate(run, meter: MeterLog, anchor_unix_s: float, offset_s: float | None = None,
             max_offset_s: float = aligning.DEFAULT_MAX_OFFSET_S, trust_units: bool = False,
             report: dict | None = None) -> Validation:
    """Compare ``run`` (:class:`~lightning_energy.analysis.runs.Run`) with ``meter``. ``offset_s``: seconds
    added to the meter's times (a wall clock), or the fit-relative time of its first reading (a relative
    clock); None: found by cross-correlation within ``max_offset_s`` (a wall clock) or anywhere (relative).
    :class:`MeterLogError` when the log cannot be compared (its units, its coverage, no alignment)."""
    fit_start, fit_end = run.start_s, run.end_s
    if meter.clock == "wall":
        meter_t = meter.time_s - anchor_unix_s
        search = (-max_offset_s, max_offset_s)
    else:
        meter_t = meter.time_s - meter.time_s[0] + fit_start
        search = (-RELATIVE_SEARCH_S, RELATIVE_SEARCH_S)
    meter_cum = aligning.cumulative_J(meter.kind, meter_t, meter.values)
    notes: list[str] = []
    if not trust_units:
        _check_units(run, meter, meter_t, meter_cum)
    gaps = aligning.find_gaps(meter_t, GAP_FACTOR)
    alignment = _alignment(run, meter, meter_t, meter_cum, gaps, offset_s, search)
    notes += alignment.notes
    meter_t = alignment.to_ours(meter_t)
    meter_cum = aligning.cumulative_J(meter.kind, meter_t, meter.values)  # power x the intervals on our clock
    gaps = aligning.find_gaps(meter_t, GAP_FACTOR)
    covered = (max(fit_start, meter_t[0]), min(fit_end, meter_t[-1]))
    if covered[1] - covered[0] < MIN_COVERED_SHARE * (fit_end - fit_start):
        raise MeterLogError(
            f"the meter's log, aligned ({alignment.how} offset {alignment.offset_s:+.3f} s), runs from "
            f"{meter_t[0] - fit_start:+.1f} s to {meter_t[-1] - fit_start:+.1f} s of the fit's start and covers "
            f"{max(covered[1] - covered[0], 0.0):.1f} s of its {fit_end - fit_start:.1f} s: is it this run's log?"
            f"{_time_zone_hint(meter_t, fit_start, fit_end) if meter.clock == 'wall' else ''}")
    compare = _Comparer(run, meter_t, meter_cum, gaps, fit_start)
    bounds = _epoch_bounds(report)
    fit_bound = report.get("bound_J") if isinstance(report, dict) else None
    fit = compare.window(*covered, bound_J=fit_bound if covered == (fit_start, fit_end) else None)
    if covered != (fit_start, fit_end):
        notes.append(f"the meter's log covers {covered[1] - covered[0]:.1f} s of the fit's {fit_end - fit_start:.1f} "
                     f"s: the fit's figures are over that part only")
    if not isinstance(fit_bound, (int, float)):
        notes.append(f"{REPORT_FILE} holds no bound for the whole fit; the epochs' bounds are shown per epoch")
    epochs = []
    for epoch in run.epochs():
        if epoch.start_s >= covered[0] and epoch.end_s <= covered[1]:
            epochs.append({"epoch": epoch.epoch, **compare.window(epoch.start_s, epoch.end_s, bounds.get(epoch.epoch))})
        else:
            epochs.append({"epoch": epoch.epoch, "start_s": epoch.start_s - fit_start, "end_s": epoch.end_s - fit_start,
                           "covered": False})
    meter_W = np.concatenate(([meter.values[0] if meter.kind == "power" else math.nan],
                              np.diff(meter_cum) / np.diff(meter_t)))
    if meter.kind == "energy":
        meter_W[0] = meter_W[1]
    result = {
        "run": run.name, "run_dir": str(run.path), "reference": meter.describe(),
        "provenance": {"ours": run.provenance, "meter": "measured"},
        "sensors": _sensors(report), "alignment": alignment.as_dict(),
        "fit": fit, "epochs": epochs, "phases": _phases(run, compare, meter_t, covered),
        "mlperf": _mlperf(compare, meter_t, gaps, fit_start, fit_end, covered),
        "gaps": [{"start_s": a - fit_start, "end_s": b - fit_start} for a, b in gaps],
        "notes": notes + meter.notes,
    }
    return Validation(result, meter_t, meter_W, run, gaps)


def _time_zone_hint(meter_t: np.ndarray, fit_start: float, fit_end: float) -> str:
    """Where the log lies a whole number of quarter hours (15 min or more) away from the fit: the offset that
    would put it there (a log in another time zone, or a naive local time read as UTC)."""
    if meter_t[0] > fit_end:
        away = meter_t[0] - fit_start
    elif meter_t[-1] < fit_start:
        away = meter_t[-1] - fit_end
    else:
        return ""
    quarters = round(away / 900.0)
    if quarters == 0:
        return ""
    return (f" It lies about {abs(quarters) / 4:g} h {'after' if away > 0 else 'before'} the fit: is its clock in "
            f"another time zone? Try --offset {-quarters * 900}")


def _check_units(run, meter: MeterLog, meter_t: np.ndarray, meter_cum: np.ndarray) -> None:
    """:class:`MeterLogError` when the meter's mean power and ours differ by more than ``PLAUSIBLE_RATIO``,
    naming the unit that would make them agree."""
    ours_W = run.total_J / run.duration_s if run.duration_s > 0 else math.nan
    meter_W = float(meter_cum[-1] / (meter_t[-1] - meter_t[0]))
    if not (ours_W > 0 and meter_W > 0):
        return
    ratio = meter_W / ours_W
    if PLAUSIBLE_RATIO[0] <= ratio <= PLAUSIBLE_RATIO[1]:
        return
    family = POWER_UNITS if meter.kind == "power" else ENERGY_UNITS
    likely = min(family, key=lambda u: abs(math.log10(ratio * UNITS[u] / UNITS[meter.unit]) - math.log10(2.0)))
    side = f"{ratio:.3g}x ours" if ratio > 1 else f"1/{1 / ratio:.3g} of ours"
    hint = (f"is its unit {likely}, not {meter.unit}? pass --unit {likely}" if likely != meter.unit and
            meter.format == "csv" else "is it this run's log?")
    raise MeterLogError(f"the meter's mean power, {meter_W:.4g} W (its values read as {meter.unit}), is {side} "
                        f"({ours_W:.4g} W over the fit): {hint} (--trust-units compares them anyway)")


def _alignment(run, meter: MeterLog, meter_t, meter_cum, gaps, offset_s, search) -> aligning.Alignment:
    fit = (run.start_s, run.end_s)
    if offset_s is not None:
        return aligning.Alignment(float(offset_s), "given", reference_s=fit[0] - float(offset_s))
    found = aligning.find_alignment(run.time_s, run.energy_J, fit, meter_t, meter_cum, gaps, search,
                                    meter.median_interval_s, run.sample_interval_s)
    if isinstance(found, aligning.Alignment):
        return found
    if meter.clock == "wall":
        assumed = aligning.Alignment(0.0, "assumed", reference_s=fit[0])
        assumed.notes.append(f"no offset found ({found}): the clocks are taken to agree (offset 0 s); give --offset "
                             "if they do not")
        return assumed
    raise MeterLogError(f"cannot place the meter's log (its times are relative, not a wall clock): {found}; "
                        "give --offset SECONDS (its first reading's time after the fit's start; negative: before)")


class _Comparer:
    """Both energies over windows of our axis."""

    def __init__(self, run, meter_t, meter_cum, gaps, fit_start) -> None:
        self.run, self.meter_t, self.meter_cum, self.gaps, self.origin = run, meter_t, meter_cum, gaps, fit_start

    def meter_J(self, a: float, b: float) -> float:
        return float(np.interp(b, self.meter_t, self.meter_cum) - np.interp(a, self.meter_t, self.meter_cum))

    def ours_covers(self, a: float, b: float) -> bool:
        slack = 2 * self.run.sample_interval_s
        return a >= self.run.time_s[0] - slack and b <= self.run.time_s[-1] + slack

    def gap_s(self, a: float, b: float) -> float:
        return sum(max(0.0, min(b, g1) - max(a, g0)) for g0, g1 in self.gaps)

    def readings(self, a: float, b: float) -> int:
        return int(np.count_nonzero((self.meter_t > a) & (self.meter_t <= b)))

    def window(self, a: float, b: float, bound_J=None) -> dict:
        return self.windows([(a, b)], bound_J)

    def windows(self, spans: list[tuple[float, float]], bound_J=None, ours: bool = True) -> dict:
        """Figures summed over ``spans`` (our axis, s); times in the result relative to the fit's start."""
        seconds = sum(b - a for a, b in spans)
        meter = sum(self.meter_J(a, b) for a, b in spans)
        ours_J = sum(self.run.energy_between(a, b) for a, b in spans) if ours else None
        out = {"start_s": spans[0][0] - self.origin if spans else None,
               "end_s": spans[-1][1] - self.origin if spans else None, "duration_s": seconds,
               "ours_J": ours_J, "meter_J": meter,
               "error_pct": 100 * (ours_J - meter) / meter if ours_J is not None and meter > 0 else None,
               "difference_J": meter - ours_J if ours_J is not None else None,
               "ours_W": ours_J / seconds if ours_J is not None and seconds > 0 else None,
               "meter_W": meter / seconds if seconds > 0 else None,
               "meter_readings": sum(self.readings(a, b) for a, b in spans),
               "gap_s": sum(self.gap_s(a, b) for a, b in spans)}
        out["difference_W"] = (out["meter_W"] - out["ours_W"]) if out["ours_W"] is not None and seconds > 0 else None
        if bound_J is not None and ours_J is not None and isinstance(bound_J, (int, float)):
            out["bound_J"] = float(bound_J)
            out["within_bound"] = abs(ours_J - meter) <= bound_J
        else:
            out["bound_J"] = None
            out["within_bound"] = None
        return out


def _epoch_bounds(report: dict | None) -> dict[int, float]:
    """Each epoch's ``bound_J`` from the report's epoch rows (where it holds one)."""
    rows = report.get("epochs") if isinstance(report, dict) else None
    return {row["epoch"]: row["bound_J"] for row in rows or [] if isinstance(row, dict) and
            isinstance(row.get("epoch"), int) and isinstance(row.get("bound_J"), (int, float))}


def _sensors(report: dict | None) -> list[dict]:
    rows = report.get("sensors") if isinstance(report, dict) else None
    return [{k: s.get(k) for k in ("name", "rank", "scope", "provenance", "source")}
            for s in rows or [] if isinstance(s, dict)]


def _subtract(spans: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` without ``holes`` (lists of (start, end), any order); the pieces in time order."""
    out = []
    for a, b in sorted(spans):
        pieces = [(a, b)]
        for h0, h1 in holes:
            pieces = [p for x0, x1 in pieces for p in ((x0, min(x1, h0)), (max(x0, h1), x1)) if p[1] > p[0]]
        out += pieces
    return sorted(out)


def _clip(spans: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The parts of ``spans`` inside ``window``."""
    cut = [(max(a, window[0]), min(b, window[1])) for a, b in spans]
    return [(a, b) for a, b in cut if b > a]


def _phases(run, compare: _Comparer, meter_t: np.ndarray, covered: tuple[float, float]) -> list[dict]:
    """Training (the epochs less validation), validation, the rest of the fit, and the meter alone before
    and after the fit."""
    fit = [covered]
    epochs = [(e.start_s, e.end_s) for e in run.epochs()]
    validation, opened = [], None
    for event in run.events:
        if event["event"] == "validation_start":
            opened = event["time_s"]
        elif event["event"] == "validation_end" and opened is not None:
            validation.append((opened, event["time_s"]))
            opened = None
    validation, epochs = _clip(validation, covered), _clip(epochs, covered)
    phases = [("training", _subtract(epochs, validation)), ("validation", validation),
              ("rest of the fit", _subtract(fit, epochs + validation))]
    out = [{"phase": name, **compare.windows(spans)} for name, spans in phases if spans]
    for name, span in (("before the fit (meter only)", (meter_t[0], run.start_s)),
                       ("after the fit (meter only)", (run.end_s, meter_t[-1]))):
        if span[1] - span[0] > 0 and compare.readings(*span) >= 2:
            ours = compare.ours_covers(*span)
            out.append({"phase": name.replace(" (meter only)", "") if ours else name,
                        **compare.windows([span], ours=ours)})
    return out


def _mlperf(compare: _Comparer, meter_t: np.ndarray, gaps, fit_start: float, fit_end: float,
            covered: tuple[float, float]) -> dict:
    """MLPerf Training's power rules checked over the fit (see the module docstring)."""
    inside = int(np.count_nonzero((meter_t >= fit_start) & (meter_t <= fit_end)))
    first = max(int(np.searchsorted(meter_t, fit_start, side="right")) - 1, 0)
    last = min(int(np.searchsorted(meter_t, fit_end, side="left")), len(meter_t) - 1)
    steps = np.diff(meter_t[first:last + 1])
    longest = float(steps.max()) if len(steps) else math.nan
    median = float(np.median(steps)) if len(steps) else math.nan
    slow = steps > MLPERF_MAX_INTERVAL_S * (1 + RATE_TOLERANCE)
    covers = bool(meter_t[0] <= fit_start and meter_t[-1] >= fit_end)
    checks = [
        {"rule": "at least one reading per second over the fit",
         "passed": bool(len(steps)) and not bool(slow.any()),
         "detail": f"median interval {median:.3f} s, longest {longest:.3f} s"
                   + (f"; {int(slow.sum())} interval(s) over {MLPERF_MAX_INTERVAL_S:g} s "
                      f"({float(steps[slow].sum()):.1f} s)" if slow.any() else "")},
        {"rule": f"at least {MLPERF_MIN_READINGS} readings over the fit",
         "passed": inside >= MLPERF_MIN_READINGS,
         "detail": f"{inside} reading(s)" + ("" if inside >= MLPERF_MIN_READINGS else
                                              ": MLPerf suggests running longer (same code path) until there are")},
        {"rule": "the log starts before the fit and ends after it", "passed": covers,
         "detail": f"log from {meter_t[0] - fit_start:+.1f} s to {meter_t[-1] - fit_start:+.1f} s of the fit's start "
                   f"(the fit ends at {fit_end - fit_start:.1f} s)"},
    ]
    windows, accuracy = _olympic(compare, covered)
    checks.append(accuracy)
    return {"checks": checks, "windows": windows, "readings_in_fit": inside, "longest_interval_s": longest,
            "passed": all(c["passed"] for c in checks if c["passed"] is not None)}


def _olympic(compare: _Comparer, covered: tuple[float, float]) -> tuple[list[dict], dict]:
    """Five one-minute windows spread over the covered fit, and MLPerf's accuracy check on their Olympic
    scores (the middle three of five, each meter's five sorted on their own)."""
    rule = (f"{MLPERF_ACCURACY_PCT:g} % accuracy: Olympic scores of {MLPERF_WINDOWS} one-minute windows "
            "within 5 % of each other")
    whole = int((covered[1] - covered[0]) // MLPERF_WINDOW_S)
    if whole < MLPERF_WINDOWS:
        return [], {"rule": rule, "passed": None,
                    "detail": f"not tested: the fit holds {whole} whole minute(s) the log covers; "
                              f"{MLPERF_WINDOWS} are needed"}
    picks = sorted({int(round(i)) for i in np.linspace(0, whole - 1, MLPERF_WINDOWS)})
    windows = [compare.window(covered[0] + i * MLPERF_WINDOW_S, covered[0] + (i + 1) * MLPERF_WINDOW_S)
               for i in picks]
    ours = sorted(w["ours_J"] for w in windows)[1:-1]
    meter = sorted(w["meter_J"] for w in windows)[1:-1]
    ours_score, meter_score = sum(ours) / len(ours), sum(meter) / len(meter)
    error = 100 * (ours_score - meter_score) / meter_score if meter_score > 0 else math.nan
    return windows, {"rule": rule, "passed": bool(abs(error) <= MLPERF_ACCURACY_PCT), "error_pct": error,
                     "ours_J": ours_score, "meter_J": meter_score,
                     "detail": f"Olympic scores: ours {ours_score:.1f} J, meter {meter_score:.1f} J per minute, "
                               f"error {error:+.2f} %; MLPerf asks for this under idle and two loads (one run is one)"}
