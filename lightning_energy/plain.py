"""EnergyMeter: the energy of a plain PyTorch loop, or of any block of code, with no Trainer.

::

    from lightning_energy import EnergyMeter

    with EnergyMeter(log_dir="runs/plain", writer=SummaryWriter("runs/plain")) as meter:
        for epoch in range(epochs):
            for x, y in loader:
                loss = step(x, y)
                meter.step()              # the end of one optimizer step
            with meter.loop("val"):       # a validation loop: left out of the epoch's training figures
                evaluate()
            meter.epoch()                 # the end of a training epoch
    print(meter.report["total_J"])

    with meter.window("eval") as eval_energy:   # any block, inside or outside a run
        evaluate()
    print(eval_energy.energy_J, eval_energy.duration_s, eval_energy.power_W, eval_energy.bound_J)

The same core as the Trainer callbacks (:mod:`lightning_energy.core`): one sampling thread per process,
the training thread only takes marks (a timestamp, or a CUDA event on a CUDA device), and figures are
logged once the samples cover them, at the step they belong to, under the names ``EnergyCallback`` logs
(``energy/step_J``, ``energy/epoch_J``, ...). At the end (``stop()`` or the ``with`` block's end, also
after an exception) the same ``energy_report.json``, ``energy_trace.csv`` and ``energy_events.csv`` as a
fit are written to ``log_dir``. In a ``torch.distributed`` run every rank makes the same calls, as with
a Trainer; all-rank figures are settled at each epoch end.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from lightning_energy.core.collective import Collective, torch_distributed
from lightning_energy.core.figures import EpochFigures, LoopFigures, StepFigures, window_bounds
from lightning_energy.core.recorder import RunRecorder, trace_suffix
from lightning_energy.core.run import (
    Attachment, RunSession, checked_extra_sensors, checked_interval, checked_sensors, sensors_for_rank,
)
from lightning_energy.measure.meter import Mark, measure
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S, get_sampler
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.provenance import combine

DEFAULT_LOG_DIR = "energy_logs"


@dataclass
class WindowFigures:
    """A block of code measured by :meth:`EnergyMeter.window` (filled when the block ends).

    ``energy_J``: all of this rank's sensors (J); ``per_sensor_J``: per sensor; ``duration_s``: s;
    ``power_W``: mean power (W); ``bound_J``: how far the attribution can be off (J; inf: an edge
    extrapolated past the samples); ``provenance``: ``measured``, ``estimated``, ``simulated`` or a mix;
    ``missing``: sensors whose figures do not cover the block.
    """

    name: str
    energy_J: float = math.nan
    per_sensor_J: dict[str, float] = field(default_factory=dict)
    duration_s: float = math.nan
    power_W: float = math.nan
    bound_J: float = math.nan
    provenance: str = ""
    missing: tuple[str, ...] = ()


class EnergyMeter:
    """Measure a training loop (``step()``, ``epoch()``, ``loop(kind)``) or any block (``window(name)``).

    Args:
        log_dir: where the report, trace and events files go.
        writer: where metrics go: a ``torch.utils.tensorboard.SummaryWriter`` (anything with
            ``add_scalar(name, value, step)``), an object with ``log_dict(metrics, step=)`` (Fabric), a
            ``callable(name, value, step)``, or None (the report only). Written from rank zero.
        sensors: sensors to read instead of the auto-detected ones; ``backend``: ``"auto"`` or ``"zeus"``.
        extra_sensors: sensors to read beside the auto-detected ones (not with ``sensors``), e.g. the node's
            BMC: ``[RedfishPowerSensor("https://bmc-17", Credentials(user, password))]``. Node-scope sensors
            (also those ``LIGHTNING_ENERGY_REDFISH_URL`` / ``LIGHTNING_ENERGY_IPMI`` configure) are read on
            local rank 0, never added to the totals, and reported in the report's ``node`` entry (node,
            components, other); a single-node run logs ``energy/node/epoch_J`` and ``energy/other/epoch_J``
            at each epoch's step once the node's samples cover it.
        interval_s: sampling interval (s, >= 0.001).
        device: the CUDA device the loop runs on (None: the current one where CUDA is available);
            its GPU is measured and, with ``cuda_events``, steps are timed on its stream.
        write_trace: write the sample trace and events files; verbose: print the report at the end.
        collective: the run's ranks (None: ``torch.distributed``'s default group where initialised).
        telemetry: also log GPU telemetry means per logged step and epoch (as ``EnergyCallback(telemetry=True)``).
        exporters: outputs that follow the run, e.g. ``[PrometheusExporter(port=9464, pushgateway=...)]``
            (:mod:`lightning_energy.outputs.prometheus`): each gets ``attach(attachment)`` at the start,
            ``run_ended()`` after the run's end is measured and ``detach()`` at the end (also after an exception).
    """

    def __init__(self, log_dir: str | Path = DEFAULT_LOG_DIR, writer: Any = None, sensors: list[Sensor] | None = None,
                 backend: str = "auto", extra_sensors: list[Sensor] | None = None, interval_s: float = DEFAULT_INTERVAL_S, device: Any = None,
                 write_trace: bool = True, verbose: bool = True, cuda_events: bool = True,
                 collective: Collective | None = None, telemetry: bool = False, exporters: list | None = None) -> None:
        self.user_sensors = checked_sensors(sensors, backend)
        self.extra_sensors = checked_extra_sensors(extra_sensors, sensors)
        self.backend, self.interval_s = backend, checked_interval(interval_s)
        self.log_dir = Path(log_dir)
        self.device, self.cuda_events = device, cuda_events
        self.write_trace, self.verbose, self.telemetry = write_trace, verbose, telemetry
        self._log = _metrics_logger(writer)
        self._collective = collective
        self.report: dict | None = None
        self.report_path: Path | None = None
        self.report_extra: dict = {}  # more top-level report entries a front end adds (the process monitor's command)
        self.epochs: list[dict] = []  # the report rows of the epochs measured so far
        self.loops: list[LoopFigures] = []
        self._session: RunSession | None = None
        self._recorder: RunRecorder | None = None
        self._epoch = 0
        self._last: Mark | None = None  # the latest boundary placed: where the next step or epoch starts
        self._last_step: StepFigures | None = None
        self.exporters = list(exporters or [])
        for exporter in self.exporters:
            if not all(callable(getattr(exporter, name, None)) for name in ("attach", "run_ended", "detach")):
                raise TypeError("each of `exporters` needs attach(attachment), run_ended() and detach() (e.g. a "
                                f"lightning_energy.outputs.prometheus.PrometheusExporter), got {type(exporter).__name__}")

    # ---------------------------------------------------------------- the run
    def __enter__(self) -> "EnergyMeter":
        return self.start()

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None and self._recorder is not None:
            self._recorder.event("exception")
        self.stop()

    @property
    def running(self) -> bool:
        return self._session is not None

    @property
    def timeline(self):
        """The run's :class:`~lightning_energy.core.timeline.Timeline` while running, else None."""
        return self._session.timeline if self._session is not None else None

    def start(self) -> "EnergyMeter":
        """The run's start: open the sensors, start the trace, place the first boundary. Collective."""
        if self._session is not None:
            return self
        collective = self._collective or torch_distributed()
        device = _cuda_device(self.device)
        clock = None
        if device is not None and self.cuda_events:
            from lightning_energy.measure.clocks import device_clock

            clock = device_clock(device)
        session = self._session = RunSession(get_sampler(), clock, collective, host=self)
        sensors, notes, zeus = sensors_for_rank(device.index if device is not None else None,
                                                collective.local_rank == 0, self.user_sensors, self.backend,
                                                self.extra_sensors)
        attachment = Attachment(session, self, list(sensors), list(notes), zeus,
                                auto=self.user_sensors is None and self.backend == "auto")
        session.add(attachment, self.interval_s)
        for exporter in self.exporters:  # collective under DDP, as start() is
            exporter.attach(attachment)
        if collective.is_zero:
            for note in attachment.notes:
                warnings.warn(f"lightning-energy: {note}", UserWarning, stacklevel=3)
        self._recorder = RunRecorder(attachment, collective, self.log_dir, self.write_trace, trace_suffix(collective.rank),
                                     telemetry=self.telemetry)
        self.epochs, self.loops = self._recorder.epochs, self._recorder.loops
        timeline = session.timeline
        timeline.subscribe(self)
        timeline.fit_started()
        self._recorder.event("fit_start", timeline.fit_start.t, mark=timeline.fit_start)
        timeline.train_started()
        self._last, self._epoch = timeline.fit_start, 0
        return self

    def step_started(self) -> None:
        """Optional: the step starts now (without it a step starts where the previous boundary was, so the
        time spent loading its batch counts in it; a Trainer's step starts after the batch is loaded)."""
        self._ensure_epoch()
        self.timeline.step_started()

    def step(self, log: bool = True) -> None:
        """The end of one optimizer step (``log``: log its figures)."""
        self._ensure_epoch()
        timeline = self.timeline
        timeline.step_started(start=self._last)  # nothing changes when step_started() opened it
        self._last = timeline.step_ended(log=log) or self._last

    def epoch(self) -> None:
        """The end of a training epoch (the next starts with the next step). Collective."""
        timeline = self._running().timeline
        if timeline.open_epoch is None:
            self._ensure_epoch()
        self._last = timeline.epoch_ended() or self._last
        self._epoch += 1
        self._recorder.warn_failures()

    @contextlib.contextmanager
    def loop(self, kind: str = "val") -> Iterator[None]:
        """A validation (``"val"``), ``"test"`` or ``"predict"`` loop: left out of the epoch it runs in, logged
        as ``energy/val_epoch_J`` etc. Collective when it runs outside an epoch."""
        if kind not in ("val", "test", "predict"):
            raise ValueError(f"`kind` must be 'val', 'test' or 'predict', got {kind!r}")
        timeline = self._running().timeline
        timeline.loop_started(kind, self._epoch, fitting=True)
        try:
            yield
        finally:
            self._last = timeline.loop_ended(kind) or self._last

    @contextlib.contextmanager
    def window(self, name: str = "window") -> Iterator[WindowFigures]:
        """Measure the block: the yielded :class:`WindowFigures` is filled when it ends (waiting, bounded,
        for the samples to cover its end). Outside a run the meter starts for the block and stops after."""
        own_run = self._session is None
        if own_run:
            self.start()
        figures = WindowFigures(name)
        timeline = self.timeline
        start = timeline.mark()
        try:
            yield figures
        finally:
            end = timeline.mark()
            timeline.meter.wait(end)
            self._fill(figures, start, end)
            if own_run:
                self.stop()

    def stop(self) -> dict | None:
        """The run's end: wait (bounded) for the samples to cover it, deliver every figure, write the report,
        trace and events; returns the report (rank zero; None elsewhere). Collective."""
        if self._session is None:
            return self.report
        recorder, timeline = self._recorder, self.timeline
        try:
            timeline.fit_ended()
            for exporter in self.exporters:  # the run's final figures (collective)
                exporter.run_ended()
            if self._last_step is not None:
                self._log_metrics(recorder.step_metrics(self._last_step), self._last_step.step)
            recorder.warn_failures()
            end = timeline.fit_end
            recorder.event("fit_end", end.t, mark=end)
            recorder.warn_output_problems()
            report = recorder.finish(end, recorder.attachment.notes, extra=self.report_extra)
            self._log_node_metrics()
            if report is not None:
                self.report = report
                self._log_metrics({"energy/total_J": report["total_J"]}, max(timeline.steps_ended - 1, 0))
                self.report_path = recorder.write_report(report, self.verbose)
        finally:
            recorder.close()
            for exporter in self.exporters:
                exporter.detach()
            timeline.unsubscribe(self)
            self._session.remove(self)
            self._session = self._recorder = None
        return self.report

    # ---------------------------------------------------------------- figures from the timeline
    def on_step_measured(self, host, figures: StepFigures) -> None:
        if not figures.log:
            self._last_step = figures
            return
        self._last_step = None
        self._log_metrics(self._recorder.step_metrics(figures), figures.step)

    def on_loop_measured(self, host, figures: LoopFigures) -> None:
        figures, metrics = self._recorder.loop_measured(figures)
        self._log_metrics(metrics, figures.step)

    def on_epoch_measured(self, host, figures: EpochFigures) -> None:
        row, metrics = self._recorder.epoch_measured(figures)
        self._log_metrics(metrics, figures.step)
        self._log_node_metrics()

    # ---------------------------------------------------------------- helpers
    def _running(self) -> "EnergyMeter":
        if self._session is None:
            raise RuntimeError("EnergyMeter is not running: call start() or use `with EnergyMeter(...) as meter:`")
        return self

    def _ensure_epoch(self) -> None:
        timeline = self._running().timeline
        if timeline.open_epoch is None:
            timeline.epoch_started(self._epoch, start=self._last)

    def _log_node_metrics(self) -> None:
        for step, metrics in self._recorder.node_metrics():
            self._log_metrics(metrics, step)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._log is not None and self._recorder is not None and self._recorder.collective.is_zero:
            self._log(metrics, step)

    def _fill(self, figures: WindowFigures, start: Mark, end: Mark) -> None:
        names = self._recorder.names
        m = measure(start, end)
        per_sensor = {n: m.energy_J[n] for n in names if n in m.energy_J}
        figures.per_sensor_J = per_sensor
        figures.energy_J = sum(per_sensor.values())
        figures.duration_s = m.duration_s
        figures.power_W = figures.energy_J / m.duration_s if m.duration_s > 0 else 0.0
        figures.bound_J = sum(window_bounds(start, end, per_sensor).values())
        figures.provenance = combine(s.provenance for s in self._recorder.attachment.sensors)
        figures.missing = tuple(m.missing)


def _metrics_logger(writer: Any) -> Callable[[dict[str, float], int], None] | None:
    """``log(metrics, step)`` for ``writer`` (see :class:`EnergyMeter`)."""
    if writer is None:
        return None
    if hasattr(writer, "add_scalar"):
        def to_summary_writer(metrics: dict[str, float], step: int) -> None:
            for name, value in metrics.items():
                writer.add_scalar(name, value, step)
        return to_summary_writer
    if hasattr(writer, "log_dict"):
        return lambda metrics, step: writer.log_dict(metrics, step=step)
    if callable(writer):
        def to_callable(metrics: dict[str, float], step: int) -> None:
            for name, value in metrics.items():
                writer(name, value, step)
        return to_callable
    raise TypeError("`writer` must be a SummaryWriter (add_scalar), an object with log_dict(metrics, step=), "
                    f"a callable(name, value, step) or None, got {type(writer).__name__}")


def _cuda_device(device: Any):
    """The torch CUDA device to measure (None: none). ``device`` None: the current one where CUDA is up;
    ``"cpu"``: none (torch is not imported for it: the process monitor runs without torch)."""
    if isinstance(device, str) and device == "cpu":
        return None
    try:
        import torch
    except ImportError:
        return None
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
