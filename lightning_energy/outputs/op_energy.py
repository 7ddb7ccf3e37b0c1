"""Power samples in Chrome traces and the energy of each profiled operator.

Clocks: a Chrome trace from ``torch.profiler`` gives ``ts`` in microseconds relative to its
``baseTimeNanoseconds`` (Kineto's clock, tied to the Unix epoch), not on ``time.perf_counter`` where the
sampler's samples live. The profiler callback opens an empty ``record_function`` marker
(:data:`SYNC_MARKER`) between two ``perf_counter`` readings at each end of a window; each marker must
lie between its readings, which bounds the offset between the clocks (to a few microseconds here, see
:func:`clock_offset_us`). Without markers, ``baseTimeNanoseconds + ts`` is taken as Unix time (it
agrees with ``time.time_ns()`` to about 20 us). Kernels and copies carry the GPU's own timestamps,
which Kineto (CUPTI) converts to the trace clock; on a CUDA run a second marker
(:data:`DEVICE_SYNC_MARKER`) launches one tiny kernel between two device synchronisations, so the
kernel lies between the ``perf_counter`` readings around them, which bounds the device tracks' own
offset (:func:`device_clock_offset_us`; width: the launch latency plus the synchronisation, tens of
microseconds). Power samples are then placed on the device timeline by that offset.

Time resolution: energy between two samples is spread linearly over time (cumulative energy,
linear between samples), so an op or kernel shorter than the sampling interval (NVML's energy
counter: about 100 ms) gets the mean power of the interval it falls in, not a power of its own;
the exact-sum rule below holds regardless.

Attribution rule (documented contract of :func:`attribute_energy`):

1. Operators are the complete events (``"ph": "X"``) of the trace except profiler bookkeeping
   (``ProfilerStep#N``, the sync markers, the ``Trace`` span, CUPTI's ``overhead`` events), Python
   frames (``python_function``) and GPU-side events that are not work (``gpu_user_annotation``,
   ``cuda_sync``). Every (pid, tid) is
   one track. Host tracks are CPU threads (every op that is not device work, CUDA runtime calls
   included); device tracks are the streams of one GPU, holding its kernels, copies and memsets
   (``cat`` ``kernel``/``gpu_memcpy``/``gpu_memset``; the GPU is ``args.device``, else ``pid``).
2. Each sensor's energy goes to the tracks of its scope: a ``device`` sensor (the rank's GPU) to the
   kernels and copies on that GPU's streams, a ``host`` sensor (RAPL, the CPU estimate) to the CPU
   threads. On a run without a GPU (``device=None``) the device is the CPU: every sensor goes to
   the CPU threads. Kernels on other GPUs get nothing.
3. On a track only the innermost running operator holds the time (self time): a parent op gets the
   time its children leave uncovered. A child running past its parent's end is cut at that end.
4. The window is cut at every op boundary of the sensor's tracks. The energy of each piece, from the
   sensor's cumulative energy (linear between samples), is split EQUALLY among those tracks running
   an op during that piece; pieces where none runs an op are idle: :data:`IDLE_ROW` for host sensors
   (Python between ops, waiting), :data:`DEVICE_IDLE_ROW` for device sensors (no kernel or copy).
5. Hence, PER SENSOR, ``sum(op energies) + idle = the sensor's window energy`` exactly (up to float
   rounding), and an op's energy is at most the energy of the time it holds.
6. Per host op, ``launched_J`` is the device energy of the kernels and copies it launched: a kernel's
   ``args.correlation`` (else its ``ac2g`` flow) leads to its launch (the ``cuda_runtime``/
   ``cuda_driver`` call, else the flow's start) and the innermost host op running on that thread at
   that moment (else the host op with the kernel's ``External id``) launched it. So ``aten::mm``
   shows what its kernels cost; kernels whose launch is not found add up to ``unlinked_device_J``,
   and ``sum(launched_J) + unlinked_device_J`` = the device rows' energy.

Where a sensor is an estimate (``Sensor.estimated``, e.g. the CPU estimate from TDP and load) every
figure that includes it is labelled ``estimated`` (CSV columns ``energy_source`` and
``launched_device_source``, a note under the text table) and that sensor's counter tracks are named
``... (W, estimate)`` / ``... (J, estimate)``.
"""

