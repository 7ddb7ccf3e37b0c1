"""Fakes for the GPU dress rehearsal: a ``pynvml`` module and torch's CUDA devices and events.

Both follow the documented semantics of the real thing, on a clock the test controls; the names,
numbers, signatures and error classes of :class:`FakeNvml` are checked against the installed
``nvidia-ml-py`` in ``tests/test_nvml_fake.py``.

:class:`FakeNvml` (``pynvml``, NVML API reference):

- ``nvmlDeviceGetTotalEnergyConsumption``: mJ (an int) since the driver was loaded (the fake's
  creation), advancing only every 100 ms; ``NVMLError_NotSupported`` on pre-Volta GPUs and MIG handles.
- ``nvmlDeviceGetPowerUsage``: mW; a 1-s average where ``power_usage_is_average`` (Ampere and newer
  except GA100, as NVML's API reference says), else instantaneous.
- ``nvmlDeviceGetFieldValues``: per-field ``nvmlReturn``; ``NVML_FI_DEV_POWER_INSTANT`` and
  ``NVML_FI_DEV_POWER_AVERAGE`` (mW, ``value.uiVal``) where the driver has them, else the field reads
  ``NVML_ERROR_NOT_SUPPORTED`` while the call itself succeeds.
- The power sensor of A100/H100/H200 (``observed_window_s``, 25 ms) observes only 25 ms of each 100 ms, as
  measured on an H200 (``benchmarks/nvml_semantics.py``): the "instant" power (the instant field, and
  ``nvmlDeviceGetPowerUsage`` where it is not an average) is the mean power over the window that ends
  ``instant_lag_s`` (11 ms) before each refresh; the field refreshes every 100 ms on its own schedule,
  ``instant_phase_s`` (55 ms; 38-82 ms measured) after the counter's updates. With
  ``observed_window_s=None`` (older parts) it is the power at the call. The counter integrates the exact
  power: each update holds its whole period's energy (measured on the H200 too).
- MIG: ``nvmlDeviceGetMigMode`` (``[current, pending]``; not supported before Ampere), MIG device
  handles and ``MIG-`` UUIDs; ``nvmlDeviceIsMigDeviceHandle`` returns a ``ctypes.c_uint`` as pynvml does.
- ``nvmlInit``/``nvmlShutdown`` are reference counted; a device call with no ``nvmlInit`` outstanding
  raises ``NVMLError_Uninitialized``, as does one ``nvmlShutdown`` too many.
- Power limits (``nvmlDeviceGet/SetPowerManagementLimit``, ``...LimitConstraints``, ``...DefaultLimit``):
  mW; setting one outside the constraints is ``NVML_ERROR_INVALID_ARGUMENT``, and without root
  (``FakeGpu.root = False``) ``NVML_ERROR_NO_PERMISSION``; persistence mode
  (``nvmlDeviceGet/SetPersistenceMode``, ``NVML_FEATURE_ENABLED``/``_DISABLED``) likewise. The limit and
  the mode are the card's: they survive ``nvmlShutdown`` (a new process sees what the last one left).
- Grace Hopper (``FakeGpu.c2c_mode``, see :func:`gh200`): ``nvmlDeviceGetC2cModeInfoV`` returns a
  ``c_nvmlC2cModeInfo_v1_t`` whose ``isC2cEnabled`` says whether C2C mode is on (``None``: not a Grace
  Hopper, the call is not supported, as on every other GPU). In C2C mode the energy counter holds the whole
  module's energy (the GPU's and ``grace_W``, the Grace CPU and its memory), and the power fields read the
  module in ``NVML_POWER_SCOPE_MODULE`` (unless ``has_module_power_fields`` is False: "not supported"), the
  GPU alone in ``NVML_POWER_SCOPE_GPU``. Every (field, scope)
  asked of ``nvmlDeviceGetFieldValues`` is recorded in ``FakeNvml.fields_asked``.
- ``nvmlDeviceGetComputeRunningProcesses``: the processes holding a CUDA context on the GPU
  (``FakeGpu.compute_pids``, which the test changes at will), as ``c_nvmlProcessInfo_v3_t``-like objects
  (``pid``, ``usedGpuMemory`` in bytes, ``gpuInstanceId``/``computeInstanceId``); ``[]`` when there are none,
  as pynvml returns. PIDs are as the driver sees them (the host's PID namespace).
- ``nvmlDeviceGetProcessUtilization(handle, timeStamp)``: the driver samples each process's SM and memory
  utilisation (%, the mean over each sample period, rounded) every ``FakeGpu.process_sample_period_s`` (1/6 s;
  nvidia-smi(1) gives 1/6 to 1 s for its utilisation samples, depending on the product) and keeps
  ``PROCESS_SAMPLE_BUFFER_S`` of them (NVML does not document its buffer: assumed); the call returns, for each
  process with non-zero utilisation, its latest sample newer than ``timeStamp`` (µs of the driver's CPU clock,
  here the fake clock), as ``c_nvmlProcessUtilizationSample_t`` (``pid``, ``timeStamp`` in µs, ``smUtil``,
  ``memUtil``, ``encUtil``, ``decUtil``), and ``NVML_ERROR_NOT_FOUND`` when there is none (NVML's documented
  return); ``NVML_ERROR_NOT_SUPPORTED`` on MIG handles (as NVML documents) and where
  ``FakeGpu.has_process_utilisation`` is False. The test sets each process's utilisation with
  :meth:`FakeNvml.set_process_utilisation` (graphics processes may have some without being in ``compute_pids``).
- Any call can take time (``latency_s``: advances the fake clock), be held until released
  (:meth:`FakeNvml.block`), or fail with an NVML error code (:meth:`FakeNvml.fail`).

:class:`FakeTorch` (enough of ``torch`` for ``lightning_energy.measure.clocks``): per-thread current device
(0 unless set), ``torch.cuda.device`` guards (recorded in ``cuda.entries``), primary contexts created
by runtime calls on a thread's current device (``cuda.contexts``), and ``torch.cuda.Event``\\ s that
complete ``lag_s`` after they are recorded (in stream order), on a device clock that may drift
(``drift``), with ``elapsed_time`` in float32 ms as CUDA reports it. As in PyTorch, ``record`` and
``elapsed_time`` run under a guard to the event's device, ``query`` and ``synchronize`` on the calling
thread's current device.
"""

