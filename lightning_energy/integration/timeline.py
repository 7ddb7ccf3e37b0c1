"""The Trainer's boundaries, reported to the run's one timeline (:mod:`lightning_energy.core.timeline`).

Every callback of the suite reports the boundary first thing in its hook
(:class:`~lightning_energy.integration.base.MeteredCallback` does it for them); the first report places
the mark and the others find it placed, so figures do not depend on the order of
``Trainer(callbacks=[...])``. This module only reads the Trainer: which epoch, which step Lightning logs
at, whether a micro-batch steps the optimizer, whether a loop is a sanity check; the core places the
marks, settles DDP figures and delivers them. Anything else (``fit_start``, ``mark()``, ``extra()``,
``so_far()``, ``flush()``, ``subscribe()`` ...) is the core timeline's, reached through this object.
"""

from __future__ import annotations

from lightning_energy.core.figures import EpochFigures, LoopFigures, StepFigures  # noqa: F401  (the callbacks' names)
from lightning_energy.core.timeline import LOOP_KINDS, Timeline  # noqa: F401
from lightning_energy.integration.lightning_internals import (
    batches_that_stepped, epoch_end_log_step, is_accumulating,
)


class TrainerTimeline:
    """One Trainer's view of its session's :class:`~lightning_energy.core.timeline.Timeline`: a method per
    Lightning hook that carries a boundary (the table in ``integration/base.py``)."""

    def __init__(self, core: Timeline) -> None:
        self.core = core

    def __getattr__(self, name: str):
        if name == "core":  # not yet set (a copy under construction)
            raise AttributeError(name)
        return getattr(self.core, name)  # fit_start, mark(), extra(), so_far(), subscribe(), ...

    def flush(self, trainer=None, timeout_s: float | None = None) -> None:
        """Wait (bounded) until every boundary placed so far is measured and deliver it all."""
        self.core.flush(timeout_s)

    # ------------------------------------------------------------------ hooks (training thread)
    def fit_started(self, trainer) -> None:
        self.core.fit_started()

    def train_started(self, trainer) -> None:
        """A fit resumed inside an epoch skips ``on_train_epoch_start``: that epoch opens here."""
        loop = trainer.fit_loop
        resumed = getattr(loop, "restarted_mid_epoch", False) or getattr(loop, "restarted_on_epoch_end", False)
        self.core.train_started(trainer.current_epoch if resumed else None)

    def train_epoch_started(self, trainer) -> None:
        self.core.epoch_started(trainer.current_epoch)

    def batch_started(self, trainer, batch_idx: int) -> None:
        self.core.step_started(trainer.current_epoch)

    def batch_ended(self, trainer, batch_idx: int) -> None:
        accumulating = trainer.accumulate_grad_batches > 1 and is_accumulating(trainer)
        log = False if accumulating else should_log_step(trainer) or bool(trainer.fast_dev_run)
        self.core.step_ended(batches_that_stepped(trainer), log, accumulating)

    def train_epoch_ended(self, trainer) -> None:
        self.core.epoch_ended(epoch_end_log_step(trainer))  # where Lightning logs the epoch's own metrics

    def loop_started(self, trainer, kind: str) -> None:
        if trainer.sanity_checking:
            return
        fitting = _fitting(trainer)
        step = batches_that_stepped(trainer) if fitting else trainer.global_step
        self.core.loop_started(kind, trainer.current_epoch, step, fitting)

    def loop_ended(self, trainer, kind: str) -> None:
        self.core.loop_ended(kind)

    def fit_ended(self, trainer) -> None:
        self.core.fit_ended(epoch_end_log_step(trainer))  # stopped inside an epoch (max_steps, max_time)


def should_log_step(trainer) -> bool:
    """Whether Lightning logs the training step that ends now: Lightning's own gate.

    This is ``trainer._logger_connector.should_update_logs`` (Lightning 2.6) for the fit loop, the only
    loop that can be active in ``on_train_batch_end``, without its generic active-loop lookup: that
    lookup compares ``RunningStage`` enums case-insensitively and costs ~20 us per call on a 2-vCPU EPYC,
    a third of the timeline's per-step cost. ``test_timeline.py`` checks that both agree at every step.
    """
    every_n = trainer.log_every_n_steps
    if every_n == 0:
        return False
    return (batches_that_stepped(trainer) + 1) % every_n == 0 or bool(trainer.should_stop)


def _fitting(trainer) -> bool:
    from lightning.pytorch.trainer.states import TrainerFn

    return trainer.state.fn == TrainerFn.FITTING
