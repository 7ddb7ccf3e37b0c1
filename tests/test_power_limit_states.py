"""The power-limit state machine without Lightning: ``PowerLimitController`` driven step by step on a fake card.

The card draws its limit while it runs a step of ``time_s(limit)`` seconds (slower at lower limits, less energy
per step): exact figures, no clock. Each transition writes one INFO line of the controller's module logger on
rank 0; the tests read them with ``caplog``. ``test_power_limit.py`` checks the same machine inside a fit
(against Zeus's own optimiser, step for step).
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_energy.optimize.power_limit import controller as controller_module
from lightning_energy.optimize.power_limit.controller import (
    Card,
    Done,
    PowerLimitController,
    PowerLimitSettings,
    Profiling,
    Ready,
    Warmup,
)
from lightning_energy.optimize.power_limit.search import LimitProfile

ROOT = Path(__file__).resolve().parents[1]
GRID = [300, 275, 250, 225, 200, 175, 150]
V100 = Card("fake V100", min_W=150, max_W=300, default_W=300, start_W=300)


def time_s(limit_W: int) -> float:
    """A step's time at a limit (s): 30 ms at 300 W, slower below."""
    return 0.03 * (300 / limit_W) ** 0.5


class FakeCard:
    """The controller's Port: a card that runs each step at the limit in force, exact figures per step."""

    def __init__(self, limit_W: int = 300, broadcast_answer=None, unmeasurable: set[int] = ()) -> None:
        self.limit_W = limit_W
        self.step: int | None = None
        self.set_at: list[tuple[int | None, int]] = []  # (step, W) of every set_limit call
        self.boundaries: list[int] = []
        self.energy_J: dict[int, float] = {}
        self.time_s: dict[int, float] = {}
        self.unmeasurable = set(unmeasurable)  # windows (first step) whose figures never come
        self.broadcast_answer = broadcast_answer  # what rank 0 sends, for a controller on another rank

    def set_limit(self, limit_W: int) -> None:
        self.set_at.append((self.step, limit_W))
        self.limit_W = limit_W

    def window_boundary(self, step: int) -> None:
        self.boundaries.append(step)

    def measure(self, first_step: int, after_last_step: int):
        if first_step in self.unmeasurable:
            return None
        steps = range(first_step, after_last_step)
        return sum(self.energy_J[s] for s in steps), sum(self.time_s[s] for s in steps)

    def gather(self, value):
        return [value]

    def broadcast(self, value):
        return value if self.broadcast_answer is None else self.broadcast_answer

    def run(self, controller: PowerLimitController, steps: range, interrupt_after: dict[int, str] = None,
            micro_batches: int = 1) -> list[str]:
        """Steps as a Trainer runs them: the step begins (once per micro-batch), the card runs it at its limit,
        then maybe an epoch end or a validation run. Returns the states' names after each step began."""
        states = []
        for step in steps:
            self.step = step
            for _ in range(micro_batches):
                controller.step_begins(step)
            states.append(type(controller.state).__name__)
            self.time_s[step] = time_s(self.limit_W)
            self.energy_J[step] = self.limit_W * self.time_s[step]
            if interrupt_after and step in interrupt_after:
                controller.interrupt(interrupt_after[step])
        return states


def make(port: FakeCard, rank: int = 0, card: Card = V100, **settings) -> PowerLimitController:
    options = dict(selector="energy", wait_steps=1, warmup_steps=1, profile_steps=2)
    options.update(settings)
    return PowerLimitController(PowerLimitSettings(**options), card, port, world_size=1, rank=rank)


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == controller_module.__name__]


@pytest.fixture
def caplog_info(caplog):
    caplog.set_level(logging.INFO, logger="lightning_energy")
    return caplog


