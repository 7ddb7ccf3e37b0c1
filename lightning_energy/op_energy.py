"""Power samples in Chrome traces and the energy of each profiled operator.

Clock: a Chrome trace from ``torch.profiler`` gives ``ts`` in microseconds relative to its
``baseTimeNanoseconds`` (Kineto's clock, tied to the Unix epoch), not on ``time.perf_counter`` where the
sampler's samples live. The profiler callback opens an empty ``record_function`` marker
(:data:`SYNC_MARKER`) between two ``perf_counter`` readings at each end of a window; each marker must
lie between its readings, which bounds the offset between the clocks (to a few microseconds here, see
:func:`clock_offset_us`). Without markers, ``baseTimeNanoseconds + ts`` is taken as Unix time (it
agrees with ``time.time_ns()`` to about 20 us).

Attribution rule (documented contract of :func:`attribute_energy`):

1. Operators are the complete events (``"ph": "X"``) of the trace except profiler bookkeeping
   (``ProfilerStep#N``, the sync markers, the ``Trace`` span), Python frames (``python_function``)
   and GPU-side copies of annotations (``gpu_user_annotation``). Every (pid, tid) is one track: a CPU
   thread or a GPU stream.
2. On a track only the innermost running operator holds the time (self time): a parent op gets the
   time its children leave uncovered. A child running past its parent's end is cut at that end.
3. The window is cut at every op boundary. The energy of each piece, from the measured cumulative
   energy (summed over sensors, linear between samples), is split EQUALLY among the tracks running an
   op during that piece; pieces where no track runs an op are ``idle`` (Python between ops, waiting).
4. Hence ``sum(op energies) + idle = window energy`` exactly (up to float rounding), and an op's
   energy is at most the energy of the time it holds.

Where a sensor is an estimate (``Sensor.estimated``, e.g. the CPU estimate from TDP and load) the
attribution is labelled ``estimated`` (CSV column ``energy_source``, a note under the text table) and
that sensor's counter tracks are named ``... (W, estimate)`` / ``... (J, estimate)``.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_energy.io import atomic_write_bytes
from lightning_energy.sampler import Reading

SYNC_MARKER = "lightning_energy::clock_sync"
IDLE_ROW = "[idle: no profiled op]"
EXCLUDED_CATEGORIES = frozenset({"Trace", "python_function", "gpu_user_annotation"})
MAX_WINDOW_POINTS = 200_000  # per profiled window (about an hour at 50 Hz); later samples are dropped


# ------------------------------------------------------------------------------------------- samples
class WindowRecorder:
    """A sampler listener keeping the samples of the open window (and the last one before it).

    Runs on the sampling thread; :meth:`open` and :meth:`close` (training thread, once per window) take
    this recorder's own small lock, never the sampler's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recording = False
        self._last: tuple[float, dict] | None = None
        self._points: list[tuple[float, dict]] = []
        self.dropped = 0

    def __call__(self, t: float, readings: list[Reading]) -> None:
        point = (t, {r.name: (r.energy_J, r.power_W) for r in readings})
        with self._lock:
            if not self._recording:
                self._last = point
            elif len(self._points) < MAX_WINDOW_POINTS:
                self._points.append(point)
            else:
                self.dropped += 1

    def open(self) -> None:
        with self._lock:
            self._points = [self._last] if self._last is not None else []
            self._recording = True
            self.dropped = 0

    def close(self) -> list[tuple[float, dict]]:
        """Stop recording and return the window's samples ``(t, {sensor: (cumulative J, W)})``."""
        with self._lock:
            points, self._points = self._points, []
            self._recording = False
            if points:
                self._last = points[-1]
        return points


@dataclass
class EnergyCurve:
    """Cumulative energy (J) per sensor over a window, linear between points (sampler clock, s)."""

    start_s: float
    end_s: float
    points: dict[str, tuple[np.ndarray, np.ndarray]]  # sensor -> (times s, cumulative J)

    @classmethod
    def from_window(cls, start_s: float, start_J: dict, end_s: float, end_J: dict,
                    samples: list[tuple[float, dict]]) -> "EnergyCurve":
        """Points of the sensors known at both ends: the two boundary values and the samples between."""
        points = {}
        for name, e_end in end_J.items():
            e_start = start_J.get(name)
            if e_end is None or e_start is None:
                continue
            ts, es = [start_s], [e_start]
            for t, values in samples:
                value = values.get(name)
                if start_s < t < end_s and value is not None and math.isfinite(value[0]):
                    ts.append(t)
                    es.append(value[0])
            ts.append(end_s)
            es.append(e_end)
            points[name] = (np.asarray(ts, float), np.maximum.accumulate(np.asarray(es, float)))
        return cls(start_s, end_s, points)

    def total_at(self, times_s: np.ndarray) -> np.ndarray:
        """Cumulative energy summed over sensors at ``times_s`` (J, relative to the window start)."""
        total = np.zeros(len(times_s))
        for ts, es in self.points.values():
            total += np.interp(times_s, ts, es) - es[0]
        return total

    @property
    def energy_J(self) -> float:
        return float(sum(es[-1] - es[0] for _, es in self.points.values()))


