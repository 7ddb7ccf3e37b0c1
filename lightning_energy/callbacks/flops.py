"""FlopsCallback: the model's FLOPs/MACs table at fit start; FLOP rate, MFU and energy per GFLOP per epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_energy import distributed
from lightning_energy.flops import FlopsRecorder, FlopsTable, batch_size_of, count_model
from lightning_energy.io import atomic_write_text
from lightning_energy.meter import Mark
from lightning_energy.peaks import Peak, device_peak, precision_of
from lightning_energy.precision import SwitchablePrecision
from lightning_energy.sampler import DEFAULT_INTERVAL_S, MIN_INTERVAL_S
from lightning_energy.sensors.base import Sensor, validate_sensors
from lightning_energy.session import open_meter_session

TABLE_FILE = "flops_table.csv"
GFLOP = 1e9


class FlopsCallback(Callback):
    """Count the model's FLOPs once, then report how fast and how efficiently they run.

    The table (per layer: parameters, forward MACs and FLOPs, backward FLOPs, MACs in the Baler
    study's convention; see :mod:`lightning_energy.flops`) is counted with ``FlopCounterMode`` on
    ``example_input`` (or the module's ``example_input_array``) at fit start, else on the first
    training batch inside the real training step (forward until ``on_before_backward``, backward
    after it). That counted step is left out of the rates below (the counter slows it down).

    Logged at fit start (rank zero): TensorBoard text ``flops/table``, ``flops_table.csv`` in the log
    dir, and hyperparameters ``flops/params``, ``flops/forward_GFLOP_per_batch``,
    ``flops/train_GFLOP_per_batch`` (forward + backward), ``flops/study_MACs_per_batch``,
    ``flops/batch_size``, ``flops/peak_TFLOP_per_s`` (of the precision at fit start) and
    ``flops/energy_estimated`` (True when a sensor of any rank is an estimate, e.g. the CPU estimate
    from TDP and load; the text table then says so and an info message says it once).

    Logged per training epoch, over the time and energy of its training steps (all ranks):

    - ``flops/epoch_GFLOP``: FLOPs run, = FLOPs per sample of the counted batch x samples in the steps
      (exact for layers that act per sample, as Linear and Conv do);
    - ``flops/rate_GFLOP_per_s``: those FLOPs over the steps' time (slowest rank);
    - ``flops/mfu``: model FLOPs utilisation, the rate over the peak of the device and precision
      (:mod:`lightning_energy.peaks`: datasheet for known GPUs, measured matrix product on CPU) x ranks.
      The precision is read at every step (the mode of a ``SwitchablePrecision`` plugin, which
      ``PrecisionSwitch`` changes mid-run, else ``trainer.precision``), so an epoch that ran in several
      precisions is held against each one's peak: ``mfu = sum over precisions of (FLOPs / peak) /
      (time x ranks)``; a peak not yet known is measured (on CPU) at the end of the epoch that needs it;
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
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s >= MIN_INTERVAL_S:
            raise ValueError(f"`interval_s` must be a number >= {MIN_INTERVAL_S} s, got {interval_s!r}")
        self.example_input = example_input
        self.peak_flops_per_s = None if peak_flops_per_s is None else float(peak_flops_per_s)
        self._user_sensors = None if sensors is None else validate_sensors(sensors)
        self.interval_s = float(interval_s)
        self.table: FlopsTable | None = None
        self.peak: Peak | None = None  # of the precision at fit start
        self.peaks: dict[str, Peak] = {}  # every precision trained in, by peaks.PRECISIONS key
        self.energy_estimated = False
        self.estimated_sensors: list[str] = []  # estimated sensors of every rank
        self.epochs: list[dict] = []
        self._session = None
        self._recorder: FlopsRecorder | None = None
        self._counting_batch = False

    # ---------------------------------------------------------------- set-up and tear-down
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self._session is not None:
            return
        self.table, self.epochs, self.peak, self.peaks = None, [], None, {}
        self._recorder: FlopsRecorder | None = None
        self._counting_batch = False
        self._step_start: Mark | None = None
        self._step_precision = "fp32"
        self._samples: dict[str, int] = {}  # samples of the epoch's measured steps per precision
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # trainer.log_dir is collective
        self._device = trainer.strategy.root_device
        self._session = open_meter_session(trainer, self, self._user_sensors, interval_s=self.interval_s)
        for note in self._session.notes:
            rank_zero_warn(note)
        local = [s.name for s in self._session.sensors if s.estimated]
        self.estimated_sensors = sorted({name for names in distributed.gather(trainer, local) for name in names})
        self.energy_estimated = bool(self.estimated_sensors)
        if self.energy_estimated:
            rank_zero_info(f"FlopsCallback: sensors {self.estimated_sensors} are estimates, not measurements, so "
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

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self._recorder is not None and self._counting_batch:
            self._recorder.__exit__(None, None, None)
            self._counting_batch = False
        if self._session is not None:
            session, self._session = self._session, None
            session.close()

    # ---------------------------------------------------------------- counting
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.peak = self._peak(self._precision(trainer))  # every callback's setup has run: a plugin is in place
        example = self.example_input if self.example_input is not None else pl_module.example_input_array
        if example is None:
            return  # counted on the first training batch
        from lightning.fabric.utilities.apply_func import move_data_to_device

        self._publish(trainer, count_model(pl_module, move_data_to_device(example, pl_module.device)))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.table is None and self._recorder is None:
            self._recorder = FlopsRecorder(pl_module)
            self._recorder.batch_size = batch_size_of(batch)
            self._recorder.__enter__()
            self._counting_batch = True
            return
        self._step_precision = self._precision(trainer)
        self._step_start = self._session.meter.mark()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss) -> None:
        if self._counting_batch and not self._recorder.forward_marked:
            self._recorder.forward_done()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        if self._counting_batch:
            self._recorder.__exit__(None, None, None)
            self._counting_batch = False
            self._publish(trainer, self._recorder.table())
            return
        if self._step_start is None:
            return
        meter = self._session.meter
        meter.add_window(self._step_start, meter.mark(), tag=("flops", trainer.current_epoch))
        self._step_start = None
        precision = self._step_precision
        self._samples[precision] = self._samples.get(precision, 0) + (batch_size_of(batch) or 0)

    def _publish(self, trainer: Trainer, table: FlopsTable) -> None:
        self.table = table
        if not trainer.is_global_zero:
            return
        from lightning.pytorch.loggers import TensorBoardLogger

        atomic_write_text(self._log_dir / TABLE_FILE, table.csv_text())
        params = {
            "flops/params": table.params,
            "flops/forward_GFLOP_per_batch": table.forward_FLOPs / GFLOP,
            "flops/train_GFLOP_per_batch": table.train_FLOPs / GFLOP,
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

    # ---------------------------------------------------------------- per epoch
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        meter = self._session.meter
        meter.wait(meter.mark())  # every step window queued before is resolved
        totals = meter.totals.pop(("flops", trainer.current_epoch), None)
        samples, self._samples = self._samples, {}
        table = self.table
        if table is None or totals is None or not table.batch_size:
            return
        per_sample = table.train_FLOPs / table.batch_size
        local = {"samples": samples, "energy_J": totals.total_J, "seconds": totals.duration_s}
        merged = distributed.merge(distributed.gather(trainer, local))
        by_precision = {name: per_sample * n for name, n in merged.get("samples", {}).items()}
        flops, seconds, energy = sum(by_precision.values()), merged["seconds"], merged["energy_J"]
        rate = flops / seconds if seconds > 0 else 0.0
        ideal_s = sum(f / self._peak(name).flops_per_s for name, f in by_precision.items())  # at every peak
        row = {
            "epoch": trainer.current_epoch,
            "flops/epoch_GFLOP": flops / GFLOP,
            "flops/rate_GFLOP_per_s": rate / GFLOP,
            "flops/mfu": ideal_s / (seconds * trainer.world_size) if seconds > 0 else 0.0,
            "energy/J_per_GFLOP": energy / (flops / GFLOP) if flops > 0 else 0.0,
        }
        self.epochs.append({**row, "steps_s": seconds, "steps_J": energy, "GFLOP_by_precision":
                            {name: f / GFLOP for name, f in by_precision.items()},
                            "energy_estimated": self.energy_estimated})
        for name, value in row.items():
            if name != "epoch":
                pl_module.log(name, value, on_step=False, on_epoch=True, batch_size=1, rank_zero_only=True)
