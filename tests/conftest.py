"""Shared test helpers: a fake clock, a tiny LightningModule and data, simulated sensors."""

from __future__ import annotations

import os

os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")
# Lightning 2.6's CLI still calls jsonargparse APIs deprecated in 4.49; not ours to fix.
os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

import lightning as L
import pytest
import torch
from torch import nn

from fakes_nvml import FakeClock  # noqa: F401 - the clock the fakes run on, imported by tests from here
from lightning_energy.measure.sampler import Sampler


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def manual_sampler(clock) -> Sampler:
    """A sampler with no thread, driven by ``sample_once()`` on the fake clock."""
    return Sampler(clock=clock)


def close_process_group() -> None:
    """End of a DDP test script: close gloo before the interpreter exits. Lightning leaves the CPU process
    group open, and gloo torn down at exit aborts now and then ("terminate called without an active
    exception", exit code -6) after a good fit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class RecordingLogger(L.pytorch.loggers.Logger):
    """A minimal third-party logger keeping every (step, metrics) it receives (MLflow and others implement
    the same interface); ``root_dir`` is where the Trainer then writes the report and trace."""

    def __init__(self, root_dir=None) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []
        self._root_dir = None if root_dir is None else str(root_dir)

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    @property
    def root_dir(self):
        return self._root_dir

    @property
    def log_dir(self):
        return self._root_dir

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def values(self, key: str) -> list:
        return [m[key] for _, m in self.metrics if key in m]

    def steps(self, key: str) -> list:
        return [step for step, m in self.metrics if key in m]


class TinyRegressor(L.LightningModule):
    """A linear model on random data that logs ``train/loss`` every step and ``val/loss``, ``test/loss``."""

    def __init__(self, in_features: int = 16, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(in_features, 1)
        self.fail_at_step = fail_at_step

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError("injected training failure")
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class FakeTimeSteps(TinyRegressor):
    """TinyRegressor on fake time: each training step moves ``clock`` (a ``SamplingClock`` from
    ``power_limit_helpers.install_fake_time``) by ``step_s`` and each validation batch by
    ``validation_step_s`` (s), so every window of a fit is an exact number of fake seconds."""

    def __init__(self, clock, step_s: float, validation_step_s: float = 0.0) -> None:
        super().__init__()
        self.clock, self.step_s, self.validation_step_s = clock, step_s, validation_step_s

    def training_step(self, batch, batch_idx):
        self.clock.advance(self.step_s)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.validation_step_s:
            self.clock.advance(self.validation_step_s)
        return super().validation_step(batch, batch_idx)


def tiny_loader(n: int = 160, batch_size: int = 16, in_features: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def trainer_kwargs(tmp_path, **overrides) -> dict:
    kwargs = dict(
        default_root_dir=str(tmp_path),
        max_epochs=2,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
        devices=1,
    )
    kwargs.update(overrides)
    return kwargs
