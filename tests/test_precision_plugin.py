"""SwitchablePrecision runs each mode through Lightning's own plugin: the same numerics as that plugin, step for step.

What the step sees (autocast and its dtype, the parameters', inputs' and default dtypes) in training,
validation and predict, the parameters after a few optimizer steps (the gradients unscaled once, the scaler's
steps) and the one gradient scaler carried through switches, on CPU (float16 autocast and the GradScaler run
there too).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from torch import nn

from conftest import tiny_loader, trainer_kwargs
from lightning_energy.integration.precision_plugin import SwitchablePrecision, lightning_plugin
from lightning_energy.optimize.precision.modes import MODES

# each mode and the plugin Lightning itself would run it with on CPU (Trainer(precision="16-mixed") on CPU
# would run bfloat16: the float16 plugin is built by hand)
LIGHTNING = {
    "32-true": lambda: Precision(),
    "bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu"),
    "16-mixed": lambda: MixedPrecision("16-mixed", "cpu"),
    "64-true": lambda: DoublePrecision(),
}
# what a step sees in each mode: (autocast dtype or None, parameters, inputs, layer output, default dtype)
EXPECTED = {
    "32-true": (None, torch.float32, torch.float32, torch.float32, torch.float32),
    "bf16-mixed": (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32),
    "16-mixed": (torch.float16, torch.float32, torch.float32, torch.float16, torch.float32),
    "16-mixed-noscale": (torch.float16, torch.float32, torch.float32, torch.float16, torch.float32),
    "64-true": (None, torch.float64, torch.float64, torch.float64, torch.float64),
}


class Observed(L.LightningModule):
    """A linear regressor (SGD) that records what each training, validation and predict step sees, and the
    gradients each optimizer step is about to use (after unscaling, before the step)."""

    def __init__(self, inf_at_steps: tuple[int, ...] = (), lr: float = 0.05, fused_adam: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 1)
        self.inf_at_steps, self.lr, self.fused_adam = inf_at_steps, lr, fused_adam
        self.seen: dict[str, set[tuple]] = {"train": set(), "val": set(), "predict": set()}
        self.grads: list[torch.Tensor] = []
        self.step_grad_norms: list[float] = []  # the norm of the gradients each optimizer step took

    def _observe(self, stage: str, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        self.seen[stage].add((autocast, self.layer.weight.dtype, x.dtype, out.dtype, torch.get_default_dtype()))
        return out

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self._observe("train", x), y)
        if self.global_step in self.inf_at_steps:
            loss = loss * float("inf")
        return loss

    def validation_step(self, batch, batch_idx):
        self._observe("val", batch[0])

    def predict_step(self, batch, batch_idx):
        return self._observe("predict", batch[0])

    def on_before_optimizer_step(self, optimizer):
        self.grads.append(torch.cat([p.grad.detach().flatten().clone() for p in self.parameters()]))

    def configure_optimizers(self):
        if self.fused_adam:
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        optimizer.register_step_post_hook(lambda *_: self.step_grad_norms.append(
            float(torch.cat([p.grad.flatten() for p in self.parameters()]).norm())))
        return optimizer


def seeded(**kwargs) -> Observed:
    """An :class:`Observed` with the weights of seed 0, whatever ran before in this process."""
    torch.manual_seed(0)
    return Observed(**kwargs)


def fit_and_predict(tmp_path, plugin, model: Observed | None = None, callbacks=(), **overrides):
    torch.manual_seed(0)
    model = model or Observed()
    trainer = L.Trainer(plugins=[plugin], callbacks=list(callbacks), logger=False,
                        **trainer_kwargs(tmp_path, **{"max_epochs": 1, "limit_train_batches": 6,
                                                      "limit_val_batches": 1, **overrides}))
    trainer.fit(model, tiny_loader(), tiny_loader(n=16))
    trainer.predict(model, tiny_loader(n=16))
    return model, trainer


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_every_step_sees_its_mode_in_training_validation_and_predict(tmp_path, mode):
    model, trainer = fit_and_predict(tmp_path, SwitchablePrecision(mode))
    assert model.seen == {"train": {EXPECTED[mode]}, "val": {EXPECTED[mode]}, "predict": {EXPECTED[mode]}}
    assert trainer.precision == MODES[mode].lightning_precision
    assert (trainer.precision_plugin.scaler is not None) is (mode == "16-mixed")
    assert torch.get_default_dtype() == torch.float32  # restored after each step


@pytest.mark.parametrize("mode", list(LIGHTNING))
def test_each_mode_trains_exactly_as_lightnings_own_plugin(tmp_path, mode):
    """The same seed, batches and SGD: the same gradients before every step (unscaled once in 16-mixed) and
    the same parameters after six steps as Lightning's own plugin of that mode, bit for bit."""
    ours, trainer = fit_and_predict(tmp_path / "ours", SwitchablePrecision(mode))
    theirs, reference = fit_and_predict(tmp_path / "theirs", LIGHTNING[mode]())
    assert type(reference.precision_plugin) is type(trainer.precision_plugin.delegate())
    assert ours.seen == theirs.seen
    assert len(ours.grads) == len(theirs.grads) == 6
    for mine, lightning in zip(ours.grads, theirs.grads):
        assert torch.equal(mine, lightning)
    for mine, lightning in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(mine, lightning)
    if mode == "16-mixed":
        assert trainer.precision_plugin.scaler.get_scale() == reference.precision_plugin.scaler.get_scale()


