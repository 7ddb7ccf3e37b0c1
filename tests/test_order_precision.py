"""Callback order: PrecisionSwitch beside an EnergyCallback, in either order of ``Trainer(callbacks=[...])``.

The switch's full-precision probe (a replay of ``training_step``) runs inside the step as the timeline's
named sub-window ``precision_probe``: no step figure of any reader contains it (before, with the
docstring's ``[EnergyCallback(), PrecisionSwitch()]``, ``time/step_s`` held the probe on every probed
step), the EnergyCallback logs it apart, and the switch builds its per-mode profiles from the same step
figures, so both orders give the same step series, the same profiles and the same choice.

Fake time (``install_fake_time``): each training step moves the clock by its mode's step time and each
probe by PROBE_S, so every figure is exact and the two orders are compared exactly. One real-time fit
(steps that sleep 20 ms, probes that sleep 0.25 s, a simulated per-mode power) checks the same where only
bounds far from any jitter are asserted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import lightning as L
import pytest
import torch

from conftest import RecordingLogger, TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.callbacks.precision import PrecisionSwitch
from lightning_energy.optimize.precision.probe import replaying
from power_limit_helpers import install_fake_time
from precision_helpers import SAMPLER_INTERVAL_S, FollowMode, ModePowerSensor

ORDERS = ("energy_first", "switch_first")
DEVICE_W, OTHER_W = 120.0, 50.0  # the switch reads the device sensor; the EnergyCallback both
STEP_S = {"32-true": 0.040, "bf16-mixed": 0.010}  # fake seconds per training step: bf16 is 4x cheaper
PROBE_S = 0.5  # fake seconds per probe: far longer than any step, so a step holding one cannot hide
PROBE = "precision_probe"


class Modes(L.Callback):
    """The mode each optimizer step runs in (its first batch), by Lightning's step number."""

    def __init__(self) -> None:
        self.by_step: dict[int, str] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.by_step.setdefault(trainer.fit_loop.epoch_loop._batches_that_stepped, trainer.precision_plugin.mode_name)


class TimedSteps(TinyRegressor):
    """Each training step moves the fake clock by its mode's step time (split over the batches of a step
    with gradient accumulation); the probe's replay (``replaying()``) moves it by PROBE_S."""

    def __init__(self, clock, batches_per_step: int = 1) -> None:
        super().__init__()
        self.clock, self.batches_per_step = clock, batches_per_step

    def training_step(self, batch, batch_idx):
        if not replaying():
            self.clock.advance(STEP_S[self.trainer.precision_plugin.mode_name] / self.batches_per_step)
        else:
            self.clock.advance(PROBE_S)
        return super().training_step(batch, batch_idx)


@dataclass
class Run:
    trainer: L.Trainer
    energy: EnergyCallback
    switch: PrecisionSwitch
    logger: RecordingLogger
    modes: Modes

    def series(self, key: str) -> dict[int, float]:
        return dict(zip(self.logger.steps(key), self.logger.values(key)))

    def logged(self, prefix: str) -> list[tuple[int, dict]]:
        return [(step, {k: v for k, v in m.items() if k.startswith(prefix)}) for step, m in self.logger.metrics
                if any(k.startswith(prefix) for k in m)]


def make_switch(**kwargs) -> PrecisionSwitch:
    kwargs = {"candidates": ["32-true", "bf16-mixed"], "tolerance": 0.5, "warmup_steps": 1, "profile_steps": 2,
              "check_every_n_steps": 3, "probe_batches": 2, "min_profile_rounds": 1, "noise_floor": False,
              "verbose": False,
              **kwargs}
    return PrecisionSwitch(**kwargs)


def fake_time_fits(tmp_path, monkeypatch, batches_per_step: int = 1, **overrides) -> dict[str, Run]:
    runs = {}
    for order in ORDERS:
        clock = install_fake_time(monkeypatch.setattr)
        device = SimulatedSensor("device", DEVICE_W, kind="energy", clock=clock)
        other = SimulatedSensor("other_device", OTHER_W, kind="energy", clock=clock)
        energy = EnergyCallback(sensors=[device, other], verbose=False, write_trace=False)
        switch = make_switch(sensors=[device])
        pair = [energy, switch] if order == "energy_first" else [switch, energy]
        logger, modes = RecordingLogger(tmp_path / order), Modes()
        trainer = L.Trainer(callbacks=[*pair, modes], logger=logger,
                            **trainer_kwargs(tmp_path / order, log_every_n_steps=1,
                                             accumulate_grad_batches=batches_per_step, **overrides))
        torch.manual_seed(0)
        trainer.fit(TimedSteps(clock, batches_per_step), tiny_loader(), tiny_loader(n=48))
        runs[order] = Run(trainer, energy, switch, logger, modes)
    return runs


