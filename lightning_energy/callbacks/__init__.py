"""Lightning callbacks of lightning-energy; each asks the shared meter for numbers."""

from lightning_energy.callbacks.energy import EnergyCallback
from lightning_energy.callbacks.flops import FlopsCallback
from lightning_energy.callbacks.precision import PrecisionSwitch
from lightning_energy.callbacks.prediction import EnergyPredictionCheck
from lightning_energy.callbacks.profiler import EnergyProfiler

__all__ = ["EnergyCallback", "EnergyProfiler", "EnergyPredictionCheck", "FlopsCallback", "PrecisionSwitch"]
