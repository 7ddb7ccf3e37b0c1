"""Forecast of a fit's total energy (J), time (s) and CO2e (g) from what has been measured so far.

The planned run is ``min(max_epochs x batches per epoch, max_steps x accumulation)`` batches, with
batches per epoch as Lightning computes them (``limit_train_batches`` honoured). Early stopping may end
the fit sooner, so the forecast is the worst case. The model:

    total = measured so far
          + remaining batches x (energy per training batch after warm-up)
          + remaining epochs  x (mean energy in an epoch outside its training batches: validation,
                                 epoch hooks; plus the mean gap between epochs: checkpointing)
          + one more gap       (the checkpoint and hooks after the last epoch)

and the same for time. Warm-up batches (the first ones of the fit: compilation, caches, autotuning)
are left out of the per-batch rate but are part of "measured so far". The gap between epochs is known
from the second epoch on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lightning_energy.measure.meter import Mark


class ForecastUnavailable(ValueError):
    """The planned length of the fit is unknown (no max_epochs or max_steps with a sized loader)."""


@dataclass(frozen=True)
class PlannedRun:
    """How many batches and epochs the fit is configured for (per rank)."""

    batches_per_epoch: float  # math.inf for an unsized loader
    total_batches: int
    epochs: int | None  # None when batches per epoch are unknown
    limited_by: str  # "max_epochs" or "max_steps"
    early_stopping: bool = False  # the fit may stop sooner: the forecast is its worst case
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {**asdict(self), "notes": list(self.notes)}


def plan_run(batches_per_epoch: float, max_epochs: int | None, max_steps: int = -1, accumulate_grad_batches: int = 1,
             early_stopping: bool = False, notes: tuple[str, ...] = ()) -> PlannedRun:
    """The planned run from the Trainer's limits (``max_steps`` counts optimizer steps)."""
    if accumulate_grad_batches < 1:
        raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
    by_epochs = batches_per_epoch * max_epochs if max_epochs is not None and max_epochs >= 0 else math.inf
    by_steps = math.inf
    if max_steps is not None and max_steps >= 0:
        if math.isfinite(batches_per_epoch):
            steps_per_epoch = math.ceil(batches_per_epoch / accumulate_grad_batches)  # a partial window steps too
            full_epochs, rest_steps = divmod(max_steps, steps_per_epoch) if steps_per_epoch else (0, 0)
            by_steps = full_epochs * batches_per_epoch + min(rest_steps * accumulate_grad_batches, batches_per_epoch)
        else:
            by_steps = max_steps * accumulate_grad_batches
    total = min(by_epochs, by_steps)
    if not math.isfinite(total):
        raise ForecastUnavailable("the planned length of the fit is unknown: set max_epochs with a sized "
                                  "train loader, or max_steps")
    limited_by = "max_epochs" if by_epochs <= by_steps else "max_steps"
    known = math.isfinite(batches_per_epoch) and batches_per_epoch > 0
    epochs = math.ceil(total / batches_per_epoch) if known else None
    return PlannedRun(batches_per_epoch, int(total), epochs, limited_by, early_stopping, tuple(notes))


def plan_from_trainer(trainer) -> PlannedRun:
    """:func:`plan_run` for a Trainer whose train loader is set up (from ``on_train_start`` on)."""
    from lightning.pytorch.callbacks import EarlyStopping, Timer

    notes = []
    early = any(isinstance(c, EarlyStopping) for c in trainer.callbacks)
    if early:
        notes.append("EarlyStopping may end the fit sooner: the forecast is the worst case (every planned epoch)")
    if any(isinstance(c, Timer) and c.time_remaining() is not None for c in trainer.callbacks):
        notes.append("max_time may end the fit sooner than forecast")
    max_epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
    return plan_run(trainer.num_training_batches, max_epochs, trainer.max_steps, trainer.accumulate_grad_batches,
                    early, tuple(notes))


@dataclass(frozen=True)
class EpochObservation:
    """What one epoch cost, split as the forecast model needs it (J, s)."""

    epoch: int
    batches: int  # training batches in the epoch
    steady_batches: int  # of which after warm-up
    steady_J: float  # energy of the training part after warm-up
    steady_s: float
    train_J: float  # energy of all training in the epoch (validation windows excluded)
    train_s: float
    inner_J: float = 0.0  # the rest of the epoch window: its validation
    inner_s: float = 0.0
    gap_J: float | None = None  # from the previous epoch's end to this epoch's start (None: first epoch)
    gap_s: float | None = None


