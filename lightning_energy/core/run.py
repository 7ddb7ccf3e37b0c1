"""A run's measurement session: this rank's sensors, the process's one sampler, one Meter, one Timeline.

Every component that measures (a Trainer callback, the Fabric monitor, the plain meter) attaches to its
run's session with the sensors it asks for and detaches at the end; the sensors of all attached
components are read by the one sampling thread of the process, and all marks go through the one
:class:`~lightning_energy.measure.meter.Meter` whose boundaries the run's
:class:`~lightning_energy.core.timeline.Timeline` places. When the last component detaches the session
closes. Framework-free: a front end passes the clock, the ranks (a
:class:`~lightning_energy.core.collective.Collective`) and the host its listeners receive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_energy.core.collective import SINGLE_PROCESS, Collective
from lightning_energy.core.published import Published
from lightning_energy.core.timeline import Timeline
from lightning_energy.measure.meter import Meter
from lightning_energy.extras import check_installed
from lightning_energy.measure.sampler import MIN_INTERVAL_S, Sampler
from lightning_energy.measure.sensors.base import Sensor, validate_sensors
from lightning_energy.measure.sensors.detect import BACKENDS, default_sensors, zeus_sensors


def checked_sensors(sensors, backend: str = "auto") -> list[Sensor] | None:
    """The ``sensors`` and ``backend`` arguments every front end takes, checked before anything runs: ``sensors``
    validated (None: auto-detected by ``backend``, ``"auto"`` or ``"zeus"``, which needs the zeus extra)."""
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
    if sensors is not None and backend != "auto":
        raise ValueError("`backend` selects auto-detected sensors; give either `sensors` or `backend`, not both")
    if backend == "zeus":
        check_installed("zeus", "backend='zeus'")
    return None if sensors is None else validate_sensors(sensors)


def checked_interval(interval_s) -> float:
    """The sampling interval every front end takes (s, at least ``MIN_INTERVAL_S``)."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s >= MIN_INTERVAL_S:
        raise ValueError(f"`interval_s` must be a number >= {MIN_INTERVAL_S} s, got {interval_s!r}")
    return float(interval_s)


def sensors_for_rank(cuda_index: int | None, read_host: bool, sensors: list[Sensor] | None = None,
                     backend: str = "auto"):
    """(sensors, notes, zeus backend) for one rank: the given ``sensors`` (host-scope ones only where
    ``read_host``: local rank 0), else detected by ``backend`` for CUDA device ``cuda_index`` (None: no
    CUDA device) and, where ``read_host``, the host."""
    if sensors is not None:
        return [s for s in sensors if s.scope == "device" or read_host], [], None
    if backend == "zeus":
        found, zeus = zeus_sensors(cuda_index, read_host)
        return found, [], zeus
    found, notes = default_sensors(cuda_index, read_host)
    return found, notes, None


@dataclass(eq=False)
class Attachment:
    """What one component holds while attached: the shared session and the sensors it asked for."""

    session: "RunSession"
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


class RunSession:
    """The sampler, Meter and Timeline of one run, shared by the components attached to it."""

    def __init__(self, sampler: Sampler, clock=None, collective: Collective = SINGLE_PROCESS, host=None,
                 on_train_start=None) -> None:
        """``clock``: the Meter's mark clock (None: host timestamps); ``host``: what timeline listeners
        receive; ``on_train_start(host)``: called once per fit when training starts."""
        self.sampler = sampler
        self.collective = collective
        self.meter = Meter(sampler, [], clock)
        sampler.add_meter(self.meter)
        self.attachments: dict[int, Attachment] = {}
        self.auto_sensors: list[Sensor] | None = None  # auto-detected once, shared by every "auto" component
        self.timeline = Timeline(self.meter, sampler, collective, host, on_train_start)
        self.published = Published()  # figures components offer each other
        self._late_owner = object()  # holds the sensors added after the start (measure_from_now)
        self.samples_at_open = sampler.samples_taken
        self.failures_at_open = len(sampler.failures)  # earlier runs' failures are not this run's

    def add(self, attachment: Attachment, interval_s: float) -> None:
        """Acquire ``attachment``'s sensors on the sampler (those that cannot be opened are dropped, with a
        note) and add them to the meter."""
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

    def measure_from_now(self, sensors: list[Sensor], attachments: list[Attachment]) -> list[Sensor]:
        """Acquire ``sensors`` for the session (held until it closes) and add them to ``attachments`` and the
        meter; marks already resolved (the fit's start) get each one's first reading. The sensors opened."""
        if not sensors:
            return []
        names = self.sampler.acquire(self._late_owner, sensors, self.sampler.interval_s)  # waits for a first point
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

    def remove(self, owner: object) -> bool:
        """Detach ``owner``; True when it was the last one (the session is then closed)."""
        attachment = self.attachments.pop(id(owner), None)
        if attachment is not None:
            self.sampler.release(attachment)
        if self.attachments:
            return False
        self.sampler.release(self._late_owner)
        self.timeline.close()
        self.sampler.remove_meter(self.meter)
        return True
