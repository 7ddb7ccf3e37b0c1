"""A run's energy for Prometheus: counters and gauges served over HTTP on each node, and pushed to a Pushgateway.

:class:`PrometheusExporter` is front-end neutral: the Trainer callback
(:class:`~lightning_energy.callbacks.prometheus.PrometheusCallback`), the plain ``EnergyMeter`` and the Fabric
``EnergyMonitor`` hand it their run's :class:`~lightning_energy.core.run.Attachment` with three calls::

    exporter.attach(attachment)   # the run starts (collective under DDP): subscribes to the run's timeline
    exporter.run_ended()          # after ``timeline.fit_ended()`` (collective): the final figures, the last push
    exporter.detach()             # the run is over: waits (bounded) for the last push; the endpoint stays up

Series (every one labelled ``rank``, ``node`` and ``job``; the sensor series also ``sensor``, ``scope`` and
``provenance``: ``measured``, ``estimated`` or ``simulated``):

- ``lightning_energy_joules_total`` (counter, J): the sensor's energy since this exporter's first run began,
  the runs' energies summed (each from its fit start). A component sensor's (scope ``device`` or ``host``)
  moves at each optimizer step's end (delivered a few steps after the step, when the samples cover it; a
  validation loop's energy arrives with the next step) and at the run's end, where it equals the report's
  figure for the sensor on that rank: after the first run, ``sum(lightning_energy_joules_total{scope!="node"})``
  is the report's ``total_J``. A sensor reading a card a lower rank (or another sensor) already reads is left
  out, as the report leaves it out of its total. A node sensor's (scope ``node``: a BMC, which contains the
  components, so never added to them) runs from the fit's start to its latest reading (a BMC refreshes every
  1-10 s) and stops at the latest reading when the run ends (the report's node figure is interpolated at the
  fit's end, so it may differ by up to one refresh).
- ``lightning_energy_bound_joules`` (gauge, J): how far a component sensor's counter can be off from its true
  energy (the attribution bound of ``series.bound_between``; ``+Inf`` where an edge was extrapolated).
- ``lightning_energy_power_watts`` (gauge, W): the sensor's latest power (read, or derived from its last two
  counter readings), while a run is measured; absent between runs.
- ``lightning_energy_steps_total``, ``lightning_energy_epochs_total`` (counters): optimizer steps and
  training epochs measured on the rank.

Figures come from what the core computed already: the step figures the timeline hands its listeners (their
resolved end marks hold cumulative J per sensor), the fit's end mark, and each sensor's latest power in the
sampler's series. A scrape computes the series on the HTTP server's thread; a push runs on a background
thread (:class:`~lightning_energy.outputs.worker.OutputWorker`). The training thread only keeps a reference
to the latest step's figures and, at epoch ends, queues a push; at the run's end it also takes each node
sensor's latest reading (and, where no scrape took it yet, its energy at the fit's start, under the sampler's
data lock, which is never held during a read); under DDP it joins one small all-gather per epoch end and at
the run's end (the boundaries where the timeline already gathers).

Serving (``port``): local rank 0 of each node serves ``http://<node>:<port>/metrics`` with the series of
its node's ranks (its own live; the other ranks' as of their last epoch end, gathered there). The endpoint
outlives the run, showing the final values, until :meth:`PrometheusExporter.close` or the process ends. A port
already in use costs one warning and the run goes on without the endpoint (pushes, if set, still go): a
training job is not stopped by its monitoring, and another port picked in its place would not be the one
Prometheus scrapes; ``port=0`` takes a free port (:attr:`PrometheusExporter.url`).

Pushing (``pushgateway``): for batch jobs, which may end before a scrape (Prometheus's "When to use the
Pushgateway": the outcome of a service-level batch job). At every epoch end and at the run's end, global
rank 0 replaces (HTTP PUT) one group keyed ``{job, **grouping_key}`` with the series of every rank, gathered
at those boundaries. One group per job, not per node or rank: the Pushgateway never forgets a group, so
groups keyed by node or rank would outlive the nodes a later run of the job lands on and add to its sums;
one group per job is replaced whole by the next run. The final push is kept, not deleted: it is the job's
outcome, which the Pushgateway exists to hold (it has, by design, no expiry); Prometheus scrapes it whenever
it next comes. Give runs that must stay side by side their own ``job`` or ``grouping_key``. A Pushgateway
that is down or refuses a push costs one warning (on the training thread, at the next boundary); later pushes
are still tried, and their failures counted in :attr:`PrometheusExporter.problems`.

Prometheus attaches its own ``job`` and ``instance`` labels to what it scrapes: keep ours with
``honor_labels: true`` in the scrape configs of the Pushgateway (as its documentation says for every
Pushgateway) and of the endpoints (else ours show as ``exported_job``).
"""

