"""File writing that never leaves a half-written file: write to a temporary name, then rename.

The temporary file is created exclusively (``O_EXCL``) under an unpredictable name in the target's
folder (:func:`tempfile.mkstemp`), written, flushed and ``fsync``-ed (a full disk often shows only
there), given the target's mode (an existing file's, else ``0o666`` less the umask) and renamed over
the target; on any failure it is removed and the target is left as it was.

Also :func:`read_yaml_config`: a config file read with a size bound and one-line errors, and
:func:`describe_error`: an exception as one short line, for every output problem the package reports.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

# fsync errors that only say the file system cannot sync (e.g. some network or virtual file systems)
_FSYNC_UNSUPPORTED = {errno.EINVAL, getattr(errno, "ENOTSUP", errno.EINVAL), getattr(errno, "EOPNOTSUPP", errno.EINVAL)}


def describe_error(err: BaseException) -> str:
    """``err`` as one short line: ``OSError: [Errno 28] No space left on device: 'path'``."""
    text = " ".join(str(err).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def fsync(fd: int) -> None:
    """``os.fsync(fd)``, except where the file system does not support syncing (then nothing)."""
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _FSYNC_UNSUPPORTED:
            raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and an atomic rename.

    Raises ``OSError`` (the target untouched, no temporary file left) when that fails.
    """
    return atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, content: bytes) -> Path:
    """Write ``content`` to ``path`` through a temporary file in the same folder and an atomic rename.

    The file gets the mode a plain ``open(path, "w")`` would give it (0o644 under the usual umask 022),
    not the temporary file's private 0o600. Raises ``OSError`` (the target untouched, no temporary file
    left) when that fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
            fh.flush()
            fsync(fh.fileno())
            os.chmod(tmp, _target_mode(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_folder(path.parent)
    return path


def atomic_write_json(path: str | os.PathLike, data) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")


def try_atomic_write_text(path: str | os.PathLike, text: str) -> str | None:
    """:func:`atomic_write_text` that never raises ``OSError``: None when written, else one line saying why not."""
    try:
        atomic_write_text(path, text)
    except OSError as err:
        return f"{Path(path).name} not written to {Path(path).parent} ({describe_error(err)})"
    return None


def try_atomic_write_json(path: str | os.PathLike, data) -> str | None:
    """:func:`atomic_write_json` that never raises ``OSError``: None when written, else one line saying why not."""
    return try_atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")


def _target_mode(path: Path) -> int:
    """The mode the file would have had if written in place: the existing file's, else 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask is process-wide: setting it races other threads)
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable (best effort: not every platform can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


MAX_CONFIG_BYTES = 1 << 20  # a YAML config is kilobytes: refuse anything past 1 MiB before parsing it


def read_yaml_config(path: str | os.PathLike, what: str, error: type[Exception]):
    """The YAML document of the config file ``path``; ``error`` with one line naming ``what`` and the problem
    (missing, over :data:`MAX_CONFIG_BYTES`, unreadable, not YAML)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise error(f"{what} {path} has {size} bytes; a config has at most {MAX_CONFIG_BYTES}")
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as err:
        raise error(f"{what} {path} is not valid YAML: {' '.join(str(err).split())}") from None
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
