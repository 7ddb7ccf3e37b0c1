"""lightning-energy: energy, power, time and CO2 of PyTorch Lightning training, per step and epoch.

``Trainer(callbacks=[EnergyCallback()])`` is all a user needs. Nothing here prints on import; zeus and
codecarbon are imported only by the functions that need them.
"""

from lightning_energy.callbacks.batch_sample import BatchSampleEstimate
from lightning_energy.callbacks.batch_size import BatchSizeSearch
from lightning_energy.callbacks.bso import ZeusBatchSizeOptimizer
from lightning_energy.callbacks.carbon import CarbonCallback
from lightning_energy.callbacks.catalog import CatalogCallback
from lightning_energy.callbacks.energy import EnergyCallback
from lightning_energy.callbacks.eta import EnergyToAccuracy
from lightning_energy.callbacks.flops import FlopsCallback
from lightning_energy.callbacks.power_limit import PowerLimitOptimizer
from lightning_energy.callbacks.forecast import ForecastCallback
from lightning_energy.callbacks.precision import PrecisionSwitch
from lightning_energy.callbacks.prediction import EnergyPredictionCheck
from lightning_energy.callbacks.profiler import EnergyProfiler
from lightning_energy.carbon import intensity_from_mix
from lightning_energy.meter import Measurement, Meter
from lightning_energy.precision import SwitchablePrecision
from lightning_energy.prediction import estimate_energy
from lightning_energy.sampler import Sampler, get_sampler
from lightning_energy.sensors import CpuEstimateSensor, NvmlGpuSensor, RaplSensor, Sensor, SimulatedSensor

__all__ = [
    "EnergyCallback", "Sensor", "SimulatedSensor", "CpuEstimateSensor", "NvmlGpuSensor", "RaplSensor",
    "Measurement", "Meter", "Sampler", "get_sampler",
    "CarbonCallback", "ForecastCallback", "CatalogCallback", "BatchSampleEstimate", "intensity_from_mix",
    "EnergyProfiler", "FlopsCallback", "EnergyPredictionCheck", "estimate_energy",
    "PrecisionSwitch", "SwitchablePrecision",
    "PowerLimitOptimizer", "BatchSizeSearch", "ZeusBatchSizeOptimizer", "EnergyToAccuracy",
]
