"""Energy sensors: the public base class and the built-in sources."""

from lightning_energy.sensors.base import Sensor, validate_sensors
from lightning_energy.sensors.estimate import CpuEstimateSensor
from lightning_energy.sensors.nvml import NvmlGpuSensor
from lightning_energy.sensors.rapl import RaplSensor, find_rapl_zones
from lightning_energy.sensors.simulated import SimulatedSensor

__all__ = ["Sensor", "validate_sensors", "CpuEstimateSensor", "NvmlGpuSensor", "RaplSensor", "find_rapl_zones",
           "SimulatedSensor"]
