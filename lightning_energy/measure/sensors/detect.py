"""The sensors used when the user passes none: what this rank can measure, else a labelled estimate.

On a ROCm build of torch (``torch.version.hip``; torch then calls AMD GPUs ``cuda``) the GPU is read through
amdsmi (:mod:`lightning_energy.measure.sensors.amdsmi`), elsewhere through NVML.

Also what a session needs to measure every GPU once: the CUDA devices a model uses besides the root device
(:func:`other_cuda_devices`, :func:`other_device_sensors`), and which ranks' GPU sensors to leave out of
all-rank sums where two ranks read one card (:func:`duplicate_device_sensors`).
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

from lightning_energy.measure.sensors.amdsmi import (
    AMD_GPU_UNREADABLE,
    AmdGpu,
    AmdSmiGpuSensor,
    amd_gpu_of_torch_device,
    rocm_in_use,
)
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.cpu_model import CpuEstimateSensor
from lightning_energy.measure.sensors.nvml import (  # noqa: F401  (the CUDA -> NVML mapping, named here too)
    CudaDeviceMappingError,
    MigDeviceError,
    NvmlError,
    NvmlGpu,
    NvmlGpuSensor,
    nvml_gpu_of_cuda_device,
    nvml_index_of_cuda_device,
    uuid_body,
)
from lightning_energy.measure.sensors import rapl
from lightning_energy.measure.sensors.rapl import RaplSensor, find_rapl_zones, unreadable_rapl_message

BACKENDS = ("auto", "zeus")
# Why a GPU cannot be measured: no pynvml (amdsmi), NVML (amdsmi) failing, a device we cannot name for certain,
# a MIG instance (an AMD compute partition).
GPU_UNREADABLE = (ImportError, NvmlError, CudaDeviceMappingError, MigDeviceError) + AMD_GPU_UNREADABLE


def module_counter_note(gpu: NvmlGpu) -> str:
    """Why no host CPU sensor is read beside a Grace Hopper module's counter."""
    return (f"NVML GPU {gpu.nvml_index} ({gpu.name}) is a Grace Hopper module in C2C mode: its energy counter "
            "already holds the Grace CPU and its memory, so no host CPU sensor is read (it would count them twice).")


def default_sensors(
    cuda_index: int | None,
    read_host: bool,
    powercap_root: Path | None = None,
    pynvml_module=None,
    amdsmi_module=None,
    rocm: bool | None = None,
) -> tuple[list[Sensor], list[str]]:
    """Sensors for this rank and the warnings to show once (rank zero).

    ``cuda_index``: this rank's CUDA (on ROCm: HIP) device as torch numbers it, or None on CPU.
    ``read_host``: read host sensors (local rank 0 only). Not beside a Grace Hopper module in C2C mode,
    whose counter holds the Grace CPU and its memory already (a note says so).
    ``powercap_root``: where RAPL zones are looked for (default ``rapl.POWERCAP_ROOT``, read at call time).
    ``pynvml_module`` / ``amdsmi_module``: the NVML / amdsmi binding (default ``import pynvml`` / ``amdsmi``;
    tests pass fakes). ``rocm``: whether the GPU is an AMD one read through amdsmi (default: torch is a ROCm
    build, ``torch.version.hip``, looked up only where torch is already imported).
    """
    if powercap_root is None:
        powercap_root = rapl.POWERCAP_ROOT
    if rocm is None:
        rocm = rocm_in_use()
    sensors: list[Sensor] = []
    notes: list[str] = []
    if cuda_index is not None and rocm:
        try:
            amd = amd_gpu_of_torch_device(cuda_index, amdsmi_module)
        except AMD_GPU_UNREADABLE as err:
            notes.append(f"GPU energy cannot be read through amdsmi ({type(err).__name__}: {err}); "
                         "GPU energy is not counted.")
        else:
            sensors.append(AmdSmiGpuSensor(amd.amdsmi_index, amdsmi_module=amdsmi_module))
            notes.extend(amd_gpu_notes(amd))
    elif cuda_index is not None:
        try:
            gpu = nvml_gpu_of_cuda_device(cuda_index, pynvml_module)
        except GPU_UNREADABLE as err:
            notes.append(f"GPU energy cannot be read through NVML ({type(err).__name__}: {err}); GPU energy is not counted.")
        else:
            sensors.append(NvmlGpuSensor(gpu.nvml_index, pynvml_module=pynvml_module))
            if gpu.module_scope and read_host:
                notes.append(module_counter_note(gpu))
                read_host = False
    if read_host:
        zones, unreadable = find_rapl_zones(powercap_root)
        if zones:
            sensors.extend(RaplSensor(zone) for zone in zones)
        else:
            if unreadable:
                notes.append(unreadable_rapl_message(unreadable))
            sensors.append(CpuEstimateSensor())
    return sensors, notes


def amd_gpu_notes(gpu: AmdGpu) -> list[str]:
    """The warnings, once, about an AMD GPU's figures: an MI250/MI250X GCD. (A card other processes use too is
    warned about by its sensor, which finds it shared when it opens or later.)"""
    notes = []
    what = f"AMD GPU {gpu.amdsmi_index}"
    if gpu.dual_gcd:
        notes.append(f"{what} ({gpu.name}) is one GCD of a two-GCD package: amdsmi reports the package's power on "
                     "one of its GCDs and 0 on the other, so this rank's GPU figure may hold its sibling's work, or "
                     "none of its own; the sum over both GCDs is the package's.")
    return notes


