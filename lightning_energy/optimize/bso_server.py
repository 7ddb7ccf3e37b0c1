"""Zeus's batch-size-optimizer (BSO) server on this machine, with an embedded SQLite database by default.

    python lightning_energy/optimize/bso_server.py --port 8000 --database runs/zeus_bso.sqlite3
    lightning-energy bso-server --port 8000                  (the same, through the package's command)

The server is Zeus's own FastAPI app (``zeus.optimizer.batch_size.server.router``); this launcher points
it at the database (``ZEUS_BSO_DATABASE_URL``), creates Zeus's tables when they are missing (Zeus's
docs use an alembic migration for a server database; an embedded SQLite file needs none) and serves it
with uvicorn. ``--database-url`` takes any SQLAlchemy async URL instead (e.g. ``postgresql+asyncpg://...``).

Zeus's server declares ``pydantic.v1`` models (Zeus 0.16's ``bso-server`` extra pins pydantic<2). Under
pydantic 2 they load through Zeus's v1 shim, and FastAPI serves them from 0.119 to 0.127 (0.119 added
pydantic.v1 models next to v2 ones; 0.128 removed them). The environment that runs this file needs:
``zeus``, ``fastapi>=0.119,<0.128``, ``uvicorn``, ``sqlalchemy[asyncio]>=2``, ``aiosqlite``,
``python-dotenv``. It imports nothing from lightning_energy, so it runs from any such environment as a
plain script. ``--check`` only tells whether this environment can run the server.

Zeus's app trusts its clients: it reads any body into memory (a 300 MB body took 2.3 GB), a job with
100,000 batch sizes blocks every client for seconds, a negative energy answers HTTP 500. The launcher
serves it behind :class:`RequestLimits`, an ASGI middleware that refuses, before Zeus sees them, bodies
over ``MAX_BODY_BYTES`` (HTTP 413), bodies that are not a JSON object (400) and values outside
:data:`FIELD_BOUNDS` (422, naming the field). It listens on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import warnings
from pathlib import Path
from urllib.parse import parse_qs

from lightning_energy.measure.zeus_codecarbon_internals import empty_bso_connection_pool

DEFAULT_DATABASE = "zeus_bso.sqlite3"
NEEDS = ("zeus, fastapi>=0.119,<0.128 (FastAPI serves Zeus's pydantic.v1 models only in that range), uvicorn, "
         "sqlalchemy[asyncio]>=2, aiosqlite, python-dotenv")


#: Largest request body accepted (bytes): a job registration with the most batch sizes allowed is ~2 kB.
MAX_BODY_BYTES = 64 * 1024
#: Longest identifier (job id, prefix, GPU model) and query string accepted (characters).
MAX_TEXT = 256
#: Most batch sizes one job may list: each is an arm of Zeus's bandit, and every request walks them all.
MAX_BATCH_SIZES = 128
_INT, _NUM, _TEXT = "integer", "number", "text"
#: JSON field -> (kind, lowest, highest) for the bodies Zeus's endpoints read. ``None``: no bound there.
#: Zeus checks the types itself; these bounds keep its arithmetic and its loops finite and small.
FIELD_BOUNDS: dict[str, tuple[str, float | None, float | None]] = {
    "job_id": (_TEXT, None, None), "job_id_prefix": (_TEXT, None, None), "gpu_model": (_TEXT, None, None),
    "default_batch_size": (_INT, 1, 2**24), "batch_size": (_INT, 1, 2**24),
    "eta_knob": (_NUM, 0.0, 1.0), "beta_knob": (_NUM, 0.0, 1e6), "target_metric": (_NUM, -1e12, 1e12),
    "max_epochs": (_INT, 1, 100_000), "num_pruning_rounds": (_INT, 0, 100), "window_size": (_INT, 0, 100_000),
    "mab_prior_mean": (_NUM, -1e12, 1e12), "mab_prior_precision": (_NUM, 0.0, 1e12),
    "mab_num_explorations": (_INT, 0, 100), "mab_seed": (_INT, 0, 2**32 - 1),
    "max_power": (_NUM, 0.0, 1e5), "number_of_gpus": (_INT, 1, 65536),
    "trial_number": (_INT, 0, 2**31 - 1), "current_epoch": (_INT, 0, 100_000),
    "time": (_NUM, 0.0, 1e9), "energy": (_NUM, 0.0, 1e15), "metric": (_NUM, -1e12, 1e12),
}


class RequestLimits:
    """ASGI middleware in front of Zeus's BSO app: bounded bodies and inputs, answered with 4xx.

    The body is read up to ``max_body_bytes`` (a larger ``Content-Length`` is refused before reading), must
    be empty or a JSON object whose known fields lie within :data:`FIELD_BOUNDS` (``batch_sizes``: at most
    ``MAX_BATCH_SIZES`` distinct sizes), and is then handed to the app unchanged.
    """

    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _answer(send, 413, f"request body over {self.max_body_bytes} bytes")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _answer(send, 413, f"request body over {self.max_body_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        status, problem = check_request(scope.get("query_string", b""), bytes(body))
        if problem:
            await _answer(send, status, problem)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


def check_request(query_string: bytes, body: bytes) -> tuple[int, str | None]:
    """(HTTP status, problem) for a request Zeus's app should not see; ``(200, None)`` when it may."""
    if len(query_string) > MAX_TEXT * 2:
        return 414, f"query string over {MAX_TEXT * 2} bytes"
    for key, values in parse_qs(query_string.decode("latin-1")).items():
        if key in FIELD_BOUNDS and any(len(v) > MAX_TEXT for v in values):
            return 422, f"{key} longer than {MAX_TEXT} characters"
    if not body.strip():
        return 200, None
    try:
        document = json.loads(body, parse_constant=lambda name: math.nan)
    except (ValueError, RecursionError):
        return 400, "request body is not JSON"
    if not isinstance(document, dict):
        return 400, "request body must be a JSON object"
    for key, value in document.items():
        problem = _field_problem(key, value)
        if problem:
            return 422, problem
    return 200, None


