"""FlopsCallback: the model's FLOPs/MACs table at fit start; FLOP rate, MFU and energy per GFLOP per epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_energy.measure import ranks as distributed
from lightning_energy.predict.flops import FlopsRecorder, FlopsTable, count_model
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.lightning_internals import batches_that_stepped, first_batch_size
from lightning_energy.integration.timeline import EpochFigures, StepFigures
from lightning_energy.predict.peaks import Peak, device_peak, precision_of
from lightning_energy.integration.precision_plugin import SwitchablePrecision
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.provenance import combine, tagged
from lightning_energy.units import FLOP_PER_GFLOP

log_info = rank_zero_info_for(__name__)

TABLE_FILE = "flops_table.csv"


class FlopsCallback(MeteredCallback):
    """Count the model's FLOPs once, then report how fast and how efficiently they run.

    The table (per layer: parameters, forward MACs and FLOPs, backward FLOPs, study MACs; see
    :mod:`lightning_energy.predict.flops`) is counted with ``FlopCounterMode`` on
    ``example_input`` (or the module's ``example_input_array``) at fit start, else on the first
    training batch inside the real training step (forward until ``on_before_backward``, backward
    after it). That counted step is left out of the rates below (the counter slows it down).

    ``study_MACs`` are the multiply-accumulates of one forward pass of the batch counted the way the Baler
    profiling study counted them (ptflops' convention: Linear and Conv layers only, a Linear bias once per
    output feature, not per sample), so a figure can be set beside that study's table; the rates, MFU and
    energy per GFLOP below use torch's FLOPs (2 per multiply-accumulate, forward and backward) instead.

    At fit end one line (rank zero, the ``lightning_energy`` logger) gives the GFLOP per training batch, the
    study MACs, the fit's FLOP rate, MFU and energy per GFLOP (saying whether that energy is measured,
    estimated or simulated) and the path of ``flops_table.csv`` (:meth:`summary_line`).

    Logged at fit start (rank zero): TensorBoard text ``flops/table``, ``flops_table.csv`` in the log
    dir, and hyperparameters ``flops/params``, ``flops/forward_GFLOP_per_batch``,
    ``flops/train_GFLOP_per_batch`` (forward + backward), ``flops/study_MACs_per_batch``,
    ``flops/batch_size``, ``flops/peak_TFLOP_per_s`` (of the precision at fit start) and
    ``flops/energy_estimated`` (True when a sensor of any rank is an estimate, e.g. the CPU estimate
    from TDP and load; the text table then says so and an info message says it once).

    Logged per training epoch (rank zero, through every logger, at the epoch's last step, once the
    Trainer's timeline has measured the epoch: a few steps after its end), over the time and energy of
    its training steps (all ranks; the optimizer steps of the timeline, the windows of
    ``EnergyCallback``'s ``energy/step_J``, work other callbacks add inside a step left out):

    - ``flops/epoch_GFLOP``: FLOPs run, = FLOPs per sample of the counted batch x samples in the steps
      (exact for layers that act per sample, as Linear and Conv do);
    - ``flops/rate_GFLOP_per_s``: those FLOPs over the steps' time (slowest rank);
    - ``flops/mfu``: model FLOPs utilisation, the rate over the peak of the device and precision
      (:mod:`lightning_energy.predict.peaks`: Lightning's ``get_available_flops`` datasheet table for known GPUs,
      with corrections where it is wrong; else a measured matrix product, on a GPU a large one timed with
      CUDA events) x ranks.
      The precision is read at every step (the mode of a ``SwitchablePrecision`` plugin, which
      ``PrecisionSwitch`` changes mid-run, else ``trainer.precision``), so an epoch that ran in several
      precisions is held against each one's peak: ``mfu = sum over precisions of (FLOPs / peak) /
      (time x ranks)``; a peak not yet known is measured (on CPU) at the end of the epoch that needs it,
      outside its steps;
    - ``energy/J_per_GFLOP``: the steps' measured energy per GFLOP; an estimate wherever the sensors
      are (``flops/energy_estimated`` and ``energy_estimated`` in :attr:`epochs` say so).

    Args:
        example_input: a batch for the model's ``forward`` (tensor, tuple of arguments or dict).
        peak_flops_per_s: the peak FLOP/s of one device, instead of the table or the measurement (for
            every precision).
        sensors: sensors to read instead of those of an ``EnergyCallback`` or the auto-detected ones.
        interval_s: sampling interval requested from the shared sampler (s).
    """

    def __init__(
        self,
        example_input: Any = None,
        peak_flops_per_s: float | None = None,
        sensors: list[Sensor] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        super().__init__()
        if peak_flops_per_s is not None and (isinstance(peak_flops_per_s, bool)
                                             or not isinstance(peak_flops_per_s, (int, float))
                                             or not peak_flops_per_s > 0):
            raise ValueError(f"`peak_flops_per_s` must be a number > 0, got {peak_flops_per_s!r}")
        self.example_input = example_input
        self.peak_flops_per_s = None if peak_flops_per_s is None else float(peak_flops_per_s)
        self.configure_measurement(sensors, interval_s=interval_s)
        self.table: FlopsTable | None = None
        self.peak: Peak | None = None  # of the precision at fit start
        self.peaks: dict[str, Peak] = {}  # every precision trained in, by peaks.PRECISIONS key
        self.energy_estimated = False
        self.estimated_sensors: list[str] = []  # estimated sensors of every rank
        self.energy_provenance = "measured"  # of the sensors of every rank: measured / estimated / simulated, +-joined
        self.table_path: Path | None = None  # flops_table.csv once written (rank zero)
        self.epochs: list[dict] = []
        self._recorder: FlopsRecorder | None = None
        self._counting_batch = False

    # ---------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        self.table, self.epochs, self.peak, self.peaks, self.table_path = None, [], None, {}, None
        self._recorder: FlopsRecorder | None = None
        self._counting_batch = False
        # per optimizer step (Lightning's step number), until the timeline measures it: its epoch, samples per
        # precision, and whether its first batch was counted (then it is left out)
        self._steps: dict[int, dict] = {}
        self._epoch_steps: dict[int, dict] = {}  # per epoch: the measured steps' samples, energy, time
        self._waiting: dict[int, EpochFigures] = {}  # epochs measured before their last step (single process)
        self._epoch_precisions: set[str] = set()
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # trainer.log_dir is collective
        self._device = trainer.strategy.root_device
        attachment = self.attach(trainer, self._user_sensors, interval_s=self.interval_s)
        local = [(s.name, s.estimated, s.provenance) for s in attachment.sensors]
        gathered = [sensor for rank in distributed.gather(trainer, local) for sensor in rank]
        self.estimated_sensors = sorted({name for name, estimated, _ in gathered if estimated})
        self.energy_provenance = combine(provenance for _, _, provenance in gathered)
        self.energy_estimated = bool(self.estimated_sensors)
        if self.energy_estimated:
            log_info(f"FlopsCallback: sensors {self.estimated_sensors} are estimates, not measurements, so "
                           "energy/J_per_GFLOP is an estimate (flops/energy_estimated = True)")

    def _precision(self, trainer: Trainer) -> str:
        """The peak table's precision of the coming step: the plugin's current mode, else the Trainer's."""
        plugin = trainer.precision_plugin
        name = plugin.mode_name if isinstance(plugin, SwitchablePrecision) else trainer.precision
        return precision_of(name, self._device.type)

    def _peak(self, precision: str) -> Peak:
        """The peak of ``precision`` on this device (measured on first use where not in the table)."""
        if precision not in self.peaks:
            if self.peak_flops_per_s is not None:
                self.peaks[precision] = Peak(self.peak_flops_per_s, precision, str(self._device), "given by the user",
                                             False)
            else:
                self.peaks[precision] = device_peak(self._device, precision)
        return self.peaks[precision]

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        self._stop_counting()

    def _stop_counting(self) -> None:
        if self._recorder is not None and self._counting_batch:
            self._recorder.__exit__(None, None, None)
            self._counting_batch = False

    # ---------------------------------------------------------------- counting
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.peak = self._peak(self._precision(trainer))  # every callback's setup has run: a plugin is in place
        example = self.example_input if self.example_input is not None else pl_module.example_input_array
        if example is None:
            return  # counted on the first training batch
        from lightning.fabric.utilities.apply_func import move_data_to_device

        self._publish(trainer, count_model(pl_module, move_data_to_device(example, pl_module.device)))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # recorded at the batch's start: the timeline may measure the step as soon as it ends
        number = batches_that_stepped(trainer)  # the step this batch belongs to
        step = self._steps.setdefault(number, {"epoch": trainer.current_epoch, "samples": {}, "counted": False})
        if self.table is None and self._recorder is None:
            self._recorder = FlopsRecorder(pl_module)
            self._recorder.batch_size = first_batch_size(batch)
            self._recorder.__enter__()
            self._counting_batch = True
            step["counted"] = True  # the counter slows the step down: left out of the rates
            return
        precision = self._precision(trainer)
        self._epoch_precisions.add(precision)
        step["samples"][precision] = step["samples"].get(precision, 0) + (first_batch_size(batch) or 0)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss) -> None:
        if self._counting_batch and not self._recorder.forward_marked:
            self._recorder.forward_done()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        if self._counting_batch:
            self._recorder.__exit__(None, None, None)
            self._counting_batch = False
            self._publish(trainer, self._recorder.table())

    def _publish(self, trainer: Trainer, table: FlopsTable) -> None:
        self.table = table
        if not trainer.is_global_zero:
            return
        from lightning.pytorch.loggers import TensorBoardLogger

        self.table_path = self.write_output(self._log_dir / TABLE_FILE, table.csv_text())
        params = {
            "flops/params": table.params,
            "flops/forward_GFLOP_per_batch": table.forward_FLOPs / FLOP_PER_GFLOP,
            "flops/train_GFLOP_per_batch": table.train_FLOPs / FLOP_PER_GFLOP,
            "flops/study_MACs_per_batch": table.study_MACs,
            "flops/batch_size": table.batch_size or 0,
            "flops/peak_TFLOP_per_s": self.peak.flops_per_s / 1e12,
            "flops/energy_estimated": self.energy_estimated,
        }
        energy = (f"ESTIMATED (sensors {', '.join(self.estimated_sensors)} are estimates)" if self.energy_estimated
                  else "measured")
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
            if isinstance(logger, TensorBoardLogger):
                text = (f"{table.markdown()}\n\npeak: {self.peak.flops_per_s / 1e12:.3f} TFLOP/s "
                        f"({self.peak.precision}, {self.peak.device}; {self.peak.source})\n\n"
                        f"energy/J_per_GFLOP: {energy}")
                logger.experiment.add_text("flops/table", text, global_step=trainer.global_step)

    # ---------------------------------------------------------------- per step and per epoch
    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        step = self._steps.pop(figures.step, None)
        if step is None or step["counted"]:
            return
        totals = self._epoch_steps.setdefault(figures.epoch, {"samples": {}, "energy_J": 0.0, "seconds": 0.0})
        for precision, samples in step["samples"].items():
            totals["samples"][precision] = totals["samples"].get(precision, 0) + samples
        energy = figures.measurement.energy_J
        totals["energy_J"] += sum(energy.get(name, 0.0) for name in self.attachment.sensor_names)
        totals["seconds"] += figures.measurement.duration_s
        waiting = self._waiting.get(figures.epoch)
        if waiting is not None and not self._steps_pending(figures.epoch):
            del self._waiting[figures.epoch]
            self._epoch_row(trainer, waiting)

    def _steps_pending(self, epoch: int) -> bool:
        return any(step["epoch"] == epoch for step in self._steps.values())

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after the epoch's end mark and outside any step: a peak this epoch needs is measured here (on CPU)
        for precision in sorted(self._epoch_precisions):
            self._peak(precision)
        self._epoch_precisions = set()

    @override
    def on_epoch_measured(self, trainer: Trainer, figures: EpochFigures) -> None:
        if trainer.world_size == 1 and self._steps_pending(figures.epoch):
            # the epoch's end was resolved a moment before its last step reached us: finish with that step
            self._waiting[figures.epoch] = figures
            return
        self._epoch_row(trainer, figures)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for epoch in sorted(self._waiting):  # every step is delivered by now; a step never measured is left out
            self._epoch_row(trainer, self._waiting.pop(epoch))
        log_info(self.summary_line())

    def summary_line(self) -> str:
        """One line on the fit: FLOPs per batch, study MACs, and over every measured epoch the FLOP rate, energy per
        GFLOP and MFU (time-weighted over the epochs) against each precision's peak, with where the table went."""
        table = self.table
        if table is None:
            return "FlopsCallback: no FLOPs counted (no training batch ran); nothing written"
        batch = f" of {table.batch_size}" if table.batch_size else ""
        where = f"table: {self.table_path}" if self.table_path is not None else "table not written (see the warning)"
        head = (f"FlopsCallback: {_flop(table.train_FLOPs)} per training batch{batch} (forward "
                f"{_flop(table.forward_FLOPs)}; study MACs {table.study_MACs:,}: one forward pass as the Baler study "
                "counts it, Linear/Conv only)")
        seconds = sum(e["steps_s"] for e in self.epochs)
        if not self.epochs or seconds <= 0:
            return f"{head}; no epoch measured beyond the counted step; {where}"
        gflop = sum(e["flops/epoch_GFLOP"] for e in self.epochs)
        energy_J = sum(e["steps_J"] for e in self.epochs)
        mfu = sum(e["flops/mfu"] * e["steps_s"] for e in self.epochs) / seconds
        precisions = sorted({name for e in self.epochs for name in e["GFLOP_by_precision"]})
        peaks = "; ".join(f"{name} {_flop(self.peaks[name].flops_per_s)}/s ({self.peaks[name].source})"
                          for name in precisions if name in self.peaks)
        per_gflop = tagged(f"{energy_J / gflop:.4g} J/GFLOP", self.energy_provenance) if gflop > 0 else "no FLOPs"
        return (f"{head}; over {len(self.epochs)} epoch{'s' if len(self.epochs) != 1 else ''}: "
                f"{_flop(gflop * FLOP_PER_GFLOP / seconds)}/s, {per_gflop}, MFU {100 * mfu:.3g} % of the peak, "
                f"{peaks}; {where}")

    def _epoch_row(self, trainer: Trainer, figures: EpochFigures) -> None:
        """The epoch's row from its measured steps, all ranks (a collective under DDP)."""
        totals = self._epoch_steps.pop(figures.epoch, None)
        table = self.table
        local = totals if totals is not None else {"samples": {}, "energy_J": 0.0, "seconds": 0.0}
        merged = distributed.merge(distributed.gather(trainer, local))
        if table is None or not table.batch_size or not merged.get("samples"):
            return
        per_sample = table.train_FLOPs / table.batch_size
        by_precision = {name: per_sample * n for name, n in merged["samples"].items()}
        flops, seconds, energy = sum(by_precision.values()), merged["seconds"], merged["energy_J"]
        rate = flops / seconds if seconds > 0 else 0.0
        unknown = [name for name in by_precision if name not in self.peaks]  # another rank's precision
        if unknown:
            with self.timeline.extra("flops_peak"):  # this may run inside a step: its time is left out of it
                for name in unknown:
                    self._peak(name)
        ideal_s = sum(f / self._peak(name).flops_per_s for name, f in by_precision.items())  # at every peak
        row = {
            "epoch": figures.epoch,
            "flops/epoch_GFLOP": flops / FLOP_PER_GFLOP,
            "flops/rate_GFLOP_per_s": rate / FLOP_PER_GFLOP,
            "flops/mfu": ideal_s / (seconds * trainer.world_size) if seconds > 0 else 0.0,
            "energy/J_per_GFLOP": energy / (flops / FLOP_PER_GFLOP) if flops > 0 else 0.0,
        }
        self.epochs.append({**row, "steps_s": seconds, "steps_J": energy, "GFLOP_by_precision":
                            {name: f / FLOP_PER_GFLOP for name, f in by_precision.items()},
                            "energy_estimated": self.energy_estimated})
        self.log_metrics(trainer, {name: value for name, value in row.items() if name != "epoch"}, figures.step)


def _flop(value: float) -> str:
    """FLOPs with an SI prefix: ``1.02 kFLOP``, ``31.3 GFLOP``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}FLOP"
    return f"{value:.3g} FLOP"
