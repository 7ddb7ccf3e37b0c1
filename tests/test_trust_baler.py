"""baler-lit's trust boundaries: hostile .baler files, outputs that cannot be written, temporary files,
and compression that refuses what it cannot restore (issue 13).

The fuzz test runs ~250 hostile files through ``baler_lit.cli.run_tool`` in one child process under an
address-space limit, and a sample of them through the real command line in their own processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from baler_conftest_helpers import REPO, one_thread, quick_trainer, single_thread  # noqa: F401 (fixture)
from baler_fuzz import build_cases, outcome, run_cli, run_in_process, table
from trust_helpers import read_only_dir  # noqa: F401 (fixture)

from baler_lit.cli import main
from baler_lit.compression import NORM_RANGE_MARGIN, compress, decompress, read_compressed
from baler_lit.data import BalerDataModule
from baler_lit.errors import BalerInputError, BalerOutputError
from baler_lit.evaluate import overall_error
from baler_lit.module import BalerModule
from baler_lit.synthetic import synthetic_cms_jets
from baler_lit.table import Table, save_npz, write_npz

pytestmark = pytest.mark.usefixtures("one_thread")
ONE_LINE_ERROR = "baler-lit {}: error: "


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint trained 2 epochs on 1200 synthetic rows, its data (.npz) and its .baler file."""
    root = tmp_path_factory.mktemp("trust")
    dm = BalerDataModule(synthetic_rows=1200, val_fraction=0.0, batch_size=128)
    torch.manual_seed(0)
    module = BalerModule(input_shape=dm.input_shape)
    with single_thread():
        trainer = quick_trainer(max_epochs=2)
        trainer.fit(module, dm)
    ckpt = root / "model.ckpt"
    trainer.save_checkpoint(ckpt)
    data = save_npz(root / "data.npz", dm.table)
    baler = root / "data.baler"
    compress(module.model, module.normalizer, dm.table, baler, "float32")
    return module.eval(), dm.table, ckpt, data, baler


@pytest.fixture(scope="module")
def fuzz_cases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    _, cases = build_cases(folder)
    original = save_npz(folder / "original.npz", synthetic_cms_jets(600, seed=3))
    return folder, cases, original


def _one_line_error(err: str, command: str) -> bool:
    return err.count("\n") == 1 and err.endswith("\n") and err.startswith(ONE_LINE_ERROR.format(command))


# -- hostile .baler files ---------------------------------------------------------------------------------
def test_fuzzed_baler_files_are_refused_with_one_line_and_bounded_memory(fuzz_cases):
    folder, cases, original = fuzz_cases
    assert len(cases) >= 200
    jobs = {name: ("decompress", str(path)) for name, path in cases.items()}
    # the same reader behind `evaluate --compressed`, for a sample of the cases
    sample = sorted(cases)[::25]
    jobs.update({f"{name} [evaluate]": ("evaluate", str(cases[name])) for name in sample})
    jobs["valid file"] = ("decompress", str(folder / "valid.baler"))  # the limit alone refuses nothing
    results = run_in_process(jobs, folder / "run", original)
    valid = results.pop("valid file")
    assert valid["rc"] == 0 and valid["left"] == ["restored.npz"], valid
    jobs.pop("valid file")
    report = table({**cases, **{n: None for n in jobs if n not in cases}}, results)
    wrong = {name: (outcome(results.get(name)), (results.get(name) or {}).get("stderr", "")[-200:])
             for name, (command, _) in jobs.items()
             if outcome(results.get(name)) != "rc 2, one line"
             or not _one_line_error(results[name]["stderr"], command)}
    assert not wrong, f"{len(wrong)} of {len(jobs)} cases not refused cleanly:\n{report}\n{list(wrong.items())[:10]}"


@pytest.mark.parametrize("name", ["dtype |O on latent", "deflate bomb in header.json"])
def test_hostile_files_through_the_command_line(fuzz_cases, tmp_path, name):
    """Each in its own process: an object dtype crashed it (SIGSEGV), a deflated header exhausted memory."""
    _, cases, _ = fuzz_cases
    out = tmp_path / "restored.npz"
    proc = run_cli(cases[name], out)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert _one_line_error(proc.stderr, "decompress"), proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_decompress_writes_nothing_when_the_header_does_not_fit_the_data(fuzz_cases, tmp_path):
    _, cases, _ = fuzz_cases
    for name in ("column dtypes object", "names of another table", "latent not finite (re-signed)"):
        out = tmp_path / "restored.npz"
        with pytest.raises(BalerInputError):
            decompress(cases[name], out)
        assert list(tmp_path.iterdir()) == [], name


