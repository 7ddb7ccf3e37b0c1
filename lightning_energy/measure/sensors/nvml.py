"""NVIDIA GPU energy through NVML (``pynvml`` from the ``nvidia-ml-py`` distribution).

What is read, in this order of preference (the sensor's ``reading`` and ``source`` say which):

- ``"energy counter"``: ``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver was
  loaded, updated about every 100 ms (Volta and newer).
- Otherwise power, polled and integrated by the sampler (milliwatts):
  ``"instant power"`` from the ``NVML_FI_DEV_POWER_INSTANT`` field where the driver has it, else
  ``nvmlDeviceGetPowerUsage``, which NVML documents as a 1-s average on Ampere and newer parts except
  GA100 (A100, A800, A30) and as instantaneous on GA100 and older parts (``"1-s average power"`` /
  ``"instant power"``; the GA100 exception is told by the card's name, see
  :func:`lightning_energy.measure.sensors.nvml_families.power_usage_is_average`).

Counter and power together (Ampere and newer, with the instant field): the counter gives the exact
energy of each 100 ms update period but not where in it the work changed; the instant power, the mean
over the part of each period the card's power sensor observes (``shape_window_s``), says which power held
on which side of a step boundary. The sampler passes it (``shape_power_field``) to the series, which
shares each period's exact energy out by it (``lightning_energy.measure.series``). The window, its lag
and the period come from the card family's row of :mod:`lightning_energy.measure.sensors.nvml_families`
(``shaping_family``), which says whether they were measured on that family or assumed from the H200.

Measured on an H200 (driver 580.159.04, ``benchmarks/nvml_semantics.py``, read-only): the counter advances
every 100.0 ms and each increment holds its whole period's energy (random 20-150 ms bursts: R² 0.92 for
the whole period against 0.73 for a 25 ms window); the instant field refreshes every 100.0 ms on a clock
of its own (38 to 82 ms after the counter's updates, medians of four runs) and holds the mean power over
the 25 ms ending 11 ms before its refresh (R² 0.98; ``shape_lag_s``); ``nvmlDeviceGetPowerUsage`` is the
1-s average field; a counter read takes 2.4 ms (the other queries 1-8 µs): it is read on the sampling
thread only, which times each read's end (``read_end_s`` of the series).

Grace Hopper (GH200) in C2C mode (``nvmlDeviceGetC2cModeInfoV``, as Zeus detects it): the energy counter
covers the whole module, the Grace CPU and its memory included. The sensor then says so
(``power_scope == "module"``, in its source and description), shapes the counter with the module-scope
instant power (``NVML_POWER_SCOPE_MODULE``; not at all where the driver has no such field), and
:func:`lightning_energy.measure.sensors.detect.default_sensors` adds no host CPU sensor beside it.

At each sample the telemetry of the GPU power study is recorded where the card exposes it: utilisation,
memory utilisation, SM and memory clocks, power state, power (same field as above), temperature and
PCIe TX/RX throughput.

Errors: every failed NVML call raises an :class:`NvmlError` subclass that names the call, the GPU and
NVML's error code (:func:`nvml_errors`), as Zeus's ``_handle_nvml_errors`` does. What a card offers is
probed once, when the sensor opens, and only "not supported" (or a driver without the function, or,
for the power field, without that field) is taken as the answer "absent": no counter, no instant field,
not C2C, no such telemetry. Any other error of a probe fails the open, except a telemetry query's: that
field is kept and reads NaN while NVML fails it.

Shared cards: the sensor lists the card's compute processes (``nvmlDeviceGetComputeRunningProcesses``) when it
opens and then at most every :data:`~lightning_energy.measure.sensors.shared_gpu.PROCESS_QUERY_INTERVAL_S` on
the sampling thread (in :meth:`NvmlGpuSensor.read_fields`, never on the training thread). A card on which
another process computes is labelled: ``SHARED with N other processes`` before its ``source``, a ``shared``
entry in its description, an ``other_processes`` column in the trace, and one warning (rules and limits in
:mod:`lightning_energy.measure.sensors.shared_gpu`; an estimate of this process's part:
:class:`~lightning_energy.measure.sensors.nvml_share.NvmlProcessShareSensor`).

MIG: a MIG instance, or a GPU in MIG mode, is refused (:class:`MigDeviceError`): NVML has no
per-instance energy, and the parent GPU's counter would count every co-tenant's work too.

The CUDA -> NVML mapping (:func:`nvml_index_for_cuda_device`) is the one shared by measurement and
power-limit control (see ``nvml_index_of_cuda_device``). Every
opened sensor names its card by UUID (``device_uuid``), so that two ranks reading one card can count it
once (``lightning_energy.measure.sensors.detect.duplicate_device_sensors``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.shared_gpu import CardSharing
from lightning_energy.measure.sensors.nvml_families import (
    NVML_COUNTER_UPDATE_PERIOD_S,
    ShapingFamily,
    is_ga100,
    power_usage_is_average,
    shaping_family,
)
from lightning_energy.units import J_PER_MJ, W_PER_MW

PCIE_READ_INTERVAL_S = 1.0  # each PCIe throughput query blocks ~20 ms in the driver: read it at most 1 Hz

# nvml.h values (the same numbers as pynvml's constants); used directly so that a pynvml that predates a
# name, or a stand-in module, still maps correctly.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_FI_DEV_POWER_INSTANT = 186
NVML_POWER_SCOPE_GPU = 0
NVML_POWER_SCOPE_MODULE = 1
NVML_DEVICE_MIG_ENABLE = 1
INSTANT_POWER_FIELD = (NVML_FI_DEV_POWER_INSTANT, NVML_POWER_SCOPE_GPU)  # (field id, scope), as Zeus asks
MODULE_INSTANT_POWER_FIELD = (NVML_FI_DEV_POWER_INSTANT, NVML_POWER_SCOPE_MODULE)  # Grace Hopper in C2C mode

POWER_SCOPE_GPU = "gpu"  # the sensor's power_scope: what its counter and power cover
POWER_SCOPE_MODULE = "module"  # a Grace superchip in C2C mode: GPU, Grace CPU and memory

READING_COUNTER = "energy counter"
READING_INSTANT = "instant power"
READING_AVERAGE = "1-s average power"


# ------------------------------------------------------------------------------------------- errors
class NvmlError(RuntimeError):
    """An NVML call failed. ``code``: NVML's ``nvmlReturn_t`` value (None if the binding gave none)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlNotSupportedError(NvmlError):
    """NVML_ERROR_NOT_SUPPORTED: this GPU or driver does not offer the query."""


