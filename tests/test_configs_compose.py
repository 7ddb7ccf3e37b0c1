"""Every documented config combination, end to end: model config + fragment keeps the model's callbacks.

``baler-lit fit --config configs/cms_ae.yaml --config configs/<fragment>.yaml``: the fragment appends its
callbacks (``trainer.callbacks+:``), so the model config's ModelCheckpoint still writes ``best.ckpt`` (which
the README's compress example reads), and one EnergyCallback measures the run (the fragment's, when it
names sensors). Small fits: a few hundred synthetic rows, one or two epochs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from baler_conftest_helpers import CFD, REPO, one_thread, single_thread  # noqa: F401 (fixture)

from baler_lit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = REPO / "configs"
FRAGMENTS = ("energy_simulated", "power_limit_simulated", "precision_switch")


def _fit(root, configs, *extra, monkeypatch):
    """Run ``baler-lit fit`` in process; return (exit code, the Trainer, the run's log dir)."""
    from lightning.pytorch.cli import LightningCLI

    seen = []
    original = LightningCLI.instantiate_trainer

    def spy(self, **kwargs):
        seen.append(original(self, **kwargs))
        return seen[-1]

    monkeypatch.setattr(LightningCLI, "instantiate_trainer", spy)
    monkeypatch.setattr(sys, "argv", ["baler-lit"])
    args = ["fit"]
    for config in configs:
        args += ["--config", str(CONFIGS / f"{config}.yaml")]
    # the shipped configs name no logger: Lightning's default one writes below default_root_dir
    args += ["--trainer.default_root_dir", str(root),
             "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
             "--trainer.log_every_n_steps", "1", *extra]
    with single_thread():
        code = main(args)
    (trainer,) = seen
    return code, trainer, Path(trainer.log_dir)


def _energy_callbacks(trainer):
    from lightning_energy import EnergyCallback

    return [c for c in trainer.callbacks if isinstance(c, EnergyCallback)]


def _small_cms(rows=400, batch=64, epochs=1):
    return ["--data.synthetic_rows", str(rows), "--data.batch_size", str(batch), "--trainer.max_epochs", str(epochs)]


@pytest.mark.parametrize("fragment", FRAGMENTS)
def test_fragments_append_callbacks_instead_of_replacing_the_list(fragment):
    """The fragments use `callbacks+:`; none of them replaces a model config's callback list."""
    loaded = yaml.safe_load((CONFIGS / f"{fragment}.yaml").read_text())
    assert "callbacks" not in loaded["trainer"] and loaded["trainer"]["callbacks+"]


def test_cms_with_energy_simulated_keeps_best_ckpt_and_measures_the_simulated_sensors(tmp_path, monkeypatch,
                                                                                      capsys):
    code, trainer, run = _fit(tmp_path, ["cms_ae", "energy_simulated"], *_small_cms(epochs=2),
                              monkeypatch=monkeypatch)
    assert code == 0
    ckpt = run / "checkpoints" / "best.ckpt"
    assert ckpt.is_file()  # the model config's ModelCheckpoint survived the fragment
    (energy,) = _energy_callbacks(trainer)
    assert [s.name for s in energy.user_sensors] == ["sim_gpu", "sim_cpu"]
    report = json.loads((run / "energy_report.json").read_text())
    names = {s["name"]: s for s in report["sensors"]}
    assert set(names) == {"sim_gpu", "sim_cpu"}
    assert names["sim_cpu"]["mean_power_W"] == pytest.approx(45.0, rel=1e-9)
    # the README's next step: compress with the checkpoint the fit kept
    capsys.readouterr()
    data = tmp_path / "jets.npz"
    from baler_lit.synthetic import synthetic_cms_jets
    from baler_lit.table import save_npz

    save_npz(data, synthetic_cms_jets(200, seed=3))
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(data), "--output", str(tmp_path / "d.baler")]) == 0
    assert "ratio" in capsys.readouterr().out


def test_cms_with_power_limit_simulated_keeps_best_ckpt_and_reads_the_simulated_card(tmp_path, monkeypatch):
    from lightning_energy.callbacks.power_limit import PowerLimitOptimizer

    code, trainer, run = _fit(tmp_path, ["cms_ae", "power_limit_simulated"],
                              *_small_cms(rows=5000, batch=32, epochs=1), monkeypatch=monkeypatch)
    assert code == 0
    assert (run / "checkpoints" / "best.ckpt").is_file()
    (energy,) = _energy_callbacks(trainer)
    (optimiser,) = [c for c in trainer.callbacks if isinstance(c, PowerLimitOptimizer)]
    assert optimiser.profiles  # it profiled limits on the simulated card
    (sensor,) = json.loads((run / "energy_report.json").read_text())["sensors"]
    assert sensor["name"] == "simgpu0" and sensor["energy_J"] > 0


