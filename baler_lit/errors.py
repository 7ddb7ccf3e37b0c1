"""Exception types for problems with user input (files, arrays, arguments) and with outputs.

The CLI turns a :class:`BalerInputError` into one error line on stderr and exit code 2, so every message
must name the offending file, key or argument by itself.
"""

from __future__ import annotations

import os
from pathlib import Path


class BalerInputError(ValueError):
    """Bad user input: a missing or unreadable file, a malformed array, an inconsistent argument."""


class BalerOutputError(BalerInputError, OSError):
    """An output that cannot be written (read-only or vanished folder, full disk, ...); also an ``OSError``."""


def output_error(path, err: OSError, doing: str = "write") -> BalerOutputError:
    """One line for an ``OSError`` met while writing ``path``: the path, what failed and the system's reason."""
    reason = err.strerror or " ".join(str(err).split()) or type(err).__name__
    exc = BalerOutputError(f"cannot {doing} {path}: {reason}")
    exc.errno = err.errno
    return exc


def existing_file(path: str | os.PathLike, what: str = "input file") -> Path:
    """``path`` as a Path if it is a readable file; else a BalerInputError naming ``what`` and the problem."""
    p = Path(path)
    if not p.exists():
        raise BalerInputError(f"{what} {p} does not exist")
    if not p.is_file():
        raise BalerInputError(f"{what} {p} is not a file")
    if not os.access(p, os.R_OK):
        raise BalerInputError(f"{what} {p} is not readable")
    return p