class NvmlNoPermissionError(NvmlError):
    """NVML_ERROR_NO_PERMISSION."""


class NvmlNotFoundError(NvmlError):
    """NVML_ERROR_NOT_FOUND (e.g. no device with that UUID)."""


class NvmlGpuLostError(NvmlError):
    """NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus; its readings are over."""


class NvmlUnavailableError(NvmlError):
    """NVML cannot be used here: library or driver missing, not initialised, function absent."""


class MigDeviceError(RuntimeError):
    """The CUDA device is a MIG instance (or its GPU is in MIG mode): its energy cannot be read alone."""


class CudaDeviceMappingError(RuntimeError):
    """The NVML device behind a CUDA device index cannot be told for certain."""


_ERROR_CLASSES: dict[int, type[NvmlError]] = {
    NVML_ERROR_NOT_SUPPORTED: NvmlNotSupportedError,
    NVML_ERROR_NO_PERMISSION: NvmlNoPermissionError,
    NVML_ERROR_NOT_FOUND: NvmlNotFoundError,
    NVML_ERROR_GPU_IS_LOST: NvmlGpuLostError,
    NVML_ERROR_UNINITIALIZED: NvmlUnavailableError,
    NVML_ERROR_DRIVER_NOT_LOADED: NvmlUnavailableError,
    NVML_ERROR_LIBRARY_NOT_FOUND: NvmlUnavailableError,
    NVML_ERROR_FUNCTION_NOT_FOUND: NvmlUnavailableError,
}
_ERROR_NAMES = {
    NVML_ERROR_UNINITIALIZED: "NVML_ERROR_UNINITIALIZED",
    NVML_ERROR_INVALID_ARGUMENT: "NVML_ERROR_INVALID_ARGUMENT",
    NVML_ERROR_NOT_SUPPORTED: "NVML_ERROR_NOT_SUPPORTED",
    NVML_ERROR_NO_PERMISSION: "NVML_ERROR_NO_PERMISSION",
    NVML_ERROR_NOT_FOUND: "NVML_ERROR_NOT_FOUND",
    NVML_ERROR_DRIVER_NOT_LOADED: "NVML_ERROR_DRIVER_NOT_LOADED",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML_ERROR_LIBRARY_NOT_FOUND",
    NVML_ERROR_FUNCTION_NOT_FOUND: "NVML_ERROR_FUNCTION_NOT_FOUND",
    NVML_ERROR_GPU_IS_LOST: "NVML_ERROR_GPU_IS_LOST",
}
# pynvml's str() of a coded error; a stand-in that raises NVMLError("Not Supported") without a code is
# read through the same text.
_CODES_BY_TEXT = {"Not Supported": NVML_ERROR_NOT_SUPPORTED, "Not Found": NVML_ERROR_NOT_FOUND,
                  "Insufficient Permissions": NVML_ERROR_NO_PERMISSION, "GPU is lost": NVML_ERROR_GPU_IS_LOST}


def nvml_error(err: BaseException, what: str) -> NvmlError:
    """The typed error for a ``pynvml.NVMLError`` raised by ``what`` (a call and the GPU it was about)."""
    code = getattr(err, "value", None)
    if not isinstance(code, int):
        code = _CODES_BY_TEXT.get(str(err))
    return nvml_error_for_code(code, f"{what}: {err}")


def nvml_error_for_code(code: int | None, message: str) -> NvmlError:
    """The typed error for NVML return code ``code`` (e.g. a per-field ``nvmlReturn``)."""
    name = _ERROR_NAMES.get(code, f"NVML error code {code}" if code is not None else "no NVML error code")
    return _ERROR_CLASSES.get(code, NvmlError)(f"{message} ({name})", code)


@contextlib.contextmanager
def nvml_errors(nvml, what: str) -> Iterator[None]:
    """Turn a ``pynvml.NVMLError`` raised in the block into the typed :class:`NvmlError` for its code."""
    try:
        yield
    except nvml.NVMLError as err:
        raise nvml_error(err, what) from err