# ------------------------------------------------------------------------------------------- clocks
def clock_offset_us(events: list[dict], syncs: list[tuple[float, float]], base_ns: int | None = None,
                    unix_minus_perf_s: float | None = None) -> tuple[float, float]:
    """(offset, uncertainty) in us: ``trace ts = perf_counter s x 1e6 + offset``, give or take the uncertainty.

    ``syncs``: ``(perf before, perf after)`` of each sync marker, in the order they were opened. A
    marker lies inside its two readings, which bounds the offset; the bounds of all markers are
    intersected (a marker delayed by preemption only widens its own bounds) and the middle taken.
    Without markers: ``baseTimeNanoseconds`` as Unix time, with a NaN uncertainty.
    """
    markers = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == SYNC_MARKER),
                     key=lambda e: float(e["ts"]))
    lows, highs, middles = [], [], []
    for e, (before, after) in zip(markers, syncs):
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        lows.append(end - after * 1e6)
        highs.append(start - before * 1e6)
        middles.append((start + end) / 2 - (before + after) / 2 * 1e6)
    if middles:
        low, high = max(lows), min(highs)
        if low <= high:
            return (low + high) / 2, (high - low) / 2
        return sum(middles) / len(middles), max(middles) - min(middles)  # inconsistent bounds: clocks drifted
    if base_ns is None or unix_minus_perf_s is None:
        raise ValueError("the trace holds no clock-sync marker and no baseTimeNanoseconds to align it")
    return unix_minus_perf_s * 1e6 - base_ns / 1e3, math.nan


# ------------------------------------------------------------------------------------------- attribution
@dataclass
class OpEnergy:
    op: str
    calls: int
    self_time_s: float
    energy_J: float
    share: float  # of the window's energy


@dataclass
class Attribution:
    """Energy of each op name over one window; ``rows`` sorted by energy, the idle row last."""

    rows: list[OpEnergy]
    window_J: float
    window_s: float
    idle_J: float
    idle_s: float
    estimated: bool = False  # some of the window's energy comes from estimated (modelled) sensors

    @property
    def ops_J(self) -> float:
        return sum(r.energy_J for r in self.rows if r.op != IDLE_ROW)

    def csv_text(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["op", "calls", "time_s", "energy_J", "share_of_step_energy", "energy_source"])
        source = "estimated" if self.estimated else "measured"
        for r in self.rows:
            writer.writerow([r.op, r.calls, f"{r.self_time_s:.9g}", f"{r.energy_J:.9g}", f"{r.share:.6g}", source])
        return out.getvalue()

    def markdown(self, top: int = 25) -> str:
        ops = [r for r in self.rows if r.op != IDLE_ROW]
        shown = ops[:top] + [r for r in self.rows if r.op == IDLE_ROW]
        lines = ["| op | calls | time (ms) | energy (mJ) | share of step energy |", "|---|---|---|---|---|"]
        for r in shown:
            lines.append(f"| {r.op} | {r.calls} | {r.self_time_s * 1e3:.3f} | {r.energy_J * 1e3:.3f} | {r.share:.1%} |")
        if len(ops) > top:
            rest = ops[top:]
            lines.append(f"| ({len(rest)} more ops) | {sum(r.calls for r in rest)} | "
                         f"{sum(r.self_time_s for r in rest) * 1e3:.3f} | {sum(r.energy_J for r in rest) * 1e3:.3f} | "
                         f"{sum(r.share for r in rest):.1%} |")
        lines.append(f"| **window** | | {self.window_s * 1e3:.3f} | {self.window_J * 1e3:.3f} | 100.0% |")
        if self.estimated:
            lines.append("\nenergy: ESTIMATED (from modelled sensors), not measured")
        return "\n".join(lines)


def is_attributed(event: dict) -> bool:
    """True for the events the attribution rule counts as operators."""
    if event.get("ph") != "X" or event.get("cat") in EXCLUDED_CATEGORIES:
        return False
    name = str(event.get("name", ""))
    return not (name.startswith("ProfilerStep#") or name == SYNC_MARKER)


