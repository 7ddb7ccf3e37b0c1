"""EnergyToAccuracy: the energy and time a run needs to reach a target validation metric (Zeus's ETA and TTA)."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_energy import distributed
from lightning_energy.meter import Mark, measure
from lightning_energy.sampler import DEFAULT_INTERVAL_S
from lightning_energy.sensors.base import Sensor, validate_sensors
from lightning_energy.session import MeterSession, open_meter_session

MODES = ("min", "max")


class SinceTrainStart:
    """Energy (J, all ranks) and time (s, slowest rank) from the start of training, read at epoch-level points."""

    def __init__(self, session: MeterSession, energy_sensors: list[str] | None = None) -> None:
        self.session = session
        self.energy_sensors = energy_sensors
        self.start: Mark | None = None

    def begin(self) -> None:
        self.start = self.session.meter.wait(self.session.meter.mark())

    def read(self, trainer: Trainer) -> tuple[float, float]:
        """Waits for a mark now (per-epoch use) and gathers over ranks: a collective, all ranks call it."""
        end = self.session.meter.wait(self.session.meter.mark())
        m = measure(self.start, end)
        names = self.energy_sensors if self.energy_sensors is not None else list(m.energy_J)
        rows = distributed.gather(trainer, (sum(m.energy_J.get(n, 0.0) for n in names), m.duration_s))
        return sum(r[0] for r in rows), max(r[1] for r in rows)


def metric_value(trainer: Trainer, monitor: str) -> float | None:
    value = trainer.callback_metrics.get(monitor)
    return None if value is None else float(value)


class EnergyToAccuracy(Callback):
    """Log the energy and time from the start of training until ``monitor`` first reaches ``target``.

    Zeus calls these ETA (energy-to-accuracy) and TTA (time-to-accuracy); its batch-size optimizer's cost
    is ``eta*ETA + (1-eta)*MaxPower*TTA``. Checked after every validation run of ``fit`` (waiting for the
    meter there, once per validation). Energy is every sensor of this suite's shared meter on every rank
    (summed), time is the slowest rank's; both continue across a resume from checkpoint.

    Logged once, when reached (rank zero): ``energy_to_target_J``, ``time_to_target_s``,
    ``epochs_to_target`` (validation runs of fit so far, counting the one that reached it). Also kept in
    :attr:`result`. With ``stop=True`` training ends there.

    Args:
        monitor: the validation metric (a key of ``trainer.callback_metrics``), e.g. ``"val/acc"``.
        target: the value to reach.
        mode: ``"max"`` (reached when ``>= target``) or ``"min"`` (``<= target``).
        stop: end training once reached.
        sensors: the sensors to read when no ``EnergyCallback`` shares its own.
    """

    def __init__(self, monitor: str, target: float, mode: str = "max", stop: bool = False,
                 sensors: list[Sensor] | None = None, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"`monitor` must be a metric name, got {monitor!r}")
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target):
            raise ValueError(f"`target` must be a finite number, got {target!r}")
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        if not isinstance(stop, bool):
            raise TypeError(f"`stop` must be a bool, got {type(stop).__name__}")
        self.monitor, self.target, self.mode, self.stop = monitor, float(target), mode, stop
        self._user_sensors = None if sensors is None else validate_sensors(sensors)
        self.interval_s = interval_s
        self.result: dict | None = None
        self._session: MeterSession | None = None
        self._resumed = {"energy_J": 0.0, "time_s": 0.0, "validations": 0}
        self._validations = 0
        self._last = (0.0, 0.0)
        self._clock: SinceTrainStart | None = None
        self._warned = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, target=self.target, mode=self.mode)

    def reached(self, value: float) -> bool:
        return value >= self.target if self.mode == "max" else value <= self.target

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self._session is not None:
            return
        self._session = open_meter_session(trainer, self, self._user_sensors, interval_s=self.interval_s)
        self._clock = SinceTrainStart(self._session)
        self._validations = 0
        self._last = (0.0, 0.0)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock.begin()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or self._clock is None or self._clock.start is None:
            return
        self._validations += 1
        energy_J, time_s = self._clock.read(trainer)
        self._last = (energy_J, time_s)
        if self.result is not None:
            return
        value = metric_value(trainer, self.monitor)
        if value is None:
            if not self._warned:
                self._warned = True
                rank_zero_warn(f"EnergyToAccuracy: metric {self.monitor!r} is not logged; logged: "
                               f"{sorted(trainer.callback_metrics)}")
            return
        if not self.reached(value):
            return
        self.result = {
            "energy_to_target_J": self._resumed["energy_J"] + energy_J,
            "time_to_target_s": self._resumed["time_s"] + time_s,
            "epochs_to_target": self._resumed["validations"] + self._validations,
            "metric": value,
            "target": self.target,
        }
        rank_zero_info(f"EnergyToAccuracy: {self.monitor} = {value:g} reached {self.target:g} after "
                       f"{self.result['energy_to_target_J']:.1f} J and {self.result['time_to_target_s']:.1f} s")
        if trainer.is_global_zero:
            metrics = {k: float(self.result[k]) for k in ("energy_to_target_J", "time_to_target_s", "epochs_to_target")}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)
        if self.stop:
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {
            "energy_J": self._resumed["energy_J"] + self._last[0],
            "time_s": self._resumed["time_s"] + self._last[1],
            "validations": self._resumed["validations"] + self._validations,
            "result": self.result,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = {k: state_dict.get(k, 0) for k in ("energy_J", "time_s", "validations")}
        self.result = state_dict.get("result")