def is_absent(err: NvmlError) -> bool:
    """Whether ``err`` says the query does not exist here: "not supported", or a driver without the function."""
    return isinstance(err, NvmlNotSupportedError) or err.code == NVML_ERROR_FUNCTION_NOT_FOUND


def _handle_nvml_errors(method: Callable) -> Callable:
    """For :class:`NvmlGpuSensor` methods: NVML errors become typed errors naming the method and GPU."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with nvml_errors(self._nvml, f"{method.__name__} on NVML GPU {self.nvml_index}"):
            return method(self, *args, **kwargs)

    return wrapper


# ------------------------------------------------------------------------------------------- library
def load_pynvml():
    """Import ``pynvml`` and initialise NVML (one ``nvmlInit``: pair it with ``nvmlShutdown``).

    Raises ImportError without the ``nvidia-ml-py`` package, :class:`NvmlError` when NVML cannot start.
    """
    import pynvml

    with nvml_errors(pynvml, "nvmlInit"):
        pynvml.nvmlInit()
    return pynvml


@contextlib.contextmanager
def nvml_session(nvml) -> Iterator[Any]:
    """NVML initialised for the block (one ``nvmlInit`` and its ``nvmlShutdown``). NVML counts the pairs, so
    handles opened elsewhere stay valid after it."""
    with nvml_errors(nvml, "nvmlInit"):
        nvml.nvmlInit()
    try:
        yield nvml
    finally:
        with nvml_errors(nvml, "nvmlShutdown"):
            nvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def uuid_body(uuid: str) -> str:
    """A UUID without its ``GPU-``/``MIG-`` prefix, lower case (torch prints none, NVML one): the key that
    tells whether two UUIDs name one card."""
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix):]
    return uuid


def _mig_mode_enabled(nvml, handle, what: str) -> bool:
    """Whether the GPU is in MIG mode (False where NVML or the GPU has no MIG: pre-Ampere parts)."""
    if not hasattr(nvml, "nvmlDeviceGetMigMode"):
        return False
    try:
        with nvml_errors(nvml, f"nvmlDeviceGetMigMode on {what}"):
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except NvmlNotSupportedError:
        return False
    return current == NVML_DEVICE_MIG_ENABLE


def c2c_mode_enabled(nvml, handle, what: str) -> bool:
    """Whether the GPU is a Grace superchip module in C2C mode (GH200), found as Zeus finds it
    (``nvmlDeviceGetC2cModeInfoV(handle).isC2cEnabled``): NVML's energy counter then covers the whole module,
    the Grace CPU and memory included. False where NVML or the GPU has no C2C mode ("not supported")."""
    if not hasattr(nvml, "nvmlDeviceGetC2cModeInfoV"):
        return False
    try:
        with nvml_errors(nvml, f"nvmlDeviceGetC2cModeInfoV on {what}"):
            info = nvml.nvmlDeviceGetC2cModeInfoV(handle)
    except NvmlError as err:
        if is_absent(err):
            return False
        raise
    return bool(info.isC2cEnabled)


def _is_mig_device_handle(nvml, handle) -> bool:
    if not hasattr(nvml, "nvmlDeviceIsMigDeviceHandle"):
        return False
    with nvml_errors(nvml, "nvmlDeviceIsMigDeviceHandle"):
        flag = nvml.nvmlDeviceIsMigDeviceHandle(handle)
    return bool(getattr(flag, "value", flag))  # pynvml returns the ctypes c_uint itself


def _mig_uuids(nvml, handle, what: str) -> list[str]:
    """The UUIDs (``MIG-...``) of the MIG instances of a GPU in MIG mode."""
    uuids = []
    with nvml_errors(nvml, f"nvmlDeviceGetMaxMigDeviceCount on {what}"):
        slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    for slot in range(slots):
        try:
            with nvml_errors(nvml, f"nvmlDeviceGetMigDeviceHandleByIndex({slot}) on {what}"):
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except NvmlNotFoundError:  # an empty slot
            continue
        with nvml_errors(nvml, f"nvmlDeviceGetUUID of MIG slot {slot} on {what}"):
            uuids.append(_text(nvml.nvmlDeviceGetUUID(mig)))
    return uuids


def _mig_refusal(what: str) -> MigDeviceError:
    return MigDeviceError(
        f"{what}: NVML reads no energy per MIG instance, and the GPU's own counter would also count the "
        "work of every other instance on it. Measure on a whole GPU (MIG mode off), or pass sensors=[...] "
        "of your own."
    )


# ------------------------------------------------------------------------------------------- processes
def compute_process_pids(nvml, index: int) -> set[int]:
    """The PIDs NVML lists as compute processes (a CUDA context) on NVML GPU ``index``
    (``nvmlDeviceGetComputeRunningProcesses``). NVML must be initialised by the caller. The PIDs are the
    host's: inside a container with its own PID namespace they may not be the ones ``os.getpid`` knows."""
    handle = _gpu(nvml, index)
    with nvml_errors(nvml, f"nvmlDeviceGetComputeRunningProcesses on NVML GPU {index}"):
        return {int(process.pid) for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}


