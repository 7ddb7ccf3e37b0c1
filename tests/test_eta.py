"""EnergyToAccuracy on fake time: exact energy and time to the target, stop, resume, refusals."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import trainer_kwargs
from lightning_energy.callbacks.eta import EnergyToAccuracy
from lightning_energy.gpu_sim import SimulatedGPU, SimulatedWorkload
from power_limit_helpers import ROWS, AccuracyModule, RecordingLogger, install_fake_time

BATCH = 64  # AccuracyModule's loader batch size here: ROWS / 64 = 16 steps per epoch


def fit(tmp_path, monkeypatch, callback, epochs, ckpt_path=None, extra=(), **overrides):
    clock = install_fake_time(monkeypatch.setattr)
    gpu = SimulatedGPU(clock=clock)
    callback._user_sensors = [gpu.energy_sensor()]
    logger = RecordingLogger()
    trainer = L.Trainer(callbacks=[callback, SimulatedWorkload(gpu=gpu), *extra], **trainer_kwargs(
        tmp_path, max_epochs=epochs, logger=[logger], num_sanity_val_steps=0, **overrides))
    trainer.fit(AccuracyModule(batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, gpu, logger


def test_energy_and_time_to_target_are_exact_and_logged(tmp_path, monkeypatch):
    callback = EnergyToAccuracy("val/acc", target=0.5)
    trainer, gpu, logger = fit(tmp_path, monkeypatch, callback, epochs=4)
    steps = 3 * ROWS // BATCH  # val/acc: 0.2, 0.4, 0.6 -> reached after the third epoch
    assert callback.result["epochs_to_target"] == 3
    assert callback.result["energy_to_target_J"] == pytest.approx(steps * gpu.step_energy_J(300, BATCH), rel=1e-9)
    assert callback.result["time_to_target_s"] == pytest.approx(steps * gpu.step_time_s(300, BATCH), rel=1e-9)
    assert trainer.current_epoch == 4  # stop=False: training went on
    assert logger.values("energy_to_target_J") == [pytest.approx(callback.result["energy_to_target_J"])]
    assert logger.values("epochs_to_target") == [3.0]


def test_stop_and_min_mode(tmp_path, monkeypatch):
    callback = EnergyToAccuracy("val/acc", target=0.25, mode="min", stop=True)  # 0.2 <= 0.25 at once
    trainer, gpu, _ = fit(tmp_path, monkeypatch, callback, epochs=5)
    assert callback.result["epochs_to_target"] == 1 and trainer.current_epoch == 1


def test_resume_counts_the_energy_before_the_checkpoint(tmp_path, monkeypatch):
    first = EnergyToAccuracy("val/acc", target=0.5)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    fit(tmp_path, monkeypatch, first, epochs=2, extra=[checkpoint], enable_checkpointing=True)
    assert first.result is None
    second = EnergyToAccuracy("val/acc", target=0.5)
    _, gpu, _ = fit(tmp_path, monkeypatch, second, epochs=4, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
                    extra=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)],
                    enable_checkpointing=True)
    steps = 3 * ROWS // BATCH
    assert second.result["epochs_to_target"] == 3
    assert second.result["energy_to_target_J"] == pytest.approx(steps * gpu.step_energy_J(300, BATCH), rel=1e-9)


def test_bad_arguments_and_missing_metric(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="mode"):
        EnergyToAccuracy("val/acc", 0.5, mode="up")
    with pytest.raises(ValueError, match="target"):
        EnergyToAccuracy("val/acc", float("nan"))
    callback = EnergyToAccuracy("val/f1", target=0.5)
    with pytest.warns(UserWarning, match="'val/f1' is not logged"):
        fit(tmp_path, monkeypatch, callback, epochs=1)
    assert callback.result is None