# ------------------------------------------------------------------------------------------ the sweep, as Zeus
def test_the_sweep_runs_zeus_transitions_with_one_line_each(caplog_info):
    port = FakeCard()
    controller = make(port)
    controller.start()
    assert controller.state == Ready(next_power_limit=300_000, steps=2)
    controller.begin_training()
    states = port.run(controller, range(25))
    # 1 wait step, then per limit 1 warm-up step and 2 profiled steps, 3 steps apart; the choice at step 22
    assert states[:4] == ["Ready", "Warmup", "Profiling", "Profiling"] and states[22:] == ["Done"] * 3
    assert port.set_at == [(None, 300), (1, 300), (4, 275), (7, 250), (10, 225), (13, 200), (16, 175), (19, 150),
                           (22, 150)]
    assert controller.limits_profiled == GRID and controller.chosen_limit_W == 150
    assert controller.state == Done(optimal_power_limit=150_000)
    for limit, p in controller.profiles.items():
        assert p.steps == 2 and p.time_per_step_s == pytest.approx(time_s(limit), rel=1e-12)
    expected = ["power limit: ready; after 1 step(s) 300 W is profiled first (exhaustive search over 7 limits, "
                "300-150 W)"]
    for i, limit in enumerate(GRID):
        expected += [f"power limit: warmup at {limit} W, step {1 + 3 * i}",
                     f"power limit: profiling {limit} W, steps {2 + 3 * i}-{3 + 3 * i}"]
    expected.append("power limit: energy picks 150 W after profiling 7 of 7 limits in 7 windows (exhaustive search); "
                    "training goes on at 150 W from step 22")
    assert lines(caplog_info) == expected


def test_a_step_of_several_micro_batches_counts_once():
    one, many = FakeCard(), FakeCard()
    runs = []
    for port, micro_batches in ((one, 1), (many, 4)):
        controller = make(port)
        controller.start()
        runs.append(port.run(controller, range(25), micro_batches=micro_batches))
    assert runs[0] == runs[1]
    assert one.set_at == many.set_at == [(1, 300), (4, 275), (7, 250), (10, 225), (13, 200), (16, 175), (19, 150),
                                         (22, 150)]


def test_without_warm_up_steps_a_limit_is_profiled_where_it_is_set(caplog_info):
    port = FakeCard()
    controller = make(port, warmup_steps=0, wait_steps=0, pl_step_W=75)  # 300, 225, 150
    controller.start()
    states = port.run(controller, range(8))
    assert states == ["Profiling", "Profiling", "Profiling", "Profiling", "Profiling", "Profiling", "Done", "Done"]
    assert port.set_at == [(0, 300), (2, 225), (4, 150), (6, 150)]
    assert [m for m in lines(caplog_info) if "warmup" in m] == []
    assert "power limit: profiling 225 W, steps 2-3" in lines(caplog_info)


# ------------------------------------------------------------------------------------------ interruptions
def test_an_interrupted_window_is_dropped_and_profiled_again_at_the_maximum_meanwhile(caplog_info):
    port = FakeCard()
    controller = make(port)
    controller.start()
    port.run(controller, range(6), interrupt_after={5: "a validation run"})  # 275 W's window: steps 5-6
    assert controller.state == Ready(next_power_limit=275_000, steps=1) and controller.retried_windows == 1
    port.run(controller, range(6, 7))
    assert port.set_at[-2:] == [(5, 300), (6, 275)]  # the maximum after the cut, 275 W again at the next step
    assert controller.state == Warmup(current_power_limit=275_000, steps=1)
    assert "power limit: profiling at 275 W interrupted by a validation run; 275 W is profiled again" in lines(
        caplog_info)
    port.run(controller, range(7, 30))
    assert controller.limits_profiled == GRID and controller.chosen_limit_W == 150
    assert controller.profiles[275].time_per_step_s == pytest.approx(time_s(275), rel=1e-12)  # no 300 W step in it


def test_a_warm_up_cut_by_an_epoch_end_says_so(caplog_info):
    port = FakeCard()
    controller = make(port, warmup_steps=3)
    controller.start()
    port.run(controller, range(3), interrupt_after={2: "the end of a training epoch"})
    assert controller.state == Ready(next_power_limit=300_000, steps=1)
    assert lines(caplog_info)[-1] == ("power limit: warmup at 300 W interrupted by the end of a training epoch; "
                                      "300 W is profiled again")


