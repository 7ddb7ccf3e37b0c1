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

import pytest

from bso_helpers import bso_server  # noqa: F401 - a session fixture: one BSO server for every test module
from fakes_nvml import FakeClock  # noqa: F401 - the clock the fakes run on, imported by tests from here
from lightning_energy.measure.sampler import Sampler
from rank_zygote import RankZygote
from suite_schedule import (pytest_collection_modifyitems, pytest_runtest_logreport,  # noqa: F401 - hooks
                            pytest_sessionfinish)
from suite_time import (EPOCHS, HALVED, ROWS, TIME_SCALE, halve_sampling_intervals,  # noqa: F401 - the tests'
                        scaled_interval, tiny_loader)  # names for them, from a module that imports no Lightning


LIGHTNING_DOUBLES = ("RecordingLogger", "TinyRegressor", "FakeTimeSteps")


@pytest.fixture(scope="session")
def rank_zygote():
    """Runs the DDP scripts' ranks forked from one process that imported Lightning once (rank_zygote.py)."""
    zygote = RankZygote()
    yield zygote
    zygote.close()


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


def __getattr__(name: str):
    """The Lightning doubles (tiny_lightning.py), imported on first use: ``from conftest import TinyRegressor``
    works as before, and pytest's controller process, which runs no test, never imports Lightning."""
    if name in LIGHTNING_DOUBLES:
        import tiny_lightning

        return getattr(tiny_lightning, name)
    raise AttributeError(f"module 'conftest' has no attribute {name!r}")


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
