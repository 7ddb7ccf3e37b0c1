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

from lightning_energy.meter import measure


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
    if any(isinstance(c, Timer) and getattr(c, "_duration", None) is not None for c in trainer.callbacks):
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


class ForecastTracker:
    """The forecast's bookkeeping over one fit, driven by boundary calls on the training thread.

    ``ForecastCallback`` calls these from its Lightning hooks; tests drive them on a fake clock. Marks
    come from ``meter``; only :meth:`epoch_end`, :meth:`forecast_now` and :meth:`fit_end` wait for
    the samples. ``merge`` combines a dict of this rank's figures over ranks (J summed, s slowest).
    """

    def __init__(self, meter, fit_start, plan: PlannedRun, warmup_batches: int, g_per_J: float = 0.0,
                 merge=_identity) -> None:
        if warmup_batches < 0:
            raise ValueError(f"warm-up must be >= 0 batches, got {warmup_batches}")
        self.meter = meter
        self.fit_start = fit_start
        self.warmup_batches = warmup_batches
        self.forecaster = Forecaster(plan, g_per_J)
        self.forecasts: list[Forecast] = []
        self.merge = merge
        self.batches = 0  # training batches of this fit
        self._previous_end = None
        self._epoch_start = None

    def epoch_start(self) -> None:
        self._epoch_start = self.meter.mark()
        self._steady_start = self._epoch_start if self.batches >= self.warmup_batches else None
        self._epoch_batches = 0
        self._steady_batches = 0
        self._validation: list[tuple] = []
        self._validation_start = None

    def batch_end(self) -> None:
        self.batches += 1
        self._epoch_batches += 1
        if self._steady_start is not None:
            self._steady_batches += 1
        elif self.batches == self.warmup_batches:
            self._steady_start = self.meter.mark()

    def validation_start(self) -> None:
        self._validation_start = self.meter.mark()

    def validation_end(self) -> None:
        if self._validation_start is not None:
            self._validation.append((self._validation_start, self.meter.mark()))
            self._validation_start = None

    def epoch_end(self, epoch: int | None = None) -> Forecast:
        """Close the epoch and forecast (waits for the samples to cover its end)."""
        end = self.meter.wait(self.meter.mark())
        observation = self._observe(end, epoch, partial=False)
        self.forecaster.add_epoch(observation)
        self._previous_end = end
        return self._predict(end, epoch=observation.epoch)

    def forecast_now(self) -> Forecast:
        """A forecast within the current epoch (waits for the samples to cover now)."""
        now = self.meter.wait(self.meter.mark())
        return self._predict(now, partial=self._observe(now, None, partial=True))

    def fit_end(self) -> tuple[float, float, list[dict]]:
        """(actual J, actual s, each forecast's error) once the fit is over."""
        end = self.meter.wait(self.meter.mark())
        actual = self.merge({"J": measure(self.fit_start, end).total_J, "s": end.t - self.fit_start.t})
        return actual["J"], actual["s"], forecast_errors(self.forecasts, actual["J"], actual["s"])

    def _observe(self, end, epoch: int | None, partial: bool) -> EpochObservation:
        validation = [measure(a, b) for a, b in self._validation if b.resolved]
        val_J, val_s = sum(v.total_J for v in validation), sum(v.duration_s for v in validation)
        window = measure(self._epoch_start, end)
        local = {"train_J": window.total_J - val_J, "train_s": window.duration_s - val_s,
                 "steady_J": 0.0, "steady_s": 0.0, "inner_J": 0.0, "inner_s": 0.0, "gap_J": 0.0, "gap_s": 0.0}
        if self._steady_start is not None:
            after = [v for v in validation if v.start_s >= self._steady_start.t]
            steady = measure(self._steady_start, end)
            local["steady_J"] = steady.total_J - sum(v.total_J for v in after)
            local["steady_s"] = steady.duration_s - sum(v.duration_s for v in after)
        has_gap = not partial and self._previous_end is not None
        if not partial:
            local["inner_J"], local["inner_s"] = val_J, val_s
        if has_gap:
            gap = measure(self._previous_end, self._epoch_start)
            local["gap_J"], local["gap_s"] = gap.total_J, gap.duration_s
        m = self.merge(local)
        return EpochObservation(epoch if epoch is not None else len(self.forecaster.epochs), self._epoch_batches,
                                self._steady_batches, m["steady_J"], m["steady_s"], m["train_J"], m["train_s"],
                                m["inner_J"], m["inner_s"], m["gap_J"] if has_gap else None,
                                m["gap_s"] if has_gap else None)

    def _predict(self, now, partial: EpochObservation | None = None, epoch: int | None = None) -> Forecast:
        so_far = self.merge({"J": measure(self.fit_start, now).total_J, "s": now.t - self.fit_start.t})
        forecast = self.forecaster.predict(so_far["J"], so_far["s"], self.batches, len(self.forecaster.epochs),
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