def test_the_probe_is_in_no_step_and_both_orders_agree_exactly(tmp_path, monkeypatch):
    runs = fake_time_fits(tmp_path, monkeypatch, max_epochs=2)
    for run in runs.values():
        modes, switch = run.modes.by_step, run.switch
        assert switch.chosen == "bf16-mixed" and run.trainer.precision_plugin.mode_name == "bf16-mixed"
        assert [(e["from"], e["to"], e["step"]) for e in switch.switches] == [("32-true", "bf16-mixed", 3)]
        step_s, step_J = run.series("time/step_s"), run.series("energy/step_J")
        assert list(step_s) == list(step_J) == list(range(20))
        for step, seconds in step_s.items():  # the step's own time, never its probe's
            assert seconds == pytest.approx(STEP_S[modes[step]], rel=1e-9)
            assert step_J[step] == pytest.approx((DEVICE_W + OTHER_W) * seconds, rel=1e-9)
        # the probes, apart: at exactly the probed steps (bf16-mixed's profiling steps 3-5, warm-up included,
        # then the two steps before each guard check, every 3 steps from step 6), PROBE_S each
        probes = [3, 4, 5, 7, 8, 10, 11, 13, 14, 16, 17, 19]  # 19: before a check the fit ends first
        assert run.series("time/extra/precision_probe_s") == pytest.approx({s: PROBE_S for s in probes}, rel=1e-9)
        assert run.series("energy/extra/precision_probe_J") == pytest.approx(
            {s: (DEVICE_W + OTHER_W) * PROBE_S for s in probes}, rel=1e-9)
        # the switch's profiles come from the same step figures, its own sensor only
        for name, row in switch.profiles.items():
            assert row["steps"] == 2
            assert row["step_s"] == pytest.approx(STEP_S[name], rel=1e-9)
            assert row["step_J"] == pytest.approx(DEVICE_W * STEP_S[name], rel=1e-9)
        report = switch.report
        rows = {row["mode"]: row for row in report["modes"]}
        assert rows["32-true"]["trained_steps"] == 3 and rows["bf16-mixed"]["trained_steps"] == 17
        for name, row in rows.items():  # every step's own figures, the probes left out
            assert row["trained_J"] == pytest.approx(DEVICE_W * STEP_S[name] * row["trained_steps"], rel=1e-9)
        assert report["probe"] == pytest.approx({"steps": len(probes), "energy_J": DEVICE_W * PROBE_S * len(probes),
                                                 "seconds": PROBE_S * len(probes)}, rel=1e-9)
        assert run.energy.report["sections"]["precision"] is report
        epochs = run.energy.report["epochs"]
        assert sum(e["extras_J"][PROBE] for e in epochs) == pytest.approx(
            (DEVICE_W + OTHER_W) * PROBE_S * len(probes), rel=1e-9)
    first, second = (runs[order] for order in ORDERS)
    for key in ("time/step_s", "energy/step_J", "time/extra/precision_probe_s", "energy/extra/precision_probe_J",
                "energy/epoch_J"):
        assert first.series(key) == second.series(key), key  # fake time: the same to the last bit
    assert first.modes.by_step == second.modes.by_step
    assert first.switch.profiles == second.switch.profiles
    assert first.switch.switches == second.switch.switches
    assert first.logged("precision/") == second.logged("precision/")


def test_with_gradient_accumulation_steps_are_optimizer_steps(tmp_path, monkeypatch):
    """Warm-up, profile and trained steps count optimizer steps (two batches each here), as the timeline."""
    runs = fake_time_fits(tmp_path, monkeypatch, batches_per_step=2, max_epochs=2)
    for run in runs.values():
        switch, modes = run.switch, run.modes.by_step
        assert run.trainer.global_step == 10 and list(run.series("time/step_s")) == list(range(10))
        assert [(e["from"], e["to"], e["step"]) for e in switch.switches] == [("32-true", "bf16-mixed", 3)]
        assert [modes[s] for s in range(10)] == ["32-true"] * 3 + ["bf16-mixed"] * 7
        for name, row in switch.profiles.items():  # two optimizer steps of two batches each
            assert row["steps"] == 2
            assert row["step_s"] == pytest.approx(STEP_S[name], rel=1e-9)
        rows = {row["mode"]: row for row in switch.report["modes"]}
        assert sum(row["trained_steps"] for row in rows.values()) == run.trainer.global_step
        for step, seconds in run.series("time/step_s").items():  # each probe of a step's two batches left out
            assert seconds == pytest.approx(STEP_S[modes[step]], rel=1e-9)
        probes = run.series("time/extra/precision_probe_s")  # both batches of a probed step are probed
        assert probes == pytest.approx({step: 2 * PROBE_S for step in (3, 4, 5, 7, 8)}, rel=1e-9)
    first, second = (runs[order] for order in ORDERS)
    assert first.series("time/step_s") == second.series("time/step_s")
    assert first.switch.profiles == second.switch.profiles


