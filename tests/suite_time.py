"""What the tests' timing rests on, and the tiny data every fit uses, without Lightning: imported by conftest and
by the DDP scripts that must not load Lightning (plain_ddp_fit.py: a plain torch.distributed loop).

Halved runs (``LIGHTNING_ENERGY_TEST_HALVE=1``, see conftest's docstring): importing this module makes every
``Sampler.acquire`` in the process ask for :func:`scaled_interval` of its interval, so the scripts the tests run
in other processes are halved too.
"""

from __future__ import annotations

import os


from lightning_energy.measure import sampler as sampler_module
from lightning_energy.measure.sampler import Sampler

HALVED = os.environ.get("LIGHTNING_ENERGY_TEST_HALVE", "") not in ("", "0")
TIME_SCALE = 0.5 if HALVED else 1.0  # the factor on every sampling interval
EPOCHS = 1 if HALVED else 2  # trainer_kwargs' default max_epochs
ROWS = 160  # tiny_loader's default rows (10 batches of 16)


def scaled_interval(interval_s: float) -> float:
    """``interval_s`` (s) as a halved run samples it: unchanged otherwise, and where halving would take it below
    the sampler's minimum (an interval the sampler refuses stays refused)."""
    scaled = interval_s * TIME_SCALE
    return scaled if scaled >= sampler_module.MIN_INTERVAL_S else interval_s


def halve_sampling_intervals() -> None:
    """Make every ``Sampler.acquire`` in this process ask for :func:`scaled_interval` of its interval."""
    acquire = Sampler.acquire
    if getattr(acquire, "halved", False):
        return

    def halved_acquire(self, owner, sensors, interval_s=sampler_module.DEFAULT_INTERVAL_S, start_thread=True):
        keeps_current = bool(self._owners) and interval_s == self.interval_s  # sensors added mid-run (run.py)
        return acquire(self, owner, sensors, interval_s if keeps_current else scaled_interval(interval_s),
                       start_thread)

    halved_acquire.halved = True
    Sampler.acquire = halved_acquire


if HALVED:
    halve_sampling_intervals()


def tiny_loader(n: int = ROWS, batch_size: int = 16, in_features: int = 16, seed: int = 0):
    """``n`` rows of a noisy linear target (x: ``in_features`` standard normals, y = 0.5·x₀ + noise) in batches."""
    import torch  # here, not at the top: pytest's controller imports this module through conftest and runs no test

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