@dataclass(frozen=True)
class Forecast:
    """A prediction of the fit's totals made after ``batches_done`` batches."""

    epoch: int | None  # the epoch that had just ended (None: a forecast made within an epoch)
    batches_done: int
    so_far_J: float
    so_far_s: float
    total_J: float
    total_s: float
    total_gCO2e: float
    J_per_batch: float
    s_per_batch: float
    epoch_overhead_J: float  # per epoch outside training batches, gap included
    epoch_overhead_s: float
    warmup_included: bool  # no batch after warm-up seen yet: the rate includes warm-up

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Forecaster:
    """Accumulates epoch observations and predicts totals for a :class:`PlannedRun`."""

    plan: PlannedRun
    g_per_J: float = 0.0  # grams CO2e per joule (intensity x PUE / 3.6e6)
    epochs: list[EpochObservation] = field(default_factory=list)

    def add_epoch(self, observation: EpochObservation) -> None:
        self.epochs.append(observation)

    def predict(self, so_far_J: float, so_far_s: float, batches_done: int, epochs_done: int,
                partial: EpochObservation | None = None, epoch: int | None = None) -> Forecast:
        """Totals for the planned run given the fit's measured energy and time so far.

        ``partial`` is the current, unfinished epoch's training (for forecasts made within an epoch).
        """
        observed = self.epochs + ([partial] if partial is not None else [])
        steady_batches = sum(o.steady_batches for o in observed)
        warmup_included = steady_batches == 0
        if warmup_included:
            batches = sum(o.batches for o in observed)
            rate_J = sum(o.train_J for o in observed) / batches if batches else math.nan
            rate_s = sum(o.train_s for o in observed) / batches if batches else math.nan
        else:
            rate_J = sum(o.steady_J for o in observed) / steady_batches
            rate_s = sum(o.steady_s for o in observed) / steady_batches
        inner_J, inner_s = _mean([o.inner_J for o in self.epochs]), _mean([o.inner_s for o in self.epochs])
        gaps = [o for o in self.epochs if o.gap_J is not None]
        gap_J, gap_s = _mean([o.gap_J for o in gaps]), _mean([o.gap_s for o in gaps])
        remaining_batches = max(self.plan.total_batches - batches_done, 0)
        remaining_epochs = max(self.plan.epochs - epochs_done, 0) if self.plan.epochs is not None else 0
        # a gap precedes each epoch still to start, and one follows the last epoch; within an epoch,
        # that epoch's own gap is already in "so far"
        started = 1 if partial is not None else 0
        remaining_gaps = max(remaining_epochs - started, 0) + 1
        total_J = so_far_J + remaining_batches * rate_J + remaining_epochs * inner_J + remaining_gaps * gap_J
        total_s = so_far_s + remaining_batches * rate_s + remaining_epochs * inner_s + remaining_gaps * gap_s
        return Forecast(epoch, batches_done, so_far_J, so_far_s, total_J, total_s, total_J * self.g_per_J,
                        rate_J, rate_s, inner_J + gap_J, inner_s + gap_s, warmup_included)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _identity(local: dict[str, float]) -> dict[str, float]:
    return local


_WHOLE_EPOCH = object()  # the warm-up was over before the epoch began: all of its training is steady


