"""The public sensor extension point.

A sensor reports either a cumulative energy counter (override :meth:`Sensor.energy_j`, joules) or an
instantaneous power (override :meth:`Sensor.power_w`, watts, integrated by the sampler). It has a
``name`` (unique within a process) and a ``scope``: ``"device"`` belongs to this rank's accelerator,
``"host"`` is shared by every rank on a node and is read by local rank 0 only (the CPU packages, DRAM), and
``"node"`` is the whole node as its BMC or a wall meter sees it (Redfish, IPMI DCMI): read by local rank 0
only, and never added to the sum of the other sensors, since it contains them; the report shows it beside
that sum and their difference (fans, PSU losses, disks, NICs).
"""

from __future__ import annotations

from typing import Literal

from lightning_energy.provenance import ESTIMATED, MEASURED

Scope = Literal["device", "host", "node"]
SCOPES = ("device", "host", "node")
SHARED_SCOPES = ("host", "node")  # read once per node, by local rank 0


class Sensor:
    """Base class for energy sensors.

    Subclasses override exactly one of :meth:`energy_j` or :meth:`power_w`. Optional attributes:

    - ``estimated``: ``True`` when the figure is modelled rather than read from a meter.
    - ``provenance`` (derived): ``"measured"``, ``"estimated"`` or ``"simulated"`` (see
      :mod:`lightning_energy.provenance`); simulated sensors override it.
    - ``source``: a short human-readable description of what is read (shown in the report).
    - ``counter_update_period_s``: for counters that only change every so often (NVML: ~0.1 s), the
      period; the sampler then attributes energy by interpolating between the updates it observes.
    - ``min_read_interval_s``: read this sensor at most this often (s), for sources whose value does not
      change faster; the sampler skips it on earlier ticks (but reads it when a result is waited for).
    - ``counter_resolution_J``: for counters, the smallest step the counter moves by (J; NVML: 1 mJ); the
      series adds it to each window's bound.
    """

    estimated: bool = False
    counter_update_period_s: float | None = None
    min_read_interval_s: float | None = None

    def __init__(self, name: str, scope: Scope = "host", source: str | None = None) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"Sensor name must be a non-empty string, got {name!r}")
        if scope not in SCOPES:
            raise ValueError(f"Sensor scope must be one of {SCOPES}, got {scope!r}")
        self.name = name
        self.scope: Scope = scope
        self.source = source or type(self).__name__

    # --- what a subclass overrides -------------------------------------------------------------
    def energy_j(self) -> float:
        """Cumulative energy in joules since an arbitrary origin (monotonic non-decreasing)."""
        raise NotImplementedError

    def power_w(self) -> float:
        """Instantaneous power in watts."""
        raise NotImplementedError

    def read_fields(self) -> dict[str, float]:
        """Extra telemetry recorded in the trace at each sample (utilisation, clocks, ...)."""
        return {}

    def open(self) -> None:
        """Acquire resources; called once before the first read, on the thread that acquires the sampler
        (the training thread, in a callback's ``setup``), not on the sampling thread."""

    def close(self) -> None:
        """Release resources; called once after the last read."""

    # --- derived ---------------------------------------------------------------------------------
    @property
    def kind(self) -> Literal["energy", "power"]:
        """``"energy"`` for cumulative counters, ``"power"`` for instantaneous readings."""
        cls = type(self)
        if cls.energy_j is not Sensor.energy_j:
            return "energy"
        if cls.power_w is not Sensor.power_w:
            return "power"
        raise TypeError(f"Sensor {self.name!r} ({cls.__name__}) overrides neither energy_j() nor power_w()")

    @property
    def provenance(self) -> str:
        """Where this sensor's joules come from: ``"measured"``, or ``"estimated"`` for a modelled figure."""
        return ESTIMATED if self.estimated else MEASURED

    def describe(self) -> dict:
        """The report's description of this sensor."""
        return {
            "name": self.name,
            "scope": self.scope,
            "kind": self.kind,
            "estimated": bool(self.estimated),
            "provenance": self.provenance,
            "source": self.source,
        }

    def identity(self) -> tuple:
        """What makes two sensor objects read the same thing: the shared sampler lets callbacks share a
        name only between sensors with equal identities (two callbacks that each detected the same GPU).
        Not ``source``: sensors may refine it when opened. Subclasses add what else sets their readings."""
        return (type(self), self.name, self.scope, self.kind, bool(self.estimated))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, scope={self.scope!r})"


def described(sensor: Sensor) -> dict:
    """``sensor.describe()``, or its name alone if that raises (a user's sensor): every rank must reach the
    collective that follows a description."""
    try:
        return dict(sensor.describe())
    except Exception:
        return {"name": sensor.name}


def validate_sensors(sensors: object, argument: str = "sensors") -> list[Sensor]:
    """Check a user-given list of sensors: Sensor instances with a usable kind and unique names."""
    if isinstance(sensors, Sensor):
        sensors = [sensors]
    if not isinstance(sensors, (list, tuple)):
        raise TypeError(f"`{argument}` must be a list of lightning_energy.Sensor, got {type(sensors).__name__}")
    names: set[str] = set()
    for item in sensors:
        if not isinstance(item, Sensor):
            raise TypeError(
                f"`{argument}` must hold lightning_energy.Sensor instances; got {type(item).__name__}: {item!r}"
            )
        item.kind  # raises TypeError if neither method is overridden
        if item.name in names:
            raise ValueError(f"`{argument}` holds two sensors named {item.name!r}; names must be unique")
        names.add(item.name)
    return list(sensors)
