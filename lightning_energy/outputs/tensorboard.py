"""TensorBoard extras: a custom-scalars layout (loss beside energy), a per-epoch power figure, and the
end-of-fit report in the HParams tab (energy totals as metrics, so runs sort by energy) and the Text tab.

The layout, the figure (drawn with matplotlib's Agg canvas, never pyplot) and the writers' flush run
on a background :class:`~lightning_energy.outputs.worker.OutputWorker`: :meth:`TensorBoardExtras.after_epoch`
on the training thread only hands references over. A writer that fails (a full disk under its flush,
a log dir made read-only) becomes one line in :attr:`TensorBoardExtras.problems` and one warning; the
extras then leave that writer alone and training goes on.

The report goes to TensorBoard once, at the end of fit (:meth:`TensorBoardExtras.write_report`). TensorBoard's
HParams plugin keeps the first hparams summary of a run, and Lightning writes one at fit start (metric
``hp_metric = -1`` unless told otherwise), so for a fit the extras ask each TensorBoardLogger not to write that
placeholder (:meth:`TensorBoardExtras.take_over_hparams`) and write the only hparams summary at fit end:
the logger's hyperparameters, how the energy was obtained (``Energy_how``: measured / estimated / simulated)
and the metrics in :data:`REPORT_METRICS` plus the run's loss, ``hp_metric`` and carbon tags when logged.
"""

from __future__ import annotations

import math
import re
import time

from lightning_energy.extras import install_command, is_installed
from lightning_energy.integration.lightning_internals import (
    set_writes_default_hp_metric, summary_file_writer, writes_default_hp_metric)
from lightning_energy.outputs.worker import DEFAULT_CLOSE_TIMEOUT_S, DEFAULT_MAX_PENDING, OutputWorker, describe_error
from lightning_energy.provenance import UNKNOWN, combine, word
from lightning_energy.measure.sampler import Reading

MAX_FIGURE_POINTS = 4000  # per epoch; older points are thinned by half when exceeded
FIGURE_TAG = "power/trace"
MIN_FIGURE_SAMPLES = 10  # an epoch with fewer samples gets no power figure (half a second at 20 Hz)
FLUSH_INTERVAL_S = 1.0  # writers flushed at most this often when there is no figure to write
#: The default drawing budget of :class:`TensorBoardExtras`: beyond the epochs that always get a power
#: figure (the first three, the last and each most expensive so far), an epoch gets one only while the time spent
#: drawing stays under this fraction of the wall time since the first epoch end (the drawing thread shares the
#: interpreter lock with training; a figure takes about 0.1 s of it on one 2-GHz core). Epochs of 10 s or more
#: all get their figure; thousands of millisecond epochs do not.
FIGURE_BUDGET = 0.01
#: The first epochs (with enough samples) that always get a power figure: a short run gets one per epoch
ALWAYS_DRAWN_EPOCHS = 3
#: Guaranteed figures (the first three, the most expensive so far) that did not fit the drawing budget when their
#: epoch ended wait for the end of the fit, holding their epoch's points; at most this many wait (the oldest most
#: expensive one gives way first; the first three never do)
MAX_DEFERRED_FIGURES = 8
#: Fixed margins of the power figure (fractions of its size): matplotlib's tight_layout measured every tick label
#: anew for each figure, about a third of the figure's drawing time
FIGURE_MARGINS = {"left": 0.11, "right": 0.98, "bottom": 0.16, "top": 0.9}
#: How the epochs that get a power figure are chosen, in words (the report's ``power_figures["rule"]``)
FIGURE_RULE = (f"the first {ALWAYS_DRAWN_EPOCHS}, the last and each most expensive epoch so far; others while "
               "drawing takes under {budget}")
