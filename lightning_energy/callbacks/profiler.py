"""EnergyProfiler: torch.profiler traces with power counter tracks, and the energy of every operator."""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.io import atomic_write_text
from lightning_energy.measure.meter import Mark, Measurement, measure
from lightning_energy.outputs.op_energy import (
    DEVICE_SYNC_MARKER, IDLE_ROWS, SYNC_MARKER, Attribution, EnergyCurve, WindowRecorder, attribute_energy,
    clock_offset_us, counter_events, device_clock_offset_us, device_of, read_chrome_trace, write_chrome_trace,
)
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.series import bound_between
from lightning_energy.provenance import combine, tagged
from lightning_energy.units import US_PER_S

log_info = rank_zero_info_for(__name__)

ACTIVITIES = ("cpu", "cuda")
TRACE_GLOB = "*.pt.trace.json*"
OPS_CSV = "op_energy_step{step}{suffix}.csv"
FLUSH = "profiler_flush"  # the timeline's sub-window of the trace export and its annotation
SYNC_TIGHT_S = 100e-6  # a sync marker taking longer was probably preempted: take another (up to 3)
SYNC_ATTEMPTS = 3


@dataclass
class _Window:
    """One profiled window (the active steps of one schedule cycle) while it is recorded."""

    start: Mark
    unix_minus_perf_s: float
    syncs: list[tuple[float, float]] = field(default_factory=list)
    device_syncs: list[tuple[float, float]] = field(default_factory=list)  # around each DEVICE_SYNC_MARKER
    end: Mark | None = None
    samples: list = field(default_factory=list)


@dataclass
class ProfiledWindow:
    """What one profiled window produced."""

    step: int
    trace_path: Path
    csv_path: Path
    window_J: float
    window_s: float
    clock_offset_us: float
    clock_uncertainty_us: float
    counter_events: int
    attribution: Attribution
    device_clock_offset_us: float = math.nan  # of the GPU's tracks; NaN on a run without one
    device_clock_uncertainty_us: float = math.nan