def test_an_interruption_outside_a_window_changes_nothing_and_says_nothing(caplog_info):
    port = FakeCard()
    controller = make(port, wait_steps=3)
    controller.start()
    port.run(controller, range(2), interrupt_after={1: "a validation run"})  # still waiting
    assert controller.state == Ready(next_power_limit=300_000, steps=2) and controller.retried_windows == 0
    port.run(controller, range(2, 40))
    count = len(lines(caplog_info))
    controller.interrupt("a validation run")  # done
    assert controller.done and controller.retried_windows == 0 and len(lines(caplog_info)) == count


# ------------------------------------------------------------------------------------------ the adaptive search
class ScriptedSearch:
    """A search that proposes a fixed sequence of limits (then None: done) and picks the least energy per step;
    it records what the controller tells it at each decision."""

    name = "adaptive"
    needs_measurements = True

    def __init__(self, limits: list[int]) -> None:
        self.limits = list(limits)
        self.told: list[tuple[dict, int | None]] = []

    def next_limit(self, profiled, previous=None):
        self.told.append((dict(profiled), previous))
        return self.limits.pop(0) if self.limits else None

    def choose(self, profiled):
        return min(profiled, key=lambda limit: profiled[limit].energy_per_step_J)


def test_a_repeated_window_needs_no_limit_change_and_says_so(caplog_info):
    port = FakeCard()
    controller = make(port, search="adaptive")
    controller.search = search = ScriptedSearch([300, 300, 150])  # the maximum, again, the minimum
    controller.start()
    states = port.run(controller, range(12))
    assert states[4:6] == ["Profiling", "Profiling"] and states[9:] == ["Done"] * 3
    assert port.set_at == [(1, 300), (6, 150), (9, 150)]  # no change for the repeat
    assert controller.limits_profiled == [300, 300, 150] and controller.profiles[300].window_count == 2
    # at each decision the search has this window's figures (merged with the earlier window of the same limit)
    assert [(sorted(known), previous) for known, previous in search.told] == [([], None), ([300], 300),
                                                                              ([300], 300), ([150, 300], 150)]
    assert search.told[2][0][300].window_count == 2
    assert lines(caplog_info)[1:] == [
        "power limit: warmup at 300 W, step 1",
        "power limit: profiling 300 W, steps 2-3",
        "power limit: profiling 300 W again, steps 4-5 (a repeated window: no warm-up)",
        "power limit: warmup at 150 W, step 6",
        "power limit: profiling 150 W, steps 7-8",
        "power limit: energy picks 150 W after profiling 2 of 7 limits in 3 windows (adaptive search); training "
        "goes on at 150 W from step 9"]


def test_another_rank_follows_rank_zero_and_logs_nothing(caplog_info):
    """Rank 0 decides; another rank applies what the broadcast brings (here: 200 W) and writes no line."""
    port = FakeCard(broadcast_answer=200)
    controller = make(port, rank=1)
    controller.start()
    port.run(controller, range(25))
    assert controller.chosen_limit_W == 200 and port.set_at[-1] == (22, 200)
    assert lines(caplog_info) == []


# ------------------------------------------------------------------------------------------ measurement problems
def test_a_window_that_cannot_be_measured_is_dropped_with_a_warning():
    port = FakeCard(unmeasurable={5})  # 275 W's window
    controller = make(port)
    controller.start()
    with pytest.warns(UserWarning, match="the window of 275 W could not be measured; it is dropped"):
        port.run(controller, range(28))
    # dropped when the next window ends, so the sweep profiles 275 W again after 250 W
    assert controller.limits_profiled == [300, 250, 275, 225, 200, 175, 150]
    assert (10, 275) in port.set_at and controller.chosen_limit_W == 150
    assert controller.profiles[275].time_per_step_s == pytest.approx(time_s(275), rel=1e-12)