#: HParams metrics written at fit end: TensorBoard tag -> key of the energy report (J, s, W)
REPORT_METRICS = {
    "report/energy_total_J": "total_J",
    "report/energy_train_J": "train_J",
    "report/energy_validation_J": "validation_J",
    "report/duration_s": "duration_s",
    "report/mean_power_W": "mean_power_W",
}
REPORT_TEXT_TAG = "lightning-energy/report"
#: the HParams column saying how the joules were obtained; capitalised so TensorBoard, which sorts the columns
#: and shows the first few, shows it first
ENERGY_HOW_HPARAM = "Energy_how"
#: tags logged by other callbacks or the module that the HParams table shows when the run has them
EXTRA_HPARAM_METRICS = ("carbon/total_gCO2e", "hp_metric")


def check_figure_budget(figure_budget):
    """``figure_budget`` if it is a fraction of the run's time from 0 to 1, or None; else a ValueError."""
    if figure_budget is not None and (isinstance(figure_budget, bool) or not isinstance(figure_budget, (int, float))
                                      or not 0.0 <= figure_budget <= 1.0):
        raise ValueError(f"figure_budget must be a fraction of the run's time from 0 to 1 (0.01 = 1 %) or None "
                         f"(a figure every epoch), got {figure_budget!r}")
    return figure_budget


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


def epoch_energy_J(points) -> float:
    """The energy (J) of an epoch's power points (``(t s, {sensor: W})``): each sensor's power integrated over
    time by the trapezoid rule between its own points, summed over sensors. Thinned points (see
    :data:`MAX_FIGURE_POINTS`) give an approximation, good enough to rank epochs."""
    by_sensor: dict[str, tuple[list[float], list[float]]] = {}
    for t, powers in points:
        for name, watts in powers.items():
            times, values = by_sensor.setdefault(name, ([], []))
            times.append(t)
            values.append(watts)
    return sum(0.5 * (w0 + w1) * (t1 - t0)
               for times, values in by_sensor.values()
               for t0, t1, w0, w1 in zip(times, times[1:], values, values[1:]))


