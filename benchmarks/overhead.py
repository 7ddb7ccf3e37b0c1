"""Training-thread overhead of ``EnergyCallback``, side by side with CodeCarbon and Zeus.

A small MLP whose Lightning training step takes about 5 ms on one CPU thread is trained with each
configuration below, interleaved within every repetition (the order rotates from one repetition to
the next), so that all configurations see the same drift of a noisy machine:

- ``plain``       no energy measurement (the reference);
- ``energy``      ``EnergyCallback(verbose=False)``, otherwise defaults (auto-detected sensors);
- ``sampler``     the same callback with its per-step hooks removed: the shared sampling thread runs as
                  in ``energy`` (default rate, same sensors, trace writer) but nothing of ours runs on the
                  training thread per step, so ``sampler``/``plain`` is the thread's cost and
                  ``energy``/``sampler`` the hooks' cost;
- ``codecarbon``  CodeCarbon's ``OfflineEmissionsTracker(measure_power_secs=1)`` around the fit;
- ``zeus``        one Zeus ``ZeusMonitor`` window per step (``begin_window``/``end_window``), monitoring
                  the devices Zeus finds (GPUs, readable RAPL packages);
- ``cluster``     ``energy`` with every cluster part on (issue 28): two node sensors (a Redfish BMC, the test
                  suite's DMTF-schema server on 127.0.0.1 over HTTP, and IPMI DCMI through the suite's fake
                  ``ipmitool``, each read at most once a second on a thread of its own) and a
                  ``PrometheusCallback`` serving on a free port. (The shared-card detection needs NVML: it runs on
                  the sampling thread where a GPU is, not here.)

Step time is measured from inside the loop: a timing callback placed first records the time between
consecutive ``on_train_batch_start`` calls, so set-up and tear-down (trainer construction, report
writing, figures) are excluded. Per fit we keep the median step time over the steps after warm-up;
per configuration we quote the median over repetitions, and the ratio to ``plain`` is the median of
the per-repetition ratios (each computed from fits run next to each other). The same timer also reads
the training thread's CPU time and the process's CPU time, whose ratios are less sensitive to other
processes on a shared machine (the load average at start and end is recorded for that reason).

The per-step hooks of ``EnergyCallback`` (and of the Zeus callback) are wrapped with
``time.perf_counter_ns()`` to give the callback's own time on the training thread per step. That time
excludes the cost that the background sampling thread imposes on the training thread (GIL, cache,
a shared core): that cost shows only in the step-time ratio.

Goals (from the issues): step-time ratio ``energy``/``plain`` <= 1.01; callback time <= 50 us per step.

A second part trains ``--epochs`` epochs of ONE batch each (Baler's CFD example has one batch per epoch),
``plain`` and ``energy`` interleaved, and reports the fit's wall-time ratio (goal <= 1.1) and the time of
``EnergyCallback``'s ``on_train_epoch_end`` on the training thread (goal <= 2 ms, median): epoch figures
are delivered once the samples cover them, without waiting, and the power figure is drawn off the thread.
When either goal is not met (``--profile auto``), one extra fit profiles the callback's hooks with cProfile.

A third part (``--front-end-reps``) trains the same model on the same batches with hand-written loops, plain
PyTorch and Lightning Fabric, each bare and with our front end (``EnergyMeter`` / ``EnergyMonitor(fabric)``,
default sensors, a TensorBoard writer, logging every 50 steps as the Trainer does), interleaved, and reports
each front end's own time in ``step()`` per step beside the Trainer callback's hook time (goal: no more).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py [--reps 5] [--steps 400]``.
Writes ``benchmarks/results/overhead.json`` (raw per-repetition numbers, medians, ratios, goals, machine).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one CPU thread, set before torch is imported
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import datetime as dt  # noqa: E402
import io  # noqa: E402
import logging  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from torch import nn  # noqa: E402

from lightning_energy import EnergyCallback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported: benchmarks/machine.py
TESTS = Path(__file__).resolve().parent.parent / "tests"  # the cluster configuration's BMC and fake ipmitool
import machine  # noqa: E402
from machine import write_json_atomic  # noqa: E402

torch.set_num_threads(1)
with contextlib.suppress(RuntimeError):  # fails if inter-op work already started
    torch.set_num_interop_threads(1)

# --- the workload: about 5 ms per Lightning training step on one thread of the 2-core test machine ---
IN_FEATURES = 256
WIDTH = 512
DEPTH = 3  # hidden layers
CLASSES = 10
BATCH = 56
DISTINCT_BATCHES = 16  # pre-built batches, reused in turn: the data path costs nothing
WARMUP_STEPS = 25  # steps per fit left out of the step-time statistics

GOAL_RATIO = 1.01  # energy / plain median step time
GOAL_CALLBACK_US = 50.0  # EnergyCallback's own time on the training thread, us per step
GOAL_EPOCH_RATIO = 1.1  # one-batch epochs: wall time with EnergyCallback / without
GOAL_EPOCH_END_US = 2000.0  # EnergyCallback's on_train_epoch_end on the training thread, us (median)
CONFIGS = ("plain", "energy", "sampler", "codecarbon", "zeus", "cluster")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overhead.json"

ZEUS_NOTE = ("ZeusMonitor found no GPU or readable RAPL counter here, so it reads no device: the zeus row "
             "measures the window bookkeeping cost only")


# ------------------------------------------------------------------------------------------ model
class TinyMLP(LightningModule):
    """An MLP classifier on random features; logs its loss every step."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(IN_FEATURES, WIDTH), nn.ReLU()]
        for _ in range(DEPTH - 1):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        layers.append(nn.Linear(WIDTH, CLASSES))
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Batches:
    """Pre-built in-memory batches served in turn (a single iterable: Lightning reads a bare list as a
    collection of loaders)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def make_batches(steps: int, seed: int = 0) -> Batches:
    """``steps`` in-memory batches (``DISTINCT_BATCHES`` distinct ones, reused), one epoch of the fit."""
    g = torch.Generator().manual_seed(seed)
    distinct = [(torch.randn(BATCH, IN_FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
                for _ in range(DISTINCT_BATCHES)]
    return Batches([distinct[i % DISTINCT_BATCHES] for i in range(steps)])


# ------------------------------------------------------------------------------------------ timing
class StepTimer(Callback):
    """Clocks read at each ``on_train_batch_start`` (ns); put it first in the callback list.

    Three clocks: wall time (``perf_counter``), the training thread's CPU time (``thread_time``: not
    inflated while other processes hold the core, though on a VM it still absorbs steal and cache
    contention) and the process's CPU time (``process_time``: all threads, so it includes the work of
    background sampling threads).
    """

    def __init__(self) -> None:
        self.marks: list[tuple[int, int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.marks.append((time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()))

    def step_times_s(self, warmup: int) -> list[float]:
        """Wall time of each step in s, the first ``warmup`` steps left out."""
        ns = [m[0] for m in self.marks]
        return [(b - a) * 1e-9 for a, b in zip(ns[warmup:], ns[warmup + 1:])]

    def cpu_ms_per_step(self, warmup: int) -> dict[str, float]:
        """Mean CPU time per step in ms after warm-up: ``thread`` (training thread), ``process`` (all threads)."""
        first, last = self.marks[warmup], self.marks[-1]
        steps = len(self.marks) - 1 - warmup
        return {"thread": (last[1] - first[1]) * 1e-6 / steps, "process": (last[2] - first[2]) * 1e-6 / steps}


class HookTimer:
    """Mixin: the time spent in the wrapped class's per-step hooks, summed per step (ns).

    Two clocks: wall time (``perf_counter_ns``, the cost to the training thread, but inflated whenever
    the OS preempts the thread inside a hook) and the thread's CPU time (``thread_time_ns``, which is not,
    but includes a few us of its own clock reads: a system call each).
    Optionally runs a ``cProfile.Profile`` inside the hooks only (``profiler``).
    """

    profiler: cProfile.Profile | None = None

    def _hook_timer_init(self) -> None:
        self.hook_ns_per_step: list[int] = []
        self.hook_cpu_ns_per_step: list[int] = []
        self._start_ns = self._start_cpu_ns = 0

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        prof = self.profiler
        if prof is not None:
            prof.enable()
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        super().on_train_batch_start(*args, **kwargs)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        self._start_ns, self._start_cpu_ns = t1 - t0, c1 - c0
        if prof is not None:
            prof.disable()

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        prof = self.profiler
        if prof is not None:
            prof.enable()
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        super().on_train_batch_end(*args, **kwargs)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        self.hook_ns_per_step.append(self._start_ns + t1 - t0)
        self.hook_cpu_ns_per_step.append(self._start_cpu_ns + c1 - c0)
        if prof is not None:
            prof.disable()

    def hook_us_per_step(self, warmup: int) -> dict[str, float]:
        """Hook time in us per step after warm-up: wall ``mean`` (amortised, includes the periodic
        logging steps), ``median`` and ``max``; ``cpu_mean``: the thread's CPU time, amortised."""
        us = [ns * 1e-3 for ns in self.hook_ns_per_step[warmup:]]
        cpu = [ns * 1e-3 for ns in self.hook_cpu_ns_per_step[warmup:]]
        return {"mean": statistics.fmean(us), "median": statistics.median(us), "max": max(us),
                "cpu_mean": statistics.fmean(cpu)}