from __future__ import annotations

import ctypes
import math
import string
import struct
import threading
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

# ------------------------------------------------------------------------------------------- NVML constants
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999

NVML_FI_DEV_POWER_AVERAGE = 185
NVML_FI_DEV_POWER_INSTANT = 186
NVML_POWER_SCOPE_GPU = 0
NVML_POWER_SCOPE_MODULE = 1
NVML_POWER_SCOPE_MEMORY = 2
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_ARCH_KEPLER = 2
NVML_DEVICE_ARCH_MAXWELL = 3
NVML_DEVICE_ARCH_PASCAL = 4
NVML_DEVICE_ARCH_VOLTA = 5
NVML_DEVICE_ARCH_TURING = 6
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_ADA = 8
NVML_DEVICE_ARCH_HOPPER = 9
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1

COUNTER_UPDATE_PERIOD_S = 0.1  # the energy counter advances every 100 ms
POWER_AVERAGE_WINDOW_S = 1.0  # nvmlDeviceGetPowerUsage's averaging window on Ampere and newer
OBSERVED_WINDOW_S = 0.025  # A100/H100/H200: the power sensor observes 25 ms of each 100 ms
INSTANT_LAG_S = 0.011  # H200, measured: the observed window ends 11 ms before the instant field refreshes
INSTANT_PHASE_S = 0.055  # H200, measured 38-82 ms: the instant field refreshes this long after the counter
MAX_MIG_DEVICES = 7  # nvmlDeviceGetMaxMigDeviceCount on an A100/H100
PROCESS_SAMPLE_PERIOD_S = 1 / 6  # nvidia-smi(1): utilisation sample periods are 1/6 s to 1 s, by product
PROCESS_SAMPLE_BUFFER_S = 10.0  # how far back the driver keeps per-process samples (undocumented: assumed)


class c_nvmlC2cModeInfo_v1_t(ctypes.Structure):
    """As pynvml's: what ``nvmlDeviceGetC2cModeInfoV`` returns."""

    _fields_ = [("isC2cEnabled", ctypes.c_uint)]


class c_nvmlProcessUtilizationSample_t(ctypes.Structure):
    """As pynvml's: one process's sample from ``nvmlDeviceGetProcessUtilization`` (timeStamp in µs, the rest %)."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


# ------------------------------------------------------------------------------------------- NVML errors
class NVMLError(Exception):
    """As pynvml's: ``NVMLError(code)`` builds the subclass for ``code``; ``value`` is the code."""

    _valClassMapping: dict[int, type] = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_MEMORY: "Insufficient Memory",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")


def _error_classes() -> dict[str, type]:
    """``NVMLError_NotSupported`` and the others, named and built as pynvml names and builds them."""
    classes = {}
    for name, code in sorted(globals().items()):
        if not name.startswith("NVML_ERROR_"):
            continue
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def new(cls, *args, _code=code):
            return NVMLError.__new__(cls, _code)

        cls = type(class_name, (NVMLError,), {"__new__": new})
        NVMLError._valClassMapping[code] = cls
        classes[class_name] = cls
    return classes


ERROR_CLASSES = _error_classes()
globals().update(ERROR_CLASSES)