def whole_gpu_indices(nvml) -> tuple[list[int], list[str]]:
    """The NVML indices of the GPUs whose energy can be read alone (not in MIG mode), and one note per GPU
    left out. NVML must be initialised by the caller."""
    indices: list[int] = []
    notes: list[str] = []
    for index in range(_device_count(nvml)):
        if _mig_mode_enabled(nvml, _gpu(nvml, index), f"NVML GPU {index}"):
            notes.append(f"NVML GPU {index} is in MIG mode: its energy cannot be read per instance; not measured.")
        else:
            indices.append(index)
    return indices, notes


# ------------------------------------------------------------------------------------------- CUDA -> NVML
def nvml_index_for_cuda_device(pynvml, cuda_index: int) -> int:
    """The NVML index of this process's CUDA device ``cuda_index`` (NVML ignores CUDA_VISIBLE_DEVICES).

    NVML must be initialised by the caller. The device is identified, most trusted first:

    1. by the UUID torch reports for it (``torch.cuda.get_device_properties(i).uuid``), found among
       NVML's GPUs;
    2. else by ``CUDA_VISIBLE_DEVICES`` read as CUDA reads it (the rules of torch's
       ``_parse_visible_devices``): ``GPU-`` UUIDs or unique prefixes of them; or ordinals, which, as
       with no ``CUDA_VISIBLE_DEVICES`` at all, count in CUDA's enumeration order. NVML numbers GPUs in
       PCI bus order (as ``nvidia-smi``); CUDA does so with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, while its
       default ``FASTEST_FIRST`` gives the same order only when every GPU is the same model.

    Raises :class:`CudaDeviceMappingError` when the device cannot be told for certain (never a guess),
    :class:`MigDeviceError` for a MIG instance or a GPU in MIG mode, :class:`NvmlError` when NVML fails.
    """
    count = _device_count(pynvml)
    uuid = _torch_uuid(cuda_index)
    if uuid is not None:
        return _index_of_uuid(pynvml, count, uuid, f"CUDA device {cuda_index} (UUID {uuid} from torch)")
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        visible = _parse_visible_devices(raw)
        if cuda_index >= len(visible):
            raise CudaDeviceMappingError(
                f"CUDA device {cuda_index} is not in CUDA_VISIBLE_DEVICES={raw!r} "
                f"(CUDA reads it as {len(visible)} device(s): {visible})"
            )
        entry = visible[cuda_index]
        if isinstance(entry, str):
            return _index_of_uuid_entry(pynvml, count, entry, cuda_index, raw)
        ordinal, where = entry, f"CUDA_VISIBLE_DEVICES={raw!r}"
    else:
        ordinal, where = cuda_index, "CUDA_VISIBLE_DEVICES unset"
    return _index_of_ordinal(pynvml, count, ordinal, f"CUDA device {cuda_index} ({where})")


@dataclass(frozen=True)
class NvmlGpu:
    """The NVML GPU behind a CUDA device: ``nvml_index`` (``nvidia-smi -i``), ``uuid`` (``GPU-...``), ``name``,
    and ``module_scope``: a Grace superchip in C2C mode (GH200), whose energy counter covers the whole module
    (GPU, Grace CPU and memory)."""

    nvml_index: int
    uuid: str
    name: str
    module_scope: bool


def nvml_gpu_for_cuda_device(pynvml, cuda_index: int) -> NvmlGpu:
    """:func:`nvml_index_for_cuda_device`, with the card's UUID, name and whether NVML measures its whole
    module (Grace Hopper in C2C mode). NVML must be initialised by the caller."""
    index = nvml_index_for_cuda_device(pynvml, cuda_index)
    return NvmlGpu(index, _gpu_uuid(pynvml, index), _gpu_name(pynvml, index),
                   c2c_mode_enabled(pynvml, _gpu(pynvml, index), f"NVML GPU {index}"))


def _device_count(nvml) -> int:
    with nvml_errors(nvml, "nvmlDeviceGetCount"):
        return int(nvml.nvmlDeviceGetCount())


def _gpu(nvml, index: int):
    with nvml_errors(nvml, f"nvmlDeviceGetHandleByIndex({index})"):
        return nvml.nvmlDeviceGetHandleByIndex(index)


def _gpu_uuid(nvml, index: int) -> str:
    with nvml_errors(nvml, f"nvmlDeviceGetUUID on NVML GPU {index}"):
        return _text(nvml.nvmlDeviceGetUUID(_gpu(nvml, index)))


def _gpu_name(nvml, index: int) -> str:
    with nvml_errors(nvml, f"nvmlDeviceGetName on NVML GPU {index}"):
        return _text(nvml.nvmlDeviceGetName(_gpu(nvml, index)))


def _refuse_mig_mode(nvml, index: int, what: str) -> int:
    if _mig_mode_enabled(nvml, _gpu(nvml, index), f"NVML GPU {index}"):
        raise _mig_refusal(f"{what} is on NVML GPU {index}, which is in MIG mode")
    return index


