"""lightning-energy's trust boundaries (issue 13): every bad input is one line on stderr and exit code 2,
nothing half-written; ``report`` and ``compare`` judge a damaged trace alike and say what is missing.

Table-driven: each case builds a bad input and names the commands that read it.
"""

from __future__ import annotations

import copy
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml
from test_commands import BASE_CONFIG
from trust_helpers import read_only_dir  # noqa: F401 (fixture)
from workbench_helpers import write_run

from lightning_energy.catalog import Catalog
from lightning_energy.cli.main import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _run(tmp_path: Path, name: str) -> Path:
    return write_run(tmp_path / name, {"gpu": 100.0, "cpu": 20.0}, duration_s=10.0, dt_s=0.5,
                     epochs=[(1.0, 4.0), (4.5, 8.0)], attributes={"precision": "32"})


def _rewrite(path: Path, edit) -> None:
    path.write_bytes(edit(path.read_bytes()))


def non_utf8_report(run: Path) -> None:
    (run / "energy_report.json").write_bytes(b'{"precision": "\xff\xfe"}')


def non_utf8_hparams(run: Path) -> None:
    (run / "hparams.yaml").write_bytes(b"lr: \xff\xfe\n")


def non_utf8_attributes(run: Path) -> None:
    (run / "run_attributes.json").write_bytes(b'{"a": "\xe9"}')


def nul_in_trace(run: Path) -> None:
    _rewrite(run / "energy_trace.csv", lambda b: b[:120] + b"\0" + b[120:])


def non_utf8_trace(run: Path) -> None:
    _rewrite(run / "energy_trace.csv", lambda b: b[:120] + b"\xff" + b[120:])


def short_row_inside_trace(run: Path) -> None:
    lines = (run / "energy_trace.csv").read_text().splitlines(keepends=True)
    lines[5] = ",".join(lines[5].split(",")[:3]) + "\r\n"
    (run / "energy_trace.csv").write_text("".join(lines))


def truncated_trace(run: Path) -> None:
    """The trace's second half is gone (rows 0..4.5 s of a 10 s fit remain), the events are whole."""
    lines = (run / "energy_trace.csv").read_text().splitlines(keepends=True)
    (run / "energy_trace.csv").write_text("".join(lines[:11]))


# label -> (damage, words the error names)
BAD_RUNS = {
    "energy_report.json not UTF-8": (non_utf8_report, "energy_report.json is not UTF-8"),
    "hparams.yaml not UTF-8": (non_utf8_hparams, "hparams.yaml is not UTF-8"),
    "run_attributes.json not UTF-8": (non_utf8_attributes, "run_attributes.json is not UTF-8"),
    "NUL byte in the trace": (nul_in_trace, "energy_trace.csv is not a lightning-energy trace"),
    "trace not UTF-8": (non_utf8_trace, "not UTF-8"),
    "short row inside the trace": (short_row_inside_trace, "line 6 has 3 cells, the header 6"),
    "truncated trace": (truncated_trace, "the last 5.5 s of the fit (55 % of its 10 s) have no samples"),
}


@pytest.mark.parametrize("label", list(BAD_RUNS))
@pytest.mark.parametrize("command", ["report", "compare", "fit"])
def test_bad_run_dirs_give_one_line_and_write_nothing(tmp_path, capsys, command, label):
    damage, words = BAD_RUNS[label]
    good, bad = _run(tmp_path, "good"), _run(tmp_path, "bad")
    damage(bad)
    out = tmp_path / "out"
    argv = {"report": ["report", bad, "--out", out], "compare": ["compare", good, bad, "--out", out],
            "fit": ["fit", good, bad, "--by", "precision", "--out", out]}[command]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert err.startswith(f"lightning-energy {command}: error: ") and err.count("\n") == 1, err
    assert words in err, err
    assert not out.exists()


def test_show_report_of_a_non_utf8_report_gives_one_line(tmp_path, capsys):
    run = _run(tmp_path, "run")
    non_utf8_report(run)
    code, _, err = run_cli(capsys, "show-report", run)
    assert code == 2 and err.count("\n") == 1 and "not UTF-8" in err, err


def test_report_and_compare_agree_on_a_trace_cut_mid_line(tmp_path, capsys):
    """The writer ends every row with a line break: a file ending without one lost its last row's end.
    Both commands leave that row out, say so, and find the same energy (the fit ends one sample later,
    within the two sampling intervals continued at an edge)."""
    run = _run(tmp_path, "run")
    _rewrite(run / "energy_trace.csv", lambda b: b[:-9])
    code, out, err = run_cli(capsys, "report", run, "--no-plots")
    assert code == 0, err
    assert "note: energy_trace.csv was cut in the middle of line 22; that incomplete row is left out" in out
    assert "10.00 s, 1200.00 J" in out  # 120 W continued over the last 0.5 s
    code, out, err = run_cli(capsys, "compare", run, "--no-plots", "--out", tmp_path / "cmp")
    assert code == 0, err
    assert "cut in the middle of line 22" in out and "1200" in out


