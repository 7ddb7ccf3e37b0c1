"""EnergyToAccuracy: the energy and time a run needs to reach a target validation metric (Zeus's ETA and TTA)."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.measure import ranks as distributed
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.lightning_internals import batches_that_stepped
from lightning_energy.measure.meter import Mark, measure
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor

log_info = rank_zero_info_for(__name__)

MODES = ("min", "max")
PUBLISHED_NAME = "energy_to_accuracy"  # result and gave_up on the run's board (see the class docstring)


def metric_value(trainer: Trainer, monitor: str) -> float | None:
    value = trainer.callback_metrics.get(monitor)
    return None if value is None else float(value)


class EnergyToAccuracy(MeteredCallback):
    """Log the energy and time from the start of training until ``monitor`` first reaches ``target``.

    Zeus calls these ETA (energy-to-accuracy) and TTA (time-to-accuracy); its batch-size optimizer's cost
    is ``eta*ETA + (1-eta)*MaxPower*TTA``. Checked after every validation run of ``fit``. The window runs
    from the fit's start (the Trainer's timeline, shared with the suite's other callbacks) to the end of
    the validation run that reached the target: energy of this callback's sensors (those of an
    ``EnergyCallback`` in the same Trainer, or auto-detected, when ``sensors`` is None) summed over ranks,
    time of the slowest rank. Nothing waits per validation; the one run that reaches the target waits
    (bounded) for the samples to cover its end. Both figures continue across a resume from checkpoint:
    a checkpoint keeps the energy and time up to when it was saved.

    Logged once, when reached (rank zero, through every logger): ``energy_to_target_J``,
    ``time_to_target_s``, ``epochs_to_target`` (validation runs of fit so far, counting the one that
    reached it). Also kept in :attr:`result`. With ``stop=True`` training ends there.

    Other callbacks of the same Trainer (``CatalogCallback``) find :attr:`result` and :attr:`gave_up` on
    the run's board (``session.published``, :class:`lightning_energy.core.published.Published`) under the
    name ``"energy_to_accuracy"`` as ``{"result": dict | None, "gave_up": dict | None}``: published at
    setup and again whenever either changes (reached, given up, restored from a checkpoint).

    A budget gives up on a run that has not reached the target: after a validation run whose figures so
    far (energy of all ranks, time of the slowest; read without waiting, so up to one sampling interval
    old) pass ``budget_J`` or ``budget_s``, training ends and :attr:`gave_up` holds those figures. Zeus's
    batch-size optimizer stops a trial the same way once its cost passes ``beta`` times the best cost of
    a finished one; the budget is checked at validation, so a run overshoots it by up to one epoch.

    Args:
        monitor: the validation metric (a key of ``trainer.callback_metrics``), e.g. ``"val/acc"``.
        target: the value to reach.
        mode: ``"max"`` (reached when ``>= target``) or ``"min"`` (``<= target``).
        stop: end training once reached.
        budget_J: give up (end training) once the fit has used more energy than this (J) without
            reaching the target; None: no energy budget.
        budget_s: the same for time (s).
        sensors: the sensors to read when no ``EnergyCallback`` shares its own.
        interval_s: sampling interval requested from the shared sampler (s).
    """

    def __init__(self, monitor: str, target: float, mode: str = "max", stop: bool = False,
                 sensors: list[Sensor] | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 budget_J: float | None = None, budget_s: float | None = None) -> None:
        super().__init__()
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"`monitor` must be a metric name, got {monitor!r}")
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target):
            raise ValueError(f"`target` must be a finite number, got {target!r}")
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        for name, budget in (("budget_J", budget_J), ("budget_s", budget_s)):
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                       or not budget > 0 or not math.isfinite(budget)):
                raise ValueError(f"`{name}` must be a finite number > 0 or None, got {budget!r}")
        self.check_flags(stop=stop)
        self.budget_J = None if budget_J is None else float(budget_J)
        self.budget_s = None if budget_s is None else float(budget_s)
        self.gave_up: dict | None = None  # the figures so far when a budget ended the run
        self.monitor, self.target, self.mode, self.stop = monitor, float(target), mode, stop
        self.configure_measurement(sensors, interval_s=interval_s)
        self.result: dict | None = None
        self._resumed = {"energy_J": 0.0, "time_s": 0.0, "validations": 0}
        self._validations = 0
        self._trainer: Trainer | None = None  # while attached: state_dict gathers over its ranks
        self._final_state: dict | None = None
        self._warned = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, target=self.target, mode=self.mode)

    def reached(self, value: float) -> bool:
        return value >= self.target if self.mode == "max" else value <= self.target

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        self.attach(trainer, self._user_sensors, interval_s=self.interval_s)
        self._trainer = trainer
        self._validations = 0
        self._final_state = None
        self.gave_up = None
        self._publish()

    def _publish(self) -> None:
        """Offer :attr:`result` and :attr:`gave_up` to the Trainer's other callbacks (while attached)."""
        if self.attachment is not None:
            self.attachment.session.published.publish(PUBLISHED_NAME, {"result": self.result, "gave_up": self.gave_up})

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        self._trainer = None

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        timeline = self.timeline
        if (trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or timeline is None
                or timeline.fit_start is None):
            return
        self._validations += 1
        if self.result is not None:
            return
        # rank zero's value decides on every rank: a metric logged without sync_dist differs across ranks,
        # and the ranks must agree to measure together (a collective) and to stop together
        value = trainer.strategy.broadcast(metric_value(trainer, self.monitor), src=0)
        if value is None:
            if not self._warned:
                self._warned = True
                rank_zero_warn(f"EnergyToAccuracy: metric {self.monitor!r} is not logged; logged: "
                               f"{sorted(trainer.callback_metrics)}")
            return
        if not self.reached(value):
            self._check_budget(trainer, value)
            return
        # the instant the target is known is no boundary of the timeline: one mark of our own, once per run
        end = self.attachment.meter.wait(timeline.mark())
        energy_J, time_s = self._since_fit_start(trainer, measure(timeline.fit_start, end))
        self.result = {
            "energy_to_target_J": self._resumed["energy_J"] + energy_J,
            "time_to_target_s": self._resumed["time_s"] + time_s,
            "epochs_to_target": self._resumed["validations"] + self._validations,
            "metric": value,
            "target": self.target,
        }
        self._publish()
        log_info(f"EnergyToAccuracy: {self.monitor} = {value:g} reached {self.target:g} after "
                       f"{self.result['energy_to_target_J']:.1f} J and {self.result['time_to_target_s']:.1f} s")
        metrics = {k: float(self.result[k]) for k in ("energy_to_target_J", "time_to_target_s", "epochs_to_target")}
        self.log_metrics(trainer, metrics, batches_that_stepped(trainer))
        if self.stop:
            trainer.should_stop = True

    def _check_budget(self, trainer: Trainer, value: float) -> None:
        """End the run when its energy or time so far passes a budget (a collective: every rank calls it)."""
        if self.budget_J is None and self.budget_s is None:
            return
        state = self._state(trainer)
        over = [f"{what} {spent:.4g} {unit} > budget {budget:.4g} {unit}"
                for what, spent, budget, unit in (("energy", state["energy_J"], self.budget_J, "J"),
                                                  ("time", state["time_s"], self.budget_s, "s"))
                if budget is not None and spent > budget]
        if not over:
            return
        self.gave_up = {"energy_J": state["energy_J"], "time_s": state["time_s"],
                        "epochs": state["validations"], "metric": value, "target": self.target,
                        "reason": "; ".join(over)}
        self._publish()
        log_info(f"EnergyToAccuracy: {self.monitor} = {value:g} has not reached {self.target:g}: "
                       f"{self.gave_up['reason']}; training ends")
        trainer.should_stop = True

    def _since_fit_start(self, trainer: Trainer, m) -> tuple[float, float]:
        """(J of all ranks, s of the slowest rank) of this rank's window ``m``: a collective."""
        names = self.attachment.sensor_names
        rows = distributed.gather(trainer, (sum(m.energy_J.get(n, 0.0) for n in names), m.duration_s))
        return sum(r[0] for r in rows), max(r[1] for r in rows)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._final_state = self._state(trainer, self.timeline.fit_end)  # for a checkpoint saved after the fit

    # ---------------------------------------------------------------- resume
    def _state(self, trainer: Trainer, until: Mark | None = None) -> dict[str, Any]:
        """Energy and time from the fit's start up to now (or ``until``), without waiting: a collective."""
        so_far = self.timeline.so_far(self.attachment.sensor_names, until)
        rows = distributed.gather(trainer, (so_far["fit_J"], so_far["duration_s"]))
        return {
            "energy_J": self._resumed["energy_J"] + sum(r[0] for r in rows),
            "time_s": self._resumed["time_s"] + max(r[1] for r in rows),
            "validations": self._resumed["validations"] + self._validations,
            "result": self.result,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        """Energy (J, all ranks) and time (s, slowest rank) since training began, up to the checkpoint.

        Does not wait (the figures reach the latest samples, extrapolated by one sampling interval at
        most). Collective under DDP, as Lightning saves checkpoints on every rank.
        """
        if self.attachment is not None and self._trainer is not None and self.timeline.fit_start is not None:
            return self._state(self._trainer)
        if self._final_state is not None:
            return {**self._final_state, "result": self.result}
        return {**self._resumed, "result": self.result}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = {k: state_dict.get(k, 0) for k in ("energy_J", "time_s", "validations")}
        self.result = state_dict.get("result")
        self._publish()