from __future__ import annotations

import math
import re
import socket
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

from lightning_energy.extras import check_installed
from lightning_energy.measure.sensors.detect import duplicate_device_sensors
from lightning_energy.measure.series import bound_between
from lightning_energy.measure.sensors.base import described

EXTRA = "prometheus"  # the pip extra that installs prometheus-client
DEFAULT_JOB = "lightning_energy"
DEFAULT_ADDRESS = "0.0.0.0"  # the endpoint listens on every interface: Prometheus scrapes from another host
DEFAULT_PUSH_TIMEOUT_S = 5.0  # one push's HTTP timeout; also the wait for the last push at the run's end
WARNING_PREFIX = "lightning-energy: "
SERVE_POLL_S = 0.05  # how often the endpoint's thread looks for close() (s): close() waits up to this long
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
SENSOR_LABELS = ("sensor", "scope", "rank", "node", "job", "provenance")
RANK_LABELS = ("rank", "node", "job")


@dataclass
class _Run:
    """One run's state: written by the training thread (each field replaced whole), read by the scrape and push
    threads."""

    attachment: Any
    left_out: frozenset  # this rank's sensors that another reading of the same card counts
    latest: Any = None  # the resolved end mark of the latest step measured, then the fit's end mark
    steps: int = 0
    epochs: int = 0
    ended: bool = False
    node_start: dict = field(default_factory=dict)  # node sensor -> its cumulative J at the fit's start
    node_final: dict = field(default_factory=dict)  # node sensor -> its J at the run's end (frozen)


@dataclass
class _Carried:
    """The finished runs' figures of one sensor of this rank (J), and its description."""

    scope: str
    provenance: str
    joules: float = 0.0
    bound_J: float | None = 0.0  # None: no bound (node sensors)


@dataclass
class RankSnapshot:
    """One rank's series at one moment (what ranks gather under DDP): per sensor ``(name, scope, provenance,
    joules J, bound J or None, power W or None)``; optimizer steps and epochs measured."""

    rank: int
    node: str
    sensors: list[tuple[str, str, str, float, float | None, float | None]] = field(default_factory=list)
    steps: int = 0
    epochs: int = 0


