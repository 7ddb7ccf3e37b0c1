"""The optional parts of lightning-energy: which pip extra installs each package, and one way to import them.

``pip install lightning-energy`` installs the core: what ``EnergyCallback``, ``EnergyMeter``,
``EnergyMonitor`` and ``lightning-energy monitor`` need. Every other package comes with an extra
(``pyproject.toml``; sizes in ``benchmarks/install_size.py``), and a feature that needs one says which in one
line when it is missing: :func:`require` imports a package (quietly) or raises :class:`MissingExtra`;
:func:`check_installed` only checks, importing nothing (for a check at construction or before a command
writes anything). The CLI turns a :class:`MissingExtra`, or a ``ModuleNotFoundError`` of a package in
:data:`EXTRA_OF` (:func:`missing_extra_of`), into one line and exit code 2.

Importing CodeCarbon or Zeus is noisy where no AMD GPU is: ``amdsmi`` prints to stdout without ROCm, and
CodeCarbon warns "AMD GPU detected but amdsmi is not properly configured" through its own stderr handler.
:func:`quiet_import` keeps both away from the user (CodeCarbon resets its logger's level while it is being
imported, so a level set beforehand does not hold: a filter on the logger does).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import logging
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType

DISTRIBUTION = "lightning-energy"

#: top-level module -> the extra that installs it (``pyproject.toml``'s ``[project.optional-dependencies]``)
EXTRA_OF: dict[str, str] = {
    "codecarbon": "carbon",
    "zeus": "zeus",
    "matplotlib": "analysis",
    "scipy": "analysis",
    "jsonargparse": "cli",
    "uproot": "baler",
    "awkward": "baler",
    "fastapi": "bso-server",
    "uvicorn": "bso-server",
    "sqlalchemy": "bso-server",
    "aiosqlite": "bso-server",
    "dotenv": "bso-server",
    "prometheus_client": "prometheus",
    "hls4ml": "hls4ml",
}
#: loggers whose records below ERROR are dropped while an optional package is imported (see the module docstring)
NOISY_IMPORT_LOGGERS = ("codecarbon",)


def install_command(extra: str) -> str:
    """The command that installs ``extra`` (quoted for any shell)."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


class MissingExtra(ModuleNotFoundError):
    """A feature's optional package is not installed; the message (one line) names the feature, the package
    and the pip extra that installs it. A ``ModuleNotFoundError`` (an ``ImportError``), so the handlers
    callers already have for a missing package catch it."""

    def __init__(self, feature: str, module: str, extra: str) -> None:
        self.feature, self.module, self.extra = feature, module, extra
        super().__init__(f"{feature} needs {module}, which is not installed: {install_command(extra)}",
                         name=module)


def extra_of(module: str) -> str:
    """The extra that installs ``module`` (a dotted name is looked up by its top-level package)."""
    root = module.partition(".")[0]
    try:
        return EXTRA_OF[root]
    except KeyError:
        raise ValueError(f"{root!r} is not an optional package of {DISTRIBUTION}; known: {sorted(EXTRA_OF)}") from None


def is_installed(module: str) -> bool:
    """Whether ``module``'s top-level package can be imported, without importing it (a package hidden by
    ``sys.modules[name] = None`` counts as missing)."""
    root = module.partition(".")[0]
    if root in sys.modules:
        return sys.modules[root] is not None
    try:
        return importlib.util.find_spec(root) is not None
    except (ImportError, ValueError):
        return False


def check_installed(modules: str | Iterable[str], feature: str, extra: str | None = None) -> None:
    """Raise :class:`MissingExtra` for the first of ``modules`` that is not installed; imports nothing.

    ``feature``: what needs them, as the user named it (``"CarbonCallback(codecarbon_crosscheck=True)"``);
    ``extra``: the extra to name (default: each module's own, :data:`EXTRA_OF`)."""
    for module in [modules] if isinstance(modules, str) else modules:
        if not is_installed(module):
            raise MissingExtra(feature, module.partition(".")[0], extra or extra_of(module))


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """``module`` imported (quietly, see :func:`quiet_import`), or :class:`MissingExtra` when its package, or
    a package it needs, is not installed. ``feature`` and ``extra`` as for :func:`check_installed`."""
    check_installed(module, feature, extra)
    try:
        with quiet_import():
            return importlib.import_module(module)
    except ModuleNotFoundError as err:  # a dependency of the extra's package is missing: the extra again
        missing = (err.name or module).partition(".")[0]
        raise MissingExtra(feature, missing, extra or extra_of(module)) from None


def missing_extra_of(err: BaseException, feature: str) -> MissingExtra | None:
    """``err`` as a :class:`MissingExtra` when it is one, or as one for ``feature`` when it is a
    ``ModuleNotFoundError`` of a package an extra installs; None for anything else."""
    if isinstance(err, MissingExtra):
        return err
    if isinstance(err, ModuleNotFoundError) and err.name:
        root = err.name.partition(".")[0]
        if root in EXTRA_OF:
            return MissingExtra(feature, root, EXTRA_OF[root])
    return None


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Within: stdout captured (``amdsmi`` prints to it without ROCm) and :data:`NOISY_IMPORT_LOGGERS`' records
    below ERROR dropped (CodeCarbon's warning about an AMD GPU the machine may not have). A filter on the logger
    itself, since CodeCarbon replaces its logger's handlers and resets its level while it is imported; the
    logger's level and handlers are left as the package set them."""
    loggers = [logging.getLogger(name) for name in NOISY_IMPORT_LOGGERS]
    below_error = _BelowError()
    for logger in loggers:
        logger.addFilter(below_error)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(below_error)
