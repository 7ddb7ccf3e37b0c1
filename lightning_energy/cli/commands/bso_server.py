"""``lightning-energy bso-server``: Zeus's batch-size-optimizer server on this machine (SQLite by default)."""

from __future__ import annotations

from lightning_energy.optimize import bso_server

HELP = "run Zeus's batch-size-optimizer server locally, with an embedded SQLite database by default"
SERVER_MODULES = ("zeus", "fastapi", "uvicorn", "sqlalchemy", "aiosqlite", "dotenv")  # its extra


def add_arguments(parser) -> None:
    bso_server.add_arguments(parser)


def run(args) -> int:
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.extras import check_installed

    check_installed(SERVER_MODULES, "the server", extra="bso-server")
    try:
        return bso_server.serve(args)
    except bso_server.LauncherError as err:
        raise CommandError(str(err)) from None
