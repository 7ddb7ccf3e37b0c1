"""SwitchablePrecision and PrecisionSwitch in real Lightning fits on CPU, with a simulated per-mode cost model."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import get_sampler
from lightning_energy.callbacks.precision import PrecisionSwitch, pick_mode, settle_mode
from lightning_energy.integration.precision_plugin import SwitchablePrecision
from lightning_energy.optimize.precision.modes import MODE_LEGEND, MODE_NAMES, MODES, unavailable_reason
from lightning_energy.optimize.precision.probe import _silenced_logging, reference_loss
from power_limit_helpers import install_fake_time
from precision_helpers import (
    SAMPLER_INTERVAL_S, STEP_SLEEP_S, FaultyRegressor, FollowMode, SimulatedModeCosts,
    SleepyBoringModel,
)

HERE = Path(__file__).resolve().parent
CHEAP_W, DEAR_W = 1.0, 1000.0


@pytest.fixture
def clock(monkeypatch):
    """Fake time: steps take the simulated cost model's seconds, every figure is exact (``install_fake_time``)."""
    return install_fake_time(monkeypatch.setattr)


def cost_model(clock, cheapest: str, **kwargs):
    """On fake time: an energy counter drawing CHEAP_W in ``cheapest`` and DEAR_W in every other mode, and the
    simulated hardware driving it (put it after the PrecisionSwitch)."""
    costs = SimulatedModeCosts(clock, {name: CHEAP_W if name == cheapest else DEAR_W for name in MODE_NAMES}, **kwargs)
    return costs.counter, costs


def switch(sensor=None, **kwargs) -> PrecisionSwitch:
    kwargs.setdefault("warmup_steps", 2)
    kwargs.setdefault("profile_steps", 3)
    kwargs.setdefault("check_every_n_steps", 2)
    kwargs.setdefault("min_profile_rounds", 1)  # the cost models' gaps settle in one round (pairs: tested apart)
    kwargs.setdefault("noise_floor", False)  # one 32-true window a round (the A/A noise floor: tested apart)
    kwargs.setdefault("verbose", False)
    return PrecisionSwitch(sensors=[sensor] if sensor is not None else None, interval_s=SAMPLER_INTERVAL_S, **kwargs)


def fit(tmp_path, model, callbacks, plugins=None, train_rows=160, ckpt_path=None, **overrides):
    overrides.setdefault("logger", CSVLogger(str(tmp_path), name="csv"))
    trainer = L.Trainer(callbacks=callbacks, plugins=plugins, **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(model, tiny_loader(n=train_rows), tiny_loader(n=32), ckpt_path=ckpt_path)
    return trainer


class AdamRegressor(FaultyRegressor):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)


# ---------------------------------------------------------------------------------------------- modes
def test_every_mode_has_a_documented_code():
    assert [MODES[n].code for n in MODE_NAMES] == list(range(len(MODE_NAMES)))
    doc = " ".join(PrecisionSwitch.__doc__.split())
    for name in MODE_NAMES:
        assert f"{MODES[name].code} = {name}" in MODE_LEGEND
        assert f"{MODES[name].code} = {name}" in doc, f"legend entry of {name} missing from the docstring"


class DriveModes(L.Callback):
    """Requests the next mode of ``order`` after every training step and records what each step ran in."""

    def __init__(self, order):
        self.order = order
        self.modes, self.pending = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.modes.append(trainer.precision_plugin.mode_name)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plugin = trainer.precision_plugin
        state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.is_floating_point()]
        assert {t.dtype for t in state} <= {torch.float32}, "optimizer state changed dtype"
        plugin.request_mode(self.order[len(self.modes) % len(self.order)])
        self.pending.append(plugin.pending_mode)


def test_switching_every_step_keeps_training_correct(tmp_path):
    order = ["32-true", "bf16-mixed", "16-mixed", "16-mixed-noscale"]
    driver = DriveModes(order)
    model = AdamRegressor(sleep_s=0.0)
    trainer = fit(tmp_path, model, [driver], plugins=[SwitchablePrecision()], max_epochs=4, logger=False)
    assert set(driver.modes) == set(order)
    assert driver.modes[:5] == ["32-true", "bf16-mixed", "16-mixed", "16-mixed-noscale", "32-true"]
    assert model.param_dtypes == {torch.float32}  # the master dtype never changes
    losses = model.losses
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) < 0.3 * sum(losses[:10])  # still learns while the mode changes every step
    plugin = trainer.precision_plugin
    assert plugin.scaler is None or plugin.mode_name == "16-mixed"
    assert plugin._scaler is not None and plugin._scaler.get_scale() > 0  # created lazily, kept while unused
    assert all(p is None for p in driver.pending)  # no accumulation: every switch applies at once


def test_a_switch_waits_for_the_optimizer_step_of_accumulated_gradients(tmp_path):
    class SwitchMidAccumulation(DriveModes):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                assert trainer.precision_plugin.request_mode("16-mixed") is False  # gradients are pending
                self.pending.append(trainer.precision_plugin.pending_mode)

    driver = SwitchMidAccumulation([])
    trainer = fit(tmp_path, FaultyRegressor(sleep_s=0.0), [driver], plugins=[SwitchablePrecision()], max_epochs=1,
                  accumulate_grad_batches=2, logger=False)
    assert driver.pending == ["16-mixed"]
    assert driver.modes[:3] == ["32-true", "32-true", "16-mixed"]  # batch 1 completes the accumulation in fp32
    assert trainer.precision_plugin.mode_name == "16-mixed"


