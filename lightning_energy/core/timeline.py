"""A run's one timeline: one mark per boundary, placed by explicit calls, and the windows every front end reads.

Boundaries: fit start and end, each training epoch's start and end, each optimizer step (from the start
of its first micro-batch to the end of the micro-batch that steps: gradient accumulation makes one step of
several), each validation, test and predict loop, and named sub-windows of work a component adds inside a
step (:meth:`Timeline.extra`: step figures exclude it and report it apart). A front end (the Trainer
callbacks, the Fabric monitor, the plain meter, the process monitor) calls ``fit_started()``,
``epoch_started(epoch)``, ``step_started(epoch)`` / ``step_ended(step)``, ``epoch_ended(step)``,
``loop_started(kind, ...)`` / ``loop_ended(kind)`` and ``fit_ended()``; a second call for a boundary
already placed changes nothing, so several components may report the same boundary.

Figures reach listeners on the calling (training) thread as soon as the samples cover them, without
waiting:

- :class:`~lightning_energy.core.figures.StepFigures` for every optimizer step (this rank's sensors);
- :class:`~lightning_energy.core.figures.LoopFigures` for every validation / test / predict loop (all ranks);
- :class:`~lightning_energy.core.figures.EpochFigures` for every training epoch, validation excluded (all ranks).

All-rank figures (epochs and loops) are measured over one common interval on every rank: each
boundary's time is the latest rank's (on one clock: ranks on one host share ``perf_counter``; across
hosts wall-clock offsets convert, which holds to the hosts' clock synchronisation). In a distributed run
(a :class:`~lightning_energy.core.collective.Collective` with an all-gather) they are settled at the
boundary itself, with two small collectives and a bounded wait; in a single process an epoch's figures
are delivered at the first boundary after its end is covered by samples (the epoch end costs one mark).
Nothing here reads a sensor, and nothing imports a training framework.
"""

from __future__ import annotations

import contextlib
import functools
from itertools import takewhile as _takewhile
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

from lightning_energy.core.collective import SINGLE_PROCESS, Collective
from lightning_energy.core.figures import (
    EpochFigures, LoopFigures, StepFigures, add_into, difference, minus, missing_names, plus, sum_per_sensor,
    total_between, window_bounds, without,
)
from lightning_energy.measure.meter import Mark, Meter, measure
from lightning_energy.measure.sampler import Sampler
from lightning_energy.measure.sensors.detect import duplicate_device_sensors
from lightning_energy.measure.sensors.base import described

LOOP_KINDS = ("val", "test", "predict")
RETAIN_MARGIN_S = 1.0  # points kept before a boundary whose common time is settled later (distributed)


class TimelineListener(Protocol):
    """What a timeline hands its figures to, on the calling thread; ``host`` is the timeline's host."""

    def on_step_measured(self, host, figures: StepFigures) -> None: ...
    def on_loop_measured(self, host, figures: LoopFigures) -> None: ...
    def on_epoch_measured(self, host, figures: EpochFigures) -> None: ...


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
    figures: EpochFigures | None = None  # set when settled across ranks (distributed)


@dataclass(eq=False)
class _Step:
    epoch: int
    start: Mark
    batches: int = 0
    extras: list[tuple[str, Mark, Mark]] = field(default_factory=list)


