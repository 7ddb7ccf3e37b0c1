"""Lightning callbacks of lightning-energy; each asks the shared meter for numbers."""

from lightning_energy.callbacks.batch_sample import BatchSampleEstimate
from lightning_energy.callbacks.batch_size import BatchSizeSearch
from lightning_energy.callbacks.bso import ZeusBatchSizeOptimizer
from lightning_energy.callbacks.carbon import CarbonCallback
from lightning_energy.callbacks.catalog import CatalogCallback
from lightning_energy.callbacks.energy import EnergyCallback
from lightning_energy.callbacks.eta import EnergyToAccuracy
from lightning_energy.callbacks.forecast import ForecastCallback
from lightning_energy.callbacks.flops import FlopsCallback
from lightning_energy.callbacks.power_limit import PowerLimitOptimizer
from lightning_energy.callbacks.precision import PrecisionSwitch
from lightning_energy.callbacks.prediction import EnergyPredictionCheck
from lightning_energy.callbacks.profiler import EnergyProfiler

__all__ = [
    "BatchSampleEstimate", "BatchSizeSearch", "CarbonCallback", "CatalogCallback", "EnergyCallback",
    "EnergyPredictionCheck", "EnergyProfiler", "EnergyToAccuracy", "FlopsCallback", "ForecastCallback",
    "PowerLimitOptimizer", "PrecisionSwitch", "ZeusBatchSizeOptimizer",
]
