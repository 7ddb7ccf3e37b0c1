"""Config fragments that compose: one EnergyCallback per run when several ``--config`` files add one.

``configs/energy_simulated.yaml`` and ``configs/power_limit_simulated.yaml`` append (``trainer.callbacks+:``)
an EnergyCallback with their own sensors to a model config's list, which already holds an auto-detecting
EnergyCallback. Two EnergyCallbacks would measure twice and write one ``energy_report.json`` over the other,
so :func:`one_energy_callback` keeps one: the last that names its sensors, else the last one listed (a later
``--config`` overrides an earlier one). The other callbacks (ModelCheckpoint, ...) are left as they are.
"""

from __future__ import annotations


def _names_its_sensors(callback) -> bool:
    return getattr(callback, "user_sensors", None) is not None or getattr(callback, "backend", "auto") != "auto"


def is_energy_callback(callback) -> bool:
    from lightning_energy import EnergyCallback

    return isinstance(callback, EnergyCallback)


def one_energy_callback(callbacks: list) -> tuple[list, list]:
    """(the callbacks with one EnergyCallback kept, the EnergyCallbacks dropped), order otherwise unchanged."""
    energy = [c for c in callbacks if is_energy_callback(c)]
    if len(energy) < 2:
        return list(callbacks), []
    configured = [c for c in energy if _names_its_sensors(c)]
    keep = (configured or energy)[-1]
    dropped = [c for c in energy if c is not keep]
    return [c for c in callbacks if not any(c is d for d in dropped)], dropped


def describe_energy_callback(callback) -> str:
    """A short description for the note printed when callbacks are dropped: its sensors or backend."""
    sensors = getattr(callback, "user_sensors", None)
    if sensors is not None:
        return "EnergyCallback(sensors: " + ", ".join(s.name for s in sensors) + ")"
    return f"EnergyCallback(backend: {getattr(callback, 'backend', 'auto')})"