class TensorBoardExtras:
    """Writes the layout once and the power figure of epochs to every TensorBoard writer, off the training thread.

    Which epochs get a power figure (:data:`FIGURE_RULE`): always the first :data:`ALWAYS_DRAWN_EPOCHS` (3),
    the last (drawn at :meth:`close` if it had none) and every epoch that used more energy than each before it;
    any other epoch while the time spent drawing stays under ``figure_budget`` of the wall time since the first
    epoch end. A run of up to 4 epochs thus gets a figure per epoch; a run of many short epochs gets its first
    three, its last, its most expensive so far and a sample of the rest. Epochs with fewer than
    :data:`MIN_FIGURE_SAMPLES` samples get none. :meth:`figure_summary` says how many were drawn (the report's
    ``power_figures``).

    When they are drawn: the run's first figure at once; every other one at once only while drawing stays within
    ``figure_budget``, else at :meth:`close` (at most :data:`MAX_DEFERRED_FIGURES` wait), in epoch order. The
    drawing thread shares the interpreter lock and, on a small machine, the cores with training: a figure takes
    about 0.1 s of CPU and the first one about 0.8 s more (importing matplotlib), so drawing one per short epoch
    slowed a run of 0.6-s epochs by about 20 % (``benchmarks/baler_speed.py``, section ``components``).

    Args:
        writers: ``SummaryWriter``-like objects (``add_custom_scalars``, ``add_image``, ``flush``).
        worker: the background worker (default: a new one, started on the first epoch end).
        figure_budget: the fraction (0 to 1) of the run's wall time that the figures beyond the first three, the
            last and the most expensive so far may take (default :data:`FIGURE_BUDGET`, 1 %; ``0``: those
            epochs only; ``None``: a figure every epoch).
        warn: warn once per problem besides recording it in :attr:`problems`.
        clock: seconds for the drawing budget (default ``time.perf_counter``; tests pass a fake clock).

    Call :meth:`close` at the end of the fit (before the loggers finalize): it drains the queued work
    within a bound. :meth:`for_trainer` also makes each writer's ``close`` (called by the logger's
    ``finalize``) drain first, so a run whose callback does not call :meth:`close` loses nothing.
    """

    def __init__(self, writers: list, worker: OutputWorker | None = None, figure_budget: float | None = FIGURE_BUDGET,
                 warn: bool = True, clock=time.perf_counter) -> None:
        check_figure_budget(figure_budget)
        self.writers = list(writers)
        self.layout_written = False
        self.worker = worker if worker is not None else OutputWorker(
            "lightning-energy-tensorboard", max_pending=DEFAULT_MAX_PENDING + MAX_DEFERRED_FIGURES, warn=warn)
        self.figure_budget = figure_budget
        self.clock = clock
        self.figures_drawn = 0
        self.figures_skipped = 0  # over the drawing budget, or replaced by a newer epoch's figure before drawn
        self.epochs_seen = 0  # epochs handed to after_epoch with their power (figure or not)
        self._epochs_pictured = 0  # epochs with enough samples for a figure (drawn or not)
        self._most_energy_J = -math.inf  # the most energy (J) of an epoch so far
        self._held: tuple | None = None  # (points, epoch) of the latest epoch without a figure: drawn if it is the last
        self._deferred: dict[int, tuple] = {}  # epoch -> (points, reason): guaranteed figures drawn at close
        self._figures_queued = 0  # figure jobs handed to the worker (drawn or not yet)
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
        self.loggers: list = []  # the TensorBoardLoggers of the writers (for_trainer), same order
        self._hp_metric_defaults: list[tuple[object, bool]] = []  # (logger, its default_hp_metric) taken over
        self.can_draw = is_installed("matplotlib")  # power figures need the [analysis] extra
        if not self.can_draw:
            self.notes.append(f"power figures: none drawn, matplotlib is not installed "
                              f"({install_command('analysis')})")

    @property
    def problems(self) -> list[str]:
        """One line per failed writer or job, and what is missing from TensorBoard because of it."""
        return self.worker.problems

    @classmethod
    def for_trainer(cls, trainer, **kwargs) -> "TensorBoardExtras | None":
        """Extras for the trainer's TensorBoard loggers (None without one); keyword arguments as for the class."""
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return None
        extras = cls([lg.experiment for lg in loggers], **kwargs)
        extras.loggers = loggers
        for writer in extras.writers:
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
    def after_epoch(self, trainer, epoch: int, power_points, energy_J: float | None = None) -> None:
        """Queue this epoch's outputs (the layout the first time, the power figure, a flush); never waits.

        ``power_points``: the epoch's ``(t s, {sensor: W})`` (None: no figure wanted); ``energy_J``: the epoch's
        energy (J) that ranks it for the "most expensive so far" rule (default: integrated from the points).
        """
        if self._closed or not self.writers:
            return
        worker = self.worker
        if not self.layout_written:
            self.layout_written = True
            worker.submit(self._write_layout, list(trainer.logged_metrics), what="TensorBoard layout")
        now = self.clock()
        if self._first_epoch_end is None:
            self._first_epoch_end = now
        if not self.can_draw:
            power_points = None
        if power_points is not None:
            self.epochs_seen += 1
            self._held = None  # a later epoch came: the one held is not the last
        if power_points is not None and len(power_points) < MIN_FIGURE_SAMPLES:
            self.figures_too_short += 1  # a few samples make no picture (one-batch epochs of milliseconds)
        elif power_points:
            reason = self._figure_reason(power_points, energy_J, now)
            if reason is not None and reason != "budget" and not self._draws_now(now):
                self._defer(power_points, epoch, reason)  # guaranteed, but over the budget now: drawn at close
            elif reason is not None:  # a figure the rule guarantees is never replaced by a later one before drawn
                self._figures_queued += 1
                worker.submit(self._write_figure, power_points, epoch, what="power figure",
                              key="power figure" if reason == "budget" else None)
                self._last_flush = now
                return  # the figure job flushes
            else:
                self.figures_skipped += 1
                self._held = (power_points, epoch)  # drawn at close if no later epoch comes
        if now - self._last_flush >= FLUSH_INTERVAL_S:  # short epochs: at most one flush a second
            self._last_flush = now
            worker.submit(self._flush, what="TensorBoard flush", key="flush")

    def _figure_reason(self, points, energy_J: float | None, now: float) -> str | None:
        """Why this epoch gets a power figure ("early", "most expensive" or "budget"), None when it gets none
        now (see :data:`FIGURE_RULE`); ``energy_J`` (J) defaults to the points' integral."""
        energy_J = epoch_energy_J(points) if energy_J is None else energy_J
        most_expensive = energy_J > self._most_energy_J
        self._most_energy_J = max(self._most_energy_J, energy_J)
        self._epochs_pictured += 1
        if self._epochs_pictured <= ALWAYS_DRAWN_EPOCHS:
            return "early"
        if most_expensive:
            return "most expensive"
        return "budget" if self._within_budget(now) else None

    def _draws_now(self, now: float) -> bool:
        """Whether a guaranteed figure is drawn at once: the run's first one, else while within the budget and
        no figure is still waiting to be drawn."""
        if self._figures_queued == 0:
            return True
        return self._within_budget(now) and (self.figure_budget is None or self.worker.pending() == 0)

    def _defer(self, points, epoch: int, reason: str) -> None:
        """Keep a guaranteed figure's points for :meth:`close`; beyond :data:`MAX_DEFERRED_FIGURES` the oldest
        "most expensive so far" one is given up (a later epoch used more energy)."""
        self._deferred[epoch] = (points, reason)
        if len(self._deferred) > MAX_DEFERRED_FIGURES:
            oldest = next((e for e, (_, why) in self._deferred.items() if why != "early"), None)
            if oldest is not None:
                del self._deferred[oldest]
                self.figures_skipped += 1

    def _within_budget(self, now: float) -> bool:
        """Whether the time spent drawing so far (s) is under ``figure_budget`` of the time since the first
        epoch end (always, with no budget)."""
        budget = self.figure_budget
        return budget is None or self.figure_s < budget * (now - self._first_epoch_end)

    def figure_summary(self) -> dict:
        """How many power figures were drawn, over how many epochs, and by what rule (for the report's
        ``power_figures``; final after :meth:`close`)."""
        budget = "no limit" if self.figure_budget is None else f"{self.figure_budget:.0%} of the run's time"
        return {"drawn": self.figures_drawn, "epochs": self.epochs_seen,
                "rule": ("every epoch" if self.figure_budget is None else FIGURE_RULE.format(budget=budget))
                        + f"; epochs under {MIN_FIGURE_SAMPLES} samples get none"}

    # ---------------------------------------------------------------- the worker thread
    def _live_writers(self) -> list:
        return [w for w in self.writers if id(w) not in self._broken]

    def _each_writer(self, action: str, call) -> None:
        for writer in self._live_writers():
            self._guarded(writer, action, call)

    def _guarded(self, writer, action: str, call) -> None:
        """``call(writer)``; a failure marks the writer broken and becomes one line in :attr:`problems`."""
        try:
            call(writer)
        except Exception as err:  # a full disk, a read-only log dir, a closed writer: never training's problem
            self._broken.add(id(writer))
            where = getattr(writer, "log_dir", None) or (writer.get_logdir() if hasattr(writer, "get_logdir")
                                                         else repr(writer))
            self.worker.record(f"tensorboard writer {id(writer)}",
                               f"TensorBoard writer at {where}: {action} failed ({describe_error(err)}); "
                               "later power figures, the layout and the report are missing there")

    def _write_layout(self, metric_names: list[str]) -> None:
        layout = custom_scalars_layout(training_loss_tags(metric_names), validation_loss_tags(metric_names))
        self._each_writer("writing the custom-scalars layout", lambda w: w.add_custom_scalars(layout))

    def _write_figure(self, points, epoch: int) -> None:
        if not self._live_writers():
            return
        started = self.clock()
        try:
            figure = power_figure(points, epoch, self.sensor_provenance)
            image = figure_image(figure)
            self._each_writer(f"adding the epoch {epoch} power figure",
                              lambda w: w.add_image(FIGURE_TAG, image, global_step=epoch, dataformats="HWC"))
            self.figures_drawn += 1
            self._each_writer("flushing", lambda w: w.flush())
        finally:
            self.figure_s += self.clock() - started

    def _flush(self) -> None:
        self._each_writer("flushing", lambda w: w.flush())

    # ---------------------------------------------------------------- the report, at the end of fit
    def take_over_hparams(self) -> None:
        """At fit setup: ask each TensorBoardLogger not to write its ``hp_metric = -1`` hparams summary at fit
        start (TensorBoard keeps a run's first one), so :meth:`write_report`'s summary is the one shown.
        The logger still records the hyperparameters (``hparams.yaml``); undone by :meth:`close`."""
        for lg in self.loggers:
            if writes_default_hp_metric(lg) is True:
                set_writes_default_hp_metric(lg, False)
                self._hp_metric_defaults.append((lg, True))

    def write_report(self, trainer, report: dict) -> None:
        """Write the report to every live writer, on the calling thread (at fit end, once): the report's
        totals as HParams metrics (and scalars, at the last global step) beside the logger's hyperparameters,
        and the console table as text. Failures are recorded in :attr:`problems`, never raised."""
        if not self.writers:
            return
        step = int(getattr(trainer, "global_step", 0))
        values = {tag: float(report[key]) for tag, key in REPORT_METRICS.items()
                  if isinstance(report.get(key), (int, float)) and math.isfinite(report[key])}
        logged = list(getattr(trainer, "logged_metrics", {}) or {})
        existing = [*validation_loss_tags(logged), *epoch_loss_tags(logged),
                    *(tag for tag in EXTRA_HPARAM_METRICS if tag in logged)]
        # TensorBoard shows the first few metric columns: the total energy, then the losses beside it
        first = [tag for tag in values if tag == "report/energy_total_J"]
        metric_tags = [*first, *(t for t in existing if t not in values), *(t for t in values if t not in first)]
        text = report_markdown(report)
        for index, writer in enumerate(self.writers):
            if id(writer) in self._broken:
                continue
            logger_params = getattr(self.loggers[index], "hparams", {}) if index < len(self.loggers) else {}
            params = {ENERGY_HOW_HPARAM: energy_how(report), **hparam_values(logger_params)}
            self._guarded(writer, "writing the report (HParams, text)",
                          lambda w, p=params: _write_report(w, p, values, metric_tags, text, step))

    # ---------------------------------------------------------------- end of fit
    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> bool:
        """Write what is queued (at most ``timeout_s``) and stop; never raises. True when all was written."""
        for writer, wrapper in self._hooks:
            if getattr(writer, "__dict__", {}).get("close") is wrapper:
                del writer.close
        self._hooks = []
        for lg, default in self._hp_metric_defaults:
            set_writes_default_hp_metric(lg, default)
        self._hp_metric_defaults = []
        if self._closed:
            return self.worker.pending() == 0
        deferred, self._deferred = self._deferred, {}
        for epoch in sorted(deferred):  # guaranteed figures that waited for the end of the fit, in epoch order
            self.worker.submit(self._write_figure, deferred[epoch][0], epoch, what="power figure")
        if self._held is not None:  # the last epoch had no figure: it always gets one
            points, epoch = self._held
            self._held = None
            if self.worker.submit(self._write_figure, points, epoch, what="power figure"):
                self.figures_skipped -= 1
        self._closed = True
        finished = self.worker.close(timeout_s)
        skipped = self.figures_skipped + self.worker.dropped.get("power figure", 0)
        if skipped:
            self.notes.append(f"power figure: {skipped} epoch(s) have none ({self.figure_summary()['rule']}; a newer "
                              f"epoch's figure replaces one not drawn yet); {self.figures_drawn} drawn")
        if self.figures_too_short:
            self.notes.append(f"power figure: {self.figures_too_short} epoch(s) have none (fewer than "
                              f"{MIN_FIGURE_SAMPLES} samples: too short for a picture); their power is in the trace")
        return finished