from __future__ import annotations

import bisect
import csv
import gzip
import io
import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning_energy.io import atomic_write_bytes
from lightning_energy.measure.sampler import Reading
from lightning_energy.units import NS_PER_US, US_PER_S

SYNC_MARKER = "lightning_energy::clock_sync"
DEVICE_SYNC_MARKER = "lightning_energy::device_clock_sync"
SYNC_MARKERS = frozenset({SYNC_MARKER, DEVICE_SYNC_MARKER})
IDLE_ROW = "[idle: no profiled op]"
DEVICE_IDLE_ROW = "[device idle: no kernel or copy]"
IDLE_ROWS = frozenset({IDLE_ROW, DEVICE_IDLE_ROW})
HOST, DEVICE = "host", "device"  # the kinds of track
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # work on a GPU stream
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})  # host calls that launch device work
FLOW_CATEGORY = "ac2g"  # Kineto's flow from a launch (ph "s") to the kernel (ph "f")
# not ops: the trace's span, Python frames, GPU-side copies of annotations, GPU waits, the profiler's own overhead
EXCLUDED_CATEGORIES = frozenset({"Trace", "python_function", "gpu_user_annotation", "cuda_sync", "overhead"})
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
        # each reading at its own read time (a tick's later reads, a slow sensor's reader thread)
        point = (t, {r.name: (r.energy_J, r.power_W, r.t_s if math.isfinite(r.t_s) else t) for r in readings})
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
                read_s = value[2] if value is not None and len(value) > 2 else t  # (J, W[, read time s])
                if value is not None and start_s < read_s < end_s and math.isfinite(value[0]):
                    ts.append(read_s)
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
def bounded_offset_us(intervals: list[tuple[float, float]], syncs: list[tuple[float, float]]) -> tuple[float, float]:
    """(offset, uncertainty) in us from trace intervals each known to lie between two perf_counter readings.

    ``intervals[i] = (start, end)`` on the trace clock (us) happened between ``syncs[i] = (before, after)``
    (s): the offset ``trace ts - perf s x 1e6`` lies in ``[end - after, start - before]``. The bounds of
    all pairs are intersected (one delayed by preemption only widens its own) and the middle taken; bounds
    that do not intersect (the clocks drifted) give the mean of the middles and their spread. NaN, NaN
    for no pairs.
    """
    lows, highs, middles = [], [], []
    for (start, end), (before, after) in zip(intervals, syncs):
        lows.append(end - after * US_PER_S)
        highs.append(start - before * US_PER_S)
        middles.append((start + end) / 2 - (before + after) / 2 * US_PER_S)
    if not middles:
        return math.nan, math.nan
    low, high = max(lows), min(highs)
    if low <= high:
        return (low + high) / 2, (high - low) / 2
    return sum(middles) / len(middles), max(middles) - min(middles)


def clock_offset_us(events: list[dict], syncs: list[tuple[float, float]], base_ns: int | None = None,
                    unix_minus_perf_s: float | None = None) -> tuple[float, float]:
    """(offset, uncertainty) in us: ``trace ts = perf_counter s x 1e6 + offset``, give or take the uncertainty.

    ``syncs``: ``(perf before, perf after)`` of each sync marker, in the order they were opened (see
    :func:`bounded_offset_us`). Without markers: ``baseTimeNanoseconds`` as Unix time, with a NaN
    uncertainty.
    """
    markers = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == SYNC_MARKER),
                     key=lambda e: float(e["ts"]))
    intervals = [_span(e) for e in markers]
    if intervals and syncs:
        return bounded_offset_us(intervals, syncs)
    if base_ns is None or unix_minus_perf_s is None:
        raise ValueError("the trace holds no clock-sync marker and no baseTimeNanoseconds to align it")
    return unix_minus_perf_s * US_PER_S - base_ns / NS_PER_US, math.nan


