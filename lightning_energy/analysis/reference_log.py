"""A power meter's log, read for ``lightning-energy validate``: a wall plug, PDU, PSU or SPEC PTDaemon log.

Two formats:

- **CSV** (comma, semicolon or tab separated; ``#`` lines are comments; a header row or none): one time
  column and one value column. The value is a power reading (W, kW, mW) or a cumulative energy counter
  (J, kJ, MJ, Wh, kWh, mWh). Its unit comes from the column's name (``power_W``, ``Power (kW)``,
  ``watts``, ``energy_kWh``, ``joules``) or from ``unit``; a column whose name says neither is refused
  with a line asking for ``--unit``. Without ``columns`` the time column is the first whose name says
  time (``time``, ``timestamp``, ``date``, ``t``, ...) and the value column the first whose name states
  a power unit, else an energy unit. ``columns=(TIME, VALUE)``: header names (any case) or 1-based column
  numbers; in a file without a header, names name its first columns in order (``time,kW``).
- **PTDaemon** (SPEC's Power and Temperature Daemon, which MLPerf Power runs; the format MLCommons'
  ``power-dev`` parses: ``Time,MM-DD-YYYY HH:MM:SS.fff,Watts,W,Volts,V,Amps,A,PF,pf,Mark,name``): found
  by its first line; the ``Watts`` field is read. PTDaemon marks a reading that failed with a negative
  value: such rows are dropped (a gap). MLPerf's power server runs PTDaemon with ``TZ=UTC``: its times are
  read as UTC.

Times: numbers are seconds, Unix time (wall clock) from 1e8 up, milliseconds from 1e11 up or where the
column's name says ``ms``, else seconds since the log's own start (a relative clock, aligned only by
``--offset`` or the cross-correlation); text is ISO 8601 (``2024-05-01T12:00:00.5+02:00``; no zone = UTC)
or PTDaemon's ``MM-DD-YYYY HH:MM:SS.fff`` (UTC).

The file is a trust boundary: at most ``MAX_REFERENCE_BYTES`` and ``MAX_REFERENCE_ROWS`` data rows, lines
of at most ``MAX_LINE_CHARS``, UTF-8; times must increase from row to row; a value must be a finite
number (a blank or ``nan`` cell is a row without a reading: dropped, counted, and the interval it leaves
is a gap); a negative power (outside PTDaemon's failed readings) or a counter that runs backwards (a
reset) is refused. Every refusal is a :class:`MeterLogError` naming the line.
"""

from __future__ import annotations

import calendar
import csv
import math
import os
import re
from array import array
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

MAX_REFERENCE_BYTES = 256 * 1024 ** 2  # 256 MiB: ~5 million rows of a 50-byte CSV line
MAX_REFERENCE_ROWS = 5_000_000  # 58 days at 1 Hz, 5.8 days at 10 Hz; 80 MB of float64 for time and value
MAX_LINE_CHARS = 4096
MIN_ROWS = 2

#: unit -> factor to SI (W for power, J for energy)
POWER_UNITS = {"W": 1.0, "kW": 1e3, "mW": 1e-3}
ENERGY_UNITS = {"J": 1.0, "kJ": 1e3, "MJ": 1e6, "Wh": 3600.0, "kWh": 3.6e6, "mWh": 3.6}
UNITS = {**POWER_UNITS, **ENERGY_UNITS}
UNIT_CHOICES = "W, kW or mW for power; J, kJ, MJ, Wh, kWh or mWh for an energy counter"

UNIX_FROM_S = 1e8  # a number of seconds from here up is Unix time (1973-03-03 on), below: a relative clock
UNIX_MS_FROM = 1e11  # a number from here up is Unix time in milliseconds (1973 on; as seconds: year 5138)

