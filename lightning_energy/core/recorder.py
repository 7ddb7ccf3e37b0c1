"""What every front end does with its run's figures: epoch rows, loops, the trace and events files, sensor
failures warned once, the state a checkpoint keeps, and the end-of-run report.

A front end (the Trainer's ``EnergyCallback``, the Fabric monitor, the plain meter, the process monitor)
makes one :class:`RunRecorder` per run over its attachment to the run's session, hands it the figures the
timeline delivers, logs the metrics it returns in its own way, and calls :meth:`RunRecorder.finish` at the
run's end. Collective calls (every rank makes them, in the same order) are marked so.
"""

from __future__ import annotations

import math
import socket
import warnings
from pathlib import Path

from lightning_energy.core.collective import Collective
from lightning_energy.core.figures import EpochFigures, LoopFigures, StepFigures, window_bounds
from lightning_energy.core.metrics import epoch_metrics, loop_metrics, node_epoch_metrics, step_metrics
from lightning_energy.core.node import NodeLedger
from lightning_energy.core.run import Attachment
from lightning_energy.core.telemetry import TelemetryRecorder
from lightning_energy.io import try_atomic_write_json
from lightning_energy.measure import ranks
from lightning_energy.measure.meter import Mark, measure
from lightning_energy.filenames import REPORT_FILE
from lightning_energy.outputs.report import build_report, format_report
from lightning_energy.outputs.trace import TraceWriter


def epoch_row(figures: EpochFigures, resumed_total_J: float = 0.0, zeus_J: float | None = None) -> dict:
    """The report's row of one epoch (J, s, W; all ranks); ``total_J`` counts ``resumed_total_J`` before
    this run."""
    epoch_J, epoch_s = figures.total_J, figures.duration_s
    return {
        "epoch": figures.epoch, "train_J": epoch_J, "train_s": epoch_s, "power_W": figures.mean_power_W,
        "edp_Js": epoch_J * epoch_s, "steps": figures.steps, "steps_J": figures.steps_J,
        "between_steps_J": epoch_J - figures.steps_J, "validation_J": figures.validation_J,
        "per_sensor_J": dict(figures.energy_J), "total_J": resumed_total_J + figures.fit_J,
        # how far the samples let the attribution be off (J): the bound of series.window_bound_J, null
        # where not computed (distributed) or not finite (an extrapolated edge)
        "bound_J": figures.bound_J if math.isfinite(figures.bound_J) else None,
        **({"extras_J": dict(figures.extras_J)} if figures.extras_J else {}),
        **({"zeus_J": zeus_J} if zeus_J is not None else {}),
        **({"missing_sensors": list(figures.missing)} if figures.missing else {}),
        **({"extrapolated": True} if figures.extrapolated else {}),
        **({"resumed_mid_epoch": True} if figures.resumed_mid_epoch else {}),
    }


def trace_suffix(rank: int, run_number: int = 1) -> str:
    """The trace and events files' suffix: ``_rank<N>`` on ranks other than 0, ``_fit<N>`` for the N-th run
    of one front end (a second ``fit`` keeps the first's files)."""
    return ("" if rank == 0 else f"_rank{rank}") + (f"_fit{run_number}" if run_number > 1 else "")


