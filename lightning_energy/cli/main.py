"""The ``lightning-energy`` command: one sub-command per module under ``lightning_energy.cli.commands``.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Errors a user can fix raise :class:`CommandError`; they are printed as one line on stderr with exit 2, and
so are an ``OSError`` (a read-only or full output folder) and a package of an extra that is not installed
(:mod:`lightning_energy.extras`: the line names the extra; commands check what they need before writing).
Start-up stays light (no Lightning, torch or matplotlib until a command needs them): the package's public
names load lazily and each command imports its heavy modules inside ``run``. Output piped into a reader
that stops early (``| head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from lightning_energy.cli.commands import CommandError  # defined apart so `python -m` runs catch it too
from lightning_energy.extras import missing_extra_of

# name -> module; add a line here for each new command
COMMANDS: dict[str, str] = {
    "show-report": "lightning_energy.cli.commands.show_report",
    "estimate": "lightning_energy.cli.commands.estimate",
    "report": "lightning_energy.cli.commands.report",
    "compare": "lightning_energy.cli.commands.compare",
    "fit": "lightning_energy.cli.commands.fit",
    "sweep": "lightning_energy.cli.commands.sweep",
    "recommend": "lightning_energy.cli.commands.recommend",
    "catalog": "lightning_energy.cli.commands.catalog",
    "bso-server": "lightning_energy.cli.commands.bso_server",
    "restore-power-limit": "lightning_energy.cli.commands.restore_power_limit",
    "monitor": "lightning_energy.cli.commands.monitor",
    "validate": "lightning_energy.cli.commands.validate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-energy", description="Energy of PyTorch Lightning runs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except CommandError as err:
        return _refuse(args.command, str(err))
    except ModuleNotFoundError as err:  # MissingExtra included: the extra that installs the package, in one line
        missing = missing_extra_of(err, "this command")
        if missing is None:
            raise
        return _refuse(args.command, str(missing))
    except BrokenPipeError:  # an OSError too: caught first
        return reader_went_away()
    except OSError as err:  # a file system refusing what the user asked for: a read-only or full output folder
        where = f": {err.filename}" if err.filename else ""
        print(f"lightning-energy {args.command}: error: {err.strerror or ' '.join(str(err).split())}{where}",
              file=sys.stderr)
        return 2


def _refuse(command: str, message: str) -> int:
    """``message`` as the command's one line of error on stderr; exit code 2."""
    print(f"lightning-energy {command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def reader_went_away() -> int:
    """stdout's reader closed the pipe (``| head``): no traceback, and nothing more written at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout would raise again
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured in tests)
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a command a closed pipe ended


if __name__ == "__main__":
    sys.exit(main())
