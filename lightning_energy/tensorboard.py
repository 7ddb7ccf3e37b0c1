"""TensorBoard extras: a custom-scalars layout (loss beside energy) and a per-epoch power figure.

The layout, the figure (drawn with matplotlib's Agg canvas, never pyplot) and the writers' flush run
on a background :class:`~lightning_energy.output_worker.OutputWorker`: :meth:`TensorBoardExtras.after_epoch`
on the training thread only hands references over. A writer that fails (a full disk under its flush,
a log dir made read-only) becomes one line in :attr:`TensorBoardExtras.problems` and one warning; the
extras then leave that writer alone and training goes on.
"""

from __future__ import annotations

import math
import re
import time

from lightning_energy.output_worker import DEFAULT_CLOSE_TIMEOUT_S, OutputWorker, describe_error
from lightning_energy.provenance import UNKNOWN, combine, word
from lightning_energy.sampler import Reading

MAX_FIGURE_POINTS = 4000  # per epoch; older points are thinned by half when exceeded
FIGURE_TAG = "power/trace"
# At most this fraction of the wall time since the first epoch end goes into drawing figures (the
# drawing thread shares the interpreter lock with training): an epoch whose figure would exceed it
# gets none. Epochs of seconds or more all get their figure; thousands of millisecond epochs do not.
MIN_FIGURE_SAMPLES = 10  # an epoch with fewer samples gets no power figure (half a second at 20 Hz)
FLUSH_INTERVAL_S = 1.0  # writers flushed at most this often when there is no figure to write
FIGURE_BUDGET = 0.01


class EpochPowerRecorder:
    """A sampler listener keeping this epoch's power per sensor (W), thinned to a bounded size."""

    def __init__(self) -> None:
        self.points: list[tuple[float, dict[str, float]]] = []

    def start_epoch(self) -> None:
        self.points = []

    def take(self) -> list[tuple[float, dict[str, float]]]:
        points, self.points = self.points, []
        return points

    def __call__(self, t: float, readings: list[Reading]) -> None:
        points = self.points
        points.append((t, {r.name: r.power_W for r in readings if math.isfinite(r.power_W)}))
        if len(points) > MAX_FIGURE_POINTS:
            del points[::2]