class PrometheusExporter:
    """Serve a run's energy to Prometheus on each node and push it to a Pushgateway (see the module docstring).

    Args:
        port: the TCP port local rank 0 of each node serves ``/metrics`` on (0: a free one; None: no endpoint).
        pushgateway: the Pushgateway's address (``http://host:9091`` or ``host:9091``); None: no pushes.
        address: the address the endpoint listens on (default every interface).
        job: the ``job`` label of every series and the Pushgateway group's job.
        grouping_key: more labels of the Pushgateway group (e.g. ``{"run": "lr0.1"}``), added to every pushed
            series by the Pushgateway.
        push_timeout_s: one push's HTTP timeout (s), and how long the run's end waits for its last push.

    At least one of ``port`` and ``pushgateway`` is needed. Needs ``prometheus-client`` (the ``prometheus``
    extra), checked here.
    """

    def __init__(self, port: int | None = None, pushgateway: str | None = None, *, address: str = DEFAULT_ADDRESS,
                 job: str = DEFAULT_JOB, grouping_key: dict[str, str] | None = None,
                 push_timeout_s: float = DEFAULT_PUSH_TIMEOUT_S) -> None:
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ValueError(f"`port` must be an int from 0 to 65535 (0: a free port) or None, got {port!r}")
        if pushgateway is not None and (not isinstance(pushgateway, str) or not pushgateway.strip()
                                        or any(c.isspace() for c in pushgateway)):
            raise ValueError(f"`pushgateway` must be an address like 'http://host:9091', got {pushgateway!r}")
        if port is None and pushgateway is None:
            raise ValueError("PrometheusExporter needs `port` (each node serves /metrics there) or `pushgateway` "
                             "(pushes at epoch and run ends), or both")
        if not isinstance(address, str) or not address:
            raise ValueError(f"`address` must be a host address like '0.0.0.0', got {address!r}")
        if not isinstance(job, str) or not job.strip():
            raise ValueError(f"`job` must be a non-empty string, got {job!r}")
        grouping_key = dict(grouping_key or {})
        for name, value in grouping_key.items():
            if not isinstance(name, str) or not _LABEL_NAME.match(name) or name.startswith("__") or name == "job":
                raise ValueError(f"`grouping_key` label names must match {_LABEL_NAME.pattern}, not start with "
                                 f"'__' and not be 'job' (give `job`), got {name!r}")
            if not isinstance(value, str) or not value:
                raise ValueError(f"`grouping_key` values must be non-empty strings, got {name}={value!r}")
        if isinstance(push_timeout_s, bool) or not isinstance(push_timeout_s, (int, float)) \
                or not 0 < push_timeout_s < math.inf:
            raise ValueError(f"`push_timeout_s` must be a positive number of seconds, got {push_timeout_s!r}")
        check_installed("prometheus_client", "PrometheusExporter", extra=EXTRA)
        self.port, self.pushgateway, self.address = port, pushgateway, address
        self.job, self.grouping_key, self.push_timeout_s = job, grouping_key, float(push_timeout_s)
        self.node = socket.gethostname()
        self.rank = 0
        self.pushes = 0  # pushes that reached the Pushgateway
        self._collective = None
        # (the run now measured or None, the finished runs' figures per sensor, their steps, their epochs): one
        # tuple replaced whole, so a scrape never sees a run's figures both carried and in its run
        self._state: tuple[_Run | None, dict[str, _Carried], int, int] = (None, {}, 0, 0)
        self._others: dict[int, RankSnapshot] = {}  # other ranks, as of the last gather (rank -> snapshot)
        self._server = None
        self._server_thread: threading.Thread | None = None
        self._worker = None
        self._log = None  # a ProblemLog, made at the first run (nothing unpicklable before it)
        self._warned = 0  # problems warned about

    # ---------------------------------------------------------------- the front end's calls (training thread)
    def attach(self, attachment) -> None:
        """The run of ``attachment`` (a :class:`~lightning_energy.core.run.Attachment`) starts: subscribe to its
        timeline and, on local rank 0, serve (once per exporter). Collective under DDP (one all-gather)."""
        if self._state[0] is not None:
            raise RuntimeError("PrometheusExporter is already attached to a run; one exporter serves one run "
                               "at a time (call detach() at the end of the first)")
        session = attachment.session
        collective = self._collective = session.collective
        self.rank = collective.rank
        descriptions = [described(s) for s in attachment.sensors]
        duplicates = duplicate_device_sensors(collective.gather(descriptions))
        left_out = frozenset(name for rank, name in duplicates if rank == collective.rank)
        if collective.local_rank == 0 and self.port is not None and self._server is None:
            self._serve()
        if self.pushgateway is not None and collective.is_zero:
            from lightning_energy.outputs.worker import OutputWorker

            self._worker = OutputWorker("lightning-energy-prometheus-push", max_pending=2, warn=False)
            self._worker.log = self._problem_log()  # its failures land beside the endpoint's, warned once per kind
            self._worker.submit(_nothing, what="start")  # its thread starts now, not at the first epoch's end
        _, carried, steps, epochs = self._state
        self._state = (_Run(attachment, left_out), carried, steps, epochs)
        attachment.timeline.subscribe(self)

    def run_ended(self) -> None:
        """The run's end (call after ``timeline.fit_ended()``): the counters take the fit's end mark (the
        report's figures), the ranks gather (collective under DDP), rank 0 queues the last push."""
        run = self._state[0]
        if run is None or run.ended:
            return
        end = run.attachment.timeline.fit_end
        if end is not None and end.resolved:
            run.latest = end
        for sensor in list(getattr(run.attachment, "node_sensors", ())):
            run.node_final[sensor.name] = self._node_joules(run, sensor.name)
        run.ended = True
        self._exchange()
        self._push()
        self._warn_new_problems()

    def detach(self) -> None:
        """The run is over: unsubscribe, fold its figures into the counters' totals, wait for the last push (at
        most ``push_timeout_s`` plus one second). The endpoint keeps serving the totals until :meth:`close`."""
        run = self._state[0]
        if run is None:
            return
        run.attachment.timeline.unsubscribe(self)
        _, old, steps, epochs = self._state
        carried = {name: _Carried(c.scope, c.provenance, c.joules, c.bound_J) for name, c in old.items()}
        for name, scope, provenance, joules, bound_J, _ in self._run_series(run):
            entry = carried.setdefault(name, _Carried(scope, provenance))
            entry.joules += joules
            entry.bound_J = _plus(entry.bound_J, bound_J)
        self._state = (None, carried, steps + run.steps, epochs + run.epochs)
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close(timeout_s=self.push_timeout_s + 1.0)
        self._warn_new_problems()

    def close(self) -> None:
        """Stop serving (the run, if one is attached, is detached first)."""
        self.detach()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            if self._server_thread is not None:
                self._server_thread.join(timeout=5.0)
        self._server_thread = None

    def __enter__(self) -> "PrometheusExporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- timeline listener (training thread)
    def on_step_measured(self, host, figures) -> None:
        run = self._state[0]
        if run is not None and not run.ended:
            run.latest = figures.end
            run.steps += 1

    def on_loop_measured(self, host, figures) -> None:
        """Loops count in the energy at the next step's end (the counters follow cumulative marks)."""

    def on_epoch_measured(self, host, figures) -> None:
        run = self._state[0]
        if run is None or run.ended:
            return
        run.epochs += 1
        self._exchange()
        self._push()
        self._warn_new_problems()

    # ---------------------------------------------------------------- what is served and pushed
    @property
    def url(self) -> str | None:
        """The endpoint's address (``http://<node>:<port>/metrics``) while serving, else None."""
        if self._server is None:
            return None
        return f"http://{self.node}:{self._server.server_port}/metrics"

    @property
    def serving_port(self) -> int | None:
        """The port served on (the free port taken for ``port=0``), None when not serving."""
        return None if self._server is None else self._server.server_port

    @property
    def pushes_pending(self) -> int:
        """Pushes queued or in flight (0 when not pushing)."""
        worker = self._worker
        return worker.pending() if worker is not None else 0

    def snapshot(self) -> RankSnapshot:
        """This rank's series now (thread-safe: any thread may call it)."""
        run, carried, carried_steps, carried_epochs = self._state
        series = {name: [c.scope, c.provenance, c.joules, c.bound_J, None] for name, c in carried.items()}
        if run is not None:
            for name, scope, provenance, joules, bound_J, power_W in self._run_series(run):
                entry = series.setdefault(name, [scope, provenance, 0.0, 0.0, None])
                entry[2] += joules
                entry[3] = _plus(entry[3], bound_J)
                entry[4] = power_W
        steps = carried_steps + (run.steps if run is not None else 0)
        epochs = carried_epochs + (run.epochs if run is not None else 0)
        return RankSnapshot(self.rank, self.node, [(n, *values) for n, values in sorted(series.items())],
                            steps, epochs)

    def node_snapshots(self) -> list[RankSnapshot]:
        """What this node's endpoint serves: this rank now, the node's other ranks as last gathered."""
        return [self.snapshot(), *(s for s in self._others_now() if s.node == self.node)]

    def all_snapshots(self) -> list[RankSnapshot]:
        """What rank 0 pushes: this rank now, every other rank as last gathered."""
        return [self.snapshot(), *self._others_now()]

    def _others_now(self) -> list[RankSnapshot]:
        others = self._others
        return [others[rank] for rank in sorted(others) if rank != self.rank]

    def _run_series(self, run: _Run):
        """(name, scope, provenance, J since the fit's start, bound J or None, power W or None) per sensor of
        ``run``: its component sensors from the marks, then its node sensors from their series."""
        start = run.attachment.timeline.fit_start
        latest = run.latest
        start_energy = dict(start.energy) if start is not None and start.resolved else {}
        end_energy = dict(latest.energy) if latest is not None else {}
        for sensor in list(run.attachment.sensors):
            name = sensor.name
            if name in run.left_out:
                continue
            a, b = start_energy.get(name), end_energy.get(name)
            if a is None or b is None:
                joules, bound_J = 0.0, 0.0
            else:
                joules, bound_J = b - a, bound_between(start.bounds.get(name), latest.bounds.get(name))
            yield name, sensor.scope, sensor.provenance, joules, bound_J, self._power(run, name)
        for sensor in list(getattr(run.attachment, "node_sensors", ())):
            yield sensor.name, sensor.scope, sensor.provenance, self._node_joules(run, sensor.name), None, \
                self._power(run, sensor.name)

    @staticmethod
    def _power(run: _Run, name: str) -> float | None:
        """The sensor's latest power (W) while the run is measured, else None."""
        if run.ended:
            return None
        s = run.attachment.sampler.series.get(name)
        power = getattr(s, "power_w", math.nan) if s is not None and s.live else math.nan
        return float(power) if math.isfinite(power) else None

    @staticmethod
    def _node_joules(run: _Run, name: str) -> float:
        """A node sensor's energy (J) from the fit's start to its latest reading (a BMC refreshes every 1-10 s;
        node sensors are off the marks), frozen at the run's end; 0 until its samples cover the fit's start."""
        if name in run.node_final:
            return run.node_final[name]
        start = run.attachment.timeline.fit_start
        if name not in run.node_start:
            s = run.attachment.sampler.series.get(name)
            if start is None or start.t is None or s is None or not s.covers(start.t):
                return 0.0
            energy, extrapolated = run.attachment.sampler.energy_at([name], start.t)  # the data lock, briefly
            if energy.get(name) is None or extrapolated:
                return 0.0
            run.node_start[name] = energy[name]
        s = run.attachment.sampler.series.get(name)
        last = s.last_energy_J if s is not None else None
        return max(last - run.node_start[name], 0.0) if last is not None else 0.0

    def _exchange(self) -> None:
        """Under DDP: every rank's snapshot to every rank (collective: all ranks call it at the same boundary)."""
        collective = self._collective
        if collective is None or not collective.distributed:
            return
        gathered = collective.gather(self.snapshot())
        self._others = {s.rank: s for s in gathered if s.rank != self.rank}

    # ---------------------------------------------------------------- the endpoint
    def _serve(self) -> None:
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
        from socketserver import ThreadingMixIn

        from prometheus_client import CollectorRegistry, make_wsgi_app

        class Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True

        class QuietHandler(WSGIRequestHandler):
            def log_message(self, format, *args) -> None:  # no line per scrape on stderr
                pass

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, self.node_snapshots))
        try:
            server = make_server(self.address, self.port, make_wsgi_app(registry), Server, QuietHandler)
        except OSError as err:
            line = (f"Prometheus endpoint not started: cannot listen on {self.address}:{self.port} ({err.strerror or err}); "
                    "training goes on without it" + (" (pushes to the Pushgateway still go)" if self.pushgateway else "")
                    + ". Give another `port`, or port=0 for a free one.")
            self._problem_log().record("endpoint", line, warn=False)
            self._warn_new_problems()
            return
        self._server = server
        self._server_thread = threading.Thread(target=server.serve_forever, args=(SERVE_POLL_S,),
                                               name="lightning-energy-prometheus", daemon=True)
        self._server_thread.start()

    # ---------------------------------------------------------------- the Pushgateway
    def _push(self) -> None:
        """Rank 0: queue a push of every rank's series (a pending push is replaced by this one)."""
        if self._worker is not None:
            self._worker.submit(self._push_now, what=f"push to the Pushgateway at {self.pushgateway}", key="push")

    def _push_now(self) -> None:
        """On the worker thread: replace the job's group with the series now."""
        from prometheus_client import CollectorRegistry, push_to_gateway

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, self.all_snapshots))
        push_to_gateway(self.pushgateway, job=self.job, registry=registry, grouping_key=self.grouping_key,
                        timeout=self.push_timeout_s)
        self.pushes += 1

    # ---------------------------------------------------------------- problems: one warning per kind
    @property
    def problems(self) -> list[str]:
        """One line per kind of problem (the endpoint, the pushes), with a count where it repeated."""
        return list(self._log.problems) if self._log is not None else []

    def _problem_log(self):
        if self._log is None:
            from lightning_energy.outputs.worker import ProblemLog

            self._log = ProblemLog(warn=False)
        return self._log

    def _warn_new_problems(self) -> None:
        """Warn, on the calling thread, once per kind of problem (a kind's later failures are only counted)."""
        lines = self.problems
        for line in lines[self._warned:]:
            warnings.warn(f"{WARNING_PREFIX}{line}" + ("" if "training goes on" in line else "; training goes on"),
                          UserWarning, stacklevel=3)
        self._warned = max(self._warned, len(lines))


