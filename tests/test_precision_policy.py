"""PrecisionPolicy on plain numbers: no Trainer, no Lightning, no clock; energies and losses given by the test."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_energy.optimize.precision import policy as policy_module
from lightning_energy.optimize.precision.policy import (
    CHECK, DIFF_SUM, FALL_BACK, FIXED, GAP_N, GUARDING, LOSS_N, LOSS_SUM, N_STATS, NONFINITE, NOTHING, PROFILING,
    REF_SUM, WINDOW_DONE, PrecisionPolicy, window_summary,
)

ROOT = Path(__file__).resolve().parent.parent


def stats(loss_sum=0.0, losses=0, nonfinite=0, diff_sum=0.0, ref_sum=0.0, probed=0) -> list[float]:
    out = [0.0] * N_STATS
    out[LOSS_SUM], out[LOSS_N], out[NONFINITE] = loss_sum, losses, nonfinite
    out[DIFF_SUM], out[REF_SUM], out[GAP_N] = diff_sum, ref_sum, probed
    return out


class Machine:
    """Drives a policy as the callback does, one optimizer step at a time, on a cost model given in numbers:
    a step in mode m costs ``watts[m] * seconds(step)`` J; a probed step's loss is ``1 + gap[m]`` against a
    reference of 1 (so the window's relative gap is ``gap[m]``)."""

    def __init__(self, policy: PrecisionPolicy, watts: dict[str, float], gap: dict[str, float] | None = None,
                 seconds=lambda step: 0.01):
        self.policy, self.watts, self.gap, self.seconds = policy, watts, gap or {}, seconds
        self.mode = policy.start_mode()
        self.step = 0
        self.windows: list[str] = []  # the mode of each profiled window, in order
        self.switches: list[tuple[int, str, str]] = []
        self._per_step: list[list[float]] = []
        self._losses = stats()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.one_step()

    def one_step(self, failure_if_skipped: bool = False, consecutive: int = 0) -> str:
        policy, mode = self.policy, self.mode
        if policy.phase == PROFILING and policy.steps_in_mode == 0 and mode == policy.window_mode:
            self.windows.append(mode)
        profiled = policy.profiled_mode(mode)
        if profiled is not None:
            seconds = self.seconds(self.step)
            self._per_step.append([self.step, self.watts[mode] * seconds, seconds, policy.profile_rounds,
                                   policy.profile_index])
        self._losses[LOSS_SUM] += 1.0 + self.gap.get(mode, 0.0)
        self._losses[LOSS_N] += 1
        if policy.probe_due(mode):
            self._losses[DIFF_SUM] += self.gap.get(mode, 0.0)
            self._losses[REF_SUM] += 1.0
            self._losses[GAP_N] += 1
        failure = policy.step_failure(mode, failure_if_skipped, consecutive)
        action = policy.after_step(mode, failure)
        self.step += 1
        if action == WINDOW_DONE:
            part = {"per_step": self._per_step, "stats": self._losses, "failure": failure}
            self._per_step, self._losses = [], stats()
            following = policy.window_finished(part)
            if following is None:
                following, _ = policy.apply_round(policy.settle([policy.local_profiles]))
            self._switch(following)
        elif action == FALL_BACK:
            self._switch(policy.fall_back(mode, failure, self.step))
        elif action == CHECK:
            gap, mean_loss, nonfinite = window_summary(self._losses)
            self._losses = stats()
            verdict = policy.guard_verdict(mean_loss, gap, nonfinite) if policy.phase == GUARDING else None
            policy.checked(mean_loss, verdict)
            if verdict is not None:
                self._switch(policy.fall_back(mode, verdict, self.step))
        return action

    def _switch(self, mode: str | None) -> None:
        if mode is not None and mode != self.mode:
            self.switches.append((self.step, self.mode, mode))
            self.mode = mode


def choosing(**kwargs) -> PrecisionPolicy:
    kwargs = {"candidates": ["32-true", "bf16-mixed"], "warmup_steps": 1, "profile_steps": 4,
              "check_every_n_steps": 4, "probe_batches": 2, "min_profile_rounds": 1, "noise_floor": False,
              "tolerance": 0.05, **kwargs}
    policy = PrecisionPolicy(**kwargs)
    assert policy.plan_for("cpu") == {}
    return policy


PRECISION_MODULES = sorted(p.stem for p in Path(policy_module.__file__).parent.glob("*.py") if p.stem != "__init__")


def test_the_precision_decisions_import_no_lightning_and_nothing_above_optimize():
    """They decide; hooking into Lightning is the callback's job (a fresh interpreter: no import sneaks in)."""
    assert {"modes", "policy", "probe", "report"} <= set(PRECISION_MODULES)
    for name in PRECISION_MODULES:
        tree = ast.parse((Path(policy_module.__file__).parent / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert imported, name  # the walk sees the imports
        assert not [m for m in imported if m.split(".")[0] in ("lightning", "pytorch_lightning")
                    or m.startswith(("lightning_energy.callbacks", "lightning_energy.integration"))], name
    modules = "; ".join(f"import lightning_energy.optimize.precision.{name}" for name in PRECISION_MODULES)
    code = (f"import sys; {modules}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning') "
            "or m.startswith(('lightning_energy.callbacks', 'lightning_energy.integration'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_a_cheaper_mode_is_profiled_then_chosen_then_guarded():
    policy = choosing()
    machine = Machine(policy, {"32-true": 100.0, "bf16-mixed": 10.0}, gap={"bf16-mixed": 0.01})
    assert machine.mode == "32-true" and policy.phase == PROFILING
    machine.run(10)  # two windows of 1 warm-up + 4 profiled steps
    assert machine.windows == ["32-true", "bf16-mixed"]
    assert machine.switches == [(5, "32-true", "bf16-mixed")]  # the pick keeps the window's mode: no switch
    assert policy.phase == GUARDING and policy.chosen == "bf16-mixed" == policy.current
    assert policy.decision.startswith("profiled: cheaper than 32-true beyond noise by energy")
    rows = policy.profiles
    assert rows["32-true"]["step_J"] == pytest.approx(1.0) and rows["bf16-mixed"]["step_J"] == pytest.approx(0.1)
    assert rows["32-true"]["steps"] == rows["bf16-mixed"]["steps"] == 4
    assert rows["bf16-mixed"]["loss_gap"] == pytest.approx(0.01) and rows["32-true"]["loss_gap"] is None
    assert policy.best_loss == pytest.approx(1.0)  # the lowest window mean loss (32-true's)
    assert [machine.one_step() for _ in range(4)] == [NOTHING, NOTHING, NOTHING, CHECK]
    assert policy.since_check == 0 and machine.mode == "bf16-mixed"  # a gap of 1 % < 5 %: stays


def test_the_guard_falls_back_after_drift_patience_checks_beyond_tolerance():
    policy = choosing(drift_patience=2)
    machine = Machine(policy, {"32-true": 100.0, "bf16-mixed": 10.0}, gap={"bf16-mixed": 0.01})
    machine.run(10)
    machine.gap["bf16-mixed"] = 0.2  # the loss drifts 20 % from now on
    machine.run(4)
    assert machine.mode == "bf16-mixed" and policy.drift_strikes == 1  # one check beyond: patience
    machine.run(4)
    assert machine.switches[-1] == (18, "bf16-mixed", "32-true")
    assert policy.rejected["bf16-mixed"].startswith("fell back: loss gap 0.2 > tolerance 0.05 at 2 checks in a row")
    assert policy.profiles["bf16-mixed"]["status"].startswith("fell back at step 18")
    assert policy.drift_strikes == 0 and policy.safer_mode("bf16-mixed") == "32-true"


def test_a_gap_back_within_tolerance_resets_the_strikes():
    policy = choosing(drift_patience=2)
    policy.phase, policy.current, policy.best_loss = GUARDING, "bf16-mixed", 1.0
    assert policy.guard_verdict(1.0, 0.2, 0) is None and policy.drift_strikes == 1
    assert policy.guard_verdict(1.0, 0.01, 0) is None and policy.drift_strikes == 0
    assert policy.guard_verdict(1.0, 0.2, 0) is None
    assert policy.guard_verdict(1.0, None, 0) is None and policy.drift_strikes == 1  # no probe: no evidence
    assert policy.guard_verdict(1.0, 0.2, 0).startswith("loss gap 0.2 > tolerance")


def test_exploding_and_nonfinite_losses_and_where_they_count():
    policy = choosing(explode_factor=10.0)
    policy.phase, policy.current, policy.best_loss = GUARDING, "bf16-mixed", 2.0
    assert policy.guard_verdict(19.9, None, 0) is None
    assert policy.guard_verdict(20.1, None, 0).startswith("exploding loss: window mean 20.1 > 10 x lowest 2")
    assert policy.guard_verdict(1.0, None, 3) == "non-finite loss in 3 steps since the last check"
    policy.checked(1.5, None)
    assert policy.best_loss == 1.5  # a new lowest window mean
    policy.checked(0.5, "a verdict")
    assert policy.best_loss == 1.5  # not from a window that failed
    policy.current = "32-true"  # nothing safer to fall back to: non-finite losses there are not its fault
    assert policy.guard_verdict(1.0, None, 3) is None


def test_fall_back_goes_one_mode_safer_skipping_the_rejected():
    policy = choosing(candidates=["32-true", "bf16-mixed", "16-mixed", "16-mixed-noscale"])
    assert policy.plan == ["32-true", "bf16-mixed", "16-mixed", "16-mixed-noscale"]
    assert policy.fall_back("16-mixed-noscale", "r1", 7) == "16-mixed" == policy.current
    policy.rejected["bf16-mixed"] = "rejected: loss gap"
    assert policy.fall_back("16-mixed", "r2", 9) == "32-true"
    assert policy.fall_back("32-true", "r3", 11) is None and "32-true" not in policy.rejected
    assert policy.rejected["16-mixed-noscale"] == "fell back: r1"


def test_step_failures_follow_the_mode_s_gradient_scaling():
    policy = choosing(max_consecutive_skips=3)
    assert policy.step_failure("bf16-mixed", False, 0) is None
    assert policy.step_failure("bf16-mixed", True, 1) == "non-finite gradients (optimizer step skipped)"
    assert policy.step_failure("16-mixed", True, 2) is None  # the scaler skips now and then by design
    assert policy.step_failure("16-mixed", True, 3) == (
        "gradient scaler skipped 3 steps in a row (non-finite gradients)")


def test_a_failure_while_profiling_ends_the_window_and_rejects_the_mode():
    policy = choosing()
    machine = Machine(policy, {"32-true": 100.0, "bf16-mixed": 10.0})
    machine.run(5)
    assert machine.mode == "bf16-mixed"
    assert machine.one_step(failure_if_skipped=True) == WINDOW_DONE  # its first (warm-up) step fails
    assert policy.chosen == "32-true" and machine.mode == "32-true"
    assert policy.profiles["bf16-mixed"]["steps"] == 0
    assert policy.rejected["bf16-mixed"] == "rejected: non-finite gradients (optimizer step skipped)"


def test_rounds_alternate_their_order_and_probe_only_the_profiled_mode():
    """bf16-mixed 1 % cheaper under 18 % step-time noise: within noise, so the contenders are profiled again,
    every other round in reverse order, until max_profile_rounds; the probe replays only the window's mode."""
    step_s = [0.010, 0.011, 0.009, 0.012, 0.008]
    policy = choosing(max_profile_rounds=3, tolerance=0.5)
    machine = Machine(policy, {"32-true": 100.0, "bf16-mixed": 99.0}, seconds=lambda step: step_s[step % 5])
    assert policy.probe_due("32-true") is False and policy.probe_due("bf16-mixed") is False  # 32-true's window
    machine.run(30)
    assert machine.windows == ["32-true", "bf16-mixed", "bf16-mixed", "32-true", "32-true", "bf16-mixed"]
    assert policy.profile_rounds == 3 and policy.chosen == "32-true"
    assert policy.decision.startswith("profiled: no mode cheaper than 32-true beyond noise")
    assert policy.profiles["bf16-mixed"]["rounds"] == 3
    assert policy.profiles["32-true"]["loss_gap"] is None and policy.profiles["bf16-mixed"]["loss_gap"] == 0.0


def test_the_noise_floor_brackets_each_round_with_the_reference():
    policy = choosing(noise_floor=True, min_profile_rounds=2, max_profile_rounds=2)
    machine = Machine(policy, {"32-true": 100.0, "bf16-mixed": 10.0},
                      seconds=lambda step: 0.01 * (1 + 0.01 * (step % 3)))
    machine.run(30)
    assert machine.windows == ["32-true", "bf16-mixed", "32-true"] * 2
    reference = policy.profiles["32-true"]
    assert reference["aa_pairs"] == 2 and reference["windows"] == 4 and reference["steps"] == 16
    assert policy.chosen == "bf16-mixed" and policy.profile_rounds == 2  # confirmed in the second round


def test_a_fixed_mode_only_checks():
    policy = PrecisionPolicy(fixed_mode="bf16-mixed", check_every_n_steps=3, probe_batches=1)
    assert policy.phase == FIXED and policy.plan == ["bf16-mixed"] and policy.start_mode() == "bf16-mixed"
    assert policy.start_reason() == "fixed mode"
    probed = []
    for _ in range(6):
        probed.append(policy.probe_due("bf16-mixed"))
        action = policy.after_step("bf16-mixed", None)
        if action == CHECK:
            policy.checked(1.0, None)
    assert probed == [False, False, True, False, False, True]  # the last probe_batches steps before a check
    assert policy.after_step("bf16-mixed", "non-finite gradients") == NOTHING  # a fixed mode never falls back


def test_resume_restores_the_decisions_and_refuses_another_plan():
    policy = choosing()
    Machine(policy, {"32-true": 100.0, "bf16-mixed": 10.0}).run(12)
    saved = policy.state_dict()
    again = choosing()
    again.load_state_dict(saved)
    assert (again.phase, again.chosen, again.current, again.profiles) == (GUARDING, "bf16-mixed", "bf16-mixed",
                                                                           policy.profiles)
    assert again.start_mode() == "bf16-mixed" and again.start_reason().startswith("resumed; profiled")
    other = choosing(candidates=["32-true", "16-mixed"])
    with pytest.raises(ValueError, match="resume with the same candidates"):
        other.load_state_dict(saved)
    fixed = PrecisionPolicy(fixed_mode="16-mixed")
    with pytest.raises(ValueError, match="trained in fixed mode 'bf16-mixed', this PrecisionSwitch is fixed to "
                                         "'16-mixed'"):
        fixed.load_state_dict({"phase": FIXED, "current": "bf16-mixed"})


def test_window_summary_and_the_gap_of_a_window():
    assert window_summary(stats()) == (None, None, 0)
    gap, mean_loss, nonfinite = window_summary(stats(6.0, 3, 1, diff_sum=-0.3, ref_sum=3.0, probed=2))
    assert gap == pytest.approx(0.1) and mean_loss == 2.0 and nonfinite == 1
    assert window_summary(stats(diff_sum=0.5, ref_sum=0.0, probed=1))[0] == math.inf
    assert window_summary(stats(diff_sum=0.0, ref_sum=0.0, probed=1))[0] == 0.0


def test_a_cuda_only_candidate_is_dropped_from_a_cpu_plan():
    policy = PrecisionPolicy(candidates=["tf32", "bf16-mixed"])
    dropped = policy.plan_for("cpu")
    assert dropped == {"tf32": "TF32 is a CUDA feature"} and policy.plan == ["32-true", "bf16-mixed"]
    assert policy.rejected == {"tf32": "unavailable: TF32 is a CUDA feature"}
    assert policy.round == ["32-true", "bf16-mixed", "32-true"]  # with the noise floor's A/A pair
