"""Exception types for problems with user input (files, arrays, arguments) and with outputs.

The CLI turns a :class:`BalerInputError` into one error line on stderr and exit code 2, so every message
must name the offending file, key or argument by itself.
"""


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