def test_64_true_is_a_fixed_mode(tmp_path):
    with pytest.raises(ValueError, match="cannot contain '64-true'.*PrecisionSwitch\\(mode='64-true'\\)"):
        PrecisionSwitch(candidates=["32-true", "64-true"])

    errors = []

    class TrySwitching(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            try:
                trainer.precision_plugin.request_mode("bf16-mixed")
            except ValueError as err:
                errors.append(str(err))

    model = FaultyRegressor(sleep_s=0.0)
    callback = switch(mode="64-true")
    trainer = fit(tmp_path, model, [callback, TrySwitching()], max_epochs=1)
    assert model.param_dtypes == {torch.float64}
    assert trainer.precision == "64-true" and trainer.precision_plugin.mode_name == "64-true"
    assert errors and "switching to or from '64-true' is only possible before training starts" in errors[0]
    assert callback.report["modes"][0]["mode"] == "64-true" and callback.report["switches"] == []


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_scaler_state_is_saved_and_restored_in_checkpoints(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    model = FaultyRegressor(fault="nan", fault_step=4, fault_steps=1, sleep_s=0.0)  # one overflow: scale backs off
    first = switch(mode="16-mixed")
    trainer = fit(tmp_path, model, [first, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], max_epochs=2,
                  enable_checkpointing=True)
    plugin = trainer.precision_plugin
    saved_scale = plugin.scaler.get_scale()
    assert saved_scale < 65536.0 and plugin.skipped_steps >= 1
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    state = checkpoint["SwitchablePrecision"]
    assert state["mode"] == "16-mixed" and state["scaler"]["scale"] == saved_scale
    assert state["skipped_steps"] == plugin.skipped_steps

    seen = {}

    class ReadScale(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["scale"] = trainer.precision_plugin.scaler.get_scale()
            seen["skipped"] = trainer.precision_plugin.skipped_steps

    trainer = fit(tmp_path, FaultyRegressor(sleep_s=0.0),
                  [switch(mode="16-mixed"), ReadScale(), ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
                  max_epochs=3, enable_checkpointing=True, ckpt_path=ckpt_dir / "last.ckpt")
    assert seen == {"scale": saved_scale, "skipped": state["skipped_steps"]}


# ---------------------------------------------------------------------------------------------- non-finite steps
class RecordSteps(L.Callback):
    """Counts optimizer.step calls (a post-hook); after every batch records the plugin's consecutive_skips
    and Adam's step counter (which a skipped step leaves unchanged, fused or not).

    ``switch_at``: (batch index, mode) requested at the end of that batch, after recording.
    """

    def __init__(self, switch_at: tuple[int, str] | None = None):
        self.calls = 0
        self.consecutive: list[int] = []
        self.adam_steps: list[int] = []
        self.switch_at = switch_at

    def on_train_start(self, trainer, pl_module):
        trainer.optimizers[0].register_step_post_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.adam_steps.append(max(adam_step_counts(pl_module), default=0))
        plugin = trainer.precision_plugin
        if isinstance(plugin, SwitchablePrecision):
            self.consecutive.append(plugin.consecutive_skips)
            if self.switch_at and self.switch_at[0] == batch_idx:
                plugin.request_mode(self.switch_at[1])


def nan_fit(tmp_path, model, plugins=None, switch_at=None):
    """One epoch of 10 steps with ``model``; the step recorder."""
    recorder = RecordSteps(switch_at)
    fit(tmp_path, model, [recorder], plugins=plugins, max_epochs=1, logger=False)
    return recorder


def adam_step_counts(model) -> set[int]:
    """The step counters in Adam's state: optimizer steps that really changed the parameters."""
    return {int(state["step"]) for state in model.trainer.optimizers[0].state.values() if "step" in state}


def skip_runs(skipped: list[int], batches: int = 10) -> list[int]:
    """The expected consecutive_skips after each batch, given the batches whose step was skipped."""
    runs, run = [], 0
    for i in range(batches):
        run = run + 1 if i in skipped else 0
        runs.append(run)
    return runs


def test_a_nan_gradient_in_32_true_steps_exactly_as_lightnings_own_plugin(tmp_path):
    runs = {}
    for name, plugins in (("lightning", None), ("switchable", [SwitchablePrecision("32-true")])):
        torch.manual_seed(0)
        model = AdamRegressor(fault="nan", fault_step=9, fault_steps=1, any_mode=True, sleep_s=0.0)
        runs[name] = (model, nan_fit(tmp_path / name, model, plugins))
    (ours, recorder), (theirs, lightning) = runs["switchable"], runs["lightning"]
    assert type(theirs.trainer.precision_plugin).__name__ == "Precision"
    assert recorder.calls == lightning.calls == 10  # the NaN step is taken, not skipped
    assert adam_step_counts(ours) == adam_step_counts(theirs) == {10}
    assert ours.trainer.precision_plugin.skipped_steps == 0 and recorder.consecutive == [0] * 10
    assert ours.losses[:9] == theirs.losses[:9] and all(math.isfinite(v) for v in ours.losses[:9])
    for mine, reference in zip(ours.parameters(), theirs.parameters()):
        assert not torch.isfinite(mine).any()  # the NaN gradient went into the parameters, as in Lightning
        torch.testing.assert_close(mine, reference, rtol=0, atol=0, equal_nan=True)


def test_a_nan_gradient_in_bf16_mixed_is_skipped_and_counted(tmp_path):
    model = AdamRegressor(fault="nan", fault_step=4, fault_steps=2, sleep_s=0.0)
    recorder = nan_fit(tmp_path, model, [SwitchablePrecision("bf16-mixed")])
    plugin = model.trainer.precision_plugin
    assert plugin.skipped_steps == 2 and recorder.calls == 8 and adam_step_counts(model) == {8}
    assert recorder.consecutive == [0, 0, 0, 0, 1, 2, 0, 0, 0, 0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


class FusedAdamRegressor(FaultyRegressor):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02, fused=True)


@pytest.mark.parametrize("model_class", [AdamRegressor, FusedAdamRegressor], ids=["adam", "fused-adam"])
def test_gradient_scaler_skips_are_detected_and_counted(tmp_path, model_class):
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

    torch.manual_seed(0)
    model = model_class(fault="nan", fault_step=4, fault_steps=2, sleep_s=0.0)
    recorder = nan_fit(tmp_path, model, [SwitchablePrecision("16-mixed")])
    plugin = model.trainer.precision_plugin
    fused = _optimizer_handles_unscaling(model.trainer.optimizers[0])
    assert fused is (model_class is FusedAdamRegressor)  # fused Adam unscales (and skips) inside its step
    # the ground truth: the batches after which Adam's step counter did not advance (the initial scale of
    # 65536 may overflow float16 in the first steps too: real scaler skips, counted as well)
    skipped = [i for i, n in enumerate(recorder.adam_steps) if n == ([0, *recorder.adam_steps][i])]
    assert {4, 5} <= set(skipped) and len(skipped) < 6
    assert plugin.skipped_steps == len(skipped)
    assert recorder.consecutive == skip_runs(skipped)
    assert plugin.scaler.get_scale() == 65536.0 / 2 ** len(skipped)  # backed off once per skipped step
    # a fused step runs (and skips inside) every time, so only the scale can tell a skip apart
    assert recorder.calls == (10 if fused else 10 - len(skipped))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_consecutive_skips_restart_when_the_mode_changes(tmp_path):
    model = AdamRegressor(fault="nan", fault_step=2, sleep_s=0.0)  # every autocast step from step 2 is NaN
    recorder = nan_fit(tmp_path, model, [SwitchablePrecision("bf16-mixed")], switch_at=(4, "16-mixed-noscale"))
    plugin = model.trainer.precision_plugin
    assert plugin.mode_name == "16-mixed-noscale" and plugin.skipped_steps == 8
    assert recorder.consecutive == [0, 0, 1, 2, 3, 1, 2, 3, 4, 5]  # back to 0 at the switch after batch 4


# ---------------------------------------------------------------------------------------------- profile, pick
@pytest.mark.parametrize("watts, expected", [
    ({"32-true": 300.0, "bf16-mixed": 10.0, "16-mixed": 120.0}, "bf16-mixed"),
    ({"32-true": 300.0, "bf16-mixed": 200.0, "16-mixed": 5.0}, "16-mixed"),
])
def test_profile_then_pick_follows_the_simulated_cost_model(tmp_path, watts, expected, capsys, clock):
    costs = SimulatedModeCosts(clock, watts, noise=0.1)  # 10 % step-time noise: far below the power gaps
    callback = switch(costs.counter, candidates=["32-true", "bf16-mixed", "16-mixed"], tolerance=0.5, warmup_steps=1,
                      profile_steps=4, verbose=True)
    trainer = fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback, costs], max_epochs=2)
    profiles = callback.profiles
    assert list(profiles) == ["32-true", "bf16-mixed", "16-mixed"]
    profiled = {name: [s for m, s in costs.steps if m == name] for name in profiles}
    for name, row in profiles.items():
        assert row["steps"] == 4
        seconds = profiled[name][1:5]  # after the warm-up step
        assert row["step_s"] == pytest.approx(statistics.fmean(seconds), rel=1e-9)
        assert row["step_s_se"] == pytest.approx(statistics.stdev(seconds) / 2, rel=1e-6)
        assert row["power_W"] == pytest.approx(watts[name], rel=1e-9)  # the windows see only their own mode
        assert row["step_J"] == pytest.approx(watts[name] * row["step_s"], rel=1e-9)
    assert callback.chosen == expected == min(profiles, key=lambda n: profiles[n]["step_J"])
    assert callback.profile_rounds == 1  # beyond noise at once
    assert trainer.precision_plugin.mode_name == expected
    assert profiles[expected]["status"] == "chosen" and profiles["32-true"]["loss_gap"] is None
    assert 0 < profiles["bf16-mixed"]["loss_gap"] < 0.5
    report = json.loads(callback.report_path.read_text())
    assert callback.report_path == Path(trainer.log_dir) / "precision_report.json"
    rows = {row["mode"]: row for row in report["modes"]}
    assert rows[expected]["status"] == "chosen" and report["chosen"] == expected
    assert rows["32-true"]["trained_steps"] == 1 + 4
    assert sum(row["trained_steps"] for row in rows.values()) == trainer.global_step
    assert rows[expected]["trained_J"] > 0 and report["energy_estimated"] is False
    assert report["confidence"] == 0.95 and report["profile_rounds"] == 1
    assert [e["reason"].split(" ")[0] for e in report["switches"]][:2] == ["profiling", "profiling"]
    printed = capsys.readouterr().out
    assert f"chosen {expected}" in printed and "loss gap" in printed and " +- " in printed


def test_tolerance_rejects_a_cheap_mode_whose_loss_differs(tmp_path, clock):
    sensor, follow = cost_model(clock, "bf16-mixed")
    callback = switch(sensor, candidates=["32-true", "bf16-mixed"], tolerance=1e-7)
    fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback, follow], max_epochs=1)
    assert callback.chosen == "32-true"
    assert callback.profiles["bf16-mixed"]["status"].startswith("rejected: loss gap")
    assert callback.profiles["bf16-mixed"]["step_J"] < callback.profiles["32-true"]["step_J"]


