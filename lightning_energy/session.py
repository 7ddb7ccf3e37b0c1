"""Attach a callback to the shared sampler: pick this rank's sensors, acquire the sampler, open a Meter.

Every callback of the suite goes through :func:`open_meter_session` in its ``setup`` so that one
sampling thread serves them all. A callback that finds an ``EnergyCallback`` already set up in the same
Trainer reuses its sensors rather than detecting them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_energy.clocks import device_clock
from lightning_energy.meter import Meter
from lightning_energy.sampler import DEFAULT_INTERVAL_S, Sampler, get_sampler
from lightning_energy.sensors.base import Sensor
from lightning_energy.sensors.detect import default_sensors, zeus_sensors


@dataclass
class MeterSession:
    """What a callback holds while attached: its sensors, the shared sampler and its own Meter."""

    owner: object
    sampler: Sampler
    meter: Meter
    sensors: list[Sensor]
    notes: list[str] = field(default_factory=list)  # one-time warnings about what could not be measured
    zeus: object = None  # the ZeusBackend when backend="zeus"

    def close(self) -> None:
        """Detach from the sampler (stops the thread when nobody else uses it)."""
        self.sampler.remove_meter(self.meter)
        self.sampler.release(self.owner)


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


def open_meter_session(
    trainer,
    owner: object,
    sensors: list[Sensor] | None = None,
    backend: str = "auto",
    interval_s: float = DEFAULT_INTERVAL_S,
    cuda_events: bool = True,
    clock=None,
) -> MeterSession:
    """Attach ``owner`` to the shared sampler with this rank's sensors and return its session.

    ``clock``: where the meter's marks are put (a ``lightning_energy.clocks`` clock); by default host
    time, or CUDA events on a CUDA device when ``cuda_events``.
    """
    zeus = None
    notes: list[str] = []
    if sensors is None and backend == "auto" and (shared := _energy_callback_sensors(trainer, owner)) is not None:
        chosen = shared
    else:
        chosen, notes, zeus = rank_sensors(trainer, sensors, backend)
    sampler = get_sampler()
    names = sampler.acquire(owner, chosen, interval_s)
    root = trainer.strategy.root_device
    if clock is None and root.type == "cuda" and cuda_events:
        clock = device_clock_for(root)
    meter = Meter(sampler, names, clock)
    sampler.add_meter(meter)
    return MeterSession(owner, sampler, meter, chosen, notes, zeus)


def _energy_callback_sensors(trainer, owner) -> list[Sensor] | None:
    """The sensors of an EnergyCallback (any callback that ``provides_default_sensors``) in the same
    Trainer, whether it is set up before or after us."""
    for callback in trainer.callbacks:
        if callback is owner or not getattr(callback, "provides_default_sensors", False):
            continue
        if callback.sensors_in_use:
            return list(callback.sensors_in_use)
        if callback.user_sensors is not None:
            return rank_sensors(trainer, callback.user_sensors)[0]
    return None


def device_clock_for(root_device):
    """The process's one event clock of a CUDA device (see ``lightning_energy.clocks.device_clock``)."""
    return device_clock(root_device)
