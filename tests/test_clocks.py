"""The clocks that put boundaries on the sampler's time axis, against a fake asynchronous CUDA device.

The fake device (``fakes_nvml.FakeTorch``) completes each event ``lag_s`` (up to 0.5 s) after it is
recorded, on a fake host clock the test advances; ``synchronize`` advances that clock to the event's
completion, as a blocking call would. Times are multiples of 1/8 s, so every expected number is exact.
"""

from __future__ import annotations

import sys
import threading
import types

import pytest

from conftest import FakeClock
from fakes_nvml import FakeCuda, FakeTorch
from lightning_energy.measure import clocks

HOUR_S = 3600.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def torch_fake(monkeypatch, clock) -> FakeTorch:
    """A two-GPU fake torch; the host clock of ``lightning_energy.measure.clocks`` is the fake clock; the
    process-wide clock cache starts empty; the test (training) thread has set device 1, as Lightning does."""
    fake = FakeTorch(clock, device_count=2)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(clocks, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(clocks, "_DEVICE_CLOCKS", {}, raising=False)
    monkeypatch.setattr(clocks, "find_capture_mode_exchange", lambda: None, raising=False)  # no CUDA driver
    fake.cuda.set_device(1)
    return fake


def resolve_on_sampler_thread(clock_under_test, token):
    """``resolve`` called from a fresh thread named "sampler" (whose current CUDA device is 0)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(clock_under_test.resolve(token)), name="sampler")
    thread.start()
    thread.join()
    return result[0]


def test_host_clock_resolves_and_waits_at_once(monkeypatch, clock):
    monkeypatch.setattr(clocks, "time", types.SimpleNamespace(perf_counter=clock))
    host = clocks.HostClock()
    token = host.record()
    clock.advance(5.0)
    assert not host.asynchronous
    assert host.resolve(token) == host.wait(token) == 1000.0
    host.reanchor()  # nothing to do, nothing raised


def test_a_boundary_resolves_to_when_the_device_reached_it_never_to_when_it_was_asked(torch_fake, clock):
    cuda_clock = clocks.CudaEventClock("cuda:1")
    torch_fake.cuda.lag_s = 0.5  # the GPU is half a second behind the Python code
    token = cuda_clock.record()  # host 1000.0: the device gets there at 1000.5
    assert cuda_clock.resolve(token) is None
    clock.advance(0.375)
    assert cuda_clock.resolve(token) is None  # 1000.375: not yet
    clock.advance(0.5)  # 1000.875: the sampler asks late
    assert cuda_clock.resolve(token) == 1000.5  # the device's time, not the time of the question
    assert cuda_clock.resolve(token) == 1000.5
    assert torch_fake.cuda.synchronizes == 1  # the first anchor, at construction; none per boundary


def test_wait_blocks_until_the_device_reaches_the_boundary(torch_fake, clock):
    cuda_clock = clocks.CudaEventClock("cuda:1")
    torch_fake.cuda.lag_s = 0.375
    token = cuda_clock.record()
    clock.advance(0.125)
    assert cuda_clock.resolve(token) is None
    assert cuda_clock.wait(token) == 1000.375
    assert clock() == 1000.375  # blocked exactly until the device got there
    assert torch_fake.cuda.synchronizes == 2
    assert cuda_clock.wait(token) == 1000.375 and torch_fake.cuda.synchronizes == 2  # known: no second wait


def test_the_sampling_thread_queries_events_on_the_clock_device_not_on_gpu_0(torch_fake, clock):
    cuda_clock = clocks.CudaEventClock("cuda:1")
    torch_fake.cuda.lag_s = 0.25
    token = cuda_clock.record()
    assert resolve_on_sampler_thread(cuda_clock, token) is None
    clock.advance(0.25)
    assert resolve_on_sampler_thread(cuda_clock, token) == 1000.25
    sampler_calls = [(call, device) for call, thread, device in torch_fake.cuda.calls if thread == "sampler"]
    assert ("cudaEventQuery", 1) in sampler_calls
    assert all(device == 1 for _, device in sampler_calls), sampler_calls
    assert ("sampler", 1) in torch_fake.cuda.entries  # under torch.cuda.device(1)
    assert torch_fake.cuda.contexts == {1}  # no CUDA context created on GPU 0


def test_wait_on_another_thread_synchronizes_on_the_clock_device(torch_fake, clock):
    cuda_clock = clocks.CudaEventClock("cuda:1")
    torch_fake.cuda.lag_s = 0.5
    token = cuda_clock.record()
    result = []
    thread = threading.Thread(target=lambda: result.append(cuda_clock.wait(token)), name="waiter")
    thread.start()
    thread.join()
    assert result == [1000.5]
    assert ("cudaEventSynchronize", "waiter", 1) in torch_fake.cuda.calls
    assert torch_fake.cuda.contexts == {1}


def test_reanchoring_keeps_float64_precision_over_24_hours(torch_fake, clock):
    """A boundary every 10 s for 24 h, each completing 0 to 0.5 s late: every one resolves to its exact
    completion time. Timed from the first anchor, elapsed_time would span up to 8.64e7 ms, which float32
    resolves to 8 ms; re-anchored every 60 s it never spans more than 71.125 s."""
    cuda_clock = clocks.CudaEventClock("cuda:1")  # re-anchors every 60 s by default
    errors = []
    for step in range(int(24 * HOUR_S / 10)):
        clock.advance(10.0)
        torch_fake.cuda.lag_s = (step % 5) * 0.125  # 0, 0.125, ..., 0.5 s behind
        token = cuda_clock.record()
        expected = clock() + torch_fake.cuda.lag_s
        clock.advance(0.625)  # the sampler gets to it after it completed
        errors.append(cuda_clock.resolve(token) - expected)
    assert max(abs(e) for e in errors) == 0.0
    assert torch_fake.cuda.longest_elapsed_ms <= (60.0 + 10.625 + 0.5) * 1000  # period + spacing + lag
    assert token.anchor.t_s > clock() - 72.0  # the last boundary is timed from a recent anchor
    assert torch_fake.cuda.synchronizes == 1  # re-anchoring never synchronizes


@pytest.mark.parametrize("drift", [2.0**-14, -(2.0**-14)])  # +-61 ppm: 5.3 s a day
def test_reanchoring_bounds_the_drift_between_gpu_and_host_clocks(torch_fake, clock, drift):
    """The sampler polls every 0.125 s; a boundary every 10 s for 24 h, lagging 0 to 0.5 s. Each anchor's
    host time is known to within one poll interval, so no boundary is off by more than that plus the
    drift over one re-anchoring period (61 ppm x 71 s = 4.3 ms), where the first anchor alone would be
    5.3 s off by the end of the day."""
    poll_s = 0.125
    torch_fake.cuda.drift = drift
    cuda_clock = clocks.CudaEventClock("cuda:1")  # re-anchors every 60 s by default
    worst = 0.0
    for step in range(int(24 * HOUR_S / 10)):
        clock.advance(10.0 - 5 * poll_s)
        torch_fake.cuda.lag_s = (step % 5) * 0.125
        token = cuda_clock.record()
        expected = clock() + torch_fake.cuda.lag_s
        for _ in range(5):  # polls at +0.125 ... +0.625 s: the last finds every boundary complete
            clock.advance(poll_s)
            t = cuda_clock.resolve(token)
        worst = max(worst, abs(t - expected))
    assert worst <= poll_s + abs(drift) * 71.0
    assert worst > 0.0  # the drift is there to bound


def test_reanchor_takes_a_new_anchor_without_synchronizing(torch_fake, clock):
    cuda_clock = clocks.CudaEventClock("cuda:1")  # re-anchors every 60 s by default
    first = cuda_clock.record()
    clock.advance(5.0)
    torch_fake.cuda.lag_s = 0.25
    cuda_clock.reanchor()  # an epoch end: 1005.0, complete at 1005.25
    assert torch_fake.cuda.synchronizes == 1 and clock() == 1005.0  # did not block
    before = cuda_clock.record()  # recorded before the new anchor is known: timed from the old one
    clock.advance(0.125)
    assert cuda_clock.resolve(before) is None
    clock.advance(0.25)
    assert cuda_clock.resolve(before) == 1005.25
    after = cuda_clock.record()
    assert first.anchor.t_s == before.anchor.t_s == 1000.0 and after.anchor.t_s == 1005.25


def test_one_clock_per_device_per_process(torch_fake, clock):
    first = clocks.device_clock("cuda:1")
    assert clocks.device_clock(torch_fake.device("cuda", 1)) is first
    assert clocks.device_clock("cuda") is first  # no index: the current device (1)
    assert first.device == torch_fake.device("cuda", 1)
    assert torch_fake.cuda.synchronizes == 1  # one first anchor for the device, however many meters
    other = clocks.device_clock("cuda:0")
    assert other is not first and other.device == torch_fake.device("cuda", 0)
    host = clocks.device_clock("cpu")
    assert host is clocks.device_clock("cpu") and not host.asynchronous


def test_a_cuda_clock_refuses_a_cpu_device(torch_fake):
    with pytest.raises(ValueError, match="CUDA device"):
        clocks.CudaEventClock("cpu")


# ------------------------------------------------------------------------ CUDA-graph captures
EVENT_CALLS = ("cudaEventQuery", "cudaEventSynchronize", "cudaEventElapsedTime")


class CapturingCuda(FakeCuda):
    """``FakeCuda`` with CUDA-graph capture and per-thread capture modes, as CUDA has them: while a thread
    captures in the global mode, an event call from another thread whose mode is global too fails and
    invalidates the capture (the NCCL watchdog's crash, pytorch#104487). ``exchange_capture_mode`` stands
    in for the driver's ``cuThreadExchangeStreamCaptureMode`` (every thread starts in the global mode)."""

    def __init__(self, clock) -> None:
        super().__init__(clock, clock.advance, 2, [], 0.0, 0.0)
        self.capturing_thread: str | None = None
        self.capture_invalidated = False
        self.exchanges: list[tuple[str, int]] = []
        self._modes = threading.local()

    def exchange_capture_mode(self, mode: int) -> int:
        previous = getattr(self._modes, "mode", clocks.CAPTURE_MODE_GLOBAL)
        self._modes.mode = mode
        self.exchanges.append((threading.current_thread().name, mode))
        return previous

    def begin_capture(self) -> None:
        self.capturing_thread = threading.current_thread().name

    def end_capture(self) -> None:
        self.capturing_thread = None

    def is_current_stream_capturing(self) -> bool:
        return self.capturing_thread == threading.current_thread().name

    def _runtime(self, call: str, device: int) -> None:
        me = threading.current_thread().name
        mode = getattr(self._modes, "mode", 0)
        if call in EVENT_CALLS and self.capturing_thread not in (None, me) and mode == 0:
            self.capture_invalidated = True
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        super()._runtime(call, device)


class CapturingTorch(FakeTorch):
    def __init__(self, clock) -> None:
        super().__init__(clock, device_count=2)
        self.cuda = CapturingCuda(clock)


@pytest.fixture
def capturing_torch(monkeypatch, clock) -> CapturingTorch:
    fake = CapturingTorch(clock)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(clocks, "time", types.SimpleNamespace(perf_counter=clock))
    fake.cuda.set_device(1)
    return fake


def query_on_sampler_thread(clock_under_test, token):
    """``resolve`` on a thread named "sampler": its result, or the exception it raised."""
    result = []

    def query():
        try:
            result.append(clock_under_test.resolve(token))
        except Exception as err:
            result.append(err)

    thread = threading.Thread(target=query, name="sampler")
    thread.start()
    thread.join()
    return result[0]


def test_event_queries_on_the_sampling_thread_never_break_a_graph_capture(monkeypatch, capturing_torch, clock):
    """The training thread captures a CUDA graph in torch's default global mode while a boundary recorded
    before the capture is pending: the sampling thread queries it in the thread-local mode, which ignores
    other threads' captures, and puts its own mode back."""
    monkeypatch.setattr(clocks, "find_capture_mode_exchange", lambda: capturing_torch.cuda.exchange_capture_mode,
                        raising=False)
    cuda_clock = clocks.CudaEventClock("cuda:1")
    token = cuda_clock.record()  # complete at once (no lag)
    capturing_torch.cuda.begin_capture()
    clock.advance(0.125)
    assert query_on_sampler_thread(cuda_clock, token) == 1000.0
    assert not capturing_torch.cuda.capture_invalidated
    sampler_modes = [mode for thread, mode in capturing_torch.cuda.exchanges if thread == "sampler"]
    assert sampler_modes == [clocks.CAPTURE_MODE_THREAD_LOCAL, clocks.CAPTURE_MODE_GLOBAL]  # and back


def broken_exchange(mode: int) -> int:
    raise RuntimeError("cuThreadExchangeStreamCaptureMode failed with CUDA driver error 3")


@pytest.mark.parametrize("exchange", [None, broken_exchange], ids=["no driver library", "driver call failing"])
def test_without_the_driver_call_the_clock_does_not_query_while_the_training_thread_captures(
        monkeypatch, capturing_torch, clock, exchange):
    monkeypatch.setattr(clocks, "find_capture_mode_exchange", lambda: exchange, raising=False)
    cuda_clock = clocks.CudaEventClock("cuda:1")
    before = cuda_clock.record()
    capturing_torch.cuda.begin_capture()
    cuda_clock.record()  # a mark inside the capture: the clock notes it
    clock.advance(0.125)
    assert query_on_sampler_thread(cuda_clock, before) is None  # not queried: "not reached yet"
    assert not capturing_torch.cuda.capture_invalidated
    capturing_torch.cuda.end_capture()
    cuda_clock.record()
    assert query_on_sampler_thread(cuda_clock, before) == 1000.0
    assert not capturing_torch.cuda.capture_invalidated


def test_the_driver_call_is_found_only_where_the_cuda_driver_is(monkeypatch):
    monkeypatch.setattr(clocks, "CUDA_DRIVER_LIBRARY", "libcuda-that-is-not-here.so.1")
    assert clocks.find_capture_mode_exchange() is None


def test_the_driver_call_exchanges_the_calling_threads_capture_mode(monkeypatch):
    """``find_capture_mode_exchange`` through ctypes, against a C-callable stand-in for the driver's
    ``CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)``."""
    import ctypes

    driver = {"mode": clocks.CAPTURE_MODE_GLOBAL, "result": 0}

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
    def exchange_in_the_driver(mode):
        driver["mode"], mode[0] = mode[0], driver["mode"]
        return driver["result"]

    library = types.SimpleNamespace(cuThreadExchangeStreamCaptureMode=exchange_in_the_driver)
    fake_ctypes = types.SimpleNamespace(CDLL=lambda name: library, c_int=ctypes.c_int, POINTER=ctypes.POINTER,
                                        byref=ctypes.byref)
    monkeypatch.setattr(clocks, "ctypes", fake_ctypes)
    exchange = clocks.find_capture_mode_exchange()
    assert exchange(clocks.CAPTURE_MODE_THREAD_LOCAL) == clocks.CAPTURE_MODE_GLOBAL
    assert driver["mode"] == clocks.CAPTURE_MODE_THREAD_LOCAL
    assert exchange(clocks.CAPTURE_MODE_GLOBAL) == clocks.CAPTURE_MODE_THREAD_LOCAL
    driver["result"] = 3  # CUDA_ERROR_NOT_INITIALIZED
    with pytest.raises(RuntimeError, match="cuThreadExchangeStreamCaptureMode failed with CUDA driver error 3"):
        exchange(clocks.CAPTURE_MODE_THREAD_LOCAL)


def test_a_driver_call_that_fails_only_on_the_sampling_thread_falls_back_without_raising(
        monkeypatch, capturing_torch, clock):
    """The round trip works on the thread that made the clock; on the sampling thread the call fails (say, no
    context current there): the query goes on without it, and from then on the clock uses the fallback."""
    def exchange(mode: int) -> int:
        if threading.current_thread().name == "sampler":
            raise RuntimeError("cuThreadExchangeStreamCaptureMode failed with CUDA driver error 201")
        return capturing_torch.cuda.exchange_capture_mode(mode)

    monkeypatch.setattr(clocks, "find_capture_mode_exchange", lambda: exchange, raising=False)
    cuda_clock = clocks.CudaEventClock("cuda:1")
    token = cuda_clock.record()
    clock.advance(0.125)
    assert query_on_sampler_thread(cuda_clock, token) == 1000.0  # resolved, no exception
    assert cuda_clock.capture_mode_exchange_failed
    capturing_torch.cuda.begin_capture()
    later = cuda_clock.record()  # the fallback notes the capture
    clock.advance(0.125)
    assert query_on_sampler_thread(cuda_clock, later) is None and not capturing_torch.cuda.capture_invalidated
