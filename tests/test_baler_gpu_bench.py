"""benchmarks/baler_gpu.py rehearsed on the CPU (``--dry-run``: fake NVML, tiny sizes): it writes valid JSON with
every side, the energy labelled simulated, and refuses bad settings. Nothing here is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "baler_gpu.py"


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def in_process(*args: str) -> int:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from baler_gpu import main

    return main(list(args))


def test_dry_run_writes_every_side_of_ours_as_valid_json(tmp_path):
    out = tmp_path / "gpu.json"
    assert in_process("--dry-run", "--rows", "1024", "--reps", "1", "--sides", "ours_f32,ours_bf16",
                      "--out", str(out)) == 0
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["energy_provenance"] == "simulated"
    assert result["settings"]["batch_size"] == 512 and result["settings"]["rows"] == 1024
    for side in ("ours_f32", "ours_bf16"):
        run_ = result["runs"][side][0]
        assert len(run_["epoch_wall_s"]) == 2 and run_["samples_per_s"] > 0
        assert all(j is not None and j >= 0 for j in run_["epoch_energy_J"])  # the fake counter was read
        assert result["median"][side]["loss"] > 0
    assert set(result["goals"]) == {"ours_f32_samples_per_s", "ours_bf16_samples_per_s"}
    assert result["errors"] == {}
    assert not list(tmp_path.glob("*.tmp"))


def test_dry_run_runs_the_original_loop_when_its_checkout_is_there(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from baler_gpu import DEFAULT_ORIGINAL

    if not (DEFAULT_ORIGINAL / "baler" / "modules" / "training.py").is_file():
        pytest.skip(f"the original Baler's checkout is not at {DEFAULT_ORIGINAL} (or /work, /tmp baler-original)")
    out = tmp_path / "gpu.json"
    proc = run("--dry-run", "--rows", "512", "--reps", "1", "--sides", "original_f32", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}, result["errors"]
    original = result["runs"]["original_f32"][0]
    assert len(original["epoch_wall_s"]) == 2 and original["loss"] > 0  # Baler's own fit() ran twice


def test_a_missing_original_is_an_error_entry_not_a_crash(tmp_path):
    out = tmp_path / "gpu.json"
    assert in_process("--dry-run", "--rows", "512", "--reps", "1", "--sides", "original_f64,ours_f32",
                      "--baler-original", str(tmp_path / "nowhere"), "--out", str(out)) == 0
    result = json.loads(out.read_text())
    assert "original import" in result["errors"] and result["runs"]["original_f64"] == []
    assert result["runs"]["ours_f32"] and "ours_f32_over_original_f64" not in result["goals"]


@pytest.mark.parametrize("args", [["--sides", "ours_f16"], ["--rows", "100"], ["--epochs-ours", "1"]])
def test_bad_settings_are_refused_with_exit_code_2(tmp_path, args, capsys):
    with pytest.raises(SystemExit) as exit_:
        in_process("--dry-run", *args, "--out", str(tmp_path / "x.json"))
    assert exit_.value.code == 2 and "error" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
