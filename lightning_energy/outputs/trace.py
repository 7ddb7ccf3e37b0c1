"""The sample trace of a run, streamed to CSV by the sampling thread.

Two files in the log dir: ``energy_trace.csv`` (one row per sample: ``time_s`` since the trace
started, ``unix_time_s``, and per sensor ``<name>:energy_J`` (cumulative, blank between counter
updates), ``<name>:power_W`` and every telemetry field ``<name>:<field>``) and ``energy_events.csv``
(``time_s, unix_time_s, event, epoch, step`` and per sensor ``<name>:energy_J``: the cumulative energy the
meter resolved at the event's mark, for the fit's start and end). Both are written under a ``.partial`` name and renamed
when the trace closes. The sample rows end when the run's report counts them (:meth:`TraceWriter.end_rows`): the
report's ``sampling.trace_rows`` is the trace's row count, however long the teardown after the report takes (the
events still pending are written after it). Rows are buffered and flushed every ``FLUSH_EVERY_ROWS`` rows, off
the training thread. A fault under the trace (a full disk, a read-only log dir) never reaches training: it is one line
in ``TraceWriter.problems`` and the report's trace entry should then say the trace is missing.
"""

from __future__ import annotations

import csv
import math
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_energy.io import fsync
from lightning_energy.outputs.worker import ProblemLog, describe_error

if TYPE_CHECKING:  # the offline reader (read_trace) should not load the sampler
    from lightning_energy.measure.sampler import Reading

FLUSH_EVERY_ROWS = 256
TRACE_FILE = "energy_trace.csv"
EVENTS_FILE = "energy_events.csv"
EVENTS = ("fit_start", "train_start", "epoch_start", "epoch_end", "validation_start", "validation_end",
          "train_end", "fit_end")


