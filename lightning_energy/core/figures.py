"""A run's figures: one optimizer step, one validation/test/predict loop, one training epoch.

Energies are J per sensor name (all-rank figures summed over ranks), durations s, times on the sampler's
clock (s). A front end (a Trainer callback, the Fabric monitor, the plain meter) takes its own sensors'
figures with ``for_sensors``. Framework-free: nothing here knows a Trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lightning_energy.measure.meter import EnergyWindow, Mark, Measurement
from lightning_energy.measure.series import bound_between


@dataclass(frozen=True)
class StepFigures:
    """One optimizer step of this rank: ``measurement`` excludes the named sub-windows in ``extras``.

    ``step``: the step the front end logs this step's metrics at (under Lightning the step it logs the
    loss at); ``log``: the front end logs at it (Lightning: ``log_every_n_steps``, the last step before
    stopping, ``fast_dev_run``); ``batches``: the micro-batches it took (gradient accumulation).
    """

    step: int
    epoch: int
    batches: int
    log: bool
    measurement: Measurement
    extras: dict[str, Measurement]
    start: Mark  # the step's resolved start and end marks (cumulative J per sensor there): a window over
    end: Mark    # several steps, from one step's start to a later one's, is ``measure(a.start, b.start)``


@dataclass(frozen=True)
class LoopFigures(EnergyWindow):
    """A validation, test or predict loop over all ranks: J per sensor name (summed over ranks).

    ``bounds_J``: the attribution bound (J) per sensor (``series.bound_between``; ``inf`` for an extrapolated
    edge), None where not computed (DDP). Figures cover every sensor of the run's session: a callback
    takes its own with :meth:`for_sensors`.
    """

    kind: str
    epoch: int
    step: int
    fitting: bool
    energy_J: dict[str, float]
    duration_s: float
    start_s: float  # this rank's sampler clock (s)
    end_s: float
    missing: tuple[dict, ...] = ()
    extrapolated: bool = False
    bounds_J: dict[str, float] | None = None

    @property
    def bound_J(self) -> float:
        """Attribution bound of ``total_J`` (J); nan where not computed (DDP), inf: an edge extrapolated."""
        return math.nan if self.bounds_J is None else sum(self.bounds_J.values())

    def for_sensors(self, names) -> "LoopFigures":
        """These figures restricted to the sensors ``names`` (a callback's own)."""
        return replace(self, energy_J=only(self.energy_J, names), bounds_J=only(self.bounds_J, names),
                       missing=tuple(m for m in self.missing if m["sensor"] in names))


@dataclass(frozen=True)
class EpochFigures:
    """A training epoch over all ranks, its validation loops excluded.

    Every energy is J per sensor name summed over ranks, over every sensor of the run's session: a
    callback takes its own sensors' figures with :meth:`for_sensors`. ``energy_J``: the epoch;
    ``duration_s``: the common interval less its validation; ``steps``: optimizer steps of all ranks,
    ``steps_energy_J`` their energy; ``extras_energy_J``: sub-windows other callbacks added (name -> J per
    sensor); ``fit_energy_J``: all ranks' energy from their fit start to this epoch's end; ``missing``:
    ``{"sensor", "rank"}`` of sensors whose figures do not cover the epoch; ``bounds_J``: the attribution
    bound per sensor (None: not computed, DDP).
    """

    epoch: int
    step: int
    energy_J: dict[str, float]
    duration_s: float
    validation: tuple[LoopFigures, ...]
    steps: int
    steps_energy_J: dict[str, float]
    extras_energy_J: dict[str, dict[str, float]]
    fit_energy_J: dict[str, float]
    start_s: float  # this rank's sampler clock (s): the common start and end under DDP
    end_s: float
    missing: tuple[dict, ...] = ()
    extrapolated: bool = False
    resumed_mid_epoch: bool = False
    bounds_J: dict[str, float] | None = None

    @property
    def sensors(self) -> list[str]:
        """The sensors these figures cover, sorted."""
        return sorted(self.energy_J)

    @property
    def total_J(self) -> float:
        return sum(self.energy_J.values())

    @property
    def steps_J(self) -> float:
        return sum(self.steps_energy_J.values())

    @property
    def fit_J(self) -> float:
        return sum(self.fit_energy_J.values())

    @property
    def extras_J(self) -> dict[str, float]:
        return {name: sum(per_sensor.values()) for name, per_sensor in self.extras_energy_J.items()}

    @property
    def bound_J(self) -> float:
        """Attribution bound of ``total_J`` (J); nan where not computed (DDP), inf: an edge extrapolated."""
        return math.nan if self.bounds_J is None else sum(self.bounds_J.values())

    @property
    def validation_J(self) -> float:
        return sum(loop.total_J for loop in self.validation)

    @property
    def mean_power_W(self) -> float:
        return self.total_J / self.duration_s if self.duration_s > 0 else 0.0

    def for_sensors(self, names) -> "EpochFigures":
        """These figures restricted to the sensors ``names`` (a callback's own, of every rank)."""
        return replace(
            self, energy_J=only(self.energy_J, names), validation=tuple(v.for_sensors(names) for v in self.validation),
            steps_energy_J=only(self.steps_energy_J, names), fit_energy_J=only(self.fit_energy_J, names),
            extras_energy_J={k: only(v, names) for k, v in self.extras_energy_J.items()},
            bounds_J=only(self.bounds_J, names), missing=tuple(m for m in self.missing if m["sensor"] in names))



# ---------------------------------------------------------------------- per-sensor arithmetic
def difference(start: dict, end: dict) -> dict[str, float]:
    return {n: e - start[n] for n, e in end.items() if e is not None and start.get(n) is not None}


def total_between(start: dict, end: dict, names: list[str]) -> float:
    return sum(end[n] - start[n] for n in names if end.get(n) is not None and start.get(n) is not None)


def missing_names(start: dict, end: dict) -> set[str]:
    return {n for n, e in end.items() if e is None or start.get(n) is None}


def only(per_sensor: dict | None, names) -> dict | None:
    """``per_sensor`` (J or a bound per sensor name) restricted to ``names``; None stays None."""
    return None if per_sensor is None else {n: v for n, v in per_sensor.items() if n in names}


def without(per_sensor: dict[str, float], names) -> dict[str, float]:
    """``per_sensor`` without ``names``."""
    return {n: v for n, v in per_sensor.items() if not names or n not in names}


def add_into(total: dict[str, float], more: dict[str, float]) -> None:
    """Add ``more`` (J per sensor) into ``total`` in place."""
    for name, joules in more.items():
        total[name] = total.get(name, 0.0) + joules


def window_bounds(start: Mark, end: Mark, names) -> dict[str, float]:
    """The attribution bound (J) of the window between two resolved marks, per sensor of ``names``."""
    return {n: bound_between(start.bounds.get(n), end.bounds.get(n)) for n in names}


def sum_per_sensor(dicts) -> dict[str, float]:
    total: dict[str, float] = {}
    for d in dicts:
        add_into(total, d)
    return total


def plus(a: Measurement | None, b: Measurement) -> Measurement:
    if a is None:
        return b
    energy = sum_per_sensor([a.energy_J, b.energy_J])
    return Measurement(a.start_s, a.start_s + a.duration_s + b.duration_s, energy,
                       tuple(sorted(set(a.missing) | set(b.missing))), a.extrapolated or b.extrapolated)


def minus(gross: Measurement, parts: list[Measurement]) -> Measurement:
    """``gross`` less the sub-windows inside it: energy per sensor and duration."""
    if not parts:
        return gross
    energy = {n: j - sum(p.energy_J.get(n, 0.0) for p in parts) for n, j in gross.energy_J.items()}
    duration = gross.duration_s - sum(p.duration_s for p in parts)
    return Measurement(gross.start_s, gross.start_s + duration, energy, gross.missing, gross.extrapolated)