class TimedEnergyCallback(HookTimer, EnergyCallback):
    """``EnergyCallback`` with its per-step hooks timed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hook_timer_init()


def _no_boundary(self, *args: Any, **kwargs: Any) -> None:
    """A hook that does nothing, not even report the step boundary to the timeline."""


_no_boundary._reports_boundary = True  # keeps MeteredCallback from wrapping it with the timeline's boundary


class SamplerOnlyEnergyCallback(EnergyCallback):
    """``EnergyCallback`` without per-step hooks: its sampling thread runs, the training thread does nothing
    of ours per step (no step boundaries placed, as with Lightning's no-op hooks)."""

    on_train_batch_start = _no_boundary
    on_train_batch_end = _no_boundary


class ZeusWindowPerStep(Callback):
    """One Zeus ``ZeusMonitor`` window per training step (``sync_execution=False``)."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.monitor.begin_window("step", sync_execution=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.monitor.end_window("step", sync_execution=False)


class TimedZeusWindowPerStep(HookTimer, ZeusWindowPerStep):
    """The Zeus per-step window callback with its hooks timed."""

    def __init__(self, monitor: Any) -> None:
        super().__init__(monitor)
        self._hook_timer_init()


# ------------------------------------------------------------------------------------------ comparisons
def import_quietly(import_fn: Callable[[], Any]) -> Any:
    """Run ``import_fn`` with stdout captured (amdsmi prints two lines when ROCm is absent)."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_fn()


def load_codecarbon() -> Any | None:
    """CodeCarbon's ``OfflineEmissionsTracker`` class, or None if codecarbon is not installed."""
    def _import():
        from codecarbon import OfflineEmissionsTracker
        return OfflineEmissionsTracker
    try:
        cls = import_quietly(_import)
    except ImportError:
        return None
    for name in ("codecarbon", "apscheduler"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return cls


def load_zeus() -> Any | None:
    """Zeus's ``ZeusMonitor`` class, or None if zeus is not installed."""
    def _import():
        from zeus.monitor import ZeusMonitor
        return ZeusMonitor
    try:
        cls = import_quietly(_import)
    except ImportError:
        return None
    logging.getLogger("zeus").setLevel(logging.ERROR)
    return cls


class ClusterParts:
    """The node sensors' servers for the ``cluster`` configuration: the test suite's Redfish BMC and fake
    ``ipmitool`` (tests/fake_bmc.py, tests/fake_ipmitool), started once."""

    def __init__(self) -> None:
        import json

        sys.path.insert(0, str(TESTS))
        from fake_bmc import FakeBmc

        self.bmc = FakeBmc(password="overhead-bench")
        self.folder = Path(tempfile.mkdtemp(prefix="le_overhead_ipmi_"))
        state = self.folder / "state.json"
        state.write_text(json.dumps({"instantaneous": 412, "average": 398, "minimum": 20, "maximum": 640,
                                     "period_s": 5, "state": "activated", "fail": None}))
        os.environ["FAKE_IPMITOOL_STATE"] = str(state)
        os.environ["FAKE_IPMITOOL_LOG"] = str(self.folder / "calls.jsonl")

    def node_sensors(self) -> list:
        from lightning_energy import Credentials, DcmiPowerSensor, RedfishPowerSensor

        return [RedfishPowerSensor(self.bmc.url, Credentials("admin", "overhead-bench"), insecure=True),
                DcmiPowerSensor(ipmitool=str(TESTS / "fake_ipmitool"))]


def load_cluster() -> Any | None:
    """The cluster parts, or None where the Prometheus extra is not installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return None
    return ClusterParts()


# ------------------------------------------------------------------------------------------ one fit
def fit_once(config: str, steps: int, batches: Batches, tools: dict[str, Any],
             profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """Train a fresh model for ``steps`` steps under ``config``; step times in s, hook time in us/step."""
    torch.manual_seed(0)
    model = TinyMLP()
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    hooked: HookTimer | None = None
    tracker = None
    zeus_devices = None
    if config == "energy":
        hooked = TimedEnergyCallback(verbose=False)
    elif config == "sampler":
        callbacks.append(SamplerOnlyEnergyCallback(verbose=False))
    elif config == "zeus":
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            monitor = tools["zeus"]()  # every GPU and readable RAPL package Zeus finds
        zeus_devices = {"gpu_indices": list(monitor.gpu_indices), "cpu_indices": list(monitor.cpu_indices)}
        hooked = TimedZeusWindowPerStep(monitor)
    elif config == "cluster":
        from lightning_energy import PrometheusCallback

        hooked = TimedEnergyCallback(verbose=False, extra_sensors=tools["cluster"].node_sensors())
        exporter = PrometheusCallback(port=0)
        callbacks.append(exporter)
    elif config == "codecarbon":
        tracker = tools["codecarbon"](country_iso_code="FRA", measure_power_secs=1, save_to_file=False,
                                      log_level="error")
    elif config != "plain":
        raise ValueError(f"unknown configuration {config!r}")
    if config != "cluster":
        exporter = None
    if hooked is not None:
        hooked.profiler = profiler
        callbacks.append(hooked)
    with tempfile.TemporaryDirectory(prefix="le_overhead_") as tmp:
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=steps, max_epochs=1,
            logger=TensorBoardLogger(tmp, name="bench"), callbacks=callbacks,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            log_every_n_steps=50, num_sanity_val_steps=0,
        )
        if tracker is not None:
            tracker.start()
        try:
            trainer.fit(model, train_dataloaders=batches)
        finally:
            if tracker is not None:
                tracker.stop()
            if exporter is not None:
                exporter.exporter.close()
    result: dict[str, Any] = {"step_s": timer.step_times_s(WARMUP_STEPS), "cpu_ms": timer.cpu_ms_per_step(WARMUP_STEPS)}
    if hooked is not None:
        result["hook_us"] = hooked.hook_us_per_step(WARMUP_STEPS)
    if zeus_devices is not None:
        result["zeus_devices"] = zeus_devices
    return result


# ------------------------------------------------------------------------------------------ front ends
FRONT_ENDS = ("plain_loop", "plain_meter", "fabric_loop", "fabric_monitor")
LOG_EVERY_N_STEPS = 50  # the Trainer's log_every_n_steps in fit_once: the loops log as often


def loop_once(front_end: str, steps: int, batches: Batches) -> dict[str, Any]:
    """The same model and batches as ``fit_once``, trained by a hand-written loop (plain PyTorch, or under
    Lightning Fabric), bare or with our front end (``EnergyMeter`` / ``EnergyMonitor(fabric)``, default
    sensors, a TensorBoard writer, logging every ``LOG_EVERY_N_STEPS`` steps as the Trainer does). Step
    times in s between consecutive steps' starts; the front end's own time in ``step()``, us per step."""
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger
    from torch.utils.tensorboard import SummaryWriter

    from lightning_energy import EnergyMeter, EnergyMonitor

    torch.manual_seed(0)
    net = TinyMLP().net
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    with tempfile.TemporaryDirectory(prefix="le_overhead_loop_") as tmp:
        fabric = meter = writer = None
        if front_end.startswith("fabric"):
            fabric = Fabric(accelerator="cpu", devices=1, loggers=FabricTensorBoardLogger(tmp, name="bench"))
            net, optimizer = fabric.setup(net, optimizer)
        if front_end == "plain_meter":
            writer = SummaryWriter(tmp)
            meter = EnergyMeter(log_dir=tmp, writer=writer, verbose=False).start()
        elif front_end == "fabric_monitor":
            meter = EnergyMonitor(fabric, verbose=False).start()
        marks, own_ns, own_cpu_ns = [], [], []
        for i, (x, y) in enumerate(batches):
            marks.append(time.perf_counter_ns())
            loss = nn.functional.cross_entropy(net(x), y)
            optimizer.zero_grad()
            if fabric is not None:
                fabric.backward(loss)
            else:
                loss.backward()
            optimizer.step()
            if meter is not None:
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                meter.step(log=(i + 1) % LOG_EVERY_N_STEPS == 0)
                t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                own_ns.append(t1 - t0)
                own_cpu_ns.append(c1 - c0)
        marks.append(time.perf_counter_ns())
        if meter is not None:
            meter.stop()
        if writer is not None:
            writer.close()
    steps_s = [(b - a) * 1e-9 for a, b in zip(marks[WARMUP_STEPS:], marks[WARMUP_STEPS + 1:])]
    result: dict[str, Any] = {"median_step_ms": statistics.median(steps_s) * 1e3}
    if own_ns:
        us = [ns * 1e-3 for ns in own_ns[WARMUP_STEPS:]]
        result["front_end_us_per_step"] = {"mean": statistics.fmean(us), "median": statistics.median(us),
                                           "cpu_mean": statistics.fmean(ns * 1e-3 for ns in own_cpu_ns[WARMUP_STEPS:])}
    return result


def run_front_end_benchmark(reps: int, steps: int) -> dict[str, Any]:
    """Each front end's own time on the training thread per step, interleaved (rotated order) with its bare
    loop; per front end the medians over repetitions, and the step-time ratio to the bare loop of the same
    repetition."""
    batches = make_batches(steps)
    for front_end in FRONT_ENDS:  # warm-up round, not recorded
        loop_once(front_end, 2 * WARMUP_STEPS + 10, Batches(batches.batches[:2 * WARMUP_STEPS + 10]))
    raw: dict[str, list[dict[str, Any]]] = {f: [] for f in FRONT_ENDS}
    for rep in range(reps):
        for front_end in rotated(list(FRONT_ENDS), rep):
            raw[front_end].append({"rep": rep, **loop_once(front_end, steps, batches)})
        print(f"  rep {rep + 1}/{reps}: " + ", ".join(
            f"{f} {raw[f][-1].get('front_end_us_per_step', {}).get('mean', 0.0):.1f} us"
            for f in ("plain_meter", "fabric_monitor")), flush=True)
    summary = {}
    for front_end, bare in (("plain_meter", "plain_loop"), ("fabric_monitor", "fabric_loop")):
        entries, base = raw[front_end], {e["rep"]: e for e in raw[bare]}
        summary[front_end] = {
            "us_per_step_mean": statistics.median(e["front_end_us_per_step"]["mean"] for e in entries),
            "us_per_step_median": statistics.median(e["front_end_us_per_step"]["median"] for e in entries),
            "cpu_us_per_step_mean": statistics.median(e["front_end_us_per_step"]["cpu_mean"] for e in entries),
            "step_ratio_vs_bare_loop": statistics.median(e["median_step_ms"] / base[e["rep"]]["median_step_ms"]
                                                         for e in entries),
            "bare_loop_median_step_ms": statistics.median(e["median_step_ms"] for e in raw[bare]),
        }
    return {"raw": raw, "summary": summary}


def format_front_end_table(front_ends: dict[str, Any], trainer: dict[str, Any]) -> str:
    rows = [("Trainer + EnergyCallback (hooks)", trainer["callback_us_per_step"],
             trainer["callback_us_per_step_median_step"], trainer["callback_cpu_us_per_step"],
             trainer["ratio_vs_plain"], "Trainer, no callback")]
    for name, label, bare in (("plain_meter", "plain loop + EnergyMeter.step()", "plain loop"),
                              ("fabric_monitor", "Fabric loop + EnergyMonitor.step()", "Fabric loop")):
        s = front_ends["summary"][name]
        rows.append((label, s["us_per_step_mean"], s["us_per_step_median"], s["cpu_us_per_step_mean"],
                     s["step_ratio_vs_bare_loop"], bare))
    lines = [f"{'front end':<36} {'us/step':>8} {'(median)':>9} {'(CPU)':>7} {'step ratio':>11}  vs",
             "-" * 90]
    lines += [f"{a:<36} {b:>8.1f} {c:>9.1f} {d:>7.1f} {e:>11.4f}  {f}" for a, b, c, d, e, f in rows]
    lines.append("any process (lightning-energy monitor)       0: nothing of ours runs in the measured process")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the run
def rotated(configs: list[str], rep: int) -> list[str]:
    """The configuration order of repetition ``rep``: rotated by one each repetition."""
    k = rep % len(configs)
    return configs[k:] + configs[:k]


def run_benchmark(reps: int, steps: int, configs: list[str], tools: dict[str, Any]) -> dict[str, Any]:
    """Interleaved fits; per config and repetition: median/mean step time (ms) and hook time (us/step)."""
    batches = make_batches(steps)
    for config in configs:  # warm-up round, not recorded: lazy imports, allocator, caches
        fit_once(config, 2 * WARMUP_STEPS + 10, Batches(batches.batches[:2 * WARMUP_STEPS + 10]), tools)
    raw: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(reps):
        order = rotated(configs, rep)
        line = []
        for config in order:
            r = fit_once(config, steps, batches, tools)
            entry = {
                "rep": rep,
                "position": order.index(config),
                "median_step_ms": statistics.median(r["step_s"]) * 1e3,
                "mean_step_ms": statistics.fmean(r["step_s"]) * 1e3,
                "thread_cpu_ms_per_step": r["cpu_ms"]["thread"],
                "process_cpu_ms_per_step": r["cpu_ms"]["process"],
                "steps_timed": len(r["step_s"]),
            }
            if "hook_us" in r:
                entry["hook_us_per_step"] = r["hook_us"]
            if "zeus_devices" in r:
                entry["zeus_devices"] = r["zeus_devices"]
            raw[config].append(entry)
            line.append(f"{config} {entry['median_step_ms']:.3f}")
        print(f"  rep {rep + 1}/{reps}: " + ", ".join(line) + " (median ms/step)", flush=True)
    return raw


def summarise(raw: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per config: medians over repetitions of step time and CPU time (ms), of the per-rep ratios to
    plain (each from fits of the same repetition) and of the hook time (us/step)."""
    plain = {e["rep"]: e for e in raw["plain"]}

    def ratios(entries: list[dict[str, Any]], key: str) -> list[float]:
        return [e[key] / plain[e["rep"]][key] for e in entries]

    summary = {}
    for config, entries in raw.items():
        s: dict[str, Any] = {
            "reps": len(entries),
            "median_step_ms": statistics.median(e["median_step_ms"] for e in entries),
            "mean_step_ms": statistics.median(e["mean_step_ms"] for e in entries),
            "thread_cpu_ms_per_step": statistics.median(e["thread_cpu_ms_per_step"] for e in entries),
            "process_cpu_ms_per_step": statistics.median(e["process_cpu_ms_per_step"] for e in entries),
            "ratio_vs_plain": statistics.median(ratios(entries, "median_step_ms")),
            "ratio_vs_plain_per_rep": ratios(entries, "median_step_ms"),
            "mean_ratio_vs_plain": statistics.median(ratios(entries, "mean_step_ms")),
            "thread_cpu_ratio_vs_plain": statistics.median(ratios(entries, "thread_cpu_ms_per_step")),
            "process_cpu_ratio_vs_plain": statistics.median(ratios(entries, "process_cpu_ms_per_step")),
        }
        if entries and "hook_us_per_step" in entries[0]:
            s["callback_us_per_step"] = statistics.median(e["hook_us_per_step"]["mean"] for e in entries)
            s["callback_us_per_step_median_step"] = statistics.median(e["hook_us_per_step"]["median"]
                                                                      for e in entries)
            s["callback_cpu_us_per_step"] = statistics.median(e["hook_us_per_step"]["cpu_mean"] for e in entries)
        summary[config] = s
    if "sampler" in raw and "energy" in raw:  # the hooks' share: energy vs the thread alone, per repetition
        sampler = {e["rep"]: e for e in raw["sampler"]}
        summary["energy"]["ratio_vs_sampler"] = statistics.median(
            e["median_step_ms"] / sampler[e["rep"]]["median_step_ms"] for e in raw["energy"])
    if "cluster" in raw and "energy" in raw:  # every cluster part on vs EnergyCallback alone, per repetition
        energy = {e["rep"]: e for e in raw["energy"]}
        for key, name in (("median_step_ms", "ratio_vs_energy"), ("thread_cpu_ms_per_step", "thread_cpu_ratio_vs_energy")):
            summary["cluster"][name] = statistics.median(e[key] / energy[e["rep"]][key] for e in raw["cluster"])
    return summary


def attribution(summary: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Where ``energy``'s step-time overhead comes from: the sampling thread (``sampler`` vs ``plain``) or
    the per-step hooks (``energy`` vs ``sampler``); None without the ``sampler`` configuration."""
    if "sampler" not in summary:
        return None
    return {"sampler_thread_ratio_vs_plain": summary["sampler"]["ratio_vs_plain"],
            "hooks_ratio_vs_sampler": summary["energy"]["ratio_vs_sampler"],
            "energy_ratio_vs_plain": summary["energy"]["ratio_vs_plain"]}


def profile_energy_hooks(steps: int, tools: dict[str, Any], top: int = 25) -> str:
    """cProfile of ``EnergyCallback``'s per-step hooks only (one extra fit); the top functions as text."""
    profiler = cProfile.Profile()
    fit_once("energy", steps, make_batches(steps), tools, profiler=profiler)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# ------------------------------------------------------------------------------------------ one-batch epochs
class EpochHookTimer(TimedEnergyCallback):
    """``EnergyCallback`` with every hook's training-thread time summed per epoch (ns): the epoch end
    (``on_train_epoch_end``, where figures used to be waited for and drawn) and all hooks of the epoch."""

    def _hook_timer_init(self) -> None:
        super()._hook_timer_init()
        self.epoch_end_ns: list[int] = []
        self.epoch_hooks_ns: list[int] = []
        self._epoch_ns = 0

    def on_train_epoch_start(self, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter_ns()
        super().on_train_epoch_start(*args, **kwargs)
        self._epoch_ns = time.perf_counter_ns() - t0

    def on_train_epoch_end(self, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter_ns()
        super().on_train_epoch_end(*args, **kwargs)
        end_ns = time.perf_counter_ns() - t0
        steps_ns = self.hook_ns_per_step[-1] if self.hook_ns_per_step else 0
        self.epoch_end_ns.append(end_ns)
        self.epoch_hooks_ns.append(self._epoch_ns + steps_ns + end_ns)


def fit_one_batch_epochs(config: str, epochs: int, batches: Batches) -> dict[str, Any]:
    """``epochs`` epochs of one batch each (Baler's CFD example: 60 frames, one batch): wall time of the fit
    loop (s) and, with EnergyCallback, its hooks' time per epoch (us)."""
    torch.manual_seed(0)
    model = TinyMLP()
    callbacks: list[Callback] = []
    timed = None
    if config == "energy":
        timed = EpochHookTimer(verbose=False)
        callbacks.append(timed)
    with tempfile.TemporaryDirectory(prefix="le_epochs_") as tmp:
        trainer = Trainer(
            accelerator="cpu", devices=1, max_epochs=epochs, logger=TensorBoardLogger(tmp, name="bench"),
            callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, log_every_n_steps=50, num_sanity_val_steps=0,
        )
        started = time.perf_counter()
        trainer.fit(model, train_dataloaders=batches)
        wall_s = time.perf_counter() - started
    result: dict[str, Any] = {"wall_s": wall_s}
    if timed is not None:
        end_us = [ns * 1e-3 for ns in timed.epoch_end_ns[WARMUP_STEPS:]]
        all_us = [ns * 1e-3 for ns in timed.epoch_hooks_ns[WARMUP_STEPS:]]
        result.update(epoch_end_us_median=statistics.median(end_us), epoch_end_us_max=max(end_us),
                      epoch_end_us_mean=statistics.fmean(end_us), epoch_hooks_us_mean=statistics.fmean(all_us))
    return result


def run_epoch_benchmark(reps: int, epochs: int) -> dict[str, Any]:
    """``plain`` and ``energy`` one-batch-epoch fits interleaved (order alternating); medians and ratios."""
    batches = make_batches(1)
    raw: dict[str, list[dict[str, Any]]] = {"plain": [], "energy": []}
    for rep in range(reps):
        for config in rotated(["plain", "energy"], rep):
            raw[config].append(fit_one_batch_epochs(config, epochs, batches))
            print(f"  one-batch epochs rep {rep + 1}/{reps} {config:<7} {raw[config][-1]['wall_s']:.2f} s", flush=True)
    ratios = [e["wall_s"] / p["wall_s"] for p, e in zip(raw["plain"], raw["energy"])]
    energy = raw["energy"]
    return {
        "epochs": epochs, "reps": reps,
        "plain_wall_s_median": statistics.median(r["wall_s"] for r in raw["plain"]),
        "energy_wall_s_median": statistics.median(r["wall_s"] for r in energy),
        "wall_ratio_median": statistics.median(ratios),
        "epoch_end_us_median": statistics.median(r["epoch_end_us_median"] for r in energy),
        "epoch_end_us_max": max(r["epoch_end_us_max"] for r in energy),
        "epoch_hooks_us_mean": statistics.median(r["epoch_hooks_us_mean"] for r in energy),
        "raw": raw,
    }


def format_epoch_table(e: dict[str, Any]) -> str:
    return "\n".join([
        f"one-batch epochs: {e['epochs']} epochs x {e['reps']} reps (plain and energy interleaved)",
        f"{'config':<8} {'median wall s':>13} {'ratio':>7} {'epoch end us (median)':>21} {'(max)':>9} "
        f"{'all hooks us/epoch':>18}",
        f"{'plain':<8} {e['plain_wall_s_median']:>13.2f} {1.0:>7.3f}",
        f"{'energy':<8} {e['energy_wall_s_median']:>13.2f} {e['wall_ratio_median']:>7.3f} "
        f"{e['epoch_end_us_median']:>21.1f} {e['epoch_end_us_max']:>9.1f} {e['epoch_hooks_us_mean']:>18.1f}",
    ])


# ------------------------------------------------------------------------------------------ output
def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """The console table: medians over repetitions."""
    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    head = (f"{'config':<11} {'median step ms':>14} {'ratio vs plain':>14} {'mean-step ratio':>15} "
            f"{'thread-CPU ratio':>16} {'process-CPU ratio':>17} {'callback us/step':>16} "
            f"{'(median step)':>13} {'(CPU)':>6} {'reps':>4}")
    rows = [head, "-" * len(head)]
    for config, s in summary.items():
        rows.append(f"{config:<11} {s['median_step_ms']:>14.3f} {s['ratio_vs_plain']:>14.4f} "
                    f"{s['mean_ratio_vs_plain']:>15.4f} {s['thread_cpu_ratio_vs_plain']:>16.4f} "
                    f"{s['process_cpu_ratio_vs_plain']:>17.4f} {us(s.get('callback_us_per_step')):>16} "
                    f"{us(s.get('callback_us_per_step_median_step')):>13} {us(s.get('callback_cpu_us_per_step')):>6} "
                    f"{s['reps']:>4}")
    return "\n".join(rows)


def machine_info() -> dict[str, Any]:
    """Versions, threads and CPU of this machine."""
    import lightning

    info = machine.machine_info(torch=torch.__version__, lightning=lightning.__version__,
                                torch_threads=torch.get_num_threads(),
                                torch_interop_threads=torch.get_num_interop_threads(),
                                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"))
    for name in ("codecarbon", "zeus"):
        with contextlib.suppress(Exception):
            info[name] = sys.modules[name].__version__ if name in sys.modules else None
    return info


def quiet_lightning() -> None:
    """Silence Lightning's per-fit info lines and the warnings expected on this set-up."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_energy"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*lightning-energy.*")
    warnings.filterwarnings("ignore", message=".*RAPL.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning's pytree shim on torch 2.13
    warnings.filterwarnings("ignore", category=UserWarning, module="zeus")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the interleaved round (default 5)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per fit (default 400)")
    parser.add_argument("--epochs", type=int, default=2000,
                        help="one-batch epochs per fit in the epoch-end benchmark (default 2000; 0 skips it)")
    parser.add_argument("--epoch-reps", type=int, default=3, help="repetitions of the epoch-end benchmark")
    parser.add_argument("--front-end-reps", type=int, default=5,
                        help="repetitions of the front-end comparison (plain PyTorch, Fabric; 0 skips it)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                        help="cProfile EnergyCallback's hooks in one extra fit (auto: if either goal is not met)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.steps <= 2 * WARMUP_STEPS:
        parser.error(f"need --reps >= 1 and --steps > {2 * WARMUP_STEPS}")

    quiet_lightning()
    tools = {"codecarbon": load_codecarbon(), "zeus": load_zeus(), "cluster": load_cluster()}
    configs = [c for c in CONFIGS if c in ("plain", "energy", "sampler") or tools[c] is not None]
    notes = [f"{c} not installed: skipped" for c in CONFIGS if c not in configs]
    notes.append("sampler: EnergyCallback without its per-step hooks (sampling thread only); sampler/plain is "
                 "the thread's cost, energy/sampler (ratio_vs_sampler) the per-step hooks' cost")
    notes.append("callback us/step: EnergyCallback's (or the Zeus callback's) on_train_batch_start + "
                 "on_train_batch_end wall time, mean per step after warm-up (includes the logging steps; the "
                 "goal is judged on it); (median step): a typical step; (CPU): the thread's CPU time in the "
                 "hooks, mean per step (not inflated by preemption); the cost the sampling thread imposes on "
                 "the training thread shows in the step-time ratio only")
    notes.append("ratio vs plain: median over repetitions of (median step time / plain's median step time "
                 "in the same repetition); mean-step ratio: the same with mean step times; thread-CPU ratio: "
                 "the training thread's CPU time per step (not inflated by other processes, blind to GIL waits); "
                 "process-CPU ratio: CPU time of all threads per step (includes sampling threads)")

    print(f"overhead benchmark: {args.reps} reps x {len(configs)} configs x {args.steps} steps "
          f"({WARMUP_STEPS} warm-up steps per fit not timed), torch threads {torch.get_num_threads()}", flush=True)
    started = time.perf_counter()
    load_start = os.getloadavg()
    raw = run_benchmark(args.reps, args.steps, configs, tools)
    summary = summarise(raw)
    zeus_devices = raw["zeus"][0]["zeus_devices"] if raw.get("zeus") else None
    if zeus_devices is not None and not (zeus_devices["gpu_indices"] or zeus_devices["cpu_indices"]):
        notes.append(ZEUS_NOTE)
    split = attribution(summary)
    energy = summary["energy"]
    goals = {
        "step_time_ratio": {"goal_max": GOAL_RATIO, "measured": energy["ratio_vs_plain"],
                            "met": energy["ratio_vs_plain"] <= GOAL_RATIO},
        "callback_us_per_step": {"goal_max": GOAL_CALLBACK_US, "measured": energy["callback_us_per_step"],
                                 "met": energy["callback_us_per_step"] <= GOAL_CALLBACK_US},
    }
    print(f"\nplain step time (median over reps): {summary['plain']['median_step_ms']:.3f} ms "
          f"(target about 5 ms on one thread)")
    print(format_table(summary))
    for name, g in goals.items():
        print(f"goal {name}: {g['measured']:.4g} <= {g['goal_max']:g}: {'met' if g['met'] else 'NOT met'}")
    if split is not None:
        print(f"overhead split: sampling thread alone {split['sampler_thread_ratio_vs_plain']:.4f} x plain; "
              f"per-step hooks on top {split['hooks_ratio_vs_sampler']:.4f} x sampler")
    if "ratio_vs_energy" in summary.get("cluster", {}):
        cluster = summary["cluster"]
        print(f"cluster parts on (2 node sensors + Prometheus) vs energy alone: step time "
              f"{cluster['ratio_vs_energy']:.4f} x, training-thread CPU {cluster['thread_cpu_ratio_vs_energy']:.4f} x")
    for note in notes:
        print(f"note: {note}")

    epochs = None
    if args.epochs > 0:
        print(f"\none-batch epochs: {args.epoch_reps} reps x 2 configs x {args.epochs} epochs", flush=True)
        epochs = run_epoch_benchmark(args.epoch_reps, args.epochs)
        goals["one_batch_epoch_wall_ratio"] = {"goal_max": GOAL_EPOCH_RATIO, "measured": epochs["wall_ratio_median"],
                                               "met": epochs["wall_ratio_median"] <= GOAL_EPOCH_RATIO}
        goals["epoch_end_us"] = {"goal_max": GOAL_EPOCH_END_US, "measured": epochs["epoch_end_us_median"],
                                 "met": epochs["epoch_end_us_median"] <= GOAL_EPOCH_END_US}
        print(format_epoch_table(epochs))
        for name in ("one_batch_epoch_wall_ratio", "epoch_end_us"):
            g = goals[name]
            print(f"goal {name}: {g['measured']:.4g} <= {g['goal_max']:g}: {'met' if g['met'] else 'NOT met'}")

    front_ends = None
    if args.front_end_reps > 0:
        print(f"\nfront ends: {args.front_end_reps} reps x {len(FRONT_ENDS)} loops x {args.steps} steps", flush=True)
        front_ends = run_front_end_benchmark(args.front_end_reps, args.steps)
        print(format_front_end_table(front_ends, energy))
        worst = max(s["us_per_step_mean"] for s in front_ends["summary"].values())
        goals["front_end_us_per_step"] = {"goal_max": energy["callback_us_per_step"], "measured": worst,
                                          "met": worst <= energy["callback_us_per_step"]}
        g = goals["front_end_us_per_step"]
        print(f"goal front_end_us_per_step (each <= the Trainer callback's): {g['measured']:.4g} <= "
              f"{g['goal_max']:.4g}: {'met' if g['met'] else 'NOT met'}")

    profile = None
    if args.profile == "always" or (args.profile == "auto" and not all(g["met"] for g in goals.values())):
        profile = profile_energy_hooks(args.steps, tools)
        print("\ncProfile of EnergyCallback's per-step hooks (one extra fit):\n" + profile)

    result = {
        "benchmark": "overhead",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - started,
        "settings": {"reps": args.reps, "steps": args.steps, "warmup_steps": WARMUP_STEPS, "configs": configs,
                     "order": "rotated by one per repetition",
                     "model": {"in": IN_FEATURES, "width": WIDTH, "hidden_layers": DEPTH, "classes": CLASSES,
                               "batch": BATCH, "optimizer": "SGD"},
                     "trainer": {"log_every_n_steps": 50, "logger": "TensorBoardLogger"},
                     "energy_callback": {"verbose": False, "other_args": "defaults"},
                     "codecarbon": {"tracker": "OfflineEmissionsTracker", "country_iso_code": "FRA",
                                    "measure_power_secs": 1},
                     "sampler": {"callback": "EnergyCallback without per-step hooks", "verbose": False},
                     "zeus": {"window": "per step", "sync_execution": False, "monitor": "ZeusMonitor() defaults",
                              **(zeus_devices or {})}},
        "goals": goals,
        "summary": summary,
        "overhead_split": split,
        "one_batch_epochs": epochs,
        "front_ends": front_ends,
        "raw": raw,
        "notes": notes,
        "machine": {**machine_info(), "loadavg_1_5_15min_start": load_start,
                    "loadavg_1_5_15min_end": os.getloadavg()},
        **({"energy_hooks_profile": profile} if profile else {}),
    }
    write_json_atomic(args.out, result)
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