# ------------------------------------------------------------------------------------------- fake GPUs
@dataclass
class FakeGpu:
    """One physical GPU as NVML sees it. Power in W (``power_W``) is changed with
    :meth:`FakeNvml.set_power`; everything NVML reports is derived from its history."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    architecture: int = NVML_DEVICE_ARCH_HOPPER
    has_energy_counter: bool = True  # Volta and newer
    has_power_fields: bool = True  # a driver with NVML_FI_DEV_POWER_INSTANT / _AVERAGE
    power_usage_is_average: bool = True  # nvmlDeviceGetPowerUsage = 1-s average (Ampere+ except GA100)
    observed_window_s: float | None = OBSERVED_WINDOW_S  # A100/H100/H200: instant power = mean of 25 ms
    instant_lag_s: float = INSTANT_LAG_S  # that window ends this long before the field's refresh
    instant_phase_s: float = INSTANT_PHASE_S  # the field refreshes this long after each counter update
    mig_uuids: tuple[str, ...] | None = None  # MIG mode on, with these instances; None: off
    c2c_mode: bool | None = None  # Grace Hopper: C2C mode on/off; None: not a Grace Hopper
    grace_W: float = 0.0  # in C2C mode: the Grace CPU and its memory, counted in the module's energy
    has_module_power_fields: bool = True  # in C2C mode: the power fields answer NVML_POWER_SCOPE_MODULE
    has_pcie_counters: bool = False
    compute_pids: list = field(default_factory=list)  # processes with a CUDA context on the GPU (host PIDs)
    has_process_utilisation: bool = True  # nvmlDeviceGetProcessUtilization answers (Maxwell and newer, not MIG)
    process_sample_period_s: float = PROCESS_SAMPLE_PERIOD_S
    process_utilisation: dict = field(default_factory=dict)  # PID -> SM % or (SM %, memory %) at the driver's load
    power_W: float = 100.0
    utilisation_pct: tuple[int, int] = (97, 40)  # (gpu, memory)
    clocks_MHz: tuple[int, int] = (1980, 2619)  # (SM, memory)
    temperature_C: int = 61
    pcie_KBps: tuple[int, int] = (1200, 3400)  # (TX, RX)
    limit_constraints_mW: tuple[int, int] = (200_000, 700_000)  # an H100 SXM's range
    default_limit_mW: int = 700_000
    limit_mW: int = 700_000  # in force now (an administrator may have left another than the default)
    persistence_mode: int = NVML_FEATURE_DISABLED
    root: bool = True  # the process may set limits and persistence mode
    limit_log: list = field(default_factory=list)  # every limit set (mW), in order
    _segments: list[tuple[float, float]] = field(default_factory=list)  # (start s, W) of each power level
    _util_segments: list[tuple[float, dict]] = field(default_factory=list)  # (start s, {PID: (SM %, mem %)})

    @property
    def mig_capable(self) -> bool:
        return self.architecture >= NVML_DEVICE_ARCH_AMPERE


class _GpuHandle:
    """An opaque device handle (as pynvml's ``c_nvmlDevice_t``: not an int, not comparable by value)."""

    def __init__(self, index: int) -> None:
        self.index = index


class _MigHandle:
    def __init__(self, parent: int, slot: int) -> None:
        self.parent = parent
        self.slot = slot


class _Value:
    __slots__ = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

    def __init__(self, ui: int = 0) -> None:
        self.dVal, self.uiVal, self.ulVal, self.ullVal, self.sllVal, self.siVal, self.usVal = 0.0, ui, 0, 0, 0, 0, 0


class _FieldValue:
    """As ``c_nvmlFieldValue_t``: ``value`` is valid only when ``nvmlReturn == NVML_SUCCESS``."""

    def __init__(self, field_id: int, scope_id: int, now_s: float) -> None:
        self.fieldId = field_id
        self.scopeId = scope_id
        self.timestamp = int(now_s * 1e6)  # us
        self.latencyUsec = 0
        self.valueType = NVML_VALUE_TYPE_UNSIGNED_INT
        self.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        self.value = _Value()


class FakeNvml:
    """A stand-in for the ``pynvml`` module over :class:`FakeGpu`\\ s, on ``clock`` (s).

    ``sleep``: how a slow call spends its ``latency_s`` (default: advance ``clock`` if it has
    ``advance``, else ``time.sleep``). Install it for code that imports pynvml with
    ``monkeypatch.setitem(sys.modules, "pynvml", fake)``.
    """

    def __init__(self, gpus: list[FakeGpu], clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], object] | None = None) -> None:
        self.gpus = list(gpus)
        self.clock = clock
        self.sleep = sleep or getattr(clock, "advance", time.sleep)
        self.loaded_at_s = clock()  # the driver loads: counters start at 0
        for gpu in self.gpus:
            gpu._segments = [(self.loaded_at_s, gpu.power_W)]
            gpu._util_segments = [(self.loaded_at_s, _utilisation_table(gpu.process_utilisation))]
        self.init_count = 0
        self.calls: Counter = Counter()
        self.latency_s: dict[str, float] = {}
        self._gates: dict[str, threading.Event] = {}
        self._failures: dict[str, int] = {}
        self.fields_asked: list[tuple[int, int]] = []  # every (field id, scope) asked of nvmlDeviceGetFieldValues

    # --- test controls ------------------------------------------------------------------------
    def set_power(self, index: int, watts: float) -> None:
        """GPU ``index`` draws ``watts`` from now on."""
        gpu = self.gpus[index]
        gpu.power_W = watts
        gpu._segments.append((self.clock(), watts))

    def set_process_utilisation(self, index: int, utilisation: dict) -> None:
        """From now on the processes of GPU ``index`` use it as ``utilisation`` says: PID -> SM % or
        (SM %, memory %); a process left out uses none. (Listing a process among the compute processes is
        ``FakeGpu.compute_pids``'s.)"""
        gpu = self.gpus[index]
        gpu.process_utilisation = dict(utilisation)
        gpu._util_segments.append((self.clock(), _utilisation_table(utilisation)))

    def block(self, name: str) -> threading.Event:
        """Calls to ``name`` wait until the returned event is set (at most 60 s, so a test cannot hang)."""
        gate = self._gates[name] = threading.Event()
        return gate

    def fail(self, name: str, code: int | None) -> None:
        """Calls to ``name`` raise ``NVMLError(code)`` from now on (``None``: stop failing)."""
        if code is None:
            self._failures.pop(name, None)
        else:
            self._failures[name] = code

    def module_energy_mJ(self, index: int, at_s: float) -> float:
        """The exact energy (mJ) NVML's counter counts for GPU ``index`` from driver load to ``at_s``: the GPU's,
        and in C2C mode the Grace CPU's and memory's too (``grace_W``)."""
        gpu = self.gpus[index]
        grace_mJ = gpu.grace_W * max(0.0, at_s - self.loaded_at_s) * 1000.0 if gpu.c2c_mode else 0.0
        return self.energy_mJ(index, at_s) + grace_mJ

    def energy_mJ(self, index: int, at_s: float) -> float:
        """The exact energy (mJ) GPU ``index`` (the GPU alone) has used from driver load to ``at_s``."""
        segments = self.gpus[index]._segments
        total = 0.0
        for i, (start, watts) in enumerate(segments):
            end = segments[i + 1][0] if i + 1 < len(segments) else math.inf
            if at_s <= start:
                break
            total += watts * (min(end, at_s) - start)
        return total * 1000.0

    # --- plumbing -----------------------------------------------------------------------------
    def _enter(self, name: str, needs_init: bool = True) -> None:
        self.calls[name] += 1
        gate = self._gates.get(name)
        if gate is not None:
            gate.wait(timeout=60.0)
        if self.latency_s.get(name):
            self.sleep(self.latency_s[name])
        if name in self._failures:
            raise NVMLError(self._failures[name])
        if needs_init and self.init_count == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _gpu_of(self, handle) -> tuple[int, FakeGpu]:
        if not isinstance(handle, _GpuHandle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle.index, self.gpus[handle.index]

    def last_update_s(self) -> float:
        """Time (s) of the counters' latest update (every 100 ms from the driver's load)."""
        updates = math.floor((self.clock() - self.loaded_at_s) / COUNTER_UPDATE_PERIOD_S + 1e-9)  # 1e-9: float noise
        return self.loaded_at_s + updates * COUNTER_UPDATE_PERIOD_S

    def _counter_mJ(self, index: int) -> int:
        return int(math.floor(self.module_energy_mJ(index, self.last_update_s()) + 1e-6))

    def _instant_mW(self, index: int) -> int:
        """mW: the mean over the observed window of the field's latest refresh (every 100 ms, its own
        ``instant_phase_s`` after the counter's; the window ends ``instant_lag_s`` before it); the power now
        where the GPU has no ``observed_window_s``; before the first full window, the power drawn when the
        driver loaded (the field changes only at its refreshes)."""
        gpu = self.gpus[index]
        window = gpu.observed_window_s
        if window is None:
            return int(round(gpu.power_W * 1000))
        first = self.loaded_at_s + gpu.instant_phase_s
        refreshes = math.floor((self.clock() - first) / COUNTER_UPDATE_PERIOD_S + 1e-9)  # 1e-9: float noise
        end = first + refreshes * COUNTER_UPDATE_PERIOD_S - gpu.instant_lag_s
        if end - window < self.loaded_at_s:
            return int(round(gpu._segments[0][1] * 1000))
        return int(round((self.energy_mJ(index, end) - self.energy_mJ(index, end - window)) / window))

    def _average_mW(self, index: int) -> int:
        now = self.clock()
        start = max(now - POWER_AVERAGE_WINDOW_S, self.loaded_at_s)
        if now <= start:
            return self._instant_mW(index)
        return int(round((self.energy_mJ(index, now) - self.energy_mJ(index, start)) / (now - start)))

    # --- library --------------------------------------------------------------------------------
    def nvmlInit(self):
        self._enter("nvmlInit", needs_init=False)
        self.init_count += 1

    def nvmlInitWithFlags(self, flags):
        self.nvmlInit()

    def nvmlShutdown(self):
        self._enter("nvmlShutdown", needs_init=False)
        if self.init_count == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        self.init_count -= 1

    def nvmlErrorString(self, result):
        return NVMLError._errcode_to_string.get(result, "Unknown Error")

    # --- devices ------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _GpuHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        """The full UUID only (``GPU-`` or ``MIG-``), as NVML: no prefixes."""
        self._enter("nvmlDeviceGetHandleByUUID")
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return _GpuHandle(index)
            for slot, mig in enumerate(gpu.mig_uuids or ()):
                if mig == uuid:
                    return _MigHandle(index, slot)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle):
        self._enter("nvmlDeviceGetIndex")
        return self._gpu_of(handle)[0]

    def nvmlDeviceGetUUID(self, handle):
        self._enter("nvmlDeviceGetUUID")
        if isinstance(handle, _MigHandle):
            return self.gpus[handle.parent].mig_uuids[handle.slot]
        return self._gpu_of(handle)[1].uuid

    def nvmlDeviceGetName(self, handle):
        self._enter("nvmlDeviceGetName")
        if isinstance(handle, _MigHandle):
            return f"{self.gpus[handle.parent].name} MIG 1g.10gb"
        return self._gpu_of(handle)[1].name

    def nvmlDeviceGetArchitecture(self, device):
        self._enter("nvmlDeviceGetArchitecture")
        return self._gpu_of(device)[1].architecture

    # --- energy and power ---------------------------------------------------------------------
    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        """mJ since driver load (an int), updated every 100 ms; Volta and newer, not on MIG handles."""
        self._enter("nvmlDeviceGetTotalEnergyConsumption")
        if isinstance(handle, _MigHandle):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        index, gpu = self._gpu_of(handle)
        if not gpu.has_energy_counter:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self._counter_mJ(index)

    def nvmlDeviceGetPowerUsage(self, handle):
        """mW: a 1-s average where ``power_usage_is_average``, else instantaneous."""
        self._enter("nvmlDeviceGetPowerUsage")
        if isinstance(handle, _MigHandle):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        index, gpu = self._gpu_of(handle)
        return self._average_mW(index) if gpu.power_usage_is_average else self._instant_mW(index)

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        """One value per requested field (an id or ``(id, scope)``); each carries its own ``nvmlReturn``."""
        self._enter("nvmlDeviceGetFieldValues")
        index, gpu = self._gpu_of(handle)
        readers = {NVML_FI_DEV_POWER_INSTANT: self._instant_mW, NVML_FI_DEV_POWER_AVERAGE: self._average_mW}
        values = []
        for requested in fieldIds:
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            self.fields_asked.append((field_id, scope))
            value = _FieldValue(field_id, scope, self.clock())
            module = scope == NVML_POWER_SCOPE_MODULE and gpu.c2c_mode and gpu.has_module_power_fields
            if gpu.has_power_fields and field_id in readers and (scope == NVML_POWER_SCOPE_GPU or module):
                grace_mW = int(round(gpu.grace_W * 1000)) if module else 0
                value.nvmlReturn, value.value = NVML_SUCCESS, _Value(readers[field_id](index) + grace_mW)
            values.append(value)
        return values

    # --- power limits and persistence mode --------------------------------------------------------
    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle):
        """[min, max] in mW."""
        self._enter("nvmlDeviceGetPowerManagementLimitConstraints")
        return list(self._gpu_of(handle)[1].limit_constraints_mW)

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        self._enter("nvmlDeviceGetPowerManagementLimit")
        return self._gpu_of(handle)[1].limit_mW

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle):
        self._enter("nvmlDeviceGetPowerManagementDefaultLimit")
        return self._gpu_of(handle)[1].default_limit_mW

    def nvmlDeviceSetPowerManagementLimit(self, handle, limit):
        """mW within the constraints; needs root."""
        self._enter("nvmlDeviceSetPowerManagementLimit")
        gpu = self._gpu_of(handle)[1]
        if not gpu.root:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        low, high = gpu.limit_constraints_mW
        if not low <= limit <= high:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu.limit_mW = int(limit)
        gpu.limit_log.append(int(limit))

    def nvmlDeviceGetPersistenceMode(self, handle):
        self._enter("nvmlDeviceGetPersistenceMode")
        return self._gpu_of(handle)[1].persistence_mode

    def nvmlDeviceSetPersistenceMode(self, handle, mode):
        self._enter("nvmlDeviceSetPersistenceMode")
        gpu = self._gpu_of(handle)[1]
        if not gpu.root:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        if mode not in (NVML_FEATURE_DISABLED, NVML_FEATURE_ENABLED):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu.persistence_mode = mode

    def nvmlDeviceGetC2cModeInfoV(self, handle):
        """A ``c_nvmlC2cModeInfo_v1_t`` on a Grace Hopper; not supported on any other GPU."""
        self._enter("nvmlDeviceGetC2cModeInfoV")
        gpu = self._gpu_of(handle)[1]
        if gpu.c2c_mode is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return c_nvmlC2cModeInfo_v1_t(isC2cEnabled=1 if gpu.c2c_mode else 0)

    # --- MIG ------------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device):
        self._enter("nvmlDeviceGetMigMode")
        _, gpu = self._gpu_of(device)
        if not gpu.mig_capable:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig_uuids is not None else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceIsMigDeviceHandle(self, device):
        self._enter("nvmlDeviceIsMigDeviceHandle")
        return ctypes.c_uint(1 if isinstance(device, _MigHandle) else 0)  # pynvml returns the c_uint

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        _, gpu = self._gpu_of(device)
        if not gpu.mig_capable:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return MAX_MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        parent, gpu = self._gpu_of(device)
        if gpu.mig_uuids is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(gpu.mig_uuids):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _MigHandle(parent, index)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice):
        self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        if not isinstance(migDevice, _MigHandle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _GpuHandle(migDevice.parent)

    # --- telemetry ------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle):
        self._enter("nvmlDeviceGetUtilizationRates")
        gpu_pct, memory_pct = self._gpu_of(handle)[1].utilisation_pct
        return types.SimpleNamespace(gpu=gpu_pct, memory=memory_pct)

    def nvmlDeviceGetClockInfo(self, handle, type):
        self._enter("nvmlDeviceGetClockInfo")
        sm, memory = self._gpu_of(handle)[1].clocks_MHz
        return {NVML_CLOCK_SM: sm, NVML_CLOCK_MEM: memory}[type]

    def nvmlDeviceGetPerformanceState(self, handle):
        self._enter("nvmlDeviceGetPerformanceState")
        self._gpu_of(handle)
        return 0

    def nvmlDeviceGetTemperature(self, handle, sensor):
        self._enter("nvmlDeviceGetTemperature")
        return self._gpu_of(handle)[1].temperature_C

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        """The compute processes on the GPU: objects with pynvml's ``c_nvmlProcessInfo_v3_t`` fields (``pid``,
        ``usedGpuMemory`` in bytes, ``gpuInstanceId``, ``computeInstanceId``: 0xFFFFFFFF outside MIG)."""
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        gpu = self._gpu_of(handle)[1]
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=512 * 2**20, gpuInstanceId=0xFFFFFFFF,
                                      computeInstanceId=0xFFFFFFFF) for pid in list(gpu.compute_pids)]

    def nvmlDeviceGetProcessUtilization(self, handle, timeStamp):
        """Each process's latest sample newer than ``timeStamp`` (µs), if it had non-zero utilisation; NOT_FOUND
        when no process has one (see the module docstring)."""
        self._enter("nvmlDeviceGetProcessUtilization")
        if isinstance(handle, _MigHandle):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        gpu = self._gpu_of(handle)[1]
        if not gpu.has_process_utilisation:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        period = gpu.process_sample_period_s
        last = math.floor((self.clock() - self.loaded_at_s) / period + 1e-9)  # 1e-9: float noise
        first = max(1, last - math.floor(PROCESS_SAMPLE_BUFFER_S / period) + 1)
        latest: dict[int, c_nvmlProcessUtilizationSample_t] = {}
        for k in range(first, last + 1):
            end = self.loaded_at_s + k * period
            stamp = int(round(end * 1e6))
            if stamp <= timeStamp:
                continue
            for pid, (sm, memory) in _mean_utilisation(gpu._util_segments, end - period, end).items():
                if sm or memory:
                    latest[pid] = c_nvmlProcessUtilizationSample_t(pid=pid, timeStamp=stamp, smUtil=sm, memUtil=memory,
                                                                   encUtil=0, decUtil=0)
        if not latest:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return [latest[pid] for pid in sorted(latest)]

    def nvmlDeviceGetPcieThroughput(self, device, counter):
        """KB/s over the last 20 ms (the real call blocks that long: set ``latency_s`` to model it)."""
        self._enter("nvmlDeviceGetPcieThroughput")
        gpu = self._gpu_of(device)[1]
        if not gpu.has_pcie_counters:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.pcie_KBps[0 if counter == NVML_PCIE_UTIL_TX_BYTES else 1]


