"""The baler-lit command: LightningCLI fit with the YAML configs, the file tools, and bad input handling."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml
from baler_conftest_helpers import CFD, NANOAOD, REPO, one_thread, requires, single_thread  # noqa: F401 (fixture)

from baler_lit.cli import load_checkpoint, main
from baler_lit.synthetic import synthetic_cms_jets
from baler_lit.table import Table, save_npz

pytestmark = pytest.mark.usefixtures("one_thread")

CMS_CONFIG = REPO / "configs" / "cms_ae.yaml"
CFD_CONFIG = REPO / "configs" / "cfd_conv_ae.yaml"


def _fit_args(config, root, *extra):
    return [
        "fit", "--config", str(config),
        "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.log_every_n_steps", "1",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`baler-lit fit --config configs/cms_ae.yaml` on a small synthetic table; returns (folder, ckpt, data)."""
    root = tmp_path_factory.mktemp("cli")
    data = root / "jets.npz"
    save_npz(data, synthetic_cms_jets(1200, seed=1))
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setattr(sys, "argv", ["baler-lit"])  # LightningCLI warns when sys.argv and args both hold arguments
        code = main(_fit_args(CMS_CONFIG, root, "--data.path", str(data), "--data.batch_size", "128",
                              "--trainer.max_epochs", "3"))  # fmt: skip
    assert code == 0
    run = root / "lightning_logs" / "version_0"
    return root, run / "checkpoints" / "best.ckpt", data


def test_fit_with_yaml_config_writes_checkpoint_config_and_energy_report(trained):
    root, ckpt, _ = trained
    run = ckpt.parent.parent
    assert ckpt.is_file()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["model"] == "AE" and saved["data"]["path"].endswith("jets.npz")
    assert saved["model"]["lr_patience"] == 50 and saved["model"]["early_stopping_patience"] == 100
    hparams = load_checkpoint(ckpt).hparams  # input_shape was linked from the data module
    assert tuple(hparams["input_shape"]) == (24,) and hparams["compression_ratio"] == 1.6
    assert (run / "energy_report.json").is_file()  # EnergyCallback from the YAML callbacks list
    assert any(p.name.startswith("events.out.tfevents") for p in run.iterdir())


