"""EnergyPredictionCheck: how far a prediction made before training was from what the fit measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_energy import distributed
from lightning_energy.io import atomic_write_json
from lightning_energy.meter import Mark, measure
from lightning_energy.prediction import EnergyEstimate, compare_prediction
from lightning_energy.sampler import DEFAULT_INTERVAL_S
from lightning_energy.sensors.base import Sensor, validate_sensors
from lightning_energy.session import open_meter_session

PREDICTION_FILE = "energy_prediction.json"
SOURCES = ("empirical", "theoretical")


class EnergyPredictionCheck(Callback):
    """Measure the training steps of a fit and compare them with a prediction per step.

    The measured energy is that of the training steps (``on_train_batch_start`` to
    ``on_train_batch_end``: forward, backward, optimiser), summed over ranks; the prediction is the
    predicted energy per step x the steps every rank ran. At the end of fit (rank zero) it logs
    ``prediction/predicted_J``, ``prediction/measured_J``, ``prediction/error`` ((predicted - measured)
    / measured, a fraction) and ``prediction/steps``, and writes ``energy_prediction.json`` (also the
    fit's whole energy and duration, ``fit_J`` and ``fit_s``) in the log dir. ``self.result`` holds the same dict.

    Args:
        prediction: an :class:`~lightning_energy.prediction.EnergyEstimate` or a step energy in J.
        source: which part of an ``EnergyEstimate`` to check: ``"empirical"`` or ``"theoretical"``.
        sensors: sensors to read instead of those of an ``EnergyCallback`` or the auto-detected ones.
    """

    def __init__(self, prediction: EnergyEstimate | float, source: str = "empirical",
                 sensors: list[Sensor] | None = None, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"`source` must be one of {SOURCES}, got {source!r}")
        if isinstance(prediction, EnergyEstimate):
            part = prediction.empirical if source == "empirical" else prediction.theoretical
            if part is None:
                raise ValueError("`prediction` has no empirical part (estimated with empirical=False); "
                                 "use source='theoretical' or estimate with the benchmarks")
            step_J = part.step_J
        elif isinstance(prediction, (int, float)) and not isinstance(prediction, bool) and prediction > 0:
            step_J = float(prediction)
        else:
            raise TypeError(f"`prediction` must be an EnergyEstimate or a step energy in J > 0, got {prediction!r}")
        self.predicted_step_J = step_J
        self.source = source
        self._user_sensors = None if sensors is None else validate_sensors(sensors)
        self.interval_s = interval_s
        self.result: dict | None = None
        self._session = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self._session is not None:
            return
        self._session = open_meter_session(trainer, self, self._user_sensors, interval_s=self.interval_s)
        for note in self._session.notes:
            rank_zero_warn(note)
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # trainer.log_dir is collective
        self._fit_start: Mark | None = None
        self._step_start: Mark | None = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            session.close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = self._session.meter.mark()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_start = self._session.meter.mark()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        meter = self._session.meter
        meter.add_window(self._step_start, meter.mark(), tag="steps")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        meter = self._session.meter
        end = meter.wait(meter.mark())
        steps = meter.totals.get("steps")
        fit = measure(self._fit_start, end)
        local = {"measured_J": steps.total_J if steps else 0.0, "steps": steps.count if steps else 0,
                 "fit_J": fit.total_J, "seconds": fit.duration_s}
        merged = distributed.merge(distributed.gather(trainer, local))
        if not trainer.is_global_zero:
            return
        if merged["steps"] == 0 or not merged["measured_J"] > 0:
            rank_zero_warn("EnergyPredictionCheck: no training step was measured; nothing to compare")
            return
        self.result = {**compare_prediction(self.predicted_step_J, merged["measured_J"], merged["steps"]),
                       "predicted_step_J": self.predicted_step_J, "source": self.source, "fit_J": merged["fit_J"],
                       "fit_s": merged["seconds"],
                       "sensors": [s.describe() for s in self._session.sensors]}
        atomic_write_json(self._log_dir / PREDICTION_FILE, self.result)
        metrics = {f"prediction/{k}": self.result[k] for k in ("predicted_J", "measured_J", "error", "steps")}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(f"lightning-energy: predicted {self.result['predicted_J']:.4g} J, measured "
                       f"{self.result['measured_J']:.4g} J over {self.result['steps']} steps "
                       f"(error {self.result['error']:+.1%})")
