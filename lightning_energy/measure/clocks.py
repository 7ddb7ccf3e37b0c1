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

CUDA graphs. A user's CUDA-graph capture in torch's default ``capture_error_mode="global"`` forbids
"potentially unsafe" CUDA calls, event queries included, on every other thread of the process that is in
the global capture mode too (every thread is, by default): a query on the sampling thread would break the
capture on the training thread (PyTorch's own NCCL watchdog did; pytorch#104487, fixed in #148594 by
querying in the thread-local capture mode). So every event call of :class:`CudaEventClock` runs with the
calling thread switched to ``cudaStreamCaptureModeThreadLocal`` for its duration, which ignores captures
of other threads. torch does not expose ``cudaThreadExchangeStreamCaptureMode`` to Python, so the driver's
own ``cuThreadExchangeStreamCaptureMode`` is called through ctypes (:func:`find_capture_mode_exchange`).
Where the driver library cannot be loaded or its call fails, the clock falls back to not querying while the
training thread was capturing when it last recorded a mark (best effort: a capture that begins after the
last mark is not seen).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator
from lightning_energy.units import MS_PER_S

REANCHOR_PERIOD_S = 60.0  # a CUDA clock takes a fresh anchor at most this often (s)
# cudaStreamCaptureMode / CUstreamCaptureMode (the same values in the runtime and the driver)
CAPTURE_MODE_GLOBAL = 0
CAPTURE_MODE_THREAD_LOCAL = 1
CUDA_DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"

CaptureModeExchange = Callable[[int], int]  # sets the calling thread's capture mode, returns the previous one


def find_capture_mode_exchange() -> CaptureModeExchange | None:
    """The driver's ``cuThreadExchangeStreamCaptureMode`` as ``exchange(mode) -> previous mode``, or None
    where the CUDA driver library or the function is missing. Raises ``RuntimeError`` on a CUDA error."""
    try:
        driver = ctypes.CDLL(CUDA_DRIVER_LIBRARY)
        function = driver.cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.POINTER(ctypes.c_int)]
    function.restype = ctypes.c_int

    def exchange(mode: int) -> int:
        value = ctypes.c_int(mode)
        result = function(ctypes.byref(value))
        if result != 0:
            raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed with CUDA driver error {result}")
        return value.value

    return exchange


def _working(exchange: CaptureModeExchange | None) -> CaptureModeExchange | None:
    """``exchange`` if a round trip on the calling thread works (the mode set, then put back), else None."""
    if exchange is None:
        return None
    try:
        exchange(exchange(CAPTURE_MODE_THREAD_LOCAL))  # the inner call returns the mode to put back
    except RuntimeError:
        return None
    return exchange


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

    def __repr__(self) -> str:
        return "HostClock()"


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
    creates a CUDA context on another GPU; and in the thread-local capture mode, so that they never
    break another thread's CUDA-graph capture (see the module docstring; ``capture_mode_exchange``:
    default :func:`find_capture_mode_exchange`).
    """

    asynchronous = True

    def __init__(self, device: Any, reanchor_period_s: float = REANCHOR_PERIOD_S,
                 capture_mode_exchange: CaptureModeExchange | None = None) -> None:
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
        # without the exchange: whether the training thread was capturing a CUDA graph at its last mark
        self._training_thread_capturing = False
        with torch.cuda.device(device):
            event = self._new_event()
            event.record(torch.cuda.current_stream(device))
            event.synchronize()
            self._anchor = _Anchor(event, time.perf_counter())
            self._exchange_capture_mode = _working(capture_mode_exchange or find_capture_mode_exchange())
        self.capture_mode_exchange_failed = False  # True once a call failed on another thread (then: the fallback)

    # --- training thread ------------------------------------------------------------------------
    def record(self) -> CudaToken:
        """A boundary at the end of the work queued so far on the current stream (no synchronisation)."""
        if self._exchange_capture_mode is None:
            self._training_thread_capturing = self._current_stream_capturing()
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

    def _current_stream_capturing(self) -> bool:
        capturing = getattr(self._torch.cuda, "is_current_stream_capturing", None)
        return bool(capturing()) if capturing is not None else False

    def __repr__(self) -> str:
        return f"CudaEventClock({self.device})"

    @contextlib.contextmanager
    def _querying(self) -> Iterator[None]:
        """Event calls from here: the clock's device current, the calling thread in the thread-local
        capture mode (restored after), so that another thread's CUDA-graph capture is never broken."""
        with self._torch.cuda.device(self.device):
            exchange = self._exchange_capture_mode
            previous = None
            if exchange is not None:
                try:
                    previous = exchange(CAPTURE_MODE_THREAD_LOCAL)
                except RuntimeError:  # works on the thread that made the clock, not here: fall back for good
                    self._give_up_capture_mode_exchange()
            try:
                yield
            finally:
                if previous is not None:
                    try:
                        exchange(previous)
                    except RuntimeError:  # the thread may stay thread-local: harmless for this thread's queries
                        self._give_up_capture_mode_exchange()

    def _give_up_capture_mode_exchange(self) -> None:
        """From now on, the fallback: no event query while the training thread was capturing at its last mark."""
        self._exchange_capture_mode = None
        self.capture_mode_exchange_failed = True

    # --- any thread -----------------------------------------------------------------------------
    def resolve(self, token: CudaToken) -> float | None:
        """The host time (s) at which the device reached ``token``, or None if it has not yet. Never blocks.

        Without the capture-mode exchange, None while the training thread was capturing a CUDA graph at
        its last mark (no query then)."""
        if token.t_s is not None or self._training_thread_capturing:
            return token.t_s
        return self._query(token)

    def _query(self, token: CudaToken) -> float | None:
        with self._lock, self._querying():
            self._poll_candidate()
            if token.t_s is None and token.event.query():
                anchor = token.anchor
                token.t_s = anchor.t_s + anchor.event.elapsed_time(token.event) / MS_PER_S
                self._spare_events.append(token.event)
                token.event = None
        return token.t_s

    def wait(self, token: CudaToken) -> float:
        """The host time (s) at which the device reached ``token``, blocking until it has (one
        ``event.synchronize()``). For the rare boundaries that must be known now, such as fit end. Its
        caller (the training thread) is not capturing a graph while it waits."""
        if token.t_s is None:
            event = token.event
            if event is not None:
                with self._querying():
                    event.synchronize()
            self._training_thread_capturing = False
            t_s = self._query(token)
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