def device_clock_offset_us(events: list[dict], syncs: list[tuple[float, float]], device: int) -> tuple[float, float]:
    """(offset, uncertainty) in us of ``device``'s tracks: ``kernel ts = perf_counter s x 1e6 + offset``.

    ``syncs``: ``(perf before, perf after)`` of each :data:`DEVICE_SYNC_MARKER`, read around a device
    synchronisation, the marker (which launches kernels on ``device``) and another synchronisation, so
    the kernels the marker launched ran between them. NaN, NaN when no marker's kernel is in the trace.
    """
    launches = Launches(events)
    markers = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == DEVICE_SYNC_MARKER),
                     key=lambda e: float(e["ts"]))
    ranges = [((e.get("pid"), e.get("tid")), *_span(e)) for e in markers]
    found: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") != "X" or device_of(e) != device:
            continue
        launch = launches.launch_of(e)
        if launch is None:
            continue
        track, t = launch
        for i, (marker_track, start, end) in enumerate(ranges):
            if track == marker_track and start <= t <= end:
                found.setdefault(i, []).append(_span(e))
    pairs = [((min(a for a, _ in kernels), max(b for _, b in kernels)), syncs[i])
             for i, kernels in sorted(found.items()) if i < len(syncs)]
    return bounded_offset_us([p[0] for p in pairs], [p[1] for p in pairs])


# ------------------------------------------------------------------------------------------- launches
def _args(event: dict) -> dict:
    args = event.get("args")
    return args if isinstance(args, dict) else {}


def _span(event: dict) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def device_of(event: dict) -> int | None:
    """The CUDA device index of a kernel, copy or memset (``args.device``, else its ``pid``); None otherwise."""
    if event.get("cat") not in DEVICE_CATEGORIES:
        return None
    device = _args(event).get("device", event.get("pid"))
    if isinstance(device, bool):
        return None
    try:
        return int(device)
    except (TypeError, ValueError):
        return None


class Launches:
    """Which host op launched each kernel or copy of a trace (rule 6 of the module docstring)."""

    def __init__(self, events: list[dict]) -> None:
        self.events = events
        self._by_correlation: dict[Any, tuple[tuple, float]] = {}  # launch call: (track, trace time us)
        self._by_flow: dict[Any, tuple[tuple, float]] = {}  # ac2g flow start
        self._flow_ends: dict[tuple, Any] = {}  # (pid, tid, ts) of an ac2g flow end -> its id
        self._by_external: dict[Any, int] = {}
        ops: dict[tuple, list[tuple[float, float, int]]] = {}
        for i, e in enumerate(events):
            ph, cat, track, args = e.get("ph"), e.get("cat"), (e.get("pid"), e.get("tid")), _args(e)
            try:
                if ph == "X" and cat in LAUNCH_CATEGORIES:
                    start, end = _span(e)
                    if "correlation" in args:
                        self._by_correlation[args["correlation"]] = (track, (start + end) / 2)
                elif ph == "s" and cat == FLOW_CATEGORY:
                    self._by_flow[e.get("id")] = (track, float(e["ts"]))
                elif ph == "f" and cat == FLOW_CATEGORY:
                    self._flow_ends[(*track, float(e["ts"]))] = e.get("id")
                elif is_attributed(e) and cat not in DEVICE_CATEGORIES:
                    ops.setdefault(track, []).append((*_span(e), i))
                    if "External id" in args:
                        self._by_external.setdefault(args["External id"], i)
            except (KeyError, TypeError, ValueError):
                continue  # an event without a usable time links nothing
        self._segments = {track: self_segments(track_ops) for track, track_ops in ops.items()}
        self._starts = {track: [s[0] for s in segments] for track, segments in self._segments.items()}

    def launch_of(self, kernel: dict) -> tuple[tuple, float] | None:
        """(host track, trace time in us) of the call that launched ``kernel``, or None if not in the trace."""
        correlation = _args(kernel).get("correlation")
        if correlation in self._by_correlation:
            return self._by_correlation[correlation]
        flow = self._flow_ends.get((kernel.get("pid"), kernel.get("tid"), float(kernel["ts"])))
        return self._by_flow.get(flow) if flow is not None else None

    def launcher_of(self, kernel: dict) -> int | None:
        """Index in the events of the host op that launched ``kernel``, or None if not found."""
        launch = self.launch_of(kernel)
        if launch is not None:
            track, t = launch
            starts = self._starts.get(track, [])
            k = bisect.bisect_right(starts, t) - 1
            if k >= 0:
                start, end, index = self._segments[track][k]
                if start <= t <= end:
                    return index
        return self._by_external.get(_args(kernel).get("External id"))


