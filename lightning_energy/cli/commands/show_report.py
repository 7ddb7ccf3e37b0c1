"""``lightning-energy show-report RUN_DIR``: print the energy report table a fit left in its log dir."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_energy.outputs.report import REPORT_FILE, format_report

HELP = "print the energy report table of a finished fit (its energy_report.json)"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="the fit's log dir, or the energy_report.json itself")


def run(args) -> int:
    from lightning_energy.cli.commands import CommandError

    path = args.run_dir / REPORT_FILE if args.run_dir.is_dir() else args.run_dir
    if not path.exists():
        raise CommandError(f"no {REPORT_FILE} in {args.run_dir} (is it the log dir of a fit with EnergyCallback?)")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        print(format_report(report))
    except UnicodeDecodeError as err:
        raise CommandError(f"{path} is not a lightning-energy report (not UTF-8 text at byte {err.start})") from None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CommandError(f"{path} is not a lightning-energy report ({type(err).__name__}: {err})") from None
    return 0