def test_pick_mode_uses_the_objective_and_prefers_safer_on_ties():
    def row(step_J, step_s, gap=0.0):
        return {"step_J": step_J, "step_s": step_s, "loss_gap": gap, "failure": None, "nonfinite_losses": 0,
                "status": ""}

    profiles = {"32-true": row(4.0, 1.0, None), "bf16-mixed": row(2.0, 3.0), "16-mixed": row(3.0, 1.0, 0.05)}
    assert pick_mode(profiles, 0.1, "energy")[0] == "bf16-mixed"
    assert pick_mode(profiles, 0.1, "time")[0] == "32-true"  # a tie with 16-mixed: the safer mode wins
    assert pick_mode(profiles, 0.1, "edp")[0] == "16-mixed"
    assert pick_mode(profiles, 0.01, "edp")[0] == "32-true"  # 16-mixed's gap 0.05 is beyond tolerance
    assert profiles["16-mixed"]["status"].startswith("rejected: loss gap")
    tie = {"32-true": row(1.0, 1.0, None), "bf16-mixed": row(1.0, 1.0)}
    assert pick_mode(tie, 0.1, "energy")[0] == "32-true"


def test_settle_mode_needs_a_difference_beyond_the_noise():
    def row(step_J, se, steps=20):
        return {"step_J": step_J, "step_J_se": se, "step_s": 1.0, "step_s_se": 0.0, "steps": steps,
                "loss_gap": 0.0, "failure": None, "nonfinite_losses": 0, "status": ""}

    t19 = 2.093  # Student-t, 95 % two-sided, 19 degrees of freedom
    bound = t19 * math.hypot(0.1, 0.1)
    near = {"32-true": row(10.0, 0.1), "bf16-mixed": row(10.0 - 0.9 * bound, 0.1)}
    first = settle_mode(near, 0.1, "energy", final=False)
    assert first["chosen"] is None and first["contenders"] == ["32-true", "bf16-mixed"]
    last = settle_mode(near, 0.1, "energy", final=True)
    assert last["chosen"] == "32-true" and "no mode cheaper than 32-true beyond noise" in last["reason"]
    far = {"32-true": row(10.0, 0.1), "bf16-mixed": row(10.0 - 1.1 * bound, 0.1)}
    assert settle_mode(far, 0.1, "energy", final=False)["chosen"] == "bf16-mixed"
    pending = settle_mode(far, 0.1, "energy", final=False, rounds=1, min_rounds=2)  # a pair of rounds first
    assert pending["chosen"] is None and pending["contenders"] == ["32-true", "bf16-mixed"]
    assert settle_mode(far, 0.1, "energy", final=False, rounds=2, min_rounds=2)["chosen"] == "bf16-mixed"
    # two reduced modes cheaper beyond noise but within noise of each other: the safer one
    tied = {"32-true": row(10.0, 0.1), "bf16-mixed": row(8.0, 0.1), "16-mixed": row(7.9, 0.1)}
    assert settle_mode(tied, 0.1, "energy")["chosen"] == "bf16-mixed"
    unknown = {"32-true": row(10.0, None, 1), "bf16-mixed": row(1.0, None, 1)}  # one step: no spread known
    assert settle_mode(unknown, 0.1, "energy", final=True)["chosen"] == "32-true"
    # steps that agree within each round, round means that do not (a machine whose load changed): the
    # rounds' spread is the noise, with rounds - 1 degrees of freedom
    drifting = {"32-true": {**row(10.0, 0.01), "rounds": 2, "step_J_round_se": 1.0},
                "bf16-mixed": {**row(8.0, 0.01), "rounds": 2, "step_J_round_se": 1.0}}
    assert settle_mode(drifting, 0.1, "energy", final=True)["chosen"] == "32-true"
    for mode_row in drifting.values():
        mode_row["step_J_round_se"] = 0.005  # below the steps' own: the steps' bound applies
    assert settle_mode(drifting, 0.1, "energy", final=True)["chosen"] == "bf16-mixed"


