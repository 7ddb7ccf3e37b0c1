"""The Trainer's one timeline: one mark per boundary, whoever asks, and the windows every callback reads.

Boundaries: fit start and end, each training epoch's start and end, each optimizer step (from the start
of its first micro-batch to the end of the batch that steps: gradient accumulation makes one step of
several batches), and each validation, test and predict loop. Every callback of the suite reports the
boundary first thing in its hook (:class:`~lightning_energy.integration.base.MeteredCallback` does it
for them); the first report places the mark and the others find it placed, so figures do not depend on
the order of ``Trainer(callbacks=[...])``. Work a callback adds inside a step (a full-precision probe, a
profiler flush) is a named sub-window (:meth:`Timeline.extra`): step figures exclude it and report it
apart.

Figures reach subscribers on the training thread as soon as the samples cover them, without waiting:

- :class:`StepFigures` for every optimizer step (this rank's sensors);
- :class:`LoopFigures` for every validation / test / predict loop (all ranks);
- :class:`EpochFigures` for every training epoch, validation excluded (all ranks).

All-rank figures (epochs and loops) are measured over one common interval on every rank: each
boundary's time is the latest rank's (on one clock: ranks on one host share ``perf_counter``; across
hosts wall-clock offsets convert, which holds to the hosts' clock synchronisation). Under DDP they are
settled at the boundary itself, with two small collectives and a bounded wait; in a single process an
epoch's figures are delivered at the first hook after its end is covered by samples (the epoch end
costs one mark). Nothing here reads a sensor.
"""

from __future__ import annotations

import contextlib
import functools
from itertools import takewhile as _takewhile
import math
import socket
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Protocol

from lightning_energy.measure.meter import EnergyWindow, Mark, Measurement, Meter, measure
from lightning_energy.integration.lightning_internals import (
    batches_that_stepped, epoch_end_log_step, is_accumulating,
)
from lightning_energy.measure.sampler import Sampler
from lightning_energy.measure.sensors.detect import duplicate_device_sensors
from lightning_energy.measure.series import bound_between

LOOP_KINDS = ("val", "test", "predict")
RETAIN_MARGIN_S = 1.0  # points kept before a boundary whose common time is settled later (DDP)


@dataclass(frozen=True)
class StepFigures:
    """One optimizer step of this rank: ``measurement`` excludes the named sub-windows in ``extras``.

    ``step``: the step Lightning logs this step's training metrics at; ``log``: Lightning logs at it
    (``log_every_n_steps``, the last step before stopping, ``fast_dev_run``).
    """

    step: int
    epoch: int
    batches: int
    log: bool
    measurement: Measurement
    extras: dict[str, Measurement]
    start: Mark  # the step's resolved start and end marks (cumulative J per sensor there): a window over
    end: Mark    # several steps, from one step's start to a later one's, is ``measure(a.start, b.start)``


@dataclass(frozen=True)
class LoopFigures(EnergyWindow):
    """A validation, test or predict loop over all ranks: J per sensor name (summed over ranks).

    ``bounds_J``: the attribution bound (J) per sensor (``series.bound_between``; ``inf`` for an extrapolated
    edge), None where not computed (DDP). Figures cover every sensor of the Trainer's session: a callback
    takes its own with :meth:`for_sensors`.
    """

    kind: str
    epoch: int
    step: int
    fitting: bool
    energy_J: dict[str, float]
    duration_s: float
    start_s: float  # this rank's sampler clock (s)
    end_s: float
    missing: tuple[dict, ...] = ()
    extrapolated: bool = False
    bounds_J: dict[str, float] | None = None

    @property
    def bound_J(self) -> float:
        """Attribution bound of ``total_J`` (J); nan where not computed (DDP), inf: an edge extrapolated."""
        return math.nan if self.bounds_J is None else sum(self.bounds_J.values())

    def for_sensors(self, names) -> "LoopFigures":
        """These figures restricted to the sensors ``names`` (a callback's own)."""
        return replace(self, energy_J=_only(self.energy_J, names), bounds_J=_only(self.bounds_J, names),
                       missing=tuple(m for m in self.missing if m["sensor"] in names))


