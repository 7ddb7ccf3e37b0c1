"""The configurations shipped inside the package: ``baler-lit fit --config cms_ae`` from any folder.

The YAML files live in the repository's ``configs/`` folder; ``baler_lit/configs`` is a link to it, and the
build copies its ``*.yaml`` into the wheel as package data (pyproject ``[tool.setuptools.package-data]``), so a
clone and an installed wheel read the same files and nothing is kept twice. A config's name is its file name
without ``.yaml``; its description is the first line of its leading comment.

This module imports neither Lightning nor torch: ``baler-lit configs`` and the name lookup before
LightningCLI starts cost only the file reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .errors import BalerInputError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SUFFIX = ".yaml"
#: what a shipped name may look like (a bare word: no folder, no suffix needed)
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
#: LightningCLI's options that take a config file (``--config=FILE`` is handled too)
CONFIG_OPTIONS = ("--config", "-c")


def shipped_names() -> list[str]:
    """Names of the shipped configs, sorted (empty when the package was installed without them)."""
    return sorted(p.name.removesuffix(SUFFIX) for p in CONFIG_DIR.glob(f"*{SUFFIX}") if p.is_file())


def description(path: Path) -> str:
    """The first line of the file's leading ``#`` comment (an empty string when it starts without one)."""
    with path.open(encoding="utf-8") as fh:
        first = fh.readline().strip()
    return first.lstrip("#").strip() if first.startswith("#") else ""


def shipped_path(name: str) -> Path | None:
    """The shipped config called ``name`` (``cms_ae`` or ``cms_ae.yaml``), or None."""
    if not NAME_PATTERN.fullmatch(name):
        return None
    path = CONFIG_DIR / (name if name.endswith(SUFFIX) else name + SUFFIX)
    return path if path.is_file() else None


def resolve_config(value: str) -> str:
    """What ``--config VALUE`` should read: ``value`` itself when it is a file (a file in the working folder wins
    over a shipped name) or inline YAML, else the shipped config of that name.

    A bare word that is neither an existing file nor a shipped name is refused (:class:`BalerInputError`) with
    the names there are, instead of being parsed as a one-word YAML document.
    """
    if Path(value).exists() or not NAME_PATTERN.fullmatch(value):
        return value
    found = shipped_path(value)
    if found is not None:
        return str(found)
    known = ", ".join(shipped_names()) or "none (this installation has no shipped configs)"
    raise BalerInputError(f"--config {value}: no such file and no shipped config of that name (shipped: {known};"
                          " `baler-lit configs` describes them)")


def resolve_config_arguments(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--config``/``-c`` value passed through :func:`resolve_config`."""
    resolved: list[str] = []
    expect_value = False
    for arg in argv:
        if expect_value:
            resolved.append(resolve_config(arg))
            expect_value = False
        elif arg in CONFIG_OPTIONS:
            resolved.append(arg)
            expect_value = True
        elif arg.startswith("--config="):
            resolved.append("--config=" + resolve_config(arg.removeprefix("--config=")))
        else:
            resolved.append(arg)
    return resolved


def list_configs(name: str | None = None) -> str:
    """``baler-lit configs``: one line per shipped config (name and description) and where they are; with
    ``name``, that config's file path alone (for ``cat``, a copy to edit, or another tool's ``--config``)."""
    if name is not None:
        found = shipped_path(name)
        if found is None:
            raise BalerInputError(f"no shipped config {name!r} (shipped: {', '.join(shipped_names()) or 'none'})")
        return str(found)
    names = shipped_names()
    if not names:
        return f"no shipped configs in {CONFIG_DIR}"
    width = max(len(n) for n in names)
    lines = [f"{n:<{width}}  {description(CONFIG_DIR / (n + SUFFIX))}" for n in names]
    return "\n".join([*lines, "", f"in {CONFIG_DIR}; use a name as `baler-lit fit --config cms_ae` (several --config"
                      " compose, the later ones win); `baler-lit configs NAME` prints its path"])
