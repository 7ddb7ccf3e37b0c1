"""``lightning-energy sweep``: a grid of runs (precision x batch size x power limit) from one YAML file.

``config`` reads and checks the YAML; ``runner`` runs a checked config. The names a user of the former single
module ``lightning_energy.sweep`` imported stay importable from here (loaded on first use)."""

from __future__ import annotations

import importlib

_PUBLIC = {
    "config": ("AXES", "SweepConfig", "SweepConfigError", "load_config", "parse_config"),
    "runner": ("SweepError", "per_step_figures", "run_one", "run_sweep", "summarise", "sweep_order"),
}
_HOME = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
