"""A test double: Zeus's own ``zeus.device.get_gpus()`` made to return simulated cards, so a test can run
Zeus's ``GlobalPowerLimitOptimizer`` against :class:`lightning_energy.simulate.gpu_sim.SimulatedGPU` and check
that our callback follows its state machine step for step."""

from __future__ import annotations

import contextlib
import io

with contextlib.redirect_stdout(io.StringIO()):  # zeus pulls amdsmi, which prints without ROCm
    from zeus.device.gpu.common import GPUs

from lightning_energy.measure.zeus_codecarbon_internals import set_zeus_gpus_slot, zeus_gpus_slot
from lightning_energy.simulate.gpu_sim import SimulatedGPU


class SimulatedGPUs(GPUs):
    """Zeus's ``GPUs`` collection over simulated cards, for :func:`installed_in_zeus`."""

    def __init__(self, gpus: list[SimulatedGPU] | None = None, ensure_homogeneous: bool = False) -> None:
        self._gpus = list(gpus or [])
        if ensure_homogeneous:
            self._ensure_homogeneous()

    def __del__(self) -> None:
        """Nothing to shut down."""

    @property
    def gpus(self) -> list[SimulatedGPU]:
        return self._gpus


@contextlib.contextmanager
def installed_in_zeus(gpus: list[SimulatedGPU]):
    """Within the block ``zeus.device.get_gpus()`` returns these simulated GPUs (Zeus's own code drives them)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import zeus.device.gpu as zeus_gpu
    previous = zeus_gpus_slot(zeus_gpu)
    set_zeus_gpus_slot(zeus_gpu, SimulatedGPUs(gpus))
    try:
        yield zeus_gpus_slot(zeus_gpu)
    finally:
        set_zeus_gpus_slot(zeus_gpu, previous)