def training_loss_tags(logged_metrics) -> list[str]:
    """The module's training-loss metric names (anything with 'loss' not from validation or test)."""
    return sorted(k for k in logged_metrics if "loss" in k.lower() and not re.match(r"(val|valid|validation|test)\b|(val|test)[/_]", k))


def validation_loss_tags(logged_metrics) -> list[str]:
    """The module's validation-loss metric names (``val/loss``, ``val_loss``, ``validation/loss`` ...)."""
    return sorted(k for k in logged_metrics if "loss" in k.lower() and re.match(r"(val|valid|validation)([/_]|\b)", k))


def epoch_loss_tags(logged_metrics) -> list[str]:
    """Training-loss names logged per epoch (``..._epoch``), or all training-loss names when none is."""
    tags = training_loss_tags(logged_metrics)
    return [t for t in tags if t.endswith("epoch")] or tags


def _exact(tags) -> list[str]:
    return [f"^{re.escape(tag)}$" for tag in tags]


def custom_scalars_layout(loss_tags: list[str], val_loss_tags: list[str] = ()) -> dict:
    """Loss beside energy, in pairs (one category each, its charts side by side), and the epoch totals.

    Each chart holds one quantity, so its series are the runs, coloured as in the run selector (TensorBoard
    colours a custom-scalars series by run: two quantities in one chart would share a colour).
    """
    def loss_charts(tags, fallback: str) -> dict:
        return {tag: ["Multiline", _exact([tag])] for tag in tags} or {fallback: ["Multiline", [fallback]]}

    return {
        "lightning-energy 1: training loss | energy per step": {
            **loss_charts(loss_tags, r"^(?!val|test).*loss"),
            "energy per step (J)": ["Multiline", [r"^energy/step_J$"]],
            "power per step (W)": ["Multiline", [r"^power/step_W$"]],
        },
        "lightning-energy 2: validation loss | validation energy": {
            **loss_charts(val_loss_tags, r"^val.*loss"),
            "validation energy per epoch (J)": ["Multiline", [r"^energy/val_epoch_J$"]],
        },
        "lightning-energy 3: epochs": {
            "training energy per epoch (J)": ["Multiline", [r"^energy/epoch_J$"]],
            "total energy (J)": ["Multiline", [r"^energy/total_J$"]],
            "power per epoch (W)": ["Multiline", [r"^power/epoch_W$"]],
        },
    }


