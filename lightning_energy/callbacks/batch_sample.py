"""BatchSampleEstimate: the CERN study's full-training estimate from a few measured batches."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_energy.forecast import cern_estimate_J
from lightning_energy.meter import Mark
from lightning_energy.sampler import DEFAULT_INTERVAL_S
from lightning_energy.sensors.base import Sensor, validate_sensors
from lightning_energy.session import MeterSession, open_meter_session

SAMPLE_TAG = "batch_sample"


class BatchSampleEstimate(Callback):
    """Energy per batch averaged over ``n_batches`` training batches x the number of batches trained.

    This is the method of the CERN study (3DGAN on A100: energy per batch over 10 batches x batches),
    kept to compare with the measured total: it leaves out everything between the steps (data
    loading, validation, checkpointing). Each sampled batch is the window from
    ``on_train_batch_start`` to ``on_train_batch_end`` of the first epoch after ``skip_batches``.
    Nothing is logged; after fit read ``batch_J`` (J of each sampled batch), ``batch_J_mean``,
    ``batches`` (trained) and ``estimate_J``. Figures are this rank's.

    Args:
        n_batches: batches to sample (10 in the study).
        skip_batches: batches to leave out before sampling (0: the study's first batches).
        sensors: the sensors to read when no ``EnergyCallback`` is present.
    """

    def __init__(self, n_batches: int = 10, skip_batches: int = 0, sensors: list[Sensor] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        for name, value, low in (("n_batches", n_batches, 1), ("skip_batches", skip_batches, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")
        self.n_batches = n_batches
        self.skip_batches = skip_batches
        self._user_sensors = None if sensors is None else validate_sensors(sensors)
        self.interval_s = interval_s
        self.batch_J: list[float] = []  # energy of each sampled batch (this rank's sensors)
        self.batch_J_mean: float | None = None
        self.sampled = 0
        self.batches = 0
        self.estimate_J: float | None = None
        self._session: MeterSession | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._session is not None or stage != TrainerFn.FITTING:
            return
        self._session = open_meter_session(trainer, self, self._user_sensors, interval_s=self.interval_s)
        self._start: Mark | None = None
        self.batches, self.sampled, self.batch_J_mean, self.estimate_J = 0, 0, None, None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def _sampling(self) -> bool:
        return self.skip_batches <= self.batches < self.skip_batches + self.n_batches

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._sampling():
            self._start = self._session.meter.mark()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        if self._sampling() and self._start is not None:
            self._session.meter.add_window(self._start, self._session.meter.mark(), tag=SAMPLE_TAG,
                                           info=self.batches, keep=True)
            self._start = None
        self.batches += 1

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        meter = self._session.meter
        meter.wait(meter.mark())  # every window queued before is resolved too
        self.batch_J = [m.total_J for _, m in meter.results]
        meter.results.clear()
        if not self.batch_J:
            return
        self.sampled = len(self.batch_J)
        self.batch_J_mean = sum(self.batch_J) / self.sampled
        self.estimate_J = cern_estimate_J(self.batch_J, self.batches)