# ---------------------------------------------------------------------------------------------- guard
@pytest.mark.parametrize("fault", ["nan", "inf"])
def test_guard_falls_back_to_the_next_safer_mode_on_nan_or_inf(tmp_path, fault, clock):
    sensor, follow = cost_model(clock, "16-mixed-noscale")
    model = FaultyRegressor(fault=fault, fault_step=17, fault_steps=1, sleep_s=0.0)
    callback = switch(sensor, candidates=["32-true", "bf16-mixed", "16-mixed-noscale"], tolerance=0.5)
    trainer = fit(tmp_path, model, [callback, follow], max_epochs=3)
    assert callback.chosen == "16-mixed-noscale"
    fallback = callback.switches[-1]
    assert (fallback["from"], fallback["to"], fallback["step"]) == ("16-mixed-noscale", "bf16-mixed", 18)
    assert fallback["reason"] == "fallback: non-finite gradients (optimizer step skipped)"
    assert trainer.precision_plugin.mode_name == "bf16-mixed"
    assert trainer.precision_plugin.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the NaN step never reached the weights
    finite = [v for v in model.losses if math.isfinite(v)]
    assert len(finite) == len(model.losses) - 1 and finite[-1] < 0.5 * finite[0]
    assert callback.report["modes"][-1]["status"].startswith("fell back at step 18")


def test_nan_while_profiling_rejects_the_candidate(tmp_path, clock):
    sensor, follow = cost_model(clock, "bf16-mixed")
    model = FaultyRegressor(fault="nan", sleep_s=0.0)  # bf16 always NaN
    callback = switch(sensor, candidates=["32-true", "bf16-mixed"], tolerance=0.5)
    trainer = fit(tmp_path, model, [callback, follow], max_epochs=1)
    assert callback.chosen == "32-true" and trainer.precision_plugin.mode_name == "32-true"
    status = callback.profiles["bf16-mixed"]["status"]
    assert status == "rejected: non-finite gradients (optimizer step skipped)"
    assert callback.profiles["bf16-mixed"]["steps"] == 0  # abandoned at its first (warm-up) step
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_guard_falls_back_on_loss_drift(tmp_path, clock):
    sensor, follow = cost_model(clock, "bf16-mixed")
    model = FaultyRegressor(fault="drift", fault_step=12, sleep_s=0.0)  # bf16's loss 10 % off from step 12
    callback = switch(sensor, candidates=["32-true", "bf16-mixed"], tolerance=0.02, drift_patience=2)
    trainer = L.Trainer(callbacks=[callback, follow], logger=CSVLogger(str(tmp_path), name="csv"),
                        **{**trainer_kwargs(tmp_path, max_epochs=3), "log_every_n_steps": 1})
    trainer.fit(model, tiny_loader(), tiny_loader(n=32))
    assert callback.chosen == "bf16-mixed"
    fallback = callback.switches[-1]
    assert (fallback["from"], fallback["to"]) == ("bf16-mixed", "32-true")
    assert fallback["reason"].startswith("fallback: loss gap 0.")
    assert "> tolerance 0.02 at 2 checks in a row" in fallback["reason"]
    gaps = [c["loss_gap"] for c in callback.checks if c["loss_gap"] is not None]
    assert all(0.05 < gap < 0.15 for gap in gaps[-2:])  # 10 % drift (plus bf16's own error); fallback at the 2nd
    assert callback.checks[-1]["step"] - callback.checks[-2]["step"] == 2
    assert trainer.precision_plugin.mode_name == "32-true"
    # logged: the mode as a number on every step, the switch count, the gap and the profiled figures
    with open(Path(trainer.log_dir) / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    modes = [float(r["precision/mode"]) for r in rows if r.get("precision/mode")]
    assert modes[0] == MODES["32-true"].code and modes[-1] == MODES["32-true"].code
    assert MODES["bf16-mixed"].code in modes
    assert [r["precision/loss_gap"] for r in rows if r.get("precision/loss_gap")]
    for name in ("32-true", "bf16-mixed"):
        assert [r for r in rows if r.get(f"precision/{name}/step_J")], name
    assert max(float(r["precision/switches"]) for r in rows if r.get("precision/switches")) == len(callback.switches)


def test_guard_falls_back_on_an_exploding_loss(tmp_path, clock):
    sensor, follow = cost_model(clock, "bf16-mixed")
    model = FaultyRegressor(fault="offset", fault_step=14, sleep_s=0.0)  # +100 on the loss, same gradients
    callback = switch(sensor, candidates=["32-true", "bf16-mixed"], tolerance=0.5, probe=False)
    fit(tmp_path, model, [callback, follow], max_epochs=3)
    fallback = callback.switches[-1]
    assert (fallback["from"], fallback["to"]) == ("bf16-mixed", "32-true")
    assert fallback["reason"].startswith("fallback: exploding loss: window mean")
    assert callback.profiles["bf16-mixed"]["loss_gap"] is None  # probe off: no gap measured


def test_fixed_mode_never_switches_but_measures_the_gap(tmp_path):
    model = FaultyRegressor(fault="drift", sleep_s=0.0)
    callback = switch(mode="bf16-mixed", tolerance=0.02)
    trainer = fit(tmp_path, model, [callback], max_epochs=2)
    assert callback.switches == [] and trainer.precision_plugin.mode_name == "bf16-mixed"
    gaps = [c["loss_gap"] for c in callback.checks]
    assert len(gaps) == 10 and all(0.05 < gap < 0.15 for gap in gaps)  # beyond tolerance, yet no switch
    report = callback.report
    assert report["fixed_mode"] == "bf16-mixed" and report["modes"][0]["trained_steps"] == 20


def test_tensorboard_gets_a_text_entry_per_switch(tmp_path, clock):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sensor, follow = cost_model(clock, "bf16-mixed")
    callback = switch(sensor, candidates=["32-true", "bf16-mixed"])
    trainer = fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback, follow], max_epochs=1,
                  logger=TensorBoardLogger(str(tmp_path), name="tb"))
    acc = EventAccumulator(trainer.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("precision/mode/text_summary")]
    assert texts == ["step 0: starts in 32-true (profiling 1/2)", "step 5: 32-true -> bf16-mixed (profiling 2/2)"]
    assert {e.value for e in acc.Scalars("precision/mode")} == {1.0, 3.0}
    assert "precision/bf16-mixed/loss_gap" in acc.Tags()["scalars"]
    assert trainer.logger.hparams["precision/start_mode"] == "32-true"
    assert trainer.logger.hparams["precision/mode_legend"] == MODE_LEGEND