# ---------------------------------------------------------------------- real time
WATTS = {"32-true": 300.0, "bf16-mixed": 3.0}  # 100x: no step-time jitter can change the choice
STEP_SLEEP_S, PROBE_SLEEP_S = 0.02, 0.25


class SleepySteps(TinyRegressor):
    """Training steps sleep 20 ms; the probe's replay (``replaying()``) sleeps 0.25 s."""

    def training_step(self, batch, batch_idx):
        time.sleep(PROBE_SLEEP_S if replaying() else STEP_SLEEP_S)
        return super().training_step(batch, batch_idx)


def test_in_real_time_no_step_holds_the_probe_in_either_order(tmp_path):
    runs = {}
    for order in ORDERS:
        sensor = ModePowerSensor(WATTS)
        energy = EnergyCallback(sensors=[sensor], interval_s=SAMPLER_INTERVAL_S, verbose=False, write_trace=False)
        # sensors=None: the EnergyCallback's; probes while profiling. Two profiled steps per mode give one
        # degree of freedom: at 50 % confidence the Student-t bound is 1 standard error, far below the 100x gap
        switch = make_switch(check_every_n_steps=0, confidence=0.5)
        pair = [energy, switch] if order == "energy_first" else [switch, energy]
        logger, modes = RecordingLogger(tmp_path / order), Modes()
        trainer = L.Trainer(callbacks=[*pair, FollowMode(sensor, pause_s=0.05), modes], logger=logger,
                            **trainer_kwargs(tmp_path / order, max_epochs=1, log_every_n_steps=1))
        trainer.fit(SleepySteps(), tiny_loader(), tiny_loader(n=48))
        run = runs[order] = Run(trainer, energy, switch, logger, modes)
        assert switch.chosen == "bf16-mixed"
        step_s, step_J = run.series("time/step_s"), run.series("energy/step_J")
        assert list(step_s) == list(step_J) == list(range(10))
        for step, seconds in step_s.items():
            assert seconds >= STEP_SLEEP_S
            assert step_J[step] == pytest.approx(WATTS[modes.by_step[step]] * seconds, rel=1e-9)
        probe_s = run.series("time/extra/precision_probe_s")
        assert list(probe_s) == [3, 4, 5]  # bf16-mixed's profiling steps, warm-up included
        assert all(seconds >= PROBE_SLEEP_S for seconds in probe_s.values())
        # No step holds the probe: the steps' and the probes' seconds are disjoint parts of the epoch's training
        # time. (A step's time bounded by the probe's sleep failed when the machine held one step 0.64 s.)
        (epoch_s,) = run.series("time/epoch_s").values()
        assert sum(step_s.values()) + sum(probe_s.values()) <= epoch_s * (1 + 1e-9)
        assert run.series("energy/extra/precision_probe_J") == pytest.approx(
            {step: WATTS["bf16-mixed"] * seconds for step, seconds in probe_s.items()}, rel=1e-9)
        for name, row in switch.profiles.items():  # its own figures: the steps', the probes left out
            assert row["power_W"] == pytest.approx(WATTS[name], rel=1e-9)
            assert STEP_SLEEP_S <= row["step_s"] <= max(step_s.values())  # from the steps' figures, no probe
    first, second = (runs[order] for order in ORDERS)
    assert first.modes.by_step == second.modes.by_step
    assert [(e["from"], e["to"], e["step"]) for e in first.switch.switches] == \
        [(e["from"], e["to"], e["step"]) for e in second.switch.switches] == [("32-true", "bf16-mixed", 3)]
    # Two real-time fits' step times are not compared: on a loaded machine each fit's steps wait for a core
    # a different while, and their medians drifted 25 % apart in either order. The orders' step series are
    # compared exactly on fake time above; here each step is bounded (the probe 12x a step) and every joule
    # is the mode's power times the step's own seconds.
