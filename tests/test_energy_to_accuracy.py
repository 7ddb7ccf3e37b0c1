"""EnergyToAccuracy on fake time: exact energy and time to the target, stop, resume, refusals."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import trainer_kwargs
from lightning_energy.callbacks.energy_to_accuracy import EnergyToAccuracy
from lightning_energy.simulate.gpu_sim import SimulatedGPU, SimulatedWorkload
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


def test_missing_metric(tmp_path, monkeypatch):
    callback = EnergyToAccuracy("val/f1", target=0.5)
    with pytest.warns(UserWarning, match="'val/f1' is not logged"):
        fit(tmp_path, monkeypatch, callback, epochs=1)
    assert callback.result is None


class IdleAfterValidation(L.Callback):
    """Time after each epoch's validation, before the checkpoint of the epoch's end (the card keeps drawing)."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def on_train_epoch_end(self, trainer, pl_module):
        self.clock.advance(self.seconds)


def test_a_resumed_run_counts_what_an_uninterrupted_one_counts(tmp_path, monkeypatch):
    """The checkpoint keeps the energy up to when it was saved, not up to the last validation: the energy
    spent between the two (here after every validation, before the epoch-end checkpoint) is not lost."""
    idle_s = 0.5

    def run(callback, epochs, folder, ckpt_path=None):
        clock = install_fake_time(monkeypatch.setattr)
        gpu = SimulatedGPU(clock=clock)
        callback._user_sensors = [gpu.energy_sensor()]
        trainer = L.Trainer(
            callbacks=[callback, SimulatedWorkload(gpu=gpu), IdleAfterValidation(clock, idle_s),
                       ModelCheckpoint(dirpath=tmp_path / folder, save_last=True, save_top_k=0)],
            **trainer_kwargs(tmp_path, max_epochs=epochs, logger=False, num_sanity_val_steps=0,
                             enable_checkpointing=True))
        trainer.fit(AccuracyModule(batch_size=BATCH), ckpt_path=ckpt_path)
        return gpu

    whole = EnergyToAccuracy("val/acc", target=0.5)
    gpu = run(whole, epochs=4, folder="whole")
    steps = 3 * ROWS // BATCH  # reached at the third validation, after two idle spells (epochs 0 and 1)
    # the card idles between steps (gpu_sim: host work is not billed at the cap)
    expected_J = steps * gpu.step_energy_J(300, BATCH) + 2 * idle_s * gpu.idle_W
    assert whole.result["energy_to_target_J"] == pytest.approx(expected_J, rel=1e-9)
    assert whole.result["time_to_target_s"] == pytest.approx(steps * gpu.step_time_s(300, BATCH) + 2 * idle_s,
                                                             rel=1e-9)
    first = EnergyToAccuracy("val/acc", target=0.5)
    run(first, epochs=2, folder="ckpt")  # its checkpoint comes after the second epoch's idle spell
    assert first.result is None
    resumed = EnergyToAccuracy("val/acc", target=0.5)
    gpu = run(resumed, epochs=4, folder="ckpt", ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert gpu.steps_run == 2 * ROWS // BATCH  # the third and fourth epochs: it went on from the checkpoint
    for key in ("energy_to_target_J", "time_to_target_s", "epochs_to_target"):
        assert resumed.result[key] == pytest.approx(whole.result[key], rel=1e-9), key


@pytest.mark.parametrize("target, waits", [(0.9, 0), (0.5, 1)], ids=["never_reached", "reached"])
def test_no_wait_at_validations_but_the_one_that_reaches_the_target(tmp_path, monkeypatch, target, waits):
    from lightning_energy.measure.meter import Meter

    recorded, training = [], []
    original = Meter.wait

    def recording_wait(self, mark, timeout_s=None):
        if training:
            recorded.append(mark)
        return original(self, mark, timeout_s)

    class Training(L.Callback):
        def on_train_start(self, trainer, pl_module):
            training.append(True)

        def on_train_end(self, trainer, pl_module):
            training.clear()

    monkeypatch.setattr(Meter, "wait", recording_wait)
    callback = EnergyToAccuracy("val/acc", target=target)
    fit(tmp_path, monkeypatch, callback, epochs=4, extra=[Training()])
    assert (callback.result is not None) == bool(waits)
    assert len(recorded) == waits
