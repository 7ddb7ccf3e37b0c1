"""Baler's ``apply_normalization = False`` (its CFD examples train on raw values) through the whole CLI: a
converted config with ``data.apply_normalization: false`` trains, and its checkpoint and ``.baler`` file carry the
identity normalisation, so decompress restores raw values with nothing else."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from baler_conftest_helpers import one_thread  # noqa: F401 (fixture)

from baler_lit.checkpoint import load_checkpoint
from baler_lit.cli import main
from baler_lit.compression import read_compressed
from baler_lit.table import Table, save_npz

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = '''def set_config(c):
    c.input_path = "workspaces/CFD/data/frames.npz"
    c.compression_ratio = 10
    c.epochs = 2
    c.early_stopping = False
    c.lr_scheduler = False
    c.model_name = "CFD_dense_AE"
    c.custom_norm = True
    c.lr = 0.001
    c.batch_size = 8
    c.test_size = 0
    c.data_dimension = 2
    c.apply_normalization = False
'''


def test_a_converted_raw_value_config_trains_compresses_and_restores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["baler-lit"])
    config = tmp_path / "workspaces" / "CFD" / "raw" / "config" / "raw_config.py"
    config.parent.mkdir(parents=True)
    config.write_text(CONFIG)
    (tmp_path / "workspaces" / "CFD" / "data").mkdir()
    frames = np.random.default_rng(0).normal(3.0, 40.0, size=(16, 6, 5))
    save_npz("workspaces/CFD/data/frames.npz", Table(frames))
    assert main(["convert-config", str(config), "--output", "raw.yaml"]) == 0
    assert main(["fit", "--config", "raw.yaml", "--trainer.enable_progress_bar", "false",
                 "--trainer.enable_model_summary", "false"]) == 0  # fmt: skip
    ckpt = tmp_path / "workspaces" / "CFD" / "raw" / "output" / "training" / "model.ckpt"
    assert load_checkpoint(ckpt).normalizer.is_identity
    assert main(["compress", "--ckpt", str(ckpt), "--input", "workspaces/CFD/data/frames.npz", "--output", "r.baler",
                 "--latent-dtype", "float32"]) == 0  # fmt: skip
    assert read_compressed("r.baler").normalizer().is_identity
    assert main(["decompress", "--input", "r.baler", "--output", "r.npz"]) == 0
    restored = np.load("r.npz")["data"]
    assert restored.shape == frames.shape and np.isfinite(restored).all()