def energy_how(report: dict) -> str:
    """How the report's joules were obtained: ``measured``, ``estimated``, ``simulated`` or a mix (``+``)."""
    from lightning_energy.provenance import of_report

    return of_report(report)


def report_markdown(report: dict) -> str:
    """The end-of-fit report as TensorBoard text: a markdown table of the sensors (TensorBoard renders it as an
    HTML table; a code block of the console table ran off the page's right edge), each sensor's source as a
    list item below it (they are long), then the console report's notes."""
    from lightning_energy.outputs.report import format_report

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    rows = ["| sensor | rank | scope | energy (J) | mean power (W) | how |", "|---|---:|---|---:|---:|---|"]
    sources = []
    for sensor in report.get("sensors", []):
        counted = "" if sensor.get("counted", True) else " (not counted: a lower rank reads this card)"
        rows.append(f"| {cell(sensor['name'])}{counted} | {sensor.get('rank', 0)} | {cell(sensor.get('scope', ''))} | "
                    f"{sensor['energy_J']:.2f} | {sensor.get('mean_power_W', 0.0):.2f} | "
                    f"{cell(sensor.get('provenance', ''))} |")
        sources.append(f"- **{cell(sensor['name'])}** (rank {sensor.get('rank', 0)}): {cell(sensor.get('source', ''))}")
    for host in (report.get("node") or {}).get("hosts", []):  # the BMCs' sources (an unverified certificate says so)
        for sensor in host.get("sensors", []):
            sources.append(f"- **{cell(sensor['name'])}** (node {cell(host['host'])}): {cell(sensor.get('source', ''))}")
    rows.append(f"| **total** | | | **{report['total_J']:.2f}** | {report.get('mean_power_W', 0.0):.2f} | "
                f"{cell(energy_how(report))} |")
    rows += ["", f"train {report.get('train_J', 0.0):.2f} J, validation {report.get('validation_J', 0.0):.2f} J, "
                 f"other {report.get('other_J', 0.0):.2f} J.", *node_markdown(report.get("node"), cell),
             "", "Sources:", "", *dict.fromkeys(sources)]
    console = format_report(report).splitlines()
    total_row = max((i for i, line in enumerate(console) if line.startswith("total ")), default=0)
    notes = [f"- {cell(line)}" for line in console[total_row + 1:] if line.strip()]
    notes = ["Notes:", "", *notes] if notes else []
    return "\n".join([f"**lightning-energy report** ({energy_how(report)}): {report['total_J']:.2f} J over "
                      f"{report['duration_s']:.2f} s", "", *rows, "", *notes])


