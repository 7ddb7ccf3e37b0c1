"""One measurement session per Trainer: this rank's sensors, the shared sampler, one Meter, one Timeline.

Every callback of the suite attaches to the session of its Trainer in ``setup`` and detaches in
``teardown``. The first to attach opens it; the sensors of all attached callbacks are read by the one
sampling thread of the process, and all marks go through the one :class:`~lightning_energy.measure.meter.Meter`
whose boundaries the Trainer's :class:`~lightning_energy.integration.timeline.Timeline` places. When the
last callback detaches the session closes, so a second ``fit`` on the same Trainer gets a fresh one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from lightning.pytorch.utilities import rank_zero_warn

from lightning_energy.measure.meter import Meter
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S, Sampler, get_sampler
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.clocks import device_clock
from lightning_energy.measure.sensors.detect import (
    default_sensors, other_cuda_devices, other_device_sensors, other_devices_note, zeus_sensors,
)


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



@dataclass(eq=False)
class Attachment:
    """What one callback holds while attached: the shared session and the sensors it asked for."""

    session: "TrainerSession"
    owner: object
    sensors: list[Sensor]
    notes: list[str] = field(default_factory=list)  # one-time warnings about what could not be measured
    zeus: object = None  # the ZeusBackend when backend="zeus"
    auto: bool = False  # its sensors were auto-detected (backend "auto"): the session may add to them

    @property
    def sensor_names(self) -> list[str]:
        return [s.name for s in self.sensors]

    @property
    def timeline(self):
        return self.session.timeline

    @property
    def meter(self) -> Meter:
        return self.session.meter

    @property
    def sampler(self) -> Sampler:
        return self.session.sampler


class TrainerSession:
    """The sampler, Meter and Timeline of one Trainer, shared by the callbacks attached to it."""

    def __init__(self, trainer, sampler: Sampler, clock) -> None:
        from lightning_energy.integration.timeline import Timeline

        self.sampler = sampler
        self.meter = Meter(sampler, [], clock)
        sampler.add_meter(self.meter)
        self.attachments: dict[int, Attachment] = {}
        self.auto_sensors: list[Sensor] | None = None  # auto-detected once, shared by every "auto" callback
        self.timeline = Timeline(trainer, self.meter, sampler, on_train_start=self._note_other_devices)
        self._device_owner = object()  # holds the sensors of devices besides the root, added at train start
        self.samples_at_open = sampler.samples_taken

    def _note_other_devices(self, trainer) -> None:
        """Once per fit, when the model sits on its devices (train start, after the strategy and the module's
        own ``on_fit_start`` placed it): when the model has parameters on CUDA devices besides the root device
        (pipeline stages, layers placed by hand), their GPUs join the sensors of every callback whose sensors
        were auto-detected, measured from train start (their energy before it is not known: the fit's start
        counts as their first reading); one warning (rank zero) and a note in every callback's report say so,
        and that marks are timed on the root device's stream only. Callbacks given their own sensors are only
        told."""
        root = trainer.strategy.root_device
        module = trainer.lightning_module
        if root.type != "cuda" or module is None:
            return
        devices = other_cuda_devices(module, root)
        if not devices:
            return
        auto = [a for a in self.attachments.values() if a.auto]
        sensors, notes = other_device_sensors(module, root) if auto else ([], [])
        sensors = self._measure_from_now(sensors, auto)
        if sensors:
            notes[0] = (other_devices_note(root, devices, sensors) + " They are measured from train start, "
                        "for the callbacks whose sensors are auto-detected.")
        else:
            notes = [other_devices_note(root, devices, []) + " Give their sensors explicitly to measure them, "
                     "e.g. `EnergyCallback(sensors=[NvmlGpuSensor(nvml_index), ...])`.", *notes[1:]]
        for note in notes:
            rank_zero_warn(f"lightning-energy: {note}")
            for attachment in self.attachments.values():
                if note not in attachment.notes:
                    attachment.notes.append(note)

    def _measure_from_now(self, sensors: list[Sensor], attachments: list[Attachment]) -> list[Sensor]:
        """Acquire ``sensors`` for the session (held until it closes) and add them to ``attachments`` and the
        meter; marks already resolved (the fit's start) get each one's first reading. The sensors opened."""
        if not sensors:
            return []
        names = self.sampler.acquire(self._device_owner, sensors, self.sampler.interval_s)  # waits for a first point
        opened = [s for s in sensors if s.name in names]
        with self.sampler._lock:  # the sampling thread resolves marks under it
            for sensor in opened:
                if sensor.name not in self.meter.sensor_names:
                    self.meter.sensor_names.append(sensor.name)
                first = self.sampler.series[sensor.name].energies[:1]
                start = self.timeline.fit_start
                if first and start is not None and start.resolved:
                    start.energy.setdefault(sensor.name, first[0])
        for attachment in attachments:
            attachment.sensors.extend(s for s in opened if s not in attachment.sensors)
        return opened

    def add(self, attachment: Attachment, interval_s: float) -> None:
        names = self.sampler.acquire(attachment, attachment.sensors, interval_s)
        dropped = [s for s in attachment.sensors if s.name not in names]
        attachment.sensors = [s for s in attachment.sensors if s.name in names]
        for sensor in dropped:
            attachment.notes.append(next((line for line in self.sampler.open_failures if repr(sensor.name) in line),
                                         f"sensor {sensor.name!r} could not be opened and is not measured"))
        for name in names:
            if name not in self.meter.sensor_names:
                self.meter.sensor_names.append(name)
        self.attachments[id(attachment.owner)] = attachment

    def remove(self, owner: object) -> bool:
        """Detach ``owner``; True when it was the last one (the session is then closed)."""
        attachment = self.attachments.pop(id(owner), None)
        if attachment is not None:
            self.sampler.release(attachment)
        if self.attachments:
            return False
        self.sampler.release(self._device_owner)
        self.timeline.close()
        self.sampler.remove_meter(self.meter)
        return True


_SESSIONS: "weakref.WeakKeyDictionary[object, TrainerSession]" = weakref.WeakKeyDictionary()


def session_of(trainer) -> TrainerSession | None:
    """The open session of ``trainer``, if any callback is attached."""
    return _SESSIONS.get(trainer)


def attach(trainer, owner: object, sensors: list[Sensor] | None = None, backend: str = "auto",
           interval_s: float = DEFAULT_INTERVAL_S, cuda_events: bool = True) -> Attachment:
    """Attach ``owner`` to its Trainer's session (opening it) with this rank's sensors.

    ``sensors=None`` with ``backend="auto"``: the sensors another callback of this Trainer already uses
    by default (an EnergyCallback's own ``sensors``, or those detected once for the session), else
    auto-detected here. Host sensors are read on local rank 0 only.
    """
    session = _SESSIONS.get(trainer)
    if session is None:
        root = trainer.strategy.root_device
        clock = device_clock(root) if root.type == "cuda" and cuda_events else None
        session = _SESSIONS[trainer] = TrainerSession(trainer, get_sampler(), clock)
    zeus, notes = None, []
    if sensors is None and backend == "auto":
        chosen = _shared_default_sensors(trainer, owner, session)
        if chosen is None:
            chosen, notes, zeus = rank_sensors(trainer, None, backend)
            session.auto_sensors = chosen
    else:
        chosen, notes, zeus = rank_sensors(trainer, sensors, backend)
    attachment = Attachment(session, owner, list(chosen), list(notes), zeus, auto=sensors is None and backend == "auto")
    session.add(attachment, interval_s)
    return attachment


def detach(attachment: Attachment) -> None:
    """Detach its owner; the last callback to leave closes the session (and the sampler releases)."""
    session = attachment.session
    if session.remove(attachment.owner):
        for trainer, candidate in list(_SESSIONS.items()):
            if candidate is session:
                del _SESSIONS[trainer]


def _shared_default_sensors(trainer, owner, session: TrainerSession) -> list[Sensor] | None:
    for callback in trainer.callbacks:
        if callback is owner or not getattr(callback, "provides_default_sensors", False):
            continue
        user = getattr(callback, "user_sensors", None)
        if user is not None:
            return rank_sensors(trainer, user)[0]
    return session.auto_sensors