class EnergyProfiler(MeteredCallback):
    """Profile training steps with ``torch.profiler`` and put the measured energy into the traces.

    For every cycle of the schedule (``skip_first`` steps, then ``wait``, ``warmup`` and ``active``
    training steps, ``repeat`` times; 0 = until training ends) it writes into the logger's log dir,
    where the TensorBoard profiler plugin finds it under the same run as the scalars:

    - ``<host>_<pid>.<ns>.pt.trace.json``: the trace from ``torch.profiler.tensorboard_trace_handler``,
      rewritten atomically with counter tracks ``power <sensor> (W)`` (every sample of the window) and
      ``energy <sensor> (J)`` (since the window start), aligned to the trace's clock (see
      :mod:`lightning_energy.outputs.op_energy`): a device sensor's tracks sit in the GPU's process, beside its
      kernels, on the device tracks' clock; plus a ``lightningEnergy`` entry (window, clock offsets of
      the host and device tracks, ``estimated`` and ``estimated_sensors``).
    - ``op_energy_step<global step>.csv``: the window's measured energy split among operators by the
      rule in :mod:`lightning_energy.outputs.op_energy`: each sensor's energy goes to the tracks of its scope
      (on a GPU run, device sensors to the kernels and copies on this rank's GPU, host sensors to the
      CPU threads; on a CPU run every sensor to the CPU threads); the innermost op per thread/stream
      holds the time, concurrent ops share equally, the rest is idle; so per sensor the ops and the
      idle rows add up to the window. Columns ``op, track, calls, time_s, energy_J,
      share_of_step_energy, sensors`` (the sensors ``energy_J`` includes), ``energy_source``
      (``estimated`` when one of them is an estimate, such as the CPU estimate from TDP and load, else
      ``measured``), and for host ops on a GPU run ``launched_kernels, launched_device_J,
      launched_device_sensors, launched_device_source``: the device energy of the kernels the op
      launched (so ``aten::mm`` shows what its kernels cost). The text table and the counter tracks
      say which figures are estimates too, and an info message says it once at setup.

    At fit end one line (rank zero, the ``lightning_energy`` logger) gives the profiled windows' energy, whether
    it is measured, estimated or simulated, the op that took most of it, and the folder of the traces and
    ``op_energy_step*.csv`` tables (:meth:`summary_line`).

    Logged (rank zero, at the global step that ends the window): ``profiler/window_J``,
    ``profiler/window_s``, ``profiler/window_W``, ``profiler/idle_J`` and, with TensorBoard, the text
    table ``energy/ops``. The window is the profiled steps from the ``ProfilerStep`` boundary before
    the first active step to the end of the last one (data loading between them included).

    Why a Callback and not a Lightning ``Profiler`` subclass: a Trainer takes one profiler only, so a
    subclass would exclude the Simple/Advanced profilers; a ``Profiler`` sees actions by name without
    the trainer, module, loggers or step numbers it needs to log tables and align windows with steps; and
    a callback can share the meter session of an ``EnergyCallback`` in the same Trainer. Lightning's
    own ``PyTorchProfiler`` cannot run at the same time (one torch profiler per process).

    The samples come from the shared sampler (no thread of its own): a short window holds few of them,
    so lower ``interval_s`` (it raises the shared sampling rate while this callback is attached) for
    a finer power curve. Post-processing (reading, annotating and rewriting the trace) runs on the
    training thread once per window, like the trace export itself, after the last profiled step has
    ended; the Trainer's timeline reports that work apart as the sub-window ``profiler_flush`` (with an
    ``EnergyCallback``: ``energy/extra/profiler_flush_J`` where it falls inside a step under gradient
    accumulation, else in the epoch's ``extras_J``), never inside a step's figures, whatever the order
    of the callbacks. The energy is that of this callback's sensors only.

    Args:
        wait, warmup, active, repeat, skip_first: the ``torch.profiler.schedule`` in training steps
            (``warmup >= 1``: the first recorded step is skewed without it; ``active >= 1``).
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
        activities: ``"cpu"``/``"cuda"`` to record; default CPU, plus CUDA when training on a GPU. Without
            ``"cuda"`` the trace holds no kernels, so device sensors are split among the CPU threads too.
        sensors: sensors to read instead of those of an ``EnergyCallback`` or the auto-detected ones.
        interval_s: sampling interval requested from the shared sampler (s, >= 0.001).
        use_gzip: write ``.pt.trace.json.gz``.
        top_ops: rows of the TensorBoard text table (the CSV holds every op).
    """

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        activities: list[str] | None = None,
        sensors: list[Sensor] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        use_gzip: bool = False,
        top_ops: int = 25,
    ) -> None:
        super().__init__()
        for name, value, least in (("wait", wait, 0), ("warmup", warmup, 1), ("active", active, 1),
                                   ("repeat", repeat, 0), ("skip_first", skip_first, 0), ("top_ops", top_ops, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"`{name}` must be an integer >= {least}, got {value!r}")
        for name, value in (("record_shapes", record_shapes), ("profile_memory", profile_memory),
                            ("with_stack", with_stack), ("use_gzip", use_gzip)):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}")
        if activities is not None:
            if isinstance(activities, str) or not all(a in ACTIVITIES for a in activities) or not activities:
                raise ValueError(f"`activities` must be a non-empty list drawn from {ACTIVITIES}, got {activities!r}")
        self.schedule = dict(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.activities = None if activities is None else list(activities)
        self.configure_measurement(sensors, interval_s=interval_s)
        self.use_gzip = use_gzip
        self.top_ops = top_ops
        self.windows: list[ProfiledWindow] = []
        self._reset()

    def _reset(self) -> None:
        self._profiler = None
        self._recorder = WindowRecorder()
        self._window: _Window | None = None
        self._pending: _Window | None = None
        self._processing = True
        self._windows_opened = 0
        self._log_dir: Path | None = None
        self._trainer: Trainer | None = None
        self.estimated_sensors: list[str] = []  # this rank's sensors that are estimates
        self._provenance: dict[str, str] = {}  # sensor name -> measured / estimated / simulated
        self._scopes: dict[str, str] = {}  # sensor name -> "device" / "host"
        self._device: int | None = None  # the CUDA index whose kernels are profiled; None on a CPU run
        self._device_probe = None  # a one-element tensor on that GPU: the device sync marker's kernel

    # ---------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        from lightning.pytorch.profilers import PyTorchProfiler

        if isinstance(trainer.profiler, PyTorchProfiler):
            raise ValueError("EnergyProfiler runs torch.profiler itself and cannot share the process with "
                             "Trainer(profiler='pytorch'); remove one of them")
        if self.activities and "cuda" in self.activities and trainer.strategy.root_device.type != "cuda":
            raise ValueError("EnergyProfiler(activities=[..., 'cuda']) needs a CUDA device; this Trainer runs on "
                             f"{trainer.strategy.root_device}")
        self._reset()
        self.windows = []
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # trainer.log_dir is collective
        self._trainer = trainer
        self._suffix = "" if trainer.global_rank == 0 else f"_rank{trainer.global_rank}"
        attachment = self.attach(trainer, self._user_sensors, interval_s=self.interval_s)
        self.estimated_sensors = sorted(s.name for s in attachment.sensors if s.estimated)
        self._scopes = {s.name: s.scope for s in attachment.sensors}
        self._provenance = {s.name: s.provenance for s in attachment.sensors}
        if self.estimated_sensors:
            log_info(f"EnergyProfiler: sensors {self.estimated_sensors} are estimates, not measurements; the "
                           "energy in the traces and per-op tables is labelled estimated")
        self._sampler = attachment.sampler
        self._sampler.add_listener(self._recorder)

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        if exception is not None:
            self._processing = False  # no trace post-processing for a failed run
        self._release()

    def _release(self) -> None:
        self._device_probe = None
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
        sampler = self.__dict__.pop("_sampler", None)
        if sampler is not None:
            sampler.remove_listener(self._recorder)

    def _flush(self):
        """The trace export and its annotation: a sub-window of the timeline, left out of step figures."""
        timeline = self.timeline
        return timeline.extra(FLUSH) if timeline is not None else contextlib.nullcontext()

    # ---------------------------------------------------------------- profiling
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import torch.profiler as tp

        root = trainer.strategy.root_device
        names = self.activities or (["cpu", "cuda"] if root.type == "cuda" else ["cpu"])
        kinds = {"cpu": tp.ProfilerActivity.CPU, "cuda": tp.ProfilerActivity.CUDA}
        if "cuda" in names:
            import torch

            self._device = root.index if root.index is not None else torch.cuda.current_device()
            self._device_probe = torch.zeros(1, device=torch.device("cuda", self._device))
        self._trace_handler = tp.tensorboard_trace_handler(str(self._log_dir), use_gzip=self.use_gzip)
        self._profiler = tp.profile(
            activities=[kinds[n] for n in names],
            schedule=tp.schedule(**self.schedule),
            on_trace_ready=self._on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._profiler.start()
        self._open_window_if_recording()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        profiler = self._profiler
        if profiler is None:
            return
        from torch.profiler import ProfilerAction

        exporting = profiler.current_action == ProfilerAction.RECORD_AND_SAVE
        if exporting:
            self._close_window()
        # the step's end is marked already (the timeline's boundary comes before this body, in any order)
        with self._flush() if exporting else contextlib.nullcontext():
            with warnings.catch_warnings():  # "clears events at the end of each cycle": one trace per cycle is the aim
                warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
                profiler.step()  # exports the trace at the end of a cycle (-> _on_trace_ready)
        self._open_window_if_recording()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._profiler is None:
            return
        if self._window is not None:  # training ended inside the active steps: keep what was recorded
            self._close_window()
        profiler, self._profiler = self._profiler, None
        with self._flush():
            profiler.stop()  # exports a window left open
        if self._windows_opened == 0 and trainer.is_global_zero:
            rank_zero_warn(f"EnergyProfiler: training ended before the schedule {self.schedule} reached an active "
                           "step; no trace was written")

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._log_dir is not None:
            log_info(self.summary_line())

    def summary_line(self) -> str:
        """One line on this rank's profiled windows: their energy (J, with its provenance), time (s), the op that
        took the most energy, and where the traces and per-op tables were written."""
        where = (f"traces (*.pt.trace.json: TensorBoard's PyTorch Profiler plugin, torch-tb-profiler, or Perfetto) "
                 f"and per-op energy (op_energy_step*.csv) in {self._log_dir}")
        if not self.windows:
            return f"EnergyProfiler: no window profiled (schedule {self.schedule}); nothing written to {self._log_dir}"
        energy_J = sum(w.window_J for w in self.windows)
        seconds = sum(w.window_s for w in self.windows)
        sensors = {name for w in self.windows for name in w.attribution.sensor_J}
        provenance = combine(self._provenance.get(name, "measured") for name in sensors)
        by_op: dict[str, float] = {}
        for w in self.windows:
            for row in w.attribution.rows:
                if row.op not in IDLE_ROWS:
                    by_op[row.op] = by_op.get(row.op, 0.0) + row.energy_J
        top = max(by_op, key=by_op.get) if by_op else None
        most = f", most in {top} ({by_op[top]:.3g} J)" if top is not None else ""
        count = f"{len(self.windows)} profiled window{'s' if len(self.windows) != 1 else ''}"
        return f"EnergyProfiler: {count}, {tagged(f'{energy_J:.3g} J', provenance)} in {seconds:.3g} s{most}; {where}"

    def _open_window_if_recording(self) -> None:
        from torch.profiler import ProfilerAction

        if self._window is None and self._profiler.current_action in (ProfilerAction.RECORD,
                                                                        ProfilerAction.RECORD_AND_SAVE):
            self._recorder.open()
            mark = self.timeline.mark()  # the ProfilerStep boundary: not one of the timeline's own
            self._window = _Window(mark, time.time() - time.perf_counter())
            self._windows_opened += 1
            self._sync()

    def _close_window(self) -> None:
        window, self._window = self._window, None
        if window is None:
            return
        self._sync(window)
        window.end = self.timeline.mark()
        self._pending = window

    def _sync(self, window: _Window | None = None) -> None:
        """An empty marker op between two perf_counter readings: ties the trace clock to the sampler's.

        On a CUDA run also a device marker: synchronise, read perf_counter, launch one tiny kernel inside
        :data:`DEVICE_SYNC_MARKER`, synchronise, read again; the kernel ran between the two readings, which
        ties the device tracks' clock to the sampler's (once per window end: two synchronisations).
        """
        from torch.profiler import record_function

        window = window or self._window
        syncs = window.syncs
        for _ in range(SYNC_ATTEMPTS):
            before = time.perf_counter()
            with record_function(SYNC_MARKER):
                pass
            syncs.append((before, time.perf_counter()))
            if syncs[-1][1] - before < SYNC_TIGHT_S:
                break
        if self._device_probe is not None:
            import torch

            torch.cuda.synchronize(self._device)
            before = time.perf_counter()
            with record_function(DEVICE_SYNC_MARKER):
                self._device_probe.add_(1.0)
            torch.cuda.synchronize(self._device)
            window.device_syncs.append((before, time.perf_counter()))

    # ---------------------------------------------------------------- the exported trace
    def _on_trace_ready(self, profiler) -> None:
        before = set(self._log_dir.glob(TRACE_GLOB))
        self._trace_handler(profiler)
        window, self._pending = self._pending, None
        if window is None or not self._processing:
            return
        written = sorted(set(self._log_dir.glob(TRACE_GLOB)) - before, key=lambda p: p.stat().st_mtime)
        try:
            if not written:
                raise FileNotFoundError(f"torch.profiler reported a trace but none appeared in {self._log_dir}")
            self.windows.append(self._annotate(window, written[-1], self._trainer))
        except (OSError, ValueError, TypeError) as err:  # a broken trace never stops training
            warnings.warn(f"EnergyProfiler: could not add energy to the trace ({type(err).__name__}: {err}); "
                          "training goes on", RuntimeWarning, stacklevel=2)

    def _annotate(self, window: _Window, trace_path: Path, trainer: Trainer) -> ProfiledWindow:
        end = self.attachment.meter.wait(window.end)  # once per window; marks resolve in order: the start too
        names = set(self.attachment.sensor_names)  # the session's other callbacks may read other sensors
        samples = [(t, {n: v for n, v in values.items() if n in names}) for t, values in self._recorder.close()]
        start_J = {n: j for n, j in window.start.energy.items() if n in names}
        end_J = {n: j for n, j in end.energy.items() if n in names}
        measured = _measure_only(window.start, end, names)
        trace = read_chrome_trace(trace_path)
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            raise ValueError(f"{trace_path} is not a Chrome trace (no traceEvents list)")
        offset, uncertainty = clock_offset_us(events, window.syncs, trace.get("baseTimeNanoseconds"),
                                         window.unix_minus_perf_s)
        device_offset, device_uncertainty = self._device_offset(events, window, offset)
        curve = EnergyCurve.from_window(window.start.t, start_J, end.t, end_J, samples)
        estimated = set(self.estimated_sensors) & set(measured.energy_J)
        attribution = attribute_energy(events, curve, offset, estimated=estimated, scopes=self._scopes,
                                       device=self._device, device_offset_us=device_offset)
        pid = next((e.get("pid") for e in events if e.get("name") == SYNC_MARKER), os.getpid())
        device_pid = next((e.get("pid") for e in events if self._device is not None and device_of(e) == self._device),
                          None)
        placement = {name: (device_pid, device_offset) for name, scope in self._scopes.items()
                     if scope == "device" and device_pid is not None}
        counters = counter_events(samples, curve, offset, pid, estimated, placement)
        events.extend(counters)
        trace["lightningEnergy"] = {
            "window_start_ts_us": window.start.t * US_PER_S + offset,
            "window_end_ts_us": end.t * US_PER_S + offset,
            "window_J": measured.total_J,
            "window_s": measured.duration_s,
            "energy_J": measured.energy_J,
            "clock_offset_us": offset,
            "clock_uncertainty_us": _json_number(uncertainty),
            "device": self._device,
            "device_clock_offset_us": _json_number(device_offset),
            "device_clock_uncertainty_us": _json_number(device_uncertainty),
            "sensor_tracks": attribution.sensor_track,
            "unlinked_device_J": attribution.unlinked_device_J,
            "samples": len(samples),
            "samples_dropped": self._recorder.dropped,
            "extrapolated": measured.extrapolated,
            "estimated": bool(estimated),
            "estimated_sensors": sorted(estimated),
        }
        write_chrome_trace(trace_path, trace)
        step = trainer.global_step
        csv_path = atomic_write_text(self._log_dir / OPS_CSV.format(step=step, suffix=self._suffix),
                                     attribution.csv_text())
        if trainer.is_global_zero:
            self._log(trainer, step, measured, attribution)
        return ProfiledWindow(step, trace_path, csv_path, measured.total_J, measured.duration_s, offset, uncertainty,
                              len(counters), attribution, device_offset, device_uncertainty)

    def _device_offset(self, events: list[dict], window: _Window, host_offset: float) -> tuple[float, float]:
        """The device tracks' clock offset from the device sync markers; on a CPU run NaN, NaN. Where no
        marker kernel is in the trace the host offset is used, with a NaN uncertainty (unchecked)."""
        if self._device is None:
            return math.nan, math.nan
        offset, uncertainty = device_clock_offset_us(events, window.device_syncs, self._device)
        return (host_offset, math.nan) if math.isnan(offset) else (offset, uncertainty)

    def _log(self, trainer: Trainer, step: int, measured, attribution: Attribution) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        metrics = {
            "profiler/window_J": measured.total_J,
            "profiler/window_s": measured.duration_s,
            "profiler/window_W": measured.mean_power_W,
            "profiler/idle_J": attribution.idle_J,
        }
        self.log_metrics(trainer, metrics, step)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("energy/ops", attribution.markdown(self.top_ops), global_step=step)
                logger.experiment.flush()


def _json_number(value: float) -> float | None:
    """``value``, or None for NaN (JSON has no NaN; trace viewers reject it)."""
    return None if math.isnan(value) else value


def _measure_only(start: Mark, end: Mark, names: set[str]) -> Measurement:
    """The measurement between two resolved marks over the sensors in ``names`` only."""
    m = measure(start, end)
    energy = {n: j for n, j in m.energy_J.items() if n in names}
    bound = sum(bound_between(start.bounds.get(n), end.bounds.get(n)) for n in energy) if energy else 0.0
    return Measurement(m.start_s, m.end_s, energy, tuple(n for n in m.missing if n in names), m.extrapolated, bound)
