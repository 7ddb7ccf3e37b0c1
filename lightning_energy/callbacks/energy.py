"""EnergyCallback: the energy, power and time of every training step and epoch, beside the loss."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.core.figures import EpochFigures, LoopFigures, StepFigures
from lightning_energy.core.metrics import LOOP_METRICS, sensor_metric  # noqa: F401  (the metric table, named here too)
from lightning_energy.core.recorder import RunRecorder, trace_suffix
from lightning_energy.core.run import checked_extra_sensors
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for, report_sections
from lightning_energy.integration.lightning_internals import epoch_end_log_step, progress_bar_dict
from lightning_energy.integration.session import trainer_collective
from lightning_energy.integration.zeus_windows import ZeusEpochWindows
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.outputs.tensorboard import FIGURE_BUDGET, EpochPowerRecorder, TensorBoardExtras, check_figure_budget
from lightning_energy.units import J_PER_KJ

log_info = rank_zero_info_for(__name__)


class EnergyCallback(MeteredCallback):
    """Measure energy per training step and epoch on any hardware and log it beside the loss.

    ``Trainer(callbacks=[EnergyCallback()])`` needs no configuration: it reads this rank's NVIDIA GPU
    through NVML, the CPU package and DRAM through RAPL, and falls back to a labelled CPU estimate when
    nothing can be measured. One background thread per process samples every sensor; the training
    thread only takes timestamps (or records CUDA events) at boundaries, and figures are logged once the
    samples cover them (a few steps later at most), at the step they belong to.

    Logged through every Lightning logger (TensorBoard, CSV, MLflow, ...), at the steps Lightning logs the
    loss at and at epoch ends: ``energy/step_J``, ``energy/epoch_J``, ``energy/total_J``, ``energy/val_epoch_J``
    and the rest of the table in :mod:`lightning_energy.core.metrics` (the public contract, the same for
    every front end); the progress bar shows ``energy_kJ`` (``energy/total_J``; under DDP updated at epoch
    ends only); with ``backend="zeus"`` also ``energy/zeus_epoch_J``, Zeus's own ``ZeusMonitor`` windows over
    the same interval as ``energy/epoch_J``, summed over ranks.

    The whole node: a node-scope sensor (the BMC through Redfish or IPMI DCMI, turned on for every job by
    ``LIGHTNING_ENERGY_REDFISH_URL`` / ``LIGHTNING_ENERGY_IPMI``: :mod:`lightning_energy.measure.sensors.node_config`,
    or given in ``extra_sensors``) is read once per node (local rank 0) and never added to the totals above
    (it contains them): the report's ``node`` entry holds the node's energy, the sum of the component sensors
    and the rest (fans, PSU losses, disks, NICs), each labelled; a single-node run also logs
    ``energy/node/epoch_J``, ``power/node/epoch_W`` and ``energy/other/epoch_J`` per epoch, at the epoch's step,
    once the BMC's samples cover it (usually during the next epoch).

    A sensor that fails mid-run (or hangs in a read) is warned about once, on the rank where it fails;
    its energy up to its last good sample stays counted, later windows get none from it, and the report
    flags the sensor (``missing_from_s``) and the epochs it misses (``missing_sensors``). A sensor that
    cannot be opened is warned about and left out.

    With a TensorBoard logger also: a custom-scalars layout placing the training loss beside
    ``energy/step_J`` and the validation loss beside ``energy/val_epoch_J``, a figure ``power/trace`` of
    epochs' power (drawn off the training thread; which epochs: ``outputs/tensorboard.py``) and, at the end
    of fit, the report: its totals as HParams metrics (``report/energy_total_J``, ...; in place of
    Lightning's ``hp_metric = -1``) and its table as text. At the end of fit: a console table and
    ``energy_report.json`` in the log dir; the sample trace ``energy_trace.csv`` and ``energy_events.csv`` (``_rank<N>`` suffix on ranks
    other than 0, ``_fit<N>`` for the N-th fit of one callback).

    Args:
        sensors: sensors to read instead of the auto-detected ones (``lightning_energy.Sensor``).
        extra_sensors: sensors to read beside the auto-detected ones, e.g.
            ``[RedfishPowerSensor("https://bmc-17", Credentials(user, password))]`` (not with ``sensors``);
            host- and node-scope ones are read on local rank 0 only. A node sensor here replaces those the
            environment configures.
        backend: ``"auto"`` (NVML, RAPL, estimate) or ``"zeus"`` (read through Zeus's ZeusMonitor).
        interval_s: sampling interval in seconds (>= 0.001).
        log_power_figure: add the per-epoch power figure to TensorBoard.
        power_figure_budget: the share of the run's time drawing power figures may take beyond the first
            three epochs, the last and each most expensive so far (0 to 1; None: a figure every epoch).
        write_trace: stream the sample trace to CSV in the log dir.
        verbose: print the report table at the end of fit (rank zero).
        cuda_events: on CUDA, time steps with CUDA events instead of host timestamps.
        telemetry: also log GPU telemetry, time-weighted means over each logged step and each epoch
            (validation excluded) of what the sampling thread reads anyway (never a device call on the
            training thread): ``telemetry/<sensor>/step/<field>`` and ``telemetry/<sensor>/epoch/<field>``
            with the fields ``gpu_util_pct``, ``mem_util_pct``, ``sm_clock_MHz``, ``temperature_C`` and
            ``pstate`` (0 = highest performance) where the sensor reads them (NVML GPUs); under DDP prefixed
            ``rank<N>/``, every rank's devices at epoch ends, rank 0's at steps.
    """

    provides_default_sensors = True

    def __init__(
        self,
        sensors: list[Sensor] | None = None,
        extra_sensors: list[Sensor] | None = None,
        backend: str = "auto",
        interval_s: float = DEFAULT_INTERVAL_S,
        log_power_figure: bool = True,
        power_figure_budget: float | None = FIGURE_BUDGET,
        write_trace: bool = True,
        verbose: bool = True,
        cuda_events: bool = True,
        telemetry: bool = False,
    ) -> None:
        super().__init__()
        self.configure_measurement(sensors, backend, interval_s)
        self.extra_sensors = checked_extra_sensors(extra_sensors, sensors)
        self.check_flags(log_power_figure=log_power_figure, write_trace=write_trace, verbose=verbose,
                         cuda_events=cuda_events, telemetry=telemetry)
        self.log_power_figure, self.write_trace, self.verbose = log_power_figure, write_trace, verbose
        self.power_figure_budget = check_figure_budget(power_figure_budget)
        self.cuda_events, self.telemetry = cuda_events, telemetry
        self.fit_start_s: float | None = None  # sampler clock (s) of the last fit's start and end
        self.fit_end_s: float | None = None
        self.last_epoch_end_s: float | None = None
        self.report: dict | None = None
        self.report_path: Path | None = None
        self.trace_path: Path | None = None
        self.loops: list[LoopFigures] = []  # every loop measured by this callback (validate/test/predict too)
        self._resumed: dict = {}
        self._final_state: dict | None = None
        self._final_trainer = None  # a weak reference to the Trainer whose fit left ``_final_state``
        self._fits = 0
        self._recorder: RunRecorder | None = None  # while set up: state_dict gathers over the Trainer's ranks

    @property
    def sensors_in_use(self) -> list[Sensor]:
        """The sensors this rank reads during the current run, node-scope ones last (empty outside a run)."""
        attachment = self.attachment
        return [*attachment.sensors, *attachment.node_sensors] if attachment is not None else []

    @property
    def state_key(self) -> str:
        # Lightning reads it at every hook call of every callback (profiler labels): built once
        key = self.__dict__.get("_state_key")
        if key is None:
            sensors = None if self._user_sensors is None else tuple(s.name for s in self._user_sensors)
            key = self._state_key = self._generate_state_key(backend=self.backend, sensors=sensors)
        return key

    # ---------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.attachment is not None:  # already set up (e.g. validate inside a running session)
            return
        # a second fit of the same Trainer continues the first (another Trainer starts afresh); a checkpoint's
        # state, if any, arrives after setup through load_state_dict and replaces this
        continues = stage == "fit" and self._final_trainer is not None and self._final_trainer() is trainer
        self._resumed = dict(self._final_state) if continues else {}
        attachment = self.attach(trainer, self._user_sensors, self.backend, self.interval_s, self.cuda_events)
        self._add_extra_sensors(trainer, attachment)
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # trainer.log_dir is collective
        self._fits += stage == "fit"
        suffix = trace_suffix(trainer.global_rank, self._fits if stage == "fit" else 1)
        # every rank's sensors of this callback: the all-rank figures it logs and reports cover these alone
        # (the session's figures carry every sensor of every callback); collective, as setup runs on every rank
        self._recorder = RunRecorder(attachment, trainer_collective(trainer), log_dir, self.write_trace, suffix,
                                     self._resumed, telemetry=self.telemetry)
        self.loops = self._recorder.loops
        self._power = EpochPowerRecorder()
        attachment.sampler.add_listener(self._power)
        self._zeus = ZeusEpochWindows(attachment.zeus) if attachment.zeus is not None else None
        self._last_step: StepFigures | None = None  # the latest step delivered, if it was not logged
        self._tb = TensorBoardExtras.for_trainer(trainer, warn=False, figure_budget=self.power_figure_budget) \
            if trainer.is_global_zero else None
        if self._tb is not None:
            self._recorder.problem_sources.append(self._tb)
            self._tb.sensor_provenance = {s.name: s.provenance for s in attachment.sensors}
            if stage == "fit":
                self._tb.take_over_hparams()  # the report's totals become the run's HParams metrics at fit end
        if getattr(trainer, "barebones", False):
            rank_zero_warn("EnergyCallback: `Trainer(barebones=True)` has no logger, so no step or epoch figure is "
                           "logged; the end-of-fit report (`callback.report`, energy_report.json) and the trace are "
                           "still written.")

    def _add_extra_sensors(self, trainer: Trainer, attachment) -> None:
        """``extra_sensors`` beside the shared auto-detected ones (host and node scope on local rank 0 only);
        a node sensor given here stands in for those the environment configures."""
        extra = [s for s in self.extra_sensors if s.scope == "device" or trainer.local_rank == 0]
        if any(s.scope == "node" for s in extra):
            for sensor in [s for s in attachment.node_sensors if s not in extra]:
                attachment.node_sensors.remove(sensor)  # the sampler still holds it until this run ends
        notes = len(attachment.notes)
        attachment.session.add_sensors(attachment, [s for s in extra if s not in attachment.sensors])
        for note in attachment.notes[notes:]:
            rank_zero_warn(note)

    def _log_node_metrics(self, trainer: Trainer) -> None:
        for step, metrics in self._recorder.node_metrics():
            self.log_metrics(trainer, metrics, step)

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        if exception is not None:
            recorder.event("exception")
        recorder.sampler.remove_listener(self._power)
        self.trace_path = recorder.close()
        if self._tb is not None:
            self._tb.close()
        self.detach()

    # ---------------------------------------------------------------- what the timeline delivers
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        start = self.timeline.fit_start
        self._recorder.event("fit_start", start.t if start is not None else None, mark=start)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._recorder.event("train_start")
        # the session may have added the GPUs of a model spread over several devices (auto-detected sensors)
        self._recorder.refresh_names()  # collective: every rank starts training
        if self._tb is not None:
            self._tb.sensor_provenance = {s.name: s.provenance for s in self.attachment.sensors}

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._recorder.event("train_end")

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._zeus is not None:  # Zeus's windows open and close next to our marks: the same interval
            self._zeus.epoch_started()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._zeus is not None:
            self._zeus.epoch_ended(trainer)
        self._recorder.warn_failures()

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._zeus is not None:
            self._zeus.validation_started(trainer)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._zeus is not None:
            self._zeus.validation_ended(trainer)

    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        # On the training thread, a few steps after the step: arithmetic and, at logging steps, the loggers.
        if not figures.log:
            self._last_step = figures
            return
        self._last_step = None
        self._log_step(trainer, figures)

    def _log_step(self, trainer: Trainer, figures: StepFigures) -> None:
        metrics = self._recorder.step_metrics(figures)
        self.log_metrics(trainer, metrics, figures.step)
        if "energy/total_J" in metrics:  # a single process: the running total in the progress bar
            self._show_total(trainer, metrics["energy/total_J"])
        if self._recorder.has_new_failures():
            self._recorder.warn_failures()

    @override
    def on_loop_measured(self, trainer: Trainer, figures: LoopFigures) -> None:
        figures, metrics = self._recorder.loop_measured(figures)
        self.log_metrics(trainer, metrics, figures.step)

    @override
    def on_epoch_measured(self, trainer: Trainer, figures: EpochFigures) -> None:
        zeus_J = self._zeus.take(figures.epoch) if self._zeus is not None else None
        row, metrics = self._recorder.epoch_measured(figures, zeus_J)
        self.log_metrics(trainer, metrics, figures.step)
        self._log_node_metrics(trainer)
        self._show_total(trainer, row["total_J"])
        self.last_epoch_end_s = figures.end_s
        if self._tb is not None:
            self._tb.after_epoch(trainer, figures.epoch, self._power.take() if self.log_power_figure else None,
                                 energy_J=figures.total_J)
        self._recorder.warn_output_problems()

    @staticmethod
    def _show_total(trainer: Trainer, total_J: float) -> None:
        # Into the progress bar's own dict: the `progress_bar_metrics` getter would first recompute (and
        # synchronise) every logged tensor, and `pl_module.log` costs ~1 ms per call.
        progress_bar_dict(trainer)["energy_kJ"] = round(total_J / J_PER_KJ, 3)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the timeline has delivered every step, loop and epoch before this runs
        recorder, timeline = self._recorder, self.timeline
        end = timeline.fit_end
        if self._last_step is not None:  # the last step is logged, as Lightning logs when it stops
            self._log_step(trainer, self._last_step)
            self._last_step = None
        recorder.warn_failures()
        recorder.event("fit_end", end.t, mark=end)
        self.fit_start_s, self.fit_end_s = timeline.fit_start.t, end.t
        self._final_state = recorder.cumulative_state(end)  # for a checkpoint saved after the fit
        self._final_trainer = weakref.ref(trainer)
        sections = report_sections(trainer, self)  # other callbacks' tables; collective
        if self._tb is not None:
            self._tb.close(timeout_s=5.0)  # the queued figures are written (bounded) before the report
        recorder.warn_output_problems()
        notes = [*self.attachment.notes, *getattr(self._tb, "notes", [])]
        drawn = {"power_figures": self._tb.figure_summary()} if self._tb is not None and self.log_power_figure else {}
        report = recorder.finish(end, notes, sections, extra=drawn)  # collective
        self._log_node_metrics(trainer)  # the last epochs' node figures, settled by finish
        if report is None:  # not rank zero
            return
        self.report = report
        # the run's total over the whole fit, as in the report, is the last `energy/total_J` logged (the epoch
        # ends' figures leave out what follows the last epoch end: teardown of the loops, the last checkpoint)
        self.log_metrics(trainer, {"energy/total_J": report["total_J"]}, epoch_end_log_step(trainer))
        if self._tb is not None:  # once, at fit end: HParams metrics and the table in the Text tab
            self._tb.write_report(trainer, report)
            recorder.warn_output_problems()
        self.report_path = recorder.write_report(report, self.verbose, log_info)

    # ---------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        """Cumulative figures of all ranks up to now (J, s), for resume.

        Does not wait: the figures reach the latest samples (one sampling interval old at most), so a
        mid-epoch checkpoint keeps the energy since the last finished epoch. Collective under DDP, as
        Lightning saves checkpoints on every rank.
        """
        if self._recorder is not None and self.timeline.fit_start is not None:
            return self._recorder.cumulative_state()
        if self._final_state is not None:
            return dict(self._final_state)
        return dict(self._resumed)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict)
        if self._recorder is not None:  # loaded after setup (a resumed fit): the recorder continues from it
            self._recorder.resumed = dict(state_dict)
            self._recorder.epochs[:] = list(self._resumed.get("epochs", []))
