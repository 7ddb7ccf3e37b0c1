"""Helpers shared by the ``test_baler_*`` tests (imported explicitly; not a conftest)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch

#: Real example files live next to the repository, never inside it (``BALER_LIT_DATA`` points elsewhere, e.g.
#: from a git worktree one level deeper).
DATA_DIR = Path(os.environ.get("BALER_LIT_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))
NANOAOD = DATA_DIR / "nanoAOD_2015_CMS_Open_Data_ttbar.root"
CFD = DATA_DIR / "CFD_animation.npz"
HZZ = DATA_DIR / "uproot-HZZ.root"
ZMUMU = DATA_DIR / "uproot-Zmumu.root"
REPO = Path(__file__).resolve().parents[1]


def requires(path: Path) -> pytest.MarkDecorator:
    """Skip when a shared data file is absent (the folder ../shared/data is outside the repository)."""
    return pytest.mark.skipif(not path.exists(), reason=f"shared data file {path} not found")


def quick_trainer(max_epochs: int = 2, **kwargs) -> L.Trainer:
    """A silent CPU trainer: no logger, checkpoints, progress bar or model summary unless asked for."""
    options = dict(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return L.Trainer(**options)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op torch thread inside the block (as `make test` does via OMP_NUM_THREADS=1).

    With two threads on a 2-core machine that is busy with anything else, OpenMP's spinning workers make
    small convolutions up to 15x slower; one thread keeps the tests' run time predictable.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Function-scoped :func:`single_thread`."""
    with single_thread():
        yield