def test_the_fit_ending_inside_the_search_measures_the_last_window_and_chooses_nothing():
    port = FakeCard()
    controller = make(port)
    controller.start()
    port.run(controller, range(8))  # 250 W's warm-up begins at step 7: 275 W's window is still pending
    assert sorted(controller.profiles) == [300]
    assert controller.end_of_fit() is False
    assert sorted(controller.profiles) == [275, 300] and controller.chosen_limit_W is None


# ------------------------------------------------------------------------------------------ other starts
def test_a_profile_file_makes_the_choice_at_once(caplog_info):
    port = FakeCard()
    controller = make(port)
    profiles = [LimitProfile(w, w * time_s(w), time_s(w), 1) for w in (300, 200)]
    controller.load(profiles, "profile.json")
    assert controller.state == Done(optimal_power_limit=200_000) and controller.loaded_from == "profile.json"
    controller.begin_training()
    port.run(controller, range(5))
    assert port.set_at == [(None, 200)]
    assert lines(caplog_info) == ["power limit: profile loaded from profile.json; energy picks 200 W"]
    with pytest.raises(ValueError, match=r"holds limits \[400\] W outside this GPU's range \[150, 300\] W"):
        make(FakeCard()).load([LimitProfile(400, 1.0, 1.0, 1)], "foreign.json")


def test_a_dry_run_measures_the_limit_in_force_and_never_sets_one(caplog_info):
    port = FakeCard(limit_W=250)
    controller = make(port, dry_run=True, card=dataclasses.replace(V100, start_W=250))
    controller.start()
    controller.begin_training()
    assert port.run(controller, range(6))[4:] == ["Done", "Done"]
    assert port.set_at == [] and controller.state == Done(optimal_power_limit=250_000)
    assert controller.dry_run_measurement.time_per_step_s == pytest.approx(time_s(250), rel=1e-12)
    report = controller.dry_run_report(None, 1000, "report.json")
    assert report["current_limit_W"] == 250 and report["candidate_limits_W"] == GRID
    assert report["profiling_steps"]["max"] * report["measured_at_current_limit"]["time_per_step_s"] == pytest.approx(
        report["expected_profiling_time_s"]["max"])
    said = lines(caplog_info)
    assert said[0] == ("power limit: ready; after 1 step(s) the limit in force, 250 W, is profiled (a dry run: the "
                       "card is never changed)")
    assert said[-1].startswith("power limit: dry run: would profile 7-7 of 7 limits") and said[-1].endswith(
        "the card allows it. Report: report.json")


# ------------------------------------------------------------------------------------------ checkpoints
def test_a_checkpoint_mid_window_resumes_at_that_limit_with_the_profiles_kept(caplog_info):
    port = FakeCard()
    first = make(port, search="adaptive")
    first.search = ScriptedSearch([300, 150])
    first.start()
    port.run(first, range(6))  # 150 W: warm-up at step 4, the window (steps 5-6) open
    saved = first.state_dict()
    assert saved["state"] == {"type": "Ready", "next_power_limit": 150_000, "steps": 1}  # as Zeus's Ready.dict()
    assert saved["unmeasured_W"] == [] and [row["power_limit"] for row in saved["profiles"]] == [300]
    second_port = FakeCard()
    second = make(second_port, search="adaptive")
    second.search = ScriptedSearch([300])
    second.start()
    second.restore(saved)
    assert second.profiles == first.profiles and second.state == Ready(next_power_limit=150_000, steps=1)
    assert lines(caplog_info)[-1] == "power limit: resumed from a checkpoint: 1 of 7 limits profiled, 150 W next"
    second.search = ScriptedSearch([])  # done after 150 W
    second_port.run(second, range(6, 12))
    assert second_port.set_at == [(6, 150), (9, 150)] and second.limits_profiled == [150]
    assert sorted(second.profiles) == [150, 300] and second.chosen_limit_W == 150


