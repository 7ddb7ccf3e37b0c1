"""ForecastCallback: the fit's total energy, time and CO2e, predicted early and updated every epoch."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_energy import distributed
from lightning_energy.carbon import JOULES_PER_KWH, world_average
from lightning_energy.forecast import (
    Forecast, ForecastTracker, ForecastUnavailable, PlannedRun, format_errors, plan_from_trainer,
)
from lightning_energy.io import atomic_write_json
from lightning_energy.meter import Mark
from lightning_energy.sampler import DEFAULT_INTERVAL_S, MIN_INTERVAL_S
from lightning_energy.sensors.base import Sensor, validate_sensors
from lightning_energy.sensors.detect import BACKENDS
from lightning_energy.session import MeterSession, open_meter_session

FORECAST_REPORT_FILE = "forecast_report.json"
DEFAULT_WARMUP_FRACTION = 0.1  # of the first epoch's batches, at least one batch
ON_BUDGET = ("ask", "stop", "warn")


class ForecastCallback(Callback):
    """Predict the fit's total energy (J), time (s) and CO2e (g) and report how good the forecasts were.

    The first forecast comes when the first epoch ends (or after ``start_after_steps`` training
    batches); it is updated at every epoch end. The planned run is ``max_epochs`` x batches per epoch
    or ``max_steps`` (``limit_train_batches`` honoured); with ``EarlyStopping`` the forecast is the
    worst case, every planned epoch. The first ``warmup_steps`` batches are left out of the rate
    (see :mod:`lightning_energy.forecast` for the model). CO2e uses the intensity and PUE of a
    ``CarbonCallback`` in the same Trainer, else the world average (labelled in the report).

    Logged metrics (summed over ranks; time: slowest rank):

    - ``forecast/total_J``, ``forecast/total_s``, ``forecast/total_gCO2e``: the latest forecast of the
      whole fit, at each epoch end (and at ``start_after_steps``; also in ``trainer.callback_metrics``).
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
        sensors, backend, interval_s: as for ``EnergyCallback``; unused when an ``EnergyCallback`` listed
            before this callback in the Trainer is present (its sensors are shared).
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
        if not isinstance(verbose, bool):
            raise TypeError(f"`verbose` must be a bool, got {type(verbose).__name__}")
        self._user_sensors = None if sensors is None else validate_sensors(sensors)
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s >= MIN_INTERVAL_S:
            raise ValueError(f"`interval_s` must be a number >= {MIN_INTERVAL_S} s, got {interval_s!r}")
        self.warmup_steps = warmup_steps
        self.start_after_steps = start_after_steps
        self.budget_J = budget_J
        self.budget_gCO2e = budget_gCO2e
        self.on_budget = on_budget
        self.backend = backend
        self.interval_s = float(interval_s)
        self.verbose = verbose
        self.forecasts: list[Forecast] = []
        self.errors: list[dict] = []
        self.report: dict | None = None
        self.report_path: Path | None = None
        self._session: MeterSession | None = None
        self._tracker: ForecastTracker | None = None

    # ---------------------------------------------------------------- set-up and tear-down
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._session is not None or stage != TrainerFn.FITTING:
            return
        self._session = open_meter_session(trainer, self, self._user_sensors, self.backend, self.interval_s)
        for note in self._session.notes:  # only when this callback detected sensors itself
            rank_zero_warn(note)
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        carbon = _carbon_callback(trainer)
        if carbon is not None:
            self._g_per_J, self._intensity, self._pue = carbon.g_per_J, carbon.intensity, carbon.pue
        else:
            self._intensity, self._pue = world_average("no CarbonCallback in the Trainer"), 1.0
            self._g_per_J = self._intensity.g_per_kWh / JOULES_PER_KWH
        self.forecasts, self.errors, self.report = [], [], None
        self._tracker: ForecastTracker | None = None
        self._plan: PlannedRun | None = None
        self._fit_start: Mark | None = None
        self._budget_handled = False
        self._stopped_by_budget = False
        self._budget_decision: str | None = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    # ---------------------------------------------------------------- fit
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        meter = self._session.meter
        self._fit_start = meter.wait(meter.mark())

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
        self._tracker = ForecastTracker(self._session.meter, self._fit_start, self._plan, warmup, self._g_per_J,
                                        merge=lambda local: _merge_ranks(trainer, local))

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._tracker is not None:
            self._tracker.epoch_start()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        tracker.batch_end()
        if self.start_after_steps is not None and tracker.batches == self.start_after_steps and not tracker.forecasts:
            forecast = tracker.forecast_now()
            if trainer.is_global_zero:  # straight to the loggers: a step log would wait for log_every_n_steps
                for logger in trainer.loggers:
                    logger.log_metrics(self._metrics(forecast), step=trainer.global_step)
            self._show(pl_module, forecast, logger=False, on_step=True)
            self._check_budget(trainer, forecast)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._tracker is not None and not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self._tracker.validation_start()

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._tracker is not None and not trainer.sanity_checking:
            self._tracker.validation_end()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._tracker is None:
            return
        forecast = self._tracker.epoch_end(trainer.current_epoch)
        self._show(pl_module, forecast, logger=True, on_step=False)
        self._check_budget(trainer, forecast)

    def _show(self, pl_module: LightningModule, forecast: Forecast, logger: bool, on_step: bool) -> None:
        """The forecast in the callback metrics (and the loggers if ``logger``) and the progress bar."""
        for name, value in self._metrics(forecast).items():
            pl_module.log(name, value, logger=logger, on_step=on_step, on_epoch=not on_step, batch_size=1,
                          rank_zero_only=True)
        pl_module.log("forecast_kJ", forecast.total_J / 1000.0, prog_bar=True, logger=False, on_step=on_step,
                      on_epoch=not on_step, batch_size=1, rank_zero_only=True)
        pl_module.log("forecast_gCO2e", forecast.total_gCO2e, prog_bar=True, logger=False, on_step=on_step,
                      on_epoch=not on_step, batch_size=1, rank_zero_only=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        actual_J, actual_s, self.errors = tracker.fit_end()
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
        self.report_path = atomic_write_json(self._log_dir / FORECAST_REPORT_FILE, self.report)
        if self.verbose and self.errors:
            print(format_errors(self.errors, actual_J, actual_s), flush=True)
        else:
            rank_zero_info(f"lightning-energy: forecast report written to {self.report_path}")

    @staticmethod
    def _metrics(forecast: Forecast) -> dict[str, float]:
        return {"forecast/total_J": forecast.total_J, "forecast/total_s": forecast.total_s,
                "forecast/total_gCO2e": forecast.total_gCO2e}

    # ---------------------------------------------------------------- budget
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


def _carbon_callback(trainer: Trainer):
    from lightning_energy.callbacks.carbon import CarbonCallback

    return next((c for c in trainer.callbacks if isinstance(c, CarbonCallback)), None)