class _Collector:
    """A prometheus-client collector of the snapshots ``source()`` returns, computed at each collect."""

    def __init__(self, exporter: PrometheusExporter, source) -> None:
        self.exporter, self.source = exporter, source

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        job = self.exporter.job
        joules = CounterMetricFamily(
            "lightning_energy_joules", "Energy (J) of the sensor on the rank since the exporter's first run began, "
            "each run from its fit start; at a run's end the report's figure.", labels=SENSOR_LABELS)
        bound = GaugeMetricFamily(
            "lightning_energy_bound_joules", "How far lightning_energy_joules_total can be off from the sensor's "
            "true energy (J; +Inf: an edge extrapolated).", labels=SENSOR_LABELS)
        power = GaugeMetricFamily(
            "lightning_energy_power_watts", "The sensor's latest power (W) while a run is measured.",
            labels=SENSOR_LABELS)
        steps = CounterMetricFamily("lightning_energy_steps", "Optimizer steps measured on the rank.",
                                    labels=RANK_LABELS)
        epochs = CounterMetricFamily("lightning_energy_epochs", "Training epochs measured on the rank.",
                                     labels=RANK_LABELS)
        for snapshot in self.source():
            rank = str(snapshot.rank)
            for name, scope, provenance, joules_J, bound_J, power_W in snapshot.sensors:
                labels = [name, scope, rank, snapshot.node, job, provenance]
                joules.add_metric(labels, joules_J)
                if bound_J is not None:
                    bound.add_metric(labels, bound_J)
                if power_W is not None:
                    power.add_metric(labels, power_W)
            steps.add_metric([rank, snapshot.node, job], snapshot.steps)
            epochs.add_metric([rank, snapshot.node, job], snapshot.epochs)
        return [joules, bound, power, steps, epochs]


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _nothing() -> None:
    return None
