"""Shared test helpers: a fake clock, a tiny LightningModule and data, simulated sensors.

Halved runs: ``LIGHTNING_ENERGY_TEST_HALVE=1 make test`` (or ``... python -m pytest``) halves what the tests'
timing rests on, to show that none of them passes only at one machine speed (issue 32):

- every sampling interval a sampler is given in the test process (the front ends' defaults and the intervals
  the tests pass: :func:`halve_sampling_intervals`, patched at import, so the DDP scripts that import this
  module get it too) and the ``--interval`` the monitor tests pass (:func:`scaled_interval`);
- the length of the default fit: :func:`trainer_kwargs`' ``max_epochs`` (:data:`EPOCHS`, 2 -> 1). The rows of
  :func:`tiny_loader` stay (:data:`ROWS`): halving them too only changed the step numbers dozens of tests
  check exactly, not how long any fit takes relative to the sampling or a watchdog.

A test that counts the default fit's epochs or steps takes them from :data:`EPOCHS` and :data:`ROWS`; a test
whose checks describe a fit of its own (two epochs, a checkpoint at step 15) passes its ``max_epochs``.
The other switch the suite must pass under is a loaded machine: run it beside a CPU hog
(``for i in 1 2; do (while :; do :; done) & done``). No test may depend on how long anything takes: use a fake
clock (``FakeClock``, ``power_limit_helpers.install_fake_time``) or wait for an event the test controls.
"""

from __future__ import annotations

import os

os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")
# Lightning 2.6's CLI still calls jsonargparse APIs deprecated in 4.49; not ours to fix.
os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

import lightning as L
import pytest
import torch
from torch import nn

from bso_helpers import bso_server  # noqa: F401 - a session fixture: one BSO server for every test module
from fakes_nvml import FakeClock  # noqa: F401 - the clock the fakes run on, imported by tests from here
from lightning_energy.measure.sampler import Sampler
from suite_schedule import (pytest_collection_modifyitems, pytest_runtest_logreport,  # noqa: F401 - hooks
                            pytest_sessionfinish)
from suite_time import (EPOCHS, HALVED, ROWS, TIME_SCALE, halve_sampling_intervals,  # noqa: F401 - the tests'
                        scaled_interval, tiny_loader)  # names for them, from a module that imports no Lightning


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


def trainer_kwargs(tmp_path, **overrides) -> dict:
    kwargs = dict(
        default_root_dir=str(tmp_path),
        max_epochs=EPOCHS,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
        devices=1,
    )
    kwargs.update(overrides)
    return kwargs
