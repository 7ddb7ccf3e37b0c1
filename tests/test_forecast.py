"""Forecasts: the planned run, exactness on constant power, convergence after warm-up, the callback, budgets."""

from __future__ import annotations

import io
import json
import math

import lightning as L
import pytest
from lightning.pytorch.callbacks import EarlyStopping

from conftest import RecordingLogger, TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import SimulatedSensor
from lightning_energy.callbacks.carbon import CarbonCallback
from lightning_energy.callbacks.forecast import FORECAST_REPORT_FILE, ForecastCallback
from lightning_energy.predict.forecast import ForecastTracker, ForecastUnavailable, plan_run
from lightning_energy.integration.timeline import EpochFigures, LoopFigures, StepFigures
from lightning_energy.measure.meter import Meter, measure

WATTS = 150.0


# ---------------------------------------------------------------- the planned run
def test_plan_from_max_epochs_and_max_steps():
    plan = plan_run(10, max_epochs=3)
    assert (plan.total_batches, plan.epochs, plan.limited_by) == (30, 3, "max_epochs")
    plan = plan_run(10, max_epochs=1000, max_steps=25)
    assert (plan.total_batches, plan.epochs, plan.limited_by) == (25, 3, "max_steps")


def test_plan_with_gradient_accumulation_counts_the_partial_window_of_each_epoch():
    # 10 batches, accumulate 4: optimizer steps after batches 4, 8 and 10 -> 3 steps per epoch;
    # 7 steps = 2 epochs (20 batches) + 1 step (4 batches)
    plan = plan_run(10, max_epochs=None, max_steps=7, accumulate_grad_batches=4)
    assert plan.total_batches == 24 and plan.epochs == 3


def test_plan_of_an_unsized_loader_needs_max_steps():
    plan = plan_run(math.inf, max_epochs=None, max_steps=50, accumulate_grad_batches=2)
    assert plan.total_batches == 100 and plan.epochs is None
    with pytest.raises(ForecastUnavailable, match="max_steps"):
        plan_run(math.inf, max_epochs=5)
    with pytest.raises(ForecastUnavailable):
        plan_run(10, max_epochs=None, max_steps=-1)


# ---------------------------------------------------------------- the model on a fake clock
class SimulatedFit:
    """A fit on a hand-driven clock: sensor power follows a known trace, every boundary at a known time.

    The test stands in for the Trainer's timeline: it places the boundaries' marks and hands the tracker
    what the timeline delivers (each step's figures, then each epoch's, validation excluded, with the
    energy at the epoch's end); the tracker itself places no mark.
    """

    def __init__(self, sampler, clock, trace, plan, warmup_batches, every_s=0.01):
        sensor = SimulatedSensor("device", trace, kind="energy", clock=clock)  # an exact counter
        names = sampler.acquire("forecast-test", [sensor], interval_s=every_s, start_thread=False)
        self.meter = Meter(sampler, names)
        self.meter.clock.record = clock  # marks on the fake clock
        sampler.add_meter(self.meter)
        self.sampler, self.clock, self.every_s, self.sensor = sampler, clock, every_s, sensor
        self.start_t = clock()
        self.tracker = ForecastTracker(self.mark(), plan, warmup_batches)
        self.epoch_number, self.step_number = 0, 0

    def mark(self):
        mark = self.meter.wait(self.meter.mark(), timeout_s=0.0)  # a sample is at this very time: exact
        assert not mark.extrapolated
        return mark

    def spend(self, seconds: float) -> None:
        for _ in range(round(seconds / self.every_s)):
            self.clock.advance(self.every_s)
            self.sampler.sample_once()

    def begin_epoch(self) -> None:
        self._epoch_start, self._loops, self._steps_J = self.mark(), [], 0.0

    def batch(self, seconds: float) -> None:
        start = self.mark()
        self.spend(seconds)
        end = self.mark()
        self.step_number += 1
        window = measure(start, end)
        self._steps_J += window.total_J
        self.tracker.step(StepFigures(self.step_number, self.epoch_number, 1, True, window, {}, start, end))

    def validation(self, seconds: float) -> None:
        start = self.mark()
        self.spend(seconds)
        end = self.mark()
        m = measure(start, end)
        self._loops.append(LoopFigures("val", self.epoch_number, self.step_number, True, dict(m.energy_J),
                                       m.duration_s, start.t, end.t))

    def end_epoch(self):
        end = self.mark()
        window = measure(self._epoch_start, end)
        energy = {n: j - sum(loop.energy_J.get(n, 0.0) for loop in self._loops) for n, j in window.energy_J.items()}
        figures = EpochFigures(self.epoch_number, self.step_number, energy,
                               window.duration_s - sum(loop.duration_s for loop in self._loops), tuple(self._loops),
                               0, {"steps": self._steps_J}, {}, {}, window.start_s, window.end_s)
        self.epoch_number += 1
        return self.tracker.epoch(figures, end.energy)

    def epoch(self, batch_s: list[float], validation_s: float, gap_s: float):
        self.begin_epoch()
        for seconds in batch_s:
            self.batch(seconds)
        if validation_s:
            self.validation(validation_s)
        forecast = self.end_epoch()
        self.spend(gap_s)  # checkpointing and hooks before the next epoch
        return forecast

    def true_total_J(self) -> float:
        return self.sensor.energy_at(self.clock() - self.sensor._origin) - self.sensor.energy_at(
            self.start_t - self.sensor._origin)