def test_compress_decompress_evaluate_commands(trained, tmp_path, capsys):
    _, ckpt, data = trained
    baler, restored, report = tmp_path / "d.baler", tmp_path / "r.npz", tmp_path / "report"
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(data), "--output", str(baler),
                 "--latent-dtype", "float16"]) == 0  # fmt: skip
    assert "ratio" in capsys.readouterr().out
    assert main(["decompress", "--input", str(baler), "--output", str(restored)]) == 0
    with np.load(restored, allow_pickle=False) as npz:
        assert npz["data"].shape == (1200, 24)
        ints = npz["data"][:, 15:]
        assert np.all(ints == np.round(ints)) and list(npz["dtypes"][15:]) == ["int32"] * 9
    capsys.readouterr()
    assert main(["evaluate", "--original", str(data), "--restored", str(restored), "--out", str(report),
                 "--compressed", str(baler), "--tensorboard", str(tmp_path / "tb")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "mean normalised RMS error" in out and "latent bfloat16" in out
    for name in ("residual_boxplot", "histograms", "response", "tradeoff"):
        assert (report / f"{name}.png").stat().st_size > 1000
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def _bad(argv, match, capsys, no_file=None):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "error:" in err and match in err, err
    if no_file is not None:
        assert not no_file.exists()


def test_bad_inputs_give_one_error_line_and_no_output(trained, tmp_path, capsys):
    _, ckpt, data = trained
    out = tmp_path / "x.baler"
    compress = ["compress", "--ckpt", str(ckpt), "--output", str(out), "--input"]
    _bad([*compress, str(tmp_path / "missing.npz")], "does not exist", capsys, out)
    np.savez(tmp_path / "nodata.npz", table=np.zeros((3, 24)))
    _bad([*compress, str(tmp_path / "nodata.npz")], "no array 'data'", capsys, out)
    values = synthetic_cms_jets(50).data
    values[3, 2] = np.nan
    np.savez(tmp_path / "nan.npz", data=values)
    _bad([*compress, str(tmp_path / "nan.npz")], "non-finite", capsys, out)
    save_npz(tmp_path / "narrow.npz", Table(synthetic_cms_jets(50).data[:, :20]))
    _bad([*compress, str(tmp_path / "narrow.npz")], "column-count mismatch", capsys, out)
    _bad(["compress", "--ckpt", str(tmp_path / "no.ckpt"), "--input", str(data), "--output", str(out)],
         "checkpoint", capsys, out)  # fmt: skip
    (tmp_path / "junk.ckpt").write_bytes(b"garbage")
    _bad(["compress", "--ckpt", str(tmp_path / "junk.ckpt"), "--input", str(data), "--output", str(out)],
         "cannot load checkpoint", capsys, out)  # fmt: skip

    good = tmp_path / "good.baler"
    assert main([*compress[:4], str(good), "--input", str(data)]) == 0
    capsys.readouterr()
    restored = tmp_path / "restored.npz"
    (tmp_path / "cut.baler").write_bytes(good.read_bytes()[:2000])
    cut = tmp_path / "cut.baler"
    _bad(["decompress", "--input", str(cut), "--output", str(restored)], "truncated", capsys, restored)
    blob = bytearray(good.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (tmp_path / "flip.baler").write_bytes(bytes(blob))
    flip = tmp_path / "flip.baler"
    _bad(["decompress", "--input", str(flip), "--output", str(restored)], "corrupted", capsys, restored)
    restored.write_bytes(b"old")
    _bad(["decompress", "--input", str(good), "--output", str(restored)], "--overwrite", capsys)
    assert restored.read_bytes() == b"old"
    assert main(["decompress", "--input", str(good), "--output", str(restored), "--overwrite"]) == 0
    capsys.readouterr()
    report = tmp_path / "report"
    save_npz(tmp_path / "short.npz", Table(synthetic_cms_jets(10).data))
    _bad(["evaluate", "--original", str(data), "--restored", str(tmp_path / "short.npz"), "--out", str(report)],
         "row-count mismatch", capsys, report)  # fmt: skip
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_missing_argument_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["decompress", "--input", "x.baler"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--output" in err


def test_print_config_stdout_is_clean_yaml():
    proc = subprocess.run(
        [sys.executable, "-m", "baler_lit.cli", "fit", "--config", str(CMS_CONFIG), "--print_config"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["compression_ratio"] == 1.6 and config["data"]["batch_size"] == 512
    assert config["trainer"]["callbacks"][0]["class_path"] == "lightning_energy.EnergyCallback"


@requires(CFD)
def test_cfd_conv_config_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the config names the data as ../shared/data/CFD_animation.npz
    monkeypatch.setattr(sys, "argv", ["baler-lit"])
    assert main(_fit_args(CFD_CONFIG, tmp_path, "--trainer.max_epochs", "2", "--data.path", str(CFD))) == 0
    module = load_checkpoint(tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "best.ckpt")
    assert module.hparams["model"] == "ConvAE" and tuple(module.hparams["input_shape"]) == (50, 50)
    assert module.model.latent_dim == 50


@requires(NANOAOD)
def test_root_jets_through_the_cli_reuse_the_training_branches(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["baler-lit"])
    args = _fit_args(CMS_CONFIG, tmp_path, "--data.path", str(NANOAOD), "--data.root_prefix", "Jet_",
                     "--data.batch_size", "128", "--trainer.max_epochs", "2")  # fmt: skip
    assert main(args) == 0
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "best.ckpt"
    assert load_checkpoint(ckpt).model.latent_dim == 25  # ceil(40 / 1.6)
    baler, restored = tmp_path / "jets.baler", tmp_path / "jets.npz"
    # no branch options: the 40 Jet_* columns recorded in the checkpoint are read again, in training order
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(NANOAOD), "--output", str(baler)]) == 0
    assert main(["decompress", "--input", str(baler), "--output", str(restored)]) == 0
    with np.load(restored, allow_pickle=False) as npz:
        assert npz["data"].shape == (537, 40) and npz["names"][0] == "Jet_area"
    capsys.readouterr()
    _bad(["compress", "--ckpt", str(ckpt), "--input", str(NANOAOD), "--output", str(tmp_path / "x.baler"),
          "--root-branches", "Jet_pt", "Jet_eta"], "column", capsys, tmp_path / "x.baler")  # fmt: skip


def test_error_bound_options_info_and_evaluate_through_the_cli(trained, tmp_path, capsys):
    _, ckpt, data = trained
    baler, restored = tmp_path / "b.baler", tmp_path / "b.npz"
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(data), "--output", str(baler),
                 "--max-relative-error", "0.05", "--max-absolute-error", "0.01"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "holds for every value" in out and "values corrected" in out
    assert main(["decompress", "--input", str(baler), "--output", str(restored)]) == 0
    with np.load(data, allow_pickle=False) as a, np.load(restored, allow_pickle=False) as b:
        x, y = a["data"].astype(np.float64), b["data"].astype(np.float64)
    assert np.all(np.abs(y - x) <= np.maximum(0.05 * np.abs(x), 0.01))
    capsys.readouterr()
    assert main(["evaluate", "--original", str(data), "--restored", str(restored), "--out", str(tmp_path / "rep"),
                 "--compressed", str(baler)]) == 0  # fmt: skip
    assert "values over the bound here: 0" in capsys.readouterr().out
    assert main(["info", str(baler), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] == 1200 and len(info["columns"]) == 24 and info["format_version"] == 2
    assert info["corrections"]["count"] > 0 and info["corrections"]["relative_bound"] == 0.05
    assert sum(info["parts_bytes"].values()) == info["file_bytes"] == baler.stat().st_size
    assert info["ratio"] == pytest.approx(info["original_bytes"] / info["file_bytes"])
    assert main(["info", str(baler)]) == 0
    text = capsys.readouterr().out
    assert "latent" in text and "corrections" in text and "pt (float32)" in text


def test_info_never_imports_lightning_and_refuses_a_bad_file_in_one_line(trained, tmp_path, capsys):
    _, ckpt, data = trained
    baler = tmp_path / "i.baler"
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(data), "--output", str(baler)]) == 0
    script = ("import sys\nfrom baler_lit.cli import main\n"
              f"assert main(['info', {str(baler)!r}]) == 0\n"
              "print('LIGHTNING', sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "LIGHTNING []" in proc.stdout and "ratio" in proc.stdout
    capsys.readouterr()
    cut = tmp_path / "cut.baler"
    cut.write_bytes(baler.read_bytes()[:-200])
    for bad, match in ((cut, "truncated"), (tmp_path / "none.baler", "does not exist"), (data, "not a baler-lit")):
        _bad(["info", str(bad)], match, capsys)


def test_evaluate_without_plots_never_imports_matplotlib_or_lightning(trained, tmp_path):
    _, _, data = trained
    report = tmp_path / "rep"
    script = ("import sys\nfrom baler_lit.cli import main\n"
              f"assert main(['evaluate', '--original', {str(data)!r}, '--restored', {str(data)!r}, '--out',"
              f" {str(report)!r}, '--no-plots']) == 0\n"
              "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'lightning', 'scipy'}))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout and "mean normalised RMS error" in proc.stdout
    assert json.loads((report / "summary.json").read_text())["mean_norm_rms"] == 0.0
    assert not list(report.glob("*.png"))


@pytest.mark.parametrize("edit, match", [
    (lambda ckpt: None, "holds the weights only"),
    (lambda ckpt: ckpt.pop("pytorch-lightning_version"), "not a Lightning checkpoint"),
], ids=["weights only", "no version"])
def test_fit_from_a_checkpoint_that_cannot_resume_it_is_one_line(trained, tmp_path, capsys, monkeypatch, edit, match):
    """Issue 29 item 6e: Lightning's restore raised a KeyError traceback (rc 1)."""
    import torch

    root, ckpt, data = trained
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    edit(checkpoint)
    foreign = tmp_path / "foreign.ckpt"
    torch.save(checkpoint, foreign)
    monkeypatch.setattr(sys, "argv", ["baler-lit"])
    capsys.readouterr()
    _bad(_fit_args(CMS_CONFIG, tmp_path, "--data.path", str(data), "--trainer.max_epochs", "4",
                   "--ckpt_path", str(foreign)), match, capsys)


def test_a_checkpoint_of_a_lightning_that_cannot_be_upgraded_is_refused_in_one_line(tmp_path):
    """A full checkpoint whose version says 1.0.0: Lightning's migration raises (a KeyError traceback)."""
    import lightning as L
    import torch

    from baler_lit.cli import check_resumable
    from baler_lit.errors import BalerInputError
    from conftest import TinyRegressor, tiny_loader, trainer_kwargs

    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, enable_checkpointing=True, logger=False))
    trainer.fit(TinyRegressor(), tiny_loader(n=32), tiny_loader(n=16))
    (full,) = tmp_path.rglob("*.ckpt")
    check_resumable(full)  # this Lightning's own: fine
    checkpoint = torch.load(full, map_location="cpu", weights_only=False)
    checkpoint["pytorch-lightning_version"] = "1.0.0"
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    with pytest.raises(BalerInputError, match="written by Lightning 1.0.0"):
        check_resumable(old)