def _index_of_uuid(nvml, count: int, uuid: str, what: str) -> int:
    body = uuid_body(uuid)
    for index in range(count):
        if uuid_body(_gpu_uuid(nvml, index)) == body:
            return _refuse_mig_mode(nvml, index, what)
    for index in range(count):  # not a whole GPU: is it a MIG instance?
        handle = _gpu(nvml, index)
        if _mig_mode_enabled(nvml, handle, f"NVML GPU {index}"):
            if any(uuid_body(mig) == body for mig in _mig_uuids(nvml, handle, f"NVML GPU {index}")):
                raise _mig_refusal(f"{what} is a MIG instance of NVML GPU {index}")
    raise CudaDeviceMappingError(f"{what}: no NVML device has this UUID")


def _index_of_uuid_entry(nvml, count: int, entry: str, cuda_index: int, raw: str) -> int:
    what = f"CUDA device {cuda_index} ({entry!r} in CUDA_VISIBLE_DEVICES={raw!r})"
    if entry.upper().startswith("MIG-"):
        raise _mig_refusal(f"{what} is a MIG instance")
    matches = [i for i in range(count) if _gpu_uuid(nvml, i).lower().startswith(entry.lower())]
    if len(matches) != 1:  # _parse_visible_devices keeps only entries that match one GPU
        raise CudaDeviceMappingError(f"{what}: {len(matches)} NVML GPUs have a UUID starting so")
    return _refuse_mig_mode(nvml, matches[0], what)


def _index_of_ordinal(nvml, count: int, ordinal: int, what: str) -> int:
    if not 0 <= ordinal < count:
        raise CudaDeviceMappingError(f"{what}: CUDA ordinal {ordinal} but NVML sees {count} GPU(s)")
    for index in range(count):  # MIG instances change CUDA's enumeration: ordinals cannot be trusted
        if _mig_mode_enabled(nvml, _gpu(nvml, index), f"NVML GPU {index}"):
            raise _mig_refusal(f"{what}: NVML GPU {index} is in MIG mode, so CUDA ordinals do not name GPUs")
    order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    if order != "PCI_BUS_ID":
        models = {_gpu_name(nvml, i) for i in range(count)}
        if len(models) > 1:
            raise CudaDeviceMappingError(
                f"{what}: CUDA_DEVICE_ORDER={order} numbers these different GPUs ({', '.join(sorted(models))}) "
                "fastest first, NVML in PCI bus order. Set CUDA_DEVICE_ORDER=PCI_BUS_ID, or name GPUs by UUID "
                "in CUDA_VISIBLE_DEVICES."
            )
    return ordinal


