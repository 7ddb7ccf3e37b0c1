"""Cheaper per-step machinery for ``baler-lit fit``: the same training, less Python work around each step.

Baler's AE takes a few milliseconds a step on one CPU core, so what Lightning does around the step shows:
py-spy and a per-step count of Python calls (``benchmarks/baler_speed.py``, section ``components``) put the
shipped run's loop, callbacks and progress bar at about a third of its step. Two pieces here remove what costs
the most and computes nothing:

- :class:`LeanProfiler`: Lightning wraps every hook call in ``trainer.profiler.profile(name)``; with no profiler
  asked for, that is :class:`~lightning.pytorch.profilers.PassThroughProfiler`, whose ``profile`` is a
  ``contextlib.contextmanager`` generator: about ten Python calls for nothing, about 60 times a step (a fifth of
  the loop's Python calls). :class:`LeanProfiler` does the same nothing with one shared context.
- :func:`lean_progress_bar`: Lightning's default bar (``RichProgressBar``, else ``TQDMProgressBar``) updates its
  task and metrics at every batch and redraws from a thread up to 100 times a second; in a run whose output is
  not a terminal every redraw is built and thrown away. The bar returned here redraws at most
  ``refresh_per_s`` times a second and updates on the training thread no more often (always at an epoch's first
  and last batch and whenever the loop ends); when its output is not a terminal (a log file, a batch job), where
  Rich prints only the final state, at most once a second. What it finally prints is what the default bar
  prints (the count, the metrics, the rate from the first to the last batch).

The baler-lit CLI installs both unless the config chooses a profiler or a progress bar itself
(``trainer.profiler``, a progress bar in ``trainer.callbacks``, ``trainer.enable_progress_bar: false``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks.progress.tqdm_progress import TQDMProgressBar
from lightning.pytorch.profilers import PassThroughProfiler

#: Redraws per second of the progress bar the CLI installs (Lightning's RichProgressBar: up to 100).
REFRESH_PER_S = 10.0
#: Updates per second of a Rich bar whose output is not a terminal (nothing is shown until it stops).
UNSEEN_UPDATES_PER_S = 1.0

_NOTHING = contextlib.nullcontext()


class LeanProfiler(PassThroughProfiler):
    """A profiler that records nothing, like Lightning's default, in one shared context per call instead of a
    generator-based context manager (Lightning enters ``profile`` around every hook call, ~60 a training step)."""

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:  # type: ignore[override]
        return _NOTHING


class _Throttle:
    """When a bar updates: at most once per ``interval_s`` of ``clock`` (s), or per ``unseen_interval_s`` while
    ``live`` is False (the bar's output is not a terminal: only the final state is ever printed)."""

    def __init__(self, interval_s: float, clock: Callable[[], float],
                 unseen_interval_s: float = 1.0 / UNSEEN_UPDATES_PER_S) -> None:
        self.interval_s = interval_s
        self.unseen_interval_s = max(interval_s, unseen_interval_s)
        self.clock = clock
        self.live = True
        self._last_s = -math.inf

    def due(self, force: bool = False) -> bool:
        now = self.clock()
        if not force and now - self._last_s < (self.interval_s if self.live else self.unseen_interval_s):
            return False
        self._last_s = now
        return True


def _throttled(base: type) -> type:
    """``base`` (a Lightning progress bar) whose batch-end updates go through a :class:`_Throttle`; a skipped
    update is applied at the epoch's last batch, at the epoch's end and when the loop ends or fails."""

    class Lean(base):
        def __init__(self, refresh_per_s: float = REFRESH_PER_S, clock: Callable[[], float] = time.monotonic,
                     **kwargs: Any) -> None:
            if not refresh_per_s > 0:
                raise ValueError(f"refresh_per_s must be > 0, got {refresh_per_s}")
            super().__init__(**kwargs)
            self.throttle = _Throttle(1.0 / refresh_per_s, clock)
            self._pending: dict[str, tuple] = {}  # hook name -> the skipped call's arguments

        def _batch_end(self, hook: str, total: float | int | None, args: tuple, batch_idx: int) -> None:
            last = total is not None and math.isfinite(total) and batch_idx + 1 >= total
            if self.throttle.due(force=last or batch_idx == 0):
                self._pending.pop(hook, None)
                getattr(super(), hook)(*args)
            else:
                self._pending[hook] = args

        def _flush(self, *hooks: str) -> None:
            for hook in hooks:
                args = self._pending.pop(hook, None)
                if args is not None:
                    getattr(super(), hook)(*args)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            self._batch_end("on_train_batch_end", self.total_train_batches,
                            (trainer, pl_module, outputs, batch, batch_idx), batch_idx)

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int,
                                    dataloader_idx: int = 0) -> None:
            total = self.total_val_batches_current_dataloader if not trainer.sanity_checking else None
            self._batch_end("on_validation_batch_end", total,
                            (trainer, pl_module, outputs, batch, batch_idx, dataloader_idx), batch_idx)

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self._flush("on_train_batch_end")
            super().on_train_epoch_end(trainer, pl_module)

        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            self._flush("on_validation_batch_end")
            super().on_validation_epoch_end(trainer, pl_module)

        def on_train_end(self, trainer, pl_module) -> None:
            self._flush("on_validation_batch_end", "on_train_batch_end")
            super().on_train_end(trainer, pl_module)

        def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
            self._flush("on_validation_batch_end", "on_train_batch_end")
            super().on_exception(trainer, pl_module, exception)

    Lean.__name__ = Lean.__qualname__ = f"Lean{base.__name__}"
    Lean.__doc__ = (f"Lightning's ``{base.__name__}``, updated and redrawn at most ``refresh_per_s`` times a second "
                    "(see :mod:`baler_lit.lean_loop`).")
    return Lean


LeanTQDMProgressBar = _throttled(TQDMProgressBar)


def _rich_class() -> type | None:
    try:
        from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE, RichProgressBar
    except ImportError:  # pragma: no cover - Lightning always ships the module
        return None
    if not _RICH_AVAILABLE:
        return None

    class LeanRich(_throttled(RichProgressBar)):
        def __init__(self, refresh_per_s: float = REFRESH_PER_S, clock: Callable[[], float] = time.monotonic,
                     **kwargs: Any) -> None:
            # Rich's refresh thread wakes ``refresh_rate`` times a second (an int in Lightning)
            kwargs.setdefault("refresh_rate", max(1, math.ceil(refresh_per_s)))
            super().__init__(refresh_per_s, clock, **kwargs)

        def on_train_start(self, trainer, pl_module) -> None:
            super().on_train_start(trainer, pl_module)
            self.throttle.live = _shows_live(self._console)

        def on_validation_start(self, trainer, pl_module) -> None:
            super().on_validation_start(trainer, pl_module)
            self.throttle.live = _shows_live(self._console)

    LeanRich.__name__ = LeanRich.__qualname__ = "LeanRichProgressBar"
    return LeanRich


def _shows_live(console) -> bool:
    """Whether a Rich console displays a live bar (a terminal or Jupyter); elsewhere Rich prints the final state
    only, when the bar stops."""
    if console is None:
        return True
    return bool(getattr(console, "is_jupyter", False)
                or (console.is_terminal and not getattr(console, "is_dumb_terminal", False)))


LeanRichProgressBar = _rich_class()


def lean_progress_bar(refresh_per_s: float = REFRESH_PER_S, clock: Callable[[], float] = time.monotonic):
    """The progress bar Lightning would choose by default (Rich when installed, else TQDM), throttled."""
    cls = LeanRichProgressBar or LeanTQDMProgressBar
    return cls(refresh_per_s, clock)
