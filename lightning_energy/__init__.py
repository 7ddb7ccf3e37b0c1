"""lightning-energy: energy, power, time and CO2 of PyTorch Lightning training, per step and epoch.

``Trainer(callbacks=[EnergyCallback()])`` is all a user needs. Nothing here prints on import, and nothing
heavy is imported until it is used: the public names below are loaded on first access (module
``__getattr__``), so ``lightning-energy --help`` and the offline commands start without Lightning or torch.
zeus and codecarbon are imported only by the functions that need them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lightning_energy.lazy import lazy_names

# The library's messages go to the "lightning_energy" loggers at INFO, shown on stderr the way Lightning
# shows its own (lightning/pytorch/__init__.py, the same rule): a handler of their own only where the root
# logger has none, else they propagate to the application's handlers.
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

# public name -> the module that defines it
_PUBLIC: dict[str, str] = {
    "EnergyCallback": "lightning_energy.callbacks.energy",
    "CarbonCallback": "lightning_energy.callbacks.carbon",
    "ForecastCallback": "lightning_energy.callbacks.forecast",
    "CatalogCallback": "lightning_energy.callbacks.catalog",
    "BatchSampleEstimate": "lightning_energy.callbacks.batch_sample_estimate",
    "EnergyProfiler": "lightning_energy.callbacks.profiler",
    "FlopsCallback": "lightning_energy.callbacks.flops",
    "EnergyPredictionCheck": "lightning_energy.callbacks.prediction_check",
    "PrecisionSwitch": "lightning_energy.callbacks.precision",
    "PowerLimitOptimizer": "lightning_energy.callbacks.power_limit",
    "BatchSizeSearch": "lightning_energy.callbacks.batch_size",
    "ZeusBatchSizeOptimizer": "lightning_energy.callbacks.zeus_batch_size",
    "EnergyToAccuracy": "lightning_energy.callbacks.energy_to_accuracy",
    "CompileModel": "lightning_energy.callbacks.compile_model",
    "PrometheusCallback": "lightning_energy.callbacks.prometheus",
    "PrometheusExporter": "lightning_energy.outputs.prometheus",
    "EnergyMeter": "lightning_energy.plain",
    "EnergyMonitor": "lightning_energy.fabric",
    "Sensor": "lightning_energy.measure.sensors.base",
    "SimulatedSensor": "lightning_energy.simulate.simulated_sensor",
    "CpuEstimateSensor": "lightning_energy.measure.sensors.cpu_model",
    "NvmlGpuSensor": "lightning_energy.measure.sensors.nvml",
    "AmdSmiGpuSensor": "lightning_energy.measure.sensors.amdsmi",
    "PartitionedGpuError": "lightning_energy.measure.sensors.amdsmi",
    "NvmlProcessShareSensor": "lightning_energy.measure.sensors.nvml_share",
    "RaplSensor": "lightning_energy.measure.sensors.rapl",
    "RedfishPowerSensor": "lightning_energy.measure.sensors.redfish",
    "RedfishEnergySensor": "lightning_energy.measure.sensors.redfish",
    "redfish_node_sensor": "lightning_energy.measure.sensors.redfish",
    "Credentials": "lightning_energy.measure.sensors.redfish",
    "DcmiPowerSensor": "lightning_energy.measure.sensors.ipmi",
    "Measurement": "lightning_energy.measure.meter",
    "Meter": "lightning_energy.measure.meter",
    "Sampler": "lightning_energy.measure.sampler",
    "get_sampler": "lightning_energy.measure.sampler",
    "intensity_from_mix": "lightning_energy.carbon",
    "estimate_energy": "lightning_energy.predict.pre_run",
    "SwitchablePrecision": "lightning_energy.integration.precision_plugin",
}

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)


if TYPE_CHECKING:  # static analysers and IDEs see the names as plain imports
    from lightning_energy.callbacks.batch_sample_estimate import BatchSampleEstimate
    from lightning_energy.callbacks.batch_size import BatchSizeSearch
    from lightning_energy.callbacks.zeus_batch_size import ZeusBatchSizeOptimizer
    from lightning_energy.callbacks.carbon import CarbonCallback
    from lightning_energy.callbacks.catalog import CatalogCallback
    from lightning_energy.callbacks.compile_model import CompileModel
    from lightning_energy.callbacks.energy import EnergyCallback
    from lightning_energy.callbacks.energy_to_accuracy import EnergyToAccuracy
    from lightning_energy.callbacks.flops import FlopsCallback
    from lightning_energy.callbacks.forecast import ForecastCallback
    from lightning_energy.callbacks.power_limit import PowerLimitOptimizer
    from lightning_energy.callbacks.precision import PrecisionSwitch
    from lightning_energy.callbacks.prediction_check import EnergyPredictionCheck
    from lightning_energy.callbacks.profiler import EnergyProfiler
    from lightning_energy.callbacks.prometheus import PrometheusCallback
    from lightning_energy.outputs.prometheus import PrometheusExporter
    from lightning_energy.carbon import intensity_from_mix
    from lightning_energy.fabric import EnergyMonitor
    from lightning_energy.plain import EnergyMeter
    from lightning_energy.measure.meter import Measurement, Meter
    from lightning_energy.integration.precision_plugin import SwitchablePrecision
    from lightning_energy.measure.sensors.amdsmi import AmdSmiGpuSensor, PartitionedGpuError
    from lightning_energy.measure.sensors.ipmi import DcmiPowerSensor
    from lightning_energy.measure.sensors.nvml_share import NvmlProcessShareSensor
    from lightning_energy.measure.sensors.redfish import (Credentials, RedfishEnergySensor, RedfishPowerSensor,
                                                          redfish_node_sensor)
    from lightning_energy.predict.pre_run import estimate_energy
    from lightning_energy.measure.sampler import Sampler, get_sampler
    from lightning_energy.measure.sensors import CpuEstimateSensor, NvmlGpuSensor, RaplSensor, Sensor
    from lightning_energy.simulate.simulated_sensor import SimulatedSensor
