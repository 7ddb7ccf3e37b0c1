"""Module paths from before the package layout of issue 19, kept for one release as deprecated aliases.

``import lightning_energy.meter`` (old) gives a thin module that warns once (``DeprecationWarning``) and
reads every name from the new module(s); nothing is copied, so the classes are the very same objects.
No file lives at an old path, so git follows each move as a rename. New code imports the new paths, or
the public names at ``lightning_energy.<Name>``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old module -> the new module(s) its names are read from, first match wins
MOVED: dict[str, tuple[str, ...]] = {
    "lightning_energy.sensors": ("lightning_energy.measure.sensors", "lightning_energy.testing.simulated_sensor"),
    "lightning_energy.sensors.base": ("lightning_energy.measure.sensors.base",),
    "lightning_energy.sensors.nvml": ("lightning_energy.measure.sensors.nvml",),
    "lightning_energy.sensors.rapl": ("lightning_energy.measure.sensors.rapl",),
    "lightning_energy.sensors.zeus": ("lightning_energy.measure.sensors.zeus",),
    "lightning_energy.sensors.detect": ("lightning_energy.measure.sensors.detect",),
    "lightning_energy.sensors.estimate": ("lightning_energy.measure.sensors.cpu_model",),
    "lightning_energy.sensors.simulated": ("lightning_energy.testing.simulated_sensor",),
    "lightning_energy.meter": ("lightning_energy.measure.meter",),
    "lightning_energy.sampler": ("lightning_energy.measure.sampler",),
    "lightning_energy.series": ("lightning_energy.measure.series",),
    "lightning_energy.clocks": ("lightning_energy.measure.clocks",),
    "lightning_energy.gpu_sim": ("lightning_energy.testing.gpu_sim",),
    "lightning_energy.examples": ("lightning_energy.testing.example_model",),
    "lightning_energy.precision": ("lightning_energy.integration.precision_plugin",
                                   "lightning_energy.optimize.precision.modes"),
    "lightning_energy.prediction": ("lightning_energy.predict.pre_run",),
    "lightning_energy.forecast": ("lightning_energy.predict.forecast",),
    "lightning_energy.power_limit": ("lightning_energy.optimize.power_limit.search",
                                     "lightning_energy.optimize.power_limit.profile_file"),
    "lightning_energy.report": ("lightning_energy.outputs.report",),
    "lightning_energy.trace": ("lightning_energy.outputs.trace",),
    "lightning_energy.callbacks.eta": ("lightning_energy.callbacks.energy_to_accuracy",),
    "lightning_energy.callbacks.bso": ("lightning_energy.callbacks.zeus_batch_size",),
    "lightning_energy.callbacks.prediction": ("lightning_energy.callbacks.prediction_check",),
    "lightning_energy.callbacks.batch_sample": ("lightning_energy.callbacks.batch_sample_estimate",),
}
PACKAGES = {"lightning_energy.sensors"}


class _Alias(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a plain module

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        targets = MOVED[name]
        warnings.warn(f"{name} is deprecated: import {targets[0]} (or the public names at lightning_energy.<Name>)",
                      DeprecationWarning, stacklevel=2)
        modules = [importlib.import_module(target) for target in targets]

        def __getattr__(attribute: str):
            for target in modules:
                if hasattr(target, attribute):
                    return getattr(target, attribute)
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}")

        module.__getattr__ = __getattr__
        module.__doc__ = f"Deprecated alias of {', '.join(targets)}."
        module.__all__ = sorted({n for target in modules for n in getattr(target, "__all__", ())})


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(), is_package=fullname in PACKAGES)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