def test_every_logger_gets_the_starting_mode_and_the_legend(tmp_path):
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = [CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")]
    trainer = fit(tmp_path, FaultyRegressor(sleep_s=0.0), [switch(mode="bf16-mixed")], max_epochs=1,
                  logger=loggers)
    hparams = yaml.safe_load((Path(loggers[0].log_dir) / "hparams.yaml").read_text())
    assert hparams["precision/start_mode"] == "bf16-mixed" and hparams["precision/mode_legend"] == MODE_LEGEND
    assert "3 = bf16-mixed" in MODE_LEGEND  # decodes the numeric precision/mode of the CSV
    with open(Path(loggers[0].log_dir) / "metrics.csv", newline="") as fh:
        assert {float(r["precision/mode"]) for r in csv.DictReader(fh) if r.get("precision/mode")} == {3.0}
    acc = EventAccumulator(loggers[1].log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("precision/mode/text_summary")]
    assert texts == ["step 0: starts in bf16-mixed (fixed mode)"]
    assert trainer.precision_plugin.mode_name == "bf16-mixed"


def test_nan_losses_in_the_reference_mode_are_reported_without_falling_back(tmp_path, clock):
    sensor, follow = cost_model(clock, "32-true")  # 32-true is the cheapest: it is chosen and then guarded
    # from step 12 (after profiling 2 x 5 steps) the loss is NaN in every mode, float32 included
    model = FaultyRegressor(fault="nan", fault_step=12, any_mode=True, sleep_s=0.0)
    callback = switch(sensor, candidates=["32-true", "bf16-mixed"])
    with pytest.warns(UserWarning, match="non-finite training losses") as caught:
        trainer = fit(tmp_path, model, [callback, follow], max_epochs=2)
    warned = [str(w.message) for w in caught if "non-finite training losses" in str(w.message)]
    assert len(warned) == 1  # once, though every later check sees NaN losses
    assert "in '32-true', which is not a reduced precision: there is no safer mode" in warned[0]
    assert callback.chosen == "32-true" and trainer.precision_plugin.mode_name == "32-true"
    assert [e["reason"] for e in callback.switches] == ["profiling 2/2", callback.decision]  # no fallback
    assert trainer.precision_plugin.skipped_steps == 0  # 32-true steps as Lightning does: nothing skipped
    nonfinite = sum(1 for v in model.losses if not math.isfinite(v))
    assert nonfinite == 20 - 12 and callback.nonfinite_losses == nonfinite  # every step from 12 on
    assert [c["nonfinite_losses"] for c in callback.checks] == [0, 2, 2, 2, 2]  # a check every 2 steps from 10
    assert callback.report["nonfinite_losses"] == nonfinite
    with open(Path(trainer.log_dir) / "metrics.csv", newline="") as fh:
        key = "precision/nonfinite_losses"
        logged = [float(r[key]) for r in csv.DictReader(fh) if r.get(key)]
    assert logged[-1] == nonfinite


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_resume_after_profiling_keeps_the_choice(tmp_path, clock):
    ckpt_dir = tmp_path / "ckpt"
    sensor, follow = cost_model(clock, "bf16-mixed")
    first = switch(sensor, candidates=["32-true", "bf16-mixed"])
    fit(tmp_path, FaultyRegressor(sleep_s=0.0), [first, follow, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
        max_epochs=1, enable_checkpointing=True)
    assert first.phase == "guarding" and len(first.switches) == 1

    sensor, follow = cost_model(clock, "32-true")  # a different cost now: no new profiling may happen
    second = switch(sensor, candidates=["32-true", "bf16-mixed"])
    seen = []

    class Modes(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.precision_plugin.mode_name)

    trainer = fit(tmp_path, FaultyRegressor(sleep_s=0.0),
                  [second, follow, Modes(), ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], max_epochs=2,
                  enable_checkpointing=True, ckpt_path=ckpt_dir / "last.ckpt")
    assert set(seen) == {"bf16-mixed"} and len(seen) == 10
    assert second.chosen == "bf16-mixed" and second.switches == first.switches
    assert trainer.precision_plugin.mode_name == "bf16-mixed"


# ---------------------------------------------------------------------------------------------- probe
class Noisy(L.LightningModule):
    """Dropout, BatchNorm and a torchmetrics metric: every side effect the probe must undo."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
        self.mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.mse(out, y)
        loss = nn.functional.mse_loss(out, y)
        self.log("train/loss", loss)
        return {"loss": loss}


def test_the_probe_replays_the_step_without_side_effects():
    torch.manual_seed(0)
    module = Noisy().train()
    batch = (torch.randn(32, 8), torch.randn(32, 1))
    fake_trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    plugin = SwitchablePrecision("bf16-mixed", device_type="cpu")
    buffers = [b.clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    reference = reference_loss(fake_trainer, module, plugin, batch, 0)
    assert all(torch.equal(a, b) for a, b in zip(buffers, module.buffers()))
    assert torch.equal(torch.get_rng_state(), rng)
    assert module.mse.update_count == 0 and float(module.mse.total) == 0
    with _silenced_logging(module):
        real = module.training_step(batch, 0)["loss"]  # the same dropout masks, in float32
    assert torch.equal(real, reference)
    assert module.mse.update_count == 1
    assert not torch.equal(buffers[0], module.net[1].running_mean)  # the real step updates BatchNorm once


# ---------------------------------------------------------------------------------------------- errors, config
def test_the_plugin_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        SwitchablePrecision("fp8")


def test_environment_problems_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="PrecisionSwitch sets the precision itself.*precision='bf16-mixed'"):
        fit(tmp_path, FaultyRegressor(), [switch()], precision="bf16-mixed")
    with pytest.raises(ValueError, match="mode='tf32'.* cannot run on 'cpu': TF32 is a CUDA feature"):
        fit(tmp_path, FaultyRegressor(), [switch(mode="tf32")])
    with pytest.raises(ValueError, match="keeps parameters in torch.float32.*torch.float64.*'64-true'"):
        fit(tmp_path, FaultyRegressor().double(), [switch()])
    assert not get_sampler().running  # the failed fits released the shared sampler


def test_a_cuda_only_candidate_is_dropped_on_cpu_with_a_warning(tmp_path, clock):
    sensor, follow = cost_model(clock, "bf16-mixed")
    callback = switch(sensor, candidates=["32-true", "tf32", "bf16-mixed"])
    with pytest.warns(UserWarning, match="candidate 'tf32' dropped: TF32 is a CUDA feature"):
        fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback, follow], max_epochs=1)
    assert callback.plan == ["32-true", "bf16-mixed"] and callback.chosen == "bf16-mixed"
    assert {r["mode"]: r["status"] for r in callback.report["modes"]}["tf32"].startswith("unavailable")


def test_lightning_cli_config_fits_and_logs_the_profiled_modes(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule

    config = HERE.parent / "configs" / "precision_switch.yaml"
    watts = {"32-true": 300.0, "bf16-mixed": 10.0, "16-mixed": 120.0}  # the shipped candidates
    sensors = [{"class_path": "precision_helpers.ModePowerSensor", "init_args": {"watts_by_mode": watts}}]
    monkeypatch.setattr("sys.argv", ["lightning-cli"])
    cli = LightningCLI(
        SleepyBoringModel, BoringDataModule, run=False, save_config_kwargs={"overwrite": True},
        args=["--config", str(config), "--seed_everything=1", "--trainer.max_epochs=1",
              "--trainer.limit_train_batches=16", "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1",
              "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
              "--trainer.enable_model_summary=false",
              "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
              f"--trainer.default_root_dir={tmp_path}",
              # the YAML's PrecisionSwitch (the last callback), shortened, on a simulated cost model
              # two profiled steps a mode: one degree of freedom; at 50 % confidence the noise bound is one
              # standard error, far below the 30x gap of real-time steps that all sleep STEP_SLEEP_S
              "--trainer.callbacks.init_args.warmup_steps=1", "--trainer.callbacks.init_args.profile_steps=2",
              "--trainer.callbacks.init_args.confidence=0.5", "--trainer.callbacks.init_args.min_profile_rounds=1",
              "--trainer.callbacks.init_args.verbose=false",
              f"--trainer.callbacks.init_args.sensors={json.dumps(sensors)}",
              f"--trainer.callbacks.init_args.interval_s={SAMPLER_INTERVAL_S}",
              "--trainer.callbacks+=precision_helpers.FollowMode", "--trainer.callbacks.init_args.pause_s=0.05"],
    )
    from lightning_energy import EnergyCallback

    (energy,) = [c for c in cli.trainer.callbacks if isinstance(c, EnergyCallback)]
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, PrecisionSwitch)]
    (follow,) = [c for c in cli.trainer.callbacks if isinstance(c, FollowMode)]
    assert cli.trainer.callbacks.index(follow) > cli.trainer.callbacks.index(callback)
    assert callback.mode is None
    assert callback.candidates == ["32-true", "bf16-mixed", "16-mixed"]  # not 16-mixed-noscale (issue 30 item 6)
    assert callback.tolerance == 0.02 and callback.check_every_n_steps == 50 and callback.objective == "energy"
    energy.verbose = False
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    assert cli.trainer.global_step == 16 and list(callback.profiles) == list(watts)
    with open(Path(cli.trainer.log_dir) / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    logged = {key: float(r[key]) for r in rows for key in r if key.startswith("precision/") and r[key]}
    for name, power_W in watts.items():
        step_s = logged[f"precision/{name}/step_s"]
        assert logged[f"precision/{name}/power_W"] == pytest.approx(power_W, rel=1e-9)  # the cost model
        assert STEP_SLEEP_S <= step_s < STEP_SLEEP_S + 1.0  # every step sleeps STEP_SLEEP_S
        assert logged[f"precision/{name}/step_J"] == pytest.approx(power_W * step_s, rel=1e-9)
        assert step_s == pytest.approx(callback.profiles[name]["step_s"], rel=1e-6)
    assert callback.chosen == "bf16-mixed" == cli.trainer.precision_plugin.mode_name  # the cheapest in J/step
    # three modes, 32-true once more (the A/A pair of the noise floor), then the pick
    assert logged["precision/switches"] == 4.0 and logged["precision/mode"] == MODES["bf16-mixed"].code


# ---------------------------------------------------------------------------------------------- DDP, GPU
@pytest.mark.slow
def test_ddp_ranks_decide_and_fall_back_together(tmp_path, rank_zygote):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    run = rank_zygote.run(HERE / "precision_ddp_fit.py", [tmp_path], tmp_path / "ranks", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # rank 1 alone would pick 16-mixed (1 W); summed over ranks bf16-mixed is cheaper (10 + 100 < 1000 + 1)
    assert ranks[0]["chosen"] == ranks[1]["chosen"] == "bf16-mixed"
    assert ranks[0]["profiles"] == ranks[1]["profiles"]
    profiles = ranks[0]["profiles"]
    assert profiles["bf16-mixed"]["step_J"] < profiles["16-mixed"]["step_J"]
    # a NaN on rank 1 only: both ranks fall back at the same step, to the same mode, for the same reason
    assert ranks[0]["switches"] == ranks[1]["switches"]
    fallback = ranks[0]["switches"][-1]
    assert (fallback["from"], fallback["to"]) == ("bf16-mixed", "32-true")
    assert fallback["reason"] == "fallback: non-finite gradients (optimizer step skipped)"
    assert ranks[0]["modes"] == ranks[1]["modes"]  # the mode of every step, on both ranks
    assert ranks[0]["finite_params"] and ranks[1]["finite_params"]
    (report_path,) = tmp_path.rglob("precision_report.json")
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 2 and report["chosen"] == "bf16-mixed" and report["final_mode"] == "32-true"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode, scaled", [("16-mixed", True), ("16-mixed-noscale", False)])
def test_gpu_fp16_with_and_without_gradient_scaling(tmp_path, mode, scaled):
    dtypes = set()

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with trainer.precision_plugin.forward_context():
                dtypes.add(pl_module(batch[0]).dtype)

    model = FaultyRegressor(sleep_s=0.0)
    callback = switch(mode=mode)
    trainer = fit(tmp_path, model, [callback, Record()], max_epochs=3, accelerator="gpu")
    plugin = trainer.precision_plugin
    assert dtypes == {torch.float16} and model.param_dtypes == {torch.float32}
    assert (plugin.scaler is not None) is scaled
    if scaled:
        assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.scaler.get_scale() > 0
    assert model.losses[-1] < 0.5 * model.losses[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_switching_through_every_mode(tmp_path):
    order = [m for m in ("32-true", "tf32", "bf16-mixed", "16-mixed", "16-mixed-noscale")
             if unavailable_reason(MODES[m], "cuda") is None]  # tf32 needs compute capability >= 8
    driver = DriveModes(order)
    model = AdamRegressor(sleep_s=0.0)
    matmul = torch.get_float32_matmul_precision()
    fit(tmp_path, model, [driver], plugins=[SwitchablePrecision()], max_epochs=4, accelerator="gpu", logger=False)
    assert set(driver.modes) == set(order) and model.param_dtypes == {torch.float32}
    assert sum(model.losses[-10:]) < 0.3 * sum(model.losses[:10])
    assert torch.get_float32_matmul_precision() == matmul  # the user's TF32 setting is restored


def test_energy_report_carries_the_precision_table(tmp_path):
    from lightning_energy import EnergyCallback, SimulatedSensor
    from lightning_energy.callbacks.precision import PrecisionSwitch as Switch

    energy = EnergyCallback(sensors=[SimulatedSensor("device", 90.0)], verbose=False)
    switch = Switch(mode="bf16-mixed", verbose=False)
    trainer = L.Trainer(callbacks=[energy, switch], **trainer_kwargs(tmp_path, max_epochs=1))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    section = energy.report["sections"]["precision"]
    assert section is switch.report  # built once, shared by both reports
    assert section["final_mode"] == "bf16-mixed"
    assert json.loads(energy.report_path.read_text())["sections"]["precision"]["final_mode"] == "bf16-mixed"


def test_a_full_disk_at_fit_end_never_fails_the_fit(tmp_path, monkeypatch, capsys):
    """precision_report.json meets a full disk: one warning, the fit completes, the report stays in memory."""
    import errno

    from lightning_energy import io

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(io, "atomic_write_text", full_disk)
    callback = switch(mode="bf16-mixed", verbose=True)
    with pytest.warns(UserWarning, match="precision_report.json not written") as record:
        trainer = fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback], max_epochs=1, logger=False)
    assert trainer.current_epoch == 1 and trainer.global_step == 10
    assert sum("precision_report.json" in str(w.message) for w in record) == 1
    assert callback.report_path is None and callback.report["modes"][0]["trained_steps"] == 10
    assert "report: not written" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- noise, sync, replay
def two_mode_switch(costs, **kwargs) -> PrecisionSwitch:
    kwargs = {"candidates": ["32-true", "bf16-mixed"], "tolerance": 0.5, "warmup_steps": 1, "profile_steps": 4,
              "check_every_n_steps": 0, "min_profile_rounds": 2, **kwargs}  # the default: rounds in pairs
    return switch(costs.counter, **kwargs)


@pytest.mark.parametrize("min_rounds, expected", [(1, "bf16-mixed"), (2, "32-true")])
def test_rounds_in_opposite_orders_cancel_a_drifting_machine(tmp_path, clock, min_rounds, expected):
    """The same arithmetic in both modes on a machine that gets 1 % faster every step (load fading): the mode
    profiled second looks cheaper, beyond the 2 % per-step noise. One round is fooled; a pair of rounds in
    opposite orders (32-true, bf16-mixed; bf16-mixed, 32-true) pools the drift away and keeps 32-true."""
    costs = SimulatedModeCosts(clock, {"32-true": 100.0, "bf16-mixed": 100.0}, noise=0.02, drift_per_step=-0.01)
    callback = two_mode_switch(costs, min_profile_rounds=min_rounds, max_profile_rounds=4)
    fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback, costs], max_epochs=5, logger=False)
    assert callback.chosen == expected
    if min_rounds == 1:
        assert callback.profile_rounds == 1  # fooled at once
    else:
        orders = [[m for m, _ in costs.steps[i * 10:(i + 1) * 10:5]] for i in range(2)]
        assert orders == [["32-true", "bf16-mixed"], ["bf16-mixed", "32-true"]]
        assert callback.decision.startswith(("profiled: no mode cheaper than 32-true beyond noise",
                                             "profiled: cheapest by energy"))


@pytest.mark.parametrize("seed", range(5))
def test_modes_at_parity_keep_the_reference_whatever_the_noise(tmp_path, clock, seed):
    """The same power and step-time distribution in both modes (10 % step-time noise): the means of a few
    steps differ by chance, sometimes in bf16-mixed's favour; only a difference beyond the noise may pick it."""
    costs = SimulatedModeCosts(clock, {"32-true": 100.0, "bf16-mixed": 100.0}, noise=0.1, seed=seed)
    callback = two_mode_switch(costs, max_profile_rounds=3)
    fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback, costs], max_epochs=4, logger=False)
    assert callback.chosen == "32-true"
    profiles = callback.profiles
    assert all(row["steps"] == callback.profile_rounds * 4 for row in profiles.values())
    if profiles["bf16-mixed"]["step_J"] < profiles["32-true"]["step_J"]:  # by chance: within noise, to the budget
        assert callback.profile_rounds == 3
        assert callback.decision.startswith("profiled: no mode cheaper than 32-true beyond noise")
    else:  # the reference leads: no need to profile further
        assert callback.decision.startswith("profiled: cheapest by energy")


