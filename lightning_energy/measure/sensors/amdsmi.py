"""AMD GPU energy through AMD SMI (the ``amdsmi`` Python package that ships with ROCm 6 and 7).

What is read, in this order of preference (the sensor's ``reading`` and ``source`` say which):

- ``"energy counter"``: ``amdsmi_get_energy_count``: an accumulator (``energy_accumulator``; ``power`` before
  ROCm 6.4) of ``counter_resolution`` µJ units (15.3 µJ on the parts AMD documents) since the driver loaded,
  with the time (ns) of its last refresh. The driver reads the card's SMU metrics at most once per 1 ms and
  hands out its cached copy in between (AMD, ROCm/legacy-rocm-build#1649); how often the firmware itself
  refreshes the accumulator is not documented per generation. The sensor assumes a refresh at least every
  :data:`COUNTER_UPDATE_PERIOD_S` (10 ms: ten times the driver's cache period, a conservative guess, not a
  measurement): each counter point's time is then known to within 10 ms. Wrap-around: gpu_metrics v1.0
  (MI100 and older) keeps a 32-bit accumulator (``amdsmi.h``: "v1 mod. (32->64)"), which wraps every
  2**32 × 15.3 µJ = 65.7 kJ (under four minutes at 300 W); the sensor adds 2**32 units back when such a
  counter drops, if the energy this implies since the last read stays below :data:`MAX_PLAUSIBLE_W`. Any
  other drop (a 64-bit counter going backwards, as in ROCm/amdsmi#115, or a GPU reset) is a read error
  (:class:`AmdSmiCounterError`), counted against the sampler's error budget; the sensor keeps its last good
  value, so a glitch costs one read and a reset fails the sensor once the budget is spent.
- Otherwise power polled and integrated by the sampler: ``amdsmi_get_power_info``'s ``current_socket_power``
  (``"instant power"``, MI300 and newer) or ``average_socket_power`` (``"average power"``, MI200 and older),
  whole watts. A GPU that offers neither is refused (:class:`AmdSmiNotSupportedError`).

Telemetry at each sample, under the names the NVML sensor uses, where amdsmi answers: ``power_W`` (the field
above), ``gpu_util_pct`` / ``mem_util_pct`` (``gfx_activity`` / ``umc_activity``), ``sm_clock_MHz`` (the GFX
clock) and ``mem_clock_MHz``, ``temperature_C`` (the hotspot, i.e. junction, sensor; amdsmi reports
millidegrees). A query "not supported" when the sensor opens is left out; one that fails otherwise stays and
reads NaN while it fails.

Shared cards: the sensor lists the processes amdsmi sees on the card (``amdsmi_get_gpu_process_list``) when it
opens and then at most every :data:`~lightning_energy.measure.sensors.shared_gpu.PROCESS_QUERY_INTERVAL_S` on
the sampling thread, under the rules of :mod:`lightning_energy.measure.sensors.shared_gpu` (which PIDs are
this process's, in and out of containers): a card another process uses is labelled ``SHARED with N other
processes`` before its ``source``, a ``shared`` entry in its description, an ``other_processes`` column in the
trace, and one warning. amdsmi measures the whole card, so every figure of a shared card holds the other
processes' work too.

Partitions: an MI300-class GPU in a compute partition mode other than SPX shows up as several GPUs with one
energy counter and one power reading for the whole chip: it is refused (:class:`PartitionedGpuError`), as a
MIG instance is on NVIDIA. MI250/MI250X: amdsmi reports the power of a package's two GCDs on one of them
and 0 on the other (as Zeus documents): the sensor says so (``power_scope == "package"``); the sum over the
two GCDs is the package's.

Library life: ``amdsmi_init`` is not reference counted (one ``amdsmi_shut_down`` ends it for the whole
process), so this module counts its own users (:func:`acquire_library` / :func:`release_library`) and shuts
amdsmi down when the last one is done.

The torch -> amdsmi mapping (:func:`amd_gpu_for_torch_device`) is shared by measurement and power-limit
control. Every opened sensor names its card by amdsmi's UUID (``device_uuid``), so that two ranks reading one
card count it once (``lightning_energy.measure.sensors.detect.duplicate_device_sensors``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import os
import threading
import time
from typing import Any, Callable, Iterator

from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.shared_gpu import CardSharing
from lightning_energy.units import J_PER_UJ

# amdsmi_wrapper's status codes (checked against the installed package in tests/test_amdsmi_fake.py)
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
AMDSMI_STATUS_FILE_NOT_FOUND = 52

COUNTER_UPDATE_PERIOD_S = 0.01  # assumed (see the module docstring): AMD documents only the driver's 1 ms cache
COUNTER_32_BIT_SPAN = 2 ** 32  # units before a gpu_metrics v1.0 accumulator wraps
MAX_PLAUSIBLE_W = 3000.0  # a 32-bit wrap implying more than this since the last read is taken for a reset
SPX = "SPX"  # the one compute partition mode in which a GPU is one device

READING_COUNTER = "energy counter"
READING_INSTANT = "instant power"
READING_AVERAGE = "average power"
POWER_SCOPE_GPU = "gpu"
POWER_SCOPE_PACKAGE = "package"  # MI250/MI250X: both GCDs' power reported on one of them


# ------------------------------------------------------------------------------------------- errors
class AmdSmiError(RuntimeError):
    """An amdsmi call failed. ``code``: amdsmi's status code (None for a parameter error)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class AmdSmiNotSupportedError(AmdSmiError):
    """AMDSMI_STATUS_NOT_SUPPORTED: this GPU, driver or environment (a VM guest) does not offer the query."""