# ------------------------------------------------------------------------------------------- attribution
@dataclass
class OpEnergy:
    """One op name on one kind of track over a window.

    ``energy_J`` is the energy of the sensors split among this kind of track (``by_sensor`` per sensor);
    for a host op, ``launched_J`` is the device sensors' energy of the ``launched_calls`` kernels and
    copies it launched, reported beside ``energy_J``, not added to it.
    """

    op: str
    calls: int
    self_time_s: float
    energy_J: float
    share: float  # of the window's energy (all sensors)
    track: str = HOST
    by_sensor: dict[str, float] = field(default_factory=dict)
    launched_J: float = 0.0
    launched_calls: int = 0


@dataclass
class Attribution:
    """Energy of each op over one window; ``rows`` sorted by energy, the idle rows last.

    ``sensor_track[sensor]``: the kind of track (:data:`HOST` or :data:`DEVICE`) the sensor's energy was
    split among; per sensor, that track's rows (idle row included) add up to ``sensor_J[sensor]``.
    ``unlinked_device_J``: device energy of kernels whose launch is not in the trace. ``idle_J`` sums
    both idle rows; ``idle_s`` is the host tracks' idle time, ``device_idle_s`` the device's.
    """

    rows: list[OpEnergy]
    window_J: float
    window_s: float
    idle_J: float
    idle_s: float
    sensor_J: dict[str, float] = field(default_factory=dict)
    sensor_track: dict[str, str] = field(default_factory=dict)
    estimated_sensors: tuple[str, ...] = ()
    unlinked_device_J: float = 0.0
    device_idle_s: float = 0.0

    @property
    def estimated(self) -> bool:
        """Some of the window's energy comes from estimated (modelled) sensors."""
        return bool(self.estimated_sensors)

    @property
    def ops_J(self) -> float:
        return sum(r.energy_J for r in self.rows if r.op not in IDLE_ROWS)

    def track_sensors(self, track: str) -> tuple[str, ...]:
        """The sensors whose energy was split among ``track``'s ops."""
        return tuple(sorted(name for name, kind in self.sensor_track.items() if kind == track))

    def source(self, sensors: tuple[str, ...]) -> str:
        """``estimated`` when any of ``sensors`` is an estimate, ``measured`` otherwise, '' for none."""
        if not sensors:
            return ""
        return "estimated" if set(sensors) & set(self.estimated_sensors) else "measured"

    def _launches_shown(self, row: OpEnergy) -> bool:
        return row.track == HOST and row.op != IDLE_ROW and bool(self.track_sensors(DEVICE))

    def csv_text(self) -> str:
        """One line per row: which sensors ``energy_J`` includes (``sensors``, ``;``-separated) and whether it
        is an estimate (``energy_source``); for host ops on a GPU run also the device energy of the kernels
        they launched, with its sensors and source."""
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["op", "track", "calls", "time_s", "energy_J", "share_of_step_energy", "sensors",
                         "energy_source", "launched_kernels", "launched_device_J", "launched_device_sensors",
                         "launched_device_source"])
        device_sensors = self.track_sensors(DEVICE)
        for r in self.rows:
            sensors = self.track_sensors(r.track)
            launches = ([r.launched_calls, f"{r.launched_J:.9g}", ";".join(device_sensors),
                         self.source(device_sensors)] if self._launches_shown(r) else ["", "", "", ""])
            writer.writerow([r.op, r.track, r.calls, f"{r.self_time_s:.9g}", f"{r.energy_J:.9g}", f"{r.share:.6g}",
                             ";".join(sensors), self.source(sensors), *launches])
        return out.getvalue()

    def _describe(self, sensors: tuple[str, ...]) -> str:
        return ", ".join(f"{name} ({'ESTIMATE' if name in self.estimated_sensors else 'measured'})"
                         for name in sensors) or "no sensor"

    def markdown(self, top: int = 25) -> str:
        """A Markdown table: per kind of track, the ``top`` ops (host ops by their energy plus that of the
        kernels they launched, kernels by energy), the rest summed, the idle row; the window; notes saying
        which sensors each column holds and which are estimates."""
        lines = ["| op | track | calls | time (ms) | energy (mJ) | share of step energy | launched kernels (mJ) |",
                 "|---|---|---|---|---|---|---|"]
        for track, idle_row in ((HOST, IDLE_ROW), (DEVICE, DEVICE_IDLE_ROW)):
            ops = sorted((r for r in self.rows if r.track == track and r.op != idle_row),
                         key=lambda r: -(r.energy_J + r.launched_J))
            shown = ops[:top]
            if len(ops) > top:
                rest = ops[top:]
                shown.append(OpEnergy(f"({len(rest)} more ops)", sum(r.calls for r in rest),
                                      sum(r.self_time_s for r in rest), sum(r.energy_J for r in rest),
                                      sum(r.share for r in rest), track, launched_J=sum(r.launched_J for r in rest)))
            for r in shown + [r for r in self.rows if r.op == idle_row]:
                launched = f"{r.launched_J * 1e3:.3f}" if self._launches_shown(r) else ""
                lines.append(f"| {r.op} | {r.track} | {r.calls} | {r.self_time_s * 1e3:.3f} | "
                             f"{r.energy_J * 1e3:.3f} | {r.share:.1%} | {launched} |")
        lines.append(f"| **window** | | | {self.window_s * 1e3:.3f} | {self.window_J * 1e3:.3f} | 100.0% | |")
        notes = [f"host rows: energy of {self._describe(self.track_sensors(HOST))}, split among CPU threads"]
        device_sensors = self.track_sensors(DEVICE)
        if device_sensors:
            notes.append(f"device rows: energy of {self._describe(device_sensors)}, split among the kernels and "
                         "copies on the GPU's streams")
            notes.append(f"launched kernels: the device energy of the kernels each host op launched (not in its "
                         f"energy); kernels whose launch is not in the trace: {self.unlinked_device_J * 1e3:.3f} mJ")
        lines.append("\n" + "; ".join(notes))
        if self.estimated:
            lines.append(f"\nenergy: ESTIMATED where it includes {', '.join(self.estimated_sensors)} (modelled "
                         "sensors), not measured")
        return "\n".join(lines)


