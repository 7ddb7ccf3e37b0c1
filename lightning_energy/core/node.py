"""The whole node's energy over the run's windows, from node-scope sensors (a BMC over Redfish or IPMI).

A BMC refreshes every 1-10 s and answers in 0.1-2 s, so node sensors are kept off the run's meter: a step
or epoch mark never waits for them, and they never enter the component figures (they contain them). A
:class:`NodeLedger` places its own marks at the times of boundaries already measured (the fit's start, each
epoch's start and end, its validation loops) and the sampling thread resolves them once the node's samples
cover them, a BMC refresh or two later; the training thread only appends a mark (no lock) and, at the run's
end, waits once for the node's samples to cover it, bounded by :meth:`NodeLedger.end_wait_s`.

Per node: ``node_J`` (its node sensor), ``components_J`` (the sum of the component sensors of every rank on
it) and ``other_J = node_J - components_J``: fans, PSU losses, disks, NICs, and whatever the component
sensors miss; each labelled measured / estimated (:func:`node_split`).
"""

from __future__ import annotations

import math

from lightning_energy.core.figures import window_bounds
from lightning_energy.measure.clocks import HostClock
from lightning_energy.measure.meter import Mark, Meter, measure
from lightning_energy.measure.sampler import RESOLUTION_INTERVALS, Sampler
from lightning_energy.measure.series import STALE_COUNTER_PERIODS
from lightning_energy.provenance import combine

MAX_END_WAIT_S = 15.0  # the longest the run's end waits for a node sensor's samples (s)
OTHER_LABEL = "other: fans, PSU losses, disks, NICs (the node less its component sensors)"


class NodeLedger:
    """Node-scope sensors' cumulative energy at chosen times, resolved off the training thread."""

    def __init__(self, sampler: Sampler, names: list[str]) -> None:
        self.sampler = sampler
        self.names = list(names)
        self.meter = Meter(sampler, self.names, HostClock())  # its marks come with their times
        sampler.add_meter(self.meter)

    def at(self, t: float) -> Mark:
        """A mark at time ``t`` (s, sampler clock), resolved when the node's samples cover it (no lock)."""
        mark = Mark(t, t)
        self.meter._pending_marks.append(mark)
        return mark

    def end_wait_s(self) -> float:
        """How long the run's end waits for the node's samples (s): a few sampling intervals plus the
        slowest node sensor's read interval, counter period and read time, at most :data:`MAX_END_WAIT_S`."""
        longest = 0.0
        for name in self.names:
            series = self.sampler.series.get(name)
            if series is None:
                continue
            sensor = series.sensor
            longest = max(longest, (sensor.counter_update_period_s or 0.0) + (sensor.min_read_interval_s or 0.0)
                          + self.sampler.slow_sensors.get(name, 0.0))
        return min(MAX_END_WAIT_S, RESOLUTION_INTERVALS * self.sampler.interval_s + (STALE_COUNTER_PERIODS + 0.5) * longest)

    def wait(self, mark: Mark) -> Mark:
        """Block (bounded by :meth:`end_wait_s`) until ``mark`` and every earlier node mark are resolved;
        past the bound the node sensors are extrapolated and the mark says so. For the run's end only."""
        return self.meter.wait(mark, self.end_wait_s())

    def window(self, start: Mark, end: Mark) -> dict:
        """The node sensors' figures between two resolved marks: ``energy_J`` per sensor, ``bounds_J`` per
        sensor (inf: an extrapolated edge), ``missing`` (sensors that do not cover it)."""
        m = measure(start, end)
        return {"energy_J": dict(m.energy_J), "bounds_J": window_bounds(start, end, m.energy_J),
                "missing": list(m.missing)}

    def close(self) -> None:
        self.sampler.remove_meter(self.meter)


def node_split(node_J: float | None, node_provenance: str, components_J: float, components_provenance: str) -> dict:
    """The node's energy beside the sum of its component sensors and the rest, each labelled."""
    split = {"node_J": node_J, "node_provenance": node_provenance,
             "components_J": components_J, "components_provenance": components_provenance}
    if node_J is None or not math.isfinite(node_J):
        return {**split, "other_J": None, "other_provenance": None}
    return {**split, "other_J": node_J - components_J,
            "other_provenance": combine([node_provenance, components_provenance])}
