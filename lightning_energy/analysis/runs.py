"""A finished run read back from the files EnergyCallback left in its log dir.

``energy_trace.csv`` gives, per sensor, the cumulative energy (J; blank cells between counter updates
are filled by linear interpolation) and the power (W); ``energy_events.csv`` gives the fit and epoch
boundaries. The attributes used to group runs (``compare --by``, ``fit --by``) come from, later ones
overriding earlier ones: what ``energy_report.json`` says about the fit (``world_size``, ``host``,
``estimated``, ``sampling_interval_s``, ``epochs``, ``steps``, ``sensors``, and ``precision``,
``batch_size``, ``power_limit_W`` ... where the report has them), LightningCLI's ``config.yaml`` (e.g.
``data.batch_size``, ``model.lr``, ``trainer.max_epochs``), Lightning's ``hparams.yaml`` (both: scalar
values, nested mappings flattened as ``outer.inner``, read by :func:`read_yaml_mapping`, which tolerates
python tags without executing them; a dotted name also answers to its last part where that is
unambiguous: ``batch_size``) and ``run_attributes.json`` (written by CatalogCallback and by
``lightning-energy sweep``). Traces of other ranks (``energy_trace_rank<N>.csv``)
are added onto rank 0's time axis through their unix timestamps.

Where the events carry the meter's cumulative energy at the fit's start and end (traces since the
provenance change), those points are added to the trace (:func:`_with_mark_points`), so that the fit's
total read back here is the meter's, as in ``energy_report.json``. The run's provenance (measured /
estimated / simulated) comes from ``energy_report.json`` (``"unknown"`` without it).

The fit's boundaries come from the events and may lie a little outside the samples (the sampler's
first sample follows the ``fit_start`` mark by a fraction of a millisecond): up to
``EDGE_TOLERANCE_INTERVALS`` sampling intervals are covered by continuing the nearest sample's power
(:meth:`Run.covering_samples`, the same rule as :meth:`Run.energy_between`); a fit window further
outside the samples is an error (a truncated trace, or events of another run).
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lightning_energy.catalog import RUN_ATTRIBUTES_FILE
from lightning_energy.provenance import UNKNOWN, of_report
from lightning_energy.outputs.report import REPORT_FILE
from lightning_energy.outputs.trace import EVENTS_FILE, TRACE_FILE

HPARAMS_FILE = "hparams.yaml"
CLI_CONFIG_FILE = "config.yaml"  # LightningCLI's SaveConfigCallback: the whole parsed config, in the log dir
EDGE_TOLERANCE_INTERVALS = 2.0  # fit boundaries this many sampling intervals outside the samples are covered
# scalar keys of energy_report.json taken as attributes where present (the report may not hold them all)
REPORT_ATTRIBUTES = ("precision", "batch_size", "power_limit_W", "world_size", "host", "estimated", "model",
                     "parameters", "accelerator", "num_devices")


class RunError(ValueError):
    """A run dir that cannot be analysed: missing or malformed files."""


@dataclass
class EpochRow:
    """One epoch from the events: the whole epoch window and its validation part (J, s, W)."""

    epoch: int
    start_s: float
    end_s: float
    energy_J: float
    validation_J: float
    validation_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def mean_power_W(self) -> float:
        return self.energy_J / self.duration_s if self.duration_s > 0 else math.nan

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "start_s": self.start_s, "end_s": self.end_s, "duration_s": self.duration_s,
                "energy_J": self.energy_J, "train_J": self.energy_J - self.validation_J,
                "validation_J": self.validation_J, "validation_s": self.validation_s,
                "mean_power_W": self.mean_power_W, "edp_Js": self.energy_J * self.duration_s}


@dataclass
class Run:
    """One run: time axis (s from the trace start), total power (W) and cumulative energy (J)."""

    name: str
    path: Path
    time_s: np.ndarray
    power_W: np.ndarray
    energy_J: np.ndarray  # cumulative from 0 at the first sample
    sensor_energy_J: dict[str, np.ndarray]  # cumulative per sensor (rank suffix for other ranks)
    sensor_power_W: dict[str, np.ndarray]
    events: list[dict]
    attributes: dict = field(default_factory=dict)
    # where the joules come from (lightning_energy.provenance), from energy_report.json's sensors;
    # "unknown" for a run without a report (a crashed fit)
    provenance: str = UNKNOWN
    notes: list[str] = field(default_factory=list)  # what was left out while reading (a row cut mid-line)

    @property
    def start_s(self) -> float:
        return self._event_time("fit_start", first=True, default=float(self.time_s[0]))

    @property
    def end_s(self) -> float:
        return self._event_time("fit_end", first=False, default=float(self.time_s[-1]))

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def total_J(self) -> float:
        return self.energy_between(self.start_s, self.end_s)

    @property
    def edp_Js(self) -> float:
        return self.total_J * self.duration_s

    def energy_between(self, start_s: float, end_s: float, sensor: str | None = None) -> float:
        """Energy (J) between two times on the trace's axis, by linear interpolation of the cumulative energy.

        Outside the samples (a fit boundary the sampler resolved by extrapolation, as the meter does when
        samples are late) the sensor's first or last power is continued.
        """
        names = list(self.sensor_energy_J) if sensor is None else [sensor]
        return float(sum(self._cumulative(n, end_s) - self._cumulative(n, start_s) for n in names))

    def _cumulative(self, name: str, t: float) -> float:
        curve, power, times = self.sensor_energy_J[name], self.sensor_power_W[name], self.time_s
        if t > times[-1]:
            return float(curve[-1] + power[-1] * (t - times[-1]))
        if t < times[0]:
            return float(curve[0] - power[0] * (times[0] - t))
        return float(np.interp(t, times, curve))

    def cumulative_J(self, t: float) -> float:
        """Total cumulative energy (J) at time ``t`` (s), continued past the samples as :meth:`energy_between`."""
        return float(sum(self._cumulative(name, t) for name in self.sensor_energy_J))

    @property
    def sample_interval_s(self) -> float:
        """The median time between samples (s)."""
        return float(np.median(np.diff(self.time_s)))

    def covering_samples(self, start_s: float, end_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(time s, total power W, cumulative energy J) with points added at ``start_s`` / ``end_s`` if outside.

        An added point continues the nearest sample's power (its energy as in :meth:`energy_between`), so
        curves resampled from these samples end at the run's total. :class:`RunError` when a boundary is
        more than ``EDGE_TOLERANCE_INTERVALS`` sampling intervals outside the samples.
        """
        t, power, energy = self.time_s, self.power_W, self.energy_J
        self.check_coverage(start_s, end_s)
        before_s, after_s = t[0] - start_s, end_s - t[-1]
        if before_s > 0:
            t, power = np.concatenate(([start_s], t)), np.concatenate(([power[0]], power))
            energy = np.concatenate(([self.cumulative_J(start_s)], energy))
        if after_s > 0:
            t, power = np.concatenate((t, [end_s])), np.concatenate((power, [power[-1]]))
            energy = np.concatenate((energy, [self.cumulative_J(end_s)]))
        return t, power, energy

    def check_coverage(self, start_s: float | None = None, end_s: float | None = None) -> None:
        """:class:`RunError` saying what is missing when the samples do not cover ``[start_s, end_s]`` (the fit,
        by default) up to ``EDGE_TOLERANCE_INTERVALS`` sampling intervals at either end.

        Every command (``report``, ``compare``, ``fit``) loads runs through this check, so none of them
        extrapolates over a truncated trace that another refuses.
        """
        start_s = self.start_s if start_s is None else start_s
        end_s = self.end_s if end_s is None else end_s
        t = self.time_s
        allowed_s = EDGE_TOLERANCE_INTERVALS * self.sample_interval_s
        before_s, after_s = t[0] - start_s, end_s - t[-1]
        if end_s >= start_s and before_s <= allowed_s and after_s <= allowed_s:
            return
        span = end_s - start_s
        missing = []
        if before_s > allowed_s:
            missing.append(f"the first {before_s:.4g} s")
        if after_s > allowed_s:
            missing.append(f"the last {after_s:.4g} s")
        share = (max(before_s, 0.0) + max(after_s, 0.0)) / span if span > 0 else math.nan
        what = (f"{' and '.join(missing)} of the fit ({100 * share:.0f} % of its {span:.4g} s) have no samples"
                if missing and span > 0 else "the fit's end lies before its start")
        cut = f" ({'; '.join(self.notes)})" if self.notes else ""
        raise RunError(
            f"run {self.name}: the trace covers [{t[0]:.6f}, {t[-1]:.6f}] s but the fit ran over [{start_s:.6f}, "
            f"{end_s:.6f}] s: {what}{cut}; at most {EDGE_TOLERANCE_INTERVALS:g} sampling intervals "
            f"({allowed_s:.4g} s) are continued. Is the trace truncated, or the events file another run's?")

    @property
    def extrapolated_s(self) -> float:
        """Seconds of the fit (before the first or after the last sample) covered by extrapolation."""
        return max(self.time_s[0] - self.start_s, 0.0) + max(self.end_s - self.time_s[-1], 0.0)

    def sensor_totals_J(self) -> dict[str, float]:
        return {name: self.energy_between(self.start_s, self.end_s, name) for name in self.sensor_energy_J}

    def epochs(self) -> list[EpochRow]:
        """Epochs with both a start and an end event, in order."""
        starts = {e["epoch"]: e["time_s"] for e in self.events if e["event"] == "epoch_start"}
        rows = []
        for event in self.events:
            if event["event"] != "epoch_end" or event["epoch"] not in starts:
                continue
            epoch, start, end = event["epoch"], starts[event["epoch"]], event["time_s"]
            val_J = val_s = 0.0
            open_at = None
            for e in self.events:
                if e["event"] == "validation_start" and start <= e["time_s"] <= end:
                    open_at = e["time_s"]
                elif e["event"] == "validation_end" and open_at is not None and e["time_s"] <= end:
                    val_J += self.energy_between(open_at, e["time_s"])
                    val_s += e["time_s"] - open_at
                    open_at = None
            rows.append(EpochRow(epoch, start, end, self.energy_between(start, end), val_J, val_s))
        return rows

    def _event_time(self, name: str, first: bool, default: float) -> float:
        times = [e["time_s"] for e in self.events if e["event"] == name]
        return (times[0] if first else times[-1]) if times else default


