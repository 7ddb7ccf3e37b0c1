"""The lean loop pieces ``baler-lit fit`` installs (issue 31, item 4) change the time only: the same weights and
losses as Lightning's default profiler and progress bar, the same final progress line; the bar's throttle runs on
a fake clock. Nothing here is timed."""

from __future__ import annotations

import inspect
import io
import sys

import lightning as L
import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

from baler_lit.cli import lean_loop_settings, main
from baler_lit.data import BalerDataModule
from baler_lit.lean_loop import (LeanProfiler, LeanRichProgressBar, LeanTQDMProgressBar, _throttled,
                                 lean_progress_bar)
from baler_lit.module import BalerModule


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fit(tmp_path, profiler=None, bar=None, epochs: int = 2) -> tuple[dict, float, Namespace]:
    L.seed_everything(0, verbose=False)
    datamodule = BalerDataModule(batch_size=64, val_fraction=0.25, shuffle=True, synthetic_rows=320)
    model = BalerModule(input_shape=datamodule.input_shape, dtype="float64")
    trainer = L.Trainer(max_epochs=epochs, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[bar] if bar is not None else None, enable_progress_bar=bar is not None,
                        profiler=profiler, default_root_dir=str(tmp_path), num_sanity_val_steps=1)  # fmt: skip
    trainer.fit(model, datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {k: v.clone() for k, v in model.state_dict().items()}, metrics, trainer


def test_lean_profiler_and_bar_train_exactly_the_same_weights_and_losses(tmp_path):
    default_bar = RichProgressBar() if LeanRichProgressBar else TQDMProgressBar()  # Lightning's own
    ours, our_metrics, trainer = fit(tmp_path / "a", LeanProfiler(), lean_progress_bar())
    theirs, their_metrics, _ = fit(tmp_path / "b", None, default_bar)
    assert type(trainer.profiler) is LeanProfiler
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert our_metrics == their_metrics and {"train/loss", "val/loss"} <= set(our_metrics)


def test_lean_profiler_is_a_pass_through_that_records_nothing():
    profiler = LeanProfiler()
    assert isinstance(profiler, PassThroughProfiler)
    with profiler.profile("run_training_batch") as entered, profiler.profile("nested"):
        profiler.start("x")
        profiler.stop("x")
    assert entered is None and profiler.summary() == ""


class Recorder:
    """A stand-in progress bar base: records which batch-end calls reach it."""

    def __init__(self, **kwargs) -> None:
        self.calls: list[tuple[str, int]] = []
        self.total_train_batches = 10
        self.total_val_batches_current_dataloader = 4

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.append(("train", batch_idx))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.calls.append(("val", batch_idx))

    def on_train_epoch_end(self, trainer, pl_module):
        self.calls.append(("train epoch end", -1))

    def on_validation_epoch_end(self, trainer, pl_module):
        self.calls.append(("val epoch end", -1))

    def on_train_end(self, trainer, pl_module):
        self.calls.append(("train end", -1))

    def on_exception(self, trainer, pl_module, exception):
        self.calls.append(("exception", -1))


class FakeTrainer:
    sanity_checking = False


def _batches(bar, clock: FakeClock, count: int, step_s: float, hook="on_train_batch_end") -> None:
    for i in range(count):
        args = (FakeTrainer(), None, None, None, i) if hook == "on_train_batch_end" else (FakeTrainer(), None, None,
                                                                                           None, i, 0)
        getattr(bar, hook)(*args)
        clock.now += step_s


def test_the_bar_updates_at_most_refresh_per_s_always_at_first_and_last_batch():
    clock = FakeClock()
    bar = _throttled(Recorder)(refresh_per_s=10, clock=clock)
    _batches(bar, clock, 10, 0.04)  # a batch every 40 ms: batches 0, 3 (120 ms), 6 (240 ms) and the last (9)
    bar.on_train_epoch_end(None, None)
    assert bar.calls == [("train", 0), ("train", 3), ("train", 6), ("train", 9), ("train epoch end", -1)]


def test_a_skipped_update_is_applied_when_the_epoch_or_the_loop_ends_early():
    clock = FakeClock()
    bar = _throttled(Recorder)(refresh_per_s=10, clock=clock)
    _batches(bar, clock, 3, 0.01)  # stopped after 3 of 10 batches (max_steps, an exception)
    bar.on_train_end(None, None)
    assert bar.calls == [("train", 0), ("train", 2), ("train end", -1)]
    bar.calls.clear()
    _batches(bar, clock, 2, 0.01)
    bar.on_exception(None, None, RuntimeError())
    assert bar.calls == [("train", 0), ("train", 1), ("exception", -1)]
    bar.calls.clear()
    _batches(bar, clock, 3, 0.01, hook="on_validation_batch_end")
    bar.on_validation_epoch_end(None, None)
    assert bar.calls == [("val", 0), ("val", 2), ("val epoch end", -1)]


def test_a_bar_nobody_sees_updates_once_a_second():
    clock = FakeClock()
    bar = _throttled(Recorder)(refresh_per_s=10, clock=clock)
    bar.throttle.live = False  # Rich, not a terminal: only the final state is printed
    _batches(bar, clock, 10, 0.3)
    assert bar.calls == [("train", 0), ("train", 4), ("train", 8), ("train", 9)]
    with pytest.raises(ValueError, match="refresh_per_s"):
        _throttled(Recorder)(refresh_per_s=0)


@pytest.mark.skipif(LeanRichProgressBar is None, reason="rich is not installed")
def test_rich_bar_off_a_terminal_prints_the_default_bars_final_line(tmp_path):
    def final_line(bar_cls, root) -> str:
        out = io.StringIO()
        fit(root, None, bar_cls(console_kwargs={"file": out, "force_terminal": False, "width": 200}), epochs=1)
        return [line for line in out.getvalue().splitlines() if "Epoch" in line][-1]

    ours = final_line(LeanRichProgressBar, tmp_path / "a")
    theirs = final_line(RichProgressBar, tmp_path / "b")
    assert "4/4" in ours and "train/loss" in ours
    strip = [part for part in ours.split() if not part.endswith("it/s") and ":" not in part]
    assert strip == [part for part in theirs.split() if not part.endswith("it/s") and ":" not in part]


def _config(**trainer) -> Namespace:
    return Namespace(trainer=Namespace(**{"profiler": None, "callbacks": None, "enable_progress_bar": None,
                                          **trainer}))


def test_the_cli_installs_the_lean_pieces_only_where_the_config_leaves_them_to_lightning():
    config = _config()
    kwargs = lean_loop_settings(config, {})
    assert type(kwargs["profiler"]) is LeanProfiler
    assert [type(c) for c in config["trainer.callbacks"]] == [type(lean_progress_bar())]
    config = _config(profiler=SimpleProfiler(), callbacks=[TQDMProgressBar()])
    assert "profiler" not in lean_loop_settings(config, {})
    assert [type(c) for c in config["trainer.callbacks"]] == [TQDMProgressBar]
    config = _config(enable_progress_bar=False)
    lean_loop_settings(config, {})
    assert not any(isinstance(c, ProgressBar) for c in config["trainer.callbacks"] or [])


class SeeLoop(L.Callback):
    seen: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        SeeLoop.seen.append((type(trainer.profiler), [type(c) for c in trainer.callbacks if isinstance(c, ProgressBar)]))


def test_baler_lit_fit_runs_with_the_lean_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["baler-lit"])
    SeeLoop.seen.clear()
    code = main(["fit", "--seed_everything", "0", "--data.synthetic_rows", "256", "--data.batch_size", "64",
                 "--model.lr_patience", "null", "--trainer.max_epochs", "1", "--trainer.logger", "false",
                 "--trainer.enable_checkpointing", "false", "--trainer.enable_model_summary", "false",
                 "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks+=test_baler_lean_loop.SeeLoop"])
    assert code == 0
    assert SeeLoop.seen == [(LeanProfiler, [type(lean_progress_bar())])]


def test_training_step_signature_is_the_functions_own():
    function = BalerModule.training_step
    code = function.__code__
    assert list(function.__signature__.parameters) == list(code.co_varnames[: code.co_argcount])
    annotations = {k: v.annotation for k, v in function.__signature__.parameters.items()
                   if v.annotation is not inspect.Parameter.empty}
    assert annotations == {k: v for k, v in function.__annotations__.items() if k != "return"}
    spec = inspect.getfullargspec(BalerModule(input_shape=(4,)).training_step)
    assert spec.args == ["self", "batch", "batch_idx"] and spec.varargs is None


def test_tqdm_fallback_is_throttled_too():
    bar = LeanTQDMProgressBar(refresh_per_s=5, clock=FakeClock())
    assert isinstance(bar, TQDMProgressBar) and bar.throttle.interval_s == pytest.approx(0.2)
