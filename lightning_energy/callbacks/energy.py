"""EnergyCallback: the energy, power and time of every training step and epoch, beside the loss."""

from __future__ import annotations

import math
import re
import socket
import warnings
import weakref
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.measure import ranks as distributed
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.lightning_internals import epoch_end_log_step, progress_bar_dict
from lightning_energy.integration.timeline import EpochFigures, LoopFigures, StepFigures
from lightning_energy.io import try_atomic_write_json
from lightning_energy.measure.meter import Mark
from lightning_energy.outputs.report import REPORT_FILE, build_report, format_report
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.outputs.tensorboard import EpochPowerRecorder, TensorBoardExtras
from lightning_energy.outputs.trace import TraceWriter
from lightning_energy.units import J_PER_KJ

log_info = rank_zero_info_for(__name__)

LOOP_METRICS = {  # loop kind -> (energy, time, power) metric names
    "val": ("energy/val_epoch_J", "time/val_epoch_s", "power/val_epoch_W"),
    "test": ("energy/test_epoch_J", "time/test_epoch_s", "power/test_epoch_W"),
    "predict": ("energy/predict_J", "time/predict_s", "power/predict_W"),
}


def _no_trainer() -> None:
    """A weak reference to no Trainer."""
    return None


def sensor_metric(sensor_name: str) -> str:
    """The per-sensor epoch metric: ``energy/sensor/<name>/epoch_J`` (characters loggers reject become ``_``)."""
    return f"energy/sensor/{re.sub(r'[^A-Za-z0-9_.-]', '_', sensor_name)}/epoch_J"