class RunRecorder:
    """One run's records over ``attachment`` (its sensors, the session's sampler and timeline).

    ``collective``: the run's ranks (all-rank figures cover every rank's sensors of this recorder);
    ``log_dir``: where the trace and the report go; ``trace_suffix``: ``_rank<N>``, ``_fit<N>``;
    ``resumed``: the state a checkpoint kept (:meth:`cumulative_state`), continued from;
    ``warn(message)``: how this front end warns (default ``warnings.warn``); ``telemetry``: add each
    logged step's and each epoch's GPU telemetry means to the metrics (:mod:`lightning_energy.core.telemetry`).
    Collective: the constructor.
    """

    def __init__(self, attachment: Attachment, collective: Collective, log_dir, write_trace: bool = True,
                 trace_suffix: str = "", resumed: dict | None = None, warn=None, telemetry: bool = False) -> None:
        self.attachment = attachment
        self.collective = collective
        self.sampler = attachment.sampler
        self.log_dir = Path(log_dir)
        self.resumed = dict(resumed or {})
        self.warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))
        self.epochs: list[dict] = list(self.resumed.get("epochs", []))
        self.loops: list[LoopFigures] = []
        self.train_J = 0.0  # all ranks, this run's epochs and validation loops
        self.validation_J = 0.0
        self.samples_at_start = self.sampler.samples_taken
        self._failures_seen = attachment.session.failures_at_open  # earlier runs' failures are not ours
        self._warned_failures: set[str] = set()
        self.problem_sources: list = []  # more outputs whose ``problems`` the report lists (see output_problems)
        self._problems_warned = 0
        self.telemetry = TelemetryRecorder([]) if telemetry else None
        # the whole node (scope "node": a BMC): off the meter's marks, measured over the same windows by a ledger
        self.node_names = attachment.node_sensor_names
        self.ledger = NodeLedger(self.sampler, self.node_names) if self.node_names else None
        self._node_fit_start: Mark | None = None
        self._node_pending: list[tuple[dict, int, list]] = []  # (epoch row, its step, its node marks)
        self.node_epochs: dict[int, dict] = {}  # epoch -> this rank's node figures of its training part
        self._node_metrics: list[tuple[int, dict[str, float]]] = []  # (step, metrics) ready to log
        self.single_node = True  # every rank on this host (set by refresh_names)
        self.refresh_names()
        if self.telemetry is not None:
            self.sampler.add_listener(self.telemetry)
        self.trace: TraceWriter | None = None
        if write_trace:
            self.trace = TraceWriter(self.log_dir, self.names + self.node_names, trace_suffix, warn=False)
            self.sampler.add_listener(self.trace)
            self.sampler.await_coverage(self.names)  # the trace's first row comes before the fit's start mark

    @property
    def timeline(self):
        return self.attachment.timeline

    @property
    def resumed_total_J(self) -> float:
        return self.resumed.get("total_J", 0.0)

    def refresh_names(self) -> None:
        """This rank's sensor names and every rank's (the session may add sensors at train start). Collective."""
        self.names = self.attachment.sensor_names
        gathered = self.collective.gather((self.names, socket.gethostname()))
        self.all_names = sorted({n for names, _ in gathered for n in names})
        self.single_node = len({host for _, host in gathered}) == 1
        if self.telemetry is not None:
            self.telemetry.sensor_names = set(self.names)

    def event(self, name: str, t: float | None = None, epoch: int | None = None, step: int | None = None,
              mark: Mark | None = None) -> None:
        """A line in the events file (``t``: the sampler clock, s; None: now)."""
        if self.trace is not None:
            self.trace.event(name, self.sampler.clock() if t is None else t, epoch, step, mark)

    # ---------------------------------------------------------------- figures -> rows and metrics
    def step_metrics(self, figures: StepFigures) -> dict[str, float]:
        """A step's metrics over this rank's sensors, with the running total since the fit's start (and
        before it, when resumed, in a single process)."""
        fit_start = self.timeline.fit_start
        running_J = sum(figures.end.energy[n] - fit_start.energy[n] for n in self.names
                        if figures.end.energy.get(n) is not None and fit_start.energy.get(n) is not None)
        single = self.collective.world_size == 1
        if single:
            running_J += self.resumed_total_J
        metrics = step_metrics(figures, self.names, running_J, "energy/total_J" if single else "energy/rank0_total_J")
        if self.telemetry is not None:
            m = figures.measurement
            metrics.update(self.telemetry.metrics(m.start_s, m.end_s, "step", self._telemetry_prefix))
        return metrics

    @property
    def _telemetry_prefix(self) -> str:
        return f"rank{self.collective.rank}/" if self.collective.world_size > 1 else ""

    def loop_measured(self, figures: LoopFigures) -> tuple[LoopFigures, dict[str, float]]:
        """(the loop's figures over this recorder's sensors, its metrics)."""
        figures = figures.for_sensors(self.all_names)
        self.loops.append(figures)
        if figures.kind == "val":
            if figures.fitting:
                self.validation_J += figures.total_J
            self.event("validation_start", figures.start_s, epoch=figures.epoch)
            self.event("validation_end", figures.end_s, epoch=figures.epoch)
        return figures, loop_metrics(figures)

    def epoch_measured(self, figures: EpochFigures, zeus_J: float | None = None) -> tuple[dict, dict[str, float]]:
        """(the epoch's report row, its metrics) over this recorder's sensors."""
        figures = figures.for_sensors(self.all_names)
        self.train_J += figures.total_J
        row = epoch_row(figures, self.resumed_total_J, zeus_J)
        self.epochs.append(row)
        if self.ledger is not None:
            self._mark_node_epoch(figures, row)
        self.event("epoch_start", figures.start_s, epoch=figures.epoch)
        self.event("epoch_end", figures.end_s, epoch=figures.epoch)
        metrics = epoch_metrics(row)
        if self.telemetry is not None:  # every rank's devices (collective: ranks deliver an epoch together)
            validation = [(loop.start_s, loop.end_s) for loop in figures.validation]
            local = self.telemetry.metrics(figures.start_s, figures.end_s, "epoch", self._telemetry_prefix, validation)
            for part in self.collective.gather(local):
                metrics.update(part)
        return row, metrics

    # ---------------------------------------------------------------- the whole node
    def _ensure_node_fit_start(self) -> Mark | None:
        start = self.timeline.fit_start
        if self._node_fit_start is None and start is not None and start.t is not None:
            self._node_fit_start = self.ledger.at(start.t)
        return self._node_fit_start

    def _mark_node_epoch(self, figures: EpochFigures, row: dict) -> None:
        """Node marks at the epoch's (common) start and end and around its validation loops (no lock)."""
        self._ensure_node_fit_start()
        loops = sorted((loop.start_s, loop.end_s) for loop in figures.validation)
        marks = [self.ledger.at(figures.start_s)]
        for a, b in loops:
            marks += [self.ledger.at(a), self.ledger.at(b)]
        marks.append(self.ledger.at(figures.end_s))
        self._node_pending.append((row, figures.step, marks))
        self.settle_node_epochs()

    def settle_node_epochs(self) -> None:
        """Take the node figures of the epochs whose node marks resolved (in order; never waits): into
        :attr:`node_epochs` and, on rank zero of a single-node run, the metrics :meth:`node_metrics` hands out."""
        while self._node_pending and all(m.resolved for m in self._node_pending[0][2]):
            row, step, marks = self._node_pending.pop(0)
            whole = self.ledger.window(marks[0], marks[-1])
            loops = [self.ledger.window(a, b) for a, b in zip(marks[1:-1:2], marks[2:-1:2])]
            energy = {n: j - sum(loop["energy_J"].get(n, 0.0) for loop in loops) for n, j in whole["energy_J"].items()}
            missing = sorted(set(whole["missing"]).union(*(loop["missing"] for loop in loops)))
            figures = {"energy_J": energy, "missing": missing, "duration_s": row["train_s"]}
            self.node_epochs[row["epoch"]] = figures
            primary = self._primary_node_J(energy, missing)
            if primary is not None and self.collective.is_zero and self.single_node:
                self._node_metrics.append((step, node_epoch_metrics(primary, row["train_J"], row["train_s"])))

    def _primary_node_J(self, energy: dict[str, float], missing) -> float | None:
        """The node's figure: its first node sensor that covers the window (a second one is a cross-check)."""
        return next((energy[n] for n in self.node_names if n in energy and n not in missing), None)

    def node_metrics(self) -> list[tuple[int, dict[str, float]]]:
        """The node metrics ready to log, each with the step of its epoch (``energy/node/epoch_J``,
        ``energy/other/epoch_J``, ``power/node/epoch_W``: rank zero of a single-node run; a BMC's figures come
        one refresh after the epoch's end, so usually with the next epoch). Taken once."""
        if self.ledger is not None:
            self.settle_node_epochs()
        ready, self._node_metrics = self._node_metrics, []
        return ready

    def finish_node(self, end: Mark) -> Mark | None:
        """At the run's end (training thread): wait, bounded, for the node's samples to cover ``end``, and
        settle every epoch's node figures. The node mark at the end (None without node sensors)."""
        if self.ledger is None or end.t is None or self._ensure_node_fit_start() is None:
            return None
        node_end = self.ledger.at(end.t)
        self.ledger.wait(node_end)
        self.settle_node_epochs()
        return node_end

    def _node_summary(self, node_end: Mark | None) -> list[dict]:
        """This rank's node sensors over the run (energy J, mean W, bound J, failures)."""
        entries = []
        start = self._node_fit_start
        window = self.ledger.window(start, node_end) if node_end is not None and start is not None else None
        duration_s = node_end.t - start.t if window is not None else 0.0
        series = self.sampler.series
        for sensor in self.attachment.node_sensors:
            s = series.get(sensor.name)
            joules = window["energy_J"].get(sensor.name) if window is not None else None
            bound = window["bounds_J"].get(sensor.name) if window is not None else None
            missing_from_s = None
            if s is None or joules is None:
                missing_from_s = 0.0
            elif s.failure is not None and start is not None:
                missing_from_s = max((s.last_time_s if s.last_time_s is not None else start.t) - start.t, 0.0)
            entries.append({
                **sensor.describe(),
                "rank": self.collective.rank,
                "energy_J": joules,
                "mean_power_W": joules / duration_s if joules is not None and duration_s > 0 else None,
                "bound_J": bound if bound is not None and math.isfinite(bound) else None,
                # False: extrapolated past its last sample at the end, or frozen at a failure
                "covers_run": bool(window is not None and joules is not None and sensor.name not in window["missing"]),
                "failure": s.failure if s is not None else "not sampled",
                "missing_from_s": missing_from_s,
                "read_errors": self.sampler.read_error_counts.get(sensor.name, 0),
            })
        return entries

    # ---------------------------------------------------------------- failures
    def warn_failures(self) -> None:
        """Warn once per failed sensor of this recorder, and once per failed meter, clock, listener or
        sampling thread, on the rank where it failed."""
        failures = self.sampler.failures
        mine = set(self.names) | set(self.node_names)
        fit_start = self.timeline.fit_start
        rank = self.collective.rank
        for failure in list(failures)[self._failures_seen:]:
            if failure.name in self._warned_failures:
                continue
            if failure.name not in mine and failure.name not in self.sampler.series:
                self._warned_failures.add(failure.name)
                self.warn(f"lightning-energy: rank {rank}: {failure.name} failed ({failure.message}); "
                          "sampling goes on and the report counts such errors (sampling.errors).")
            elif failure.name in mine:
                self._warned_failures.add(failure.name)
                after_s = failure.t - fit_start.t if fit_start is not None and fit_start.t is not None else 0.0
                self.warn(f"lightning-energy: rank {rank}: sensor {failure.name!r} failed {after_s:.2f} s after fit "
                          f"start ({failure.message}); training goes on, its energy up to its last good sample "
                          "stays counted, later figures lack it and the report flags them.")
        self._failures_seen = len(failures)

    def has_new_failures(self) -> bool:
        return len(self.sampler.failures) > self._failures_seen

    # ---------------------------------------------------------------- resume
    def cumulative_state(self, until: Mark | None = None) -> dict:
        """Totals since the first fit over all ranks up to now or ``until``: total, train and validation J
        (the open epoch's training so far included), duration s (slowest rank), the epoch rows (those ended
        but not yet delivered estimated from the samples at hand, marked ``provisional``). Collective."""
        so_far = self.timeline.so_far(self.names, until)
        pending = [{**epoch_row(f.for_sensors(self.all_names), self.resumed_total_J), "provisional": True}
                   for f in so_far["pending_epochs"]]
        merged = ranks.merge(self.collective.gather({
            "total_J": so_far["fit_J"],
            "train_J": self.train_J + so_far.get("open_train_J", 0.0) + sum(r["train_J"] for r in pending),
            "validation_J": self.validation_J + so_far.get("open_validation_J", 0.0)
            + sum(r["validation_J"] for r in pending),
            "seconds": so_far["duration_s"],
        }))
        resumed = self.resumed
        state = {key: resumed.get(key, 0.0) + merged[key] for key in ("total_J", "train_J", "validation_J")}
        state["duration_s"] = resumed.get("duration_s", 0.0) + merged["seconds"]
        state["epochs"] = list(self.epochs) + pending
        if "open_epoch" in so_far:
            state["open_epoch"] = so_far["open_epoch"]
        return state

    # ---------------------------------------------------------------- the report
    def rank_summary(self, start: Mark, end: Mark, node_end: Mark | None = None) -> dict:
        """This rank's part of the report: each sensor's energy over ``start``..``end``, failures, shaping;
        its node sensors' (scope ``"node"``) up to ``node_end`` (see :meth:`finish_node`) apart, with their
        figures per epoch."""
        fit = measure(start, end)
        bounds = window_bounds(start, end, [sensor.name for sensor in self.attachment.sensors])
        sensors = []
        series = self.sampler.series
        for sensor in self.attachment.sensors:
            joules = fit.energy_J.get(sensor.name, 0.0)
            s = series.get(sensor.name)
            missing_from_s = None  # seconds after fit start from which the sensor's figures are missing
            if s is None:
                missing_from_s = 0.0
            elif s.failure is not None:
                missing_from_s = max((s.last_time_s if s.last_time_s is not None else fit.start_s) - fit.start_s, 0.0)
            sensors.append({
                **sensor.describe(),
                "rank": self.collective.rank,
                "energy_J": joules,
                "mean_power_W": joules / fit.duration_s if fit.duration_s > 0 else 0.0,
                # the attribution bound of the fit's window (J; None where not finite: a sensor that failed)
                "bound_J": bounds[sensor.name] if math.isfinite(bounds[sensor.name]) else None,
                "failure": s.failure if s is not None else "not sampled",
                "missing_from_s": missing_from_s,
                # counters with a power reading: whether the power readings shaped the steps' figures, or
                # why the plain counter rule was used (the card did not behave as its family's constants say)
                **({"attribution": s.shaping} if s is not None and s.shaping is not None else {}),
            })
        return {
            "rank": self.collective.rank,
            "local_rank": self.collective.local_rank,
            "node": socket.gethostname(),
            "duration_s": fit.duration_s,
            "train_J": self.train_J,
            "validation_J": self.validation_J,
            "sensors": sensors,
            **({"node_sensors": self._node_summary(node_end),
                "node_epochs": {str(epoch): figures for epoch, figures in self.node_epochs.items()}}
               if self.ledger is not None else {}),
        }

    def sampling_section(self) -> dict:
        """The report's ``sampling`` entry: interval (s), samples (the sampler's ticks since this recorder's
        set-up), the trace's rows and files, read errors, slow sensors, errors.

        The trace ends its rows here (:meth:`TraceWriter.end_rows`): ``trace_rows`` is the row count of the
        trace file (None without one, or when it failed), and every row is one of the ``samples`` (a tick
        that read nothing writes no row)."""
        sampler, names = self.sampler, self.names + self.node_names
        trace_rows = self.trace.end_rows() if self.trace is not None and not self.trace.failed else None
        return {
            "interval_s": sampler.interval_s,
            "samples": sampler.samples_taken - self.samples_at_start,
            "trace_rows": trace_rows,
            "trace_file": str(self.trace.trace_path) if self.trace else None,
            "events_file": str(self.trace.events_path) if self.trace else None,
            # transient read errors per sensor (within the error budget: the sensor stayed in), sensors read
            # on a thread of their own because their reads are slow (s per read), and errors of the meters,
            # clocks, listeners or sampling thread that sampling survived
            "read_errors": {n: c for n, c in sampler.read_error_counts.items() if n in names},
            "slow_sensors_s": {n: s for n, s in sampler.slow_sensors.items() if n in names},
            "errors": dict(sampler.error_counts),
        }

    def finish(self, end: Mark, notes: list[str], sections: dict | None = None,
               extra: dict | None = None) -> dict | None:
        """The report of the run from the fit's start to ``end`` (every rank's summary gathered: collective);
        on rank zero built and returned (else None). ``extra``: more top-level entries (e.g. ``command``)."""
        node_end = self.finish_node(end)  # this rank's node sensors (local rank 0): a bounded wait
        summaries = self.collective.gather(self.rank_summary(self.timeline.fit_start, end, node_end))
        if not self.collective.is_zero:
            return None
        report_extra = {
            "sampling": self.sampling_section(),
            "notes": list(notes),
            "figures_cover": list(self.all_names),
            "output_problems": self.output_problems,
            "sections": dict(sections or {}),
            **{f"resumed_{k}": v for k, v in self.resumed.items() if k != "epochs"},
            **(extra or {}),
        }
        return build_report(summaries, self.epochs, report_extra)

    def write_report(self, report: dict, verbose: bool, info=None) -> Path | None:
        """Write ``report`` atomically to the log dir and print its table (``verbose``) or one line through
        ``info(message)``; a full disk or a read-only log dir never fails the run: one warning, None."""
        problem = try_atomic_write_json(self.log_dir / REPORT_FILE, report)
        path = None if problem else self.log_dir / REPORT_FILE
        if problem:
            self.warn(f"lightning-energy: {problem}")
        if verbose:
            print(format_report(report) + f"\nreport: {path}", flush=True)
        elif info is not None:
            info(f"lightning-energy: report written to {path}")
        return path

    @property
    def output_problems(self) -> list[str]:
        """What failed in the outputs so far: the trace's problems and those of ``problem_sources`` (objects
        with a ``problems`` list, e.g. a front end's TensorBoard writer)."""
        return [line for source in (self.trace, *self.problem_sources) for line in getattr(source, "problems", [])]

    def warn_output_problems(self) -> None:
        """Warn (on the calling thread, once each) about outputs that failed: a full disk under the trace, a
        TensorBoard writer that cannot flush. Training goes on; the report lists them."""
        problems = self.output_problems
        for line in problems[self._problems_warned:]:
            self.warn(f"lightning-energy: rank {self.collective.rank}: {line}")
        self._problems_warned = len(problems)

    def close(self) -> Path | None:
        """Stop the trace (the path of the trace file, None without one)."""
        if self.telemetry is not None:
            self.sampler.remove_listener(self.telemetry)
        if self.ledger is not None:
            self.ledger.close()
        if self.trace is None:
            return None
        self.sampler.remove_listener(self.trace)
        self.trace.close()
        return self.trace.trace_path