def _parse_visible_devices(raw: str) -> list[int] | list[str]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it (torch.cuda._parse_visible_devices's rules).

    A list of ``GPU-``/``MIG-`` UUIDs (or prefixes) when it starts with one, stopping at the first entry
    that is not; else ordinals read as ``strtoul`` would (``"1gpu"`` is 1), stopping at the first
    negative or unreadable one. A repeated entry makes the list empty. UUID entries are checked against
    the GPUs where they are looked up.
    """
    entries = raw.split(",")
    for prefix in ("GPU-", "MIG-"):
        if raw.startswith(prefix):
            uuids: list[str] = []
            for entry in entries:
                if not entry.startswith(prefix):
                    break
                if entry in uuids:
                    return []
                uuids.append(entry)
            return uuids
    ordinals: list[int] = []
    for entry in entries:
        number = re.match(r"[+-]?\d+", entry.strip())
        value = int(number.group()) if number else -1
        if value < 0:
            break
        if value in ordinals:
            return []
        ordinals.append(value)
    return ordinals


def _torch_uuid(cuda_index: int) -> str | None:
    """The UUID torch reports for CUDA device ``cuda_index``; None where torch has no CUDA or no UUIDs."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    try:
        properties = torch.cuda.get_device_properties(cuda_index)
    except (AssertionError, RuntimeError, ValueError) as err:  # torch's ways of saying "no such device"
        raise CudaDeviceMappingError(f"torch cannot describe CUDA device {cuda_index}: {err}") from err
    uuid = getattr(properties, "uuid", None)  # absent before torch 2.1
    return None if uuid is None else str(uuid)


# ------------------------------------------------------------------------------------------- sensor
class NvmlGpuSensor(Sensor):
    """The energy of one NVIDIA GPU (scope ``"device"``) by its NVML index, with per-sample telemetry.

    ``reading`` (set by :meth:`open`): ``"energy counter"`` (J from the mJ counter), or power in W from
    ``"instant power"`` / ``"1-s average power"`` (see the module docstring). ``power_scope``: ``"gpu"``,
    or ``"module"`` on a Grace Hopper in C2C mode, whose counter holds the Grace CPU and memory too.
    ``device_uuid``: the card's NVML UUID (``GPU-...``). ``shaping_family``: the card family's row of
    :mod:`~lightning_energy.measure.sensors.nvml_families` the counter is shaped by (None: not shaped).
    Failed NVML calls raise :class:`NvmlError` subclasses; a GPU in MIG mode is refused with
    :class:`MigDeviceError`. ``pynvml_module``: the NVML binding (default: ``import pynvml`` when opened).

    ``sharing`` (set by :meth:`open`): the card's other compute processes
    (:class:`~lightning_energy.measure.sensors.shared_gpu.CardSharing`); a card found shared labels ``source``
    and ``describe()["shared"]``. ``own_pids()``: the PIDs that are "this process" (default
    :func:`~lightning_energy.measure.sensors.shared_gpu.own_process_ids`; a monitor passes the command's tree);
    ``clock`` (s, default ``time.perf_counter``): what rate-limits the process listing.
    """

    warns_when_shared = True  # one warning when the card is first found shared (see shared_gpu.CardSharing)

    def __init__(self, nvml_index: int, name: str | None = None, pynvml_module=None,
                 own_pids: Callable[[], Iterable[int]] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self._plain_source = ""
        self.sharing: CardSharing | None = None
        super().__init__(name or f"gpu{nvml_index}", "device")
        self.nvml_index = nvml_index
        self._own_pids = own_pids
        self._sharing_clock = clock or time.perf_counter
        self.device_uuid: str | None = None  # set when opened
        self.power_scope: str | None = None  # POWER_SCOPE_GPU or POWER_SCOPE_MODULE, set when opened
        self.reading: str | None = None
        self.power_field: str | None = None  # the NVML query behind power_w() and the power_W telemetry
        self._nvml = pynvml_module
        self._initialised = False
        self._handle = None
        self._mode = "energy"
        self._instant_field: tuple[int, int] | None = None  # (field id, scope) of the instant power, if offered
        self._power_is_average = False
        self._telemetry: dict[str, Callable[[], dict[str, float]]] = {}
        self._last_pcie_read = -float("inf")
        self._pcie_supported: bool | None = None  # None: not tried yet (tried on the sampling thread)
        # counter + instant power (set when opened, see the module docstring): the telemetry field, the
        # window (s) the power reading averages and how long (s) before each of its refreshes that ends
        self.shaping_family: ShapingFamily | None = None
        self.shape_power_field: str | None = None
        self.shape_window_s: float | None = None
        self.shape_lag_s: float | None = None

    @property
    def kind(self) -> str:
        return self._mode

    @property
    def source(self) -> str:
        """What is read, in words; ``SHARED with N other processes ...`` before it once the card is found shared."""
        sharing = self.sharing
        return (sharing.label() if sharing is not None else "") + self._plain_source

    @source.setter
    def source(self, value: str) -> None:
        label = self.sharing.label() if self.sharing is not None else ""
        self._plain_source = value[len(label):] if label and value.startswith(label) else value

    def identity(self) -> tuple:
        # not the kind: it is settled when the sensor opens (counter, or power on pre-Volta parts)
        return (type(self), self.name, self.nvml_index)

    def describe(self) -> dict:
        family = self.shaping_family
        return {**super().describe(), "nvml_index": self.nvml_index, "device_uuid": self.device_uuid,
                "power_scope": self.power_scope, "reading": self.reading, "power_field": self.power_field,
                "shaping": family.describe() if family is not None else None,
                "shaping_measured": family.measured if family is not None else None,
                "shared": self.sharing.describe() if self.sharing is not None else None}

    def open(self) -> None:
        """Initialise NVML (one ``nvmlInit``, undone by :meth:`close`), find the GPU and what it offers."""
        if self._handle is not None:
            return
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        with nvml_errors(self._nvml, "nvmlInit"):
            self._nvml.nvmlInit()
        self._initialised = True
        try:
            self._open()
        except BaseException:
            self._handle = None
            with contextlib.suppress(NvmlError):  # the reason to report is the one being raised
                self._shutdown()
            raise

    @_handle_nvml_errors
    def _open(self) -> None:
        nvml, what = self._nvml, f"NVML GPU {self.nvml_index}"
        handle = nvml.nvmlDeviceGetHandleByIndex(self.nvml_index)
        if _is_mig_device_handle(nvml, handle) or _mig_mode_enabled(nvml, handle, what):
            raise _mig_refusal(f"{what} is in MIG mode")
        gpu_name = _text(nvml.nvmlDeviceGetName(handle))
        self.device_uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        self._handle = handle
        module = c2c_mode_enabled(nvml, handle, what)
        self.power_scope = POWER_SCOPE_MODULE if module else POWER_SCOPE_GPU
        architecture = self._architecture()
        field = MODULE_INSTANT_POWER_FIELD if module else INSTANT_POWER_FIELD
        self._instant_field = field if self._offers_field(field) else None
        self._power_is_average = self._instant_field is None and power_usage_is_average(architecture, gpu_name)
        self.power_field = self._power_field_text(gpu_name)
        try:
            with nvml_errors(nvml, f"nvmlDeviceGetTotalEnergyConsumption on {what}"):
                nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except NvmlNotSupportedError:  # pre-Volta: no counter
            self._mode = "power"
            self.counter_update_period_s = None
            self.reading = READING_AVERAGE if self._power_is_average else READING_INSTANT
            how = f"{self.reading} polled and integrated (no energy counter on this GPU) from {self.power_field}"
        else:
            self._mode = "energy"
            self.counter_update_period_s = NVML_COUNTER_UPDATE_PERIOD_S
            self.reading = READING_COUNTER
            covers = " of the whole module: GPU, Grace CPU and memory (C2C mode)" if module else ""
            how = f"nvmlDeviceGetTotalEnergyConsumption (energy counter{covers}, mJ, updated every ~0.1 s)"
        self.source = f"NVML {how} on GPU {self.nvml_index} ({gpu_name})"
        self._telemetry = self._supported_telemetry()
        self.sharing = CardSharing(f"NVML GPU {self.nvml_index} ({gpu_name}, {self.device_uuid})", self._own_pids,
                                   self._sharing_clock, warn=self.warns_when_shared)
        if self.sharing.due():  # the first listing, at open: due by construction, and timed from here
            self._list_processes()
        self.shaping_family = self.shape_power_field = self.shape_window_s = self.shape_lag_s = None
        family = shaping_family(architecture, module)
        if self._mode == "energy" and self._instant_field and "power_W" in self._telemetry and family is not None:
            self.shaping_family, self.counter_update_period_s = family, family.period_s
            self.shape_power_field, self.shape_window_s, self.shape_lag_s = "power_W", family.window_s, family.lag_s
            scope = "module-scope " if module else ""
            self.source += f", shaped by the {scope}instant power ({family.describe()})"

    def _power_field_text(self, gpu_name: str) -> str:
        if self._instant_field == MODULE_INSTANT_POWER_FIELD:
            return "NVML_FI_DEV_POWER_INSTANT field, module scope (GPU, Grace CPU and memory; instantaneous, mW)"
        if self._instant_field is not None:
            return "NVML_FI_DEV_POWER_INSTANT field (instantaneous, mW)"
        if self._power_is_average:
            return "nvmlDeviceGetPowerUsage (mW; a 1-s average on Ampere and newer except GA100)"
        if is_ga100(gpu_name):
            return "nvmlDeviceGetPowerUsage (mW; instantaneous on GA100)"
        return "nvmlDeviceGetPowerUsage (mW; instantaneous before Ampere)"

    def close(self) -> None:
        """Release the GPU and NVML (the ``nvmlShutdown`` that pairs with :meth:`open`'s ``nvmlInit``)."""
        self._handle = None
        self._shutdown()

    def _shutdown(self) -> None:
        if self._initialised:
            self._initialised = False
            with nvml_errors(self._nvml, "nvmlShutdown"):
                self._nvml.nvmlShutdown()

    @_handle_nvml_errors
    def energy_j(self) -> float:
        """Cumulative energy in J (the counter counts mJ since the driver was loaded)."""
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) * J_PER_MJ

    @_handle_nvml_errors
    def power_w(self) -> float:
        """Power in W (``power_field`` says which NVML query, instantaneous or 1-s average, and its scope)."""
        return self._power_mw() * W_PER_MW

    def _power_mw(self) -> float:
        nvml = self._nvml
        if self._instant_field is None:
            return float(nvml.nvmlDeviceGetPowerUsage(self._handle))
        value = nvml.nvmlDeviceGetFieldValues(self._handle, [self._instant_field])[0]
        if value.nvmlReturn != NVML_SUCCESS:  # the call succeeds; each field carries its own return code
            raise nvml_error_for_code(value.nvmlReturn, f"NVML_FI_DEV_POWER_INSTANT on NVML GPU {self.nvml_index}")
        return float(value.value.uiVal)

    def _offers_field(self, field: tuple[int, int]) -> bool:
        """Whether the driver answers this (field id, scope): "not supported" (for the call or the field) is no,
        as are a driver that predates the field API and a field or scope it does not know (the field's
        ``NVML_ERROR_INVALID_ARGUMENT``); any other error is raised."""
        nvml = self._nvml
        if not hasattr(nvml, "nvmlDeviceGetFieldValues"):
            return False
        what = f"NVML_FI_DEV_POWER_INSTANT (scope {field[1]}) on NVML GPU {self.nvml_index}"
        try:
            with nvml_errors(nvml, f"nvmlDeviceGetFieldValues on NVML GPU {self.nvml_index}"):
                value = nvml.nvmlDeviceGetFieldValues(self._handle, [field])[0]
            if value.nvmlReturn == NVML_ERROR_INVALID_ARGUMENT:
                return False
            if value.nvmlReturn != NVML_SUCCESS:
                raise nvml_error_for_code(value.nvmlReturn, what)
        except NvmlError as err:
            if is_absent(err):
                return False
            raise
        return True

    def _architecture(self) -> int | None:
        """``nvmlDeviceGetArchitecture`` (None where NVML or the GPU does not say)."""
        nvml = self._nvml
        if not hasattr(nvml, "nvmlDeviceGetArchitecture"):
            return None
        try:
            with nvml_errors(nvml, f"nvmlDeviceGetArchitecture on NVML GPU {self.nvml_index}"):
                return nvml.nvmlDeviceGetArchitecture(self._handle)
        except NvmlError as err:
            if is_absent(err):
                return None
            raise

    def read_fields(self) -> dict[str, float]:
        """Telemetry; a query NVML fails this time reads NaN (the sensor's energy is unaffected)."""
        fields: dict[str, float] = {}
        for field, query in self._telemetry.items():
            try:
                with nvml_errors(self._nvml, f"{field} on NVML GPU {self.nvml_index}"):
                    fields.update(query())
            except NvmlError:
                fields[field] = float("nan")
        now = time.perf_counter()
        if self._pcie_supported is not False and now - self._last_pcie_read >= PCIE_READ_INTERVAL_S:
            self._last_pcie_read = now
            fields.update(self._read_pcie())
        fields.update(self._sharing_fields())
        return fields

    def _sharing_fields(self) -> dict[str, float]:
        """The card's other compute processes (listed again when due) as the ``other_processes`` telemetry
        field; none where NVML cannot list them."""
        sharing = self.sharing
        if sharing is None or sharing.unchecked is not None:
            return {}
        if sharing.due():
            self._list_processes()
        if sharing.unchecked is not None:  # found absent at this listing
            return {}
        now = sharing.now  # None: every listing so far failed (reads NaN, as other telemetry does)
        return {"other_processes": float("nan") if now is None else float(now.count)}

    def _list_processes(self) -> None:
        """List the card's compute processes into :attr:`sharing`. Never raises an NVML error: "not supported",
        "no permission" or a driver without the call leave the card unchecked (said in its description), other
        errors are counted and the last listing stands."""
        sharing, nvml = self.sharing, self._nvml
        if not hasattr(nvml, "nvmlDeviceGetComputeRunningProcesses"):
            sharing.failed("this NVML binding has no nvmlDeviceGetComputeRunningProcesses", absent=True)
            return
        try:
            with nvml_errors(nvml, f"nvmlDeviceGetComputeRunningProcesses on NVML GPU {self.nvml_index}"):
                listed = [int(process.pid) for process in nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)]
        except NvmlError as err:
            sharing.failed(str(err), absent=is_absent(err) or isinstance(err, NvmlNoPermissionError))
            return
        sharing.observe(listed)

    def _supported_telemetry(self) -> dict[str, Callable[[], dict[str, float]]]:
        """The telemetry queries this GPU answers (probed once: "not supported" ones are left out; one that
        fails otherwise is kept, and reads NaN while it fails).

        PCIe throughput is not probed here: each query blocks ~20 ms, so it is tried on the sampling
        thread at its first read.
        """
        nvml, h = self._nvml, self._handle

        def utilisation():
            u = nvml.nvmlDeviceGetUtilizationRates(h)
            return {"gpu_util_pct": float(u.gpu), "mem_util_pct": float(u.memory)}

        queries = {  # in read order: the power first, so that it is read right after the counter it shapes
            "power_W": lambda: {"power_W": self._power_mw() * W_PER_MW},
            "utilisation": utilisation,
            "sm_clock_MHz": lambda: {"sm_clock_MHz": float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))},
            "mem_clock_MHz": lambda: {"mem_clock_MHz": float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM))},
            "pstate": lambda: {"pstate": float(nvml.nvmlDeviceGetPerformanceState(h))},
            "temperature_C": lambda: {
                "temperature_C": float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
            },
        }
        supported = {}
        for field, query in queries.items():
            try:
                with nvml_errors(nvml, f"{field} on NVML GPU {self.nvml_index}"):
                    query()
            except NvmlError as err:
                if is_absent(err):
                    continue
            supported[field] = query
        return supported

    def _read_pcie(self) -> dict[str, float]:
        nvml, h = self._nvml, self._handle
        try:
            with nvml_errors(nvml, f"nvmlDeviceGetPcieThroughput on NVML GPU {self.nvml_index}"):
                fields = {
                    "pcie_tx_KBps": float(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)),
                    "pcie_rx_KBps": float(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)),
                }
        except NvmlNotSupportedError:
            if self._pcie_supported is None:  # never answered: not on this GPU
                self._pcie_supported = False
                return {}
            return {"pcie_tx_KBps": float("nan"), "pcie_rx_KBps": float("nan")}
        except NvmlError:
            return {"pcie_tx_KBps": float("nan"), "pcie_rx_KBps": float("nan")}
        self._pcie_supported = True
        return fields