class EnergyCallback(MeteredCallback):
    """Measure energy per training step and epoch on any hardware and log it beside the loss.

    ``Trainer(callbacks=[EnergyCallback()])`` needs no configuration: it reads this rank's NVIDIA GPU
    through NVML, the CPU package and DRAM through RAPL, and falls back to a labelled CPU estimate when
    nothing can be measured. One background thread per process samples every sensor; the training
    thread only takes timestamps (or records CUDA events) at boundaries, and figures are logged once the
    samples cover them (a few steps later at most), at the step they belong to.

    Logged through every Lightning logger (TensorBoard, CSV, MLflow, ...; no metric name is a path prefix
    of another; units in the names; the public contract):

    - ``energy/step_J``, ``power/step_W``, ``time/step_s``: one optimizer step (with gradient
      accumulation: all its micro-batches), this rank's sensors plus host sensors on local rank 0, at the
      steps Lightning logs the loss at (``log_every_n_steps``, and the last step). Work other callbacks
      add inside a step is left out and logged apart: ``energy/extra/<name>_J``, ``time/extra/<name>_s``.
    - ``energy/total_J``: energy of all ranks since the first fit started, continuing across resumes and
      across ``fit`` calls on one Trainer; at every epoch end, (single process only) also at the
      step-level logging steps, and at the end of fit the report's total (so the last value logged is the
      run's total that every output shows). Under DDP the step-level figure would need a collective per step, so:
    - ``energy/rank0_total_J`` (DDP only, step level): rank 0's sensors alone since this fit started.
    - ``energy/epoch_J``, ``power/epoch_W``, ``time/epoch_s``, ``edp/epoch_Js`` (energy x time): one
      training epoch without its validation, all ranks over one common interval (power: the sum of the
      sensors' powers).
    - ``energy/sensor/<sensor name>/epoch_J``: the same per sensor.
    - ``energy/epoch_between_steps_J``: the epoch's energy outside the steps (data loading, hooks).
    - ``energy/val_epoch_J``, ``power/val_epoch_W``, ``time/val_epoch_s``; ``energy/test_epoch_J``, ...;
      ``energy/predict_J``, ``power/predict_W``, ``time/predict_s``: validation, test and predict loops.
    - ``energy/zeus_epoch_J``: with ``backend="zeus"``, Zeus's own ``ZeusMonitor`` windows over the
      same interval as ``energy/epoch_J`` (closed while validation runs), summed over ranks.
    - progress bar: ``energy_kJ``, the ``energy/total_J`` figure (under DDP updated at epoch ends only).

    A sensor that fails mid-run (or hangs in a read) is warned about once, on the rank where it fails;
    its energy up to its last good sample stays counted, later windows get none from it, and the report
    flags the sensor (``missing_from_s``) and the epochs it misses (``missing_sensors``). A sensor that
    cannot be opened is warned about and left out.

    With a TensorBoard logger also: a custom-scalars layout placing the training loss beside
    ``energy/step_J`` and the validation loss beside ``energy/val_epoch_J``, a figure ``power/trace`` of
    each epoch's power (drawn off the training thread, within 1 % of the run's time; epochs of fewer than
    10 samples get none) and, at the end of fit, the report: its totals as HParams metrics
    (``report/energy_total_J``, ...; in place of Lightning's ``hp_metric = -1``) and its table as text. At the end of fit: a console table and ``energy_report.json`` in the log
    dir; the sample trace ``energy_trace.csv`` and ``energy_events.csv`` (``_rank<N>`` suffix on ranks
    other than 0, ``_fit<N>`` for the N-th fit of one callback).

    Args:
        sensors: sensors to read instead of the auto-detected ones (``lightning_energy.Sensor``).
        backend: ``"auto"`` (NVML, RAPL, estimate) or ``"zeus"`` (read through Zeus's ZeusMonitor).
        interval_s: sampling interval in seconds (>= 0.001).
        log_power_figure: add the per-epoch power figure to TensorBoard.
        write_trace: stream the sample trace to CSV in the log dir.
        verbose: print the report table at the end of fit (rank zero).
        cuda_events: on CUDA, time steps with CUDA events instead of host timestamps.
    """

    provides_default_sensors = True

    def __init__(
        self,
        sensors: list[Sensor] | None = None,
        backend: str = "auto",
        interval_s: float = DEFAULT_INTERVAL_S,
        log_power_figure: bool = True,
        write_trace: bool = True,
        verbose: bool = True,
        cuda_events: bool = True,
    ) -> None:
        super().__init__()
        self.configure_measurement(sensors, backend, interval_s)
        self.fit_start_s: float | None = None  # sampler clock (s) of the last fit's start and end
        self.fit_end_s: float | None = None
        self.last_epoch_end_s: float | None = None
        self.check_flags(log_power_figure=log_power_figure, write_trace=write_trace, verbose=verbose,
                         cuda_events=cuda_events)
        self.log_power_figure = log_power_figure
        self.write_trace = write_trace
        self.verbose = verbose
        self.cuda_events = cuda_events
        self.report: dict | None = None
        self.report_path: Path | None = None
        self.trace_path: Path | None = None
        self.loops: list[LoopFigures] = []  # every loop measured by this callback (validate/test/predict too)
        self._resumed: dict = {}
        self._final_state: dict | None = None
        self._final_trainer = _no_trainer  # the Trainer whose fit left ``_final_state`` (a weak reference)
        self._fits = 0
        self._reset_run_state()

    @property
    def user_sensors(self) -> list[Sensor] | None:
        """The sensors given at construction (None: auto-detected)."""
        return self._user_sensors

    @property
    def sensors_in_use(self) -> list[Sensor]:
        """The sensors this rank reads during the current run (empty outside a run)."""
        return list(self._sensors) if self.attachment is not None else []

    @property
    def state_key(self) -> str:
        # Lightning reads it at every hook call of every callback (profiler labels): built once
        key = self.__dict__.get("_state_key")
        if key is None:
            sensors = None if self._user_sensors is None else tuple(s.name for s in self._user_sensors)
            key = self._state_key = self._generate_state_key(backend=self.backend, sensors=sensors)
        return key

    def _reset_run_state(self) -> None:
        self._sampler = None
        self._sensors: list[Sensor] = []
        self._names: list[str] = []
        self._all_names: list[str] = []
        self._zeus = None
        self._zeus_epochs: dict[int, float] = {}
        self._trace: TraceWriter | None = None
        self._power = EpochPowerRecorder()
        self._tb: TensorBoardExtras | None = None
        self._session_train_J = 0.0
        self._session_validation_J = 0.0
        self._epochs: list[dict] = list(self._resumed.get("epochs", []))
        self._warned_failures: set[str] = set()
        self._failures_seen = 0
        self._notes: list[str] = []
        self._trainer: Trainer | None = None  # while set up: state_dict gathers over its ranks
        self._rank = 0
        self._last_step: StepFigures | None = None  # the latest step delivered, if it was not logged
        self._samples_at_setup = 0

    # ---------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.attachment is not None:  # already set up (e.g. validate inside a running session)
            return
        # a second fit of the same Trainer continues the first (another Trainer starts afresh); a checkpoint's
        # state, if any, arrives after setup through load_state_dict and replaces this
        continues = self._final_state is not None and stage == "fit" and self._final_trainer() is trainer
        self._resumed = dict(self._final_state) if continues else {}
        self._reset_run_state()
        from lightning_energy.measure.sampler import get_sampler

        self._failures_seen = len(get_sampler().failures)  # earlier runs' failures are not ours
        attachment = self.attach(trainer, self._user_sensors, self.backend, self.interval_s, self.cuda_events)
        self._sampler = attachment.sampler
        self._samples_at_setup = self._sampler.samples_taken
        self._sensors, self._notes, self._zeus = attachment.sensors, attachment.notes, attachment.zeus
        self._names = attachment.sensor_names
        # every rank's sensors of this callback: the all-rank figures it logs and reports cover these alone
        # (the session's figures carry every sensor of every callback); collective, as setup runs on every rank
        self._all_names = sorted({n for rank in distributed.gather(trainer, self._names) for n in rank})
        self._sampler.add_listener(self._power)
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # trainer.log_dir is collective
        if stage == "fit":
            self._fits += 1
        if self.write_trace:
            suffix = "" if trainer.global_rank == 0 else f"_rank{trainer.global_rank}"
            if stage == "fit" and self._fits > 1:
                suffix += f"_fit{self._fits}"
            self._trace = TraceWriter(log_dir, self._names, suffix, warn=False)
            self._sampler.add_listener(self._trace)
            self._sampler.await_coverage(self._names)  # the trace's first row comes before the fit's start mark
        self._log_dir = log_dir
        self._trainer, self._rank = trainer, trainer.global_rank
        self._step_total_key = "energy/total_J" if trainer.world_size == 1 else "energy/rank0_total_J"
        self._tb = TensorBoardExtras.for_trainer(trainer, warn=False) if trainer.is_global_zero else None
        if self._tb is not None:
            self._tb.sensor_provenance = {s.name: s.provenance for s in self._sensors}
        if self._tb is not None and stage == "fit":
            self._tb.take_over_hparams()  # the report's totals become the run's HParams metrics at fit end
        self._problems_warned = 0
        if getattr(trainer, "barebones", False):
            rank_zero_warn("EnergyCallback: `Trainer(barebones=True)` has no logger, so no step or epoch figure is "
                           "logged; the end-of-fit report (`callback.report`, energy_report.json) and the trace are "
                           "still written.")

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        if exception is not None:
            self._event("exception")
        self._release()

    def _release(self) -> None:
        if self._sampler is None:
            return
        sampler, self._sampler = self._sampler, None
        sampler.remove_listener(self._power)
        if self._trace is not None:
            sampler.remove_listener(self._trace)
            self._trace.close()
            self.trace_path = self._trace.trace_path
        if self._tb is not None:
            self._tb.close()
        self.detach()
        self._trainer = None

    def _event(self, name: str, t: float | None = None, epoch: int | None = None, step: int | None = None,
               mark: Mark | None = None) -> None:
        if self._trace is not None and self._sampler is not None:
            self._trace.event(name, self._sampler.clock() if t is None else t, epoch, step, mark)

    # ---------------------------------------------------------------- what the timeline delivers
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        start = self.timeline.fit_start
        self._event("fit_start", start.t if start is not None else None, mark=start)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._event("train_start")
        # the session may have added the GPUs of a model spread over several devices (auto-detected sensors):
        # this rank's and every rank's names again (collective: every rank starts training)
        self._names = self.attachment.sensor_names
        self._all_names = sorted({n for rank in distributed.gather(trainer, self._names) for n in rank})
        if self._tb is not None:
            self._tb.sensor_provenance = {s.name: s.provenance for s in self._sensors}

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._event("train_end")

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._zeus is not None:  # Zeus's windows open and close next to our marks: the same interval
            self._zeus.begin_epoch()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._zeus is not None:
            self._zeus.pause_epoch()
            self._zeus_epochs[trainer.current_epoch] = sum(distributed.gather(trainer, self._zeus.end_epoch()))
        self._warn_failures()

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._zeus is not None and not trainer.sanity_checking:
            self._zeus.pause_epoch()  # Zeus's epoch figure leaves validation out, like ours

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._zeus is not None and not trainer.sanity_checking:
            self._zeus.resume_epoch()

    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        # On the training thread, a few steps after the step: arithmetic and, at logging steps, the loggers.
        if not figures.log:
            self._last_step = figures
            return
        self._last_step = None
        self._log_step(trainer, figures)

    def _log_step(self, trainer: Trainer, figures: StepFigures) -> None:
        m = figures.measurement
        energy_J = sum(m.energy_J.get(n, 0.0) for n in self._names)
        fit_start = self.timeline.fit_start
        running_J = sum(figures.end.energy[n] - fit_start.energy[n] for n in self._names
                        if figures.end.energy.get(n) is not None and fit_start.energy.get(n) is not None)
        single = trainer.world_size == 1
        if single:
            running_J += self._resumed_total_J()
        metrics = {"energy/step_J": energy_J, "power/step_W": energy_J / m.duration_s if m.duration_s > 0 else 0.0,
                   "time/step_s": m.duration_s, self._step_total_key: running_J}
        for name, extra in figures.extras.items():
            metrics[f"energy/extra/{name}_J"] = sum(extra.energy_J.get(n, 0.0) for n in self._names)
            metrics[f"time/extra/{name}_s"] = extra.duration_s
        self.log_metrics(trainer, metrics, figures.step)
        if single:
            self._show_total(trainer, running_J)
        if len(self._sampler.failures) > self._failures_seen:
            self._warn_failures()

    @override
    def on_loop_measured(self, trainer: Trainer, figures: LoopFigures) -> None:
        figures = figures.for_sensors(self._all_names)
        self.loops.append(figures)
        energy_name, time_name, power_name = LOOP_METRICS[figures.kind]
        energy_J = figures.total_J
        self.log_metrics(trainer, {energy_name: energy_J, time_name: figures.duration_s,
                                   power_name: energy_J / figures.duration_s if figures.duration_s > 0 else 0.0},
                         figures.step)
        if figures.kind == "val":
            if figures.fitting:
                self._session_validation_J += energy_J
            self._event("validation_start", figures.start_s, epoch=figures.epoch)
            self._event("validation_end", figures.end_s, epoch=figures.epoch)

    @override
    def on_epoch_measured(self, trainer: Trainer, figures: EpochFigures) -> None:
        figures = figures.for_sensors(self._all_names)
        epoch = figures.epoch
        self._session_train_J += figures.total_J
        row = self._epoch_row(figures, self._zeus_epochs.pop(epoch, None))
        metrics = {
            "energy/epoch_J": row["train_J"],
            "power/epoch_W": row["power_W"],
            "time/epoch_s": row["train_s"],
            "edp/epoch_Js": row["edp_Js"],
            "energy/epoch_between_steps_J": row["between_steps_J"],
            "energy/total_J": row["total_J"],
            **{sensor_metric(name): joules for name, joules in sorted(figures.energy_J.items())},
        }
        if "zeus_J" in row:
            metrics["energy/zeus_epoch_J"] = row["zeus_J"]
        self.log_metrics(trainer, metrics, figures.step)
        self._epochs.append(row)
        self._show_total(trainer, row["total_J"])
        self.last_epoch_end_s = figures.end_s
        self._event("epoch_start", figures.start_s, epoch=epoch)
        self._event("epoch_end", figures.end_s, epoch=epoch)
        if self._tb is not None:
            self._tb.after_epoch(trainer, epoch, self._power.take() if self.log_power_figure else None)
        self._warn_output_problems()

    def _output_problems(self) -> list[str]:
        return [*getattr(self._trace, "problems", []), *getattr(self._tb, "problems", [])]

    def _warn_output_problems(self) -> None:
        """Warn (on the training thread, once each) about outputs that failed: a full disk under the trace,
        a TensorBoard writer that cannot flush. Training goes on; the report lists them."""
        problems = self._output_problems()
        for line in problems[self._problems_warned:]:
            warnings.warn(f"lightning-energy: rank {self._rank}: {line}", UserWarning, stacklevel=2)
        self._problems_warned = len(problems)

    def _epoch_row(self, figures: EpochFigures, zeus_J: float | None = None) -> dict:
        """The report's row of one epoch (J, s, W; all ranks)."""
        epoch_J, epoch_s = figures.total_J, figures.duration_s
        return {
            "epoch": figures.epoch, "train_J": epoch_J, "train_s": epoch_s, "power_W": figures.mean_power_W,
            "edp_Js": epoch_J * epoch_s, "steps": figures.steps, "steps_J": figures.steps_J,
            "between_steps_J": epoch_J - figures.steps_J, "validation_J": figures.validation_J,
            "per_sensor_J": dict(figures.energy_J), "total_J": self._resumed_total_J() + figures.fit_J,
            # how far the samples let the attribution be off (J): the bound of series.window_bound_J, null
            # where not computed (DDP) or not finite (an extrapolated edge)
            "bound_J": figures.bound_J if math.isfinite(figures.bound_J) else None,
            **({"extras_J": dict(figures.extras_J)} if figures.extras_J else {}),
            **({"zeus_J": zeus_J} if zeus_J is not None else {}),
            **({"missing_sensors": list(figures.missing)} if figures.missing else {}),
            **({"extrapolated": True} if figures.extrapolated else {}),
            **({"resumed_mid_epoch": True} if figures.resumed_mid_epoch else {}),
        }

    @staticmethod
    def _show_total(trainer: Trainer, total_J: float) -> None:
        # Into the progress bar's own dict: the `progress_bar_metrics` getter would first recompute (and
        # synchronise) every logged tensor, and `pl_module.log` costs ~1 ms per call.
        progress_bar_dict(trainer)["energy_kJ"] = round(total_J / J_PER_KJ, 3)

    def _warn_failures(self) -> None:
        """Warn once per failed sensor, on the rank where it failed (not only on rank zero)."""
        if self._sampler is None:
            return
        failures = self._sampler.failures
        mine = set(self._names)
        fit_start = self.timeline.fit_start if self.timeline is not None else None
        for failure in list(failures)[self._failures_seen:]:
            if failure.name not in mine and failure.name not in self._warned_failures and \
                    failure.name not in self._sampler.series:  # a meter, clock, listener or the sampling thread
                self._warned_failures.add(failure.name)
                warnings.warn(f"lightning-energy: rank {self._rank}: {failure.name} failed ({failure.message}); "
                              "sampling goes on and the report counts such errors (sampling.errors).",
                              UserWarning, stacklevel=2)
            elif failure.name in mine and failure.name not in self._warned_failures:
                self._warned_failures.add(failure.name)
                after_s = failure.t - fit_start.t if fit_start is not None and fit_start.t is not None else 0.0
                warnings.warn(
                    f"lightning-energy: rank {self._rank}: sensor {failure.name!r} failed "
                    f"{after_s:.2f} s after fit start ({failure.message}); training goes on, its energy up to "
                    "its last good sample stays counted, later figures lack it and the report flags them.",
                    UserWarning, stacklevel=2,
                )
        self._failures_seen = len(failures)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the timeline has delivered every step, loop and epoch before this runs
        timeline = self.timeline
        end = timeline.fit_end
        if self._last_step is not None:  # the last step is logged, as Lightning logs when it stops
            self._log_step(trainer, self._last_step)
            self._last_step = None
        self._warn_failures()
        self._event("fit_end", end.t, mark=end)
        self.fit_start_s, self.fit_end_s = timeline.fit_start.t, end.t
        self._final_state = self._cumulative_state(trainer, end)  # for a checkpoint saved after the fit
        self._final_trainer = weakref.ref(trainer)
        summaries = distributed.gather(trainer, self._rank_summary(trainer, timeline.fit_start, end))
        sections = {}  # other callbacks' tables (e.g. PrecisionSwitch's per-mode table); collective
        for callback in trainer.callbacks:
            section = getattr(callback, "energy_report_section", None)
            if callback is not self and callable(section):
                sections.update(section(trainer) or {})
        if self._tb is not None:
            self._tb.close(timeout_s=5.0)  # the queued figures are written (bounded) before the report
        self._warn_output_problems()
        if not trainer.is_global_zero:
            return
        problems = self._output_problems()
        extra = {
            "sampling": {
                "interval_s": self._sampler.interval_s,
                "samples": self._sampler.samples_taken - self._samples_at_setup,
                "trace_file": str(self._trace.trace_path) if self._trace else None,
                "events_file": str(self._trace.events_path) if self._trace else None,
                # transient read errors per sensor (within the error budget: the sensor stayed in), sensors read
                # on a thread of their own because their reads are slow (s per read), and errors of the meters,
                # clocks, listeners or sampling thread that sampling survived
                "read_errors": {n: c for n, c in self._sampler.read_error_counts.items() if n in self._names},
                "slow_sensors_s": {n: s for n, s in self._sampler.slow_sensors.items() if n in self._names},
                "errors": dict(self._sampler.error_counts),
            },
            "notes": [*self._notes, *getattr(self._tb, "notes", [])],
            "figures_cover": list(self._all_names),
            "output_problems": problems,
            "sections": sections,
            **{f"resumed_{k}": v for k, v in self._resumed.items() if k != "epochs"},
        }
        self.report = build_report(summaries, self._epochs, extra)
        # the run's total over the whole fit, as in the report, is the last `energy/total_J` logged (the epoch
        # ends' figures leave out what follows the last epoch end: teardown of the loops, the last checkpoint)
        self.log_metrics(trainer, {"energy/total_J": self.report["total_J"]}, epoch_end_log_step(trainer))
        if self._tb is not None:  # once, at fit end: HParams metrics and the table in the Text tab
            self._tb.write_report(trainer, self.report)
            self._warn_output_problems()
        problem = try_atomic_write_json(self._log_dir / REPORT_FILE, self.report)
        self.report_path = None if problem else self._log_dir / REPORT_FILE
        if problem:  # a full disk or a read-only log dir never fails the fit
            rank_zero_warn(f"lightning-energy: {problem}")
        if self.verbose:
            print(format_report(self.report) + f"\nreport: {self.report_path}", flush=True)
        else:
            log_info(f"lightning-energy: report written to {self.report_path}")

    def _rank_summary(self, trainer: Trainer, start: Mark, end: Mark) -> dict:
        from lightning_energy.measure.meter import measure

        fit = measure(start, end)
        sensors = []
        series = self._sampler.series
        for sensor in self._sensors:
            joules = fit.energy_J.get(sensor.name, 0.0)
            s = series.get(sensor.name)
            missing_from_s = None  # seconds after fit start from which the sensor's figures are missing
            if s is None:
                missing_from_s = 0.0
            elif s.failure is not None:
                missing_from_s = max((s.last_time_s if s.last_time_s is not None else fit.start_s) - fit.start_s, 0.0)
            sensors.append({
                **sensor.describe(),
                "rank": trainer.global_rank,
                "energy_J": joules,
                "mean_power_W": joules / fit.duration_s if fit.duration_s > 0 else 0.0,
                "failure": s.failure if s is not None else "not sampled",
                "missing_from_s": missing_from_s,
                # counters with a power reading: whether the power readings shaped the steps' figures, or
                # why the plain counter rule was used (the card did not behave as its family's constants say)
                **({"attribution": s.shaping} if s is not None and s.shaping is not None else {}),
            })
        return {
            "rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node": socket.gethostname(),
            "duration_s": fit.duration_s,
            "train_J": self._session_train_J,
            "validation_J": self._session_validation_J,
            "sensors": sensors,
        }

    # ---------------------------------------------------------------- resume
    def _resumed_total_J(self) -> float:
        return self._resumed.get("total_J", 0.0)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Cumulative figures of all ranks up to now (J, s), for resume.

        Does not wait: the figures reach the latest samples (one sampling interval old at most), so a
        mid-epoch checkpoint keeps the energy since the last finished epoch. Collective under DDP, as
        Lightning saves checkpoints on every rank.
        """
        if self.attachment is not None and self._trainer is not None and self.timeline.fit_start is not None:
            return self._cumulative_state(self._trainer)
        if self._final_state is not None:
            return dict(self._final_state)
        return dict(self._resumed)

    def _cumulative_state(self, trainer: Trainer, until: Mark | None = None) -> dict[str, Any]:
        """Totals since the first fit over all ranks (collective) up to now or ``until``: total, train
        and validation J (the open epoch's training so far included), duration s (slowest rank)."""
        so_far = self.timeline.so_far(self._names, until)
        # epochs ended but not yet delivered (single process: a few steps after their end) are included
        # as estimated from the samples at hand, and marked so
        pending = [{**self._epoch_row(f.for_sensors(self._all_names)), "provisional": True} for f in so_far["pending_epochs"]]
        merged = distributed.merge(distributed.gather(trainer, {
            "total_J": so_far["fit_J"],
            "train_J": self._session_train_J + so_far.get("open_train_J", 0.0) + sum(r["train_J"] for r in pending),
            "validation_J": self._session_validation_J + so_far.get("open_validation_J", 0.0)
            + sum(r["validation_J"] for r in pending),
            "seconds": so_far["duration_s"],
        }))
        resumed = self._resumed
        state = {key: resumed.get(key, 0.0) + merged[key] for key in ("total_J", "train_J", "validation_J")}
        state["duration_s"] = resumed.get("duration_s", 0.0) + merged["seconds"]
        state["epochs"] = list(self._epochs) + pending
        if "open_epoch" in so_far:
            state["open_epoch"] = so_far["open_epoch"]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict)
        self._epochs = list(self._resumed.get("epochs", []))
