"""Helpers shared by the ``test_trust_*`` tests (imported explicitly; not a conftest)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def read_only_dir(tmp_path) -> Iterator[Path]:
    """A folder nobody can create files in: mode 0555, made immutable (``chattr +i``) when running as root,
    whom the mode does not stop; skipped where neither works."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False
    if os.access(folder, os.W_OK):
        immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        if not immutable:
            folder.chmod(0o755)
            pytest.skip("cannot make a folder read-only for this user")
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)