def test_at_parity_a_mean_of_a_few_steps_favours_bf16_by_chance():
    """The seeds above are no cherry-pick: in some, bf16-mixed's first-round mean is the lower one (what a
    pick by means alone would have chosen)."""
    import random

    def first_round_means(seed):
        rng = random.Random(seed)
        draws = [max(-3.0, min(3.0, rng.gauss(0.0, 1.0))) for _ in range(10)]  # steps 0-4 32-true, 5-9 bf16
        return statistics.fmean(draws[1:5]), statistics.fmean(draws[6:10])

    assert any(bf16 < ref for ref, bf16 in map(first_round_means, range(5)))
    assert any(bf16 > ref for ref, bf16 in map(first_round_means, range(5)))


def test_a_small_real_difference_is_settled_by_more_rounds(tmp_path, clock):
    """bf16-mixed draws 20 % less with 20 % step-time noise: one round of 4 steps cannot tell, more can (the
    bound then follows the spread of the round means, with rounds - 1 degrees of freedom)."""
    costs = SimulatedModeCosts(clock, {"32-true": 100.0, "bf16-mixed": 80.0}, noise=0.2, seed=0)
    callback = two_mode_switch(costs, max_profile_rounds=12)
    fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback, costs], max_epochs=13, logger=False)
    assert callback.chosen == "bf16-mixed" and 1 < callback.profile_rounds < 12
    assert callback.decision.startswith("profiled: cheaper than 32-true beyond noise")
    ref, bf16 = callback.profiles["32-true"], callback.profiles["bf16-mixed"]
    assert ref["step_J"] - bf16["step_J"] > 2 * math.hypot(ref["step_J_se"], bf16["step_J_se"])