def _field_problem(key: str, value) -> str | None:
    if key == "batch_sizes":
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_BATCH_SIZES:
            return f"batch_sizes must be a list of 1 to {MAX_BATCH_SIZES} batch sizes"
        if len(set(map(str, value))) != len(value):
            return "batch_sizes lists a size twice"
        problems = (_field_problem("batch_size", v) for v in value)
        return next((p.replace("batch_size", "batch_sizes[]", 1) for p in problems if p), None)
    if key not in FIELD_BOUNDS or value is None:
        return None
    kind, low, high = FIELD_BOUNDS[key]
    if kind == _TEXT:
        if isinstance(value, str) and len(value) <= MAX_TEXT:
            return None
        return f"{key} must be text of at most {MAX_TEXT} characters"
    whole = isinstance(value, int) and not isinstance(value, bool)
    number = whole or isinstance(value, float) and math.isfinite(value)
    if not number or kind == _INT and not whole or not low <= value <= high:
        return f"{key} must be a finite {kind} in [{low:g}, {high:g}], got {str(value)[:40]}"
    return None


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps({"message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--database", default=DEFAULT_DATABASE,
                        help=f"SQLite file of the embedded database (default ./{DEFAULT_DATABASE}; created if missing)")
    parser.add_argument("--database-url", default=None,
                        help="an SQLAlchemy async database URL instead of --database, e.g. postgresql+asyncpg://...")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--check", action="store_true", help="only check that this environment can run the server")


def database_url(args: argparse.Namespace) -> str:
    if args.database_url:
        return args.database_url
    path = Path(args.database).expanduser().resolve()
    if path.is_dir():
        raise ValueError(f"--database {path} is a directory; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite+aiosqlite:///{path}"


def load_server():
    """Zeus's app and database objects (after ``ZEUS_BSO_DATABASE_URL`` is set: Zeus reads it on import)."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # amdsmi prints without ROCm
        # FastAPI 0.119-0.127 serve pydantic.v1 models with a deprecation warning per route: known, see above
        warnings.filterwarnings("ignore", message=".*pydantic.v1 is deprecated.*")
        # ... and Zeus's pydantic shim imports v1 names through pydantic 2's moved-names warning
        warnings.filterwarnings("ignore", message=r".*has been removed\. We are importing from `pydantic\.v1")
        import uvicorn
        from zeus.optimizer.batch_size.server.database.db_connection import sessionmanager
        from zeus.optimizer.batch_size.server.database.schema import Base
        from zeus.optimizer.batch_size.server.router import app
    return app, Base, sessionmanager, uvicorn


async def create_tables(base, sessionmanager) -> None:
    """Zeus's tables, where missing; the pool is emptied after so that the server's event loop opens its own."""
    async with sessionmanager.connect() as connection:
        await connection.run_sync(base.metadata.create_all)
    await empty_bso_connection_pool(sessionmanager)


class LauncherError(Exception):
    """A problem with the arguments or the environment, told in one line."""


def serve(args: argparse.Namespace) -> int:
    """Check, create the tables and serve until stopped; raises :class:`LauncherError` before serving."""
    if not 0 < args.port < 65536:
        raise LauncherError(f"--port must be in 1..65535, got {args.port}")
    try:
        url = database_url(args)
    except ValueError as err:
        raise LauncherError(str(err)) from None
    os.environ["ZEUS_BSO_DATABASE_URL"] = url
    os.environ.setdefault("ZEUS_BSO_LOG_LEVEL", args.log_level)
    try:
        app, base, sessionmanager, uvicorn = load_server()
    except Exception as err:
        raise LauncherError(f"Zeus's BSO server cannot run in this environment ({type(err).__name__}: {err}). "
                            f"It needs: {NEEDS}.") from None
    if args.check:
        print("ok: Zeus's BSO server can run here")
        return 0
    import asyncio  # here, not at the top: `lightning-energy --help` need not load it

    asyncio.run(create_tables(base, sessionmanager))
    print(f"Zeus BSO server on http://{args.host}:{args.port} with database {url}", flush=True)
    uvicorn.run(RequestLimits(app), host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bso_server", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return serve(parser.parse_args(argv))
    except LauncherError as err:
        print(f"bso_server: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
