"""Where step boundaries are put on the sampler's time axis (``time.perf_counter`` seconds, float64).

On the host a boundary is simply "now" (:class:`HostClock`). On CUDA the work of a step runs
asynchronously after the Python call returns, so a boundary is a CUDA event recorded in the stream
(:class:`CudaEventClock`); the sampling thread converts it to host time once the GPU has reached it,
from an *anchor*: an earlier completed event whose host time is known. No ``torch.cuda.synchronize()``
runs per step. Every clock has the same four calls:

- ``record()`` (training thread, cheap): a token for "now" in the work submitted so far;
- ``resolve(token) -> float | None`` (never blocks): the host time in s, or None while the device has
  not reached the token;
- ``wait(token) -> float`` (blocks until the device reaches the token): for the few places that must
  have the time now (fit end);
- ``reanchor()``: a hint that now is a good time to refresh the anchor (free on the host).

Use :func:`device_clock` to get them: one clock per device per process, shared by every meter.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any
from lightning_energy.units import MS_PER_S

REANCHOR_PERIOD_S = 60.0  # a CUDA clock takes a fresh anchor at most this often (s)


class HostClock:
    """Boundaries at the host time of the call (``time.perf_counter`` s)."""

    asynchronous = False

    def record(self) -> float:
        return time.perf_counter()

    def resolve(self, token: Any) -> float | None:
        return token

    def wait(self, token: Any) -> float:
        return token

    def reanchor(self) -> None:
        """Nothing to do on the host."""


class _Anchor:
    """A completed CUDA event and the host time (``perf_counter`` s, float64) at which it completed."""

    __slots__ = ("event", "t_s")

    def __init__(self, event: Any, t_s: float) -> None:
        self.event = event
        self.t_s = t_s


class _Candidate:
    """An event recorded to become the next anchor, with the host-time interval its completion lies in.

    ``not_done_s``: the device had not reached it at this host time (at first: the time it was
    recorded); it completes after. Once a query finds it complete, that query's time is the upper end.
    """

    __slots__ = ("event", "not_done_s")

    def __init__(self, event: Any, not_done_s: float) -> None:
        self.event = event
        self.not_done_s = not_done_s


class CudaToken:
    """A boundary recorded by :class:`CudaEventClock`: its event, the anchor it is timed from, and its
    host time once resolved (``t_s``; the event goes back to the clock's pool then)."""

    __slots__ = ("event", "anchor", "t_s")

    def __init__(self, event: Any, anchor: _Anchor) -> None:
        self.event = event
        self.anchor = anchor
        self.t_s: float | None = None


class CudaEventClock:
    """Boundaries as CUDA events on ``device``, resolved to host seconds on the sampling thread.

    Time is kept as float64 host seconds: a boundary's time is its anchor's host time plus
    ``anchor.elapsed_time(event)``, a float32 count of ms that only ever spans from a recent anchor
    (float32 over 60 s resolves 4 us; over 24 h it would resolve 8 ms).

    Anchors. The first is taken at construction with one ``synchronize`` (its host time is read as the
    synchronize returns: late by the return latency, microseconds). After that, without any
    synchronize: once :data:`REANCHOR_PERIOD_S` has passed since the anchor's host time (or
    when :meth:`reanchor` asks), :meth:`record` also records a candidate event. Each :meth:`resolve`
    queries it; when it is found complete it becomes the anchor, its host time being the old anchor's
    extrapolation clamped into ``[last time the candidate was seen incomplete, time it was seen
    complete]``, the interval its true completion lies in. So an anchor's host time is wrong by at most
    the gap between those two queries (one per resolve: the sampling interval, 50 ms at the default
    20 Hz, while marks are pending) and, typically, by only the drift between the GPU and host clocks
    over one period (tens of ppm x 60 s: a few ms). Each token keeps the anchor that was current when it
    was recorded, so ``elapsed_time`` spans at most the period plus the gap between marks and the lag.

    Threads. ``record`` runs on the training thread (whose current device Lightning has set).
    ``resolve``, ``wait`` and the anchor queries run with ``torch.cuda.device(self.device)`` around
    every event query, so the sampling thread, whose current CUDA device is 0 unless set, never
    creates a CUDA context on another GPU.
    """

    asynchronous = True

    def __init__(self, device: Any, reanchor_period_s: float = REANCHOR_PERIOD_S) -> None:
        import torch

        if not reanchor_period_s > 0:
            raise ValueError(f"reanchor_period_s must be > 0, got {reanchor_period_s!r}")
        self._torch = torch
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaEventClock needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.reanchor_period_s = float(reanchor_period_s)
        self._spare_events: deque = deque()
        self._lock = threading.Lock()  # resolve/wait may run on two threads; record never takes it
        self._candidate: _Candidate | None = None
        with torch.cuda.device(device):
            event = self._new_event()
            event.record(torch.cuda.current_stream(device))
            event.synchronize()
        self._anchor = _Anchor(event, time.perf_counter())

    # --- training thread ------------------------------------------------------------------------
    def record(self) -> CudaToken:
        """A boundary at the end of the work queued so far on the current stream (no synchronisation)."""
        if self._candidate is None and time.perf_counter() - self._anchor.t_s >= self.reanchor_period_s:
            self._record_candidate()
        event = self._spare_events.pop() if self._spare_events else self._new_event()
        event.record(self._torch.cuda.current_stream(self.device))
        return CudaToken(event, self._anchor)

    def reanchor(self) -> None:
        """Take a fresh anchor soon (an event recorded now, timed when the sampling thread sees it
        complete); no synchronisation. Epoch ends call it; the period makes it happen anyway."""
        if self._candidate is None:
            self._record_candidate()

    def _record_candidate(self) -> None:
        event = self._new_event()
        recorded_s = time.perf_counter()
        event.record(self._torch.cuda.current_stream(self.device))
        self._candidate = _Candidate(event, recorded_s)

    def _new_event(self):
        return self._torch.cuda.Event(enable_timing=True)

    # --- any thread -----------------------------------------------------------------------------
    def resolve(self, token: CudaToken) -> float | None:
        """The host time (s) at which the device reached ``token``, or None if it has not yet. Never blocks."""
        if token.t_s is not None:
            return token.t_s
        with self._lock, self._torch.cuda.device(self.device):
            self._poll_candidate()
            if token.t_s is None and token.event.query():
                anchor = token.anchor
                token.t_s = anchor.t_s + anchor.event.elapsed_time(token.event) / MS_PER_S
                self._spare_events.append(token.event)
                token.event = None
        return token.t_s

    def wait(self, token: CudaToken) -> float:
        """The host time (s) at which the device reached ``token``, blocking until it has (one
        ``event.synchronize()``). For the rare boundaries that must be known now, such as fit end."""
        if token.t_s is None:
            event = token.event
            if event is not None:
                with self._torch.cuda.device(self.device):
                    event.synchronize()
            t_s = self.resolve(token)
            if t_s is None:
                raise RuntimeError("a CUDA event reported incomplete right after synchronize()")
        return token.t_s

    def _poll_candidate(self) -> None:
        """Adopt the candidate anchor if the device has reached it (lock held, device set)."""
        candidate = self._candidate
        if candidate is None:
            return
        before_s = time.perf_counter()
        if not candidate.event.query():
            candidate.not_done_s = before_s
            return
        done_s = time.perf_counter()
        anchor = self._anchor
        extrapolated_s = anchor.t_s + anchor.event.elapsed_time(candidate.event) / MS_PER_S
        self._anchor = _Anchor(candidate.event, min(max(extrapolated_s, candidate.not_done_s), done_s))
        self._candidate = None


_DEVICE_CLOCKS: dict[tuple[str, int], CudaEventClock] = {}
_DEVICE_CLOCKS_LOCK = threading.Lock()
_HOST_CLOCK = HostClock()


def device_clock(device: Any) -> CudaEventClock | HostClock:
    """The process's one clock for ``device``: a :class:`CudaEventClock` per CUDA device (created on
    first use, on the calling thread, which should have that device current), the host clock otherwise."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return _HOST_CLOCK
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _DEVICE_CLOCKS_LOCK:
        clock = _DEVICE_CLOCKS.get((device.type, index))
        if clock is None:
            clock = _DEVICE_CLOCKS[(device.type, index)] = CudaEventClock(torch.device("cuda", index))
        return clock