def run_fit(sampler, clock, trace, epochs=4, batches=8, batch_s=0.05, first_batch_s=None, validation_s=0.1,
            gap_s=0.0, pre_s=0.3, warmup=1):
    fit = SimulatedFit(sampler, clock, trace, plan_run(batches, max_epochs=epochs), warmup)
    fit.spend(pre_s)  # set-up and sanity check before the first epoch
    forecasts = []
    for epoch in range(epochs):
        times = [batch_s] * batches
        if epoch == 0 and first_batch_s is not None:
            times[0] = first_batch_s
        forecasts.append(fit.epoch(times, validation_s, gap_s))
    actual_J, actual_s, errors = fit.tracker.fit_end(fit.mark())
    return fit, forecasts, actual_J, actual_s, errors


def test_forecast_on_constant_power_is_exact_after_the_first_epoch(manual_sampler, clock):
    fit, forecasts, actual_J, actual_s, errors = run_fit(manual_sampler, clock, WATTS)
    assert actual_J == pytest.approx(fit.true_total_J(), rel=1e-12)
    assert actual_s == pytest.approx(0.3 + 4 * (8 * 0.05 + 0.1), abs=1e-9)
    for forecast in forecasts:
        assert forecast.total_J == pytest.approx(actual_J, rel=1e-9)
        assert forecast.total_s == pytest.approx(actual_s, rel=1e-9)
    assert forecasts[0].J_per_batch == pytest.approx(WATTS * 0.05, rel=1e-9)
    assert [round(e["error_pct"], 9) for e in errors] == [0.0] * 4


def test_gaps_between_epochs_are_learnt_from_the_second_epoch(manual_sampler, clock):
    _, forecasts, actual_J, actual_s, errors = run_fit(manual_sampler, clock, WATTS, gap_s=0.07)
    assert forecasts[0].total_J < actual_J  # the checkpoint gaps are not known yet
    for forecast in forecasts[1:]:
        assert forecast.total_J == pytest.approx(actual_J, rel=1e-9)
        assert forecast.total_s == pytest.approx(actual_s, rel=1e-9)


def test_forecast_converges_on_a_warm_up_then_steady_trace(manual_sampler, clock):
    # 300 W for the first 0.6 s (compilation, caches), then 100 W; the first batch is slow too
    trace = [(0.0, 300.0), (0.6, 100.0)]
    _, forecasts, actual_J, _, errors = run_fit(manual_sampler, clock, trace, epochs=5, first_batch_s=0.3,
                                                 warmup=0)
    magnitudes = [abs(e["error_pct"]) for e in errors]
    assert magnitudes[0] > 10.0  # warm-up counted into the rate: a poor first forecast
    assert all(b < a for a, b in zip(magnitudes, magnitudes[1:]))  # better every epoch
    assert magnitudes[-1] < 1e-6


def test_excluding_warm_up_makes_the_first_forecast_exact(manual_sampler, clock):
    trace = [(0.0, 300.0), (0.6, 100.0)]  # 0.3 s before the fit + 0.3 s first batch: warm-up is 1 batch
    _, forecasts, actual_J, _, errors = run_fit(manual_sampler, clock, trace, epochs=5, first_batch_s=0.3, warmup=1)
    assert forecasts[0].total_J == pytest.approx(actual_J, rel=1e-9)
    assert forecasts[0].J_per_batch == pytest.approx(100.0 * 0.05, rel=1e-9)
    assert not forecasts[0].warmup_included