# ------------------------------------------------------------------ several GPUs in one process
def other_cuda_devices(module, root_device) -> list:
    """The CUDA devices (``torch.device``, by index) holding parameters or buffers of ``module`` other than
    ``root_device`` (the strategy's root device, with its index): pipeline stages or layers placed by hand,
    which the session's sensors and marks (root device only) would otherwise miss."""
    root = (root_device.type, root_device.index)
    found = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        device = tensor.device
        if device.type == "cuda" and (device.type, device.index) != root:
            found.setdefault(device.index, device)
    return [found[index] for index in sorted(found)]


def other_device_sensors(module, root_device, pynvml_module=None, amdsmi_module=None,
                         rocm: bool | None = None) -> tuple[list[Sensor], list[str]]:
    """GPU sensors (NVML, or amdsmi on ROCm: ``rocm`` as in :func:`default_sensors`) for
    :func:`other_cuda_devices` of ``module``, and notes to show once: one line naming those devices and their
    sensors, one per device that cannot be read. Nothing when the model lives on the root device alone. A
    device on the root device's card is left out (that card is measured already)."""
    devices = other_cuda_devices(module, root_device)
    if not devices:
        return [], []
    if rocm is None:
        rocm = rocm_in_use()
    library = "amdsmi" if rocm else "NVML"

    def card_index(cuda_index: int) -> int:
        if rocm:
            return amd_gpu_of_torch_device(cuda_index, amdsmi_module).amdsmi_index
        return nvml_index_of_cuda_device(cuda_index, pynvml_module)

    root_index = None
    if root_device.type == "cuda":
        try:
            root_index = card_index(root_device.index)
        except GPU_UNREADABLE:
            pass  # the root's own detection has said why
    sensors: list[Sensor] = []
    indices: list[int] = []
    notes: list[str] = []
    for device in devices:
        try:
            index = card_index(device.index)
        except GPU_UNREADABLE as err:
            notes.append(f"{device}'s energy cannot be read through {library} ({type(err).__name__}: {err}); "
                         "it is not counted.")
            continue
        if index != root_index and index not in indices:
            indices.append(index)
            sensors.append(AmdSmiGpuSensor(index, amdsmi_module=amdsmi_module) if rocm
                           else NvmlGpuSensor(index, pynvml_module=pynvml_module))
    notes.insert(0, other_devices_note(root_device, devices, sensors))
    return sensors, notes


def other_devices_note(root_device, devices: list, sensors: list[Sensor]) -> str:
    """One line: the model uses ``devices`` besides ``root_device``; which sensors measure them; marks wait on
    the root device only."""
    where = ", ".join(str(d) for d in devices)
    measured = (f"their GPUs are measured too ({', '.join(s.name for s in sensors)})" if sensors
                else "their energy is not measured")
    return (f"The model has parameters or buffers on {where} besides the root device {root_device}: {measured}; "
            f"step and epoch boundaries are timed on {root_device}'s stream only.")


# ------------------------------------------------------------------ one card, several ranks
def duplicate_device_sensors(per_rank: list[list[dict]]) -> set[tuple[int, str]]:
    """Which (rank, sensor name) to leave out of all-rank sums so that each physical card counts once.

    ``per_rank[r]``: rank ``r``'s sensor descriptions (``Sensor.describe()``; GPU sensors carry
    ``device_uuid``). Two ranks reading one card (MPS, a mis-set ``CUDA_VISIBLE_DEVICES``) each read all of
    it: the lowest rank keeps it, every later reading of the same UUID (a later rank's, or a second sensor
    of the same rank) is named here. Sensors without a UUID (host sensors, user sensors) are never named.
    """
    owner: dict[str, tuple[int, str]] = {}
    duplicates: set[tuple[int, str]] = set()
    for rank, described in enumerate(per_rank):
        for sensor in described:
            uuid = sensor.get("device_uuid")
            if not uuid:
                continue
            key = uuid_body(str(uuid))
            if key in owner:
                duplicates.add((rank, sensor["name"]))
            else:
                owner[key] = (rank, sensor["name"])
    return duplicates


def zeus_sensors(cuda_index: int | None, read_host: bool, pynvml_module=None):
    """Sensors and the backend object for ``backend="zeus"``; raises if Zeus finds nothing to read, or if the
    CUDA device cannot be told for certain (the same CUDA -> NVML mapping as ``backend="auto"``)."""
    from lightning_energy.extras import check_installed
    from lightning_energy.measure.sensors.zeus import ZeusBackend

    check_installed("zeus", "backend='zeus'")  # a missing extra, not a GPU that cannot be told
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Zeus warns about every absent vendor library
            backend = ZeusBackend(cuda_index, with_cpu=read_host, pynvml_module=pynvml_module)
    except GPU_UNREADABLE as err:
        raise RuntimeError(f"backend='zeus': cannot tell which NVIDIA GPU CUDA device {cuda_index} is "
                           f"({type(err).__name__}: {err})") from err
    sensors = backend.sensors()
    if not sensors and (cuda_index is not None or read_host):
        raise RuntimeError(
            "backend='zeus': Zeus found no GPU or RAPL CPU counter it can read on this rank "
            "(no NVIDIA GPU visible, RAPL absent or not readable). Use backend='auto' for a labelled estimate."
        )
    return sensors, backend
