"""BatchSampleEstimate: the CERN study's full-training estimate from a few measured batches."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_energy.predict.forecast import cern_estimate_J
from lightning_energy.integration.base import MeteredCallback
from lightning_energy.integration.timeline import StepFigures
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor


class BatchSampleEstimate(MeteredCallback):
    """Energy per batch averaged over ``n_batches`` training batches x the number of batches trained.

    This is the method of the CERN study (3DGAN on A100: energy per batch over 10 batches x batches),
    kept to compare with the measured total: it leaves out everything between the steps (data
    loading, validation, checkpointing). The sampled batches are the training batches ``skip_batches``
    to ``skip_batches + n_batches - 1`` of the fit, measured as the Trainer's timeline measures its
    optimizer steps (the windows of ``EnergyCallback``'s ``energy/step_J``; work other callbacks add
    inside a step left out); with gradient accumulation a step's energy is shared equally among its
    batches. Nothing is logged; after fit read ``batch_J`` (J of each sampled batch), ``batch_J_mean``,
    ``batches`` (trained) and ``estimate_J``. Figures are this rank's.

    Args:
        n_batches: batches to sample (10 in the study).
        skip_batches: batches to leave out before sampling (0: the study's first batches).
        sensors: the sensors to read when no ``EnergyCallback`` is present.
        interval_s: sampling interval requested from the shared sampler (s).
    """

    def __init__(self, n_batches: int = 10, skip_batches: int = 0, sensors: list[Sensor] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        for name, value, low in (("n_batches", n_batches, 1), ("skip_batches", skip_batches, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")
        self.n_batches = n_batches
        self.skip_batches = skip_batches
        self.configure_measurement(sensors, interval_s=interval_s)
        self.batch_J: list[float] = []  # energy of each sampled batch (this rank's sensors)
        self.batch_J_mean: float | None = None
        self.sampled = 0
        self.batches = 0
        self.estimate_J: float | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.attachment is not None or stage != TrainerFn.FITTING:
            return
        self.attach(trainer, self._user_sensors, interval_s=self.interval_s)
        self.batch_J, self.batches, self.sampled, self.batch_J_mean, self.estimate_J = [], 0, 0, None, None

    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        first, self.batches = self.batches, self.batches + figures.batches
        low, high = self.skip_batches, self.skip_batches + self.n_batches
        sampled = min(self.batches, high) - max(first, low)
        if sampled > 0:
            energy = figures.measurement.energy_J
            step_J = sum(energy.get(name, 0.0) for name in self.attachment.sensor_names)
            self.batch_J.extend([step_J / figures.batches] * sampled)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the timeline has delivered every step before this runs
        if not self.batch_J:
            return
        self.sampled = len(self.batch_J)
        self.batch_J_mean = sum(self.batch_J) / self.sampled
        self.estimate_J = cern_estimate_J(self.batch_J, self.batches)