def test_a_forecast_within_the_first_epoch(manual_sampler, clock):
    fit = SimulatedFit(manual_sampler, clock, WATTS, plan_run(10, max_epochs=2), warmup_batches=2)
    fit.begin_epoch()
    for _ in range(5):
        fit.batch(0.04)
    forecast = fit.tracker.forecast_now(fit.mark(), epoch=0)
    assert forecast.epoch is None and forecast.batches_done == 5
    assert forecast.total_s == pytest.approx(20 * 0.04, rel=1e-9)  # no validation, no gaps: batches only
    assert forecast.total_J == pytest.approx(WATTS * 20 * 0.04, rel=1e-9)


# ---------------------------------------------------------------- ForecastCallback in fits
def fit_with(tmp_path, *callbacks, **overrides):
    trainer = L.Trainer(callbacks=list(callbacks), **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    return trainer


def test_callback_logs_the_forecast_each_epoch_and_reports_errors(tmp_path, capsys):
    forecast = ForecastCallback(sensors=[SimulatedSensor("device", WATTS)])
    carbon = CarbonCallback(intensity_g_per_kWh=200.0, pue=1.1, sensors=[SimulatedSensor("device", WATTS)],
                            verbose=False)
    logger = RecordingLogger(tmp_path)
    trainer = fit_with(tmp_path, carbon, forecast, max_epochs=3, limit_train_batches=0.5, logger=logger)
    assert forecast.report_path == tmp_path / FORECAST_REPORT_FILE  # the logger's log dir
    report = json.loads(forecast.report_path.read_text())
    assert report["plan"]["batches_per_epoch"] == 5 and report["plan"]["total_batches"] == 15
    assert report["warmup_steps"] == 1  # 10 % of 5 batches, at least one
    assert report["actual"]["batches"] == 15 and report["actual"]["epochs"] == 3
    assert [f["epoch"] for f in report["forecasts"]] == [0, 1, 2]
    for f in report["forecasts"]:  # constant power: every joule is WATTS x a second
        assert f["total_J"] == pytest.approx(WATTS * f["total_s"], rel=1e-9)
        assert f["total_gCO2e"] == pytest.approx(f["total_J"] / 3.6e6 * 200.0 * 1.1, rel=1e-12)
    actual = report["actual"]
    assert actual["total_J"] == pytest.approx(WATTS * actual["total_s"], rel=1e-9)
    assert [e["epoch"] for e in report["errors"]] == [0, 1, 2]
    for e, f in zip(report["errors"], report["forecasts"]):
        assert e["error_J"] == pytest.approx(f["total_J"] - actual["total_J"], rel=1e-12, abs=1e-12)
        assert e["error_pct"] == pytest.approx(100 * e["error_J"] / actual["total_J"], rel=1e-12, abs=1e-12)
    # through every logger, once per epoch at the epoch's step; the latest also in the callback metrics
    for key in ("total_J", "total_s", "total_gCO2e"):
        assert logger.values(f"forecast/{key}") == pytest.approx([f[key] for f in report["forecasts"]], rel=1e-12)
        assert float(trainer.callback_metrics[f"forecast/{key}"]) == pytest.approx(
            report["forecasts"][-1][key], rel=1e-6)
    assert logger.steps("forecast/total_J") == [4, 9, 14]  # where Lightning logs its epoch metrics
    assert trainer.progress_bar_metrics["forecast_kJ"] == pytest.approx(report["forecasts"][-1]["total_J"] / 1000)
    out = capsys.readouterr().out
    assert "lightning-energy forecast" in out and "error %" in out


def test_early_stopping_forecast_is_the_worst_case(tmp_path):
    forecast = ForecastCallback(sensors=[SimulatedSensor("device", WATTS)], verbose=False)
    stopper = EarlyStopping(monitor="val/loss", patience=1, min_delta=10.0)  # never improves after the first
    fit_with(tmp_path, forecast, stopper, max_epochs=10)
    report = forecast.report
    assert report["plan"]["early_stopping"] is True and report["plan"]["epochs"] == 10
    assert any("EarlyStopping" in note for note in report["plan"]["notes"])
    assert report["actual"]["epochs"] == 2 and report["ended_before_plan"] is True
    assert all(e["error_J"] > 0 for e in forecast.errors)  # the forecast assumed all 10 epochs


def test_start_after_steps_forecasts_before_the_first_epoch_ends(tmp_path):
    forecast = ForecastCallback(warmup_steps=2, start_after_steps=5, sensors=[SimulatedSensor("device", WATTS)],
                                verbose=False)
    fit_with(tmp_path, forecast, max_epochs=2)
    assert [f["epoch"] for f in forecast.report["forecasts"]] == [None, 0, 1]
    assert forecast.report["forecasts"][0]["batches_done"] == 5


class ProgressBarProbe(L.Callback):
    """After each training batch: what the progress bar shows, what the callback metrics hold and how many
    forecasts the ForecastCallback has made so far."""

    def __init__(self, forecast: ForecastCallback) -> None:
        self.forecast = forecast
        self.seen: list[tuple[int, int, dict, dict, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        shown = trainer.progress_bar_callback.get_metrics(trainer, pl_module)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("forecast/")}
        self.seen.append((trainer.current_epoch, batch_idx, dict(shown), metrics, len(self.forecast.forecasts)))


def test_the_first_forecast_is_in_the_progress_bar_as_soon_as_it_exists(tmp_path):
    forecast = ForecastCallback(warmup_steps=2, start_after_steps=5, sensors=[SimulatedSensor("device", WATTS)],
                                verbose=False)
    probe = ProgressBarProbe(forecast)
    fit_with(tmp_path, forecast, probe, max_epochs=2, enable_progress_bar=True)
    forecasts = forecast.report["forecasts"]
    first, after_epoch_0 = forecasts[:2]
    assert first["batches_done"] == 5 and first["total_J"] != pytest.approx(after_epoch_0["total_J"], rel=1e-9)
    made = [count for *_, count in probe.seen]
    # the forecast at batch 5 at once; the epoch-0 update when epoch 0's figures arrive: once samples cover
    # the epoch's end (within one sampling interval), at a later step's boundary or at the fit's end
    assert made[:4] == [0] * 4 and made[4:10] == [1] * 6
    assert made == sorted(made) and made[-1] <= 2 and len(forecasts) == 3
    for epoch, batch_idx, shown, metrics, count in probe.seen:
        if count == 0:  # before the 5th batch: nothing to show yet
            assert "forecast_kJ" not in shown and not metrics
            continue
        expected = forecasts[count - 1]  # the latest forecast made
        assert float(shown["forecast_kJ"]) == pytest.approx(expected["total_J"] / 1000.0, rel=1e-6)
        assert float(shown["forecast_gCO2e"]) == pytest.approx(expected["total_gCO2e"], rel=1e-6)
        assert metrics["forecast/total_J"] == pytest.approx(expected["total_J"], rel=1e-6)
        assert metrics["forecast/total_s"] == pytest.approx(expected["total_s"], rel=1e-6)
    assert len(probe.seen) == 20


# ---------------------------------------------------------------- budgets
class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def budget_fit(tmp_path, **kwargs):
    forecast = ForecastCallback(sensors=[SimulatedSensor("device", WATTS)], verbose=False, **kwargs)
    trainer = fit_with(tmp_path, forecast, max_epochs=4)
    return trainer, forecast


def test_over_budget_without_a_terminal_stops_instead_of_waiting(tmp_path):
    with pytest.warns(UserWarning, match="no terminal to ask on"):
        trainer, forecast = budget_fit(tmp_path, budget_J=1.0)  # on_budget="ask"; pytest's stdin is no TTY
    assert trainer.current_epoch == 1  # stopped after the first epoch's forecast
    assert forecast.report["budget"]["decision"] == "stop" and forecast.report["budget"]["stopped"] is True


def test_over_budget_asks_on_a_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", FakeTerminal("y\n"))
    trainer, forecast = budget_fit(tmp_path, budget_J=1.0)
    assert "Continue training? [y/N]" in capsys.readouterr().err
    assert trainer.current_epoch == 4 and forecast.report["budget"]["decision"] == "continue"
    monkeypatch.setattr("sys.stdin", FakeTerminal("n\n"))
    trainer, forecast = budget_fit(tmp_path / "second", budget_J=1.0)
    assert trainer.current_epoch == 1 and forecast.report["budget"]["stopped"] is True


def test_on_budget_stop_and_warn(tmp_path):
    with pytest.warns(UserWarning, match=r"over budget: .*gCO2e.*stopping"):
        trainer, _ = budget_fit(tmp_path, budget_gCO2e=1e-9, on_budget="stop")
    assert trainer.current_epoch == 1
    with pytest.warns(UserWarning, match="going on"):
        trainer, forecast = budget_fit(tmp_path / "warn", budget_J=1.0, on_budget="warn")
    assert trainer.current_epoch == 4 and forecast.report["budget"]["stopped"] is False


def test_within_budget_nothing_happens(tmp_path):
    trainer, forecast = budget_fit(tmp_path, budget_J=1e9, on_budget="stop")
    assert trainer.current_epoch == 4 and forecast.report["budget"]["decision"] is None


