"""The base class of the suite's callbacks: the session's life cycle, the timeline's boundaries, logging.

A subclass writes its hooks as usual. Every boundary hook (``on_fit_start``, ``on_train_epoch_start``,
``on_train_batch_start``/``_end``, ``on_train_epoch_end``, the validation/test/predict epoch hooks,
``on_fit_end``) first reports the boundary to the Trainer's timeline, whether the subclass overrides the
hook or not: :meth:`MeteredCallback.__init_subclass__` wraps overrides. Whichever suite callback comes
first in ``Trainer(callbacks=[...])`` places the mark; callback order no longer changes a figure.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path
from typing import Any, Callable

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_energy.core.run import checked_interval, checked_sensors
from lightning_energy.integration import session as sessions
from lightning_energy.integration.lightning_internals import summary_file_writer, tensorboard_tag_prefix
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor


def _report(boundary: Callable) -> Callable:
    """Make a hook report ``boundary(timeline, trainer, *args)`` before its own work."""

    def wrap(hook: Callable) -> Callable:
        @functools.wraps(hook)
        def reporting_hook(self, trainer, pl_module, *args, **kwargs):
            timeline = self.__dict__.get("_timeline")  # per step: no property chain
            if timeline is not None:
                boundary(timeline, trainer, *args)
            return hook(self, trainer, pl_module, *args, **kwargs)

        reporting_hook._reports_boundary = True
        return reporting_hook

    return wrap


def _nothing(self, trainer, pl_module, *args, **kwargs) -> None:
    return None


BOUNDARIES: dict[str, Callable] = {
    "on_fit_start": lambda tl, trainer: tl.fit_started(trainer),
    "on_train_start": lambda tl, trainer: tl.train_started(trainer),
    "on_train_epoch_start": lambda tl, trainer: tl.train_epoch_started(trainer),
    "on_train_batch_start": lambda tl, trainer, batch, batch_idx, *_: tl.batch_started(trainer, batch_idx),
    "on_train_batch_end": lambda tl, trainer, outputs, batch, batch_idx, *_: tl.batch_ended(trainer, batch_idx),
    "on_train_epoch_end": lambda tl, trainer: tl.train_epoch_ended(trainer),
    "on_validation_epoch_start": lambda tl, trainer: tl.loop_started(trainer, "val"),
    "on_validation_epoch_end": lambda tl, trainer: tl.loop_ended(trainer, "val"),
    "on_test_epoch_start": lambda tl, trainer: tl.loop_started(trainer, "test"),
    "on_test_epoch_end": lambda tl, trainer: tl.loop_ended(trainer, "test"),
    "on_predict_epoch_start": lambda tl, trainer: tl.loop_started(trainer, "predict"),
    "on_predict_epoch_end": lambda tl, trainer: tl.loop_ended(trainer, "predict"),
    "on_fit_end": lambda tl, trainer: tl.fit_ended(trainer),
}


class MeteredCallback(Callback):
    """Base of the suite's callbacks: attach/detach, boundaries, argument checks, logging.

    Subclasses call :meth:`attach` in ``setup`` (it subscribes them to the timeline's figures when they
    define ``on_step_measured``/``on_loop_measured``/``on_epoch_measured``) and get :meth:`detach` on
    ``teardown`` and ``on_exception`` (call ``super()`` when overriding them).
    """

    provides_default_sensors = False  # True: callbacks with sensors=None read this one's sensors

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook_name, boundary in BOUNDARIES.items():
            hook = cls.__dict__.get(hook_name)
            if hook is not None and not getattr(hook, "_reports_boundary", False):
                setattr(cls, hook_name, _report(boundary)(hook))

    @property
    def timeline(self):
        """The Trainer's timeline while attached, else None."""
        return self.__dict__.get("_timeline")

    @property
    def attachment(self):
        return self.__dict__.get("_attachment")

    @property
    def user_sensors(self) -> list[Sensor] | None:
        """The sensors given at construction (None: auto-detected)."""
        return self.__dict__.get("_user_sensors")

    # ------------------------------------------------------------------ life cycle
    def attach(self, trainer, sensors: list[Sensor] | None = None, backend: str = "auto",
               interval_s: float = DEFAULT_INTERVAL_S, cuda_events: bool = True):
        """Join the Trainer's measurement session (idempotent); warns once about what cannot be measured."""
        if self.attachment is not None:
            return self.attachment
        attachment = self._attachment = sessions.attach(trainer, self, sensors, backend, interval_s, cuda_events)
        self._timeline = attachment.timeline
        for note in attachment.notes:
            rank_zero_warn(note)
        if any(hasattr(self, name) for name in ("on_step_measured", "on_loop_measured", "on_epoch_measured")):
            attachment.timeline.subscribe(self)
        return attachment

    def detach(self, trainer=None) -> None:
        attachment = self.__dict__.pop("_attachment", None)
        self.__dict__.pop("_timeline", None)
        if attachment is None:
            return
        attachment.timeline.unsubscribe(self)
        sessions.detach(attachment)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.release(trainer, stage=stage, exception=None)
        self.detach(trainer)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.release(trainer, stage=None, exception=exception)
        self.detach(trainer)

    def release(self, trainer, stage: str | None, exception: BaseException | None) -> None:
        """Free what this callback holds at the end of a run, before the session is detached.

        Called once per run: by ``teardown`` (``stage`` is "fit", "validate", ... and ``exception`` None) or,
        when the run fails, by ``on_exception`` (``stage`` None; Lightning then calls no ``teardown``).
        Subclasses override this instead of both hooks.
        """

    # ------------------------------------------------------------------ listeners (overridable)
    def on_step_measured(self, trainer, figures) -> None:
        """A step's figures, on the training thread (this rank's sensors)."""

    def on_loop_measured(self, trainer, figures) -> None:
        """A validation / test / predict loop's all-rank figures."""

    def on_epoch_measured(self, trainer, figures) -> None:
        """A training epoch's all-rank figures."""

    # ------------------------------------------------------------------ logging
    @staticmethod
    def log_metrics(trainer, metrics: dict[str, float], step: int) -> None:
        """Log through every Lightning logger, from rank zero (figures are already all-rank where named so).

        Not ``pl_module.log``: the figures are not per-batch values to reduce, they would print in
        ``validate()``/``test()`` result tables, and they are delivered after their boundary.
        """
        if trainer.is_global_zero and metrics:
            for logger in trainer.loggers:
                if not _tensorboard_event(logger, metrics, step):
                    logger.log_metrics(metrics, step=step)

    # ------------------------------------------------------------------ argument checks
    def configure_measurement(self, sensors, backend: str = "auto", interval_s: float = DEFAULT_INTERVAL_S) -> None:
        """Check and keep the measuring arguments every suite callback takes: ``sensors`` (None: those of the
        Trainer's session, else auto-detected by ``backend``) and the sampling ``interval_s`` (s)."""
        self._user_sensors = self.check_sensors(sensors, backend)
        self.backend = backend
        self.interval_s = self.check_interval(interval_s)

    @staticmethod
    def check_sensors(sensors, backend: str = "auto") -> list[Sensor] | None:
        return checked_sensors(sensors, backend)

    @staticmethod
    def check_interval(interval_s) -> float:
        return checked_interval(interval_s)

    @staticmethod
    def check_flags(**flags: Any) -> None:
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}")

    @staticmethod
    def warn(message: str) -> None:
        warnings.warn(message, UserWarning, stacklevel=3)

    @staticmethod
    def write_output(path, data) -> Path | None:
        """Write a report file atomically (``data``: text, or JSON-able); never raises on a full disk or a
        read-only log dir: warns in one line and returns None instead of the path."""
        from lightning_energy.io import try_atomic_write_json, try_atomic_write_text

        problem = try_atomic_write_text(path, data) if isinstance(data, str) else try_atomic_write_json(path, data)
        if problem is not None:
            rank_zero_warn(f"lightning-energy: {problem}; training is not affected")
            return None
        return Path(path)