def _pynvml(pynvml_module):
    if pynvml_module is None:
        import pynvml as pynvml_module
    return pynvml_module


def nvml_index_of_cuda_device(cuda_index: int, pynvml_module=None) -> int:
    """The NVML index (``nvidia-smi -i``) of this process's CUDA device ``cuda_index``.

    The one CUDA -> NVML mapping, for measurement (:class:`NvmlGpuSensor`, ``backend="zeus"``) and power-limit
    control alike (see :func:`lightning_energy.measure.sensors.nvml.nvml_index_for_cuda_device` for the rules:
    the UUID torch reports, else ``CUDA_VISIBLE_DEVICES`` with indices or ``GPU-`` UUIDs and
    ``CUDA_DEVICE_ORDER``). Initialises NVML for the call and shuts it down after; NVML counts
    ``nvmlInit``/``nvmlShutdown`` pairs, so handles opened elsewhere stay valid. Raises one of
    :data:`lightning_energy.measure.sensors.detect.GPU_UNREADABLE`.
    """
    with nvml_session(_pynvml(pynvml_module)) as nvml:
        return nvml_index_for_cuda_device(nvml, cuda_index)


def nvml_gpu_of_cuda_device(cuda_index: int, pynvml_module=None) -> NvmlGpu:
    """:func:`nvml_index_of_cuda_device`, with the card's UUID, name and whether NVML measures its whole
    module (Grace Hopper in C2C mode). Raises one of :data:`lightning_energy.measure.sensors.detect.GPU_UNREADABLE`."""
    with nvml_session(_pynvml(pynvml_module)) as nvml:
        return nvml_gpu_for_cuda_device(nvml, cuda_index)
