"""EnergyCallback: the energy, power and time of every training step and epoch, beside the loss."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_energy import distributed
from lightning_energy.io import atomic_write_json
from lightning_energy.meter import Mark, Measurement, Meter, measure
from lightning_energy.report import REPORT_FILE, build_report, format_report
from lightning_energy.sampler import DEFAULT_INTERVAL_S, MIN_INTERVAL_S, get_sampler
from lightning_energy.sensors.base import Sensor, validate_sensors
from lightning_energy.sensors.detect import BACKENDS
from lightning_energy.session import open_meter_session
from lightning_energy.tensorboard import EpochPowerRecorder, TensorBoardExtras
from lightning_energy.trace import TraceWriter


class EnergyCallback(Callback):
    """Measure energy per training step and epoch on any hardware and log it beside the loss.

    ``Trainer(callbacks=[EnergyCallback()])`` needs no configuration: it reads this rank's NVIDIA GPU
    through NVML, the CPU package and DRAM through RAPL, and falls back to a labelled CPU estimate when
    nothing can be measured. One background thread per process samples every sensor; the training
    thread only takes timestamps (or records CUDA events) at step boundaries.

    Logged metrics (units in the names; the public contract):

    - ``energy/step_J``, ``power/step_W``, ``time/step_s``: one training step (this rank's sensors plus
      host sensors on local rank 0), at the Trainer's ``log_every_n_steps``.
    - ``energy/total_J``: energy of all ranks since the first fit started, continuing across resumes; at
      every epoch end, and (single process only) also at the step-level logging steps. Under DDP the
      step-level figure would need a collective per step, so it is not logged there; instead:
    - ``energy/rank0_total_J`` (DDP only, step level): rank 0's sensors alone (its device plus its
      node's host sensors) since this fit started; a lower bound of the all-rank figure, never mixed in.
    - ``energy/epoch_J``, ``power/epoch_W``, ``time/epoch_s``, ``edp/epoch_Js`` (energy x time): one
      training epoch without its validation, summed over ranks (time: slowest rank).
    - ``energy/epoch_J/<sensor name>``: the same per sensor.
    - ``energy/epoch_between_steps_J``: the epoch's energy outside the steps (data loading, hooks).
    - ``energy/val_epoch_J``, ``power/val_epoch_W``, ``time/val_epoch_s``; ``energy/test_epoch_J``,
      ``power/test_epoch_W``, ``time/test_epoch_s``: validation and test loops, measured separately.
    - ``energy/zeus_epoch_J``: with ``backend="zeus"``, Zeus's own ``ZeusMonitor`` windows over the
      same interval as ``energy/epoch_J`` (closed while validation runs), summed over ranks.
    - progress bar: ``energy_kJ``, the ``energy/total_J`` figure (under DDP updated at epoch ends only).

    A sensor that fails mid-run is warned about once, on the rank where it fails; its energy up to its
    last good sample stays counted, later windows get none from it, and the report flags the sensor
    (``missing_from_s``: seconds after fit start from which its figures are missing) and the epochs it
    misses (``missing_sensors``).

    With a TensorBoard logger also: a custom-scalars layout placing the training loss beside
    ``energy/step_J`` and ``energy/epoch_J``, and a figure ``power/trace`` of each epoch's power.
    At the end of fit: a console table and ``energy_report.json`` in the log dir; the sample trace
    ``energy_trace.csv`` and ``energy_events.csv`` (``_rank<N>`` suffix on ranks other than 0).

    Args:
        sensors: sensors to read instead of the auto-detected ones (``lightning_energy.Sensor``).
        backend: ``"auto"`` (NVML, RAPL, estimate) or ``"zeus"`` (read through Zeus's ZeusMonitor).
        interval_s: sampling interval in seconds (>= 0.001).
        log_power_figure: add the per-epoch power figure to TensorBoard.
        write_trace: stream the sample trace to CSV in the log dir.
        verbose: print the report table at the end of fit (rank zero).
        cuda_events: on CUDA, time steps with CUDA events instead of host timestamps.
    """

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
        self._user_sensors = None if sensors is None else validate_sensors(sensors)
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
        if sensors is not None and backend != "auto":
            raise ValueError("`backend` selects auto-detected sensors; give either `sensors` or `backend`, not both")
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s >= MIN_INTERVAL_S:
            raise ValueError(f"`interval_s` must be a number >= {MIN_INTERVAL_S} s, got {interval_s!r}")
        for flag, value in (("log_power_figure", log_power_figure), ("write_trace", write_trace),
                            ("verbose", verbose), ("cuda_events", cuda_events)):
            if not isinstance(value, bool):
                raise TypeError(f"`{flag}` must be a bool, got {type(value).__name__}")
        self.backend = backend
        self.interval_s = float(interval_s)
        self.log_power_figure = log_power_figure
        self.write_trace = write_trace
        self.verbose = verbose
        self.cuda_events = cuda_events
        self.report: dict | None = None
        self.report_path: Path | None = None
        self.trace_path: Path | None = None
        self._resumed: dict = {}
        self._reset_run_state()

    @property
    def user_sensors(self) -> list[Sensor] | None:
        """The sensors given at construction (None: auto-detected)."""
        return self._user_sensors

    @property
    def sensors_in_use(self) -> list[Sensor]:
        """The sensors this rank reads during the current run (empty outside a run)."""
        return list(self._sensors) if self._meter is not None else []

    @property
    def state_key(self) -> str:
        sensors = None if self._user_sensors is None else tuple(s.name for s in self._user_sensors)
        return self._generate_state_key(backend=self.backend, sensors=sensors)

    def _reset_run_state(self) -> None:
        self._sampler = None
        self._meter: Meter | None = None
        self._sensors: list[Sensor] = []
        self._zeus = None
        self._trace: TraceWriter | None = None
        self._power = EpochPowerRecorder()
        self._tb: TensorBoardExtras | None = None
        self._fit_start: Mark | None = None
        self._epoch_start: Mark | None = None
        self._step_start: Mark | None = None
        self._loop_start: Mark | None = None
        self._val_in_epoch: dict[str, float] = {}
        self._val_s_in_epoch = 0.0
        self._last_epoch_end: Mark | None = None
        self._session_train_J = 0.0
        self._session_validation_J = 0.0
        self._epochs: list[dict] = list(self._resumed.get("epochs", []))
        self._warned_failures: set[str] = set()
        self._failures_seen = 0
        self._notes: list[str] = []
        self._log_every = 50
        self._trainer: Trainer | None = None  # while set up: state_dict gathers over its ranks
        self._rank = 0
        self._epoch_open = False
        self._final_state: dict | None = None

    # ---------------------------------------------------------------- set-up and tear-down
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._meter is not None:  # already set up (e.g. validate inside a running session)
            return
        self._resumed = {}  # a checkpoint's state arrives after setup, through load_state_dict
        self._reset_run_state()
        sampler = get_sampler()
        self._failures_seen = len(sampler.failures)  # earlier runs' failures are not ours
        self._session = open_meter_session(trainer, self, self._user_sensors, self.backend, self.interval_s,
                                           self.cuda_events)
        self._sampler, self._meter = sampler, self._session.meter
        self._sensors, self._notes, self._zeus = self._session.sensors, self._session.notes, self._session.zeus
        for note in self._notes:
            rank_zero_warn(note)
        names = self._meter.sensor_names
        self._sampler.add_listener(self._power)
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # trainer.log_dir is collective
        if self.write_trace:
            suffix = "" if trainer.global_rank == 0 else f"_rank{trainer.global_rank}"
            self._trace = TraceWriter(log_dir, names, suffix)
            self._sampler.add_listener(self._trace)
        self._log_dir = log_dir
        self._log_every = max(int(trainer.log_every_n_steps), 0)
        self._trainer, self._rank = trainer, trainer.global_rank
        self._step_total_key = "energy/total_J" if trainer.world_size == 1 else "energy/rank0_total_J"
        self._tb = TensorBoardExtras.for_trainer(trainer) if trainer.is_global_zero else None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._event("exception")
        self._release()

    def _release(self) -> None:
        if self._sampler is None:
            return
        sampler, self._sampler = self._sampler, None
        sampler.remove_listener(self._power)
        if self._trace is not None:
            sampler.remove_listener(self._trace)
        self._session.close()
        if self._trace is not None:
            self._trace.close()
        self.trace_path = self._trace.trace_path if self._trace is not None else None
        self._meter = None
        self._trainer = None

    def _event(self, name: str, mark: Mark | None = None, epoch: int | None = None, step: int | None = None) -> None:
        if self._trace is not None:
            t = mark.t if mark is not None and mark.t is not None else self._sampler.clock()
            self._trace.event(name, t, epoch, step)

    # ---------------------------------------------------------------- fit
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = self._meter.wait(self._meter.mark())
        self._last_epoch_end = self._fit_start
        self._event("fit_start", self._fit_start)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._event("train_start")
        loop = trainer.fit_loop
        if getattr(loop, "restarted_mid_epoch", False) or getattr(loop, "restarted_on_epoch_end", False):
            self._start_epoch(trainer)  # resumed inside an epoch: Lightning skips on_train_epoch_start

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_epoch(trainer)

    def _start_epoch(self, trainer: Trainer) -> None:
        self._meter.clock.reanchor()
        self._epoch = trainer.current_epoch
        self._epoch_loop = trainer.fit_loop.epoch_loop
        if self._zeus is not None:  # Zeus's windows open and close next to our marks: the same interval
            self._zeus.begin_epoch()
        self._epoch_start = self._meter.mark()
        self._val_in_epoch, self._val_s_in_epoch = {}, 0.0
        self._epoch_open = True
        self._power.start_epoch()
        self._event("epoch_start", self._epoch_start, epoch=trainer.current_epoch)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_start = self._meter.mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        # The hot path: two cheap marks, a tuple appended, nothing that waits or writes per step.
        meter = self._meter
        end = meter.mark()
        step = self._epoch_loop._batches_that_stepped  # the step Lightning logs this batch's loss at
        log_now = self._log_every > 0 and (step + 1) % self._log_every == 0
        meter.add_window(self._step_start, end, tag=self._epoch, info=(step, end), keep=log_now)
        if meter.results:
            self._log_step_results(trainer)
        if len(self._sampler.failures) > self._failures_seen:
            self._warn_failures()

    def _log_step_results(self, trainer: Trainer) -> None:
        results = self._meter.results
        single = trainer.world_size == 1
        running_J = None
        while results:
            (step, end), m = results.popleft()
            # this process's sensors since this fit started: the whole total only in a single process
            running_J = measure(self._fit_start, end).total_J + (self._resumed_total_J() if single else 0.0)
            metrics = {"energy/step_J": m.total_J, "power/step_W": m.mean_power_W, "time/step_s": m.duration_s,
                       self._step_total_key: running_J}
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)
        if running_J is not None and single:
            self._show_total(trainer, running_J)

    @staticmethod
    def _show_total(trainer: Trainer, total_J: float) -> None:
        # Written straight into the progress bar's dict: `pl_module.log` costs ~1 ms per call here.
        trainer.progress_bar_metrics["energy_kJ"] = round(total_J / 1000.0, 3)

    def _warn_failures(self) -> None:
        """Warn once per failed sensor, on the rank where it failed (not only on rank zero)."""
        failures = self._sampler.failures
        mine = set(self._meter.sensor_names)
        for failure in list(failures)[self._failures_seen:]:
            if failure.name in mine and failure.name not in self._warned_failures:
                self._warned_failures.add(failure.name)
                after_s = failure.t - self._fit_start.t if self._fit_start is not None else 0.0
                warnings.warn(
                    f"lightning-energy: rank {self._rank}: sensor {failure.name!r} failed "
                    f"{after_s:.2f} s after fit start ({failure.message}); training goes on, its energy up to "
                    "its last good sample stays counted, later figures lack it and the report flags them.",
                    UserWarning, stacklevel=2,
                )
        self._failures_seen = len(failures)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        meter = self._meter
        end = meter.mark()
        if self._zeus is not None:
            self._zeus.pause_epoch()
        end = meter.wait(end)
        self._last_epoch_end = end
        self._epoch_open = False
        self._log_step_results(trainer)
        self._warn_failures()
        epoch = trainer.current_epoch
        window = measure(self._epoch_start, end)
        train_energy = {n: j - self._val_in_epoch.get(n, 0.0) for n, j in window.energy_J.items()}
        steps = meter.totals.pop(epoch, None)
        local = {
            "energy": train_energy,
            "seconds": window.duration_s - self._val_s_in_epoch,
            "steps_J": steps.total_J if steps else 0.0,
            "steps": steps.count if steps else 0,
            "validation_J": sum(self._val_in_epoch.values()),
            "fit_J": measure(self._fit_start, end).total_J,
            "missing": [{"sensor": name, "rank": trainer.global_rank} for name in window.missing],
        }
        if self._zeus is not None:
            local["zeus_J"] = self._zeus.end_epoch()
        merged = distributed.merge(distributed.gather(trainer, local))
        epoch_J = sum(merged["energy"].values())
        epoch_s = merged["seconds"]
        self._session_train_J += sum(train_energy.values())
        zeus_J = merged.get("zeus_J")
        total_J = self._resumed_total_J() + merged["fit_J"]
        metrics = {
            "energy/epoch_J": epoch_J,
            "power/epoch_W": epoch_J / epoch_s if epoch_s > 0 else 0.0,
            "time/epoch_s": epoch_s,
            "edp/epoch_Js": epoch_J * epoch_s,
            "energy/epoch_between_steps_J": epoch_J - merged["steps_J"],
            "energy/total_J": total_J,
            **{f"energy/epoch_J/{name}": joules for name, joules in sorted(merged["energy"].items())},
        }
        if zeus_J is not None:
            metrics["energy/zeus_epoch_J"] = zeus_J
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=False, on_epoch=True, batch_size=1, rank_zero_only=True)
        self._epochs.append({
            "epoch": epoch, "train_J": epoch_J, "train_s": epoch_s, "power_W": metrics["power/epoch_W"],
            "edp_Js": epoch_J * epoch_s, "steps": merged["steps"], "steps_J": merged["steps_J"],
            "between_steps_J": metrics["energy/epoch_between_steps_J"], "validation_J": merged["validation_J"],
            "per_sensor_J": merged["energy"], "total_J": total_J, **({"zeus_J": zeus_J} if zeus_J is not None else {}),
            **({"missing_sensors": merged["missing"]} if merged["missing"] else {}),
            **({"resumed_mid_epoch": True} if self._resumed.get("open_epoch") == epoch and self._first_epoch() else {}),
        })
        self._show_total(trainer, total_J)
        self._event("epoch_end", end, epoch=epoch)
        if self._tb is not None:
            self._tb.after_epoch(trainer, epoch, self._power.take() if self.log_power_figure else None)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._event("train_end")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        end = self._meter.wait(self._meter.mark())
        self._event("fit_end", end)
        self._final_state = self._cumulative_state(trainer, end)  # for a checkpoint saved after the fit
        summaries = distributed.gather(trainer, self._rank_summary(trainer, measure(self._fit_start, end)))
        sections = {}  # other callbacks' tables (e.g. PrecisionSwitch's per-mode table); collective
        for callback in trainer.callbacks:
            section = getattr(callback, "energy_report_section", None)
            if callback is not self and callable(section):
                sections.update(section(trainer) or {})
        if not trainer.is_global_zero:
            return
        extra = {
            "sampling": {
                "interval_s": self._sampler.interval_s,
                "samples": self._sampler.samples_taken,
                "trace_file": str(self._trace.trace_path) if self._trace else None,
                "events_file": str(self._trace.events_path) if self._trace else None,
            },
            "notes": self._notes,
            "sections": sections,
            **{f"resumed_{k}": v for k, v in self._resumed.items() if k != "epochs"},
        }
        self.report = build_report(summaries, self._epochs, extra)
        self.report_path = atomic_write_json(self._log_dir / REPORT_FILE, self.report)
        if self.verbose:
            print(format_report(self.report) + f"\nreport: {self.report_path}", flush=True)
        else:
            rank_zero_info(f"lightning-energy: report written to {self.report_path}")

    def _rank_summary(self, trainer: Trainer, fit: Measurement) -> dict:
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

    # ---------------------------------------------------------------- validation and test
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._loop_start = self._meter.mark()
            if self._zeus is not None:
                self._zeus.pause_epoch()  # Zeus's epoch figure leaves validation out, like ours
            self._event("validation_start", self._loop_start, epoch=trainer.current_epoch)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self._loop_start is None:
            return
        if self._zeus is not None:
            self._zeus.resume_epoch()
        m = self._end_loop(trainer, pl_module, "val")
        if self._trace is not None:
            self._trace.event("validation_end", m.end_s, epoch=trainer.current_epoch)
        if trainer.state.fn == TrainerFn.FITTING:
            for name, joules in m.energy_J.items():
                self._val_in_epoch[name] = self._val_in_epoch.get(name, 0.0) + joules
            self._val_s_in_epoch += m.duration_s
            self._session_validation_J += m.total_J

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop_start = self._meter.mark()

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_loop(trainer, pl_module, "test")

    def _end_loop(self, trainer: Trainer, pl_module: LightningModule, prefix: str) -> Measurement:
        end = self._meter.wait(self._meter.mark())
        m = measure(self._loop_start, end)
        self._loop_start = None
        energy_J = sum(distributed.gather(trainer, m.total_J))
        seconds = max(distributed.gather(trainer, m.duration_s))
        for name, value in ((f"energy/{prefix}_epoch_J", energy_J), (f"time/{prefix}_epoch_s", seconds),
                            (f"power/{prefix}_epoch_W", energy_J / seconds if seconds > 0 else 0.0)):
            pl_module.log(name, value, on_step=False, on_epoch=True, batch_size=1, rank_zero_only=True)
        return m

    # ---------------------------------------------------------------- resume
    def _resumed_total_J(self) -> float:
        return self._resumed.get("total_J", 0.0)

    def _first_epoch(self) -> bool:
        """True while the first epoch of this fit is being closed (its row not yet appended)."""
        return len(self._epochs) == len(self._resumed.get("epochs", []))

    def state_dict(self) -> dict[str, Any]:
        """Cumulative figures of all ranks up to now (J, s), for resume.

        Saving a checkpoint waits (once, not per step) until the samples cover the moment of saving, so
        a mid-epoch checkpoint keeps the energy since the last finished epoch. Collective under DDP, as
        Lightning saves checkpoints on every rank.
        """
        if self._meter is not None and self._fit_start is not None and self._trainer is not None:
            return self._cumulative_state(self._trainer, self._meter.wait(self._meter.mark()))
        if self._final_state is not None:
            return dict(self._final_state)
        return dict(self._resumed)

    def _cumulative_state(self, trainer: Trainer, end: Mark) -> dict[str, Any]:
        """Totals since the first fit up to ``end`` over all ranks (collective): total, train and
        validation J (the open epoch's training so far included), duration s (slowest rank)."""
        train_J = self._session_train_J
        if self._epoch_open:
            open_epoch = measure(self._epoch_start, end).total_J - sum(self._val_in_epoch.values())
            if self._loop_start is not None:  # saved while validation runs: that part is not training
                open_epoch -= measure(self._loop_start, end).total_J
            train_J += open_epoch
        fit = measure(self._fit_start, end)
        merged = distributed.merge(distributed.gather(trainer, {
            "total_J": fit.total_J, "train_J": train_J, "validation_J": self._session_validation_J,
            "seconds": fit.duration_s,
        }))
        resumed = self._resumed
        state = {key: resumed.get(key, 0.0) + merged[key] for key in ("total_J", "train_J", "validation_J")}
        state["duration_s"] = resumed.get("duration_s", 0.0) + merged["seconds"]
        state["epochs"] = list(self._epochs)
        if self._epoch_open:
            state["open_epoch"] = trainer.current_epoch
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict)
        self._epochs = list(self._resumed.get("epochs", []))