def test_a_window_without_figures_at_the_checkpoint_is_profiled_again_first():
    port = FakeCard()
    first = make(port)
    first.start()
    port.run(first, range(9))  # 275 W's window (steps 5-6) ended at step 7, not measured yet (the sweep waits)
    saved = first.state_dict()
    assert saved["unmeasured_W"] == [275] and [row["power_limit"] for row in saved["profiles"]] == [300]
    assert saved["state"] == {"type": "Ready", "next_power_limit": 250_000, "steps": 1}
    second = make(FakeCard())
    second.start()
    second.restore(saved)
    assert second.state == Ready(next_power_limit=275_000, steps=1)


def test_a_finished_search_resumes_done():
    port = FakeCard()
    first = make(port)
    first.start()
    port.run(first, range(25))
    second_port = FakeCard()
    second = make(second_port)
    second.start()
    second.restore(first.state_dict())
    assert second.done and second.chosen_limit_W == 150 and second.profiles == first.profiles
    second.begin_training()
    second_port.run(second, range(25, 30))
    assert second_port.set_at == [(None, 150)]


def test_a_checkpoint_over_other_limits_is_ignored_with_a_warning():
    first = make(FakeCard(), pl_step_W=50)
    first.start()
    saved = first.state_dict()
    second = make(FakeCard())
    second.start()
    with pytest.warns(UserWarning, match="profiled over other limits"):
        second.restore(saved)
    assert second.state == Ready(next_power_limit=300_000, steps=2)


def test_states_refuse_what_zeus_refuses():
    with pytest.raises(ValueError, match="Ready.steps must be an integer >= 1"):
        Ready(next_power_limit=300_000, steps=0)
    with pytest.raises(ValueError, match="Profiling.current_power_limit"):
        Profiling(current_power_limit=-1, steps=3)


# ------------------------------------------------------------------------------------------ settings
def test_settings_are_frozen_and_checked():
    settings = PowerLimitSettings(eta_knob=1)
    assert settings.eta_knob == 1.0 and isinstance(settings.eta_knob, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.profile_steps = 3
    for kwargs, match in [({"selector": "fastest"}, "`selector` must be one of"),
                          ({"profile_steps": 0}, "`profile_steps` must be an integer >= 1"),
                          ({"wait_steps": True}, "`wait_steps` must be an integer >= 0"),
                          ({"eta_knob": 1.5}, "`eta_knob`"), ({"tolerance": 1.0}, "`tolerance`"),
                          ({"max_power_scope": "node"}, "`max_power_scope`")]:
        with pytest.raises(ValueError, match=match):
            PowerLimitSettings(**kwargs)
    with pytest.raises(TypeError, match="`dry_run` must be a bool"):
        PowerLimitSettings(dry_run="yes")


def test_every_setting_is_a_keyword_of_the_callback_with_the_same_default():
    """LightningCLI configs pass the callback's keywords: each setting keeps its keyword and default there."""
    import inspect

    from lightning_energy.callbacks.power_limit import PowerLimitOptimizer

    keywords = inspect.signature(PowerLimitOptimizer).parameters
    for field in dataclasses.fields(PowerLimitSettings):
        assert keywords[field.name].default == field.default, field.name
    callback = PowerLimitOptimizer(selector="time", search="adaptive", wait_steps=2, warmup_steps=3, profile_steps=4,
                                   pl_step_W=50, noise=0.05, dry_run=True)
    assert callback.settings == PowerLimitSettings(selector="time", search="adaptive", wait_steps=2, warmup_steps=3,
                                                   profile_steps=4, pl_step_W=50, noise=0.05, dry_run=True)


def test_the_controller_imports_without_lightning():
    probe = ("import sys\nimport lightning_energy.optimize.power_limit.controller\n"
             "print(sorted(n for n in sys.modules if n.split('.')[0] in ('lightning', 'pytorch_lightning', "
             "'lightning_fabric')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