class AmdSmiNoPermissionError(AmdSmiError):
    """AMDSMI_STATUS_NO_PERM."""


class AmdSmiNotFoundError(AmdSmiError):
    """AMDSMI_STATUS_NOT_FOUND, or no GPU at that index."""


class AmdSmiUnavailableError(AmdSmiError):
    """amdsmi cannot be used here: not initialised, the driver or a file missing."""


class AmdSmiCounterError(AmdSmiError):
    """The energy accumulator went backwards in a way no wrap-around explains (a GPU reset, a driver glitch)."""


class PartitionedGpuError(RuntimeError):
    """The device is a compute partition (CPX, DPX ...) of an AMD GPU: its energy cannot be read alone."""


class RocmDeviceMappingError(RuntimeError):
    """The amdsmi GPU behind a torch (HIP) device cannot be told for certain."""


# Why an AMD GPU cannot be measured: no amdsmi, amdsmi failing, a device we cannot name, a partition.
AMD_GPU_UNREADABLE = (ImportError, AmdSmiError, RocmDeviceMappingError, PartitionedGpuError)

_ERROR_CLASSES: dict[int, type[AmdSmiError]] = {
    AMDSMI_STATUS_NOT_SUPPORTED: AmdSmiNotSupportedError,
    AMDSMI_STATUS_NO_PERM: AmdSmiNoPermissionError,
    AMDSMI_STATUS_NOT_FOUND: AmdSmiNotFoundError,
    AMDSMI_STATUS_NOT_INIT: AmdSmiUnavailableError,
    AMDSMI_STATUS_DRIVER_NOT_LOADED: AmdSmiUnavailableError,
    AMDSMI_STATUS_FILE_NOT_FOUND: AmdSmiUnavailableError,
}


@contextlib.contextmanager
def amdsmi_errors(amdsmi, what: str) -> Iterator[None]:
    """Turn an ``AmdSmiException`` raised in the block into the typed :class:`AmdSmiError` for its status code."""
    try:
        yield
    except amdsmi.AmdSmiLibraryException as err:
        code = err.get_error_code()
        info = err.get_error_info()
        raise _ERROR_CLASSES.get(code, AmdSmiError)(f"{what}: {info} (amdsmi status {code})", code) from err
    except amdsmi.AmdSmiException as err:  # a parameter or key error: no status code
        raise AmdSmiError(f"{what}: {type(err).__name__}: {err}") from err


def is_absent(err: AmdSmiError) -> bool:
    """Whether ``err`` says the query does not exist here."""
    return isinstance(err, AmdSmiNotSupportedError)