class Timeline:
    """Boundaries and windows of one run (built by its session; front ends place its boundaries).

    ``host``: what listeners receive as their first argument (the Trainer under Lightning, the Fabric
    object, the plain meter); ``collective``: this process's ranks (distributed runs settle all-rank
    figures at each epoch and loop end); ``on_train_start(host)``: called once per fit when training starts.
    """

    def __init__(self, meter: Meter, sampler: Sampler, collective: Collective = SINGLE_PROCESS, host: Any = None,
                 on_train_start=None) -> None:
        self.meter = meter
        self.sampler = sampler
        self.collective = collective
        self.host = host
        self._on_train_start = on_train_start
        self.listeners: list[TimelineListener] = []
        self.fit_start: Mark | None = None
        self.fit_end: Mark | None = None
        self.epochs_measured: list[EpochFigures] = []
        self.loops_measured: list[LoopFigures] = []
        self.steps_ended = 0  # optimizer steps this timeline placed
        self._distributed = collective.distributed
        self._epoch: _Epoch | None = None
        self._step: _Step | None = None
        self._batch_open = False
        self._loops: dict[str, _Loop] = {}
        self._pending_epochs: deque[_Epoch] = deque()
        self._pending_loops: deque[_Loop] = deque()
        self._left_out: set[str] | None = None  # this rank's sensors on a card a lower rank counts (distributed)

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, listener: TimelineListener) -> None:
        if listener not in self.listeners:
            self.listeners.append(listener)

    def unsubscribe(self, listener: TimelineListener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def mark(self) -> Mark:
        """A mark now, for a component's own window (e.g. across several steps); resolved like all others."""
        return self.meter.mark()

    @property
    def open_step_start(self) -> Mark | None:
        """The start mark of the optimizer step now running (the one its :class:`StepFigures` will carry as
        ``start``); None between steps. For a decision that needs the energy up to this step's start now."""
        return self._step.start if self._step is not None else None

    @property
    def open_epoch(self) -> int | None:
        """The number of the training epoch now open, else None."""
        return self._epoch.epoch if self._epoch is not None else None

    # ------------------------------------------------------------------ boundaries (training thread)
    def fit_started(self) -> None:
        """The run's start (the first call places it; a second fit of one run continues from it)."""
        if self.fit_start is None:
            self.fit_start = self.meter.mark()

    def train_started(self, resumed_epoch: int | None = None) -> None:
        """Training begins (once per fit). ``resumed_epoch``: a fit resumed inside that epoch, whose start
        boundary the front end never reports: it is opened here (figures flagged ``resumed_mid_epoch``)."""
        check, self._on_train_start = self._on_train_start, None  # once, whichever component reports first
        if check is not None:
            check(self.host)
        if self._epoch is None and resumed_epoch is not None:
            self._open_epoch(resumed_epoch, resumed=True)

    def epoch_started(self, epoch: int, start: Mark | None = None) -> None:
        """Training epoch ``epoch`` starts now, or at ``start`` (a mark placed earlier: the boundary before
        it); again the same number: nothing changes."""
        self._deliver()
        if self._epoch is None or self._epoch.epoch != epoch:
            self._open_epoch(epoch, resumed=False, start=start)

    def _open_epoch(self, number: int, resumed: bool, start: Mark | None = None) -> None:
        self.meter.clock.reanchor()
        self._epoch = _Epoch(number, start if start is not None else self.meter.mark(), resumed)
        self._step = None
        if self._distributed:
            self.sampler.retain(self, self.sampler.clock() - RETAIN_MARGIN_S)

    def step_started(self, epoch: int | None = None, start: Mark | None = None) -> None:
        """A micro-batch starts: the first of an optimizer step opens the step's window, now or at ``start``
        (a mark placed earlier: the boundary before it); ``epoch``: the open epoch's number when None, 0
        outside epochs."""
        if self._batch_open:
            return
        self._batch_open = True
        if self._step is None:
            if epoch is None:
                epoch = self._epoch.epoch if self._epoch is not None else 0
            self._step = _Step(epoch, start if start is not None else self.meter.mark())

    def step_ended(self, step: int | None = None, log: bool = True, accumulating: bool = False) -> Mark | None:
        """The micro-batch ends. ``accumulating``: the optimizer steps at a later micro-batch (the step's
        window stays open); else the step ends: ``step`` is the number its figures are logged at (None:
        the count of steps ended before it), ``log`` whether the front end logs them. The step's end mark
        (None: no step ended)."""
        if not self._batch_open:
            return None
        self._batch_open = False
        open_step = self._step
        open_step.batches += 1
        if accumulating:
            return None
        self._step = None
        end = self.meter.mark()
        number = self.steps_ended if step is None else step
        self.steps_ended += 1
        self.meter.add_window(open_step.start, end, tag=None, info=(number, open_step, log, end), keep=True)
        if self._epoch is not None:
            self._epoch.steps += 1
        self._deliver()
        return end

    def epoch_ended(self, log_step: int | None = None) -> Mark | None:
        """The open training epoch ends; ``log_step``: the step its figures are logged at (None: the last
        step ended in it, as Lightning logs an epoch's metrics). Its end mark (None: no epoch was open)."""
        epoch = self._epoch
        if epoch is None or epoch.end is not None:
            return None
        self._batch_open = False
        self._step = None
        epoch.end = self.meter.mark()
        epoch.step = max(self.steps_ended - 1, 0) if log_step is None else log_step
        self._epoch = None
        self._pending_epochs.append(epoch)
        if self._distributed:
            self._settle_epoch_across_ranks(epoch)
        self._deliver()
        return epoch.end

    def loop_started(self, kind: str, epoch: int | None = None, step: int | None = None,
                     fitting: bool = True) -> None:
        """A validation / test / predict loop starts (``kind``: ``"val"``, ``"test"``, ``"predict"``).
        ``fitting``: inside a fit (a validation loop counts in its epoch); ``epoch`` and ``step`` label its
        figures (None: the open epoch, the last step ended, as Lightning logs a fit's validation)."""
        if kind in self._loops:
            return
        if epoch is None:
            epoch = self._epoch.epoch if self._epoch is not None else 0
        step = max(self.steps_ended - 1, 0) if step is None else step
        loop = self._loops[kind] = _Loop(kind, epoch, step, fitting, self.meter.mark())
        if self._distributed:
            self.sampler.retain(self, self.sampler.clock() - RETAIN_MARGIN_S)
        if fitting and self._epoch is not None:
            self._epoch.loops.append(loop)

    def loop_ended(self, kind: str) -> Mark | None:
        """The loop of ``kind`` ends (collective in a distributed run unless it lies inside an epoch). Its
        end mark (None: no such loop was open)."""
        loop = self._loops.pop(kind, None)
        if loop is None:
            return None
        loop.end = self.meter.mark()
        if self._epoch is not None and any(known is loop for known in self._epoch.loops):
            self._deliver()  # measured with its epoch
            return loop.end
        if self._distributed:
            self._settle_loop_across_ranks(loop)
        self._pending_loops.append(loop)
        if loop.fitting:
            self._deliver()
        else:
            self.flush()  # a loop outside a fit: nothing comes after to deliver it
        return loop.end

    def fit_ended(self, open_epoch_log_step: int | None = None) -> None:
        """The run's end: an epoch still open (stopped inside it) ends here, logged at
        ``open_epoch_log_step``; waits (bounded) until everything is measured and delivers it."""
        if self.fit_end is None and self.fit_start is not None:
            if self._epoch is not None:
                self.epoch_ended(open_epoch_log_step)
            self.fit_end = self.meter.mark()
            self.flush()

    @contextlib.contextmanager
    def extra(self, name: str) -> Iterator[None]:
        """A named sub-window for work a component adds: excluded from step figures, reported apart."""
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
    def flush(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) until every boundary placed so far is measured and deliver it all."""
        marks = [e.end for e in self._pending_epochs] + [loop.end for loop in self._pending_loops]
        for mark in marks + ([self.fit_end] if self.fit_end is not None else []):
            self.meter.wait(mark, timeout_s)
        self._deliver()

    def _deliver(self, epochs: bool = True) -> None:
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
                self._emit_next_epoch()
                ready_epochs = max(0, ready_epochs - 1)
            if self._pending_epochs and self._pending_epochs[0].epoch < step.epoch:
                break  # its epoch is not settled yet: the step waits for it
            results.popleft()
            extras = {}
            for name, start, stop in step.extras:
                extras[name] = plus(extras.get(name), measure(start, stop))
            net = minus(gross, list(extras.values()))
            epoch = self._find_epoch(step.epoch)
            if epoch is not None:
                add_into(epoch.steps_energy_J, net.energy_J)
                for name, m in extras.items():
                    add_into(epoch.step_extras_J.setdefault(name, {}), m.energy_J)
            figures = StepFigures(step_number, step.epoch, step.batches, log, net, extras, step.start, end)
            for listener in list(self.listeners):
                listener.on_step_measured(self.host, figures)
        for _ in range(ready_epochs):
            self._emit_next_epoch()
        for _ in range(ready_loops):
            self._emit_loop(self._pending_loops.popleft())

    def _emit_next_epoch(self) -> None:
        epoch = self._pending_epochs.popleft()
        figures = epoch.figures or self._local_epoch_figures(epoch)
        for loop in epoch.loops:
            self._emit_loop(loop)
        self.epochs_measured.append(figures)
        for listener in list(self.listeners):
            listener.on_epoch_measured(self.host, figures)

    def _find_epoch(self, number: int) -> _Epoch | None:
        if self._epoch is not None and self._epoch.epoch == number:
            return self._epoch
        return next((e for e in self._pending_epochs if e.epoch == number), None)

    def _epoch_ready(self, epoch: _Epoch) -> bool:
        return epoch.figures is not None or (not self._distributed and epoch.end.resolved)

    @staticmethod
    def _loop_ready(loop: _Loop) -> bool:
        return loop.figures is not None or loop.end.resolved

    def _emit_loop(self, loop: _Loop) -> None:
        if loop.figures is None:
            loop.figures = self._local_loop_figures(loop)
        self.loops_measured.append(loop.figures)
        for listener in list(self.listeners):
            listener.on_loop_measured(self.host, loop.figures)

    # ------------------------------------------------------------------ single process: marks
    def _local_loop_figures(self, loop: _Loop) -> LoopFigures:
        m = measure(loop.start, loop.end)
        return LoopFigures(loop.kind, loop.epoch, loop.step, loop.fitting, dict(m.energy_J), m.duration_s,
                           m.start_s, m.end_s, tuple({"sensor": n, "rank": 0} for n in m.missing), m.extrapolated,
                           window_bounds(loop.start, loop.end, m.energy_J))

    def _local_epoch_figures(self, epoch: _Epoch) -> EpochFigures:
        window = measure(epoch.start, epoch.end)
        loops = [self._local_loop_figures(loop) for loop in epoch.loops]
        for loop, figures in zip(epoch.loops, loops):
            loop.figures = figures
        energy = {n: j - sum(loop.energy_J.get(n, 0.0) for loop in loops) for n, j in window.energy_J.items()}
        duration = window.duration_s - sum(loop.duration_s for loop in loops)
        fit = measure(self.fit_start, epoch.end).energy_J if self.fit_start is not None else window.energy_J
        missing = tuple({"sensor": n, "rank": 0} for n in window.missing)
        bounds = sum_per_sensor([window_bounds(epoch.start, epoch.end, window.energy_J), *(loop.bounds_J for loop in loops)])
        return EpochFigures(epoch.epoch, epoch.step, energy, duration, tuple(loops), epoch.steps,
                            dict(epoch.steps_energy_J), self._epoch_extras(epoch), dict(fit), window.start_s,
                            window.end_s, missing, window.extrapolated, epoch.resumed_mid_epoch, bounds)

    @staticmethod
    def _epoch_extras(epoch: _Epoch) -> dict[str, dict[str, float]]:
        """The epoch's sub-windows (inside its steps and between them): name -> J per sensor."""
        extras = {name: dict(per_sensor) for name, per_sensor in epoch.step_extras_J.items()}
        for name, start, end in epoch.extras:
            add_into(extras.setdefault(name, {}), measure(start, end).energy_J)
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
            part = difference(a, b)
            loops.append(LoopFigures(loop.kind, loop.epoch, loop.step, True, part, b_s - a_s, a_s, b_s))
            loop_energy = sum_per_sensor([loop_energy, part])
            loop_s += b_s - a_s
        train = {n: j - loop_energy.get(n, 0.0) for n, j in difference(start_energy, end_energy).items()}
        fit = difference(energy(self.fit_start)[0], end_energy) if self.fit_start is not None else {}
        return EpochFigures(epoch.epoch, epoch.step, train, end_s - start_s - loop_s, tuple(loops), epoch.steps,
                            dict(epoch.steps_energy_J), self._epoch_extras(epoch), fit, start_s, end_s, (),
                            not epoch.end.resolved, epoch.resumed_mid_epoch)

    # ------------------------------------------------------------------ distributed: one common interval
    def _settle_epoch_across_ranks(self, epoch: _Epoch) -> None:
        """Collective: measure the epoch over the ranks' common interval, on every rank, now."""
        self.meter.wait(epoch.end)  # this rank's marks and its step windows are resolved
        self._deliver(epochs=False)  # this epoch's steps count in its steps_J before it is settled
        local_bounds = [epoch.start.t, epoch.end.t] + [t for loop in epoch.loops for t in (loop.start.t, loop.end.t)]
        common = self._common_times(local_bounds)
        start_s, end_s = common[0], common[1]
        loop_bounds = list(zip(common[2::2], common[3::2]))
        names = self._counted_names()
        at = self._energies_at(names, [start_s, end_s, *[t for pair in loop_bounds for t in pair]])
        e_start, e_end = at[0], at[1]
        flagged = set(e_start[1]) | set(e_end[1])
        loop_energy = []
        for i in range(len(loop_bounds)):
            (a, fa), (b, fb) = at[2 + 2 * i], at[3 + 2 * i]
            flagged |= set(fa) | set(fb)
            loop_energy.append(difference(a, b))
        window = difference(e_start[0], e_end[0])
        train = {n: j - sum(le.get(n, 0.0) for le in loop_energy) for n, j in window.items()}
        fit = difference(self.fit_start.energy, e_end[0]) if self.fit_start is not None else {}
        rank = self.collective.rank
        left_out = self._left_out
        local = {
            "train": train, "loops": loop_energy, "steps": epoch.steps,
            "steps_J": without(epoch.steps_energy_J, left_out),
            "extras": {k: without(v, left_out) for k, v in self._epoch_extras(epoch).items()}, "fit_J": without(fit, left_out),
            "missing": [{"sensor": n, "rank": rank} for n in sorted(flagged | missing_names(e_start[0], e_end[0]))],
        }
        gathered = self.collective.gather(local)
        loops = []
        for i, loop in enumerate(epoch.loops):
            a, b = loop_bounds[i]
            energy = sum_per_sensor(g["loops"][i] for g in gathered)
            loop.figures = LoopFigures(loop.kind, loop.epoch, loop.step, True, energy, b - a, a, b,
                                       tuple(m for g in gathered for m in g["missing"]), bool(flagged))
            loops.append(loop.figures)
        epoch.figures = EpochFigures(
            epoch.epoch, epoch.step, sum_per_sensor(g["train"] for g in gathered),
            (end_s - start_s) - sum(b - a for a, b in loop_bounds), tuple(loops),
            sum(g["steps"] for g in gathered), sum_per_sensor(g["steps_J"] for g in gathered),
            {name: sum_per_sensor(g["extras"].get(name, {}) for g in gathered)
             for name in sorted({name for g in gathered for name in g["extras"]})},
            sum_per_sensor(g["fit_J"] for g in gathered), start_s, end_s,
            tuple(m for g in gathered for m in g["missing"]), bool(flagged), epoch.resumed_mid_epoch)
        self.sampler.retain(self, None)

    def _settle_loop_across_ranks(self, loop: _Loop) -> None:
        """Collective: a validation/test/predict loop over the ranks' common interval."""
        self.meter.wait(loop.end)
        start_s, end_s = self._common_times([loop.start.t, loop.end.t])
        (a, fa), (b, fb) = self._energies_at(self._counted_names(), [start_s, end_s])
        rank = self.collective.rank
        flagged = set(fa) | set(fb) | missing_names(a, b)
        gathered = self.collective.gather({"energy": difference(a, b),
                                           "missing": [{"sensor": n, "rank": rank} for n in sorted(flagged)]})
        loop.figures = LoopFigures(loop.kind, loop.epoch, loop.step, loop.fitting,
                                   sum_per_sensor(g["energy"] for g in gathered), end_s - start_s, start_s, end_s,
                                   tuple(m for g in gathered for m in g["missing"]), bool(flagged))
        self.sampler.retain(self, None)

    def _counted_names(self) -> list[str]:
        """This rank's sensors that count in all-rank sums: two ranks reading one card (MPS, a mis-set
        ``CUDA_VISIBLE_DEVICES``) would count it twice, so the lowest rank keeps it (by the card's UUID).
        The first call is a collective (every rank settles the same first boundary); later ones are free."""
        if self._left_out is None:
            descriptions = [described(self.sampler.series[n].sensor) for n in self.meter.sensor_names
                         if n in self.sampler.series]
            skip = duplicate_device_sensors(self.collective.gather(descriptions))
            self._left_out = {name for rank, name in skip if rank == self.collective.rank}
        return [n for n in self.meter.sensor_names if n not in self._left_out]

    def _common_times(self, local: list[float]) -> list[float]:
        """Each boundary's time on this rank's clock as the latest rank reached it (collective)."""
        host, offset = socket.gethostname(), time.time() - time.perf_counter()
        gathered = self.collective.gather((host, offset, local))
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
        state = {"fit_J": total_between(fit_start_energy, energy_now, names), "duration_s": now - fit_start_s,
                 "pending_epochs": [self._provisional_epoch_figures(e, now) for e in self._pending_epochs]}
        epoch = self._epoch
        if epoch is not None:
            start_energy, _ = self._energy_of(epoch.start, now)
            validation = 0.0
            for loop in epoch.loops:
                loop_start, _ = self._energy_of(loop.start, now)
                loop_end = self._energy_of(loop.end, now)[0] if loop.end is not None else energy_now
                validation += total_between(loop_start, loop_end, names)
            state.update(open_epoch=epoch.epoch, open_validation_J=validation,
                         open_train_J=total_between(start_energy, energy_now, names) - validation)
        return state

    def close(self) -> None:
        self.sampler.retain(self, None)
        self.listeners.clear()
