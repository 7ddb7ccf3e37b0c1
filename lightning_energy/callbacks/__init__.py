"""Lightning callbacks of lightning-energy; each asks the shared meter for numbers."""

from lightning_energy.callbacks.energy import EnergyCallback
from lightning_energy.callbacks.precision import PrecisionSwitch

__all__ = ["EnergyCallback", "PrecisionSwitch"]