# ------------------------------------------------------------------------------------------- library
def load_amdsmi():
    """Import ``amdsmi`` (it prints to stdout, and fails with KeyError or OSError, where ROCm's libamd_smi.so is
    missing). Raises ImportError when it cannot be used."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import amdsmi
    except ImportError:
        raise
    except (KeyError, OSError, AttributeError) as err:
        raise ImportError(f"the amdsmi package cannot load ROCm's libamd_smi.so ({type(err).__name__}: {err}); "
                          "is ROCm installed (ROCM_PATH)?") from err
    return amdsmi


_LIBRARY_LOCK = threading.Lock()
# id(amdsmi module) -> (the module, its users in this process); the module is held so that its id is not reused
_LIBRARY_USERS: dict[int, tuple[Any, int]] = {}


def acquire_library(amdsmi) -> None:
    """``amdsmi_init`` for the first user in this process (amdsmi does not count its users itself)."""
    with _LIBRARY_LOCK:
        users = _LIBRARY_USERS.get(id(amdsmi), (amdsmi, 0))[1]
        if users == 0:
            with amdsmi_errors(amdsmi, "amdsmi_init"):
                amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
        _LIBRARY_USERS[id(amdsmi)] = (amdsmi, users + 1)


def release_library(amdsmi) -> None:
    """``amdsmi_shut_down`` when the last user in this process is done."""
    with _LIBRARY_LOCK:
        users = _LIBRARY_USERS.get(id(amdsmi), (amdsmi, 0))[1] - 1
        if users > 0:
            _LIBRARY_USERS[id(amdsmi)] = (amdsmi, users)
            return
        _LIBRARY_USERS.pop(id(amdsmi), None)
        if users == 0:
            with amdsmi_errors(amdsmi, "amdsmi_shut_down"):
                amdsmi.amdsmi_shut_down()


@contextlib.contextmanager
def amdsmi_session(amdsmi) -> Iterator[Any]:
    """amdsmi initialised for the block (shared with any sensor open in this process)."""
    acquire_library(amdsmi)
    try:
        yield amdsmi
    finally:
        release_library(amdsmi)


def _module(amdsmi_module):
    return load_amdsmi() if amdsmi_module is None else amdsmi_module


# ------------------------------------------------------------------------------------------- GPUs
@dataclasses.dataclass(frozen=True)
class AmdGpu:
    """The amdsmi GPU behind a torch device: ``amdsmi_index`` (its place in amdsmi's list, the ``-g`` of
    ``amd-smi``), ``uuid`` (amdsmi's), ``bdf`` (PCI ``domain:bus:device.function``), ``name`` (market name)."""

    amdsmi_index: int
    uuid: str
    bdf: str
    name: str

    @property
    def dual_gcd(self) -> bool:
        """An MI250/MI250X GCD: amdsmi reports its package's power on one of its two GCDs."""
        return "MI250" in self.name


def _handles(amdsmi) -> list:
    with amdsmi_errors(amdsmi, "amdsmi_get_processor_handles"):
        return list(amdsmi.amdsmi_get_processor_handles())


def _handle(amdsmi, index: int):
    handles = _handles(amdsmi)
    if not 0 <= index < len(handles):
        raise AmdSmiNotFoundError(f"no AMD GPU {index}: amdsmi sees {len(handles)}", AMDSMI_STATUS_NOT_FOUND)
    return handles[index]


def _describe_gpu(amdsmi, index: int, handle) -> AmdGpu:
    what = f"AMD GPU {index}"
    with amdsmi_errors(amdsmi, f"amdsmi_get_gpu_device_uuid on {what}"):
        uuid = str(amdsmi.amdsmi_get_gpu_device_uuid(handle))
    with amdsmi_errors(amdsmi, f"amdsmi_get_gpu_device_bdf on {what}"):
        bdf = str(amdsmi.amdsmi_get_gpu_device_bdf(handle))
    try:
        with amdsmi_errors(amdsmi, f"amdsmi_get_gpu_asic_info on {what}"):
            name = str(amdsmi.amdsmi_get_gpu_asic_info(handle).get("market_name", "AMD GPU"))
    except AmdSmiNotSupportedError:
        name = "AMD GPU"
    return AmdGpu(index, uuid, bdf, name)


def compute_partition(amdsmi, handle, what: str) -> str | None:
    """The GPU's compute partition mode (``"SPX"``, ``"CPX"`` ...); None where amdsmi has none (before MI300)."""
    if not hasattr(amdsmi, "amdsmi_get_gpu_compute_partition"):
        return None
    try:
        with amdsmi_errors(amdsmi, f"amdsmi_get_gpu_compute_partition on {what}"):
            mode = str(amdsmi.amdsmi_get_gpu_compute_partition(handle)).strip().upper()
    except AmdSmiNotSupportedError:
        return None
    return mode or None


def refuse_partition(amdsmi, handle, what: str) -> None:
    """Raise :class:`PartitionedGpuError` where the GPU is split into compute partitions."""
    mode = compute_partition(amdsmi, handle, what)
    if mode is not None and mode != SPX:
        raise PartitionedGpuError(
            f"{what} is in {mode} compute-partition mode: amdsmi reads one energy counter and one power for the "
            "whole chip, which would also count the work of every other partition on it. Measure in SPX mode "
            "(`amd-smi set -C SPX`, as root), or pass sensors=[...] of your own.")


def process_pids(amdsmi, handle, what: str) -> set[int]:
    """The PIDs amdsmi lists as using the GPU (``amdsmi_get_gpu_process_list``); amdsmi must be initialised."""
    with amdsmi_errors(amdsmi, f"amdsmi_get_gpu_process_list on {what}"):
        return {int(p["pid"]) for p in amdsmi.amdsmi_get_gpu_process_list(handle)}


class AmdCardSharing(CardSharing):
    """:class:`~lightning_energy.measure.sensors.shared_gpu.CardSharing` with amdsmi's words in its warning."""

    def warning(self) -> str:
        others = self.now
        count = others.count if others is not None else self.max_others
        pids = "" if others is None or not others.identifiable else \
            f" (PIDs {', '.join(str(p) for p in sorted(others.pids)[:8])}{', ...' if len(others.pids) > 8 else ''})"
        return (f"{self.what} is shared: amdsmi lists {count} other process(es){pids} using it. amdsmi measures "
                "the whole card, so its energy figures include their work; the report labels them SHARED.")


# ------------------------------------------------------------------------------------------- torch (HIP) -> amdsmi
def _visible(name: str) -> list[int | str] | None:
    """``name`` read as ROCm reads a ``*_VISIBLE_DEVICES`` list: indices, or ``GPU-`` UUIDs. None where unset.
    Anything else (a repeated entry, an unreadable one) cannot be told for certain and is refused."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    entries: list[int | str] = []
    for text in (part.strip() for part in raw.split(",")):
        if not text:
            continue
        if text.isdigit():
            entry: int | str = int(text)
        elif text.upper().startswith("GPU-"):
            entry = text
        else:
            raise RocmDeviceMappingError(f"{name}={raw!r}: cannot read {text!r} as a device index or GPU- UUID")
        if entry in entries:
            raise RocmDeviceMappingError(f"{name}={raw!r} names {text!r} twice")
        entries.append(entry)
    return entries


def hip_device_of(torch_index: int) -> int | str:
    """The device behind torch's ``cuda:<torch_index>`` on ROCm, before any masking: a HIP index as the whole
    node counts them, or a ``GPU-`` UUID. ``ROCR_VISIBLE_DEVICES`` masks first; ``HIP_VISIBLE_DEVICES`` (or
    ``CUDA_VISIBLE_DEVICES``, which HIP honours when it is unset) indexes what that leaves."""
    rocr, hip, cuda = (_visible(n) for n in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"))
    if hip is not None and cuda is not None and hip != cuda:
        raise RocmDeviceMappingError(
            f"HIP_VISIBLE_DEVICES={os.environ['HIP_VISIBLE_DEVICES']!r} and "
            f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} disagree; set one of them")
    index: int | str = torch_index
    masks = (("HIP_VISIBLE_DEVICES", hip) if hip is not None else ("CUDA_VISIBLE_DEVICES", cuda),
             ("ROCR_VISIBLE_DEVICES", rocr))  # the HIP mask indexes what ROCr's leaves
    for name, visible in masks:
        if visible is None:
            continue
        if isinstance(index, str):
            return index  # a UUID names the device whatever masks it further
        if index >= len(visible):
            raise RocmDeviceMappingError(f"device {index} is not in {name}={os.environ[name]!r} "
                                         f"({len(visible)} device(s))")
        index = visible[index]
    return index


def _uuid_key(text: str) -> str:
    """A UUID without ``GPU-`` and dashes, lower case; torch may print HIP's 16 ASCII hex digits as the hex of
    their bytes (32 digits): those are decoded back."""
    key = text.strip().lower()
    key = key[4:] if key.startswith("gpu-") else key
    key = key.replace("-", "")
    if len(key) == 32:
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            decoded = bytes.fromhex(key).decode("ascii").lower()
            if all(c in "0123456789abcdef" for c in decoded):
                return decoded
    return key


def _enumeration(amdsmi, handle, what: str) -> dict | None:
    """``amdsmi_get_gpu_enumeration_info`` (``hip_id``, ``hip_uuid``), None where amdsmi has it not."""
    if not hasattr(amdsmi, "amdsmi_get_gpu_enumeration_info"):
        return None
    try:
        with amdsmi_errors(amdsmi, f"amdsmi_get_gpu_enumeration_info on {what}"):
            return dict(amdsmi.amdsmi_get_gpu_enumeration_info(handle))
    except AmdSmiNotSupportedError:
        return None


def _uuid_keys(amdsmi, gpu: AmdGpu, handle) -> set[str]:
    """The keys (:func:`_uuid_key`) of a GPU's amdsmi UUID and, where amdsmi gives it, its HIP UUID."""
    hip_uuid = str((_enumeration(amdsmi, handle, f"AMD GPU {gpu.amdsmi_index}") or {}).get("hip_uuid") or "")
    return {_uuid_key(gpu.uuid)} | ({_uuid_key(hip_uuid)} if hip_uuid else set())


def _torch_properties(torch_index: int):
    """torch's properties of ``cuda:<torch_index>`` on ROCm, or None where torch (or ROCm) is absent."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not getattr(getattr(torch, "version", None), "hip", None):
        return None
    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.get_device_properties(torch_index)
    except (AssertionError, RuntimeError, ValueError) as err:
        raise RocmDeviceMappingError(f"torch cannot describe device {torch_index}: {err}") from err


def _bdf_key(bdf: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of ``dddd:bb:dd.f``."""
    try:
        domain, bus, rest = bdf.split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


def amd_gpu_for_torch_device(amdsmi, torch_index: int) -> AmdGpu:
    """The amdsmi GPU behind torch's ``cuda:<torch_index>`` on ROCm; amdsmi must be initialised by the caller.

    Identified, most trusted first: by the PCI address torch reports (``pci_domain_id``/``pci_bus_id``/
    ``pci_device_id``, where this torch has them) against ``amdsmi_get_gpu_device_bdf``; by the UUID torch
    reports, where it matches exactly one GPU's ``hip_uuid`` or amdsmi UUID (their spellings differ between
    ROCm versions: a UUID that matches none is not taken as an answer); else by the ``*_VISIBLE_DEVICES``
    variables (:func:`hip_device_of`) against ``amdsmi_get_gpu_enumeration_info``'s ``hip_id``/``hip_uuid``
    (amdsmi lists GPUs in PCI order, HIP numbers them otherwise on some nodes: without that call only a node
    with one GPU can be told). Raises :class:`RocmDeviceMappingError` where the GPU cannot be told for
    certain (never a guess), :class:`PartitionedGpuError` for a compute partition, :class:`AmdSmiError`.
    """
    handles = _handles(amdsmi)
    described = [_describe_gpu(amdsmi, i, h) for i, h in enumerate(handles)]
    what = f"torch device cuda:{torch_index}"
    properties = _torch_properties(torch_index)
    found: int | None = None
    pci = [getattr(properties, n, None) for n in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if properties is not None and all(isinstance(v, int) for v in pci):
        matches = [g.amdsmi_index for g in described if _bdf_key(g.bdf) == tuple(pci)]
        if len(matches) != 1:
            raise RocmDeviceMappingError(f"{what} is at PCI {pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}, where amdsmi "
                                         f"lists {len(matches)} GPUs")
        found = matches[0]
    uuid = getattr(properties, "uuid", None) if properties is not None else None
    if found is None and uuid:
        key = _uuid_key(str(uuid))
        matches = [g.amdsmi_index for g, h in zip(described, handles) if key in _uuid_keys(amdsmi, g, h)]
        if len(matches) == 1:
            found = matches[0]
    if found is None:
        found = _index_from_environment(amdsmi, handles, described, torch_index)
    gpu = described[found]
    refuse_partition(amdsmi, handles[found], f"{what} (AMD GPU {found}, {gpu.bdf})")
    return gpu


def _index_from_environment(amdsmi, handles: list, described: list[AmdGpu], torch_index: int) -> int:
    device = hip_device_of(torch_index)
    where = ", ".join(f"{n}={os.environ[n]!r}" for n in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                                          "CUDA_VISIBLE_DEVICES") if n in os.environ) or "no *_VISIBLE_DEVICES"
    what = f"torch device cuda:{torch_index} (HIP device {device}; {where})"
    enumerations = [_enumeration(amdsmi, h, f"AMD GPU {i}") for i, h in enumerate(handles)]
    if isinstance(device, str):
        key = _uuid_key(device)
        matches = [g.amdsmi_index for g, h in zip(described, handles) if key in _uuid_keys(amdsmi, g, h)]
        if len(matches) != 1:
            raise RocmDeviceMappingError(f"{what}: {len(matches)} amdsmi GPUs have this UUID")
        return matches[0]
    if all(e is not None and isinstance(e.get("hip_id"), int) for e in enumerations):
        matches = [i for i, e in enumerate(enumerations) if e["hip_id"] == device]
        if len(matches) != 1:
            raise RocmDeviceMappingError(f"{what}: {len(matches)} amdsmi GPUs have HIP id {device}")
        return matches[0]
    if len(handles) == 1 and device == 0:
        return 0
    raise RocmDeviceMappingError(
        f"{what}: this amdsmi cannot say which HIP index each GPU has (no amdsmi_get_gpu_enumeration_info), and "
        "amdsmi's order (PCI) is not HIP's on every node. Update ROCm's amdsmi (6.4 or newer), or pass "
        "sensors=[AmdSmiGpuSensor(<amd-smi index>)].")


def amd_gpu_of_torch_device(torch_index: int, amdsmi_module=None) -> AmdGpu:
    """:func:`amd_gpu_for_torch_device` in an amdsmi session of its own. Raises one of
    :data:`AMD_GPU_UNREADABLE`."""
    with amdsmi_session(_module(amdsmi_module)) as amdsmi:
        return amd_gpu_for_torch_device(amdsmi, torch_index)


# ------------------------------------------------------------------------------------------- sensor
def _handle_errors(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with amdsmi_errors(self._amdsmi, f"{method.__name__} on AMD GPU {self.amdsmi_index}"):
            return method(self, *args, **kwargs)

    return wrapper


def _number(value) -> float:
    """An amdsmi reading as a float: NaN for its ``"N/A"``."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


class AmdSmiGpuSensor(Sensor):
    """The energy of one AMD GPU (scope ``"device"``) by its amdsmi index (``amd-smi -g``), with telemetry.

    ``reading`` (set by :meth:`open`): ``"energy counter"`` (J from the µJ accumulator), or power in W from
    ``"instant power"`` / ``"average power"`` (see the module docstring). ``device_uuid``, ``bdf``: the card's.
    ``power_scope``: ``"gpu"``, or ``"package"`` on an MI250/MI250X GCD. ``sharing`` (set by :meth:`open`):
    the card's other processes (:class:`AmdCardSharing`); a card found shared labels ``source`` and
    ``describe()["shared"]``. Failed amdsmi calls raise :class:`AmdSmiError` subclasses; a compute partition is
    refused with :class:`PartitionedGpuError`. ``amdsmi_module``: the binding (default: ``import amdsmi`` when
    opened); ``own_pids()``: the PIDs that are "this process" (default
    :func:`~lightning_energy.measure.sensors.shared_gpu.own_process_ids`); ``clock`` (s, default
    ``time.perf_counter``): what rate-limits the process listing.
    """

    def __init__(self, amdsmi_index: int, name: str | None = None, amdsmi_module=None,
                 own_pids: Callable[[], Any] | None = None, clock: Callable[[], float] | None = None) -> None:
        self.sharing: AmdCardSharing | None = None
        super().__init__(name or f"gpu{amdsmi_index}", "device")
        self.amdsmi_index = amdsmi_index
        self.device_uuid: str | None = None
        self.bdf: str | None = None
        self.gpu_name: str | None = None
        self.reading: str | None = None
        self.power_field: str | None = None
        self.power_scope: str | None = None
        self._own_pids = own_pids
        self._sharing_clock = clock or time.perf_counter
        self._amdsmi = amdsmi_module
        self._acquired = False
        self._handle = None
        self._mode = "energy"
        self._power_key: str | None = None
        self._telemetry: dict[str, Callable[[], dict[str, float]]] = {}
        self._last_raw: int | None = None
        self._last_stamp_ns: int | None = None
        self._wraps = 0

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
        return (type(self), self.name, self.amdsmi_index)

    def describe(self) -> dict:
        return {**super().describe(), "amdsmi_index": self.amdsmi_index, "device_uuid": self.device_uuid,
                "bdf": self.bdf, "power_scope": self.power_scope, "reading": self.reading,
                "power_field": self.power_field, "library": "amdsmi",
                "shared": self.sharing.describe() if self.sharing is not None else None}

    def open(self) -> None:
        """Initialise amdsmi (shared, see :func:`acquire_library`), find the GPU and what it offers."""
        if self._handle is not None:
            return
        if self._amdsmi is None:
            self._amdsmi = load_amdsmi()
        acquire_library(self._amdsmi)
        self._acquired = True
        try:
            self._open()
        except BaseException:
            self._handle = None
            with contextlib.suppress(AmdSmiError):
                self._release()
            raise

    def _open(self) -> None:
        amdsmi, what = self._amdsmi, f"AMD GPU {self.amdsmi_index}"
        handle = _handle(amdsmi, self.amdsmi_index)
        refuse_partition(amdsmi, handle, what)
        gpu = _describe_gpu(amdsmi, self.amdsmi_index, handle)
        self.device_uuid, self.bdf, self.gpu_name = gpu.uuid, gpu.bdf, gpu.name
        self._handle = handle
        self._last_raw = self._last_stamp_ns = None
        self._wraps = 0
        self._power_key, self.power_field = self._power_source()
        try:
            with amdsmi_errors(amdsmi, f"amdsmi_get_energy_count on {what}"):
                amdsmi.amdsmi_get_energy_count(handle)
        except AmdSmiNotSupportedError:
            if self._power_key is None:
                raise AmdSmiNotSupportedError(f"{what} ({gpu.name}): amdsmi offers neither its energy counter nor "
                                              "its power (a virtual machine guest?)", AMDSMI_STATUS_NOT_SUPPORTED)
            self._mode = "power"
            self.counter_update_period_s = None
            self.reading = READING_INSTANT if self._power_key == "current_socket_power" else READING_AVERAGE
            how = f"{self.reading} polled and integrated (no energy counter) from {self.power_field}"
        else:
            self._mode = "energy"
            self.counter_update_period_s = COUNTER_UPDATE_PERIOD_S
            self.reading = READING_COUNTER
            how = ("amdsmi_get_energy_count (energy accumulator × counter_resolution, µJ; refreshed at least every "
                   f"{COUNTER_UPDATE_PERIOD_S * 1000:g} ms, assumed)")
        self.power_scope = POWER_SCOPE_PACKAGE if gpu.dual_gcd else POWER_SCOPE_GPU
        self.source = f"amdsmi {how} on AMD GPU {self.amdsmi_index} ({gpu.name}, {gpu.bdf})"
        if gpu.dual_gcd:
            self.source += (": on an MI250/MI250X amdsmi reports both GCDs' power on one GCD of the package and 0 "
                            "on the other; the two GCDs' sum is the package's")
        self._telemetry = self._supported_telemetry()
        self.sharing = AmdCardSharing(f"AMD GPU {self.amdsmi_index} ({gpu.name}, {gpu.bdf})", self._own_pids,
                                      self._sharing_clock)
        if self.sharing.due():  # the first listing, at open: due by construction, and timed from here
            self._list_processes()

    def _power_source(self) -> tuple[str | None, str | None]:
        try:
            with amdsmi_errors(self._amdsmi, f"amdsmi_get_power_info on AMD GPU {self.amdsmi_index}"):
                info = self._amdsmi.amdsmi_get_power_info(self._handle)
        except AmdSmiNotSupportedError:
            return None, None
        if not math.isnan(_number(info.get("current_socket_power"))):
            return "current_socket_power", "amdsmi_get_power_info current_socket_power (instantaneous, W)"
        if not math.isnan(_number(info.get("average_socket_power"))):
            return "average_socket_power", "amdsmi_get_power_info average_socket_power (an average, W)"
        return None, None

    def close(self) -> None:
        """Release the GPU and this sensor's share of amdsmi."""
        self._handle = None
        self._release()

    def _release(self) -> None:
        if self._acquired:
            self._acquired = False
            release_library(self._amdsmi)

    @_handle_errors
    def energy_j(self) -> float:
        """Cumulative energy in J: the accumulator (unwrapped, see the module docstring) × its resolution (µJ)."""
        count = self._amdsmi.amdsmi_get_energy_count(self._handle)
        raw = count.get("energy_accumulator", count.get("power"))
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise AmdSmiError(f"amdsmi_get_energy_count on AMD GPU {self.amdsmi_index} returned no accumulator: {count}")
        resolution_uJ = float(count["counter_resolution"])
        stamp_ns = count.get("timestamp")
        return (self._unwrapped(raw, resolution_uJ, stamp_ns if isinstance(stamp_ns, int) else None)
                * resolution_uJ * J_PER_UJ)

    def _unwrapped(self, raw: int, resolution_uJ: float, stamp_ns: int | None) -> int:
        last = self._last_raw
        if last is not None and raw < last:
            span = COUNTER_32_BIT_SPAN
            delta = raw + span - last
            elapsed_s = (stamp_ns - self._last_stamp_ns) * 1e-9 if (
                stamp_ns is not None and self._last_stamp_ns is not None and stamp_ns > self._last_stamp_ns) else None
            limit = MAX_PLAUSIBLE_W * elapsed_s / (resolution_uJ * J_PER_UJ) if elapsed_s is not None else span / 2
            if last >= span or raw >= span or delta > limit:
                raise AmdSmiCounterError(
                    f"the energy accumulator of AMD GPU {self.amdsmi_index} went backwards ({last} -> {raw} units "
                    f"of {resolution_uJ:g} µJ): a GPU reset or a driver glitch, not a 32-bit wrap; this read is "
                    "skipped")
            self._wraps += 1
        self._last_raw, self._last_stamp_ns = raw, stamp_ns
        return raw + self._wraps * COUNTER_32_BIT_SPAN

    @_handle_errors
    def power_w(self) -> float:
        """Power in W (``power_field`` says which amdsmi reading)."""
        value = _number(self._amdsmi.amdsmi_get_power_info(self._handle).get(self._power_key))
        if math.isnan(value):
            raise AmdSmiError(f"{self._power_key} of AMD GPU {self.amdsmi_index} reads N/A")
        return value

    def read_fields(self) -> dict[str, float]:
        """Telemetry; a query amdsmi fails this time reads NaN (the sensor's energy is unaffected)."""
        fields: dict[str, float] = {}
        for field, query in self._telemetry.items():
            try:
                with amdsmi_errors(self._amdsmi, f"{field} on AMD GPU {self.amdsmi_index}"):
                    fields.update(query())
            except AmdSmiError:
                fields[field] = math.nan
        fields.update(self._sharing_fields())
        return fields

    def _sharing_fields(self) -> dict[str, float]:
        """The card's other processes (listed again when due) as the ``other_processes`` telemetry field; none
        where amdsmi cannot list them."""
        sharing = self.sharing
        if sharing is None or sharing.unchecked is not None:
            return {}
        if sharing.due():
            self._list_processes()
        if sharing.unchecked is not None:
            return {}
        now = sharing.now  # None: every listing so far failed (reads NaN, as other telemetry does)
        return {"other_processes": math.nan if now is None else float(now.count)}

    def _list_processes(self) -> None:
        """List the card's processes into :attr:`sharing`. Never raises an amdsmi error: "not supported" or "no
        permission" leave the card unchecked (said in its description), other errors are counted."""
        try:
            listed = process_pids(self._amdsmi, self._handle, f"AMD GPU {self.amdsmi_index}")
        except AmdSmiError as err:
            self.sharing.failed(str(err), absent=is_absent(err) or isinstance(err, AmdSmiNoPermissionError))
            return
        self.sharing.observe(listed)

    def _supported_telemetry(self) -> dict[str, Callable[[], dict[str, float]]]:
        amdsmi, h = self._amdsmi, self._handle

        def activity():
            a = amdsmi.amdsmi_get_gpu_activity(h)
            return {"gpu_util_pct": _number(a.get("gfx_activity")), "mem_util_pct": _number(a.get("umc_activity"))}

        queries: dict[str, Callable[[], dict[str, float]]] = {}
        if self._power_key is not None:
            queries["power_W"] = lambda: {"power_W": _number(amdsmi.amdsmi_get_power_info(h).get(self._power_key))}
        queries.update({
            "utilisation": activity,
            "sm_clock_MHz": lambda: {"sm_clock_MHz": _number(
                amdsmi.amdsmi_get_clock_info(h, amdsmi.AmdSmiClkType.GFX).get("clk"))},
            "mem_clock_MHz": lambda: {"mem_clock_MHz": _number(
                amdsmi.amdsmi_get_clock_info(h, amdsmi.AmdSmiClkType.MEM).get("clk"))},
            "temperature_C": lambda: {"temperature_C": _number(amdsmi.amdsmi_get_temp_metric(
                h, amdsmi.AmdSmiTemperatureType.HOTSPOT, amdsmi.AmdSmiTemperatureMetric.CURRENT)) / 1000.0},
        })
        supported = {}
        for field, query in queries.items():
            try:
                with amdsmi_errors(amdsmi, f"{field} on AMD GPU {self.amdsmi_index}"):
                    query()
            except AmdSmiError as err:
                if is_absent(err):
                    continue
            supported[field] = query
        return supported


def rocm_in_use() -> bool:
    """Whether this process runs a ROCm build of torch (``torch.version.hip``), looked up only where torch is
    already imported (no import here: detection stays light)."""
    import sys

    torch = sys.modules.get("torch")
    return bool(getattr(getattr(torch, "version", None), "hip", None)) if torch is not None else False
