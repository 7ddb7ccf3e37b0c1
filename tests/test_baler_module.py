"""The LightningModule: logged metrics, dtypes, Baler's optimiser/scheduler/early-stopping defaults, checkpoints."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from baler_conftest_helpers import one_thread, quick_trainer  # noqa: F401 (fixture)
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from baler_lit.cli import load_checkpoint
from baler_lit.data import BalerDataModule
from baler_lit.errors import BalerInputError
from baler_lit.module import BalerModule

pytestmark = pytest.mark.usefixtures("one_thread")


class EpochLosses(L.Callback):
    def __init__(self) -> None:
        self.train: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.train.append(float(trainer.callback_metrics["train/loss"]))


def test_fit_logs_train_and_val_loss_and_learns():
    dm = BalerDataModule(synthetic_rows=2000, val_fraction=0.2, batch_size=128)
    module = BalerModule(input_shape=dm.input_shape)
    losses = EpochLosses()
    trainer = quick_trainer(max_epochs=4, callbacks=[losses])
    trainer.fit(module, dm)
    metrics = trainer.callback_metrics
    assert {"train/loss", "val/loss"} <= set(metrics)
    assert len(losses.train) == 4 and losses.train[-1] < 0.5 * losses.train[0]
    assert module.normalizer is not None and module.column_names[0] == "pt"


def test_step_and_total_losses_are_logged_when_asked():
    dm = BalerDataModule(synthetic_rows=600, val_fraction=0.0, batch_size=100)
    module = BalerModule(input_shape=dm.input_shape, reg_param=0.001, rho=0.05, step_log_interval=2)
    trainer = quick_trainer(max_epochs=1)
    trainer.fit(module, dm)
    metrics = trainer.callback_metrics
    assert "train/loss_step" in metrics and "val/loss" not in metrics
    assert float(metrics["train/total_loss"]) > float(metrics["train/loss"])


def test_float64_training_uses_float64_end_to_end():
    dm = BalerDataModule(synthetic_rows=500, val_fraction=0.2, batch_size=100)
    module = BalerModule(input_shape=dm.input_shape, dtype="float64")
    seen = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch.dtype)

    quick_trainer(max_epochs=1, callbacks=[Probe()]).fit(module, dm)
    assert seen and set(seen) == {torch.float64}
    assert all(p.dtype == torch.float64 for p in module.parameters())


def test_baler_optimiser_scheduler_and_early_stopping_defaults():
    dm = BalerDataModule(synthetic_rows=300, val_fraction=0.2)
    module = BalerModule(input_shape=dm.input_shape)
    trainer = quick_trainer(max_epochs=1)
    trainer.fit(module, dm)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 1e-3
    assert optimizer.defaults["fused"] is True
    config = trainer.lr_scheduler_configs[0]
    assert isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert config.scheduler.factor == 0.5 and config.scheduler.patience == 50 and config.monitor == "val/loss"
    stoppers = [c for c in trainer.callbacks if isinstance(c, EarlyStopping)]
    assert len(stoppers) == 1 and stoppers[0].patience == 100 and stoppers[0].monitor == "val/loss"


def test_without_validation_the_monitor_falls_back_to_train_loss():
    dm = BalerDataModule(synthetic_rows=300, val_fraction=0.0)
    module = BalerModule(input_shape=dm.input_shape, lr_patience=1, early_stopping_patience=1)
    trainer = quick_trainer(max_epochs=2)
    trainer.fit(module, dm)
    assert trainer.lr_scheduler_configs[0].monitor == "train/loss"
    assert [c.monitor for c in trainer.callbacks if isinstance(c, EarlyStopping)] == ["train/loss"]


def test_schedules_can_be_switched_off():
    dm = BalerDataModule(synthetic_rows=300, val_fraction=0.2)
    module = BalerModule(input_shape=dm.input_shape, lr_patience=None, early_stopping_patience=None, adam="foreach")
    trainer = quick_trainer(max_epochs=1)
    trainer.fit(module, dm)
    assert trainer.lr_scheduler_configs == []
    assert not any(isinstance(c, EarlyStopping) for c in trainer.callbacks)


def test_checkpoint_keeps_normalisation_and_loads_without_pickle(tmp_path):
    dm = BalerDataModule(synthetic_rows=500, val_fraction=0.2, batch_size=100)
    module = BalerModule(input_shape=dm.input_shape, dtype="float64", latent_dim=9)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="best", monitor="val/loss")
    quick_trainer(max_epochs=2, enable_checkpointing=True, callbacks=[ckpt]).fit(module, dm)
    loaded = load_checkpoint(tmp_path / "best.ckpt")  # weights_only=True inside, no Lightning
    assert loaded.model.latent_dim == 9 and next(loaded.model.parameters()).dtype == torch.float64
    stored = torch.load(tmp_path / "best.ckpt", weights_only=True)["state_dict"]
    for name, value in loaded.model.state_dict().items():
        torch.testing.assert_close(value, stored[f"model.{name}"], rtol=0, atol=0)
    np.testing.assert_array_equal(loaded.normalizer.minimum, dm.normalizer.minimum)
    assert loaded.column_names == dm.table.names and loaded.column_dtypes == dm.table.dtypes


def test_column_count_mismatch_is_reported_before_training():
    dm = BalerDataModule(synthetic_rows=100, val_fraction=0.0)
    module = BalerModule(input_shape=(23,))
    with pytest.raises(BalerInputError, match="column-count mismatch"):
        quick_trainer(max_epochs=1).fit(module, dm)


def test_module_needs_an_input_shape():
    with pytest.raises(BalerInputError, match="input_shape"):
        BalerModule()


def test_testing_from_a_checkpoint_uses_the_stored_normalisation(tmp_path):
    train_dm = BalerDataModule(synthetic_rows=400, val_fraction=0.2, batch_size=100)
    module = BalerModule(input_shape=train_dm.input_shape)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="best", monitor="val/loss")
    quick_trainer(max_epochs=1, enable_checkpointing=True, callbacks=[ckpt]).fit(module, train_dm)

    wider = train_dm.table.data * 2.0  # twice the training range in every column
    np.savez(tmp_path / "wider.npz", data=wider, names=np.array(train_dm.table.names))
    test_dm = BalerDataModule(str(tmp_path / "wider.npz"), batch_size=100)
    fresh = BalerModule(input_shape=test_dm.input_shape)
    # the same callbacks as in training, as a CLI run with the same config would have
    tester = quick_trainer(enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="val/loss")])
    metrics = tester.test(fresh, test_dm, ckpt_path=str(tmp_path / "best.ckpt"), weights_only=True)[0]
    assert "test/loss" in metrics
    np.testing.assert_array_equal(fresh.normalizer.scale, train_dm.normalizer.scale)
    assert float(test_dm._tensor("all").max()) > 1.5  # normalised with the training range, not refitted