class TraceWriter:
    """A sampler listener writing every sample, plus the events callbacks record.

    Never raises: a trace that cannot be created or written (a full disk, a read-only log dir) becomes
    one line in :attr:`problems` (and one warning); the writer then stops, removes what it had written
    under the ``.partial`` name (a truncated trace is worse than none) and :attr:`complete` stays False.
    """

    def __init__(self, folder: str | os.PathLike, sensor_names: list[str], suffix: str = "", warn: bool = True) -> None:
        folder = Path(folder)
        self.trace_path = folder / TRACE_FILE.replace(".csv", f"{suffix}.csv")
        self.events_path = folder / EVENTS_FILE.replace(".csv", f"{suffix}.csv")
        self.sensor_names = list(sensor_names)
        self.origin_perf = time.perf_counter()
        self.origin_unix = time.time()
        self.log = ProblemLog(warn)
        self.complete = False  # both files written in full under their final names
        self.failed = False
        self._trace_file = self._events_file = None
        self._columns: list[tuple[str, str]] | None = None
        self._pending_events: deque = deque()
        self._rows_since_flush = 0
        self._lock = threading.Lock()  # the sampling thread writes, the training thread closes (once)
        self.rows = 0
        self.rows_ended = False  # no sample rows after the report counted them (events are still written)
        self.closed = False
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._trace_file = open(self._partial(self.trace_path), "w", newline="")
            self._events_file = open(self._partial(self.events_path), "w", newline="")
            self._trace = csv.writer(self._trace_file)
            self._events = csv.writer(self._events_file)
            # per sensor, the cumulative J the meter resolved at the event's mark (where the event has one)
            self._events.writerow(["time_s", "unix_time_s", "event", "epoch", "step"]
                                  + [f"{name}:energy_J" for name in self.sensor_names])
        except OSError as err:
            self._abandon("could not be created", err)

    @property
    def problems(self) -> list[str]:
        """One line per problem with the trace files (empty when they were written in full)."""
        return self.log.problems

    @staticmethod
    def _partial(path: Path) -> Path:
        return path.with_name(path.name + ".partial")

    def event(self, name: str, t: float, epoch: int | None = None, step: int | None = None, mark=None) -> None:
        """Record an event at sampler time ``t`` (any thread; written by the sampling thread).

        ``mark``: the meter's :class:`~lightning_energy.measure.meter.Mark` at ``t``. The event is then written once
        the meter has resolved it (later events wait, so the file keeps their order), with the cumulative
        energy per sensor the meter found there: a reader of the files gets the meter's own figure for a
        window between two such events (the fit), not a re-interpolation of the samples.
        """
        if not self.failed:
            self._pending_events.append((name, t, epoch, step, mark))

    def end_rows(self) -> int:
        """Write no sample row from now on and return the rows written (the run's report calls it when it
        counts the samples, so that the trace holds exactly the rows the report states). The events still
        pending (the fit's end) are written at the next sample or at :meth:`close`."""
        with self._lock:
            self.rows_ended = True
            return self.rows

    def __call__(self, t: float, readings: list[Reading]) -> None:
        if self.closed:
            return
        with self._lock:
            if self.closed:
                return
            try:
                if self.rows_ended:
                    self._write_events()
                else:
                    self._write_sample(t, readings)
            except (OSError, ValueError) as err:  # ValueError: a file closed under us
                self._abandon(f"stopped after {self.rows} rows", err)

    def _write_sample(self, t: float, readings: list[Reading]) -> None:
        by_name = {r.name: r for r in readings if r.name in self.sensor_names}
        if self._columns is None:
            self._columns = self._header(by_name)
        row = [f"{t - self.origin_perf:.6f}", f"{self.origin_unix + t - self.origin_perf:.6f}"]
        for name, field in self._columns:
            reading = by_name.get(name)
            if reading is None:
                row.append("")
            elif field == "energy_J":
                row.append(_fmt(reading.energy_J))
            elif field == "power_W":
                row.append(_fmt(reading.power_W))
            else:
                row.append(_fmt(reading.fields.get(field, math.nan)))
        self._trace.writerow(row)
        self.rows += 1
        self._write_events()
        self._rows_since_flush += 1
        if self._rows_since_flush >= FLUSH_EVERY_ROWS:
            self._trace_file.flush()
            self._events_file.flush()
            self._rows_since_flush = 0

    def _header(self, by_name: dict[str, Reading]) -> list[tuple[str, str]]:
        columns = []
        for name in self.sensor_names:
            columns += [(name, "energy_J"), (name, "power_W")]
            reading = by_name.get(name)
            columns += [(name, f) for f in (reading.fields if reading else {}) if f not in ("energy_J", "power_W")]
        self._trace.writerow(["time_s", "unix_time_s"] + [f"{n}:{f}" for n, f in columns])
        return columns

    def _write_events(self, final: bool = False) -> None:
        while self._pending_events:
            name, t, epoch, step, mark = self._pending_events[0]
            if mark is not None and not mark.resolved and not final:
                return  # its energy is not known yet: written at a later sample (or at close, without it)
            self._pending_events.popleft()
            energy = (mark.energy or {}) if mark is not None else {}
            self._events.writerow([
                f"{t - self.origin_perf:.6f}", f"{self.origin_unix + t - self.origin_perf:.6f}", name,
                "" if epoch is None else epoch, "" if step is None else step,
                *(_fmt(energy.get(sensor)) for sensor in self.sensor_names),
            ])

    def _abandon(self, what: str, err: BaseException) -> None:
        """Stop writing: close the files, remove the partial ones (best effort), record one problem line."""
        self.failed = self.closed = True
        self._pending_events.clear()
        left = []
        for handle, path in ((self._trace_file, self.trace_path), (self._events_file, self.events_path)):
            if handle is not None:
                try:
                    handle.close()
                except (OSError, ValueError):
                    pass  # the same fault again while flushing what was buffered
            partial = self._partial(path)
            try:
                partial.unlink(missing_ok=True)
            except OSError:
                left.append(partial.name)
        self._trace_file = self._events_file = None
        leftover = f"; a partial file remains: {', '.join(left)}" if left else ""
        self.log.record("trace", f"sample trace {self.trace_path.name} (and {self.events_path.name}) in "
                                 f"{self.trace_path.parent} {what} ({describe_error(err)}); the run has no trace"
                                 f"{leftover}")

    def close(self) -> None:
        """Write what is left and give the files their final names (call after the sampler let go). Never raises."""
        with self._lock:
            if self.closed:
                return
            try:
                if self._columns is None:
                    self._header({})
                    self._columns = []
                self._write_events(final=True)
                for handle in (self._trace_file, self._events_file):
                    handle.flush()
                    fsync(handle.fileno())
                    handle.close()
            except (OSError, ValueError) as err:
                self._abandon(f"could not be completed after {self.rows} rows", err)
                return
            self.closed = True
            renamed, stuck, error = [], [], None
            for path in (self.trace_path, self.events_path):
                try:
                    os.replace(self._partial(path), path)
                    renamed.append(path)
                except OSError as err:  # e.g. the log dir became read-only: the data is whole, under its partial name
                    stuck.append(self._partial(path).name)
                    error = error or err
            if stuck:
                self.failed = True
                self.log.record("trace", f"sample trace in {self.trace_path.parent} is complete but could not be "
                                         f"given its final name ({describe_error(error)}); it remains as "
                                         f"{', '.join(stuck)}")
            self.complete = len(renamed) == 2
            self._trace_file = self._events_file = None


def _fmt(value: float) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.10g}"


def read_trace(path: str | os.PathLike) -> dict[str, list[float]]:
    """Columns of a trace CSV as float lists (blank cells become NaN)."""
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        columns: dict[str, list[float]] = {h: [] for h in header}
        for row in reader:
            for h, cell in zip(header, row):
                columns[h].append(float(cell) if cell not in ("", None) else math.nan)
    return columns
