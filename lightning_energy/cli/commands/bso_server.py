"""``lightning-energy bso-server``: Zeus's batch-size-optimizer server on this machine (SQLite by default)."""

from __future__ import annotations

from lightning_energy.optimize import bso_server

HELP = "run Zeus's batch-size-optimizer server locally, with an embedded SQLite database by default"


def add_arguments(parser) -> None:
    bso_server.add_arguments(parser)


def run(args) -> int:
    from lightning_energy.cli.commands import CommandError

    try:
        return bso_server.serve(args)
    except bso_server.LauncherError as err:
        raise CommandError(str(err)) from None