class ForecastTracker:
    """The forecast's bookkeeping over one fit, fed the figures of the Trainer's timeline (it places no mark).

    ``ForecastCallback`` hands on what the timeline delivers: every step's figures (:meth:`step`, this
    rank), every epoch's (:meth:`epoch`, all ranks, with this rank's cumulative energy per sensor at the
    epoch's end) and the fit's end mark (:meth:`fit_end`); :meth:`forecast_now` forecasts within an epoch
    from a resolved mark. Nothing here waits or reads a sensor. Tests feed hand-built figures on a fake
    clock. ``fit_start``: the timeline's resolved fit-start mark. ``names``: the sensors counted (None:
    every sensor in the figures). ``merge`` combines a dict of this rank's figures over ranks (keys ending
    ``J`` summed, ``s`` the slowest rank's); epoch and loop figures are all ranks' already.

    The warm-up ends with the step in which the ``warmup_batches``-th training batch falls (with gradient
    accumulation a step is several batches); the steady rate is measured from that step's end.
    """

    def __init__(self, fit_start: Mark, plan: PlannedRun, warmup_batches: int, g_per_J: float = 0.0,
                 merge=_identity, names: list[str] | None = None) -> None:
        if warmup_batches < 0:
            raise ValueError(f"warm-up must be >= 0 batches, got {warmup_batches}")
        self.fit_start = fit_start
        self.warmup_batches = warmup_batches
        self.names = None if names is None else list(names)
        self.forecaster = Forecaster(plan, g_per_J)
        self.forecasts: list[Forecast] = []
        self.merge = merge
        self.batches = 0  # training batches of this fit in the steps measured so far
        self._epoch_batches: dict[int, int] = {}
        self._epoch_steady_batches: dict[int, int] = {}
        self._epoch_first_start: dict[int, Mark] = {}  # the start of each epoch's first step
        self._steady_from: dict[int, object] = {}  # epoch -> the mark where warm-up ended in it, or _WHOLE_EPOCH
        self._warm = warmup_batches == 0
        self._previous: tuple[float, float] | None = None  # (J, s) since fit start at the previous epoch's end

    # ------------------------------------------------------------------ energy of the counted sensors
    def _counted(self, energy_J: dict[str, float]) -> float:
        return sum(j for n, j in energy_J.items() if self.names is None or n in self.names)

    def _since_fit_start(self, energy: dict[str, float | None]) -> float:
        """This rank's J of the counted sensors from fit start to a point with cumulative ``energy``."""
        start = self.fit_start.energy or {}
        names = self.names if self.names is not None else list(energy)
        return sum(energy[n] - start[n] for n in names
                   if energy.get(n) is not None and start.get(n) is not None)

    # ------------------------------------------------------------------ what the timeline delivers
    def step(self, figures) -> None:
        """One optimizer step of this rank (:class:`~lightning_energy.integration.timeline.StepFigures`)."""
        epoch = figures.epoch
        if epoch not in self._epoch_first_start:
            self._epoch_first_start[epoch] = figures.start
            if self._warm:
                self._steady_from[epoch] = _WHOLE_EPOCH
        self.batches += figures.batches
        self._epoch_batches[epoch] = self._epoch_batches.get(epoch, 0) + figures.batches
        if self._warm:  # a step after the warm-up
            self._epoch_steady_batches[epoch] = self._epoch_steady_batches.get(epoch, 0) + figures.batches
        elif self.batches >= self.warmup_batches:
            self._warm = True  # warm-up ends with this step: the steady rate is measured from its end
            self._steady_from[epoch] = figures.end

    def epoch(self, figures, end_energy: dict[str, float | None]) -> Forecast:
        """Close an epoch and forecast: ``figures`` (:class:`~lightning_energy.integration.timeline.EpochFigures`,
        all ranks, validation excluded) and this rank's cumulative J per sensor at the epoch's end."""
        epoch = figures.epoch
        train_J, train_s = self._counted(figures.energy_J), figures.duration_s
        val_J = sum(self._counted(loop.energy_J) for loop in figures.validation)
        val_s = sum(loop.duration_s for loop in figures.validation)
        steady_from = self._steady_from.get(epoch)
        local = {"fit_J": self._since_fit_start(end_energy), "fit_s": figures.end_s - self.fit_start.t,
                 "steady_J": 0.0, "steady_s": 0.0}
        if isinstance(steady_from, Mark):
            local["steady_J"] = local["fit_J"] - self._since_fit_start(steady_from.energy)
            local["steady_s"] = figures.end_s - steady_from.t
        m = self.merge(local)  # collective under DDP: every rank calls it for every epoch
        if steady_from is _WHOLE_EPOCH:
            steady_J, steady_s = train_J, train_s
        elif isinstance(steady_from, Mark):
            after = [loop for loop in figures.validation if loop.start_s >= steady_from.t]
            steady_J = m["steady_J"] - sum(self._counted(loop.energy_J) for loop in after)
            steady_s = m["steady_s"] - sum(loop.duration_s for loop in after)
        else:
            steady_J = steady_s = 0.0
        gap_J = gap_s = None
        if self._previous is not None:  # the rest since the previous epoch's end: the gap before this epoch
            gap_J = m["fit_J"] - self._previous[0] - train_J - val_J
            gap_s = m["fit_s"] - self._previous[1] - train_s - val_s
        self.forecaster.add_epoch(EpochObservation(
            epoch, self._epoch_batches.get(epoch, 0), self._epoch_steady_batches.get(epoch, 0), steady_J, steady_s,
            train_J, train_s, val_J, val_s, gap_J, gap_s))
        self._previous = (m["fit_J"], m["fit_s"])
        done = sum(n for e, n in self._epoch_batches.items() if e <= epoch)  # later steps may be in already
        return self._predict(m["fit_J"], m["fit_s"], done, epoch=epoch)

    def forecast_now(self, now: Mark, epoch: int) -> Forecast:
        """A forecast within ``epoch`` at the resolved mark ``now`` (every step before it delivered)."""
        here = self._since_fit_start(now.energy)
        local = {"fit_J": here, "fit_s": now.t - self.fit_start.t, "train_J": 0.0, "train_s": 0.0,
                 "steady_J": 0.0, "steady_s": 0.0}
        first = self._epoch_first_start.get(epoch)
        if first is not None:
            local["train_J"], local["train_s"] = here - self._since_fit_start(first.energy), now.t - first.t
        steady_from = self._steady_from.get(epoch)
        if steady_from is _WHOLE_EPOCH:
            local["steady_J"], local["steady_s"] = local["train_J"], local["train_s"]
        elif isinstance(steady_from, Mark):
            local["steady_J"] = here - self._since_fit_start(steady_from.energy)
            local["steady_s"] = now.t - steady_from.t
        m = self.merge(local)
        partial = EpochObservation(epoch, self._epoch_batches.get(epoch, 0), self._epoch_steady_batches.get(epoch, 0),
                                   m["steady_J"], m["steady_s"], m["train_J"], m["train_s"])
        return self._predict(m["fit_J"], m["fit_s"], self.batches, partial=partial)

    def fit_end(self, end: Mark) -> tuple[float, float, list[dict]]:
        """(actual J, actual s, each forecast's error) at the fit's resolved end mark."""
        actual = self.merge({"J": self._since_fit_start(end.energy), "s": end.t - self.fit_start.t})
        return actual["J"], actual["s"], forecast_errors(self.forecasts, actual["J"], actual["s"])

    def _predict(self, so_far_J: float, so_far_s: float, batches_done: int,
                 partial: EpochObservation | None = None, epoch: int | None = None) -> Forecast:
        forecast = self.forecaster.predict(so_far_J, so_far_s, batches_done, len(self.forecaster.epochs),
                                           partial=partial, epoch=epoch)
        self.forecasts.append(forecast)
        return forecast