@dataclass(frozen=True)
class EpochFigures:
    """A training epoch over all ranks, its validation loops excluded.

    Every energy is J per sensor name summed over ranks, over every sensor of the Trainer's session: a
    callback takes its own sensors' figures with :meth:`for_sensors`. ``energy_J``: the epoch;
    ``duration_s``: the common interval less its validation; ``steps``: optimizer steps of all ranks,
    ``steps_energy_J`` their energy; ``extras_energy_J``: sub-windows other callbacks added (name -> J per
    sensor); ``fit_energy_J``: all ranks' energy from their fit start to this epoch's end; ``missing``:
    ``{"sensor", "rank"}`` of sensors whose figures do not cover the epoch; ``bounds_J``: the attribution
    bound per sensor (None: not computed, DDP).
    """

    epoch: int
    step: int
    energy_J: dict[str, float]
    duration_s: float
    validation: tuple[LoopFigures, ...]
    steps: int
    steps_energy_J: dict[str, float]
    extras_energy_J: dict[str, dict[str, float]]
    fit_energy_J: dict[str, float]
    start_s: float  # this rank's sampler clock (s): the common start and end under DDP
    end_s: float
    missing: tuple[dict, ...] = ()
    extrapolated: bool = False
    resumed_mid_epoch: bool = False
    bounds_J: dict[str, float] | None = None

    @property
    def sensors(self) -> list[str]:
        """The sensors these figures cover, sorted."""
        return sorted(self.energy_J)

    @property
    def total_J(self) -> float:
        return sum(self.energy_J.values())

    @property
    def steps_J(self) -> float:
        return sum(self.steps_energy_J.values())

    @property
    def fit_J(self) -> float:
        return sum(self.fit_energy_J.values())

    @property
    def extras_J(self) -> dict[str, float]:
        return {name: sum(per_sensor.values()) for name, per_sensor in self.extras_energy_J.items()}

    @property
    def bound_J(self) -> float:
        """Attribution bound of ``total_J`` (J); nan where not computed (DDP), inf: an edge extrapolated."""
        return math.nan if self.bounds_J is None else sum(self.bounds_J.values())

    @property
    def validation_J(self) -> float:
        return sum(loop.total_J for loop in self.validation)

    @property
    def mean_power_W(self) -> float:
        return self.total_J / self.duration_s if self.duration_s > 0 else 0.0

    def for_sensors(self, names) -> "EpochFigures":
        """These figures restricted to the sensors ``names`` (a callback's own, of every rank)."""
        return replace(
            self, energy_J=_only(self.energy_J, names), validation=tuple(v.for_sensors(names) for v in self.validation),
            steps_energy_J=_only(self.steps_energy_J, names), fit_energy_J=_only(self.fit_energy_J, names),
            extras_energy_J={k: _only(v, names) for k, v in self.extras_energy_J.items()},
            bounds_J=_only(self.bounds_J, names), missing=tuple(m for m in self.missing if m["sensor"] in names))


class TimelineListener(Protocol):
    def on_step_measured(self, trainer, figures: StepFigures) -> None: ...
    def on_loop_measured(self, trainer, figures: LoopFigures) -> None: ...
    def on_epoch_measured(self, trainer, figures: EpochFigures) -> None: ...


@dataclass(eq=False)
class _Loop:
    kind: str
    epoch: int
    step: int
    fitting: bool
    start: Mark
    end: Mark | None = None
    figures: LoopFigures | None = None


@dataclass(eq=False)
class _Epoch:
    epoch: int
    start: Mark
    resumed_mid_epoch: bool
    end: Mark | None = None
    step: int = 0
    loops: list[_Loop] = field(default_factory=list)
    steps: int = 0
    steps_energy_J: dict[str, float] = field(default_factory=dict)  # J per sensor of its delivered steps
    extras: list[tuple[str, Mark, Mark]] = field(default_factory=list)  # sub-windows between steps
    step_extras_J: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> J per sensor, in steps
    figures: EpochFigures | None = None  # set when settled across ranks (DDP)


@dataclass(eq=False)
class _Step:
    epoch: int
    start: Mark
    batches: int = 0
    extras: list[tuple[str, Mark, Mark]] = field(default_factory=list)


