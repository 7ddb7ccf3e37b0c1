"""Exception type for problems with user input (files, arrays, arguments).

The CLI turns a :class:`BalerInputError` into one error line on stderr and a non-zero exit code, so every
message must name the offending file, key or argument by itself.
"""


class BalerInputError(ValueError):
    """Bad user input: a missing or unreadable file, a malformed array, an inconsistent argument."""