def test_16_mixed_noscale_runs_float16_without_scaling(tmp_path):
    """Float16 autocast with no scaler: the same gradients and parameters as Lightning's float16 plugin with
    a scale that never overflows here (1024, a power of two: scaling and unscaling are exact)."""
    ours, trainer = fit_and_predict(tmp_path / "ours", SwitchablePrecision("16-mixed-noscale"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    theirs, reference = fit_and_predict(tmp_path / "theirs", MixedPrecision("16-mixed", "cpu", scaler=scaler))
    assert scaler.get_scale() == 1024.0 and trainer.precision_plugin.scaler is None  # no step skipped
    assert trainer.precision_plugin.delegate().scaler is None
    for mine, lightning in zip([*ours.grads, *ours.parameters()], [*theirs.grads, *theirs.parameters()]):
        assert torch.equal(mine, lightning)


def test_16_mixed_gradients_are_unscaled_once_and_stepped_as_seen(tmp_path):
    """SGD without momentum: each step moves a parameter by exactly -lr x the gradient the hooks saw, and
    those gradients are the unscaled ones (the scale is 65536: scaled ones would be thousands of times
    larger than float32's gradients of the same batch)."""
    model, trainer = fit_and_predict(tmp_path / "half", SwitchablePrecision("16-mixed"), limit_train_batches=1)
    torch.manual_seed(0)
    before = Observed()  # the same initial weights as the fit's
    x, y = next(iter(tiny_loader()))
    nn.functional.mse_loss(before.layer(x), y).backward()
    full = torch.cat([p.grad.flatten() for p in before.parameters()])
    (seen,) = model.grads
    assert trainer.precision_plugin.scaler.get_scale() == 65536.0  # no overflow: the step was taken
    torch.testing.assert_close(seen, full, rtol=0.02, atol=1e-3)  # float16 forward, unscaled gradients
    initial = torch.cat([p.detach().flatten() for p in before.parameters()])
    stepped = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(stepped, initial - model.lr * seen, rtol=0, atol=1e-7)


class SwitchAt(L.Callback):
    """Requests ``modes[batch]`` after that batch; records the plugin's scaler and its scale after every batch."""

    def __init__(self, modes: dict[int, str]) -> None:
        self.modes = modes
        self.scalers: list = []
        self.scales: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plugin = trainer.precision_plugin
        self.scalers.append(plugin.scaler)
        self.scales.append(plugin.scaler.get_scale() if plugin.scaler is not None else None)
        if batch_idx in self.modes:
            plugin.request_mode(self.modes[batch_idx])


def test_an_inf_gradient_in_16_mixed_is_skipped_and_the_scaler_is_carried_through_a_switch(tmp_path):
    """An infinite loss at step 1: the scaler skips that step (parameters stay finite) and halves its scale;
    bf16-mixed runs steps 3-5 without it; back in 16-mixed the same scaler goes on from the halved scale."""
    switcher = SwitchAt({2: "bf16-mixed", 5: "16-mixed"})
    model, trainer = fit_and_predict(tmp_path, SwitchablePrecision("16-mixed"), Observed(inf_at_steps=(1,)),
                                     callbacks=[switcher], limit_train_batches=8)
    plugin = trainer.precision_plugin
    assert switcher.scales == [65536.0, 32768.0, 32768.0, None, None, None, 32768.0, 32768.0]
    scalers = [s for s in switcher.scalers if s is not None]
    assert len(scalers) == 5 and all(s is plugin._scaler for s in scalers)  # one scaler, kept while unused
    assert plugin.skipped_steps == 1 and plugin.consecutive_skips == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.isfinite(model.grads[1]).all()  # the skipped step's gradients were not finite


def test_an_inf_gradient_in_16_mixed_skips_the_step_as_lightnings_own_plugin_does(tmp_path):
    ours, trainer = fit_and_predict(tmp_path / "ours", SwitchablePrecision("16-mixed"), seeded(inf_at_steps=(2,)))
    theirs, reference = fit_and_predict(tmp_path / "theirs", LIGHTNING["16-mixed"](), seeded(inf_at_steps=(2,)))
    assert trainer.precision_plugin.scaler.get_scale() == reference.precision_plugin.scaler.get_scale() == 32768.0
    for mine, lightning in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(mine, lightning) and torch.isfinite(mine).all()


@pytest.mark.parametrize("mode, refused", [("16-mixed", True), ("bf16-mixed", False)])
def test_clipping_with_a_fused_optimizer_is_refused_only_under_gradient_scaling(tmp_path, mode, refused):
    """A fused optimizer unscales inside its step, so the gradients cannot be clipped before it in
    16-mixed (Lightning's MixedPrecision refuses); in bf16-mixed nothing is scaled and clipping works."""
    model = Observed(fused_adam=True)
    if refused:
        with pytest.raises(RuntimeError, match="performs unscaling of gradients internally"):
            fit_and_predict(tmp_path, SwitchablePrecision(mode), model, gradient_clip_val=0.1)
        return
    model, _ = fit_and_predict(tmp_path, SwitchablePrecision(mode), model, gradient_clip_val=1e-3)
    assert len(model.step_grad_norms) == 6 and all(float(g.norm()) > 1e-2 for g in model.grads)  # to clip
    assert all(norm == pytest.approx(1e-3, rel=1e-3) for norm in model.step_grad_norms)  # clipped before each step


def test_each_mode_is_delegated_to_the_lightning_plugin_of_its_numerics():
    plugins = {name: lightning_plugin(mode, "cpu") for name, mode in MODES.items() if name != "tf32"}
    assert {name: type(p).__name__ for name, p in plugins.items()} == {
        "64-true": "DoublePrecision", "32-true": "Precision", "bf16-mixed": "MixedPrecision",
        "16-mixed": "MixedPrecision", "16-mixed-noscale": "MixedPrecision"}
    assert plugins["bf16-mixed"].precision == "bf16-mixed" and plugins["16-mixed"].precision == "16-mixed"
    assert plugins["16-mixed-noscale"].precision == "16-mixed" and plugins["16-mixed-noscale"].scaler is None
    assert plugins["bf16-mixed"].scaler is None
    scaler = torch.amp.GradScaler("cpu")
    assert lightning_plugin(MODES["16-mixed"], "cpu", scaler).scaler is scaler
    assert type(lightning_plugin(MODES["tf32"], "cuda")) is Precision  # TF32 is switched apart
