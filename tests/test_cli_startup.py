"""The command's offline paths start light and quiet: no Lightning or torch, no traceback on a closed pipe.

Not timing tests: what is asserted is which modules a fresh interpreter loaded (timings are in
benchmarks/cli_startup.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench_helpers import write_run

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "torch", "matplotlib", "scipy", "zeus", "codecarbon", "pandas")


def fresh_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120, **kwargs)


def loaded_after(argv: list[str]) -> dict:
    """Run the CLI in a fresh interpreter; the heavy modules it loaded, its exit code and its stdout."""
    code = f"""
import contextlib, io, json, sys
from lightning_energy.cli.main import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        rc = main({argv!r})
except SystemExit as exit:  # --help
    rc = exit.code
print(json.dumps({{"rc": rc, "out": out.getvalue(), "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    done = fresh_python(code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory) -> Path:
    folder = write_run(tmp_path_factory.mktemp("run") / "run", {"gpu": 100.0}, duration_s=10.0, dt_s=0.5,
                       epochs=[(1.0, 4.0), (4.5, 8.0)], attributes={"batch_size": 32})
    report = {"duration_s": 10.0, "total_J": 1000.0, "total_kWh": 1000.0 / 3.6e6, "epochs": [{}], "world_size": 1,
              "sensors": [{"name": "gpu", "rank": 0, "scope": "device", "energy_J": 1000.0, "mean_power_W": 100.0,
                           "estimated": False, "source": "hand-made"}],
              "mean_power_W": 100.0, "train_J": 900.0, "validation_J": 0.0, "other_J": 100.0, "estimated": False,
              "estimated_J": 0.0}
    (folder / "energy_report.json").write_text(json.dumps(report))
    return folder


@pytest.mark.parametrize("argv", [
    ["--help"], ["report", "--help"], ["show-report", "RUN"], ["report", "RUN", "--no-plots"],
    ["compare", "RUN", "--no-plots", "--out", "OUT"], ["catalog", "list", "--catalog", "OUT/none.sqlite"],
], ids=lambda argv: " ".join(argv))
def test_offline_commands_do_not_import_lightning_or_torch(argv, offline_run, tmp_path):
    argv = [a.replace("RUN", str(offline_run)).replace("OUT", str(tmp_path)) for a in argv]
    result = loaded_after(argv)
    assert result["heavy"] == [], f"{argv} loaded {result['heavy']}"
    assert result["rc"] in (0, 2), result  # 2: catalog list of a missing catalog, still without heavy imports


def _commands() -> list[str]:
    from lightning_energy.cli.main import COMMANDS

    return list(COMMANDS)


@pytest.mark.parametrize("command", _commands())
def test_every_commands_help_imports_neither_lightning_nor_torch(command):
    result = loaded_after([command, "--help"])
    assert result["rc"] == 0 and f"usage: lightning-energy {command}" in result["out"]
    assert result["heavy"] == [], f"{command} --help loaded {result['heavy']}"


def test_estimate_finds_a_model_file_in_the_current_directory_as_python_m_does(tmp_path):
    """As the console script runs it: ``sys.path`` without the current directory (``python -m`` and ``-c`` add
    it; the ``lightning-energy`` script does not)."""
    (tmp_path / "my_energy_model.py").write_text(
        "import torch\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, width=4):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(width, 2)\n\n"
        "    def forward(self, x):\n"
        "        return self.layer(x)\n")
    code = """
import os, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
from lightning_energy.cli.main import main
rc = main(["estimate", "my_energy_model.Net", "--init-args", '{"width": 4}', "--input-shape", "8,4", "--steps", "10",
           "--no-empirical"])
print("cwd on sys.path after:", os.getcwd() in sys.path or "" in sys.path)
sys.exit(rc)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    assert "Predicted energy (10 steps" in done.stdout
    assert "cwd on sys.path after: False" in done.stdout  # only for that import


def test_public_names_still_import_and_importing_the_package_loads_nothing_heavy():
    done = fresh_python(f"""
import sys
import lightning_energy
heavy = [m for m in {HEAVY!r} if m in sys.modules]
assert heavy == [], heavy
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.callbacks import CarbonCallback
assert EnergyCallback.__module__ == "lightning_energy.callbacks.energy", EnergyCallback.__module__
assert "EnergyCallback" in dir(lightning_energy) and "CarbonCallback" in lightning_energy.__all__
assert lightning_energy.measure.sensors.cpu_model.CpuEstimateSensor is lightning_energy.CpuEstimateSensor  # submodules too
try:
    lightning_energy.NoSuchThing
except AttributeError as err:
    print("ok", err)
""")
    assert done.returncode == 0, done.stderr
    assert "ok module 'lightning_energy' has no attribute 'NoSuchThing'" in done.stdout
    assert done.stderr == ""


def test_a_reader_that_closed_the_pipe_ends_the_command_without_a_traceback(offline_run):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte (like `| head` having exited)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-m", "lightning_energy.cli", "report", str(offline_run), "--no-plots"],
                              env=env, cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
    assert done.returncode == 141


def test_files_the_commands_write_are_readable_by_others(offline_run, tmp_path):
    from lightning_energy.cli.main import main

    old = os.umask(0o022)
    try:
        assert main(["report", str(offline_run), "--out", str(tmp_path / "plots")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "plots").iterdir()}
    assert modes and set(modes.values()) == {"0o644"}, modes


def test_chrome_traces_are_rewritten_with_the_usual_mode(tmp_path):
    from lightning_energy.outputs.op_energy import read_chrome_trace, write_chrome_trace

    old = os.umask(0o022)
    try:
        for name in ("trace.json", "trace.json.gz"):
            path = write_chrome_trace(tmp_path / name, {"traceEvents": [{"name": "op"}]})
            assert oct(path.stat().st_mode & 0o777) == "0o644"
            assert read_chrome_trace(path) == {"traceEvents": [{"name": "op"}]}
    finally:
        os.umask(old)