def test_npz_writer_refuses_object_arrays(tmp_path):
    with pytest.raises(BalerInputError, match="not numeric"):
        write_npz(tmp_path / "x.npz", np.array([object()], dtype=object), ["a"], ["float64"])
    assert list(tmp_path.iterdir()) == []


# -- temporary files ----------------------------------------------------------------------------------------
def test_planted_symlink_at_the_old_temp_name_redirects_nothing(trained, tmp_path):
    _, _, _, _, baler = trained
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "restored.npz"
    (tmp_path / f".{out.name}.{os.getpid()}.tmp").symlink_to(victim)  # the name the writer used to pick
    decompress(baler, out)
    assert victim.read_text() == "precious"
    assert out.is_file() and not out.is_symlink()


def test_planted_symlink_at_the_old_report_folder_name_redirects_nothing(tmp_path):
    from baler_lit.evaluate import evaluate

    original = Table(np.arange(60.0).reshape(20, 3), names=["a", "b", "c"])
    restored = Table(original.data + 0.5, names=["a", "b", "c"])
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "report"
    (tmp_path / f".{out.name}.{os.getpid()}.tmp").symlink_to(victim, target_is_directory=True)
    evaluate(original, restored, out)
    assert list(victim.iterdir()) == []
    assert (out / "summary.json").is_file() and not out.is_symlink()


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from baler_lit.table import atomic_output
    out = Path(sys.argv[1])
    with atomic_output(out, False) as tmp:
        fh = tmp if hasattr(tmp, "write") else open(tmp, "wb")
        fh.write(b"x" * 2**20)
        fh.flush()
        print("ready", flush=True)
        sys.stdin.read()  # blocks until the test has signalled
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_temp_file_is_removed_when_the_writer_is_terminated(tmp_path, signum):
    out = tmp_path / "out.baler"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, cwd=tmp_path, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert len(list(tmp_path.iterdir())) == 1  # the temporary file, hidden
        child.send_signal(signum)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode != 0
    assert list(tmp_path.iterdir()) == []


def test_temp_file_is_private_until_renamed_and_then_gets_the_usual_mode(trained, tmp_path):
    _, _, _, _, baler = trained
    out = tmp_path / "restored.npz"
    decompress(baler, out)
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


# -- outputs that cannot be written -------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["compress", "decompress", "evaluate"])
def test_read_only_output_directory_gives_one_line(trained, read_only_dir, capsys, command):
    _, _, ckpt, data, baler = trained
    restored = read_only_dir.parent / "restored.npz"
    decompress(baler, restored, overwrite=True)
    argv = {
        "compress": ["compress", "--ckpt", str(ckpt), "--input", str(data), "--output", str(read_only_dir / "o.baler")],
        "decompress": ["decompress", "--input", str(baler), "--output", str(read_only_dir / "r.npz")],
        "evaluate": ["evaluate", "--original", str(data), "--restored", str(restored), "--out",
                     str(read_only_dir / "report")],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err, command) and "writ" in err, err
    assert list(read_only_dir.iterdir()) == []


def test_output_error_is_an_os_error_naming_the_path(trained, read_only_dir):
    _, _, _, _, baler = trained
    with pytest.raises(BalerOutputError, match="r.npz|ro") as info:
        decompress(baler, read_only_dir / "r.npz")
    assert isinstance(info.value, OSError)


def test_evaluate_with_the_compressed_file_of_another_table_gives_one_line(trained, tmp_path, capsys):
    module, _, _, _, _ = trained
    other = Table(synthetic_cms_jets(700, seed=9).data, source="other")
    other_baler = tmp_path / "other.baler"
    compress(module.model, module.normalizer, other, other_baler)
    _, _, _, data, baler = trained
    restored = decompress(baler, tmp_path / "restored.npz")
    assert restored.n_rows == 1200
    report = tmp_path / "report"
    assert main(["evaluate", "--original", str(data), "--restored", str(tmp_path / "restored.npz"), "--out",
                 str(report), "--compressed", str(other_baler)]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err, "evaluate") and "700 rows" in err and "1200 rows" in err, err
    assert not report.exists()


# -- compression refuses what it cannot restore ------------------------------------------------------------
def _scaled(table: Table, factor: float) -> Table:
    return Table(table.data * factor, names=table.names, dtypes=table.dtypes, source=f"x{factor:g}")