PTD_LINE = re.compile(r"^Time,\d\d-\d\d-\d{4} \d\d:\d\d:\d\d")
PTD_TIME = re.compile(r"^(\d\d)-(\d\d)-(\d{4}) (\d\d):(\d\d):(\d\d(?:\.\d+)?)$")
TIME_NAME = re.compile(r"time|date|^t$|^ts$|^epoch|^unix|^seconds?$|^s$", re.IGNORECASE)
_CASED_UNITS = {"W", "kW", "mW", "J", "kJ", "MJ", "mJ", "Wh", "kWh", "mWh"}
_WORD_UNITS = {"w": "W", "watt": "W", "watts": "W", "kw": "kW", "kilowatt": "kW", "kilowatts": "kW",
               "j": "J", "joule": "J", "joules": "J", "kj": "kJ", "kilojoule": "kJ", "kilojoules": "kJ",
               "wh": "Wh", "kwh": "kWh", "watthour": "Wh", "watthours": "Wh", "kilowatthour": "kWh",
               "kilowatthours": "kWh"}


class MeterLogError(ValueError):
    """A meter log that cannot be used; the message is one line saying what and where."""


@dataclass
class MeterLog:
    """A meter's readings: ``time_s`` (Unix s for a wall clock, else s of the log's own clock) and ``values``
    in SI (W for a power log, cumulative J for an energy counter)."""

    path: Path
    format: str  # "csv" or "ptdaemon"
    kind: str  # "power" or "energy"
    unit: str  # the unit the file's values are in (UNITS)
    time_column: str
    value_column: str
    clock: str  # "wall" (Unix time) or "relative"
    time_s: np.ndarray
    values: np.ndarray
    dropped_rows: int = 0  # rows without a reading (blank, nan, PTDaemon's failed readings)
    first_dropped_line: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def median_interval_s(self) -> float:
        return float(np.median(np.diff(self.time_s)))

    def describe(self) -> dict:
        return {"file": str(self.path), "format": self.format, "kind": self.kind, "unit": self.unit,
                "time_column": self.time_column, "value_column": self.value_column, "clock": self.clock,
                "rows": int(len(self.time_s)), "dropped_rows": self.dropped_rows,
                "median_interval_s": self.median_interval_s, "notes": list(self.notes)}


def unit_of_name(name: str) -> str | None:
    """The unit a column's name states (``power_W`` -> ``W``, ``Energy (kWh)`` -> ``kWh``, ``watts`` -> ``W``,
    ``kilowatt hours`` -> ``kWh``), or None."""
    tokens = [t for t in re.split(r"[^A-Za-z]+", name) if t]
    for token in tokens:
        if token in _CASED_UNITS and token != "mJ":
            return token
    lowered = [t.lower() for t in tokens]
    joined = [a + b.rstrip("s") + "s" for a, b in zip(lowered, lowered[1:]) if b in ("hour", "hours")]
    for word in joined + lowered:
        if word in _WORD_UNITS:
            return _WORD_UNITS[word]
    return None


def _kind_of(unit: str) -> str:
    return "power" if unit in POWER_UNITS else "energy"


def read_meter_log(path: str | os.PathLike, columns: tuple[str, str] | None = None, unit: str | None = None,
                   max_bytes: int | None = None, max_rows: int | None = None) -> MeterLog:
    """The readings of the meter log at ``path`` (see the module docstring); :class:`MeterLogError` otherwise.
    ``max_bytes`` / ``max_rows``: the limits (default ``MAX_REFERENCE_BYTES`` / ``MAX_REFERENCE_ROWS``)."""
    path = Path(path)
    max_bytes = MAX_REFERENCE_BYTES if max_bytes is None else max_bytes
    max_rows = MAX_REFERENCE_ROWS if max_rows is None else max_rows
    if unit is not None and unit not in UNITS:
        raise MeterLogError(f"unknown unit {unit!r}: use {UNIT_CHOICES}")
    try:
        with open(path, "rb") as raw:
            size = os.fstat(raw.fileno()).st_size
            if size > max_bytes:
                raise MeterLogError(f"{path} is {size / 1024 ** 2:.0f} MiB, more than the "
                                    f"{max_bytes / 1024 ** 2:.0f} MiB "
                                    f"a meter log may be here: cut it to the run (with a margin) first")
            if not os.path.isfile(path):
                raise MeterLogError(f"{path} is not a regular file")
        with open(path, encoding="utf-8-sig", newline="") as fh:
            return _Reader(path, fh, columns, unit, max_rows).read()
    except UnicodeDecodeError as err:
        raise MeterLogError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except IsADirectoryError:
        raise MeterLogError(f"{path} is a directory, not a meter log") from None
    except OSError as err:
        raise MeterLogError(f"cannot read meter log {path}: {err.strerror or err}") from None


