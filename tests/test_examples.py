"""The README's front-end examples (examples/*.py) run as written, from a fresh folder, and leave a report."""

from __future__ import annotations

import json
import runpy
import warnings
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["trainer_callback", "fabric_loop", "plain_loop"])
def test_an_example_runs_as_written_and_writes_its_report(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    (report_path, *_) = sorted(tmp_path.rglob("energy_report.json"))
    report = json.loads(report_path.read_text())
    assert report["total_J"] > 0 and report["epochs"] and len(report["epochs"]) == 2
    assert " J" in capsys.readouterr().out


def test_the_any_process_example_measures_its_command(tmp_path):
    """examples/any_process.sh as a newcomer runs it (the venv's bin on PATH): one report, two epochs of 20 steps."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(["bash", str(EXAMPLES / "any_process.sh")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "runs" / "monitor" / "energy_report.json").read_text())
    assert [e["steps"] for e in report["epochs"]] == [20, 20]
    assert report["command"]["exit_code"] == 0 and report["total_J"] > 0
    assert "J (estimated) over" in run.stderr or "J (measured) over" in run.stderr