def load_run(run_dir: str | Path) -> Run:
    """Read a run dir (the log dir of a fit with EnergyCallback); :class:`RunError` names what is wrong."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunError(f"run dir {path} does not exist or is not a directory")
    trace_path = path / TRACE_FILE
    if not trace_path.exists():
        raise RunError(f"no {TRACE_FILE} in {path} (is it the log dir of a fit with EnergyCallback?)")
    notes: list[str] = []
    time_s, sensors, powers, unix_s = _read_one_trace(trace_path, notes)
    events = _read_events(path / EVENTS_FILE)
    time_s, sensors, powers, unix_s = _with_mark_points(time_s, sensors, powers, unix_s, events)
    sensors = {name: cumulative - cumulative[0] for name, cumulative in sensors.items()}
    for extra in sorted(path.glob("energy_trace_rank*.csv")):
        rank = extra.stem.rsplit("_rank", 1)[1]
        _, s_r, p_r, u_r = _read_one_trace(extra, notes)
        for name in s_r:
            sensors[f"{name}@rank{rank}"] = np.interp(unix_s, u_r, s_r[name] - s_r[name][0])
            powers[f"{name}@rank{rank}"] = np.interp(unix_s, u_r, p_r[name], left=0.0, right=0.0)
    energy_J = np.sum(list(sensors.values()), axis=0)
    power_W = np.sum(list(powers.values()), axis=0)
    run = Run(_run_name(path), path, time_s, power_W, energy_J, sensors, powers, events, _read_attributes(path),
              provenance=_read_provenance(path), notes=notes)
    run.check_coverage()
    return run


def report_attributes(report: dict) -> dict:
    """Attributes of a fit from its ``energy_report.json``: the fields it has that describe the run."""
    out = {k: report[k] for k in REPORT_ATTRIBUTES if _scalar(report.get(k))}
    sampling = report.get("sampling")
    if isinstance(sampling, dict) and _scalar(sampling.get("interval_s")):
        out["sampling_interval_s"] = sampling["interval_s"]
    epochs = report.get("epochs")
    if isinstance(epochs, list) and all(isinstance(e, dict) for e in epochs):
        out["epochs"] = len(epochs)
        steps = [e.get("steps") for e in epochs]
        if epochs and all(isinstance(n, int) and not isinstance(n, bool) for n in steps):
            out["steps"] = sum(steps)
    sensors = report.get("sensors")
    if isinstance(sensors, list) and sensors and all(isinstance(s, dict) and "name" in s for s in sensors):
        out["sensors"] = ",".join(sorted({str(s["name"]) for s in sensors}))
    return out


def _scalar(value) -> bool:
    return isinstance(value, (int, float, str, bool)) and not (isinstance(value, float) and not math.isfinite(value))


def _flatten(mapping: dict, prefix: str = "") -> dict:
    """Scalar values of a nested mapping, nested keys joined with dots."""
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif _scalar(value):
            out[f"{prefix}{key}"] = value
    return out


def _read_trace_columns(path: Path) -> tuple[dict[str, list[float]], list[str]]:
    """Columns of a trace CSV by name (first copy of a name written twice; blank cells NaN) and notes.

    A file that does not end with a line break was cut mid-line (the writer ends every row): its last,
    incomplete row is left out and a note says so. Any other row with the wrong number of cells, a cell
    that is not a number, bytes that are not UTF-8 or a NUL byte is a :class:`RunError` naming the line.
    """
    notes = []
    with open(path, "rb") as raw:
        raw.seek(0, os.SEEK_END)
        size = raw.tell()
        if size:
            raw.seek(-1, os.SEEK_END)
        cut = size > 0 and raw.read(1) not in (b"\n", b"\r")
    line = 1
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = csv.reader(fh)
            header = next(rows)
            first = {name: header.index(name) for name in header}
            cells: list[list[float]] = [[] for _ in header]
            pending = None
            for line, row in enumerate(rows, start=2):
                if pending is not None:
                    _append_row(pending, header, cells, path, line - 1)
                pending = row
            if pending is not None:
                if cut:
                    notes.append(f"{path.name} was cut in the middle of line {line}; that incomplete row is left out")
                else:
                    _append_row(pending, header, cells, path, line)
    except StopIteration:
        raise RunError(f"{path} is empty") from None
    except UnicodeDecodeError as err:
        raise RunError(f"{path} is not a lightning-energy trace: bytes that are not UTF-8 near line {line + 1} "
                       f"({err.reason})") from None
    except csv.Error as err:
        raise RunError(f"{path} is not a lightning-energy trace: line {line + 1}: {err}") from None
    return {name: cells[index] for name, index in first.items()}, notes


def _append_row(row: list[str], header: list[str], cells: list[list[float]], path: Path, line: int) -> None:
    if len(row) != len(header):
        raise RunError(f"{path} is not a lightning-energy trace: line {line} has {len(row)} cells, the header "
                       f"{len(header)}")
    try:
        for column, cell in zip(cells, row):
            column.append(float(cell) if cell else math.nan)
    except ValueError as err:
        raise RunError(f"{path} is not a lightning-energy trace: line {line}: {err}") from None


def _read_one_trace(path: Path, notes: list[str] | None = None
                    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    """(time s, cumulative J per sensor as written, power W per sensor, unix time s) of one trace file;
    notes appended."""
    try:
        columns, found = _read_trace_columns(path)
    except OSError as err:
        raise RunError(f"cannot read {path}: {err.strerror or err}") from None
    if notes is not None:
        notes.extend(found)
    if "time_s" not in columns or "unix_time_s" not in columns:
        raise RunError(f"{path} is not a lightning-energy trace: no time_s / unix_time_s columns")
    names = [c[: -len(":energy_J")] for c in columns if c.endswith(":energy_J")]
    if not names:
        raise RunError(f"{path} has no <sensor>:energy_J column")
    time_s = np.asarray(columns["time_s"], dtype=float)
    if len(time_s) < 2 or not np.all(np.isfinite(time_s)) or np.any(np.diff(time_s) < 0):
        raise RunError(f"{path} needs at least 2 samples with increasing time_s")
    sensors, powers = {}, {}
    for name in names:
        raw = np.asarray(columns[f"{name}:energy_J"], dtype=float)
        valid = np.isfinite(raw)
        if not valid.any():
            continue
        _check_never_decreases(path, name, raw, valid)
        sensors[name] = np.interp(time_s, time_s[valid], raw[valid])
        watts = np.asarray(columns.get(f"{name}:power_W", [math.nan] * len(time_s)), dtype=float)
        _drop_first_reading_power(watts)
        read = np.isfinite(watts)  # blank where the sensor was not read at that tick: between its readings
        powers[name] = np.interp(time_s, time_s[read], watts[read]) if read.any() else np.zeros_like(time_s)
    if not sensors:
        raise RunError(f"{path} has no energy readings")
    return time_s, sensors, powers, np.asarray(columns["unix_time_s"], dtype=float)


def _drop_first_reading_power(watts: np.ndarray) -> None:
    """Blank (NaN, in place) a sensor's first power reading when it is 0 W and a later reading follows: the
    sampler writes 0 W at a counter's first read, which has no interval before it to average over, so that
    0 is no power the sensor saw (drawn, it is a false drop to 0 W at fit start). The next reading's power
    then stands for it."""
    read = np.flatnonzero(np.isfinite(watts))
    if len(read) > 1 and watts[read[0]] == 0.0:
        watts[read[0]] = math.nan


def _check_never_decreases(path: Path, sensor: str, energy_J: np.ndarray, valid: np.ndarray) -> None:
    """:class:`RunError` naming the sensor and the line where its cumulative energy (J) runs backwards.

    The writer's cumulative energy never decreases (and its 10 significant digits keep that order), so a
    decrease is damage; read on, the fit's total would come out negative, or 0 J where the meter's marks
    raise the curve to its earlier maximum. ``valid``: the rows holding a reading (blank cells skipped).
    """
    rows = np.flatnonzero(valid)
    readings = energy_J[rows]
    backwards = np.flatnonzero(np.diff(readings) < 0)
    if backwards.size:
        first = int(backwards[0])
        line = int(rows[first + 1]) + 2  # data rows start on line 2, after the header
        raise RunError(f"{path} is not a lightning-energy trace: sensor {sensor}'s cumulative energy runs "
                       f"backwards on line {line} (from {readings[first]:.10g} J to {readings[first + 1]:.10g} J; "
                       f"{backwards.size} such step(s)); cumulative energy never decreases")


def _with_mark_points(time_s: np.ndarray, sensors: dict[str, np.ndarray], powers: dict[str, np.ndarray],
                      unix_s: np.ndarray, events: list[dict]):
    """The trace with the meter's cumulative energy at the events that carry it (the fit's start and end)
    added as points, so that a window between them is the meter's own figure.

    Between two samples the meter puts a change of power at the mark (the work changed there), where linear
    interpolation of the samples would spread it over the interval: on a 50 ms CPU estimate that was 6 % of
    a one-second fit. Points outside the samples are left out; other sensors and the power are interpolated
    at the added times; a counter's row read after its update may then lie below the point before it, and
    is raised to it (cumulative energy never decreases).
    """
    marks = [(e["time_s"], e["energy"]) for e in events
             if e.get("energy") and time_s[0] <= e["time_s"] <= time_s[-1]]
    if not marks:
        return time_s, sensors, powers, unix_s
    new_t = np.union1d(time_s, [t for t, _ in marks])
    at = {t: int(np.searchsorted(new_t, t)) for t, _ in marks}
    out = {}
    for name, cumulative in sensors.items():
        curve = np.interp(new_t, time_s, cumulative)
        for t, energy in marks:
            if energy.get(name) is not None:
                curve[at[t]] = energy[name]
        out[name] = np.maximum.accumulate(curve)
    return (new_t, out, {n: np.interp(new_t, time_s, p) for n, p in powers.items()},
            np.interp(new_t, time_s, unix_s))


def _read_events(path: Path) -> list[dict]:
    """Events in file order: time (s, trace axis), name, epoch and, where written, the meter's cumulative J
    per sensor at the event (``energy``)."""
    if not path.exists():
        return []
    events = []
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                energy = {column[: -len(":energy_J")]: float(value) for column, value in row.items()
                          if column and column.endswith(":energy_J") and value not in ("", None)}
                events.append({"time_s": float(row["time_s"]), "event": row["event"],
                               "epoch": int(row["epoch"]) if row.get("epoch") else None,
                               **({"energy": energy} if energy else {})})
    except (KeyError, ValueError, TypeError, csv.Error) as err:
        raise RunError(f"{path} is not a lightning-energy events file ({type(err).__name__}: {err})") from None
    except OSError as err:
        raise RunError(f"cannot read {path}: {err.strerror or err}") from None
    return events


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; a RunError naming the file when it cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise RunError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise RunError(f"cannot read {path}: {err.strerror or err}") from None


def _read_json(path: Path):
    """The JSON value in ``path``; a RunError naming the file when it is not valid JSON."""
    try:
        return json.loads(_read_text(path))
    except (json.JSONDecodeError, RecursionError) as err:
        raise RunError(f"{path} is not valid JSON ({err})") from None


def _read_provenance(path: Path) -> str:
    """The provenance of the run's joules from its energy_report.json (``"unknown"`` without one)."""
    report = path / REPORT_FILE
    loaded = _read_json(report) if report.exists() else None
    return of_report(loaded) if isinstance(loaded, dict) else UNKNOWN


