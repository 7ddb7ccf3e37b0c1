"""A fake ``amdsmi`` module (AMD SMI's Python interface) over fake AMD GPUs, on a clock the test controls.

It follows the documented semantics of amdsmi 7.0 (``amdsmi_interface.py`` and AMD's "AMD SMI Python API
reference"); its names, constants, signatures and exception classes are checked against the installed
``amdsmi`` package in ``tests/test_amdsmi_fake.py``.

- ``amdsmi_init(flag)`` / ``amdsmi_shut_down()``: NOT reference counted (``amd_smi.cc``: a second init is a
  no-op, one shut-down ends the library for the whole process); a device call after it raises
  ``AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)``.
- ``amdsmi_get_processor_handles()``: one opaque handle per GPU, in amd-smi's order (PCI BDF order);
  ``amdsmi_get_gpu_enumeration_info`` gives each its ``hip_id`` (the HIP runtime's index before any
  ``*_VISIBLE_DEVICES`` masking; it may differ from the BDF order) and ``hip_uuid``.
- ``amdsmi_get_energy_count``: ``{"energy_accumulator", "counter_resolution", "timestamp"}``: the
  accumulator counts ``counter_resolution`` µJ (15.3 µJ, a float) per unit since the driver loaded (plus
  ``FakeAmdGpu.counter_start``), refreshed every ``FakeAmdGpu.update_period_s`` (1 ms: AMD says the driver
  reads the SMU's metrics at most every 1 ms and returns its cached copy in between); ``timestamp`` is
  that refresh's time in ns. ``counter_bits=32`` models the 32-bit accumulator of gpu_metrics v1.0
  (``amdsmi.h``: "v1 mod. (32->64)"), which wraps every 2**32 × 15.3 µJ = 65.7 kJ. ``legacy_power_key``:
  the key was ``power`` before ROCm 6.4. ``NOT_SUPPORTED`` where the GPU has no counter (a VM guest).
- ``amdsmi_get_power_info``: W as integers; ``current_socket_power`` (instantaneous, MI300 and newer) and
  ``average_socket_power`` (an average, MI200 and older; this fake averages over ``average_window_s``);
  a field the GPU lacks reads ``"N/A"`` (the library maps 0xFFFF to it).
- ``amdsmi_get_gpu_activity`` (%), ``amdsmi_get_clock_info`` (MHz), ``amdsmi_get_temp_metric`` (millidegrees
  Celsius, as AMD's API reference says).
- ``amdsmi_get_gpu_process_list``: one dict per process using the GPU (``pid``, ``name``, ``mem`` ...).
- ``amdsmi_get_gpu_compute_partition`` / ``_memory_partition``: ``"SPX"``, ``"CPX"`` ..., ``"NPS1"`` ...;
  ``NOT_SUPPORTED`` before MI300 (``None`` here).
- ``amdsmi_get_power_cap_info``: µW (``power_cap``, ``default_power_cap``, ``min_power_cap``, ``max_power_cap``,
  ``dpm_cap``); ``amdsmi_set_power_cap(handle, sensor_ind, cap)``: µW, ``NO_PERM`` without root,
  ``INVAL`` outside [min, max]. The cap is the card's: it survives ``amdsmi_shut_down``.
- Any call can take time (``latency_s``), be held until released (:meth:`FakeAmdSmi.block`), or fail with
  a status code (:meth:`FakeAmdSmi.fail`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable

# ------------------------------------------------------------------------------------ constants (amdsmi_wrapper)
AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_TIMEOUT = 8
AMDSMI_STATUS_RETRY = 9
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_BUSY = 30
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
AMDSMI_STATUS_NO_DATA = 40
AMDSMI_STATUS_FILE_NOT_FOUND = 52
AMDSMI_STATUS_UNKNOWN_ERROR = 4294967295

AMDSMI_MAX_DEVICES = 32
AMDSMI_GPU_UUID_SIZE = 38
MAX_NUM_PROCESSES = 1024

COUNTER_RESOLUTION_UJ = 15.3  # µJ per accumulator unit (AMD's documentation; reported as a float32)
UPDATE_PERIOD_S = 0.001  # the driver refreshes its copy of the SMU metrics at most every 1 ms
AVERAGE_WINDOW_S = 1.0  # average_socket_power's window (an assumption of this fake; AMD does not document it)

_ERROR_TEXT = {  # as amdsmi_exception.AmdSmiLibraryException.set_err_info writes them
    AMDSMI_STATUS_INVAL: "AMDSMI_STATUS_INVAL - Invalid parameters",
    AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    AMDSMI_STATUS_TIMEOUT: "AMDSMI_STATUS_TIMEOUT - Timeout in API call",
    AMDSMI_STATUS_RETRY: "AMDSMI_STATUS_RETRY - Retry operation",
    AMDSMI_STATUS_NO_PERM: "AMDSMI_STATUS_NO_PERM - Permission Denied",
    AMDSMI_STATUS_INIT_ERROR: "AMDSMI_STATUS_INIT_ERROR - Initialization error",
    AMDSMI_STATUS_BUSY: "AMDSMI_STATUS_BUSY - Device busy",
    AMDSMI_STATUS_NOT_FOUND: "AMDSMI_STATUS_NOT_FOUND - Device Not found",
    AMDSMI_STATUS_NOT_INIT: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    AMDSMI_STATUS_DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded",
    AMDSMI_STATUS_NO_DATA: "AMDSMI_STATUS_NO_DATA - No data was found for given input",
    AMDSMI_STATUS_FILE_NOT_FOUND: "AMDSMI_STATUS_FILE_NOT_FOUND - File or directory not found",
}


# ------------------------------------------------------------------------------------ enums (amdsmi_interface)
class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 4294967295
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8
    INIT_AMD_APUS = 3


class AmdSmiClkType(IntEnum):
    GFX = 0
    MEM = 4


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0


class AmdSmiComputePartitionType(IntEnum):
    SPX = 1
    DPX = 2
    TPX = 3
    QPX = 4
    CPX = 5
    INVALID = 0


# ------------------------------------------------------------------------------------ exceptions (amdsmi_exception)
class AmdSmiException(Exception):
    """Base smi exception class"""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code):
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _ERROR_TEXT.get(err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred")

    def __str__(self):
        return "Error code:\n\t{err_code} | {err_info}".format(err_code=self.err_code, err_info=self.err_info)

    def get_error_info(self, detailed=True):
        return self.err_info if detailed else str(self.err_info).split(" - ")[0]

    def get_error_code(self):
        return self.err_code


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self):
        super().__init__(AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self):
        super().__init__(AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, receivedValue, expectedType, msg=None):
        super().__init__(msg)
        self.err_code = None
        self.err_msg = msg or f"Invalid parameter:\nActual type: {type(receivedValue)}\nExpected type: {expectedType}"

    def __str__(self):
        return self.err_msg


# ------------------------------------------------------------------------------------ fake GPUs
@dataclass
class FakeAmdGpu:
    """One AMD GPU (or GCD) as amdsmi sees it. Power in W (``power_W``) changes with :meth:`FakeAmdSmi.set_power`."""

    bdf: str
    uuid: str  # amdsmi_get_gpu_device_uuid
    hip_id: int
    hip_uuid: str = ""
    market_name: str = "AMD Instinct MI300X"
    has_energy_counter: bool = True
    counter_bits: int = 64
    counter_start: int = 0  # the accumulator's value when the fake driver loads (units of the resolution)
    legacy_power_key: bool = False  # amdsmi before ROCm 6.4 named the accumulator "power"
    resolution_uJ: float = COUNTER_RESOLUTION_UJ
    update_period_s: float = UPDATE_PERIOD_S
    has_current_power: bool = True  # current_socket_power (MI300 and newer)
    has_average_power: bool = False  # average_socket_power (MI200 and older)
    compute_partition: str | None = "SPX"  # None: the query is not supported (before MI300)
    memory_partition: str | None = "NPS1"
    process_pids: list = field(default_factory=list)
    power_W: float = 300.0
    activity_pct: tuple[int, int] = (95, 40)  # (gfx, umc)
    clocks_MHz: tuple[int, int] = (2100, 1300)  # (GFX, MEM)
    hotspot_mC: int = 65_000  # millidegrees Celsius
    cap_range_uW: tuple[int, int] = (200_000_000, 750_000_000)
    default_cap_uW: int = 750_000_000
    cap_uW: int = 750_000_000
    root: bool = True
    cap_log: list = field(default_factory=list)
    _segments: list[tuple[float, float]] = field(default_factory=list)


class _Handle:
    """An opaque processor handle (the real one is a ctypes ``c_void_p``)."""

    def __init__(self, index: int) -> None:
        self.index = index


class FakeAmdSmi:
    """A stand-in for the ``amdsmi`` module over :class:`FakeAmdGpu` s, on ``clock`` (s). Install it for code
    that imports amdsmi with ``monkeypatch.setitem(sys.modules, "amdsmi", fake)``."""

    AmdSmiInitFlags = AmdSmiInitFlags
    AmdSmiClkType = AmdSmiClkType
    AmdSmiTemperatureType = AmdSmiTemperatureType
    AmdSmiTemperatureMetric = AmdSmiTemperatureMetric
    AmdSmiComputePartitionType = AmdSmiComputePartitionType
    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiRetryException = AmdSmiRetryException
    AmdSmiTimeoutException = AmdSmiTimeoutException
    AmdSmiParameterException = AmdSmiParameterException

    def __init__(self, gpus: list[FakeAmdGpu], clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], object] | None = None) -> None:
        self.gpus = list(gpus)
        self.clock = clock
        self.sleep = sleep or getattr(clock, "advance", time.sleep)
        self.loaded_at_s = clock()
        for gpu in self.gpus:
            gpu._segments = [(self.loaded_at_s, gpu.power_W)]
        self.initialised = False
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: Counter = Counter()
        self.latency_s: dict[str, float] = {}
        self._gates: dict[str, threading.Event] = {}
        self._failures: dict[str, int] = {}

    # --- test controls ------------------------------------------------------------------------
    def set_power(self, index: int, watts: float) -> None:
        gpu = self.gpus[index]
        gpu.power_W = watts
        gpu._segments.append((self.clock(), watts))

    def block(self, name: str) -> threading.Event:
        gate = self._gates[name] = threading.Event()
        return gate

    def fail(self, name: str, code: int | None) -> None:
        """Calls to ``name`` raise ``AmdSmiLibraryException(code)`` from now on (``None``: stop failing)."""
        if code is None:
            self._failures.pop(name, None)
        else:
            self._failures[name] = code

    def energy_J(self, index: int, at_s: float) -> float:
        """The exact energy (J) GPU ``index`` used from driver load to ``at_s``."""
        segments = self.gpus[index]._segments
        total = 0.0
        for i, (start, watts) in enumerate(segments):
            end = segments[i + 1][0] if i + 1 < len(segments) else math.inf
            if at_s <= start:
                break
            total += watts * (min(end, at_s) - start)
        return total

    # --- plumbing -----------------------------------------------------------------------------
    def _enter(self, name: str, handle=None, needs_init: bool = True) -> FakeAmdGpu | None:
        self.calls[name] += 1
        gate = self._gates.get(name)
        if gate is not None:
            gate.wait(timeout=60.0)
        if self.latency_s.get(name):
            self.sleep(self.latency_s[name])
        if name in self._failures:
            raise AmdSmiLibraryException(self._failures[name])
        if needs_init and not self.initialised:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        if handle is None:
            return None
        if not isinstance(handle, _Handle):
            raise AmdSmiParameterException(handle, "amdsmi_processor_handle")
        return self.gpus[handle.index]

    def _last_update_s(self, gpu: FakeAmdGpu) -> float:
        updates = math.floor((self.clock() - self.loaded_at_s) / gpu.update_period_s + 1e-9)
        return self.loaded_at_s + updates * gpu.update_period_s

    def _average_W(self, index: int) -> float:
        now = self.clock()
        start = max(now - AVERAGE_WINDOW_S, self.loaded_at_s)
        if now <= start:
            return self.gpus[index].power_W
        return (self.energy_J(index, now) - self.energy_J(index, start)) / (now - start)

    # --- library --------------------------------------------------------------------------------
    def amdsmi_init(self, flag=AmdSmiInitFlags.INIT_AMD_GPUS):
        self._enter("amdsmi_init", needs_init=False)
        if not isinstance(flag, AmdSmiInitFlags):
            raise AmdSmiParameterException(flag, AmdSmiInitFlags)
        self.init_calls += 1
        self.initialised = True  # a second init is a no-op (amd_smi.cc)

    def amdsmi_shut_down(self):
        self._enter("amdsmi_shut_down", needs_init=False)
        self.shutdown_calls += 1
        self.initialised = False  # one shut-down ends it for every user in the process

    def amdsmi_get_processor_handles(self):
        self._enter("amdsmi_get_processor_handles")
        return [_Handle(i) for i in range(len(self.gpus))]

    def amdsmi_get_gpu_device_bdf(self, processor_handle):
        return self._enter("amdsmi_get_gpu_device_bdf", processor_handle).bdf

    def amdsmi_get_gpu_device_uuid(self, processor_handle):
        return self._enter("amdsmi_get_gpu_device_uuid", processor_handle).uuid

    def amdsmi_get_gpu_enumeration_info(self, processor_handle):
        gpu = self._enter("amdsmi_get_gpu_enumeration_info", processor_handle)
        index = processor_handle.index
        return {"drm_render": 128 + index, "drm_card": index, "hsa_id": index + 1, "hip_id": gpu.hip_id,
                "hip_uuid": gpu.hip_uuid}

    def amdsmi_get_gpu_asic_info(self, processor_handle):
        gpu = self._enter("amdsmi_get_gpu_asic_info", processor_handle)
        return {"market_name": gpu.market_name, "vendor_id": "0x1002", "vendor_name": "Advanced Micro Devices Inc.",
                "subvendor_id": "0x1002", "device_id": "0x74a1", "rev_id": "0x00", "asic_serial": "0x0000000000000000",
                "oam_id": 0, "num_compute_units": 304, "target_graphics_version": "gfx942", "subsystem_id": "0x74a1"}

    # --- energy and power -----------------------------------------------------------------------
    def amdsmi_get_energy_count(self, processor_handle):
        gpu = self._enter("amdsmi_get_energy_count", processor_handle)
        if not gpu.has_energy_counter:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        updated_s = self._last_update_s(gpu)
        units = int(math.floor(self.energy_J(processor_handle.index, updated_s) * 1e6 / gpu.resolution_uJ + 1e-6))
        value = (gpu.counter_start + units) % (2 ** gpu.counter_bits)
        key = "power" if gpu.legacy_power_key else "energy_accumulator"
        return {key: value, "counter_resolution": gpu.resolution_uJ, "timestamp": int(round(updated_s * 1e9))}

    def amdsmi_get_power_info(self, processor_handle):
        gpu = self._enter("amdsmi_get_power_info", processor_handle)
        current = int(round(gpu.power_W)) if gpu.has_current_power else "N/A"
        average = int(round(self._average_W(processor_handle.index))) if gpu.has_average_power else "N/A"
        return {"socket_power": current if gpu.has_current_power else average, "current_socket_power": current,
                "average_socket_power": average, "gfx_voltage": 800, "soc_voltage": 900, "mem_voltage": 1100,
                "power_limit": gpu.cap_uW // 1_000_000}

    # --- telemetry ------------------------------------------------------------------------------
    def amdsmi_get_gpu_activity(self, processor_handle):
        gpu = self._enter("amdsmi_get_gpu_activity", processor_handle)
        return {"gfx_activity": gpu.activity_pct[0], "umc_activity": gpu.activity_pct[1], "mm_activity": "N/A"}

    def amdsmi_get_clock_info(self, processor_handle, clock_type):
        gpu = self._enter("amdsmi_get_clock_info", processor_handle)
        if not isinstance(clock_type, AmdSmiClkType):
            raise AmdSmiParameterException(clock_type, AmdSmiClkType)
        clk = gpu.clocks_MHz[0 if clock_type == AmdSmiClkType.GFX else 1]
        return {"clk": clk, "min_clk": 500, "max_clk": 2100, "clk_locked": False, "clk_deep_sleep": 0}

    def amdsmi_get_temp_metric(self, processor_handle, sensor_type, metric):
        gpu = self._enter("amdsmi_get_temp_metric", processor_handle)
        if not isinstance(sensor_type, AmdSmiTemperatureType):
            raise AmdSmiParameterException(sensor_type, AmdSmiTemperatureType)
        return gpu.hotspot_mC

    def amdsmi_get_gpu_process_list(self, processor_handle):
        gpu = self._enter("amdsmi_get_gpu_process_list", processor_handle)
        return [{"name": "python", "pid": pid, "mem": 512 * 2**20,
                 "engine_usage": {"gfx": 0, "enc": 0},
                 "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": 512 * 2**20},
                 "cu_occupancy": "N/A"} for pid in list(gpu.process_pids)]

    # --- partitions -----------------------------------------------------------------------------
    def amdsmi_get_gpu_compute_partition(self, processor_handle):
        gpu = self._enter("amdsmi_get_gpu_compute_partition", processor_handle)
        if gpu.compute_partition is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return gpu.compute_partition

    def amdsmi_get_gpu_memory_partition(self, processor_handle):
        gpu = self._enter("amdsmi_get_gpu_memory_partition", processor_handle)
        if gpu.memory_partition is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return gpu.memory_partition

    # --- power cap --------------------------------------------------------------------------------
    def amdsmi_get_power_cap_info(self, processor_handle):
        gpu = self._enter("amdsmi_get_power_cap_info", processor_handle)
        low, high = gpu.cap_range_uW
        return {"power_cap": gpu.cap_uW, "default_power_cap": gpu.default_cap_uW, "dpm_cap": 0,
                "min_power_cap": low, "max_power_cap": high}

    def amdsmi_set_power_cap(self, processor_handle, sensor_ind, cap):
        gpu = self._enter("amdsmi_set_power_cap", processor_handle)
        if not isinstance(sensor_ind, int):
            raise AmdSmiParameterException(sensor_ind, int)
        if not isinstance(cap, int):
            raise AmdSmiParameterException(cap, int)
        if not gpu.root:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NO_PERM)
        low, high = gpu.cap_range_uW
        if not low <= cap <= high:
            raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL)
        gpu.cap_uW = int(cap)
        gpu.cap_log.append(int(cap))


for _name, _value in list(globals().items()):  # amdsmi.AMDSMI_STATUS_NOT_SUPPORTED etc. are not on the real
    if _name.startswith("AMDSMI_STATUS_"):     # module; the fake keeps them for tests only
        setattr(FakeAmdSmi, _name, _value)


def mi300x(count: int = 2, **overrides) -> list[FakeAmdGpu]:
    """``count`` MI300X in SPX mode, BDFs ``0000:<0c + 0x20 i>:00.0``, HIP ids in BDF order."""
    return [FakeAmdGpu(bdf=f"0000:{0x0c + 0x20 * i:02x}:00.0", uuid=f"{i:02x}ff74a1-0000-1000-80e8-7f3b1c2d3e4f",
                       hip_id=i, hip_uuid=f"GPU-{i:02x}3b1c2d3e4f5a6b", **overrides) for i in range(count)]