def test_report_refuses_the_truncated_trace_that_compare_refuses(tmp_path, capsys):
    run = _run(tmp_path, "run")
    truncated_trace(run)
    errors = []
    for argv in (["report", run, "--no-plots"], ["compare", run, "--no-plots"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2
        errors.append(err.split("error: ", 1)[1])
    assert errors[0] == errors[1]  # one rule, one message


@pytest.mark.parametrize("command", ["report", "compare"])
def test_read_only_output_folder_gives_one_line(tmp_path, read_only_dir, capsys, command):
    run = _run(tmp_path, "run")
    code, _, err = run_cli(capsys, command, run, "--out", read_only_dir / "plots")
    assert code == 2 and err.startswith(f"lightning-energy {command}: error: ") and err.count("\n") == 1, err
    assert str(read_only_dir) in err
    assert list(read_only_dir.iterdir()) == []


# ---------------------------------------------------------------- the run catalog
def _catalog(path: Path) -> Path:
    Catalog(path).add({"model": "pkg.Model", "metrics": {"val/loss": 0.5}, "energy_J": 10.0,
                       "sensors": [{"name": "gpu", "energy_J": 10.0}]})
    return path


def _sql(path: Path, statement: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(statement)
    conn.close()


CATALOG_DAMAGE = {
    "metrics not JSON": ("UPDATE fits SET metrics = '{oops'", "its `metrics` is not a JSON object"),
    "metrics a JSON list": ("UPDATE fits SET metrics = '[1, 2]'", "its `metrics` is not a JSON object"),
    "config a JSON string": ("UPDATE fits SET config = '\"x\"'", "its `config` is not a JSON object"),
    "metric not a number": ("UPDATE fits SET metrics = '{\"loss\": \"low\"}'", "are not all numbers"),
}


@pytest.mark.parametrize("label", list(CATALOG_DAMAGE))
@pytest.mark.parametrize("action", [["list"], ["show", "1"], ["compare", "1", "1"], ["export", "-"]])
def test_damaged_catalog_records_give_one_line(tmp_path, capsys, label, action):
    path = _catalog(tmp_path / "c.sqlite")
    statement, words = CATALOG_DAMAGE[label]
    _sql(path, statement)
    code, out, err = run_cli(capsys, "catalog", *action, "--catalog", path)
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert out == ""


def test_read_only_catalog_can_be_read(tmp_path, read_only_dir, capsys):
    """A catalog on read-only media: SQLite cannot create WAL's -shm file there; it is read immutable."""
    path = _catalog(tmp_path / "c.sqlite")
    subprocess.run(["chattr", "-i", str(read_only_dir)], capture_output=True)
    read_only_dir.chmod(0o755)
    copy_path = read_only_dir / "c.sqlite"
    copy_path.write_bytes(path.read_bytes())
    read_only_dir.chmod(0o555)
    subprocess.run(["chattr", "+i", str(read_only_dir)], capture_output=True)
    code, out, err = run_cli(capsys, "catalog", "list", "--catalog", copy_path)
    assert code == 0, err
    assert "Model" in out
    code, out, err = run_cli(capsys, "catalog", "export", read_only_dir / "all.csv", "--catalog", copy_path)
    assert code == 2 and err.count("\n") == 1 and f"cannot write {read_only_dir / 'all.csv'}" in err, err


def test_corrupt_catalog_gives_one_line(tmp_path, capsys):
    path = _catalog(tmp_path / "c.sqlite")
    path.write_bytes(path.read_bytes()[:1500])
    code, _, err = run_cli(capsys, "catalog", "list", "--catalog", path)
    assert code == 2 and err.count("\n") == 1 and "not a lightning-energy run catalog" in err, err


# ---------------------------------------------------------------- sweep configs
@pytest.mark.parametrize("change, words", [
    (lambda c: c["grid"].update(power_limit_W=[float("inf")]), "grid.power_limit_W values must be finite watts"),
    (lambda c: c["grid"].update(power_limit_W=[float("nan")]), "grid.power_limit_W values must be finite watts"),
    (lambda c: c["sensors"]["simulated"].update(host_W=float("inf")), "host_W must be a number of watts >= 0 (finite)"),
    (lambda c: c["sensors"]["simulated"]["gpu"].update(idle_W=float("inf")), "gpu.idle_W must be a number of watts"),
    (lambda c: c.update(sensors="auto", trainer={**c["trainer"], "accelerator": "gpu"}),
     None),  # sensors: auto with .inf: the same check before any GPU is opened
])
def test_sweep_yaml_with_infinite_watts_gives_one_line(tmp_path, capsys, change, words):
    config = copy.deepcopy(BASE_CONFIG)
    change(config)
    if words is None:
        config["grid"]["power_limit_W"] = [float("inf")]
        words = "grid.power_limit_W values must be finite watts"
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    assert ".inf" in path.read_text() or ".nan" in path.read_text()
    code, _, err = run_cli(capsys, "sweep", "--config", path, "--output-dir", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()


def test_sweep_yaml_not_utf8_gives_one_line(tmp_path, capsys):
    path = tmp_path / "sweep.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    code, _, err = run_cli(capsys, "sweep", "--config", path)
    assert code == 2 and err.count("\n") == 1 and "is not valid YAML" in err, err