def is_attributed(event: dict) -> bool:
    """True for the events the attribution rule counts as operators (host ops, kernels and copies)."""
    if event.get("ph") != "X" or event.get("cat") in EXCLUDED_CATEGORIES:
        return False
    name = str(event.get("name", ""))
    return not (name.startswith("ProfilerStep#") or name in SYNC_MARKERS)


def self_segments(events: list[tuple[float, float, Any]]) -> list[tuple[float, float, Any]]:
    """Innermost-op segments ``(start, end, key)`` of one track's ``(start, end, key)`` events."""
    ordered = sorted(events, key=lambda e: (e[0], -e[1]))
    segments: list[tuple[float, float, Any]] = []
    stack: list[tuple[float, float, Any]] = []
    cursor = -math.inf

    def close_until(t: float) -> None:
        nonlocal cursor
        while stack and stack[-1][1] <= t:
            _, end, key = stack.pop()
            if end > cursor:
                segments.append((cursor, end, key))
            cursor = max(cursor, end)

    for start, end, key in ordered:
        close_until(start)
        if stack:
            end = min(end, stack[-1][1])  # a child never outlives its parent
            if start > cursor:
                segments.append((cursor, start, stack[-1][2]))
        cursor = max(cursor, start)
        if end > start:
            stack.append((start, end, key))
    close_until(math.inf)
    return segments