class Timeline:
    """Boundaries and windows of one Trainer (built by its session; callbacks use ``attachment.timeline``)."""

    def __init__(self, trainer, meter: Meter, sampler: Sampler, on_train_start=None) -> None:
        """``on_train_start(trainer)``: called once per fit at train start (the session's device check)."""
        self.meter = meter
        self._on_train_start = on_train_start
        self.sampler = sampler
        self.listeners: list[TimelineListener] = []
        self.fit_start: Mark | None = None
        self.fit_end: Mark | None = None
        self.epochs_measured: list[EpochFigures] = []
        self.loops_measured: list[LoopFigures] = []
        self._distributed = _is_distributed(trainer)
        self._epoch: _Epoch | None = None
        self._step: _Step | None = None
        self._batch_open = False
        self._loops: dict[str, _Loop] = {}
        self._pending_epochs: deque[_Epoch] = deque()
        self._pending_loops: deque[_Loop] = deque()
        self._left_out: set[str] | None = None  # this rank's sensors on a card a lower rank counts (DDP)

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, listener: TimelineListener) -> None:
        if listener not in self.listeners:
            self.listeners.append(listener)

    def unsubscribe(self, listener: TimelineListener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def mark(self) -> Mark:
        """A mark now, for a callback's own window (e.g. across several steps); resolved like all others."""
        return self.meter.mark()

    @property
    def open_step_start(self) -> Mark | None:
        """The start mark of the optimizer step now running (the one its :class:`StepFigures` will carry as
        ``start``); None between steps. For a decision that needs the energy up to this step's start now."""
        return self._step.start if self._step is not None else None

    # ------------------------------------------------------------------ boundaries (training thread)
    def fit_started(self, trainer) -> None:
        if self.fit_start is None:
            self.fit_start = self.meter.mark()

    def train_started(self, trainer) -> None:
        """A fit resumed inside an epoch skips ``on_train_epoch_start``: open that epoch here."""
        check, self._on_train_start = self._on_train_start, None  # once, whichever callback reports first
        if check is not None:
            check(trainer)
        loop = trainer.fit_loop
        if self._epoch is None and (getattr(loop, "restarted_mid_epoch", False)
                                    or getattr(loop, "restarted_on_epoch_end", False)):
            self._open_epoch(trainer, resumed=True)

    def train_epoch_started(self, trainer) -> None:
        self._deliver(trainer)
        if self._epoch is None or self._epoch.epoch != trainer.current_epoch:
            self._open_epoch(trainer, resumed=False)

    def _open_epoch(self, trainer, resumed: bool) -> None:
        self.meter.clock.reanchor()
        self._epoch = _Epoch(trainer.current_epoch, self.meter.mark(), resumed)
        self._step = None
        if self._distributed:
            self.sampler.retain(self, self.sampler.clock() - RETAIN_MARGIN_S)

    def batch_started(self, trainer, batch_idx: int) -> None:
        if self._batch_open:
            return
        self._batch_open = True
        if self._step is None:
            self._step = _Step(trainer.current_epoch, self.meter.mark())

    def batch_ended(self, trainer, batch_idx: int) -> None:
        if not self._batch_open:
            return
        self._batch_open = False
        step = self._step
        step.batches += 1
        if trainer.accumulate_grad_batches > 1 and is_accumulating(trainer):
            return  # the optimizer steps at a later batch: the window stays open
        self._step = None
        log = should_log_step(trainer) or bool(trainer.fast_dev_run)
        end = self.meter.mark()
        self.meter.add_window(step.start, end, tag=None, info=(batches_that_stepped(trainer), step, log, end),
                              keep=True)
        if self._epoch is not None:
            self._epoch.steps += 1
        self._deliver(trainer)

    def train_epoch_ended(self, trainer) -> None:
        epoch = self._epoch
        if epoch is None or epoch.end is not None:
            return
        self._batch_open = False
        self._step = None
        epoch.end = self.meter.mark()
        epoch.step = epoch_end_log_step(trainer)  # where Lightning logs the epoch's own metrics
        self._epoch = None
        self._pending_epochs.append(epoch)
        if self._distributed:
            self._settle_epoch_across_ranks(trainer, epoch)
        self._deliver(trainer)

    def loop_started(self, trainer, kind: str) -> None:
        if trainer.sanity_checking or kind in self._loops:
            return
        fitting = _fitting(trainer)
        epoch = trainer.current_epoch
        step = batches_that_stepped(trainer) if fitting else trainer.global_step
        loop = self._loops[kind] = _Loop(kind, epoch, step, fitting, self.meter.mark())
        if self._distributed:
            self.sampler.retain(self, self.sampler.clock() - RETAIN_MARGIN_S)
        if fitting and self._epoch is not None:
            self._epoch.loops.append(loop)

    def loop_ended(self, trainer, kind: str) -> None:
        loop = self._loops.pop(kind, None)
        if loop is None:
            return
        loop.end = self.meter.mark()
        if self._epoch is not None and any(known is loop for known in self._epoch.loops):
            self._deliver(trainer)  # measured with its epoch
            return
        if self._distributed:
            self._settle_loop_across_ranks(trainer, loop)
        self._pending_loops.append(loop)
        if loop.fitting:
            self._deliver(trainer)
        else:
            self.flush(trainer)  # validate()/test()/predict(): nothing comes after to deliver it

    def fit_ended(self, trainer) -> None:
        if self.fit_end is None and self.fit_start is not None:
            if self._epoch is not None:  # stopped inside an epoch (max_steps, max_time): close it
                self.train_epoch_ended(trainer)
            self.fit_end = self.meter.mark()
            self.flush(trainer)

    @contextlib.contextmanager
    def extra(self, name: str) -> Iterator[None]:
        """A named sub-window for work a callback adds: excluded from step figures, reported apart."""
        start = self.meter.mark()
        try:
            yield
        finally:
            window = (name, start, self.meter.mark())
            if self._step is not None:
                self._step.extras.append(window)
            elif self._epoch is not None:
                self._epoch.extras.append(window)

    # ------------------------------------------------------------------ delivery
    def flush(self, trainer, timeout_s: float | None = None) -> None:
        """Wait (bounded) until every boundary placed so far is measured and deliver it all."""
        marks = [e.end for e in self._pending_epochs] + [loop.end for loop in self._pending_loops]
        for mark in marks + ([self.fit_end] if self.fit_end is not None else []):
            self.meter.wait(mark, timeout_s)
        self._deliver(trainer)

    def _deliver(self, trainer, epochs: bool = True) -> None:
        """Hand every measured step, loop and epoch to the listeners (cheap when nothing is new).

        Which epochs and loops are ready is read BEFORE the step results are drained: the meter publishes
        a window before any later mark resolves, so every step of a ready epoch is delivered first. An epoch
        whose end resolves while the steps are drained goes out before the first step of a later epoch.
        """
        if not (self.meter.results or self._pending_epochs or self._pending_loops):
            return  # the common case on the training thread: nothing new
        ready_epochs = sum(1 for _ in _takewhile(self._epoch_ready, self._pending_epochs)) if epochs else 0
        ready_loops = sum(1 for _ in _takewhile(self._loop_ready, self._pending_loops))
        results = self.meter.results
        while results:
            (step_number, step, log, end), gross = results[0]
            # The sampler may have resolved an epoch's end (and this later step) after the count above:
            # that epoch goes out first, so listeners always see an epoch before the next epoch's steps.
            while (epochs and self._pending_epochs and self._pending_epochs[0].epoch < step.epoch
                   and self._epoch_ready(self._pending_epochs[0])):
                self._emit_next_epoch(trainer)
                ready_epochs = max(0, ready_epochs - 1)
            if self._pending_epochs and self._pending_epochs[0].epoch < step.epoch:
                break  # its epoch is not settled yet: the step waits for it
            results.popleft()
            extras = {}
            for name, start, stop in step.extras:
                extras[name] = _plus(extras.get(name), measure(start, stop))
            net = _minus(gross, list(extras.values()))
            epoch = self._find_epoch(step.epoch)
            if epoch is not None:
                _add_into(epoch.steps_energy_J, net.energy_J)
                for name, m in extras.items():
                    _add_into(epoch.step_extras_J.setdefault(name, {}), m.energy_J)
            figures = StepFigures(step_number, step.epoch, step.batches, log, net, extras, step.start, end)
            for listener in list(self.listeners):
                listener.on_step_measured(trainer, figures)
        for _ in range(ready_epochs):
            self._emit_next_epoch(trainer)
        for _ in range(ready_loops):
            self._emit_loop(trainer, self._pending_loops.popleft())

    def _emit_next_epoch(self, trainer) -> None:
        epoch = self._pending_epochs.popleft()
        figures = epoch.figures or self._local_epoch_figures(epoch)
        for loop in epoch.loops:
            self._emit_loop(trainer, loop)
        self.epochs_measured.append(figures)
        for listener in list(self.listeners):
            listener.on_epoch_measured(trainer, figures)

    def _find_epoch(self, number: int) -> _Epoch | None:
        if self._epoch is not None and self._epoch.epoch == number:
            return self._epoch
        return next((e for e in self._pending_epochs if e.epoch == number), None)

    def _epoch_ready(self, epoch: _Epoch) -> bool:
        return epoch.figures is not None or (not self._distributed and epoch.end.resolved)

    @staticmethod
    def _loop_ready(loop: _Loop) -> bool:
        return loop.figures is not None or loop.end.resolved

    def _emit_loop(self, trainer, loop: _Loop) -> None:
        if loop.figures is None:
            loop.figures = self._local_loop_figures(loop)
        self.loops_measured.append(loop.figures)
        for listener in list(self.listeners):
            listener.on_loop_measured(trainer, loop.figures)

    # ------------------------------------------------------------------ single process: marks
    def _local_loop_figures(self, loop: _Loop) -> LoopFigures:
        m = measure(loop.start, loop.end)
        return LoopFigures(loop.kind, loop.epoch, loop.step, loop.fitting, dict(m.energy_J), m.duration_s,
                           m.start_s, m.end_s, tuple({"sensor": n, "rank": 0} for n in m.missing), m.extrapolated,
                           _bounds(loop.start, loop.end, m.energy_J))

    def _local_epoch_figures(self, epoch: _Epoch) -> EpochFigures:
        window = measure(epoch.start, epoch.end)
        loops = [self._local_loop_figures(loop) for loop in epoch.loops]
        for loop, figures in zip(epoch.loops, loops):
            loop.figures = figures
        energy = {n: j - sum(loop.energy_J.get(n, 0.0) for loop in loops) for n, j in window.energy_J.items()}
        duration = window.duration_s - sum(loop.duration_s for loop in loops)
        fit = measure(self.fit_start, epoch.end).energy_J if self.fit_start is not None else window.energy_J
        missing = tuple({"sensor": n, "rank": 0} for n in window.missing)
        bounds = _sum_dicts([_bounds(epoch.start, epoch.end, window.energy_J), *(loop.bounds_J for loop in loops)])
        return EpochFigures(epoch.epoch, epoch.step, energy, duration, tuple(loops), epoch.steps,
                            dict(epoch.steps_energy_J), self._epoch_extras(epoch), dict(fit), window.start_s,
                            window.end_s, missing, window.extrapolated, epoch.resumed_mid_epoch, bounds)

    @staticmethod
    def _epoch_extras(epoch: _Epoch) -> dict[str, dict[str, float]]:
        """The epoch's sub-windows (inside its steps and between them): name -> J per sensor."""
        extras = {name: dict(per_sensor) for name, per_sensor in epoch.step_extras_J.items()}
        for name, start, end in epoch.extras:
            _add_into(extras.setdefault(name, {}), measure(start, end).energy_J)
        return extras

    def _energy_of(self, mark: Mark, now: float) -> tuple[dict, float]:
        """(cumulative J per sensor, time s) at ``mark``: its own figures once resolved, else from the samples
        at hand (extrapolated past the latest; a device mark not yet reached counts as ``now``)."""
        if mark.resolved:
            return mark.energy, mark.t
        t = mark.t if mark.t is not None else now
        return self.sampler.energy_at(self.meter.sensor_names, t)[0], t

    def _provisional_epoch_figures(self, epoch: _Epoch, now: float) -> EpochFigures:
        """An ended epoch not yet covered by samples, from the samples at hand (its end extrapolated by at
        most the time since the latest sample; flagged ``extrapolated``). Marks are left untouched."""
        if epoch.figures is not None:
            return epoch.figures
        energy = functools.partial(self._energy_of, now=now)
        start_energy, start_s = energy(epoch.start)
        end_energy, end_s = energy(epoch.end)
        loops, loop_energy, loop_s = [], {}, 0.0
        for loop in epoch.loops:
            (a, a_s), (b, b_s) = energy(loop.start), energy(loop.end)
            part = _difference(a, b)
            loops.append(LoopFigures(loop.kind, loop.epoch, loop.step, True, part, b_s - a_s, a_s, b_s))
            loop_energy = _sum_dicts([loop_energy, part])
            loop_s += b_s - a_s
        train = {n: j - loop_energy.get(n, 0.0) for n, j in _difference(start_energy, end_energy).items()}
        fit = _difference(energy(self.fit_start)[0], end_energy) if self.fit_start is not None else {}
        return EpochFigures(epoch.epoch, epoch.step, train, end_s - start_s - loop_s, tuple(loops), epoch.steps,
                            dict(epoch.steps_energy_J), self._epoch_extras(epoch), fit, start_s, end_s, (),
                            not epoch.end.resolved, epoch.resumed_mid_epoch)

    # ------------------------------------------------------------------ DDP: one common interval
    def _settle_epoch_across_ranks(self, trainer, epoch: _Epoch) -> None:
        """Collective: measure the epoch over the ranks' common interval, on every rank, now."""
        self.meter.wait(epoch.end)  # this rank's marks and its step windows are resolved
        self._deliver(trainer, epochs=False)  # this epoch's steps count in its steps_J before it is settled
        local_bounds = [epoch.start.t, epoch.end.t] + [t for loop in epoch.loops for t in (loop.start.t, loop.end.t)]
        common = self._common_times(trainer, local_bounds)
        start_s, end_s = common[0], common[1]
        loop_bounds = list(zip(common[2::2], common[3::2]))
        names = self._counted_names(trainer)
        at = self._energies_at(names, [start_s, end_s, *[t for pair in loop_bounds for t in pair]])
        e_start, e_end = at[0], at[1]
        flagged = set(e_start[1]) | set(e_end[1])
        loop_energy = []
        for i in range(len(loop_bounds)):
            (a, fa), (b, fb) = at[2 + 2 * i], at[3 + 2 * i]
            flagged |= set(fa) | set(fb)
            loop_energy.append(_difference(a, b))
        window = _difference(e_start[0], e_end[0])
        train = {n: j - sum(le.get(n, 0.0) for le in loop_energy) for n, j in window.items()}
        fit = _difference(self.fit_start.energy, e_end[0]) if self.fit_start is not None else {}
        rank = trainer.global_rank
        left_out = self._left_out
        local = {
            "train": train, "loops": loop_energy, "steps": epoch.steps,
            "steps_J": _drop(epoch.steps_energy_J, left_out),
            "extras": {k: _drop(v, left_out) for k, v in self._epoch_extras(epoch).items()}, "fit_J": _drop(fit, left_out),
            "missing": [{"sensor": n, "rank": rank} for n in sorted(flagged | _missing_names(e_start[0], e_end[0]))],
        }
        gathered = _gather(trainer, local)
        loops = []
        for i, loop in enumerate(epoch.loops):
            a, b = loop_bounds[i]
            energy = _sum_dicts(g["loops"][i] for g in gathered)
            loop.figures = LoopFigures(loop.kind, loop.epoch, loop.step, True, energy, b - a, a, b,
                                       tuple(m for g in gathered for m in g["missing"]), bool(flagged))
            loops.append(loop.figures)
        epoch.figures = EpochFigures(
            epoch.epoch, epoch.step, _sum_dicts(g["train"] for g in gathered),
            (end_s - start_s) - sum(b - a for a, b in loop_bounds), tuple(loops),
            sum(g["steps"] for g in gathered), _sum_dicts(g["steps_J"] for g in gathered),
            {name: _sum_dicts(g["extras"].get(name, {}) for g in gathered)
             for name in sorted({name for g in gathered for name in g["extras"]})},
            _sum_dicts(g["fit_J"] for g in gathered), start_s, end_s,
            tuple(m for g in gathered for m in g["missing"]), bool(flagged), epoch.resumed_mid_epoch)
        self.sampler.retain(self, None)

    def _settle_loop_across_ranks(self, trainer, loop: _Loop) -> None:
        """Collective: a validation/test/predict loop over the ranks' common interval."""
        self.meter.wait(loop.end)
        start_s, end_s = self._common_times(trainer, [loop.start.t, loop.end.t])
        (a, fa), (b, fb) = self._energies_at(self._counted_names(trainer), [start_s, end_s])
        rank = trainer.global_rank
        flagged = set(fa) | set(fb) | _missing_names(a, b)
        gathered = _gather(trainer, {"energy": _difference(a, b),
                                     "missing": [{"sensor": n, "rank": rank} for n in sorted(flagged)]})
        loop.figures = LoopFigures(loop.kind, loop.epoch, loop.step, loop.fitting,
                                   _sum_dicts(g["energy"] for g in gathered), end_s - start_s, start_s, end_s,
                                   tuple(m for g in gathered for m in g["missing"]), bool(flagged))
        self.sampler.retain(self, None)

    def _counted_names(self, trainer) -> list[str]:
        """This rank's sensors that count in all-rank sums: two ranks reading one card (MPS, a mis-set
        ``CUDA_VISIBLE_DEVICES``) would count it twice, so the lowest rank keeps it (by the card's UUID).
        The first call is a collective (every rank settles the same first boundary); later ones are free."""
        if self._left_out is None:
            described = [_description(self.sampler.series[n].sensor) for n in self.meter.sensor_names
                         if n in self.sampler.series]
            skip = duplicate_device_sensors(_gather(trainer, described))
            self._left_out = {name for rank, name in skip if rank == trainer.global_rank}
        return [n for n in self.meter.sensor_names if n not in self._left_out]

    def _common_times(self, trainer, local: list[float]) -> list[float]:
        """Each boundary's time on this rank's clock as the latest rank reached it (collective)."""
        host, offset = socket.gethostname(), time.time() - time.perf_counter()
        gathered = _gather(trainer, (host, offset, local))
        common = list(local)
        for other_host, other_offset, times in gathered:
            shift = 0.0 if other_host == host else other_offset - offset
            common = [max(c, t + shift) for c, t in zip(common, times)]
        return common

    def _energies_at(self, names: list[str], times: list[float]):
        """Cumulative J per sensor at each time (waiting, bounded, until samples reach the latest)."""
        self.meter.wait_until_covered(max(times))
        return [self.sampler.energy_at(names, t) for t in times]

    def so_far(self, names: list[str], until: Mark | None = None) -> dict:
        """This rank's figures up to now, without waiting (for checkpoints): ``fit_J`` and ``duration_s``
        since fit start, for an open epoch ``open_epoch``, its ``open_train_J`` (validation so far
        excluded) and ``open_validation_J``, and ``pending_epochs`` (ended, not yet delivered). Past the
        latest samples (one sampling interval at most) energy is extrapolated from the last power.
        ``until``: a resolved mark to stop at instead of now (the fit's end)."""
        if self.fit_start is None:
            return {"fit_J": 0.0, "duration_s": 0.0, "pending_epochs": []}
        if until is not None and until.resolved:
            now, energy_now = until.t, until.energy
        else:
            now = self.sampler.clock()
            energy_now, _ = self.sampler.energy_at(names, now)
        fit_start_energy, fit_start_s = self._energy_of(self.fit_start, now)
        state = {"fit_J": _total(fit_start_energy, energy_now, names), "duration_s": now - fit_start_s,
                 "pending_epochs": [self._provisional_epoch_figures(e, now) for e in self._pending_epochs]}
        epoch = self._epoch
        if epoch is not None:
            start_energy, _ = self._energy_of(epoch.start, now)
            validation = 0.0
            for loop in epoch.loops:
                loop_start, _ = self._energy_of(loop.start, now)
                loop_end = self._energy_of(loop.end, now)[0] if loop.end is not None else energy_now
                validation += _total(loop_start, loop_end, names)
            state.update(open_epoch=epoch.epoch, open_validation_J=validation,
                         open_train_J=_total(start_energy, energy_now, names) - validation)
        return state

    def close(self) -> None:
        self.sampler.retain(self, None)
        self.listeners.clear()


# ---------------------------------------------------------------------- helpers
def should_log_step(trainer) -> bool:
    """Whether Lightning logs the training step that ends now: Lightning's own gate.

    This is ``trainer._logger_connector.should_update_logs`` (Lightning 2.6) for the fit loop, the only
    loop that can be active in ``on_train_batch_end``, without its generic active-loop lookup: that
    lookup compares ``RunningStage`` enums case-insensitively and costs ~20 us per call on a 2-vCPU EPYC,
    a third of the timeline's per-step cost. ``test_timeline.py`` checks that both agree at every step.
    """
    every_n = trainer.log_every_n_steps
    if every_n == 0:
        return False
    return (batches_that_stepped(trainer) + 1) % every_n == 0 or bool(trainer.should_stop)


def _is_distributed(trainer) -> bool:
    if trainer.world_size <= 1:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _gather(trainer, value: Any) -> list[Any]:
    from lightning_energy.measure import ranks as distributed

    return distributed.gather(trainer, value)


def _fitting(trainer) -> bool:
    from lightning.pytorch.trainer.states import TrainerFn

    return trainer.state.fn == TrainerFn.FITTING


def _difference(start: dict, end: dict) -> dict[str, float]:
    return {n: e - start[n] for n, e in end.items() if e is not None and start.get(n) is not None}


def _total(start: dict, end: dict, names: list[str]) -> float:
    return sum(end[n] - start[n] for n in names if end.get(n) is not None and start.get(n) is not None)


def _missing_names(start: dict, end: dict) -> set[str]:
    return {n for n, e in end.items() if e is None or start.get(n) is None}


def _description(sensor) -> dict:
    """``sensor.describe()``, or its name alone if that raises (a user's sensor): every rank must reach the
    collective that follows."""
    try:
        return dict(sensor.describe())
    except Exception:
        return {"name": sensor.name}


def _only(per_sensor: dict | None, names) -> dict | None:
    """``per_sensor`` (J or a bound per sensor name) restricted to ``names``; None stays None."""
    return None if per_sensor is None else {n: v for n, v in per_sensor.items() if n in names}


def _drop(per_sensor: dict[str, float], names) -> dict[str, float]:
    """``per_sensor`` without ``names``."""
    return {n: v for n, v in per_sensor.items() if not names or n not in names}


def _add_into(total: dict[str, float], more: dict[str, float]) -> None:
    """Add ``more`` (J per sensor) into ``total`` in place."""
    for name, joules in more.items():
        total[name] = total.get(name, 0.0) + joules


def _bounds(start: Mark, end: Mark, names) -> dict[str, float]:
    """The attribution bound (J) of the window between two resolved marks, per sensor of ``names``."""
    return {n: bound_between(start.bounds.get(n), end.bounds.get(n)) for n in names}


def _sum_dicts(dicts) -> dict[str, float]:
    total: dict[str, float] = {}
    for d in dicts:
        _add_into(total, d)
    return total


def _plus(a: Measurement | None, b: Measurement) -> Measurement:
    if a is None:
        return b
    energy = _sum_dicts([a.energy_J, b.energy_J])
    return Measurement(a.start_s, a.start_s + a.duration_s + b.duration_s, energy,
                       tuple(sorted(set(a.missing) | set(b.missing))), a.extrapolated or b.extrapolated)


def _minus(gross: Measurement, parts: list[Measurement]) -> Measurement:
    """``gross`` less the sub-windows inside it: energy per sensor and duration."""
    if not parts:
        return gross
    energy = {n: j - sum(p.energy_J.get(n, 0.0) for p in parts) for n, j in gross.energy_J.items()}
    duration = gross.duration_s - sum(p.duration_s for p in parts)
    return Measurement(gross.start_s, gross.start_s + duration, energy, gross.missing, gross.extrapolated)
