"""Lightning callbacks of lightning-energy; each asks the shared meter for numbers."""

from lightning_energy.callbacks.energy import EnergyCallback

__all__ = ["EnergyCallback"]
