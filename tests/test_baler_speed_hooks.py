"""The per-step shortcuts of BalerModule.optimizer_zero_grad and BalerCheckpoint.state_key (issue 31, item 4) change nothing but the time: the same
weights as Lightning's default hooks, the same checkpoint key. Nothing here is timed."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from baler_lit.data import BalerDataModule
from baler_lit.module import BalerCheckpoint, BalerModule


def fit(tmp_path, module_cls=BalerModule, epochs: int = 2) -> dict:
    L.seed_everything(0, verbose=False)
    datamodule = BalerDataModule(batch_size=64, val_fraction=0.0, shuffle=False, synthetic_rows=256)
    model = module_cls(input_shape=datamodule.input_shape, dtype="float64")
    trainer = L.Trainer(max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(model, datamodule)
    return {k: v.clone() for k, v in model.state_dict().items()}


class LightningDefaults(BalerModule):
    """BalerModule with Lightning's own zero_grad hook back."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        return L.LightningModule.optimizer_zero_grad(self, epoch, batch_idx, optimizer)


def test_the_shortcuts_train_exactly_the_same_weights(tmp_path):
    ours, defaults = fit(tmp_path / "a"), fit(tmp_path / "b", LightningDefaults)
    assert ours.keys() == defaults.keys()
    assert all(torch.equal(ours[k], defaults[k]) for k in ours)


def test_zero_grad_shortcut_sets_gradients_to_none_and_leaves_other_optimizers_alone():
    module = BalerModule(input_shape=(4,))
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.rand(3, 4)).sum().backward()
    module.optimizer_zero_grad(0, 0, optimizer)
    assert all(p.grad is None for p in module.parameters())

    class OwnZeroGrad(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            OwnZeroGrad.calls += 1
            super().zero_grad(set_to_none)

    module.optimizer_zero_grad(0, 0, OwnZeroGrad(module.parameters(), lr=0.1))
    assert OwnZeroGrad.calls == 1
    with torch.autograd.profiler.profile():  # a running profiler keeps the optimizer's own (labelled) zero_grad
        calls = []
        optimizer.zero_grad = lambda *a, **k: calls.append(1)
        module.optimizer_zero_grad(0, 0, optimizer)
    assert calls == [1]


def test_checkpoint_key_is_model_checkpoints_built_once_per_setting(monkeypatch):
    callback = BalerCheckpoint(filename="best")
    assert callback.state_key == ModelCheckpoint.state_key.fget(callback)
    built = []
    original = ModelCheckpoint._generate_state_key
    monkeypatch.setattr(ModelCheckpoint, "_generate_state_key", lambda self, **kw: built.append(1) or original(self, **kw))
    for _ in range(5):
        callback.state_key
    assert built == []  # cached
    callback.monitor = "train/loss"  # what setup does with "auto"
    assert "'monitor': 'train/loss'" in callback.state_key and len(built) == 1
