"""The suite's Lightning doubles: a tiny regressor, the same on fake time, a recording logger. Imported through
``conftest`` (``from conftest import TinyRegressor``) on first use, so that only processes that run tests import
Lightning."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn


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
