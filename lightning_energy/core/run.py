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
from lightning_energy.measure.sensors.base import SHARED_SCOPES, Sensor, validate_sensors
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


def checked_extra_sensors(extra_sensors, sensors=None) -> list[Sensor]:
    """The ``extra_sensors`` argument of every front end: sensors read beside the auto-detected ones (a node
    sensor, a PDU), validated before anything runs; not with ``sensors`` (list them there instead)."""
    if extra_sensors is None:
        return []
    if sensors is not None:
        raise ValueError("`extra_sensors` adds to the auto-detected sensors; with `sensors` given, list them all "
                         "in `sensors`")
    return validate_sensors(extra_sensors, "extra_sensors")


def sensors_for_rank(cuda_index: int | None, read_host: bool, sensors: list[Sensor] | None = None,
                     backend: str = "auto", extra_sensors: list[Sensor] | None = None, environ=None):
    """(sensors, notes, zeus backend) for one rank: the given ``sensors`` (host- and node-scope ones only
    where ``read_host``: local rank 0), else detected by ``backend`` for CUDA device ``cuda_index`` (None: no
    CUDA device) and, where ``read_host``, the host, plus ``extra_sensors`` (same rule) and the node sensors
    the environment configures (``LIGHTNING_ENERGY_REDFISH_URL``, ``LIGHTNING_ENERGY_IPMI``...: see
    :mod:`lightning_energy.measure.sensors.node_config`; not when ``extra_sensors`` holds a node sensor, nor
    with ``sensors`` given). ``environ``: where the settings are read (default ``os.environ``)."""
    if sensors is not None:
        return _for_this_rank(sensors, read_host), [], None
    extra = _for_this_rank(extra_sensors or [], read_host)
    if backend == "zeus":
        found, zeus = zeus_sensors(cuda_index, read_host)
        notes = []
    else:
        (found, notes), zeus = default_sensors(cuda_index, read_host), None
    found = list(found)
    if read_host and not any(s.scope == "node" for s in extra):
        from lightning_energy.measure.sensors.node_config import node_sensors_from_env

        node, node_notes = node_sensors_from_env(environ)
        found.extend(node)
        notes = [*notes, *node_notes]
    taken = {s.name for s in found}
    for sensor in extra:
        if sensor.name in taken:
            raise ValueError(f"`extra_sensors` holds a sensor named {sensor.name!r}, the name of an auto-detected "
                             "sensor; give it another name")
    return [*found, *extra], notes, zeus


def _for_this_rank(sensors: list[Sensor], read_host: bool) -> list[Sensor]:
    """Device-scope sensors on every rank; host- and node-scope ones on local rank 0 (``read_host``) only."""
    return [s for s in sensors if s.scope not in SHARED_SCOPES or read_host]


@dataclass(eq=False)
class Attachment:
    """What one component holds while attached: the shared session and the sensors it asked for."""

    session: "RunSession"
    owner: object
    sensors: list[Sensor]
    notes: list[str] = field(default_factory=list)  # one-time warnings about what could not be measured
    zeus: object = None  # the ZeusBackend when backend="zeus"
    auto: bool = False  # its sensors were auto-detected (backend "auto"): the session may add to them
    # scope "node" (the whole node: a BMC): read by the sampler, never on the meter's marks (they would wait a
    # BMC's second) nor in ``sensors`` (they contain them); the session moves them here when it adds the attachment
    node_sensors: list[Sensor] = field(default_factory=list)
    interval_s: float | None = None  # the sampling interval it asked for (set when added)

    @property
    def sensor_names(self) -> list[str]:
        """The component sensors' names: every figure of the meter's marks sums these."""
        return [s.name for s in self.sensors]

    @property
    def node_sensor_names(self) -> list[str]:
        return [s.name for s in self.node_sensors]

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
        note) and add them to the meter; node-scope sensors go to ``attachment.node_sensors``, off the meter."""
        given, attachment.sensors = attachment.sensors, []
        attachment.interval_s = interval_s
        self._acquire(attachment, given, interval_s)
        self.attachments[id(attachment.owner)] = attachment

    def add_sensors(self, attachment: Attachment, sensors: list[Sensor]) -> list[Sensor]:
        """Acquire more sensors for an attached ``attachment`` (a front end's ``extra_sensors`` beside the
        shared auto-detected ones), before its run's first mark; the sensors opened."""
        return self._acquire(attachment, sensors, attachment.interval_s or self.sampler.interval_s)

    def _acquire(self, attachment: Attachment, sensors: list[Sensor], interval_s: float) -> list[Sensor]:
        held = [*attachment.sensors, *attachment.node_sensors]
        names = self.sampler.acquire(attachment, [*held, *(s for s in sensors if s not in held)], interval_s)
        opened = [s for s in sensors if s.name in names]
        for sensor in sensors:
            if sensor.name not in names:
                attachment.notes.append(next((line for line in self.sampler.open_failures
                                              if repr(sensor.name) in line),
                                             f"sensor {sensor.name!r} could not be opened and is not measured"))
        for sensor in opened:
            if sensor.scope == "node":
                if sensor not in attachment.node_sensors:
                    attachment.node_sensors.append(sensor)
                continue
            if sensor not in attachment.sensors:
                attachment.sensors.append(sensor)
            if sensor.name not in self.meter.sensor_names:
                self.meter.sensor_names.append(sensor.name)
        return opened

    def measure_from_now(self, sensors: list[Sensor], attachments: list[Attachment]) -> list[Sensor]:
        """Acquire ``sensors`` for the session (held until it closes) and add them to ``attachments`` and the
        meter; marks already resolved (the fit's start) get each one's first reading. The sensors opened."""
        if not sensors:
            return []
        names = self.sampler.acquire(self._late_owner, sensors, self.sampler.interval_s)  # waits for a first point
        opened = [s for s in sensors if s.name in names and s.scope != "node"]
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
