"""A run's energy predicted from a short measured probe of the run itself (calibrated, not modelled).

The layer fits of :mod:`~lightning_energy.predict.pre_run` price only Linear and Conv layers; the rest of a
step (activations, loss, optimizer, data loading, Python) and the cost of validation and of epoch ends are not
in them (on this machine they predicted 12.4 J for a run that took 24.2 J). The probe measures all of it:

1. :func:`probe_fit` trains the user's own ``LightningModule`` on the user's own dataloaders for two short
   epochs (``warmup_batches`` + ``probe_batches`` training batches each, ``probe_val_batches`` validation
   batches after each, no sanity check) while :class:`RunMarks` places meter marks at the Trainer's
   boundaries (a mark is a timestamp: the training thread reads no sensor).
2. :func:`predict_from_probe` extrapolates the probe to the plan (:class:`RunPlan`): the probe's own energy,
   plus the energy per training batch (start to start: the step and the loading of the next batch, from the
   batches after the warm-up) times the batches the plan has beyond the probe's, plus the energy per
   validation batch times the extra validation batches, plus the measured cost of an epoch end (the second
   epoch's energy, with what ran between the two epochs, less its batches and its validation) times the
   extra epochs.

The prediction covers the Trainer's training loop, ``on_train_start`` to ``on_train_end`` (validation and
epoch ends included, the sanity check and the Trainer's set-up not), the window :class:`RunMarks` measures on
the real run. Its bound adds in quadrature a ``confidence`` (95 %) interval from the probe's batch-to-batch
spread of time per batch (energy per batch is taken as spreading like time; this part alone holds only for a
machine whose load stays as it was during the probe) and a run-to-run ``margin`` (default
:data:`DEFAULT_MARGIN`, 25 % of the prediction: the largest error ``benchmarks/prediction_error.py`` measured
on a shared machine whose load moved between probe and run; give ``margin=0`` on a quiet, dedicated one). Joules carry the sensors' provenance: on a machine
without energy counters they are the labelled CPU estimate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_energy.measure.meter import Mark, Meter, measure

DEFAULT_PROBE_BATCHES = 10
DEFAULT_WARMUP_BATCHES = 2
DEFAULT_PROBE_VAL_BATCHES = 3
# run-to-run margin (relative) added to the probe's statistical bound: the machine's load moves between the
# probe and the run. benchmarks/prediction_error.py on a shared 2-vCPU VM, CPU estimate, 5 models x 3 runs of
# 1.5-8 s: at load average ~3 errors from -24.7 % to +20.6 % (mean |error| 9.1 %); at load ~5 (more jobs than
# cores) from -48 % to +76 % on the runs under 3 s (mean |error| 19.0 %), which no margin set in advance covers
DEFAULT_MARGIN = 0.25


@dataclass(frozen=True)
class RunPlan:
    """The run to predict: ``epochs`` of ``train_batches`` training batches, ``val_batches`` validation
    batches after every ``val_every_n_epochs``-th epoch (0 batches: no validation)."""

    epochs: int
    train_batches: int
    val_batches: int = 0
    val_every_n_epochs: int = 1

    def __post_init__(self) -> None:
        for name in ("epochs", "train_batches", "val_every_n_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RunPlan.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.val_batches, bool) or not isinstance(self.val_batches, int) or self.val_batches < 0:
            raise ValueError(f"RunPlan.val_batches must be an integer >= 0, got {self.val_batches!r}")

    @property
    def val_runs(self) -> int:
        return self.epochs // self.val_every_n_epochs if self.val_batches else 0


@dataclass
class ProbeFigures:
    """What a probe measured (J: the sensors' energy, summed; s: seconds)."""

    total_J: float  # on_train_start to on_train_end
    total_s: float
    epochs: int
    batch_J: float  # per training batch after the warm-up, start to start
    batch_s: float
    batch_s_sd: float  # batch-to-batch standard deviation of the time per batch
    steady_batches: int  # batches behind batch_J
    train_batches: int  # training batches the probe ran, all epochs
    val_batch_J: float  # per validation batch (validation loop start to end / batches)
    val_batches: int  # validation batches the probe ran
    epoch_end_J: float  # the last epoch (and the gap before it) less its batches and its validation
    provenance: str = "measured"


@dataclass
class CalibratedEstimate:
    """A run's energy predicted from a probe, with a ``confidence`` bound (J)."""

    plan: RunPlan
    probe: ProbeFigures
    predicted_J: float
    bound_J: float  # half-width of the interval: statistical and margin in quadrature
    confidence: float
    statistical_J: float = 0.0  # the probe's batch-to-batch part of the bound
    margin: float = 0.0  # the run-to-run margin, relative
    parts_J: dict[str, float] = field(default_factory=dict)

    @property
    def relative_bound(self) -> float:
        return self.bound_J / self.predicted_J if self.predicted_J > 0 else math.inf

    def as_dict(self) -> dict:
        return {"plan": asdict(self.plan), "probe": asdict(self.probe), "predicted_J": self.predicted_J,
                "bound_J": self.bound_J, "relative_bound": self.relative_bound, "confidence": self.confidence,
                "statistical_J": self.statistical_J, "margin": self.margin,
                "parts_J": dict(self.parts_J), "provenance": self.probe.provenance}

    def format(self) -> str:
        p = self.probe
        return (f"calibrated ({p.provenance}; probe of {p.train_batches} training + {p.val_batches} validation "
                f"batches): {self.predicted_J:.4g} J +- {self.bound_J:.3g} J ({self.relative_bound:.1%}, "
                f"{self.confidence:.0%} bound of the probe's batch-to-batch spread, +-{self.statistical_J:.3g} J, "
                f"and a {self.margin:.0%} run-to-run margin) for {self.plan.epochs} "
                f"epochs x {self.plan.train_batches} batches; {p.batch_J:.4g} J per training batch, "
                f"{p.val_batch_J:.4g} J per validation batch, {p.epoch_end_J:.4g} J per epoch end")


def predict_from_probe(probe: ProbeFigures, plan: RunPlan, confidence: float = 0.95,
                       margin: float = DEFAULT_MARGIN) -> CalibratedEstimate:
    """Extrapolate ``probe`` to ``plan`` (see the module docstring); pure arithmetic on measured figures."""
    if not 0 < confidence < 1:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}")
    if not (isinstance(margin, (int, float)) and 0 <= margin < math.inf) or isinstance(margin, bool):
        raise ValueError(f"`margin` must be a finite number >= 0, got {margin!r}")
    extra_batches = plan.epochs * plan.train_batches - probe.train_batches
    extra_val = plan.val_runs * plan.val_batches - probe.val_batches
    extra_epochs = plan.epochs - probe.epochs
    parts = {"probe": probe.total_J, "training batches": extra_batches * probe.batch_J,
             "validation batches": extra_val * probe.val_batch_J, "epoch ends": extra_epochs * probe.epoch_end_J}
    predicted = math.fsum(parts.values())
    # energy per batch spreads like time per batch: the relative standard deviation of one batch
    rel_sd = probe.batch_s_sd / probe.batch_s if probe.batch_s > 0 else 0.0
    sd_batch_J = rel_sd * probe.batch_J
    n = max(probe.steady_batches, 1)
    se_mean = sd_batch_J / math.sqrt(n)
    # the mean's error scales with the batches extrapolated; an epoch end is a difference over the epoch's
    # batches, so it carries their summed noise (sqrt(batches in an epoch) x one batch's sd)
    batches_per_epoch = max(probe.train_batches // max(probe.epochs, 1), 1)
    variance = ((extra_batches * se_mean) ** 2
                + (extra_epochs * math.sqrt(batches_per_epoch) * sd_batch_J) ** 2
                + (extra_val * rel_sd * probe.val_batch_J / math.sqrt(max(probe.val_batches, 1))) ** 2)
    statistical = _t_quantile(confidence, n - 1) * math.sqrt(variance)
    bound = math.hypot(statistical, margin * predicted)
    return CalibratedEstimate(plan, probe, predicted, bound, confidence, statistical_J=statistical, margin=float(margin),
                              parts_J=parts)


def _t_quantile(confidence: float, dof: int) -> float:
    from scipy import stats

    return float(stats.t.ppf((1 + confidence) / 2, max(dof, 1)))


class RunMarks(Callback):
    """Meter marks at the training loop's boundaries (timestamps only: no sensor is read on the training
    thread); :meth:`figures` turns them into :class:`ProbeFigures` once the marks are resolved.

    ``meter``: a :class:`~lightning_energy.measure.meter.Meter` attached to the shared sampler
    (:class:`~lightning_energy.predict.pre_run.MeterProbe` gives one). ``warmup_batches``: training
    batches at the start of the first epoch left out of the energy per batch.
    """

    def __init__(self, meter: Meter, warmup_batches: int = DEFAULT_WARMUP_BATCHES) -> None:
        self.meter = meter
        self.warmup_batches = warmup_batches
        self.train_start: Mark | None = None
        self.train_end: Mark | None = None
        self.epochs: list[dict[str, Any]] = []  # per epoch: start, batch starts, last batch end, validation

    def on_train_start(self, trainer, pl_module) -> None:
        self.train_start = self.meter.mark()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epochs.append({"start": self.meter.mark(), "batches": [], "last_end": None, "val": [], "end": None})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.epochs[-1]["batches"].append(self.meter.mark())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.epochs[-1]["last_end"] = self.meter.mark()

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and self.epochs:
            self.epochs[-1]["val"].append([self.meter.mark(), None, 0])

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking and self.epochs and self.epochs[-1]["val"]:
            self.epochs[-1]["val"][-1][2] += 1

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and self.epochs and self.epochs[-1]["val"]:
            self.epochs[-1]["val"][-1][1] = self.meter.mark()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epochs[-1]["end"] = self.meter.mark()

    def on_train_end(self, trainer, pl_module) -> None:
        self.train_end = self.meter.mark()

    def total(self) -> tuple[float, float]:
        """(J, s) from ``on_train_start`` to ``on_train_end`` (waits, bounded, for the end mark)."""
        end = self.meter.wait(self.train_end)
        m = measure(self.meter.wait(self.train_start), end)
        return m.total_J, m.duration_s

    def figures(self, provenance: str = "measured") -> ProbeFigures:
        """The probe's figures (waits, bounded, for every mark to resolve)."""
        total_J, total_s = self.total()
        wait = self.meter.wait
        steady_J, steady_n, durations = 0.0, 0, []
        val_J, val_n, epoch_end_J, train_batches = 0.0, 0, 0.0, 0
        for index, epoch in enumerate(self.epochs):
            starts = epoch["batches"]
            train_batches += len(starts)
            first = self.warmup_batches if index == 0 else 0
            steady = starts[first:]
            if len(steady) >= 2:  # start to start: each batch with the loading of the next
                resolved = [wait(mark) for mark in steady]  # a resolved mark has its time t (s, sampler clock)
                steady_J += measure(resolved[0], resolved[-1]).total_J
                steady_n += len(steady) - 1
                durations += [b.t - a.t for a, b in zip(resolved, resolved[1:])]
            epoch_val_J = 0.0
            for start, end, batches in epoch["val"]:
                if end is not None:
                    epoch_val_J += measure(wait(start), wait(end)).total_J
                    val_n += batches
            val_J += epoch_val_J
            if index == len(self.epochs) - 1 and epoch["end"] is not None:
                epoch_J = measure(wait(epoch["start"]), wait(epoch["end"])).total_J
                if index > 0 and self.epochs[index - 1]["end"] is not None:  # what runs between two epochs
                    epoch_J += measure(wait(self.epochs[index - 1]["end"]), wait(epoch["start"])).total_J
                epoch_end_J = epoch_J - epoch_val_J  # the batches are taken off below, at the mean
                last_epoch_batches = len(starts)
        if steady_n == 0:
            raise ValueError("the probe needs at least 2 training batches after the warm-up to measure a batch")
        batch_J = steady_J / steady_n
        mean_s = math.fsum(durations) / len(durations)
        sd_s = (math.sqrt(math.fsum((d - mean_s) ** 2 for d in durations) / (len(durations) - 1))
                if len(durations) > 1 else 0.0)
        if self.epochs and self.epochs[-1]["end"] is not None:
            epoch_end_J -= last_epoch_batches * batch_J
        return ProbeFigures(total_J, total_s, len(self.epochs), batch_J, mean_s, sd_s, steady_n, train_batches,
                            val_J / val_n if val_n else 0.0, val_n, epoch_end_J, provenance)


def probe_fit(make_module: Callable[[], LightningModule], train_dataloaders, plan: RunPlan,
              val_dataloaders=None, probe_batches: int = DEFAULT_PROBE_BATCHES,
              warmup_batches: int = DEFAULT_WARMUP_BATCHES, probe_val_batches: int = DEFAULT_PROBE_VAL_BATCHES,
              sensors=None, confidence: float = 0.95, margin: float = DEFAULT_MARGIN,
              **trainer_kwargs: Any) -> CalibratedEstimate:
    """Probe the run of ``plan`` (two epochs of ``warmup_batches`` + ``probe_batches`` training batches, each
    followed by ``probe_val_batches`` validation batches, at most the plan's) and predict its energy
    (:func:`predict_from_probe`).

    ``make_module`` builds a fresh module (the probe trains it; the real run should start from its own).
    ``sensors``: as for ``EnergyCallback`` (None: auto-detected). ``trainer_kwargs`` go to the probe's
    ``Trainer`` (``accelerator``, ``devices``, ...), as in the real run.
    """
    from lightning_energy.predict.pre_run import MeterProbe
    from lightning_energy.provenance import combine

    for name, value, lowest in (("probe_batches", probe_batches, 2), ("warmup_batches", warmup_batches, 0),
                                ("probe_val_batches", probe_val_batches, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ValueError(f"`{name}` must be an integer >= {lowest}, got {value!r}")
    meter_probe = MeterProbe(sensors)
    with meter_probe.attached():
        marks = RunMarks(meter_probe.meter, warmup_batches)
        kwargs = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                  "enable_model_summary": False, **trainer_kwargs}
        kwargs.update(max_epochs=2, max_steps=-1, num_sanity_val_steps=0,
                      limit_train_batches=warmup_batches + probe_batches,
                      limit_val_batches=min(probe_val_batches, plan.val_batches) if val_dataloaders is not None else 0,
                      check_val_every_n_epoch=1, callbacks=[*kwargs.get("callbacks", []), marks])
        trainer = Trainer(**kwargs)
        trainer.fit(make_module(), train_dataloaders, val_dataloaders)
        figures = marks.figures(combine(s.provenance for s in meter_probe.sensors))
    return predict_from_probe(figures, plan, confidence, margin)


def measure_run(fit: Callable[[Callback], None], sensors=None) -> tuple[float, float, str]:
    """(J, s, provenance) of ``on_train_start`` to ``on_train_end`` of the fit that ``fit(callback)`` runs
    with the given callback in its Trainer: the window a calibrated estimate predicts, through the same
    sensors."""
    from lightning_energy.predict.pre_run import MeterProbe
    from lightning_energy.provenance import combine

    meter_probe = MeterProbe(sensors)
    with meter_probe.attached():
        marks = RunMarks(meter_probe.meter)
        fit(marks)
        joules, seconds = marks.total()
    return joules, seconds, combine(s.provenance for s in meter_probe.sensors)


class _SyntheticRun(LightningModule):
    """``model`` trained to output zeros (mean squared output) with Adam: a stand-in for a training step
    whose cost does not depend on the data's values (dense layers), for a probe without the user's data."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).float().pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.model(batch[0]).float().pow(2).mean())

    def configure_optimizers(self):
        import torch

        return torch.optim.Adam(self.parameters(), lr=1e-4)


def synthetic_probe(model, example_input, plan: RunPlan, probe_batches: int = DEFAULT_PROBE_BATCHES,
                    sensors=None, confidence: float = 0.95, margin: float = DEFAULT_MARGIN) -> CalibratedEstimate:
    """:func:`probe_fit` of ``model`` on random batches shaped like ``example_input`` (its device and dtype),
    trained to output zeros with Adam: what ``lightning-energy estimate --probe`` measures when it has a model
    class and an input shape but not the user's data, loss or optimizer (their costs, and data loading, are
    then not in the prediction). The probe trains ``model``; its weights are put back afterwards."""
    import copy

    import torch

    generator = torch.Generator().manual_seed(0)
    batches = DEFAULT_WARMUP_BATCHES + probe_batches
    data = torch.randn((batches, *example_input.shape), generator=generator).to(example_input)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.reshape(-1, *example_input.shape[1:])),
                                         batch_size=example_input.shape[0])
    val = loader  # validation is off in the probe when the plan has none
    device = example_input.device
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    devices = [device.index if device.index is not None else 0] if device.type == "cuda" else 1
    original = copy.deepcopy(model.state_dict())
    try:
        return probe_fit(lambda: _SyntheticRun(model), loader, plan, val, probe_batches=probe_batches,
                         sensors=sensors, confidence=confidence, margin=margin, accelerator=accelerator,
                         devices=devices)
    finally:
        model.load_state_dict(original)  # the probe leaves the caller's weights as they were