def test_cms_with_precision_switch_keeps_best_ckpt(tmp_path, monkeypatch):
    from lightning_energy.callbacks.precision import PrecisionSwitch

    # 150 steps: room for every profiling round PrecisionSwitch may need (4 modes x 3 steps x up to 4 rounds);
    # with 20 steps the pick depended on whether the machine's noise let one round decide
    code, trainer, run = _fit(tmp_path, ["cms_ae", "precision_switch"], *_small_cms(rows=6000, batch=32),
                              # the fragment's PrecisionSwitch (the last callback), shortened
                              "--trainer.callbacks.init_args.warmup_steps=1",
                              "--trainer.callbacks.init_args.profile_steps=2", monkeypatch=monkeypatch)
    assert code == 0
    assert (run / "checkpoints" / "best.ckpt").is_file()
    assert len(_energy_callbacks(trainer)) == 1  # the model config's and the fragment's: one kept
    (switch,) = [c for c in trainer.callbacks if isinstance(c, PrecisionSwitch)]
    assert switch.chosen is not None
    assert (run / "energy_report.json").is_file()


def test_cms_alone_keeps_its_energy_callback_and_checkpoint(tmp_path, monkeypatch):
    code, trainer, run = _fit(tmp_path, ["cms_ae"], *_small_cms(), monkeypatch=monkeypatch)
    assert code == 0 and (run / "checkpoints" / "best.ckpt").is_file()
    (energy,) = _energy_callbacks(trainer)
    assert energy.user_sensors is None
    # `lightning-energy fit/compare --by batch_size` reads the value LightningCLI saved in config.yaml, and the
    # module's hparams despite the !!python/tuple Lightning writes for input_shape
    from lightning_energy.analysis.runs import load_run

    assert "!!python/tuple" in (run / "hparams.yaml").read_text()
    attributes = load_run(run).attributes
    assert attributes["batch_size"] == 64 and attributes["data.batch_size"] == 64
    assert attributes["compression_ratio"] == 1.6 and attributes["model"] == "AE"


def test_cfd_config_finds_bakers_example_through_the_data_env(tmp_path, monkeypatch):
    cfd = Path(os.environ.get("BALER_LIT_DATA", CFD.parent)) / CFD.name
    if not cfd.exists():
        pytest.skip(f"shared data file {cfd} not found")
    monkeypatch.setenv("BALER_LIT_DATA", str(cfd.parent))
    monkeypatch.chdir(tmp_path)  # the config no longer depends on the working directory
    code, trainer, run = _fit(tmp_path, ["cfd_conv_ae", "energy_simulated"], "--trainer.max_epochs", "1",
                              monkeypatch=monkeypatch)
    assert code == 0 and (run / "checkpoints" / "best.ckpt").is_file()
    assert trainer.datamodule.table.source == str(cfd)
    with np.load(cfd) as npz:
        np.testing.assert_array_equal(trainer.datamodule.table.data, npz["data"])


def test_cfd_config_without_the_example_trains_on_a_labelled_stand_in(tmp_path, monkeypatch):
    from baler_lit import examples

    monkeypatch.setenv("BALER_LIT_DATA", str(tmp_path / "nowhere"))
    monkeypatch.setattr(examples, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"CFD_animation.npz not found .* synthetic CFD-like stand-in"):
        code, trainer, run = _fit(tmp_path, ["cfd_conv_ae"], "--trainer.max_epochs", "1", monkeypatch=monkeypatch)
    assert code == 0 and (run / "checkpoints" / "best.ckpt").is_file()
    table = trainer.datamodule.table
    assert table.data.shape == (60, 50, 50) and table.source.startswith("synthetic stand-in")
    assert -0.0112 <= table.data.min() < table.data.max() <= 0.0477  # Baler's example's value range


def test_synthetic_cfd_is_smooth_and_moves():
    from baler_lit.examples import synthetic_cfd

    field = synthetic_cfd(60, seed=0)
    spatial = np.abs(np.diff(field, axis=2)).mean()
    assert spatial < 0.1 * (field.max() - field.min())  # neighbouring pixels are close: a field, not noise
    assert np.abs(field[1] - field[0]).mean() > 0.1 * spatial  # frames differ: the pattern drifts
