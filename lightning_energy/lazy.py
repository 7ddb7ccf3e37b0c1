"""Public names loaded on first access (PEP 562 module ``__getattr__``): importing a package stays light."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_names(package: str, names: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``names`` (name -> defining module) are imported
    when first used; each is then cached in the package's namespace. A submodule not imported yet is
    imported on access too (``lightning_energy.measure.sensors`` after a plain ``import lightning_energy``)."""
    import sys

    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