def test_every_mode_is_profiled_under_the_same_synchronisation(tmp_path, clock, monkeypatch):
    """The reduced modes' per-step gradient check (a pass over the gradients and a host-device sync) costs
    SYNC_S here; while profiling 32-true pays it too (and never skips), so modes whose arithmetic costs the
    same profile the same. Once profiling is over 32-true steps as Lightning's own plugin again."""
    import lightning_energy.integration.precision_plugin as precision_module

    sync_s = 0.004
    costs = SimulatedModeCosts(clock, {"32-true": 100.0, "bf16-mixed": 100.0})  # no noise: equal arithmetic
    checks: list[tuple[int, str]] = []
    original = precision_module.gradients_finite

    def timed_check(optimizer):
        plugin = trainer_ref[0].precision_plugin
        checks.append((trainer_ref[0].global_step, plugin.mode_name))
        costs.run(plugin.mode_name, sync_s)
        return original(optimizer)

    monkeypatch.setattr(precision_module, "gradients_finite", timed_check)
    callback = two_mode_switch(costs, objective="time", max_profile_rounds=1)
    trainer_ref = []

    class Keep(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            trainer_ref.append(trainer)

    fit(tmp_path, FaultyRegressor(sleep_s=0.0), [Keep(), callback, costs], max_epochs=2, logger=False)
    ref, bf16 = callback.profiles["32-true"], callback.profiles["bf16-mixed"]
    assert ref["step_s"] == pytest.approx(STEP_SLEEP_S + sync_s, rel=1e-9)
    assert bf16["step_s"] == pytest.approx(ref["step_s"], rel=1e-9)  # the same regime: the same figures
    checked = {mode: sorted({step for step, m in checks if m == mode}) for mode in ("32-true", "bf16-mixed")}
    assert checked["32-true"] == list(range(0, 5))  # every profiling step (warm-up included) ...
    assert checked["bf16-mixed"] == list(range(5, 10))
    assert callback.chosen == "32-true"  # a tie: the reference; after profiling it checks no more
    assert all(step < 10 for step, _ in checks) and trainer_ref[0].precision_plugin.check_reference_steps is False


def test_the_guard_replays_several_batches_per_check(tmp_path, clock):
    """bf16-mixed drifts 10 % from step 10 on, except on every 4th batch, which is the one just before each
    check: a gap over that batch alone sees no drift; over the last four batches it does."""
    sensor, costs = cost_model(clock, "bf16-mixed")
    model = FaultyRegressor(fault="drift", fault_step=10, sleep_s=0.0, clean_every=4, clean_phase=1)
    callback = switch(sensor, candidates=["32-true", "bf16-mixed"], tolerance=0.05, check_every_n_steps=4,
                      probe_batches=4, drift_patience=2)
    fit(tmp_path, model, [callback, costs], max_epochs=3, logger=False)
    assert callback.chosen == "bf16-mixed" and callback.switches[0]["step"] == 5  # profiling: steps 0-9
    assert [c["step"] for c in callback.checks][:2] == [14, 18]  # the checks follow steps 13 and 17 (clean ones)
    assert all(0.05 < c["loss_gap"] < 0.1 for c in callback.checks[:2])  # 3 of 4 batches 10 % off
    assert len(callback.switches) == 2
    fallback = callback.switches[-1]
    assert (fallback["from"], fallback["to"], fallback["step"]) == ("bf16-mixed", "32-true", 18)
    assert "at 2 checks in a row" in fallback["reason"]
    assert callback.report["probe"]["steps"] == 5 + 2 * 4  # bf16-mixed's profile, then 4 per check


# ---------------------------------------------------------------------------------------------- the A/A noise floor
def profile_on_a_wandering_machine(seed: int, noise_floor: bool, bf16_watts: float = 100.0,
                                   max_rounds: int = 3) -> tuple[str, int, dict]:
    """Profiling rounds as the callback runs them (``round_order``, every other round reversed, ``settle_mode``
    after each, 1 warm-up + 4 profiled steps a window) on fake time: a machine whose speed wanders slowly
    (log step time an AR(1) process, 15 % spread, correlation 0.97 per step: a shared VM's load) plus 2 %
    per-step noise. 32-true draws 100 W; returns (chosen, rounds, profiles)."""
    import random

    from lightning_energy.callbacks.precision import merge_profiles, round_order

    rng = random.Random(seed)
    plan, watts = ["32-true", "bf16-mixed"], {"32-true": 100.0, "bf16-mixed": bf16_watts}
    local: dict = {}
    step, speed = 0, 0.15 * rng.gauss(0.0, 1.0)
    order = round_order(plan, noise_floor)
    for profile_round in range(max_rounds):
        for window, mode in enumerate(order):
            part = local.setdefault(mode, {"per_step": [], "stats": [0.0] * 6, "failure": None})
            for k in range(1 + 4):
                speed = 0.97 * speed + math.sqrt(1 - 0.97**2) * 0.15 * rng.gauss(0.0, 1.0)
                seconds = 0.01 * math.exp(speed) * (1 + 0.02 * max(-3.0, min(3.0, rng.gauss(0.0, 1.0))))
                if k >= 1:
                    part["per_step"].append([step, watts[mode] * seconds, seconds, profile_round, window])
                step += 1
        profiles = merge_profiles([local], plan)
        decision = settle_mode(profiles, 0.5, "energy", 0.95, profile_round + 1 >= max_rounds, profile_round + 1, 2)
        if decision["chosen"] is not None:
            return decision["chosen"], profile_round + 1, profiles
        order = round_order([m for m in plan if m in decision["contenders"]], noise_floor)
        if (profile_round + 1) % 2:
            order.reverse()
    raise AssertionError("the last round must decide")


def test_the_aa_noise_floor_stops_false_picks_on_a_wandering_machine():
    """The same cost in both modes on a machine whose speed wanders: in rounds AB, BA the candidate sits in
    the middle of the pair of rounds and the reference at its ends, so a slow bump in speed gives the
    candidate a steady lead that neither the per-step spread nor the two round means show (the rule of one
    reference window a round picks bf16-mixed in some of 300 seeded fits). With the reference profiled again
    at the end of every round, the A/A pairs measure that noise: no false pick in the 300."""
    old = [profile_on_a_wandering_machine(seed, noise_floor=False)[0] for seed in range(300)]
    new = [profile_on_a_wandering_machine(seed, noise_floor=True)[0] for seed in range(300)]
    assert old.count("bf16-mixed") >= 3
    assert new.count("bf16-mixed") == 0


def test_the_aa_noise_floor_still_finds_a_real_difference():
    """bf16-mixed draws 30 % less on the same wandering machine: the rule with the noise floor finds it about
    as often as the rule without (both within 3 rounds), and its floor is the A/A pairs' spread."""
    old = [profile_on_a_wandering_machine(seed, False, bf16_watts=70.0)[0] for seed in range(100)]
    runs = [profile_on_a_wandering_machine(seed, True, bf16_watts=70.0) for seed in range(100)]
    new = [chosen for chosen, _, _ in runs]
    assert new.count("bf16-mixed") >= 70 and new.count("bf16-mixed") >= old.count("bf16-mixed") - 5
    chosen, rounds, profiles = runs[0]
    reference = profiles["32-true"]
    assert reference["aa_pairs"] == rounds and reference["windows"] == 2 * rounds
    assert profiles["bf16-mixed"]["aa_pairs"] == 0 and profiles["bf16-mixed"]["windows"] == rounds
    assert 0 < reference["window_J_rel_sd"] < 0.5


def test_with_the_noise_floor_a_round_is_reference_candidates_reference(tmp_path, clock):
    """The callback's rounds: 32-true, bf16-mixed, 32-true, then (reversed) the same; the report's reference
    row counts its A/A pairs, and a 10x cheaper bf16-mixed is still chosen."""
    costs = SimulatedModeCosts(clock, {"32-true": 100.0, "bf16-mixed": 10.0}, noise=0.02)
    callback = two_mode_switch(costs, noise_floor=True, max_profile_rounds=4)
    fit(tmp_path, FaultyRegressor(sleep_s=0.0), [callback, costs], max_epochs=4, logger=False)
    windows = [costs.steps[i][0] for i in range(0, 30, 5)]
    assert windows == ["32-true", "bf16-mixed", "32-true", "32-true", "bf16-mixed", "32-true"]
    assert callback.chosen == "bf16-mixed" and callback.profile_rounds == 2
    assert callback.profiles["32-true"]["aa_pairs"] == 2 and callback.profiles["32-true"]["steps"] == 16


def test_switch_messages_go_to_the_precision_modules_logger_not_stdout(tmp_path, capsys, caplog, clock):
    """A switch and the report's path are library messages: INFO records of ``lightning_energy.callbacks.precision``
    (a user silences them by name), never printed."""
    import logging

    sensor, follow = cost_model(clock, "bf16-mixed")
    callback = switch(sensor, candidates=["32-true", "bf16-mixed"])
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        fit(tmp_path, TinyRegressor(), [callback, follow], max_epochs=2)
    ours = [r.getMessage() for r in caplog.records if r.name == "lightning_energy.callbacks.precision"]
    assert any("-> bf16-mixed" in m for m in ours) and any("report written to" in m for m in ours)
    assert "PrecisionSwitch" not in capsys.readouterr().out
