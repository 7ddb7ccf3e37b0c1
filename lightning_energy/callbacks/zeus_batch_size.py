"""ZeusBatchSizeOptimizer: a recurring job asks Zeus's BSO server for its batch size and reports every epoch.

Why not wrap ``zeus.optimizer.batch_size.BatchSizeOptimizer`` (the client): its constructor opens every
GPU through ``get_gpus()`` (no CPU or simulated runs), it measures with its own ``ZeusMonitor`` window
instead of the shared sampler, it raises to end a failed trial where Lightning wants ``should_stop``, and
it reports the end of a trial from ``atexit``. What it sends is kept exactly: Zeus's own request models
(``JobSpecFromClient``, ``TrialId``, ``TrainingResult``, ``ReportResponse``) to Zeus's own URLs, with the
same numbers (cumulative time and energy since training began, the validation metric, the epoch count),
so the server cannot tell the two clients apart. Start a server with ``python lightning_energy/optimize/bso_server.py``.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_energy.extras import check_installed
from lightning_energy.measure import ranks as distributed
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.lightning_internals import batches_that_stepped
from lightning_energy.measure.meter import Mark, measure
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.optimize.power_limit.gpu_control import rank_gpu
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.units import MW_PER_W

log_info = rank_zero_info_for(__name__)


def _zeus_bso():
    with contextlib.redirect_stdout(io.StringIO()):
        import zeus.optimizer.batch_size.common as common
    return common


class BSOServerError(RuntimeError):
    """The BSO server could not be reached or refused a request."""


class ZeusBatchSizeOptimizer(MeteredCallback):
    """Batch size from Zeus's BSO server for each run of a recurring job; energy, time and metric back per epoch.

    At the start of ``fit`` (rank zero asks, every rank applies) the job is registered with the server
    (again, for a recurring job with the same ``job_id``: the server checks that it is the same) and the
    server's batch size is set through ``lightning_setattr`` (model attribute, ``hparams`` or datamodule)
    before the dataloaders are built. After every validation run it reports the time and energy since
    training began (``on_train_start``, after the sanity check; energy of this callback's device sensors,
    or of all its sensors when there is none, summed over ranks; the slowest rank's time) and ``monitor``;
    each report waits (bounded) for the samples to reach the end of its validation run, as the server's
    answer decides whether training goes on. Training ends when the server says so (target
    reached, ``max_epochs`` of the job, or a cost above ``beta_knob`` times the best one). At the end the
    trial is closed (the server marks an unreported one failed).

    Logged (rank zero, per report): ``bso/batch_size``, ``bso/energy_J``, ``bso/time_s``, ``bso/cost`` (Zeus's
    ``eta*E + (1-eta)*MaxPower*T``, J). The outcome is kept in :attr:`outcome`.

    Args:
        server_url: e.g. ``"http://127.0.0.1:8000"``.
        job_id_prefix, job_id: the job; give ``job_id`` (starting with the prefix) for a recurring job,
            or leave it None for the server to make one per run.
        batch_sizes, default_batch_size: the candidates and the first one tried.
        monitor: the validation metric reported (``trainer.callback_metrics`` key).
        target_metric, higher_is_better_metric, eta_knob, beta_knob, max_epochs, num_pruning_rounds,
        window_size, mab_prior_mean, mab_prior_precision, mab_num_explorations, mab_seed: Zeus's ``JobParams``.
        batch_arg_name: the attribute holding the batch size.
        gpu: a Zeus ``GPU`` object (e.g. ``SimulatedGPU``) giving MaxPower and the GPU model; default: this
            rank's CUDA GPU through Zeus; on CPU give ``max_power_W`` and ``gpu_model``.
        max_power_W, gpu_model: instead of reading them from the GPU.
        sensors: the sensors to measure with (default: the GPU's own sensor for a simulated GPU, else shared).
        timeout_s: HTTP timeout per request.
    """

    def __init__(self, server_url: str, job_id_prefix: str, batch_sizes: list[int], default_batch_size: int,
                 job_id: str | None = None, monitor: str = "val/acc", target_metric: float = 0.5,
                 higher_is_better_metric: bool = True, eta_knob: float = 0.5, beta_knob: float | None = 2.0,
                 max_epochs: int = 100, num_pruning_rounds: int = 2, window_size: int = 0,
                 mab_prior_mean: float = 0.0, mab_prior_precision: float = 0.0, mab_num_explorations: int = 2,
                 mab_seed: int | None = None, batch_arg_name: str = "batch_size", gpu: Any = None,
                 max_power_W: float | None = None, gpu_model: str | None = None,
                 sensors: list[Sensor] | None = None, timeout_s: float = 10.0,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        check_installed("zeus", "ZeusBatchSizeOptimizer")  # fail at construction, not in the middle of a fit
        if not isinstance(server_url, str) or not server_url.startswith(("http://", "https://")):
            raise ValueError(f"`server_url` must be an http(s) URL, got {server_url!r}")
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"`monitor` must be a metric name, got {monitor!r}")
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` must be > 0, got {timeout_s!r}")
        common = _zeus_bso()
        try:  # Zeus's own validation of the job (sizes, eta, beta, default in the list, prefix of the id)
            self.job = common.JobSpec(
                job_id=job_id, job_id_prefix=job_id_prefix, batch_sizes=list(batch_sizes),
                default_batch_size=default_batch_size, eta_knob=eta_knob, beta_knob=beta_knob,
                target_metric=target_metric, higher_is_better_metric=higher_is_better_metric, max_epochs=max_epochs,
                num_pruning_rounds=num_pruning_rounds, window_size=window_size, mab_prior_mean=mab_prior_mean,
                mab_prior_precision=mab_prior_precision, mab_num_explorations=mab_num_explorations, mab_seed=mab_seed)
        except Exception as err:  # pydantic's ValidationError names the field
            raise ValueError(f"invalid BSO job: {err}") from err
        self.server_url = server_url.rstrip("/")
        self.monitor = monitor
        self.batch_arg_name = batch_arg_name
        self.gpu = gpu
        self.max_power_W, self.gpu_model = max_power_W, gpu_model
        self.configure_measurement(sensors, interval_s=interval_s)
        self.timeout_s = float(timeout_s)
        self.batch_size: int | None = None
        self.trial: dict | None = None
        self.reports: list[dict] = []
        self.outcome: dict | None = None
        self._train_start: Mark | None = None
        self._energy_sensors: list[str] = []
        self._resumed_trial: dict | None = None

    # ---------------------------------------------------------------- HTTP (rank zero)
    def _request(self, method: str, path: str, **kwargs):
        import httpx

        url = self.server_url + path
        try:
            response = httpx.request(method, url, timeout=self.timeout_s, **kwargs)
        except httpx.HTTPError as err:
            raise BSOServerError(f"cannot reach Zeus's BSO server at {self.server_url} ({type(err).__name__}: {err}). "
                                 "Start one: python lightning_energy/optimize/bso_server.py --port <port>") from err
        if not 200 <= response.status_code < 300:
            raise BSOServerError(f"Zeus's BSO server answered {response.status_code} to {method} {path}: {response.text}")
        return response.json()

    # ---------------------------------------------------------------- set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.attachment is not None:
            return
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MisconfigurationException(f"ZeusBatchSizeOptimizer: field `{self.batch_arg_name}` not found in the model, "
                                            "its hparams, the datamodule or its hparams (set `batch_arg_name`)")
        self._gpu_config = self._gpu_config_for(trainer)
        sensors = self._user_sensors
        if sensors is None and hasattr(self.gpu, "energy_sensor"):
            sensors = [self.gpu.energy_sensor()]
        attachment = self.attach(trainer, sensors, interval_s=self.interval_s)
        device = [s.name for s in attachment.sensors if s.scope == "device"]
        self._energy_sensors = device or attachment.sensor_names  # ours only: the session may hold others
        self._train_start = None
        self.reports, self.outcome = [], None

    def _gpu_config_for(self, trainer: Trainer) -> dict:
        gpu = self.gpu
        if gpu is None and trainer.strategy.root_device.type == "cuda":
            gpu = rank_gpu(trainer.strategy.root_device, "ZeusBatchSizeOptimizer")
        max_W = self.max_power_W if self.max_power_W is not None else (
            gpu.get_power_management_limit_constraints()[1] / MW_PER_W if gpu is not None else None)
        model = self.gpu_model or (str(gpu.get_name()) if gpu is not None else None)
        if max_W is None or not model:
            raise MisconfigurationException("ZeusBatchSizeOptimizer needs the GPU's maximum power and model: train on a "
                                            "GPU, pass `gpu`, or give `max_power_W` and `gpu_model`")
        # as Zeus's client: MaxPower of the job is the maximum limit times the number of GPUs
        return {"max_power": float(max_W) * trainer.world_size, "number_of_gpus": trainer.world_size, "gpu_model": model}

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        if exception is not None or stage == "fit":
            self._end_trial(trainer)
        self._train_start = None

    def _end_trial(self, trainer: Trainer) -> None:
        """Tell the server this trial is over (it marks it failed if no report ended it)."""
        if self.trial is None or not trainer.is_global_zero:
            return
        trial, self.trial = self.trial, None
        try:
            self._request("PATCH", _zeus_bso().REPORT_END_URL, content=_zeus_bso().TrialId(**trial).json())
        except BSOServerError as err:
            rank_zero_warn(f"ZeusBatchSizeOptimizer: could not close trial {trial}: {err}")

    # ---------------------------------------------------------------- the batch size
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Register the job and get the batch size (after a checkpoint restore: the restored trial's)."""
        common = _zeus_bso()
        trial = self._resumed_trial
        if trial is None and trainer.is_global_zero:
            spec = common.JobSpecFromClient(**self.job.dict(), **self._gpu_config)
            created = common.CreatedJob.parse_obj(self._request("POST", common.REGISTER_JOB_URL, content=spec.json()))
            answer = common.TrialId.parse_obj(self._request("GET", common.GET_NEXT_BATCH_SIZE_URL,
                                                            params={"job_id": created.job_id}))
            if answer.batch_size not in self.job.batch_sizes:
                raise BSOServerError(f"Zeus's BSO server returned batch size {answer.batch_size}, not one of "
                                     f"{self.job.batch_sizes}")
            trial = answer.dict()
        self.trial = trainer.strategy.broadcast(trial, src=0)
        self.batch_size = int(self.trial["batch_size"])
        lightning_setattr(pl_module, self.batch_arg_name, self.batch_size)
        log_info(f"ZeusBatchSizeOptimizer: job {self.trial['job_id']} trial {self.trial['trial_number']}: "
                       f"batch size {self.batch_size}")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.enable_validation:
            raise MisconfigurationException("ZeusBatchSizeOptimizer reports the validation metric after every "
                                            "validation run: give the Trainer a validation loop")
        # training begins here, after the sanity check: no boundary of the timeline, so a mark of our own
        # (resolved in the background; the first report waits for a later one)
        self._train_start = self.timeline.mark()

    # ---------------------------------------------------------------- per epoch
    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or self.outcome is not None
                or self._train_start is None):
            return
        energy_J, time_s = self._since_train_start(trainer)  # every rank: a collective
        value = trainer.callback_metrics.get(self.monitor)
        value = None if value is None else float(value)
        answer = None
        if trainer.is_global_zero:
            if value is None:
                raise MisconfigurationException(f"ZeusBatchSizeOptimizer: metric {self.monitor!r} is not logged; "
                                                f"logged: {sorted(trainer.callback_metrics)}")
            answer = self._report(trainer, energy_J, time_s, value)
        answer = trainer.strategy.broadcast(answer, src=0)
        if answer["stop_train"]:
            self.outcome = answer
            trainer.should_stop = True
            if answer["converged"]:
                log_info(f"ZeusBatchSizeOptimizer: {answer['message']} (batch size {self.batch_size})")
            else:
                rank_zero_warn(f"ZeusBatchSizeOptimizer: the server ends this run: {answer['message'].strip()} "
                               f"Batch size {self.batch_size} will not be tried again; start the next run.")

    def _since_train_start(self, trainer: Trainer) -> tuple[float, float]:
        """(J of all ranks, s of the slowest rank) from the start of training to now: waits (bounded) for the
        samples to reach now, and gathers over the ranks (a collective)."""
        end = self.attachment.meter.wait(self.timeline.mark())  # the end of this validation run
        m = measure(self._train_start, end)  # resolved too: marks resolve in order
        local = (sum(m.energy_J.get(name, 0.0) for name in self._energy_sensors), m.duration_s)
        rows = distributed.gather(trainer, local)
        return sum(r[0] for r in rows), max(r[1] for r in rows)

    def _report(self, trainer: Trainer, energy_J: float, time_s: float, value: float) -> dict:
        common = _zeus_bso()
        epoch = trained_epochs(trainer)
        result = common.TrainingResult(**self.trial, time=time_s + self._resumed_time_s,
                                       energy=energy_J + self._resumed_energy_J, metric=value, current_epoch=epoch)
        answer = common.ReportResponse.parse_obj(self._request("POST", common.REPORT_RESULT_URL, content=result.json()))
        eta = self.job.eta_knob
        row = {**result.dict(), "cost": eta * result.energy + (1 - eta) * self._gpu_config["max_power"] * result.time,
               **answer.dict()}
        self.reports.append(row)
        metrics = {"bso/batch_size": float(self.batch_size), "bso/energy_J": result.energy, "bso/time_s": result.time,
                   "bso/cost": row["cost"]}
        self.log_metrics(trainer, metrics, batches_that_stepped(trainer))
        return answer.dict()

    # ---------------------------------------------------------------- resume
    _resumed_time_s = 0.0
    _resumed_energy_J = 0.0

    @override
    def state_dict(self) -> dict[str, Any]:
        """The trial, and the time (s) and energy (J) reported last (the epoch count is the Trainer's)."""
        trial = self.trial if self.trial is not None else self._resumed_trial  # restored, not yet started
        if not self.reports:
            return {"trial": trial, "time_s": self._resumed_time_s, "energy_J": self._resumed_energy_J}
        last = self.reports[-1]
        return {"trial": trial, "time_s": last["time"], "energy_J": last["energy"]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_trial = state_dict.get("trial")
        self._resumed_time_s = float(state_dict.get("time_s", 0.0))
        self._resumed_energy_J = float(state_dict.get("energy_J", 0.0))


def trained_epochs(trainer: Trainer) -> int:
    """Training epochs completed when a validation run ends (Zeus's ``current_epoch``).

    A validation after an epoch's last batch completes that epoch; one within an epoch
    (``val_check_interval`` < 1) reports the epochs completed before it, so several validation runs
    in one epoch are not counted as several epochs.
    """
    at_epoch_end = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return trainer.current_epoch + int(at_epoch_end)