def read_yaml_mapping(path: Path) -> dict:
    """The mapping in a YAML file, read without executing anything; {} when it is not a mapping or not YAML.

    Lightning writes python tags into ``hparams.yaml`` (``!!python/tuple`` for a tuple hparam): a tuple is
    read as a list, any other ``python/...`` or application tag as None (left out of the attributes), so one
    such value no longer hides every other hparam, and no constructor named by the file is ever called.
    """
    import yaml

    class TolerantLoader(yaml.SafeLoader):
        pass

    def python_tag(loader, suffix, node):
        if suffix == "tuple" and isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        return None

    def unknown_tag(loader, suffix, node):
        return None

    TolerantLoader.add_multi_constructor("tag:yaml.org,2002:python/", python_tag)
    TolerantLoader.add_multi_constructor("!", unknown_tag)
    try:
        loaded = yaml.load(_read_text(path), Loader=TolerantLoader)  # noqa: S506 (a SafeLoader subclass)
    except (yaml.YAMLError, RecursionError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def with_short_names(attributes: dict) -> dict:
    """``attributes`` plus, for each dotted key (``data.batch_size`` from LightningCLI's ``config.yaml``), its
    last part (``batch_size``) where no attribute has that name already and every dotted key ending in it
    agrees on the value (``--by batch_size`` then works on baler-lit runs; an ambiguous name is left out)."""
    by_leaf: dict[str, set] = {}
    for key, value in attributes.items():
        if "." in key:
            by_leaf.setdefault(key.rsplit(".", 1)[1], set()).add(repr(value))
    out = dict(attributes)
    for key, value in attributes.items():
        leaf = key.rsplit(".", 1)[-1]
        if "." in key and leaf not in attributes and len(by_leaf[leaf]) == 1:
            out[leaf] = value
    return out


def _read_attributes(path: Path) -> dict:
    """Attributes of the run in ``path``: report < ``config.yaml`` < ``hparams.yaml`` < ``run_attributes.json``."""
    attributes: dict = {}
    report = path / REPORT_FILE
    if report.exists():
        loaded = _read_json(report)
        if isinstance(loaded, dict):
            attributes.update(report_attributes(loaded))
    for name in (CLI_CONFIG_FILE, HPARAMS_FILE):
        if (path / name).exists():
            attributes.update(_flatten(read_yaml_mapping(path / name)))
    attributes = with_short_names(attributes)
    attributes_file = path / RUN_ATTRIBUTES_FILE
    if attributes_file.exists():
        loaded = _read_json(attributes_file)
        if not isinstance(loaded, dict):
            raise RunError(f"{attributes_file} must hold a JSON object")
        attributes.update(loaded)
    return attributes


def _run_name(path: Path) -> str:
    path = path.resolve()
    return f"{path.parent.name}/{path.name}" if path.name.startswith("version_") else path.name


def load_runs(run_dirs: list) -> list[Run]:
    """Several runs; where two names coincide, each of those is named by the fewest trailing folders of its path
    that tell it apart (``a/lightning_logs/version_0``, ``b/lightning_logs/version_0``), never the whole path
    unless nothing shorter differs."""
    runs = [load_run(d) for d in run_dirs]
    names = [r.name for r in runs]
    clashing = [run for run in runs if names.count(run.name) > 1]
    for run, name in zip(clashing, distinguishing_names([run.path.resolve() for run in clashing])):
        run.name = name
    return runs


def distinguishing_names(paths: list[Path]) -> list[str]:
    """For each path, its shortest tail of folders (``parent/name``, ``grandparent/parent/name`` ...) that no
    other path of the list ends with; a path that is another's tail in full keeps its whole form."""
    parts = [p.parts for p in paths]
    names = []
    for index, own in enumerate(parts):
        others = [other for i, other in enumerate(parts) if i != index]
        for length in range(1, len(own) + 1):
            tail = own[-length:]
            if all(other[-length:] != tail for other in others):
                break
        names.append(str(Path(*tail)) if len(tail) < len(own) else str(Path(*own)))
    return names


ATTRIBUTE_SOURCES = (f"attributes come from {REPORT_FILE}, {CLI_CONFIG_FILE} (LightningCLI), {HPARAMS_FILE} and "
                     f"{RUN_ATTRIBUTES_FILE} in the run dir; dotted names also answer to their last part")


def attribute(run: Run, name: str):
    """A run attribute; :class:`RunError` listing the attributes the run has if it lacks this one."""
    if name not in run.attributes:
        known = ", ".join(sorted(run.attributes)) or "none"
        raise RunError(f"run {run.name} has no attribute {name!r} (it has: {known}); {ATTRIBUTE_SOURCES}")
    return run.attributes[name]


def require_attribute(runs: list[Run], name: str) -> list:
    """The attribute ``name`` of every run; :class:`RunError` naming the runs without it and what all runs have."""
    if len(runs) == 1:
        return [attribute(runs[0], name)]
    missing = [run.name for run in runs if name not in run.attributes]
    if missing:
        shared = set.intersection(*(set(run.attributes) for run in runs))
        raise RunError(f"run(s) {', '.join(missing)} have no attribute {name!r}; attributes every run has: "
                       f"{', '.join(sorted(shared)) or 'none'}; {ATTRIBUTE_SOURCES}")
    return [run.attributes[name] for run in runs]
