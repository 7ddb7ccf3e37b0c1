"""This rank's sensors: what a Trainer's measurement session is opened with.

The session itself (one sampler, Meter and Timeline per Trainer, shared by the suite's callbacks) is
:mod:`lightning_energy.integration.session`.
"""

from __future__ import annotations

from lightning_energy.sensors.base import Sensor
from lightning_energy.sensors.detect import default_sensors, zeus_sensors


def rank_sensors(trainer, sensors: list[Sensor] | None = None, backend: str = "auto"):
    """(sensors, notes, zeus backend) for this rank: host sensors on local rank 0 only."""
    root = trainer.strategy.root_device
    cuda_index = root.index if root.type == "cuda" else None
    read_host = trainer.local_rank == 0
    if sensors is not None:
        return [s for s in sensors if s.scope == "device" or read_host], [], None
    if backend == "zeus":
        found, zeus = zeus_sensors(cuda_index, read_host)
        return found, [], zeus
    found, notes = default_sensors(cuda_index, read_host)
    return found, notes, None

