"""Where a joule comes from: ``measured`` by a meter, ``estimated`` by a model, or ``simulated``.

Every sensor has a provenance (:attr:`lightning_energy.Sensor.provenance`): a power meter or energy
counter (NVML, RAPL, Zeus) measures; the CPU estimate from TDP and load estimates; the simulated sensor
and the simulated GPU's counter simulate. The provenance travels with the figure: each sensor's entry in
``energy_report.json``, the report's own ``provenance`` (of its total), the trace header, the catalog and
the sweep results carry it, and every output that shows a joule names it (:func:`tagged`).

A figure summed over sensors of different provenances has them all, joined by ``+`` in the order
measured, estimated, simulated (``"measured+estimated"``: a GPU counter plus the CPU estimate).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

MEASURED = "measured"
ESTIMATED = "estimated"
SIMULATED = "simulated"
KINDS = (MEASURED, ESTIMATED, SIMULATED)
UNKNOWN = "unknown"  # files that do not say (a run dir without its energy_report.json)
_ORDER = (*KINDS, UNKNOWN)


def combine(provenances: Iterable[str]) -> str:
    """The provenance of a sum of figures: the distinct kinds joined by ``+`` (``"measured"`` for none)."""
    seen = set()
    for value in provenances:
        seen.update(value.split("+"))
    unexpected = seen - set(_ORDER)
    if unexpected:
        raise ValueError(f"unknown provenance {sorted(unexpected)}; expected one of {_ORDER}")
    return "+".join(kind for kind in _ORDER if kind in seen) or MEASURED


def of_entry(entry: Mapping) -> str:
    """The provenance of one sensor's entry in a report or catalog record.

    Entries written before provenance was recorded have only ``estimated``: they read as estimated or
    measured, as they were labelled then.
    """
    value = entry.get("provenance")
    if isinstance(value, str) and value.split("+")[0] in _ORDER:
        return combine([value])
    return ESTIMATED if entry.get("estimated") else MEASURED


def of_report(report: Mapping) -> str:
    """The provenance of a report's (or catalog record's) total, from its sensors if it does not say."""
    value = report.get("provenance")
    if isinstance(value, str) and value.split("+")[0] in _ORDER:
        return combine([value])
    sensors = report.get("sensors")
    if isinstance(sensors, list) and sensors:
        return combine(of_entry(s) for s in sensors if isinstance(s, Mapping))
    return ESTIMATED if report.get("estimated") else MEASURED


def is_measured(provenance: str) -> bool:
    """True when every part of the figure was measured."""
    return combine([provenance]) == MEASURED


def word(provenance: str) -> str:
    """How an output names it: ``"measured"``, ``"ESTIMATED"``, ``"MEASURED+SIMULATED"`` (capitals when not
    all of it is measured), ``"provenance unknown"``."""
    if provenance == UNKNOWN:
        return "provenance unknown"
    return provenance if is_measured(provenance) else provenance.upper()


def tagged(text: str, provenance: str) -> str:
    """``text`` followed by its provenance in brackets: ``"73.9 J (ESTIMATED)"``."""
    return f"{text} ({word(provenance)})"
