"""Zeus's BSO server for the tests: one process for the whole session (``bso_server``, a fixture that conftest
provides), started under the first Python that can run it: ``$LIGHTNING_ENERGY_BSO_PYTHON``,
``.venv-bso/bin/python``, or this interpreter. Each test uses a job of its own (a fresh job id).

Its start (Zeus, FastAPI and SQLAlchemy imported) takes seconds on a quiet machine and a minute or more on a
loaded one: it is waited for until it listens or exits, with no deadline of its own (pytest-timeout is the net).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "lightning_energy" / "optimize" / "bso_server.py"
POLL_S = 0.2  # how often the server is tried while it starts (s)


def server_python() -> str | None:
    """The first interpreter that can run the server (its ``--check`` passes), or None."""
    candidates = [os.environ.get("LIGHTNING_ENERGY_BSO_PYTHON"), str(REPO / ".venv-bso" / "bin" / "python"),
                  sys.executable]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            check = subprocess.run([candidate, str(LAUNCHER), "--check"], capture_output=True, text=True)
            if check.returncode == 0:
                return candidate
    return None


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=POLL_S):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def bso_server(tmp_path_factory):
    """(the server's URL, its SQLite database)."""
    python = server_python()
    if python is None:
        pytest.skip("no Python here can run Zeus's BSO server: it needs fastapi>=0.119,<0.128, uvicorn, "
                    "sqlalchemy[asyncio], aiosqlite and python-dotenv beside zeus (see lightning_energy/optimize/bso_server.py); "
                    "create .venv-bso or set LIGHTNING_ENERGY_BSO_PYTHON")
    folder = tmp_path_factory.mktemp("bso")
    database = folder / "bso.sqlite3"
    with socket.socket() as s:  # a free port on this machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(folder / "server.log", "w")
    server = subprocess.Popen([python, str(LAUNCHER), "--host", "127.0.0.1", "--port", str(port),
                               "--database", str(database)], stdout=log, stderr=subprocess.STDOUT)
    try:
        while not listening(port):  # an event (it listens, or it exits), not a time
            if server.poll() is not None:
                pytest.fail(f"the BSO server exited: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(POLL_S)
        yield f"http://127.0.0.1:{port}", database
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