class _Reader:
    """One pass over the file: lines bounded, the format found, rows parsed into two float arrays."""

    def __init__(self, path: Path, fh, columns, unit, max_rows: int) -> None:
        self.path, self.fh, self.columns, self.unit, self.max_rows = path, fh, columns, unit, max_rows
        self.line = 0
        self.rows = 0  # data rows seen, with or without a reading

    def lines(self):
        """The file's lines without their ends, numbered in ``self.line``; blank and ``#`` lines skipped."""
        for text in self.fh:
            self.line += 1
            if len(text) > MAX_LINE_CHARS:
                raise MeterLogError(f"{self.path} line {self.line} is longer than {MAX_LINE_CHARS} characters: "
                                    "not a meter log")
            if "\0" in text:
                raise MeterLogError(f"{self.path} line {self.line} holds a NUL byte: not a text meter log")
            text = text.rstrip("\r\n")
            if text.strip() and not text.lstrip().startswith("#"):
                yield text

    def fail(self, what: str) -> MeterLogError:
        return MeterLogError(f"{self.path} line {self.line}: {what}")

    def read(self) -> MeterLog:
        lines = self.lines()
        first = next(lines, None)
        if first is None:
            raise MeterLogError(f"{self.path} holds no readings (empty, or only comments)")
        if PTD_LINE.match(first):
            if self.columns is not None or self.unit is not None:
                raise MeterLogError(f"{self.path} is a PTDaemon log: its Watts field is read, --columns and --unit "
                                    "do not apply to it")
            return self._read_ptdaemon(first, lines)
        return self._read_csv(first, lines)

    # ------------------------------------------------------------------ PTDaemon
    def _read_ptdaemon(self, first: str, lines) -> MeterLog:
        times, values = array("d"), array("d")
        dropped, first_dropped = 0, None
        for text in _chain(first, lines):
            cells = text.split(",")
            fields = dict(zip(cells[0::2], cells[1::2]))
            if "Time" not in fields or "Watts" not in fields:
                raise self.fail("not a PTDaemon line (Time,<time>,Watts,<W>,...): "
                                f"{text[:80]!r}")
            t = self._ptd_time(fields["Time"])
            watts = self._number(fields["Watts"], "Watts")
            if not math.isfinite(watts) or watts < 0:  # PTDaemon writes -1 for a reading that failed
                dropped += 1
                first_dropped = first_dropped or self.line
                self._check_time(times, t)
                continue
            self._append(times, values, t, watts)
        log = MeterLog(self.path, "ptdaemon", "power", "W", "Time", "Watts", "wall", np.array(times, dtype=float),
                       np.array(values, dtype=float), dropped, first_dropped)
        return self._finish(log)

    def _ptd_time(self, cell: str) -> float:
        match = PTD_TIME.match(cell.strip())
        if not match:
            raise self.fail(f"PTDaemon time {cell!r} is not MM-DD-YYYY HH:MM:SS.fff")
        month, day, year, hour, minute = (int(g) for g in match.groups()[:5])
        try:
            datetime(year, month, day, hour, minute)  # the calendar's own check of the fields
        except ValueError as err:
            raise self.fail(f"PTDaemon time {cell!r}: {err}") from None
        return calendar.timegm((year, month, day, hour, minute, 0)) + float(match.group(6))

    # ------------------------------------------------------------------ CSV
    def _read_csv(self, first: str, lines) -> MeterLog:
        delimiter = max(",;\t", key=first.count)
        if first.count(delimiter) == 0:
            raise self.fail("one column only: a meter log needs a time column and a value column, separated by "
                            "commas, semicolons or tabs")
        rows = csv.reader(_chain(first, lines), delimiter=delimiter, skipinitialspace=True)
        try:
            head = next(rows)
            has_header = not all(_looks_like_data(cell) for cell in head)
            names = [cell.strip() for cell in head] if has_header else [str(i + 1) for i in range(len(head))]
            time_index, value_index, names = self._choose_columns(names, has_header)
            if time_index == value_index:
                raise MeterLogError(f"{self.path}: the time and value columns are both {names[time_index]!r}")
            unit = self.unit or unit_of_name(names[value_index])
            if unit is None:
                raise MeterLogError(
                    f"{self.path}: column {names[value_index]!r} does not say its unit: pass --unit ({UNIT_CHOICES})")
            kind = _kind_of(unit)
            time_name = names[time_index]
            parse_time = None
            times, values = array("d"), array("d")
            dropped, first_dropped = 0, None
            for cells in rows if has_header else _chain(head, rows):
                if len(cells) <= max(time_index, value_index):
                    raise self.fail(f"{len(cells)} field(s); the time and value columns are fields "
                                    f"{time_index + 1} and {value_index + 1}")
                if parse_time is None:
                    parse_time = self._time_parser(cells[time_index], time_name)
                t = parse_time(cells[time_index].strip())
                cell = cells[value_index].strip()
                if cell == "" or cell.lower() == "nan":
                    dropped += 1
                    first_dropped = first_dropped or self.line
                    self._check_time(times, t)
                    continue
                value = self._number(cell, names[value_index])
                if not math.isfinite(value):
                    raise self.fail(f"{names[value_index]} is {cell!r}: not a finite number")
                if value < 0:
                    raise self.fail(f"{names[value_index]} is {value:g} {unit}: a meter's "
                                    f"{'power' if kind == 'power' else 'energy counter'} is never negative "
                                    "(a current clamp the wrong way round?)")
                if kind == "energy" and values and value < values[-1] / UNITS[unit] * (1 - 1e-12):
                    raise self.fail(f"the energy counter {names[value_index]} runs backwards (from "
                                    f"{values[-1] / UNITS[unit]:g} to {value:g} {unit}): a reset or a wrap; "
                                    "cut the log there, or use a power column")
                self._append(times, values, t, value * UNITS[unit])
        except csv.Error as err:
            raise self.fail(f"not CSV: {err}") from None
        clock = getattr(parse_time, "clock", "relative")
        log = MeterLog(self.path, "csv", kind, unit, time_name, names[value_index], clock, np.array(times, dtype=float),
                       np.array(values, dtype=float), dropped, first_dropped)
        if getattr(parse_time, "note", None):
            log.notes.append(parse_time.note)
        return self._finish(log)

    def _choose_columns(self, names: list[str], has_header: bool) -> tuple[int, int, list[str]]:
        if self.columns is not None:
            if not has_header and not all(c.isdigit() for c in self.columns):
                # names given to the columns of a file without a header, in order: time first
                names = list(names)
                for i, given in enumerate(self.columns):
                    if given.isdigit():
                        continue
                    names[i] = given
                return (*(self._index(c, names, i) for i, c in enumerate(self.columns)), names)
            return (*(self._index(c, names, None) for c in self.columns), names)
        time_index = next((i for i, n in enumerate(names) if TIME_NAME.search(n)), 0 if not has_header else None)
        if time_index is None:
            raise MeterLogError(f"{self.path}: no column says it holds the time (columns: {', '.join(names)}): "
                                "choose with --columns TIME,VALUE")
        units = {i: unit_of_name(n) for i, n in enumerate(names) if i != time_index}
        if not has_header:
            return time_index, 1 if time_index == 0 else 0, names
        power = [i for i, u in units.items() if u in POWER_UNITS]
        energy = [i for i, u in units.items() if u in ENERGY_UNITS]
        named = [i for i in units if re.search(r"power|watt|energy|joule|consum", names[i], re.IGNORECASE)]
        if self.unit is not None:
            chosen = (power if self.unit in POWER_UNITS else energy) or named
        else:
            chosen = power or energy or named  # a column named power without a unit: refused below, asking for it
        if not chosen:
            raise MeterLogError(f"{self.path}: no column states a power or energy unit (columns: {', '.join(names)}): "
                                f"choose with --columns TIME,VALUE and give the unit with --unit ({UNIT_CHOICES})")
        return time_index, chosen[0], names

    def _index(self, given: str, names: list[str], position: int | None) -> int:
        if given.isdigit():
            index = int(given) - 1
            if not 0 <= index < len(names):
                raise MeterLogError(f"{self.path}: no column {given} (it has {len(names)}: {', '.join(names)})")
            return index
        if position is not None:
            return position
        lowered = [n.lower() for n in names]
        if given.strip().lower() not in lowered:
            raise MeterLogError(f"{self.path}: no column named {given!r} (columns: {', '.join(names)})")
        return lowered.index(given.strip().lower())

    def _time_parser(self, cell: str, name: str):
        """The parser of this log's time cells, chosen from the first one (every row must then agree)."""
        cell = cell.strip()
        millis = "ms" in [t.lower() for t in re.split(r"[^A-Za-z]+", name)]
        try:
            first = float(cell)
        except ValueError:
            first = None
        if first is not None:
            scale = 1e-3 if millis or first >= UNIX_MS_FROM else 1.0

            def number(text: str) -> float:
                return self._number(text, name) * scale

            number.clock = "wall" if first * scale >= UNIX_FROM_S else "relative"
            if scale != 1.0:
                number.note = f"times in column {name!r} read as milliseconds"
            return number
        if PTD_TIME.match(cell):
            def ptd(text: str) -> float:
                return self._ptd_time(text)

            ptd.clock = "wall"
            ptd.note = f"times in column {name!r} (MM-DD-YYYY HH:MM:SS) read as UTC"
            return ptd

        def iso(text: str) -> float:
            try:
                moment = datetime.fromisoformat(text)
            except ValueError:
                raise self.fail(f"time {text!r} is neither a number of seconds, ISO 8601 nor "
                                "MM-DD-YYYY HH:MM:SS") from None
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=timezone.utc)
            return moment.timestamp()

        iso(cell)
        iso.clock = "wall"
        if datetime.fromisoformat(cell).tzinfo is None:
            iso.note = f"times in column {name!r} carry no zone: read as UTC (a log in local time: pass --offset)"
        return iso

    def _number(self, text: str, what: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise self.fail(f"{what} is {text[:40]!r}, not a number") from None

    def _check_time(self, times: array, t: float) -> None:
        """``t`` (s) is finite and after the last reading kept; counts the row against ``max_rows``."""
        self.rows += 1
        if self.rows > self.max_rows:
            raise self.fail(f"more than {self.max_rows:,} rows: cut the log to the run (with a margin) first")
        if not math.isfinite(t):
            raise self.fail("the time is not a finite number")
        if times and t <= times[-1]:
            raise self.fail(f"the time does not increase ({t:.6f} s after {times[-1]:.6f} s): a log's rows must be in "
                            "time order, one reading per time")

    def _append(self, times: array, values: array, t: float, value: float) -> None:
        self._check_time(times, t)
        times.append(t)
        values.append(value)

    def _finish(self, log: MeterLog) -> MeterLog:
        if len(log.time_s) < MIN_ROWS:
            raise MeterLogError(f"{self.path} holds {len(log.time_s)} reading(s): at least {MIN_ROWS} are needed")
        if log.dropped_rows:
            log.notes.append(f"{log.dropped_rows} row(s) without a reading dropped (first on line "
                             f"{log.first_dropped_line}); the intervals they leave are gaps")
        return log


def _chain(first: str, rest):
    yield first
    yield from rest


def _looks_like_data(cell: str) -> bool:
    """Whether a header-row candidate cell is a value (a number or a time), not a column name."""
    cell = cell.strip()
    try:
        float(cell)
        return True
    except ValueError:
        pass
    if PTD_TIME.match(cell):
        return True
    try:
        datetime.fromisoformat(cell)
        return True
    except ValueError:
        return False
