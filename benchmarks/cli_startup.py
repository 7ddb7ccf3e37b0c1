"""Start-up time of the ``lightning-energy`` command's offline paths, beside the imports they avoid.

Each case is a fresh ``python`` process (so nothing is cached in ``sys.modules``), run ``--reps`` times,
the cases interleaved within each repetition (the order rotates) so that all see the same drift of a
shared machine. Cases:

- ``python``            ``python -c pass``: the interpreter alone (the floor);
- ``--help``            ``python -m lightning_energy.cli --help``;
- ``show-report``       printing a finished fit's energy_report.json;
- ``report``            ``report RUN --no-plots`` of a small hand-made run (trace + events);
- ``catalog list``      listing an empty catalog (SQLite);
- ``import callbacks``  ``import lightning_energy.callbacks.energy`` (Lightning and torch): what every
                        command paid before the package's names were loaded lazily.

Quoted: the median wall time per case and its ratio to ``python``; goal (issue 16): offline commands
start in <= 1 s. Wall times on a shared 2-core machine are noisy: compare cases of one run, not runs.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cli_startup.py [--reps 7]``.
Writes ``benchmarks/results/cli_startup.json`` (raw times, medians, ratios, machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported: benchmarks/machine.py
import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "cli_startup.json"
GOAL_S = 1.0


def _hand_made_run(folder: Path) -> Path:
    """A 10 s run at 100 W sampled every 0.5 s, one epoch, with its report: enough for report/show-report."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["time_s,unix_time_s,gpu:energy_J,gpu:power_W"]
    rows += [f"{i * 0.5:.6f},{1.7e9 + i * 0.5:.6f},{100.0 * i * 0.5:.6f},100" for i in range(21)]
    (folder / "energy_trace.csv").write_text("\n".join(rows) + "\n")
    events = ["time_s,unix_time_s,event,epoch,step", f"0,{1.7e9},fit_start,,", f"0.5,{1.7e9 + 0.5},epoch_start,0,",
              f"9.5,{1.7e9 + 9.5},epoch_end,0,", f"10,{1.7e9 + 10},fit_end,,"]
    (folder / "energy_events.csv").write_text("\n".join(events) + "\n")
    report = {"duration_s": 10.0, "total_J": 1000.0, "total_kWh": 1000.0 / 3.6e6, "train_J": 900.0,
              "validation_J": 0.0, "other_J": 100.0, "world_size": 1, "mean_power_W": 100.0, "edp_Js": 1e4,
              "estimated": False, "estimated_J": 0.0, "measured_J": 1000.0, "epochs": [{"epoch": 0}],
              "sensors": [{"name": "gpu", "rank": 0, "scope": "device", "energy_J": 1000.0, "mean_power_W": 100.0,
                           "estimated": False, "source": "hand-made"}]}
    (folder / "energy_report.json").write_text(json.dumps(report))
    return folder


def cases(work: Path) -> dict[str, list[str]]:
    from lightning_energy.catalog import Catalog

    run = _hand_made_run(work / "run")
    Catalog(work / "empty.sqlite").ensure()
    cli = [sys.executable, "-m", "lightning_energy.cli"]
    return {
        "python": [sys.executable, "-c", "pass"],
        "--help": [*cli, "--help"],
        "show-report": [*cli, "show-report", str(run)],
        "report": [*cli, "report", str(run), "--no-plots"],
        "catalog list": [*cli, "catalog", "list", "--catalog", str(work / "empty.sqlite")],
        "import callbacks": [sys.executable, "-c", "import lightning_energy.callbacks.energy"],
    }


def time_once(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.decode()[-500:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CODECARBON_LOG_LEVEL": "error",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        commands = cases(Path(tmp))
        names = list(commands)
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                times[name].append(time_once(commands[name], env))
    medians = {name: statistics.median(values) for name, values in times.items()}
    floor = medians["python"]
    print(f"{'case':<18} {'median s':>9} {'min s':>7} {'max s':>7} {'x python':>9}  goal <= {GOAL_S:g} s")
    for name in names:
        goal = "" if name in ("python", "import callbacks") else ("ok" if medians[name] <= GOAL_S else "MISSED")
        print(f"{name:<18} {medians[name]:>9.3f} {min(times[name]):>7.3f} {max(times[name]):>7.3f} "
              f"{medians[name] / floor:>9.2f}  {goal}")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    machine.write_json_atomic(RESULT, {
        "benchmark": "cli_startup", "reps": args.reps, "goal_s": GOAL_S, "times_s": times, "median_s": medians,
        "ratio_to_python": {name: medians[name] / floor for name in names},
        "load_average_at_end": load, "machine": machine.machine_info(OMP_NUM_THREADS="1"),
    })
    print(f"wrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
