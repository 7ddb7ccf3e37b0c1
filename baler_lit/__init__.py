"""Baler's autoencoder compression as a PyTorch Lightning module, data module and CLI.

Importing this package is cheap and silent: the public names below are loaded on first access, and heavy or
noisy optional dependencies (uproot, matplotlib, tensorboard, lightning_energy) are imported inside the
functions that need them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "BalerModule": "baler_lit.module",
    "BalerDataModule": "baler_lit.data",
    "build_model": "baler_lit.models",
    "compress": "baler_lit.compression",
    "decompress": "baler_lit.compression",
    "read_compressed": "baler_lit.compression",
    "load_table": "baler_lit.sources",
    "synthetic_cms_jets": "baler_lit.synthetic",
    "BalerInputError": "baler_lit.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'baler_lit' has no attribute {name!r}")
