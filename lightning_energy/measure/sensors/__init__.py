"""Energy sensors: the public base class and the built-in sources (the simulated one is
:mod:`lightning_energy.simulate.simulated_sensor`)."""

from lightning_energy.measure.sensors.base import Sensor, validate_sensors
from lightning_energy.measure.sensors.cpu_model import CpuEstimateSensor
from lightning_energy.measure.sensors.nvml import NvmlGpuSensor
from lightning_energy.measure.sensors.rapl import RaplSensor, find_rapl_zones

__all__ = ["Sensor", "validate_sensors", "CpuEstimateSensor", "NvmlGpuSensor", "RaplSensor", "find_rapl_zones"]
