"""EnergyPredictionCheck: how far a prediction made before training was from what the fit measured."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.measure import ranks as distributed
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.timeline import StepFigures
from lightning_energy.measure.meter import measure
from lightning_energy.predict.pre_run import EnergyEstimate, compare_prediction
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor

log_info = rank_zero_info_for(__name__)

PREDICTION_FILE = "energy_prediction.json"
SOURCES = ("empirical", "theoretical")


class EnergyPredictionCheck(MeteredCallback):
    """Measure the training steps of a fit and compare them with a prediction per step.

    The measured energy is that of the training steps, summed over ranks: the optimizer steps of the
    Trainer's timeline (forward, backward, optimiser; with gradient accumulation all micro-batches of a
    step; work other callbacks add inside a step left out), the same windows as ``EnergyCallback``'s
    ``energy/step_J``. The prediction is the predicted energy per batch-step x the training batches
    every rank ran. At the end of fit (rank zero, through every logger) it logs ``prediction/predicted_J``,
    ``prediction/measured_J``, ``prediction/error`` ((predicted - measured) / measured, a fraction) and
    ``prediction/steps`` (training batches), and writes ``energy_prediction.json`` (also the fit's whole
    energy and duration, ``fit_J`` and ``fit_s``) in the log dir. ``self.result`` holds the same dict.

    Args:
        prediction: an :class:`~lightning_energy.predict.pre_run.EnergyEstimate` or a step energy in J.
        source: which part of an ``EnergyEstimate`` to check: ``"empirical"`` or ``"theoretical"``.
        sensors: sensors to read instead of those of an ``EnergyCallback`` or the auto-detected ones.
        interval_s: sampling interval requested from the shared sampler (s).
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
        self.configure_measurement(sensors, interval_s=interval_s)
        self.result: dict | None = None
        self._measured_J = 0.0
        self._batches = 0

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        self.attach(trainer, self._user_sensors, interval_s=self.interval_s)
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # trainer.log_dir is collective
        self._measured_J, self._batches = 0.0, 0

    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        energy = figures.measurement.energy_J
        self._measured_J += sum(energy.get(name, 0.0) for name in self.attachment.sensor_names)
        self._batches += figures.batches

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the timeline has delivered every step before this runs; its fit end is resolved
        timeline = self.timeline
        names = self.attachment.sensor_names
        fit = measure(timeline.fit_start, timeline.fit_end)
        local = {"measured_J": self._measured_J, "steps": self._batches,
                 "fit_J": sum(fit.energy_J.get(n, 0.0) for n in names), "seconds": fit.duration_s}
        merged = distributed.merge(distributed.gather(trainer, local))
        if not trainer.is_global_zero:
            return
        if merged["steps"] == 0 or not merged["measured_J"] > 0:
            rank_zero_warn("EnergyPredictionCheck: no training step was measured; nothing to compare")
            return
        self.result = {**compare_prediction(self.predicted_step_J, merged["measured_J"], merged["steps"]),
                       "predicted_step_J": self.predicted_step_J, "source": self.source, "fit_J": merged["fit_J"],
                       "fit_s": merged["seconds"],
                       "sensors": [s.describe() for s in self.attachment.sensors]}
        self.write_output(self._log_dir / PREDICTION_FILE, self.result)
        metrics = {f"prediction/{k}": self.result[k] for k in ("predicted_J", "measured_J", "error", "steps")}
        self.log_metrics(trainer, metrics, trainer.global_step)
        log_info(f"lightning-energy: predicted {self.result['predicted_J']:.4g} J, measured "
                       f"{self.result['measured_J']:.4g} J over {self.result['steps']} steps "
                       f"(error {self.result['error']:+.1%})")
