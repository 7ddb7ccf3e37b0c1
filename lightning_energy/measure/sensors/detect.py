"""The sensors used when the user passes none: what this rank can measure, else a labelled estimate."""

from __future__ import annotations

import warnings
from pathlib import Path

from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.cpu_model import CpuEstimateSensor
from lightning_energy.measure.sensors.nvml import (
    CudaDeviceMappingError,
    MigDeviceError,
    NvmlError,
    NvmlGpuSensor,
    nvml_errors,
    nvml_index_for_cuda_device,
)
from lightning_energy.measure.sensors import rapl
from lightning_energy.measure.sensors.rapl import RaplSensor, find_rapl_zones, unreadable_rapl_message

BACKENDS = ("auto", "zeus")
# Why a GPU cannot be measured: no pynvml, NVML failing, a device we cannot name for certain, a MIG instance.
GPU_UNREADABLE = (ImportError, NvmlError, CudaDeviceMappingError, MigDeviceError)


def nvml_index_of_cuda_device(cuda_index: int, pynvml_module=None) -> int:
    """The NVML index (``nvidia-smi -i``) of this process's CUDA device ``cuda_index``.

    The one CUDA -> NVML mapping, for measurement (:class:`NvmlGpuSensor`) and power-limit control alike
    (see :func:`lightning_energy.measure.sensors.nvml.nvml_index_for_cuda_device` for the rules: the UUID torch
    reports, else ``CUDA_VISIBLE_DEVICES`` with indices or ``GPU-`` UUIDs and ``CUDA_DEVICE_ORDER``).
    Initialises NVML for the call and shuts it down after; NVML counts ``nvmlInit``/``nvmlShutdown``
    pairs, so handles opened elsewhere stay valid. Raises one of :data:`GPU_UNREADABLE`.
    """
    if pynvml_module is None:
        import pynvml as pynvml_module
    nvml = pynvml_module
    with nvml_errors(nvml, "nvmlInit"):
        nvml.nvmlInit()
    try:
        return nvml_index_for_cuda_device(nvml, cuda_index)
    finally:
        with nvml_errors(nvml, "nvmlShutdown"):
            nvml.nvmlShutdown()


def default_sensors(
    cuda_index: int | None,
    read_host: bool,
    powercap_root: Path | None = None,
    pynvml_module=None,
) -> tuple[list[Sensor], list[str]]:
    """Sensors for this rank and the warnings to show once (rank zero).

    ``cuda_index``: this rank's CUDA device (after CUDA_VISIBLE_DEVICES), or None on CPU.
    ``read_host``: read host sensors (local rank 0 only).
    ``powercap_root``: where RAPL zones are looked for (default ``rapl.POWERCAP_ROOT``, read at call time).
    ``pynvml_module``: the NVML binding (default ``import pynvml``; tests pass a fake).
    """
    if powercap_root is None:
        powercap_root = rapl.POWERCAP_ROOT
    sensors: list[Sensor] = []
    notes: list[str] = []
    if cuda_index is not None:
        try:
            nvml_index = nvml_index_of_cuda_device(cuda_index, pynvml_module)
            sensors.append(NvmlGpuSensor(nvml_index, pynvml_module=pynvml_module))
        except GPU_UNREADABLE as err:
            notes.append(f"GPU energy cannot be read through NVML ({type(err).__name__}: {err}); GPU energy is not counted.")
    if read_host:
        zones, unreadable = find_rapl_zones(powercap_root)
        if zones:
            sensors.extend(RaplSensor(zone) for zone in zones)
        else:
            if unreadable:
                notes.append(unreadable_rapl_message(unreadable))
            sensors.append(CpuEstimateSensor())
    return sensors, notes


def zeus_sensors(cuda_index: int | None, read_host: bool):
    """Sensors and the backend object for ``backend="zeus"``; raises if Zeus finds nothing to read."""
    from lightning_energy.measure.sensors.zeus import ZeusBackend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Zeus warns about every absent vendor library
        backend = ZeusBackend(cuda_index, with_cpu=read_host)
    sensors = backend.sensors()
    if not sensors and (cuda_index is not None or read_host):
        raise RuntimeError(
            "backend='zeus': Zeus found no GPU or RAPL CPU counter it can read on this rank "
            "(no NVIDIA GPU visible, RAPL absent or not readable). Use backend='auto' for a labelled estimate."
        )
    return sensors, backend