def report_sections(trainer, reporter) -> dict:
    """The tables other callbacks add to the energy report (``energy_report_section(trainer)``, e.g.
    PrecisionSwitch's per-mode table), ``reporter`` left out. Collective: every rank calls it."""
    sections: dict = {}
    for callback in trainer.callbacks:
        section = getattr(callback, "energy_report_section", None)
        if callback is not reporter and callable(section):
            sections.update(section(trainer) or {})
    return sections


def rank_zero_info_for(module: str) -> Callable[[str], None]:
    """``log_info(message)``: an INFO record of ``logging.getLogger(module)`` on the process of global rank
    zero only (Lightning's ``rank_zero_only``, the rank read at each call). The suite's messages go to the
    ``lightning_energy`` loggers, so a user can silence or redirect them by name (shown on stderr by default,
    as Lightning shows its own: see ``lightning_energy/__init__.py``)."""
    logger = logging.getLogger(module)

    @rank_zero_only
    def log_info(message: str) -> None:
        logger.info(message, stacklevel=3)  # the record names the caller, not this wrapper

    return log_info


def _tensorboard_event(logger, metrics: dict[str, float], step: int) -> bool:
    """Write ``metrics`` to a TensorBoard logger as ONE event of several scalars (the same tags and step as
    its ``log_metrics``, which writes one event per scalar: ~80 us each here, the bulk of a one-batch
    epoch's cost). False when ``logger`` is not Lightning's TensorBoardLogger."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if type(logger) is not TensorBoardLogger:
        return False
    from tensorboard.compat.proto.summary_pb2 import Summary

    prefix = tensorboard_tag_prefix(logger)
    values = [Summary.Value(tag=f"{prefix}{name}", simple_value=float(value)) for name, value in metrics.items()]
    summary_file_writer(logger.experiment).add_summary(Summary(value=values), step)
    return True


# the base's own boundary hooks: every suite callback reports every boundary
for _name, _boundary in BOUNDARIES.items():
    setattr(MeteredCallback, _name, override(_report(_boundary)(_nothing)))
