"""Zeus's batch-size-optimizer (BSO) server on this machine, with an embedded SQLite database by default.

    python lightning_energy/bso_server.py --port 8000 --database runs/zeus_bso.sqlite3
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
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import warnings
from pathlib import Path

DEFAULT_DATABASE = "zeus_bso.sqlite3"
NEEDS = ("zeus, fastapi>=0.119,<0.128 (FastAPI serves Zeus's pydantic.v1 models only in that range), uvicorn, "
         "sqlalchemy[asyncio]>=2, aiosqlite, python-dotenv")


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
        import uvicorn
        from zeus.optimizer.batch_size.server.database.db_connection import sessionmanager
        from zeus.optimizer.batch_size.server.database.schema import Base
        from zeus.optimizer.batch_size.server.router import app
    return app, Base, sessionmanager, uvicorn


async def create_tables(base, sessionmanager) -> None:
    """Zeus's tables, where missing; the pool is emptied after so that the server's event loop opens its own."""
    async with sessionmanager.connect() as connection:
        await connection.run_sync(base.metadata.create_all)
    await sessionmanager._engine.dispose()


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
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
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