def test_latents_that_overflow_the_latent_dtype_are_refused(trained, tmp_path):
    module, table, _, _, _ = trained
    out = tmp_path / "big.baler"
    with pytest.raises(BalerInputError, match=r"latent codes .* not finite in float16.*outside the checkpoint"):
        compress(module.model, module.normalizer, _scaled(table, 1e6), out, "float16")
    assert list(tmp_path.iterdir()) == []


def test_input_outside_the_normalisation_range_warns_and_strict_refuses(trained, tmp_path):
    module, table, _, _, _ = trained
    inside = compress(module.model, module.normalizer, table, tmp_path / "in.baler", "float32")
    assert inside.warnings == []
    outside = compress(module.model, module.normalizer, _scaled(table, 1e6), tmp_path / "out.baler", "float32")
    assert len(outside.warnings) == 1 and "outside the checkpoint's normalisation range" in outside.warnings[0]
    # the round-trip error says what the warning warns of: the restored data is far worse than in range
    assert outside.roundtrip_mean_norm_rms > 1.5 * inside.roundtrip_mean_norm_rms
    with pytest.raises(BalerInputError, match="--strict"):
        compress(module.model, module.normalizer, _scaled(table, 1e6), tmp_path / "strict.baler", strict=True)
    assert not (tmp_path / "strict.baler").exists()


def test_margin_is_measured_in_column_ranges(trained, tmp_path):
    """Just inside the margin: no warning; just outside: a warning (one column shifted by its range x m)."""
    module, table, _, _, _ = trained
    span = module.normalizer.scale[0]
    for shift, warned in ((0.9 * NORM_RANGE_MARGIN, False), (1.1 * NORM_RANGE_MARGIN, True)):
        data = table.data.copy()
        data[0, 0] = module.normalizer.minimum[0] + span * (1 + shift)
        result = compress(module.model, module.normalizer, Table(data, table.names, table.dtypes),
                          tmp_path / f"{shift}.baler")
        assert bool(result.warnings) == warned, (shift, result.warnings)


def test_round_trip_error_is_the_error_of_the_restored_file(trained, tmp_path):
    """With every row sampled (1200 <= ROUNDTRIP_ROWS) the reported error is what decompress gives."""
    module, table, _, _, _ = trained
    for dtype in ("float32", "float16", "bfloat16"):
        result = compress(module.model, module.normalizer, table, tmp_path / f"{dtype}.baler", dtype)
        restored = decompress(tmp_path / f"{dtype}.baler")
        assert result.roundtrip_rows == table.n_rows
        assert result.roundtrip_mean_norm_rms == pytest.approx(overall_error(table, restored.data), rel=1e-9)
        header = read_compressed(tmp_path / f"{dtype}.baler").header
        assert header["roundtrip"]["mean_norm_rms"] == result.roundtrip_mean_norm_rms


def test_compress_command_reports_round_trip_error_and_strict(trained, tmp_path, capsys):
    _, table, ckpt, _, _ = trained
    far = save_npz(tmp_path / "far.npz", _scaled(table, 1e6))
    float32 = ["--latent-dtype", "float32"]  # the default (float16) cannot hold these latents: tested last
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(far), "--output", str(tmp_path / "a.baler"),
                 *float32]) == 0
    captured = capsys.readouterr()
    assert "round-trip error measured on 1200 of the rows just compressed" in captured.out
    assert captured.err.startswith("baler-lit compress: warning: ") and captured.err.count("\n") == 1
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(far), "--output", str(tmp_path / "b.baler"),
                 "--strict", *float32]) == 2
    assert _one_line_error(capsys.readouterr().err, "compress")
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(far), "--output", str(tmp_path / "c.baler"),
                 "--latent-dtype", "float16"]) == 2
    assert "not finite in float16" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.baler", "far.npz"]


# -- a training run that cannot work ------------------------------------------------------------------------
def test_short_power_limit_run_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    """PowerLimitOptimizer on an epoch too short for one profiling window: before, the callback's
    ValueError escaped LightningCLI as a traceback (exit 1)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["baler-lit"])  # LightningCLI warns when sys.argv and args both hold arguments
    code = main(["fit", "--config", str(REPO / "configs" / "cms_ae.yaml"),
                 "--config", str(REPO / "configs" / "power_limit_simulated.yaml"),
                 "--trainer.max_epochs", "1", "--data.synthetic_rows", "300", "--trainer.enable_progress_bar", "false",
                 "--trainer.enable_model_summary", "false", "--trainer.logger", "false"])
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [errors[0]] and errors[0].startswith("baler-lit: error: PowerLimitOptimizer: profiling one "
                                                          "limit needs"), err
