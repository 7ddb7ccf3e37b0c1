"""lightning-energy's trust boundaries, round two (issue 29, items 6b-6d, 7c, 7d): a damaged catalog row, an
absurd resampling rate, an input shape too large to allocate, a trace whose energies run backwards and a
sweep config with a bad Trainer argument each give one line on stderr, exit code 2 and no output file.
"""

from __future__ import annotations

import copy
import sqlite3
from pathlib import Path

import pytest
import yaml
from test_commands import BASE_CONFIG
from test_trust_cli import _catalog, _run, _sql, run_cli

from lightning_energy.catalog import FIT_COLUMNS, Catalog


def _one_line_refusal(code: int, err: str, command: str, *words: str) -> None:
    assert code == 2, err
    assert err.startswith(f"lightning-energy {command}: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err


# ---------------------------------------------------------------- 6b: a damaged catalog row
def _untyped_fits_table(path: Path) -> None:
    """Rebuild ``fits`` with columns declared without a type, as a crafted file may: SQLite then keeps a
    number in the `model` column as a number (a TEXT column would have turned it into text)."""
    names = ", ".join(name for name, _ in FIT_COLUMNS)
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE fits_untyped (id INTEGER PRIMARY KEY AUTOINCREMENT, {names})")
        conn.execute(f"INSERT INTO fits_untyped SELECT id, {names} FROM fits")
        conn.execute("DROP TABLE fits")
        conn.execute("ALTER TABLE fits_untyped RENAME TO fits")
    conn.close()


CATALOG_ROW_DAMAGE = {  # label -> (SQL on a one-fit catalog, words the error names)
    "model a number (untyped table)": ("UPDATE fits SET model = 5 WHERE id = 2",
                                       "fit 2 is damaged: its `model` is int 5"),
    "model bytes": ("UPDATE fits SET model = X'00ff' WHERE id = 2", "fit 2 is damaged: its `model` is bytes"),
    "energy text": ("UPDATE fits SET energy_J = 'lots' WHERE id = 2", "fit 2 is damaged: its `energy_J` is str 'lots'"),
    "steps text": ("UPDATE fits SET steps = 'many' WHERE id = 2", "its `steps` is str 'many', not an integer"),
    "provenance unknown": ("UPDATE fits SET provenance = 'measured+bogus' WHERE id = 2", "its `provenance`"),
}


@pytest.mark.parametrize("label", list(CATALOG_ROW_DAMAGE))
@pytest.mark.parametrize("action", [["list"], ["show", "2"], ["compare", "1", "2"], ["export", "-"]])
def test_a_catalog_row_of_the_wrong_type_gives_one_line(tmp_path, capsys, label, action):
    """Every action refuses (exit 2, nothing printed) naming the file, the fit and the column; ``list`` does
    not print the sound fits either: a listing quietly leaving one out would read as complete."""
    path = _catalog(tmp_path / "c.sqlite")
    _catalog(path)  # fit 2, the one damaged
    if "untyped" in label:
        _untyped_fits_table(path)
    statement, words = CATALOG_ROW_DAMAGE[label]
    _sql(path, statement)
    code, out, err = run_cli(capsys, "catalog", *action, "--catalog", path)
    _one_line_refusal(code, err, "catalog", str(path), words)
    assert out == ""


def test_a_damaged_sensor_row_gives_one_line(tmp_path, capsys):
    path = _catalog(tmp_path / "c.sqlite")
    _sql(path, "UPDATE fit_sensors SET energy_J = 'lots'")
    code, out, err = run_cli(capsys, "catalog", "show", "1", "--catalog", path)
    _one_line_refusal(code, err, "catalog", "fit 1 is damaged: sensor row 'gpu' (rank 0): its `energy_J` is str")
    assert out == ""


def test_the_sound_fits_of_a_catalog_still_show(tmp_path, capsys):
    path = _catalog(tmp_path / "c.sqlite")
    _catalog(path)
    _sql(path, "UPDATE fits SET energy_J = 'lots' WHERE id = 2")
    code, out, err = run_cli(capsys, "catalog", "show", "1", "--catalog", path)
    assert code == 0 and "fit 1: pkg.Model" in out, err
    assert Catalog(path).get(1)["energy_J"] == 10.0


# ---------------------------------------------------------------- 6c: compare --rate-hz out of range
@pytest.mark.parametrize("rate", ["1e9", "1e308", "inf", "nan", "0", "-4"])
def test_compare_refuses_a_rate_whose_grid_is_too_large_or_not_a_rate(tmp_path, capsys, rate):
    run = _run(tmp_path, "run")
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(capsys, "compare", run, "--rate-hz", rate, "--out", out)
    words = "--rate-hz" if float(rate) > 1e6 else "--rate-hz must be a finite number > 0"
    _one_line_refusal(code, err, "compare", words)
    if rate == "1e9":
        from lightning_energy.analysis.resample import MAX_GRID_POINTS

        assert "too fine for run run" in err and f"more than the {MAX_GRID_POINTS:,} allowed" in err, err
        assert "at most 1e+05 Hz" in err, err  # the 10 s fit: (MAX_GRID_POINTS - 1) / 10 s
    assert not out.exists() and stdout == ""


def test_the_highest_rate_named_fits_the_bound():
    from lightning_energy.analysis.resample import MAX_GRID_POINTS, grid_points

    assert grid_points(10.0, (MAX_GRID_POINTS - 1) / 10.0) == MAX_GRID_POINTS
    with pytest.raises(ValueError, match="grid points"):
        grid_points(10.0, MAX_GRID_POINTS / 10.0)
    with pytest.raises(ValueError, match="grid points"):
        grid_points(1e300, 1e300)  # the count overflows a float: refused, not an OverflowError


def test_compare_at_an_ordinary_rate_still_works(tmp_path, capsys):
    run = _run(tmp_path, "run")
    code, _, err = run_cli(capsys, "compare", run, "--rate-hz", "100", "--no-plots", "--out", tmp_path / "cmp")
    assert code == 0, err


# ---------------------------------------------------------------- 6d: estimate with a huge input shape
@pytest.mark.parametrize("init_args, shape, words", [
    ("[24, 8]", "1000000,1000000,24", "--input-shape 1000000,1000000,24 (87.3 TiB in float32)"),
    ("[24, 8]", "99999999999999999999,24", "--input-shape 99999999999999999999,24"),
    ("[1000000, 1000000]", "2,1000000", "the model's parameters (3.64 TiB)"),  # built on `meta` first
])
def test_estimate_refuses_sizes_that_cannot_be_allocated(tmp_path, capsys, init_args, shape, words):
    out = tmp_path / "estimate.json"
    code, stdout, err = run_cli(capsys, "estimate", "torch.nn.Linear", "--init-args", init_args, "--input-shape",
                                shape, "--steps", "1", "--no-empirical", "--json", out)
    _one_line_refusal(code, err, "estimate", words, "free on cpu")
    assert stdout == "" and not out.exists()


# ---------------------------------------------------------------- 7c: a trace whose energies run backwards
def _energies_run_backwards(run: Path, sensor: str = "gpu") -> None:
    """The sensor's cumulative energy column reversed: it falls from its last value to 0 J."""
    lines = (run / "energy_trace.csv").read_text().splitlines()
    header = lines[0].split(",")
    column = header.index(f"{sensor}:energy_J")
    rows = [line.split(",") for line in lines[1:]]
    energies = [row[column] for row in rows][::-1]
    for row, energy in zip(rows, energies):
        row[column] = energy
    (run / "energy_trace.csv").write_text("\n".join([lines[0], *(",".join(r) for r in rows)]) + "\n")


@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_trace_whose_energy_runs_backwards_is_refused(tmp_path, capsys, command):
    run = _run(tmp_path, "run")
    _energies_run_backwards(run)
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, command, run, "--out", out)
    _one_line_refusal(code, err, command, "energy_trace.csv", "sensor gpu's cumulative energy runs backwards on line 3",
                      "from 1000 J to 950 J")
    assert not out.exists() and stdout == ""


