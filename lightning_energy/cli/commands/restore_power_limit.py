"""``lightning-energy restore-power-limit``: put GPUs back after a run that could not (SIGKILL, power loss).

``PowerLimitOptimizer`` and real-GPU sweeps write a marker per card before changing its power limit
(the limit and persistence mode in force, the NVML index and UUID, the pid) and remove it after
restoring. A marker left behind means the card may still run at a profiled limit: this command sets
the recorded limit and persistence mode back and removes the marker (the next run on that card does the
same before it starts). Markers of processes that still run are left alone unless ``--force``; a
marker replaced since it was read (a new run took the card meanwhile) is left to that run. ``--list``
only shows them. Needs the same rights as setting a limit (SYS_ADMIN or the Zeus daemon). Every
marker written so far (format ``lightning-energy power-limit marker 1``) is read.
"""

from __future__ import annotations

from pathlib import Path
from lightning_energy.units import W_PER_MW

HELP = "put GPUs back to the power limit and persistence mode a killed run left behind (crash markers)"


def add_arguments(parser) -> None:
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the markers are (default $LIGHTNING_ENERGY_STATE_DIR or ~/.local/state/lightning-energy)")
    parser.add_argument("--list", action="store_true", help="show the markers, change nothing")
    parser.add_argument("--force", action="store_true", help="also restore cards whose run still seems alive")


def run(args) -> int:
    from lightning_energy.optimize.power_limit import gpu_control
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.extras import check_installed

    directory = args.state_dir if args.state_dir is not None else gpu_control.state_dir()
    paths = gpu_control.list_markers(directory)
    if not paths:
        print(f"no power-limit markers in {directory}: nothing to restore")
        return 0
    if not args.list:  # before anything is printed
        check_installed("zeus", "restoring a card (Zeus sets the limits back)")
    markers, problems = [], []
    for path in paths:
        try:
            markers.append(gpu_control.read_marker(path))
        except ValueError as err:
            problems.append(str(err))
    restored = 0
    for marker in markers:
        what = (f"GPU {marker.nvml_index} ({marker.gpu_name}): {marker.limit_mW * W_PER_MW:g} W, persistence mode "
                f"{'?' if marker.persistence_mode is None else ('on' if marker.persistence_mode else 'off')}, "
                f"left by {marker.owner} (pid {marker.pid} on {marker.host})")
        if args.list:
            print(f"{marker.path.name}: {what}{' (still running)' if marker.process_alive else ''}")
            continue
        if marker.process_alive and not args.force:
            print(f"skipped {what}: that process still runs and restores the card itself (--force to restore now)")
            continue
        failures = gpu_control.restore_from_marker(marker)
        if failures:
            problems.extend(failures)
        elif marker.path.exists():  # restore_from_marker removes the marker it acts on: this one is a new run's
            print(f"left {marker.path.name} alone: a new run has taken GPU {marker.nvml_index} since and puts "
                  f"back what was there itself")
        else:
            restored += 1
            print(f"restored {what}")
    if problems:
        raise CommandError("; ".join(problems))
    if not args.list:
        print(f"{restored} card(s) restored")
    return 0