for _name, _cls in ERROR_CLASSES.items():  # pynvml.NVMLError_NotSupported etc. on the fake module too
    setattr(FakeNvml, _name, _cls)
FakeNvml.NVMLError = NVMLError
FakeNvml.c_nvmlC2cModeInfo_v1_t = c_nvmlC2cModeInfo_v1_t
FakeNvml.c_nvmlProcessUtilizationSample_t = c_nvmlProcessUtilizationSample_t


def _utilisation_table(utilisation: dict) -> dict[int, tuple[float, float]]:
    """PID -> (SM %, memory %) from PID -> SM % or (SM %, memory %)."""
    return {int(pid): (float(v[0]), float(v[1])) if isinstance(v, tuple) else (float(v), 0.0)
            for pid, v in utilisation.items()}


def _mean_utilisation(segments: list[tuple[float, dict]], start: float, end: float) -> dict[int, tuple[int, int]]:
    """Each process's mean (SM %, memory %) over ``(start, end]`` from the programmed ``segments``, rounded."""
    totals: dict[int, list[float]] = {}
    for i, (begin, table) in enumerate(segments):
        stop = segments[i + 1][0] if i + 1 < len(segments) else math.inf
        overlap = min(stop, end) - max(begin, start)
        if overlap <= 0:
            continue
        for pid, (sm, memory) in table.items():
            total = totals.setdefault(pid, [0.0, 0.0])
            total[0] += sm * overlap
            total[1] += memory * overlap
    span = end - start
    return {pid: (int(round(sm / span)), int(round(memory / span))) for pid, (sm, memory) in totals.items()}