@dataclass
class _Split:
    """One kind of track's segments and each sensor's energy of every segment (rule 4)."""

    segments: list[tuple[float, float, int]]
    segment_J: dict[str, np.ndarray]
    idle_J: dict[str, float]
    idle_s: float


def _split(tracks: dict[tuple, list], ws: float, we: float, curves: dict[str, tuple[np.ndarray, np.ndarray]]) -> _Split:
    segments = [s for track in tracks.values() for s in self_segments(track)]
    bounds = np.unique(np.asarray([ws, we] + [t for a, b, _ in segments for t in (a, b)], float))
    starts = np.searchsorted(bounds, [a for a, _, _ in segments])
    ends = np.searchsorted(bounds, [b for _, b, _ in segments])
    running = np.zeros(len(bounds) + 1)
    np.add.at(running, starts, 1)
    np.add.at(running, ends, -1)
    running = np.cumsum(running)[:-2]  # ops running in piece k = [bounds[k], bounds[k+1]]
    idle = running == 0
    segment_J, idle_J = {}, {}
    for name, (times, energies) in curves.items():
        d_energy = np.diff(np.interp(bounds, times, energies))
        per_op = np.divide(d_energy, running, out=np.zeros_like(d_energy), where=running > 0)
        cumulative = np.concatenate([[0.0], np.cumsum(per_op)])
        segment_J[name] = cumulative[ends] - cumulative[starts]
        idle_J[name] = float(d_energy[idle].sum())
    return _Split(segments, segment_J, idle_J, float(np.diff(bounds)[idle].sum()))