def self_segments(events: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Innermost-op segments ``(start, end, name)`` of one track's ``(start, end, name)`` events."""
    ordered = sorted(events, key=lambda e: (e[0], -e[1]))
    segments: list[tuple[float, float, str]] = []
    stack: list[tuple[float, float, str]] = []
    cursor = 0.0

    def close_until(t: float) -> None:
        nonlocal cursor
        while stack and stack[-1][1] <= t:
            _, end, name = stack.pop()
            if end > cursor:
                segments.append((cursor, end, name))
            cursor = max(cursor, end)

    for start, end, name in ordered:
        close_until(start)
        if stack:
            end = min(end, stack[-1][1])  # a child never outlives its parent
            if start > cursor:
                segments.append((cursor, start, stack[-1][2]))
        cursor = max(cursor, start)
        if end > start:
            stack.append((start, end, name))
    close_until(math.inf)
    return segments


def attribute_energy(events: list[dict], curve: EnergyCurve, offset_us: float, estimated: bool = False) -> Attribution:
    """Split the window's measured energy among ops by the module's rule (``offset_us``: trace clock;
    ``estimated``: the curve comes at least partly from estimated sensors)."""
    ws, we = curve.start_s, curve.end_s
    tracks: dict[tuple, list] = {}
    calls: dict[str, int] = {}
    for e in events:
        if not is_attributed(e):
            continue
        start = (float(e["ts"]) - offset_us) / 1e6
        end = start + float(e.get("dur", 0.0)) / 1e6
        if end <= ws or start >= we:
            continue
        name = str(e["name"])
        calls[name] = calls.get(name, 0) + 1
        tracks.setdefault((e.get("pid"), e.get("tid")), []).append((max(start, ws), min(end, we), name))
    segments = [s for track in tracks.values() for s in self_segments(track)]
    bounds = np.unique(np.asarray([ws, we] + [t for a, b, _ in segments for t in (a, b)], float))
    energy = curve.total_at(bounds)
    d_energy = np.diff(energy)
    starts = np.searchsorted(bounds, [a for a, _, _ in segments])
    ends = np.searchsorted(bounds, [b for _, b, _ in segments])
    running = np.zeros(len(bounds) + 1)
    np.add.at(running, starts, 1)
    np.add.at(running, ends, -1)
    running = np.cumsum(running)[:-2]  # ops running in piece k = [bounds[k], bounds[k+1]]
    per_op = np.divide(d_energy, running, out=np.zeros_like(d_energy), where=running > 0)
    cumulative = np.concatenate([[0.0], np.cumsum(per_op)])
    by_name: dict[str, list[float]] = {}
    for (a, b, name), i, j in zip(segments, starts, ends):
        acc = by_name.setdefault(name, [0.0, 0.0])
        acc[0] += b - a
        acc[1] += cumulative[j] - cumulative[i]
    window_J = float(energy[-1] - energy[0])
    idle = running == 0
    idle_J = float(d_energy[idle].sum())
    idle_s = float(np.diff(bounds)[idle].sum())
    share = (lambda j: j / window_J) if window_J > 0 else (lambda j: 0.0)
    rows = [OpEnergy(name, calls[name], t, j, share(j)) for name, (t, j) in by_name.items()]
    rows.sort(key=lambda r: (-r.energy_J, r.op))
    rows.append(OpEnergy(IDLE_ROW, 0, idle_s, idle_J, share(idle_J)))
    return Attribution(rows, window_J, we - ws, idle_J, idle_s, estimated)


# ------------------------------------------------------------------------------------------- trace files
def counter_events(samples: list[tuple[float, dict]], curve: EnergyCurve, offset_us: float, pid,
                   estimated: frozenset[str] | set[str] = frozenset()) -> list[dict]:
    """Chrome counter events (``"ph": "C"``) per sensor: power (W) and energy since the window start (J).

    Power tracks hold each sample's reading from its time on; the value in force at the window start
    opens the track and the last value closes it at the window end. Tracks of the sensors named in
    ``estimated`` say so in their names.
    """
    ws, we = curve.start_s, curve.end_s
    events = []

    def ts(t: float) -> float:
        return round(t * 1e6 + offset_us, 3)

    for name, (times, energies) in curve.points.items():
        power_points = [(t, values[name][1]) for t, values in samples
                        if name in values and math.isfinite(values[name][1]) and t <= we]
        before = [p for t, p in power_points if t <= ws]
        inside = [(t, p) for t, p in power_points if ws < t]
        if before:
            inside.insert(0, (ws, before[-1]))
        if inside:
            inside.append((we, inside[-1][1]))
        label = ", estimate" if name in estimated else ""
        for t, watts in inside:
            events.append({"ph": "C", "name": f"power {name} (W{label})", "pid": pid, "ts": ts(t),
                           "args": {"W": watts}})
        for t, joules in zip(times, energies):
            events.append({"ph": "C", "name": f"energy {name} (J{label})", "pid": pid, "ts": ts(t),
                           "args": {"J": float(joules - energies[0])}})
    return events


def read_chrome_trace(path: str | os.PathLike) -> dict:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def write_chrome_trace(path: str | os.PathLike, trace: dict) -> Path:
    """Rewrite a (possibly gzipped) trace atomically: temporary file in the same folder, then rename."""
    path = Path(path)
    content = json.dumps(trace).encode()
    return atomic_write_bytes(path, gzip.compress(content) if path.suffix == ".gz" else content)
