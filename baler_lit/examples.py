"""Example data by name: ``data.path: example:CFD_animation`` in a config, ``--input example:CMS_synthetic``.

``example:CMS_synthetic`` is the synthetic CMS-jet table ``baler-lit fit --config cms_ae`` trains on when no
data path is given (:func:`~baler_lit.synthetic.synthetic_cms_jets` with the data module's default rows and
seed): generated, never read from a file, so a fresh clone can compress, decompress and evaluate it.

Baler ships a CFD example (``CFD_animation.npz``: 60 frames of a 50×50 float64 field; ``CFD_still.npz``: one
frame). It is not part of this repository; :func:`find_example` looks for the file, in order, in
``$BALER_LIT_DATA``, in ``../shared/data`` beside the repository root (where a checkout next to the Baler
data keeps it) and in ``../shared/data`` / ``data`` below the working directory. When none has it,
:func:`stand_in` generates an equivalent synthetic field (same shape, dtype and value range: a smooth
periodic flow pattern drifting frame by frame) and warns once, naming the places it searched, so a
config that needs the example still runs, and says that it ran on stand-in data. The file found is read
by :func:`baler_lit.sources.load_example` (this module reads no file: the readers are above it).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from .errors import BalerInputError
from .synthetic import synthetic_cms_jets
from .table import Table

PREFIX = "example:"
#: example name -> frames of 50×50 (Baler's files)
EXAMPLES = {"CFD_animation": 60, "CFD_still": 1}
#: generated examples: name -> (rows, seed), the defaults of BalerDataModule and configs/cms_ae.yaml
GENERATED = {"CMS_synthetic": (100_000, 0)}
FRAME = (50, 50)
ENV_DIR = "BALER_LIT_DATA"
REPO_ROOT = Path(__file__).resolve().parents[1]


def is_example(path) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def search_dirs() -> list[Path]:
    """Folders searched for Baler's example files, in order."""
    dirs = [Path(os.environ[ENV_DIR])] if os.environ.get(ENV_DIR) else []
    dirs += [REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data", Path.cwd() / "data"]
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def find_example(name: str) -> Path | None:
    """The first ``<dir>/<name>.npz`` in :func:`search_dirs`, or None."""
    for folder in search_dirs():
        candidate = folder / f"{name}.npz"
        if candidate.is_file():
            return candidate
    return None


def synthetic_cfd(frames: int = 60, seed: int = 0) -> np.ndarray:
    """A CFD-like field, ``(frames, 50, 50)`` float64 within Baler's example's range (about -0.011 to 0.048).

    Two vortex-street-like modes drifting downstream plus a little seeded noise: smooth in space, changing
    from frame to frame, so a convolutional autoencoder meets the same kind of structure.
    """
    rng = np.random.default_rng(seed)
    y, x = np.meshgrid(np.linspace(0.0, 1.0, FRAME[0]), np.linspace(0.0, 1.0, FRAME[1]), indexing="ij")
    t = np.arange(frames, dtype=float)[:, None, None] / max(frames, 1)
    field = (np.sin(2 * np.pi * (2 * x - t)) * np.cos(np.pi * (2 * y - 1)) * np.exp(-((y - 0.5) ** 2) / 0.08)
             + 0.5 * np.sin(2 * np.pi * (3 * x - 2 * t) + 1.0) * np.sin(2 * np.pi * y))
    field = field + 0.02 * rng.standard_normal(field.shape)
    low, high = -0.0111, 0.0476
    field = (field - field.min()) / (field.max() - field.min())
    return low + (high - low) * field


def example_name(path: str) -> str:
    """The name in ``example:<name>``, checked against :data:`EXAMPLES` and :data:`GENERATED`."""
    name = path[len(PREFIX):]
    if name not in EXAMPLES and name not in GENERATED:
        raise BalerInputError(f"unknown example {name!r}; known: {', '.join([*EXAMPLES, *GENERATED])}")
    return name


def generated(name: str) -> Table | None:
    """The table of a generated example (:data:`GENERATED`), or None for Baler's file examples."""
    if name not in GENERATED:
        return None
    rows, seed = GENERATED[name]
    return synthetic_cms_jets(rows, seed)


def stand_in(name: str, seed: int = 0) -> Table:
    """The synthetic stand-in for example ``name`` (Baler's file was not found), with a warning that says so."""
    searched = ", ".join(str(d) for d in search_dirs())
    warnings.warn(
        f"baler-lit: Baler's {name}.npz not found (searched {searched}; set ${ENV_DIR} to its folder): training "
        f"on a synthetic CFD-like stand-in of the same shape ({EXAMPLES[name]}×{FRAME[0]}×{FRAME[1]}), "
        "not Baler's data", UserWarning, stacklevel=3)
    return Table(synthetic_cfd(EXAMPLES[name], seed), names=[], dtypes=[], source=f"synthetic stand-in for {name}")
