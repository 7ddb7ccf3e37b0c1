"""ForecastCallback: the fit's total energy, time and CO2e, predicted early and updated every epoch."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.measure import ranks as distributed
from lightning_energy.carbon import world_average
from lightning_energy.predict.forecast import (
    Forecast, ForecastTracker, ForecastUnavailable, PlannedRun, format_errors, plan_from_trainer,
)
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.lightning_internals import callback_metrics_dict, progress_bar_dict
from lightning_energy.integration.timeline import EpochFigures, StepFigures
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.units import J_PER_KJ, J_PER_KWH

log_info = rank_zero_info_for(__name__)

FORECAST_REPORT_FILE = "forecast_report.json"
DEFAULT_WARMUP_FRACTION = 0.1  # of the first epoch's batches, at least one batch
ON_BUDGET = ("ask", "stop", "warn")


class ForecastCallback(MeteredCallback):
    """Predict the fit's total energy (J), time (s) and CO2e (g) and report how good the forecasts were.

    The first forecast comes when the first epoch has been measured (or after ``start_after_steps``
    training batches); it is updated for every epoch. The planned run is ``max_epochs`` x batches per
    epoch or ``max_steps`` (``limit_train_batches`` honoured); with ``EarlyStopping`` the forecast is the
    worst case, every planned epoch. The first ``warmup_steps`` batches are left out of the rate
    (see :mod:`lightning_energy.predict.forecast` for the model). CO2e uses the intensity and PUE of a
    ``CarbonCallback`` in the same Trainer, else the world average (labelled in the report).

    The figures are the Trainer's timeline's (the windows every suite callback reads): an epoch's
    forecast is made when its figures arrive, a few steps after its end in a single process (at its end
    under DDP, or when a budget is set: then the epoch end waits, bounded, for its samples so that the
    budget is acted on at that epoch's end).

    Logged metrics (summed over ranks; time: slowest rank), through every Lightning logger:

    - ``forecast/total_J``, ``forecast/total_s``, ``forecast/total_gCO2e``: the latest forecast of the
      whole fit, at each epoch's step (and at ``start_after_steps``; also in ``trainer.callback_metrics``).
    - progress bar: ``forecast_kJ``, ``forecast_gCO2e``, from the first forecast on.

    At the end of fit ``forecast_report.json`` in the log dir holds the plan, every forecast and its
    error against the actual totals (forecast - actual, J, s and %); a table is printed with ``verbose``.

    Budget: with ``budget_J`` or ``budget_gCO2e``, a forecast above the budget is acted on once, as
    ``on_budget`` says: ``"ask"`` asks on the terminal whether to go on (without a terminal, e.g. in CI,
    it stops without waiting), ``"stop"`` stops the fit, ``"warn"`` warns and goes on.

    Args:
        warmup_steps: training batches at the start left out of the rate (default: 10 % of the first
            epoch, at least one).
        start_after_steps: also forecast after this many training batches, before the first epoch ends.
        budget_J, budget_gCO2e: limits on the forecast total (> 0).
        on_budget: ``"ask"``, ``"stop"`` or ``"warn"``.
        sensors, backend, interval_s: as for ``EnergyCallback``; with ``sensors=None`` the sensors of an
            ``EnergyCallback`` in the same Trainer are read (wherever it is listed).
        verbose: print the forecast-error table at the end of fit.
    """

    def __init__(
        self,
        warmup_steps: int | None = None,
        start_after_steps: int | None = None,
        budget_J: float | None = None,
        budget_gCO2e: float | None = None,
        on_budget: str = "ask",
        sensors: list[Sensor] | None = None,
        backend: str = "auto",
        interval_s: float = DEFAULT_INTERVAL_S,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        for name, value, low in (("warmup_steps", warmup_steps, 0), ("start_after_steps", start_after_steps, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"`{name}` must be an integer >= {low} or None, got {value!r}")
        if warmup_steps is not None and start_after_steps is not None and start_after_steps <= warmup_steps:
            raise ValueError(f"`start_after_steps` ({start_after_steps}) must be greater than `warmup_steps` "
                             f"({warmup_steps}): the forecast needs batches after warm-up")
        for name, value in (("budget_J", budget_J), ("budget_gCO2e", budget_gCO2e)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not (math.isfinite(value) and value > 0)):
                raise ValueError(f"`{name}` must be a number > 0 or None, got {value!r}")
        if on_budget not in ON_BUDGET:
            raise ValueError(f"`on_budget` must be one of {ON_BUDGET}, got {on_budget!r}")
        self.check_flags(verbose=verbose)
        self.configure_measurement(sensors, backend, interval_s)
        self.warmup_steps = warmup_steps
        self.start_after_steps = start_after_steps
        self.budget_J = budget_J
        self.budget_gCO2e = budget_gCO2e
        self.on_budget = on_budget
        self.verbose = verbose
        self.forecasts: list[Forecast] = []  # every forecast of the current (or last) fit, as made
        self.errors: list[dict] = []
        self.report: dict | None = None
        self.report_path: Path | None = None
        self._tracker: ForecastTracker | None = None

    # ---------------------------------------------------------------- set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.attachment is not None or stage != TrainerFn.FITTING:
            return
        self.attach(trainer, self._user_sensors, self.backend, self.interval_s)
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self.forecasts, self.errors, self.report = [], [], None
        self._tracker = None
        self._plan: PlannedRun | None = None
        self._batches_seen = 0  # training batches ended this fit (counted at once, not when measured)
        self._budget_handled = False
        self._stopped_by_budget = False
        self._budget_decision: str | None = None

    # ---------------------------------------------------------------- fit
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # every callback's setup has run: a CarbonCallback has published its figures wherever it is listed
        carbon = self.attachment.session.published.get("carbon")
        if carbon is not None:
            self._intensity, self._pue = carbon["intensity"], carbon["pue"]
        else:
            self._intensity, self._pue = world_average("no CarbonCallback in the Trainer"), 1.0
        self._g_per_J = self._intensity.g_per_kWh * self._pue / J_PER_KWH  # gCO2e per J, as CarbonCallback's

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        try:
            plan = plan_from_trainer(trainer)
        except ForecastUnavailable as err:
            rank_zero_warn(f"lightning-energy: no forecast: {err}")
            return
        # a resumed fit forecasts what is left of the plan
        done_before = trainer.fit_loop.epoch_loop.batch_progress.total.completed
        epochs_before = trainer.current_epoch
        self._plan = dataclasses.replace(
            plan, total_batches=max(plan.total_batches - done_before, 0),
            epochs=None if plan.epochs is None else max(plan.epochs - epochs_before, 0),
        )
        per_epoch = plan.batches_per_epoch
        if self.warmup_steps is not None:
            warmup = self.warmup_steps
        else:
            warmup = max(1, round(DEFAULT_WARMUP_FRACTION * per_epoch)) if math.isfinite(per_epoch) else 1
        # the sensors counted: this callback's own on every rank (host sensors live on local rank 0 only);
        # collective, like on_train_start itself on every rank
        names = sorted({n for rank in distributed.gather(trainer, self.attachment.sensor_names) for n in rank})
        self._tracker = ForecastTracker(self.timeline.fit_start, self._plan, warmup, self._g_per_J,
                                        merge=lambda local: _merge_ranks(trainer, local), names=names)
        self.forecasts = self._tracker.forecasts

    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        if self._tracker is not None:
            self._tracker.step(figures)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        self._batches_seen += 1
        if self.start_after_steps is None or self._batches_seen != self.start_after_steps or tracker.forecasts:
            return
        # once per fit: a mark now, and every step before it measured (a bounded wait for the samples)
        timeline = self.timeline
        now = self.attachment.meter.wait(timeline.mark())
        timeline.flush(trainer)
        forecast = tracker.forecast_now(now, trainer.current_epoch)
        self._show(trainer, forecast, step=trainer.global_step)
        self._check_budget(trainer, forecast)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A budget is acted on at the epoch's end: the epoch's figures are needed now, not a few steps later.
        # (Under DDP the timeline has measured the epoch already; this then waits for nothing.)
        if self._tracker is not None and self._budget_pending():
            self.timeline.flush(trainer)

    @override
    def on_epoch_measured(self, trainer: Trainer, figures: EpochFigures) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        end_energy, _ = self.attachment.sampler.energy_at(self.attachment.sensor_names, figures.end_s)
        forecast = tracker.epoch(figures, end_energy)
        self._show(trainer, forecast, step=figures.step)
        self._check_budget(trainer, forecast)

    def _show(self, trainer: Trainer, forecast: Forecast, step: int) -> None:
        """The forecast to the loggers (rank zero), into the callback metrics and the progress bar."""
        metrics = self._metrics(forecast)
        self.log_metrics(trainer, metrics, step)
        if not trainer.is_global_zero:
            return
        callback_metrics_dict(trainer).update({name: torch.tensor(value) for name, value in metrics.items()})
        bar = progress_bar_dict(trainer)
        bar["forecast_kJ"] = forecast.total_J / J_PER_KJ
        bar["forecast_gCO2e"] = forecast.total_gCO2e

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the timeline has delivered every step and epoch before this runs
        tracker = self._tracker
        if tracker is None:
            return
        actual_J, actual_s, self.errors = tracker.fit_end(self.timeline.fit_end)
        self.forecasts = list(tracker.forecasts)
        if not trainer.is_global_zero:
            return
        completed = len(tracker.forecaster.epochs)
        self.report = {
            "plan": self._plan.as_dict(),
            "warmup_steps": tracker.warmup_batches,
            "start_after_steps": self.start_after_steps,
            "intensity": self._intensity.as_dict(),
            "pue": self._pue,
            "actual": {"total_J": actual_J, "total_s": actual_s, "total_gCO2e": actual_J * self._g_per_J,
                       "batches": tracker.batches, "epochs": completed},
            "ended_before_plan": self._plan.epochs is not None and completed < self._plan.epochs,
            "budget": {"budget_J": self.budget_J, "budget_gCO2e": self.budget_gCO2e, "on_budget": self.on_budget,
                       "decision": self._budget_decision, "stopped": self._stopped_by_budget},
            "forecasts": [f.as_dict() for f in self.forecasts],
            "errors": self.errors,
        }
        self.report_path = self.write_output(self._log_dir / FORECAST_REPORT_FILE, self.report)
        if self.verbose and self.errors:
            print(format_errors(self.errors, actual_J, actual_s), flush=True)
        else:
            log_info(f"lightning-energy: forecast report written to {self.report_path}")

    @staticmethod
    def _metrics(forecast: Forecast) -> dict[str, float]:
        return {"forecast/total_J": forecast.total_J, "forecast/total_s": forecast.total_s,
                "forecast/total_gCO2e": forecast.total_gCO2e}

    # ---------------------------------------------------------------- budget
    def _budget_pending(self) -> bool:
        return not self._budget_handled and (self.budget_J is not None or self.budget_gCO2e is not None)

    def _check_budget(self, trainer: Trainer, forecast: Forecast) -> None:
        if self._budget_handled:
            return
        over = []
        if self.budget_J is not None and forecast.total_J > self.budget_J:
            over.append(f"{forecast.total_J:.1f} J > budget {self.budget_J:g} J")
        if self.budget_gCO2e is not None and forecast.total_gCO2e > self.budget_gCO2e:
            over.append(f"{forecast.total_gCO2e:.4g} gCO2e > budget {self.budget_gCO2e:g} gCO2e")
        if not over:
            return
        self._budget_handled = True
        message = f"lightning-energy: the forecast for this fit is over budget: {'; '.join(over)}"
        decision = "continue"
        if trainer.is_global_zero:
            if self.on_budget == "warn":
                rank_zero_warn(message + "; going on (on_budget='warn')")
            elif self.on_budget == "stop":
                rank_zero_warn(message + "; stopping (on_budget='stop')")
                decision = "stop"
            else:
                answer = ask_yes_no(message + ". Continue training? [y/N] ")
                if answer is None:
                    rank_zero_warn(message + "; no terminal to ask on (stdin is not a TTY), so stopping. Set "
                                   "on_budget='warn' to go on past the budget without asking.")
                decision = "continue" if answer else "stop"
        decision = trainer.strategy.broadcast(decision, src=0)
        self._budget_decision = decision
        if decision == "stop":
            self._stopped_by_budget = True
            trainer.should_stop = True


def ask_yes_no(question: str) -> bool | None:
    """Ask on the terminal; True for y/yes, False otherwise, None when stdin is not an interactive terminal."""
    stdin = sys.stdin
    try:
        interactive = stdin is not None and stdin.isatty()
    except (AttributeError, ValueError, OSError):
        interactive = False
    if not interactive:
        return None
    print(question, end="", file=sys.stderr, flush=True)
    answer = stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def _merge_ranks(trainer: Trainer, local: dict[str, float]) -> dict[str, float]:
    """Per-rank figures merged: joules (keys ending ``J``) summed, seconds (ending ``s``) the slowest rank's."""
    values = distributed.gather(trainer, local)
    return {key: (max(v[key] for v in values) if key.endswith("s") else sum(v[key] for v in values))
            for key in local}