class TensorBoardExtras:
    """Writes the layout once and the power figure each epoch to every TensorBoard writer, off the training thread.

    Args:
        writers: ``SummaryWriter``-like objects (``add_custom_scalars``, ``add_image``, ``flush``).
        worker: the background worker (default: a new one, started on the first epoch end).
        figure_budget: the fraction of wall time figures may take (``None``: a figure every epoch).
        warn: warn once per problem besides recording it in :attr:`problems`.

    Call :meth:`close` at the end of the fit (before the loggers finalize): it drains the queued work
    within a bound. :meth:`for_trainer` also makes each writer's ``close`` (called by the logger's
    ``finalize``) drain first, so a run whose callback does not call :meth:`close` loses nothing.
    """

    def __init__(self, writers: list, worker: OutputWorker | None = None, figure_budget: float | None = FIGURE_BUDGET,
                 warn: bool = True) -> None:
        self.writers = list(writers)
        self.layout_written = False
        self.worker = worker if worker is not None else OutputWorker("lightning-energy-tensorboard", warn=warn)
        self.figure_budget = figure_budget
        self.figures_drawn = 0
        self.figures_skipped = 0  # over the drawing budget, or replaced by a newer epoch's figure before drawn
        self.notes: list[str] = []  # what is left out by design (not a fault): skipped figures
        self.figures_too_short = 0  # epochs with fewer than MIN_FIGURE_SAMPLES samples: no figure
        self._last_flush = -math.inf
        self.figure_s = 0.0  # seconds spent drawing and writing figures (worker thread)
        self._first_epoch_end: float | None = None
        # sensor name -> "measured" / "estimated" / "simulated": the power figure labels each curve with it
        self.sensor_provenance: dict[str, str] = {}
        self._broken: set[int] = set()  # id() of writers that failed: left alone from then on
        self._hooks: list[tuple[object, object]] = []  # (writer, our close wrapper)
        self._closed = False

    @property
    def problems(self) -> list[str]:
        """One line per failed writer or job, and what is missing from TensorBoard because of it."""
        return self.worker.problems

    @classmethod
    def for_trainer(cls, trainer, **kwargs) -> "TensorBoardExtras | None":
        """Extras for the trainer's TensorBoard loggers (None without one); keyword arguments as for the class."""
        from lightning.pytorch.loggers import TensorBoardLogger

        writers = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not writers:
            return None
        extras = cls(writers, **kwargs)
        for writer in writers:
            extras._drain_before_close(writer)
        return extras

    def _drain_before_close(self, writer) -> None:
        """Make ``writer.close()`` (Lightning's logger ``finalize`` calls it when the run ends, after the
        callbacks' teardown) write this object's queued work first, so nothing reaches a closed writer.
        Undone by :meth:`close`. (The writer, unlike its logger, is never pickled.)"""
        original = getattr(writer, "close", None)
        if original is None:
            return

        def close(*args, **kwargs):
            self.close()
            return original(*args, **kwargs)

        try:
            writer.close = close
        except (AttributeError, TypeError):
            return
        self._hooks.append((writer, close))

    # ---------------------------------------------------------------- the training thread: references only
    def after_epoch(self, trainer, epoch: int, power_points) -> None:
        """Queue this epoch's outputs (the layout the first time, the power figure, a flush); never waits."""
        if self._closed or not self.writers:
            return
        worker = self.worker
        if not self.layout_written:
            self.layout_written = True
            worker.submit(self._write_layout, list(trainer.logged_metrics), what="TensorBoard layout")
        now = time.perf_counter()
        if self._first_epoch_end is None:
            self._first_epoch_end = now
        if power_points is not None and len(power_points) < MIN_FIGURE_SAMPLES:
            self.figures_too_short += 1  # a few samples make no picture (one-batch epochs of milliseconds)
        elif power_points:
            budget = self.figure_budget
            if budget is not None and self.figures_drawn and self.figure_s > budget * (now - self._first_epoch_end):
                self.figures_skipped += 1
            else:
                worker.submit(self._write_figure, power_points, epoch, what="power figure", key="power figure")
                self._last_flush = now
                return  # the figure job flushes
        if now - self._last_flush >= FLUSH_INTERVAL_S:  # short epochs: at most one flush a second
            self._last_flush = now
            worker.submit(self._flush, what="TensorBoard flush", key="flush")

    # ---------------------------------------------------------------- the worker thread
    def _live_writers(self) -> list:
        return [w for w in self.writers if id(w) not in self._broken]

    def _each_writer(self, action: str, call) -> None:
        for writer in self._live_writers():
            try:
                call(writer)
            except Exception as err:  # a full disk, a read-only log dir, a closed writer: never training's problem
                self._broken.add(id(writer))
                where = getattr(writer, "log_dir", None) or (writer.get_logdir() if hasattr(writer, "get_logdir")
                                                             else repr(writer))
                self.worker.record(f"tensorboard writer {id(writer)}",
                                   f"TensorBoard writer at {where}: {action} failed ({describe_error(err)}); "
                                   "later power figures and the layout are missing there")

    def _write_layout(self, metric_names: list[str]) -> None:
        layout = custom_scalars_layout(training_loss_tags(metric_names))
        self._each_writer("writing the custom-scalars layout", lambda w: w.add_custom_scalars(layout))

    def _write_figure(self, points, epoch: int) -> None:
        if not self._live_writers():
            return
        started = time.perf_counter()
        try:
            figure = power_figure(points, epoch, self.sensor_provenance)
            image = figure_image(figure)
            self._each_writer(f"adding the epoch {epoch} power figure",
                              lambda w: w.add_image(FIGURE_TAG, image, global_step=epoch, dataformats="HWC"))
            self.figures_drawn += 1
            self._each_writer("flushing", lambda w: w.flush())
        finally:
            self.figure_s += time.perf_counter() - started

    def _flush(self) -> None:
        self._each_writer("flushing", lambda w: w.flush())

    # ---------------------------------------------------------------- end of fit
    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> bool:
        """Write what is queued (at most ``timeout_s``) and stop; never raises. True when all was written."""
        for writer, wrapper in self._hooks:
            if getattr(writer, "__dict__", {}).get("close") is wrapper:
                del writer.close
        self._hooks = []
        if self._closed:
            return self.worker.pending() == 0
        self._closed = True
        finished = self.worker.close(timeout_s)
        skipped = self.figures_skipped + self.worker.dropped.get("power figure", 0)
        if skipped:
            budget = ("" if self.figure_budget is None
                      else f"drawing is kept under {self.figure_budget:.0%} of the run's time; ")
            self.notes.append(f"power figure: {skipped} epoch(s) have none ({budget}a newer epoch's figure replaces "
                              f"one not drawn yet); {self.figures_drawn} drawn")
        if self.figures_too_short:
            self.notes.append(f"power figure: {self.figures_too_short} epoch(s) have none (fewer than "
                              f"{MIN_FIGURE_SAMPLES} samples: too short for a picture); their power is in the trace")
        return finished


def training_loss_tags(logged_metrics) -> list[str]:
    """The module's training-loss metric names (anything with 'loss' not from validation or test)."""
    return sorted(k for k in logged_metrics if "loss" in k.lower() and not re.match(r"(val|valid|validation|test)\b|(val|test)[/_]", k))


def custom_scalars_layout(loss_tags: list[str]) -> dict:
    """Charts side by side: the training loss, energy per step, energy per epoch, power per step."""
    loss_regex = [re.escape(tag) for tag in loss_tags] or [r".*loss.*"]
    return {
        "lightning-energy": {
            "training loss": ["Multiline", loss_regex],
            "energy per step (J)": ["Multiline", [r"energy/step_J"]],
            "energy per epoch (J)": ["Multiline", [r"energy/epoch_J$", r"energy/val_epoch_J"]],
            "power per step (W)": ["Multiline", [r"power/step_W"]],
        }
    }


def power_figure(points, epoch: int, sensor_provenance: dict[str, str] | None = None):
    """Power of each sensor (W) over the epoch's seconds: a ``matplotlib.figure.Figure`` on an Agg canvas.

    Each curve and the title say where the joules come from (``sensor_provenance``: sensor name ->
    measured / estimated / simulated; a sensor missing there is "provenance unknown"). Built without pyplot (no global figure manager, no GUI backend), so any thread may draw it.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    provenance = sensor_provenance or {}
    t0 = points[0][0]
    names = sorted({name for _, powers in points for name in powers})
    figure = Figure(figsize=(7, 3.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name in names:
        xs = [t - t0 for t, p in points if name in p]
        ys = [p[name] for _, p in points if name in p]
        axes.plot(xs, ys, label=f"{name} ({word(provenance.get(name, UNKNOWN))})", linewidth=1)
    axes.set_xlabel("seconds since epoch start")
    axes.set_ylabel("power (W)")
    overall = combine(provenance.get(name, UNKNOWN) for name in names)
    axes.set_title(f"epoch {epoch} power, {word(overall)}")
    if names:
        axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    return figure


def figure_image(figure):
    """The figure rendered by its Agg canvas: an RGB ``uint8`` array, height x width x 3."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()
