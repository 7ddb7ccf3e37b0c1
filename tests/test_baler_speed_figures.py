"""Power figures that would slow training wait for the end of the fit (issue 31: EnergyCallback + TensorBoard cost
more than the sum of their parts because a ~0.1 s figure, the first ~0.8 s with matplotlib's import, was drawn
for every short epoch beside training). Fake clock and fake writers: nothing here is timed."""

from __future__ import annotations

from fakes_nvml import FakeClock
from test_output_faults import WAIT_S, FakeTrainer, FakeWriter

import lightning_energy.outputs.tensorboard as tensorboard_module
from lightning_energy.outputs.tensorboard import MAX_DEFERRED_FIGURES, TensorBoardExtras

EPOCH_S = 0.5
DRAW_S = 0.1


def points(start_s: float, watts: float = 100.0) -> list:
    return [(start_s + 0.025 * i, {"device": watts}) for i in range(20)]


def extras_on_fake_clock(monkeypatch, **kwargs):
    clock = FakeClock()
    real = tensorboard_module.power_figure

    def slow_power_figure(*args):
        clock.advance(DRAW_S)
        return real(*args)

    monkeypatch.setattr(tensorboard_module, "power_figure", slow_power_figure)
    writer = FakeWriter()
    extras = TensorBoardExtras([writer], clock=clock, **kwargs)
    return extras, writer, clock


def epoch(extras, clock, index: int, watts: float = 100.0) -> None:
    clock.advance(EPOCH_S)
    extras.after_epoch(FakeTrainer(), index, points(clock(), watts))
    assert extras.worker.drain(WAIT_S)


def drawn(writer) -> list[int]:
    return [step for tag, step in writer.images if tag == tensorboard_module.FIGURE_TAG]


def test_only_the_first_figure_is_drawn_while_short_epochs_train_the_rest_at_the_end(monkeypatch):
    extras, writer, clock = extras_on_fake_clock(monkeypatch)
    for i in range(3):
        epoch(extras, clock, i)
    assert drawn(writer) == [0]  # epochs 1 and 2 would take 20 % of the run: they wait
    extras.close(WAIT_S)
    assert drawn(writer) == [0, 1, 2]  # the rule's figures all arrive, in epoch order
    assert extras.figure_summary()["drawn"] == 3


def test_a_most_expensive_epoch_over_the_budget_is_drawn_at_the_end_before_the_last(monkeypatch):
    extras, writer, clock = extras_on_fake_clock(monkeypatch)
    watts = [100.0] * 8
    watts[5] = 300.0
    for i, w in enumerate(watts):
        epoch(extras, clock, i, w)
    assert 5 not in drawn(writer)
    extras.close(WAIT_S)
    assert drawn(writer)[-4:] == [1, 2, 5, 7]


def test_long_epochs_still_get_their_figures_at_once(monkeypatch):
    extras, writer, clock = extras_on_fake_clock(monkeypatch)
    for i in range(3):
        clock.advance(30.0)  # 30-s epochs: a 0.1-s figure is well within 1 %
        extras.after_epoch(FakeTrainer(), i, points(clock()))
        assert extras.worker.drain(WAIT_S)
    assert drawn(writer) == [0, 1, 2]
    extras.close(WAIT_S)


def test_waiting_figures_are_bounded(monkeypatch):
    extras, writer, clock = extras_on_fake_clock(monkeypatch)
    for i in range(40):
        epoch(extras, clock, i, 100.0 + i)  # every epoch the most expensive so far
    assert len(extras._deferred) <= MAX_DEFERRED_FIGURES
    extras.close(WAIT_S)
    shown = drawn(writer)
    assert {0, 1, 2, 39} <= set(shown) and len(shown) < 40
    assert extras.figures_skipped > 0


def test_without_a_budget_every_figure_is_drawn_at_once(monkeypatch):
    extras, writer, clock = extras_on_fake_clock(monkeypatch, figure_budget=None)
    for i in range(4):
        epoch(extras, clock, i)
    assert drawn(writer) == [0, 1, 2, 3]
    extras.close(WAIT_S)
