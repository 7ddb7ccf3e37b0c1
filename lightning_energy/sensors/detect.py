"""The sensors used when the user passes none: what this rank can measure, else a labelled estimate."""

from __future__ import annotations

import warnings
from pathlib import Path

from lightning_energy.sensors.base import Sensor
from lightning_energy.sensors.estimate import CpuEstimateSensor
from lightning_energy.sensors.nvml import NvmlGpuSensor, load_pynvml, nvml_index_for_cuda_device
from lightning_energy.sensors import rapl
from lightning_energy.sensors.rapl import RaplSensor, find_rapl_zones, unreadable_rapl_message

BACKENDS = ("auto", "zeus")


def default_sensors(
    cuda_index: int | None,
    read_host: bool,
    powercap_root: Path | None = None,
) -> tuple[list[Sensor], list[str]]:
    """Sensors for this rank and the warnings to show once (rank zero).

    ``cuda_index``: this rank's CUDA device (after CUDA_VISIBLE_DEVICES), or None on CPU.
    ``read_host``: read host sensors (local rank 0 only).
    ``powercap_root``: where RAPL zones are looked for (default ``rapl.POWERCAP_ROOT``, read at call time).
    """
    if powercap_root is None:
        powercap_root = rapl.POWERCAP_ROOT
    sensors: list[Sensor] = []
    notes: list[str] = []
    if cuda_index is not None:
        try:
            pynvml = load_pynvml()
            sensors.append(NvmlGpuSensor(nvml_index_for_cuda_device(pynvml, cuda_index), pynvml_module=pynvml))
        except Exception as err:
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
    from lightning_energy.sensors.zeus import ZeusBackend

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