for _name, _value in list(globals().items()):
    if _name.startswith("NVML_"):
        setattr(FakeNvml, _name, _value)


class FakeClock:
    """A clock the test advances by hand (seconds); the fakes' slow calls advance it (``advance``)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


def alternating_steps_through_the_sampler(fake: FakeNvml, clock: FakeClock, boundaries: list[float], rng,
                                          counter_read_s: float = 0.0) -> list:
    """Drive the real ``Sampler`` (no thread: ticks every 50 ms + 0-2 ms on ``clock``) and a ``Meter`` over
    GPU 0 of ``fake``: idle until the first of ``boundaries`` (the power wandering by a watt, as an idle
    card's does), then 150 W and 50 W in turn from each boundary, a mark at each; each counter read takes
    ``counter_read_s``. Returns the marks, resolved."""
    from lightning_energy.measure.meter import Meter
    from lightning_energy.measure.sampler import Sampler
    from lightning_energy.measure.sensors.nvml import NvmlGpuSensor

    fake.latency_s["nvmlDeviceGetTotalEnergyConsumption"] = counter_read_s
    sampler = Sampler(clock=clock)
    names = sampler.acquire("steps", [NvmlGpuSensor(0, pynvml_module=fake)], interval_s=0.05, start_thread=False)
    meter = Meter(sampler, names)
    meter.clock.record = clock
    sampler.add_meter(meter)
    next_tick, marks = clock() + 0.05, []
    for at in [*boundaries, boundaries[-1] + 1.0]:
        while next_tick + counter_read_s < at:  # each tick done by the boundary
            clock.t = next_tick
            if not marks:
                fake.set_power(0, 50.0 + rng.uniform(-1.0, 1.0))
            sampler.sample_once()
            next_tick += 0.05 + rng.uniform(0.0, 0.002)
        clock.t = at
        if at in boundaries:
            fake.set_power(0, 150.0 if len(marks) % 2 == 0 else 50.0)
            marks.append(meter.mark())
    sampler.release("steps")
    return marks


def gh200(c2c_mode: bool = True, grace_W: float = 150.0, **overrides) -> FakeGpu:
    """One Grace Hopper module (GH200), C2C mode on by default; its Grace CPU and memory draw ``grace_W``."""
    return FakeGpu(uuid="GPU-6a200000-1111-2222-3333-444444444444", name="NVIDIA GH200 480GB",
                   c2c_mode=c2c_mode, grace_W=grace_W, **overrides)


def h100s(count: int = 2, **overrides) -> list[FakeGpu]:
    """``count`` identical Hopper GPUs with distinct UUIDs ``GPU-0000000<i>-...``."""
    return [FakeGpu(uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444", **overrides) for i in range(count)]


# ------------------------------------------------------------------------------------------- fake torch
class FakeDevice:
    """``torch.device``: ``type`` and ``index``."""

    def __init__(self, spec, index: int | None = None) -> None:
        if isinstance(spec, FakeDevice):
            spec, index = spec.type, spec.index
        elif isinstance(spec, int):
            spec, index = "cuda", spec
        elif ":" in spec:
            spec, number = spec.split(":")
            index = int(number)
        self.type, self.index = spec, index

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeDevice) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))

    def __repr__(self) -> str:
        return f"device(type={self.type!r}, index={self.index})"

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class FakeStream:
    def __init__(self, device_index: int) -> None:
        self.device_index = device_index


class FakeEvent:
    """``torch.cuda.Event``: completes ``lag_s`` after it is recorded, never before an earlier event
    of its stream. Created on the device of the first stream that records it."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self._cuda = cuda
        self.enable_timing = enable_timing
        self.device_index: int | None = None
        self.completes_at_s: float | None = None
        cuda.events_created += 1

    def record(self, stream: FakeStream | None = None) -> None:
        cuda = self._cuda
        if stream is None:
            stream = cuda.current_stream()
        if self.device_index is not None and self.device_index != stream.device_index:
            raise RuntimeError(f"Event device {self.device_index} does not match recording stream's device "
                               f"{stream.device_index}.")
        self.device_index = stream.device_index
        cuda._runtime("cudaEventRecord", stream.device_index)  # torch guards to the stream's device
        now = cuda.clock()
        last = cuda._stream_done_s.get(stream.device_index, -math.inf)
        self.completes_at_s = max(now + cuda.lag_s, last)
        cuda._stream_done_s[stream.device_index] = self.completes_at_s

    def query(self) -> bool:
        cuda = self._cuda
        cuda._runtime("cudaEventQuery", cuda.current_device())  # no device guard in torch
        return self.completes_at_s is None or cuda.clock() >= self.completes_at_s

    def synchronize(self) -> None:
        cuda = self._cuda
        cuda._runtime("cudaEventSynchronize", cuda.current_device())  # no device guard in torch
        cuda.synchronizes += 1
        if self.completes_at_s is not None and cuda.clock() < self.completes_at_s:
            cuda.sleep(self.completes_at_s - cuda.clock())

    def elapsed_time(self, end_event: FakeEvent) -> float:
        """ms from this event to ``end_event`` on the device clock, as a float32 (CUDA's precision)."""
        cuda = self._cuda
        if self.completes_at_s is None or end_event.completes_at_s is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        cuda._runtime("cudaEventElapsedTime", self.device_index)  # torch guards to the event's device
        now = cuda.clock()
        if now < self.completes_at_s or now < end_event.completes_at_s:
            raise RuntimeError("CUDA error: device not ready")
        ms = (cuda.device_time_s(end_event.completes_at_s) - cuda.device_time_s(self.completes_at_s)) * 1000.0
        cuda.longest_elapsed_ms = max(cuda.longest_elapsed_ms, abs(ms))
        return struct.unpack("f", struct.pack("f", ms))[0]  # rounded to float32


class _DeviceGuard:
    """``torch.cuda.device(d)``: the thread's current device is ``d`` inside; on exit the previous one
    comes back only if it has a context (torch's ``_maybe_exchange_device``)."""

    def __init__(self, cuda: FakeCuda, device) -> None:
        self._cuda = cuda
        self.idx = device.index if isinstance(device, FakeDevice) else device
        self.prev_idx = -1

    def __enter__(self):
        cuda = self._cuda
        cuda.entries.append((threading.current_thread().name, self.idx))
        self.prev_idx = cuda.current_device()
        cuda.set_device(self.idx)

    def __exit__(self, *exc) -> bool:
        cuda = self._cuda
        if self.prev_idx in cuda.contexts:
            cuda._local.device = self.prev_idx
        return False


class FakeCuda:
    """``torch.cuda``. ``contexts``: devices with a primary context in this process (a runtime call on a
    thread creates one on the thread's current device); ``calls``: (call, thread name, device);
    ``entries``: (thread name, device) of every ``torch.cuda.device`` guard entered."""

    def __init__(self, clock: Callable[[], float], sleep: Callable[[float], object], device_count: int,
                 uuids: list[str], lag_s: float, drift: float) -> None:
        self.clock = clock
        self.sleep = sleep
        self._device_count = device_count
        self.uuids = uuids
        self.lag_s = lag_s
        self.drift = drift  # the device clock runs (1 + drift) times as fast as the host's
        self._origin_s = clock()
        self._local = threading.local()
        self._stream_done_s: dict[int, float] = {}
        self.contexts: set[int] = set()
        self.calls: list[tuple[str, str, int]] = []
        self.entries: list[tuple[str, int]] = []
        self.synchronizes = 0
        self.events_created = 0
        self.longest_elapsed_ms = 0.0

    def device_time_s(self, host_s: float) -> float:
        return (host_s - self._origin_s) * (1.0 + self.drift)

    def _runtime(self, call: str, device: int) -> None:
        self.calls.append((call, threading.current_thread().name, device))
        self.contexts.add(device)

    # --- the torch.cuda API -----------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._device_count

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device) -> None:
        index = device.index if isinstance(device, FakeDevice) else device
        self._local.device = index
        self._runtime("cudaSetDevice", index)  # CUDA 12 creates the device's primary context here

    def device(self, device) -> _DeviceGuard:
        return _DeviceGuard(self, device)

    def current_stream(self, device=None) -> FakeStream:
        if device is None:
            return FakeStream(self.current_device())
        return FakeStream(device.index if isinstance(device, FakeDevice) else device)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> FakeEvent:
        return FakeEvent(self, enable_timing, blocking, interprocess)

    def get_device_properties(self, device):
        index = device.index if isinstance(device, FakeDevice) else device
        if not 0 <= index < self._device_count:
            raise AssertionError("Invalid device id")
        uuid = self.uuids[index] if index < len(self.uuids) else None
        return types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid=uuid)


class FakeTorch:
    """Enough of the ``torch`` module for the clocks and the CUDA -> NVML mapping. Install it with
    ``monkeypatch.setitem(sys.modules, "torch", fake)`` (code that imports torch inside functions then
    gets it). ``uuids``: what ``get_device_properties(i).uuid`` prints for each CUDA device (as torch,
    without a ``GPU-`` prefix)."""

    def __init__(self, clock: Callable[[], float], sleep: Callable[[float], object] | None = None,
                 device_count: int = 2, uuids: list[str] | None = None, lag_s: float = 0.0,
                 drift: float = 0.0) -> None:
        self.cuda = FakeCuda(clock, sleep or getattr(clock, "advance", time.sleep), device_count,
                             uuids or [], lag_s, drift)

    def device(self, spec, index: int | None = None) -> FakeDevice:
        return FakeDevice(spec, index)
