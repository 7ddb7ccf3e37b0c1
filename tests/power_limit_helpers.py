"""Fake time for the simulated GPU: marks, samples and steps on one hand-driven clock.

``install_fake_time(setattr)`` points the shared sampler and every new Meter of this process at a fake
clock that only moves when the simulated GPU runs a step; the sampler has no thread and takes one
sample after every step, so every step boundary is a sample point and every window's energy is the
exact integral of the simulator's power. ``setattr`` is ``monkeypatch.setattr`` in tests, a plain
attribute setter in the DDP script.
"""

from __future__ import annotations

import lightning as L

from conftest import RecordingLogger  # noqa: F401  (re-exported for the power-limit tests)
import torch
from torch import nn

from lightning_energy.integration import session as integration_session
from lightning_energy.measure.meter import Meter
from lightning_energy.measure.sampler import Sampler


class ThreadlessSampler(Sampler):
    """The shared sampler without its thread: samples only when the fake clock moves (or a meter waits)."""

    def acquire(self, owner, sensors, interval_s=0.02, start_thread=True):
        return super().acquire(owner, sensors, interval_s, start_thread=False)

    def request_sample(self):
        self.sample_once()  # no thread to wake: the waiting meter gets its sample at the fake time now


class SamplingClock:
    """Seconds that advance only by hand; each advance takes a sample at the new time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.sampler: Sampler | None = None

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        if self.sampler is not None:
            self.sampler.sample_once()
        return self.t


class FakeHostClock:
    """A Meter clock that puts marks at the fake time."""

    asynchronous = False

    def __init__(self, clock: SamplingClock) -> None:
        self._clock = clock

    def record(self) -> float:
        return self._clock()

    def resolve(self, token: float) -> float:
        return token

    def wait(self, token: float) -> float:
        return token

    def reanchor(self) -> None:
        """Nothing to re-anchor on a fake clock."""


def install_fake_time(setattr) -> SamplingClock:
    clock = SamplingClock()
    sampler = ThreadlessSampler(clock=clock)
    clock.sampler = sampler
    setattr(integration_session, "get_sampler", lambda: sampler)
    from lightning_energy.core import run as core_run

    setattr(core_run, "Meter", lambda s, names, c=None: Meter(s, names, FakeHostClock(clock)))
    return clock


class SimModule(L.LightningModule):
    """A linear model whose steps stand for the simulated GPU's workload.

    ``fail_at_step``: raise ``exception`` at that global step.
    """

    def __init__(self, fail_at_step: int | None = None, exception: type[BaseException] = RuntimeError,
                 clock: SamplingClock | None = None, validation_s: float = 0.0) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.fail_at_step = fail_at_step
        self.exception = exception
        self.clock = clock
        self.validation_s = validation_s
        self.steps_seen = 0

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise self.exception("injected failure")
        self.steps_seen += 1
        (x,) = batch
        return self.layer(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ValidatingSimModule(SimModule):
    """SimModule with a validation loop that takes ``validation_s`` fake seconds."""

    def validation_step(self, batch, batch_idx):
        if self.clock is not None and batch_idx == 0:
            self.clock.advance(self.validation_s)
        (x,) = batch
        self.log("val/loss", self.layer(x).square().mean(), batch_size=x.shape[0])


def loader(batches: int, batch_size: int = 256) -> torch.utils.data.DataLoader:
    x = torch.randn(batches * batch_size, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=batch_size)


ROWS = 1024
ACCURACY_PER_EPOCH = 0.2  # AccuracyModule's val/acc in epoch e (0-based) is 0.2 * (e + 1): 0.5 is reached in epoch 2


class AccuracyModule(L.LightningModule):
    """Loader from ``hparams.batch_size``; val/acc rises by 0.2 per epoch; records the batch sizes trained."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 1)
        self.trained_batches: list[int] = []

    def _loader(self, rows: int):
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=self.hparams.batch_size)

    def train_dataloader(self):
        return self._loader(ROWS)

    def val_dataloader(self):
        return self._loader(64)

    def training_step(self, batch, batch_idx):
        self.trained_batches.append(batch[0].shape[0])
        return self.layer(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", ACCURACY_PER_EPOCH * (self.current_epoch + 1), batch_size=batch[0].shape[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