def attribute_energy(events: list[dict], curve: EnergyCurve, offset_us: float, estimated=(),
                     scopes: dict[str, str] | None = None, device: int | None = None,
                     device_offset_us: float | None = None) -> Attribution:
    """Split each sensor's energy over the window among ops by the module's rule.

    Args:
        events: the trace's ``traceEvents``.
        curve: cumulative energy per sensor over the window (sampler clock).
        offset_us: host tracks' clock offset (``trace ts = perf_counter s x 1e6 + offset``).
        estimated: names of the sensors that are estimates.
        scopes: sensor name -> ``"device"`` or ``"host"`` (missing: host).
        device: the CUDA index of the rank's GPU, whose kernels the device sensors pay for; None on a run
            without a GPU (every sensor is split among the CPU threads).
        device_offset_us: the device tracks' clock offset (default: ``offset_us``).
    """
    ws, we = curve.start_s, curve.end_s
    scopes = scopes or {}
    shift = {HOST: offset_us, DEVICE: offset_us if device_offset_us is None else device_offset_us}
    sensor_track = {name: DEVICE if device is not None and scopes.get(name) == "device" else HOST
                    for name in curve.points}
    tracks: dict[str, dict[tuple, list]] = {HOST: {}, DEVICE: {}}
    rows: dict[tuple[str, str], OpEnergy] = {}

    def row(kind: str, name: str) -> OpEnergy:
        found = rows.get((kind, name))
        if found is None:
            found = rows[(kind, name)] = OpEnergy(name, 0, 0.0, 0.0, 0.0, kind)
        return found

    for i, e in enumerate(events):
        if not is_attributed(e):
            continue
        event_device = device_of(e)
        if event_device is None:
            kind = HOST
        elif event_device == device:
            kind = DEVICE
        else:
            continue  # another GPU's work, or any GPU's on a run that trains on the CPU
        start = (float(e["ts"]) - shift[kind]) / US_PER_S
        end = start + float(e.get("dur", 0.0)) / US_PER_S
        if end <= ws or start >= we:
            continue
        row(kind, str(e["name"])).calls += 1
        tracks[kind].setdefault((e.get("pid"), e.get("tid")), []).append((max(start, ws), min(end, we), i))

    device_event_J: dict[int, float] = {}
    idle_s = {HOST: 0.0, DEVICE: 0.0}
    kinds = (HOST, DEVICE) if device is not None else (HOST,)
    for kind in kinds:
        curves = {name: curve.points[name] for name, k in sensor_track.items() if k == kind}
        split = _split(tracks[kind], ws, we, curves)
        idle_s[kind] = split.idle_s
        per_sensor = [(name, joules.tolist()) for name, joules in split.segment_J.items()]
        for k, (a, b, i) in enumerate(split.segments):
            r = row(kind, str(events[i]["name"]))
            r.self_time_s += b - a
            for name, joules in per_sensor:
                r.by_sensor[name] = r.by_sensor.get(name, 0.0) + joules[k]
                if kind == DEVICE:
                    device_event_J[i] = device_event_J.get(i, 0.0) + joules[k]
        idle = row(kind, IDLE_ROW if kind == HOST else DEVICE_IDLE_ROW)
        idle.self_time_s = split.idle_s
        idle.by_sensor = dict(split.idle_J)

    unlinked_J = 0.0
    if device_event_J:
        launches = Launches(events)
        for i, joules in sorted(device_event_J.items()):
            launcher = launches.launcher_of(events[i])
            if launcher is None:
                unlinked_J += joules
                continue
            r = row(HOST, str(events[launcher]["name"]))
            r.launched_J += joules
            r.launched_calls += 1

    sensor_J = {name: float(es[-1] - es[0]) for name, (_, es) in curve.points.items()}
    window_J = sum(sensor_J.values())
    for r in rows.values():
        r.energy_J = sum(r.by_sensor.values())
        r.share = r.energy_J / window_J if window_J > 0 else 0.0
    ordered = sorted((r for r in rows.values() if r.op not in IDLE_ROWS), key=lambda r: (-r.energy_J, r.track, r.op))
    ordered += [rows[(kind, name)] for kind, name in ((HOST, IDLE_ROW), (DEVICE, DEVICE_IDLE_ROW)) if (kind, name) in rows]
    idle_J = sum(r.energy_J for r in ordered if r.op in IDLE_ROWS)
    estimated_sensors = tuple(sorted(set(estimated) & set(curve.points)))
    return Attribution(ordered, window_J, we - ws, idle_J, idle_s[HOST], sensor_J, sensor_track, estimated_sensors,
                       unlinked_J, idle_s[DEVICE])


# ------------------------------------------------------------------------------------------- trace files
def counter_events(samples: list[tuple[float, dict]], curve: EnergyCurve, offset_us: float, pid,
                   estimated: frozenset[str] | set[str] = frozenset(),
                   placement: dict[str, tuple[Any, float]] | None = None) -> list[dict]:
    """Chrome counter events (``"ph": "C"``) per sensor: power (W) and energy since the window start (J).

    Power tracks hold each sample's reading from its time on; the value in force at the window start
    opens the track and the last value closes it at the window end. Tracks of the sensors named in
    ``estimated`` say so in their names. ``placement[sensor] = (pid, offset_us)`` puts a sensor's tracks
    in another process of the trace on that process's clock (a device sensor beside its GPU's streams);
    the others go to ``pid`` at ``offset_us``.
    """
    ws, we = curve.start_s, curve.end_s
    events = []
    placement = placement or {}

    for name, (times, energies) in curve.points.items():
        track_pid, offset = placement.get(name, (pid, offset_us))

        def ts(t: float, offset: float = offset) -> float:
            return round(t * US_PER_S + offset, 3)

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
            events.append({"ph": "C", "name": f"power {name} (W{label})", "pid": track_pid, "ts": ts(t),
                           "args": {"W": watts}})
        for t, joules in zip(times, energies):
            events.append({"ph": "C", "name": f"energy {name} (J{label})", "pid": track_pid, "ts": ts(t),
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
