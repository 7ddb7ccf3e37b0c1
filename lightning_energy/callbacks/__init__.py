"""Lightning callbacks of lightning-energy; each asks the shared meter for numbers.

The callbacks are loaded on first access (module ``__getattr__``): importing one submodule, e.g. for a
file-name constant, does not import Lightning through the others.
"""

from __future__ import annotations

import importlib

_CALLBACKS: dict[str, str] = {
    "BatchSampleEstimate": "batch_sample", "BatchSizeSearch": "batch_size", "ZeusBatchSizeOptimizer": "bso",
    "CarbonCallback": "carbon", "CatalogCallback": "catalog", "EnergyCallback": "energy",
    "EnergyToAccuracy": "eta", "ForecastCallback": "forecast", "FlopsCallback": "flops",
    "PowerLimitOptimizer": "power_limit", "PrecisionSwitch": "precision", "EnergyPredictionCheck": "prediction",
    "EnergyProfiler": "profiler",
}

__all__ = sorted(_CALLBACKS)


def __getattr__(name: str):
    module = _CALLBACKS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_energy.callbacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