def forecast_errors(forecasts: list[Forecast], actual_J: float, actual_s: float) -> list[dict]:
    """Each forecast's error against the fit's actual totals: forecast - actual (J, s and %)."""
    rows = []
    for f in forecasts:
        rows.append({
            "epoch": f.epoch, "batches_done": f.batches_done, "forecast_J": f.total_J, "forecast_s": f.total_s,
            "forecast_gCO2e": f.total_gCO2e, "error_J": f.total_J - actual_J, "error_s": f.total_s - actual_s,
            "error_pct": 100.0 * (f.total_J - actual_J) / actual_J if actual_J else math.nan,
            "time_error_pct": 100.0 * (f.total_s - actual_s) / actual_s if actual_s else math.nan,
        })
    return rows


def format_errors(rows: list[dict], actual_J: float, actual_s: float) -> str:
    """The console table of forecast errors."""
    header = f"{'epoch':>5} {'batches':>8} {'forecast J':>12} {'error %':>8} {'forecast s':>11} {'error %':>8}"
    lines = [f"lightning-energy forecast: actual {actual_J:.1f} J, {actual_s:.2f} s", header, "-" * len(header)]
    for r in rows:
        epoch = "-" if r["epoch"] is None else str(r["epoch"])
        lines.append(f"{epoch:>5} {r['batches_done']:>8} {r['forecast_J']:>12.1f} {r['error_pct']:>8.2f} "
                     f"{r['forecast_s']:>11.2f} {r['time_error_pct']:>8.2f}")
    return "\n".join(lines)


def cern_estimate_J(batch_energies_J: list[float], total_batches: int) -> float:
    """The CERN study's full-training estimate: mean energy of the sampled batches x number of batches."""
    if not batch_energies_J:
        raise ValueError("the CERN estimate needs at least one measured batch")
    return sum(batch_energies_J) / len(batch_energies_J) * total_batches
