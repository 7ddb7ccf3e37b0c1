"""Lightning callbacks of lightning-energy; each asks the shared meter for numbers.

The callbacks are loaded on first access (module ``__getattr__``): importing one submodule, e.g. for a
file-name constant, does not import Lightning through the others.
"""

from __future__ import annotations

from lightning_energy.lazy import lazy_names

_CALLBACKS: dict[str, str] = {
    "BatchSampleEstimate": "batch_sample_estimate", "BatchSizeSearch": "batch_size", "ZeusBatchSizeOptimizer": "zeus_batch_size",
    "CarbonCallback": "carbon", "CatalogCallback": "catalog", "CompileModel": "compile_model",
    "EnergyCallback": "energy",
    "EnergyToAccuracy": "energy_to_accuracy", "ForecastCallback": "forecast", "FlopsCallback": "flops",
    "PowerLimitOptimizer": "power_limit", "PrecisionSwitch": "precision", "EnergyPredictionCheck": "prediction_check",
    "EnergyProfiler": "profiler",
}

__all__ = sorted(_CALLBACKS)
__getattr__, __dir__ = lazy_names(__name__, {name: f"{__name__}.{module}" for name, module in _CALLBACKS.items()})