def node_markdown(node: dict | None, cell) -> list[str]:
    """The report's ``node`` entry as a markdown table (none without node sensors): per host, the node's energy,
    the sum of its component sensors and the rest, each with its provenance; the rest is labelled below it."""
    if not node:
        return []

    def joules(value, provenance) -> str:
        return "-" if value is None else f"{value:.2f} ({cell(provenance or '')})"

    rows = ["", "| node | node (J) | components (J) | other (J) | node sensor |", "|---|---:|---:|---:|---|"]
    for host in node.get("hosts", []):
        rows.append(f"| {cell(host['host'])} | {joules(host['node_J'], host['node_provenance'])} | "
                    f"{joules(host['components_J'], host['components_provenance'])} | "
                    f"{joules(host['other_J'], host['other_provenance'])} | "
                    f"{cell(host.get('node_sensor') or 'none covering the run')} |")
    return [*rows, "", f"Node: the whole node's energy from its BMC, never part of the total; {cell(node['label'])}."]


def hparam_values(params) -> dict:
    """Hyperparameters as TensorBoard's HParams plugin takes them: nested keys joined with ``/``, numbers,
    strings and booleans kept, anything else (lists, None, objects) as its ``str``; keys starting with ``_`` are
    left out."""
    out: dict = {}

    def visit(prefix: str, value) -> None:
        if isinstance(value, dict) or hasattr(value, "items") and callable(value.items):
            for key, inner in value.items():
                if not str(key).startswith("_"):  # Lightning's own bookkeeping (`_instantiator`, `_class_path`)
                    visit(f"{prefix}/{key}" if prefix else str(key), inner)
        elif isinstance(value, (bool, int, float, str)):
            out[prefix] = value
        else:
            out[prefix] = str(value)

    visit("", dict(params or {}))
    return out


def _write_report(writer, params: dict, values: dict, metric_tags: list[str], text: str, step: int) -> None:
    """One writer: the hparams summary (experiment, session start and end), the metrics' values, the text."""
    from torch.utils.tensorboard.summary import hparams

    experiment, start, end = hparams(params, dict.fromkeys(metric_tags, 0.0))  # the summary takes names only
    file_writer = summary_file_writer(writer)
    for summary in (experiment, start, end):
        file_writer.add_summary(summary, step)
    for tag, value in values.items():
        writer.add_scalar(tag, value, step)
    writer.add_text(REPORT_TEXT_TAG, text, step)
    writer.flush()


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
    figure.subplots_adjust(**FIGURE_MARGINS)
    return figure


def figure_image(figure):
    """The figure rendered by its Agg canvas: an RGB ``uint8`` array, height x width x 3."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()