def test_a_trace_with_blank_counter_cells_is_not_taken_for_one_running_backwards(tmp_path, capsys):
    from workbench_helpers import write_run

    run = write_run(tmp_path / "run", {"gpu": 100.0}, duration_s=4.0, dt_s=0.5, counter_every=3)
    code, out, err = run_cli(capsys, "report", run, "--no-plots")
    assert code == 0 and "400.00 J" in out, err


# ---------------------------------------------------------------- 7d: sweep --dry-run with bad Trainer arguments
@pytest.mark.parametrize("trainer, words", [
    ({"max_epochs": "ten"}, "trainer.max_epochs must be an integer >= -1, got 'ten'"),
    ({"max_epochs": -5}, "trainer.max_epochs must be an integer >= -1, got -5"),
    ({"max_epochs": 2.5}, "trainer.max_epochs must be an integer >= -1, got 2.5"),
    ({"max_epochs": True}, "trainer.max_epochs must be an integer >= -1, got True"),
    ({"max_epochs": -1}, "would train forever"),
    ({"max_epochs": 1, "max_step": 10}, "trainer has key(s) ['max_step'] that Lightning's Trainer does not take"),
    ({"max_epochs": 1, "gpus": 1}, "['gpus']"),
    ({"max_epochs": 1, "accumulate_grad_batches": 0}, "trainer.accumulate_grad_batches must be an integer >= 1"),
])
def test_sweep_dry_run_refuses_bad_trainer_arguments(tmp_path, capsys, trainer, words):
    config = copy.deepcopy(BASE_CONFIG)
    config["trainer"] = {"accelerator": "cpu", "devices": 1, **trainer}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out, err = run_cli(capsys, "sweep", "--config", path, "--dry-run", "--output-dir", tmp_path / "out")
    _one_line_refusal(code, err, "sweep", words)
    assert out == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("trainer", [{"max_epochs": None}, {"max_epochs": -1, "max_steps": 20}, {"max_epochs": 0},
                                     {"max_epochs": 2, "min_epochs": None, "max_time": "00:00:01:00"}])
def test_sweep_dry_run_takes_what_lightning_takes(tmp_path, capsys, trainer):
    config = copy.deepcopy(BASE_CONFIG)
    config["trainer"] = {"accelerator": "cpu", **trainer}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out, err = run_cli(capsys, "sweep", "--config", path, "--dry-run")
    assert code == 0 and out.count("\n") == 3, err  # the three power limits
