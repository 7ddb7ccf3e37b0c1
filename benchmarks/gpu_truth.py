"""Per-step and per-epoch truth on a real card, through real ``Trainer.fit`` runs (issue 26, "On a GPU").

The last H200 run could not tell a true busy/idle ratio of 100 ms steps from an error of our figures: no
read-only query gives a step's energy. Here the NVML energy counter, which holds each ~100 ms period's whole
energy exactly (``benchmarks/nvml_semantics.py``), is the reference, read on a thread of its own (a read
every few ms; each change's time is known to a few ms) and never through the product:

1. **Phase powers.** A fit of long steps (``--long-step-s``, several counter periods each), idle and busy in
   turn (bf16 matrix products on the card, synchronised at the step's end). The counter's periods fitted
   against the busy intervals (``nvml_semantics.fit_counter``'s whole-period model: idle W, busy W and the
   counter's own lag) give each phase's power; the periods wholly inside a phase, past its first
   ``SETTLE_S``, give each phase's steady power.
2. **100 ms steps.** The same workload in steps of 70-130 ms (random lengths, busy and idle in turn) through
   a real ``Trainer.fit`` with ``EnergyCallback`` on the product's defaults (CUDA events, auto-detected
   sensors), ``--epochs`` epochs whose first and last steps are idle (so that every epoch edge lies where
   the power is steady and the counter's interpolation is sound). Each step figure of the callback's GPU
   sensor is compared with what the phase powers predict for its interval (busy time x busy W + the rest x
   idle W), from the long steps (1.) and from the same fit's own counter periods fitted the same way
   (the true busy/idle powers of 100 ms steps, which need not be the long steps': a card's power falls
   back slowly after a burst). Each epoch's figure is compared with the counter's delta over the same
   interval (goal: within 1 %) and with a Zeus ``ZeusMonitor`` window over the epoch (goal: within 2 %).

An observer callback placed first synchronises the device at every hook and records the host times of the
steps and epochs; the product's marks are recorded after it, so the GPU is never behind at a mark (a GPU
running late is the subject of issue 26 item 8, not of this check). Step-time overhead at 3 ms steps is
``benchmarks/overhead.py``'s (``make gpu-check`` runs it on the card's machine).

``--dry-run``: the fake NVML of ``tests/fakes_nvml.py`` (H200 semantics, on the real clock) installed as
``pynvml``, and a CPU loop for the busy phases (the fake draws ``DRY_BUSY_W`` then, ``DRY_IDLE_W`` otherwise):
every path but the card's own. ``--quick``: short steps and few of them (a rehearsal of the code paths only;
its figures mean nothing).

``python benchmarks/gpu_truth.py [--dry-run] [--quick] [--out PATH]`` (default
``benchmarks/results/gpu_truth.json``; ``make gpu-check`` names the file after the card).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import io
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")
BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
for _path in (ROOT, BENCHMARKS, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gpu_check import card_state, fake_pynvml  # noqa: E402
from machine import machine_info, write_json_atomic  # noqa: E402
from nvml_semantics import _overlap as overlap_s  # noqa: E402
from nvml_semantics import fit_counter, quantiles  # noqa: E402

DEFAULT_OUT = BENCHMARKS / "results" / "gpu_truth.json"
BUSY, IDLE = "busy", "idle"
SETTLE_S = 0.3  # a phase's first 0.3 s are left out of its steady power (clocks and power still moving)
SETTLE_STEPS_S = 1.0  # 100 ms steps of the fit's first second (the series pins the power reading's schedule)
POLL_PAUSE_S = 0.002  # between two counter reads of the reference thread (an H200 read itself takes 2.4 ms)
MATRIX = 8192  # bf16 MATRIX^3 products keep the card busy (~1.4 ms each on an H100/H200)
DRY_BUSY_W, DRY_IDLE_W = 600.0, 130.0
GOAL_EPOCH_VS_NVML_PCT = 1.0
GOAL_EPOCH_VS_ZEUS_PCT = 2.0
GOAL_STEP_MEDIAN_PCT = 5.0  # issue 26's per-step goals for wandering steps >= 100 ms (fake H200)
GOAL_STEP_P95_PCT = 15.0


@dataclass(frozen=True)
class Settings:
    long_step_s: float = 1.2
    long_pairs: int = 4  # idle, busy: 4 of each
    epochs: int = 3
    steps_per_epoch: int = 50
    edge_idle_steps: int = 2  # idle steps at each end of every epoch
    step_s: tuple[float, float] = (0.07, 0.13)
    seed: int = 0

    @classmethod
    def quick(cls) -> Settings:
        return cls(long_step_s=0.25, long_pairs=2, epochs=2, steps_per_epoch=8, edge_idle_steps=1,
                   step_s=(0.02, 0.04))


# ------------------------------------------------------------------------------------------ workloads
class CardWorkload:
    """The real card: busy = bf16 products on CUDA device ``cuda_index`` until about ``seconds`` of GPU time,
    then a synchronise; idle = the host sleeps. NVML through the real ``pynvml``, read-only."""

    accelerator = "gpu"

    def __init__(self, cuda_index: int = 0) -> None:
        import pynvml
        import torch

        from lightning_energy.measure.sensors.nvml import nvml_index_for_cuda_device

        pynvml.nvmlInit()
        self.nvml, self.torch, self.cuda_index = pynvml, torch, cuda_index
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index_for_cuda_device(pynvml, cuda_index))
        torch.cuda.set_device(cuda_index)
        self.a = torch.randn(MATRIX, MATRIX, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        for _ in range(5):
            self._product()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            self._product()
        end.record()
        end.synchronize()
        self.product_s = start.elapsed_time(end) / 1000 / 20
        self.busy: list[tuple[float, float]] = []

    def _product(self) -> None:
        self.torch.mm(self.a, self.a, out=self.c)

    def busy_for(self, seconds: float) -> None:
        start = time.perf_counter()
        for _ in range(max(1, round(seconds / self.product_s))):
            self._product()
        self.torch.cuda.synchronize()
        self.busy.append((start, time.perf_counter()))

    def idle_for(self, seconds: float) -> None:
        time.sleep(seconds)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def counter_mJ(self) -> int:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def sensors(self) -> None:
        return None  # the product's own detection, as a user gets it

    def zeus_monitor(self):
        from zeus.monitor import ZeusMonitor

        return ZeusMonitor(gpu_indices=[self.cuda_index], cpu_indices=[]), self.cuda_index

    def describe(self) -> dict[str, Any]:
        return {**card_state(self.nvml, self.handle), "torch": self.torch.__version__,
                "product_ms": self.product_s * 1000, "matrix": f"bf16 {MATRIX}^3"}


class DryWorkload:
    """The dry run: the fake NVML (``tests/fakes_nvml.py``, installed as ``pynvml``) draws ``DRY_BUSY_W`` while
    a CPU loop stands in for the card's work and ``DRY_IDLE_W`` otherwise; the product reads it through its
    real NVML sensor."""

    accelerator = "cpu"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.nvml = fake_pynvml(power_W=DRY_IDLE_W)
        sys.modules["pynvml"] = self.nvml  # Zeus and anything else that imports pynvml get the fake
        self.nvml.nvmlInit()
        self.handle = self.nvml.nvmlDeviceGetHandleByIndex(0)
        self.x = torch.randn(64, 64)
        self.busy: list[tuple[float, float]] = []

    def busy_for(self, seconds: float) -> None:
        start = time.perf_counter()
        self.nvml.set_power(0, DRY_BUSY_W)
        while time.perf_counter() - start < seconds:
            self.x = self.torch.tanh(self.x @ self.x)
        self.nvml.set_power(0, DRY_IDLE_W)
        self.busy.append((start, time.perf_counter()))

    def idle_for(self, seconds: float) -> None:
        time.sleep(seconds)

    def synchronize(self) -> None:
        pass

    def counter_mJ(self) -> int:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def sensors(self) -> list:
        from lightning_energy.measure.sensors.nvml import NvmlGpuSensor

        return [NvmlGpuSensor(0, pynvml_module=self.nvml)]

    def zeus_monitor(self):
        from zeus.monitor import ZeusMonitor

        return ZeusMonitor(gpu_indices=[0], cpu_indices=[]), 0

    def describe(self) -> dict[str, Any]:
        return {**card_state(self.nvml, self.handle), "torch": self.torch.__version__,
                "dry_run": f"fake NVML, {DRY_BUSY_W:g} W busy (a CPU loop) / {DRY_IDLE_W:g} W idle"}


# ------------------------------------------------------------------------------------------ the reference
class CounterPoller:
    """Reads the NVML energy counter on its own thread every ``pause_s`` + the read's own time, and keeps
    each change as ``(t, mJ)``: ``t`` (``perf_counter`` s, the sampler's clock) is the middle of the span
    in which the change happened (from the start of the last read that saw the old value to the end of
    the one that saw the new). A read that raises ends the polling and is kept in ``error``."""

    def __init__(self, read_mJ, pause_s: float = POLL_PAUSE_S) -> None:
        self.read_mJ, self.pause_s = read_mJ, pause_s
        self.updates: list[tuple[float, int]] = []
        self.spans_s: list[float] = []  # width of each change's span (its time is known to half of it)
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gpu-truth-counter", daemon=True)

    def __enter__(self) -> CounterPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _poll(self) -> None:
        try:
            previous_start = time.perf_counter()
            last = self.read_mJ()
            while not self._stop.is_set():
                start = time.perf_counter()
                value = self.read_mJ()
                end = time.perf_counter()
                if value != last:
                    self.updates.append(((previous_start + end) / 2, value))
                    self.spans_s.append(end - previous_start)
                    last = value
                previous_start = start
                time.sleep(self.pause_s)
        except Exception as err:  # noqa: BLE001 - the reference's failure is recorded, the fit goes on
            self.error = f"{type(err).__name__}: {err}"


def counter_energy_J(updates: list[tuple[float, int]], t: float, lag_s: float = 0.0) -> tuple[float, float] | None:
    """The card's energy (J, from the counter's origin) up to ``t``: the counter's changes, each holding the
    energy up to ``lag_s`` before it, interpolated linearly; and the bound (J) on that interpolation (the
    true value lies between the two changes around ``t``: half their difference). None outside them."""
    times = [u - lag_s for u, _ in updates]
    k = bisect.bisect_right(times, t)
    if k == 0 or k == len(times):
        return None
    (t0, e0), (t1, e1) = (times[k - 1], updates[k - 1][1]), (times[k], updates[k][1])
    share = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
    return (e0 + share * (e1 - e0)) / 1000, (e1 - e0) / 2000


@dataclass(frozen=True)
class PowerModel:
    """Power (W) as ``idle_W`` outside the busy intervals and ``busy_W`` inside them."""

    busy_W: float
    idle_W: float
    source: str

    def energy_J(self, start: float, end: float, busy: list[tuple[float, float]]) -> float:
        busy_s = overlap_s(start, end, busy)
        return self.busy_W * busy_s + self.idle_W * (end - start - busy_s)


def fitted_model(busy: list[tuple[float, float]], updates: list[tuple[float, int]], source: str) -> dict[str, Any]:
    """The counter's periods against the busy intervals (``fit_counter``'s whole-period model): busy and idle W,
    the counter's lag (ms) and R²; None figures where the periods are too few."""
    if len(updates) < 4 or not busy:
        return {"source": source, "busy_W": None, "idle_W": None, "lag_ms": None, "r2": None, "periods": 0}
    fit = fit_counter({"busy": busy, "counter": updates, "instant": []})["whole period"]
    return {"source": source, "busy_W": fit["busy_W"], "idle_W": fit["idle_W"], "lag_ms": fit["lag_ms"],
            "r2": fit["r2"], "periods": len(updates) - 1}


def steady_powers(phases: list[tuple[str, float, float]], updates: list[tuple[float, int]],
                  lag_s: float) -> dict[str, float | None]:
    """Median power (W) of the counter periods lying wholly inside a phase, past its first ``SETTLE_S``."""
    powers: dict[str, list[float]] = {BUSY: [], IDLE: []}
    shifted = [(t - lag_s, e) for t, e in updates]
    for kind, start, end in phases:
        inside = [(t, e) for t, e in shifted if start + SETTLE_S <= t <= end]
        powers[kind] += [(e1 - e0) / 1000 / (t1 - t0) for (t0, e0), (t1, e1) in zip(inside, inside[1:]) if t1 > t0]
    return {f"{kind}_W": statistics.median(p) if p else None for kind, p in powers.items()} | {
        f"{kind}_periods": len(p) for kind, p in powers.items()}


# ------------------------------------------------------------------------------------------ the fit
def schedule_of_long_steps(settings: Settings) -> list[tuple[str, float]]:
    return [(kind, settings.long_step_s) for _ in range(settings.long_pairs) for kind in (IDLE, BUSY)]


def schedule_of_short_steps(settings: Settings) -> list[tuple[str, float]]:
    """Every epoch: ``edge_idle_steps`` idle, then busy and idle in turn (random lengths in ``step_s``), then
    ``edge_idle_steps`` idle; one list over all epochs."""
    rng = random.Random(settings.seed)
    schedule = []
    middle = settings.steps_per_epoch - 2 * settings.edge_idle_steps
    for _ in range(settings.epochs):
        schedule += [(IDLE, settings.step_s[1])] * settings.edge_idle_steps
        schedule += [(BUSY if i % 2 == 0 else IDLE, rng.uniform(*settings.step_s)) for i in range(middle)]
        schedule += [(IDLE, settings.step_s[1])] * settings.edge_idle_steps
    return schedule


def build_fit_classes():
    """The LightningModule and callbacks (defined once Lightning is imported)."""
    import lightning as L
    import torch
    from torch import nn

    from lightning_energy import EnergyCallback

    class ScheduledSteps(L.LightningModule):
        """Step ``k`` of the fit keeps the card busy, or leaves it idle, for ``schedule[k]`` (kind, s)."""

        def __init__(self, workload, schedule: list[tuple[str, float]]) -> None:
            super().__init__()
            self.workload, self.schedule, self.calls = workload, schedule, 0
            self.weight = nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            kind, seconds = self.schedule[self.calls]
            self.calls += 1
            (self.workload.busy_for if kind == BUSY else self.workload.idle_for)(seconds)
            return (self.weight * batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Observer(L.Callback):
        """Placed first: synchronises the device at every hook, records host times of steps and epochs, and
        holds a Zeus window over every epoch (``sync_execution=False``: the device is synchronised here)."""

        def __init__(self, workload, zeus=None, zeus_index: int = 0) -> None:
            self.workload, self.zeus, self.zeus_index = workload, zeus, zeus_index
            self.steps: list[tuple[float, float]] = []
            self.epochs: list[dict[str, Any]] = []
            self.zeus_error: str | None = None

        def _now(self) -> float:
            self.workload.synchronize()
            return time.perf_counter()

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self._epoch_start = self._now()
            if self.zeus is not None:
                try:
                    self.zeus.begin_window(f"epoch{trainer.current_epoch}", sync_execution=False)
                except Exception as err:  # noqa: BLE001
                    self.zeus_error, self.zeus = f"{type(err).__name__}: {err}", None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._step_start = self._now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.steps.append((self._step_start, self._now()))

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            end = self._now()
            zeus_J = None
            if self.zeus is not None:
                try:
                    zeus_J = self.zeus.end_window(f"epoch{trainer.current_epoch}",
                                                  sync_execution=False).gpu_energy[self.zeus_index]
                except Exception as err:  # noqa: BLE001
                    self.zeus_error, self.zeus = f"{type(err).__name__}: {err}", None
            self.epochs.append({"epoch": trainer.current_epoch, "start": self._epoch_start, "end": end,
                                "zeus_J": zeus_J})

    class RecordingEnergyCallback(EnergyCallback):
        """``EnergyCallback`` keeping every step's and epoch's figures as they are delivered."""

        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.step_figures, self.epoch_figures = [], []

        def on_step_measured(self, trainer, figures) -> None:
            self.step_figures.append(figures)
            super().on_step_measured(trainer, figures)

        def on_epoch_measured(self, trainer, figures) -> None:
            self.epoch_figures.append(figures)
            super().on_epoch_measured(trainer, figures)

    return L, ScheduledSteps, Observer, RecordingEnergyCallback


def gpu_sensor_name(names) -> str | None:
    gpus = sorted(n for n in names if n.startswith("gpu"))
    return gpus[0] if gpus else None


def run_fit(workload, schedule: list[tuple[str, float]], epochs: int, with_zeus: bool) -> dict[str, Any]:
    """One ``Trainer.fit`` over ``schedule`` with the observer, ``EnergyCallback`` (product defaults, but for
    the dry run's sensors) and the counter read on its own thread. Raw records, host ``perf_counter`` s."""
    import torch

    L, ScheduledSteps, Observer, RecordingEnergyCallback = build_fit_classes()
    zeus, zeus_index, zeus_error = None, 0, None
    if with_zeus:
        try:
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                zeus, zeus_index = workload.zeus_monitor()
        except Exception as err:  # noqa: BLE001 - Zeus missing or failing is a finding, not a crash
            zeus_error = f"{type(err).__name__}: {err}"
    observer = Observer(workload, zeus, zeus_index)
    energy = RecordingEnergyCallback(sensors=workload.sensors(), verbose=False, log_power_figure=False)
    steps_per_epoch = len(schedule) // epochs
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(steps_per_epoch, 1)),
                                       batch_size=1)
    workload.busy.clear()
    with tempfile.TemporaryDirectory(prefix="gpu_truth_") as tmp:
        trainer = L.Trainer(accelerator=workload.accelerator, devices=1, max_epochs=epochs, logger=False,
                            default_root_dir=tmp, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
                            callbacks=[observer, energy])
        with CounterPoller(workload.counter_mJ) as poller:
            trainer.fit(ScheduledSteps(workload, schedule), data)
            time.sleep(0.25)  # two more counter updates after the fit: the last epoch's edge is covered
    names = {n for f in energy.epoch_figures for n in f.energy_J} | {
        n for f in energy.step_figures for n in f.measurement.energy_J}
    gpu = gpu_sensor_name(names)
    return {
        "gpu_sensor": gpu, "sensors": sorted(names),
        "schedule": schedule, "observed_steps": observer.steps, "busy": list(workload.busy),
        "observed_epochs": observer.epochs, "zeus_error": zeus_error or observer.zeus_error,
        "updates": poller.updates, "update_spans_s": poller.spans_s, "poller_error": poller.error,
        "step_figures": [{"start_s": f.measurement.start_s, "end_s": f.measurement.end_s,
                          "J": f.measurement.energy_J.get(gpu), "extrapolated": f.measurement.extrapolated}
                         for f in energy.step_figures],
        "epoch_figures": [{"epoch": f.epoch, "start_s": f.start_s, "end_s": f.end_s, "J": f.energy_J.get(gpu),
                           "bound_J": (f.bounds_J or {}).get(gpu), "extrapolated": f.extrapolated}
                          for f in energy.epoch_figures],
    }


# ------------------------------------------------------------------------------------------ analysis
def relative_pct(ours: float, truth: float) -> float | None:
    return None if not truth else (ours - truth) / truth * 100


def step_rows(fit: dict[str, Any], models: list[PowerModel], lag_s: float) -> list[dict[str, Any]]:
    """Each step figure of the GPU sensor beside each model's energy for the same interval and the counter's
    interpolated delta (with its bound)."""
    rows = []
    for f in fit["step_figures"]:
        if f["J"] is None or f["end_s"] <= f["start_s"]:
            continue
        duration = f["end_s"] - f["start_s"]
        kind = BUSY if overlap_s(f["start_s"], f["end_s"], fit["busy"]) > duration / 2 else IDLE
        row = {"start_s": f["start_s"], "duration_s": duration, "kind": kind, "J": f["J"],
               "extrapolated": f["extrapolated"]}
        start, end = (counter_energy_J(fit["updates"], t, lag_s) for t in (f["start_s"], f["end_s"]))
        if start is not None and end is not None:  # the counter's own delta: loose (± a period) for short steps
            row |= {"counter_J": end[0] - start[0], "counter_bound_J": start[1] + end[1]}
        for model in models:
            truth = model.energy_J(f["start_s"], f["end_s"], fit["busy"])
            row[f"{model.source}_J"] = truth
            row[f"{model.source}_error_pct"] = relative_pct(f["J"], truth)
        rows.append(row)
    return rows


def step_statistics(rows: list[dict[str, Any]], model: PowerModel, settle_until_s: float) -> dict[str, Any]:
    """|error| % quantiles per kind of step (after ``settle_until_s``: the first second, while the series
    pins the power reading's schedule, is reported apart), and the callback's median W beside the model's."""
    out: dict[str, Any] = {"model": model.source, "busy_W": model.busy_W, "idle_W": model.idle_W}
    key = f"{model.source}_error_pct"
    for label, chosen in (("all", rows), ("settled", [r for r in rows if r["start_s"] >= settle_until_s])):
        for kind in (BUSY, IDLE, "both"):
            picked = [r for r in chosen if kind in ("both", r["kind"]) and r[key] is not None]
            errors = [abs(r[key]) for r in picked]
            stats = quantiles(errors) if errors else {"median": None, "p95": None, "n": 0}
            stats["max"] = max(errors) if errors else None
            watts = [r["J"] / r["duration_s"] for r in picked]
            stats["callback_median_W"] = statistics.median(watts) if watts else None
            out[f"{label}_{kind}"] = stats
    return out


def epoch_rows(fit: dict[str, Any], lag_s: float) -> list[dict[str, Any]]:
    """Each epoch: ours against the counter's delta over the same interval and against Zeus's window."""
    zeus = {e["epoch"]: e for e in fit["observed_epochs"]}
    rows = []
    for f in fit["epoch_figures"]:
        start = counter_energy_J(fit["updates"], f["start_s"], lag_s)
        end = counter_energy_J(fit["updates"], f["end_s"], lag_s)
        nvml_J = None if start is None or end is None else end[0] - start[0]
        zeus_row = zeus.get(f["epoch"], {})
        rows.append({
            "epoch": f["epoch"], "duration_s": f["end_s"] - f["start_s"], "J": f["J"], "bound_J": f["bound_J"],
            "extrapolated": f["extrapolated"], "nvml_J": nvml_J,
            "nvml_bound_J": None if nvml_J is None else start[1] + end[1],
            "vs_nvml_pct": None if nvml_J is None or f["J"] is None else relative_pct(f["J"], nvml_J),
            "zeus_J": zeus_row.get("zeus_J"),
            "zeus_duration_s": (zeus_row["end"] - zeus_row["start"]) if zeus_row else None,
            "vs_zeus_pct": None if zeus_row.get("zeus_J") is None or f["J"] is None
            else relative_pct(f["J"], zeus_row["zeus_J"]),
        })
    return rows


def phase_list(fit: dict[str, Any]) -> list[tuple[str, float, float]]:
    return [(kind, start, end) for (kind, _), (start, end) in zip(fit["schedule"], fit["observed_steps"])]


def analyse(long_fit: dict[str, Any], short_fit: dict[str, Any]) -> dict[str, Any]:
    """Phase powers from the long steps (their steady periods, and the two-level fit of all their periods),
    the 100 ms fit's own two-level fit; each fit's steps against the models that apply, and the epochs."""
    long_fitted = fitted_model(long_fit["busy"], long_fit["updates"], "long_steps_fit")
    lag_s = (long_fitted["lag_ms"] or 0) / 1000
    steady = steady_powers(phase_list(long_fit), long_fit["updates"], lag_s)
    short_fitted = fitted_model(short_fit["busy"], short_fit["updates"], "short_steps_fit")
    models = {m["source"]: PowerModel(m["busy_W"], m["idle_W"], m["source"])
              for m in (long_fitted, short_fitted) if m["busy_W"] is not None}
    if steady["busy_W"] is not None and steady["idle_W"] is not None:
        models["long_steps_steady"] = PowerModel(steady["busy_W"], steady["idle_W"], "long_steps_steady")
    long_models = [models[k] for k in ("long_steps_fit", "long_steps_steady") if k in models]
    short_models = [models[k] for k in ("long_steps_steady", "short_steps_fit") if k in models]
    long_rows, short_rows = step_rows(long_fit, long_models, lag_s), step_rows(short_fit, short_models, lag_s)
    fit_start = short_fit["observed_steps"][0][0] if short_fit["observed_steps"] else 0.0
    return {
        "long_steps": {"fit": long_fitted, "steady": steady, "lag_ms_used": lag_s * 1000, "steps": long_rows,
                       "statistics": [step_statistics(long_rows, m, 0.0) for m in long_models]},
        "short_steps": {"fit": short_fitted, "steps": short_rows,
                        "statistics": [step_statistics(short_rows, m, fit_start + SETTLE_STEPS_S)
                                       for m in short_models]},
        "epochs": epoch_rows(short_fit, lag_s),
    }


def goals_of(analysis: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals on this card: the largest epoch error against each reference; the median and p95
    step error (settled steps, both kinds) against the 100 ms fit's own powers."""
    def goal(measured, goal_max):
        return {"goal_max": goal_max, "measured": measured, "met": None if measured is None else measured <= goal_max}

    def largest(key):
        values = [abs(r[key]) for r in analysis["epochs"] if r[key] is not None]
        return max(values) if values else None

    own = next((s for s in analysis["short_steps"]["statistics"] if s["model"] == "short_steps_fit"), None)
    settled = own["settled_both"] if own else {"median": None, "p95": None}
    return {"epoch_vs_nvml_pct": goal(largest("vs_nvml_pct"), GOAL_EPOCH_VS_NVML_PCT),
            "epoch_vs_zeus_pct": goal(largest("vs_zeus_pct"), GOAL_EPOCH_VS_ZEUS_PCT),
            "step_median_pct": goal(settled["median"], GOAL_STEP_MEDIAN_PCT),
            "step_p95_pct": goal(settled["p95"], GOAL_STEP_P95_PCT)}


# ------------------------------------------------------------------------------------------ output
def _f(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_tables(analysis: dict[str, Any], goals: dict[str, Any]) -> str:
    long, short = analysis["long_steps"], analysis["short_steps"]
    fit, steady = long["fit"], long["steady"]
    lines = [
        "phase powers (counter, long steps): fit busy {} W, idle {} W, counter lag {} ms, R² {}; steady "
        "(periods past {:.1f} s) busy {} W ({} periods), idle {} W ({} periods)".format(
            _f(fit["busy_W"]), _f(fit["idle_W"]), _f(fit["lag_ms"], "d") if fit["lag_ms"] is not None else "-",
            _f(fit["r2"], ".3f"), SETTLE_S, _f(steady["busy_W"]), steady["busy_periods"], _f(steady["idle_W"]),
            steady["idle_periods"]),
        "100 ms steps, the fit's own counter periods: busy {} W, idle {} W, lag {} ms, R² {} ({} periods)".format(
            _f(short["fit"]["busy_W"]), _f(short["fit"]["idle_W"]),
            _f(short["fit"]["lag_ms"], "d") if short["fit"]["lag_ms"] is not None else "-",
            _f(short["fit"]["r2"], ".3f"), short["fit"]["periods"]),
        "",
        f"{'steps':<12} {'truth from':<18} {'kind':<5} {'n':>4} {'median |err| %':>14} {'p95':>7} {'max':>7} "
        f"{'ours W':>7} {'model W':>7}",
    ]
    for label, block in (("long", long), ("100 ms", short)):
        for stats in block["statistics"]:
            for kind in (BUSY, IDLE, "both"):
                s = stats[f"settled_{kind}"]
                model_W = {BUSY: stats["busy_W"], IDLE: stats["idle_W"]}.get(kind)
                lines.append(f"{label:<12} {stats['model']:<18} {kind:<5} {s['n']:>4} {_f(s['median'], '.2f'):>14} "
                             f"{_f(s['p95'], '.2f'):>7} {_f(s['max'], '.2f'):>7} {_f(s['callback_median_W']):>7} "
                             f"{_f(model_W):>7}")
    lines += ["", f"{'epoch':>5} {'s':>6} {'ours J':>9} {'bound J':>8} {'NVML J':>9} {'±J':>6} {'vs NVML %':>9} "
                  f"{'Zeus J':>9} {'vs Zeus %':>9}"]
    for r in analysis["epochs"]:
        lines.append(f"{r['epoch']:>5} {r['duration_s']:>6.2f} {_f(r['J']):>9} {_f(r['bound_J']):>8} "
                     f"{_f(r['nvml_J']):>9} {_f(r['nvml_bound_J']):>6} {_f(r['vs_nvml_pct'], '+.2f'):>9} "
                     f"{_f(r['zeus_J']):>9} {_f(r['vs_zeus_pct'], '+.2f'):>9}")
    lines.append("")
    for name, g in goals.items():
        verdict = "-" if g["met"] is None else ("met" if g["met"] else "NOT met")
        lines.append(f"goal {name}: {_f(g['measured'], '.2f')} <= {g['goal_max']:g}: {verdict}")
    return "\n".join(lines)


def compact_fit(fit: dict[str, Any]) -> dict[str, Any]:
    """What the JSON keeps of a fit's raw records (the step and epoch rows carry the rest)."""
    return {"gpu_sensor": fit["gpu_sensor"], "sensors": fit["sensors"], "zeus_error": fit["zeus_error"],
            "poller_error": fit["poller_error"], "counter_updates": len(fit["updates"]),
            "update_span_ms": quantiles([s * 1000 for s in fit["update_spans_s"]]) if fit["update_spans_s"] else None,
            "busy_intervals": len(fit["busy"]), "steps_observed": len(fit["observed_steps"]),
            "step_figures": len(fit["step_figures"]),
            "extrapolated_steps": sum(1 for f in fit["step_figures"] if f["extrapolated"])}


def quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_energy", "zeus", "codecarbon"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*lightning-energy.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")


def run(dry_run: bool, settings: Settings, out: Path) -> dict[str, Any]:
    """Both fits, the analysis, the tables printed and the JSON written (returned)."""
    quiet()
    started = time.perf_counter()
    if not dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_truth: needs a CUDA GPU with NVML; none here (--dry-run rehearses on fakes)")
            return {}
    workload = DryWorkload() if dry_run else CardWorkload()
    card = workload.describe()
    print(f"gpu_truth{' (dry run)' if dry_run else ''} on {card['gpu']} (driver {card['driver']}): long steps "
          f"{settings.long_pairs} x (idle, busy) of {settings.long_step_s:g} s", flush=True)
    long_fit = run_fit(workload, schedule_of_long_steps(settings), 1, with_zeus=False)
    print(f"  then {settings.epochs} epochs x {settings.steps_per_epoch} steps of {settings.step_s[0] * 1000:.0f}-"
          f"{settings.step_s[1] * 1000:.0f} ms", flush=True)
    short_fit = run_fit(workload, schedule_of_short_steps(settings), settings.epochs, with_zeus=True)
    analysis = analyse(long_fit, short_fit)
    goals = goals_of(analysis)
    print(format_tables(analysis, goals))
    for label, fit in (("long steps", long_fit), ("100 ms steps", short_fit)):
        for key in ("zeus_error", "poller_error"):
            if fit[key]:
                print(f"note: {label}: {key.replace('_', ' ')}: {fit[key]}")
    import lightning

    result = {
        "benchmark": "gpu_truth", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dry_run": dry_run, "card": card,
        "machine": machine_info(torch=workload.torch.__version__, lightning=lightning.__version__),
        "settings": {**settings.__dict__, "settle_s": SETTLE_S, "poll_pause_s": POLL_PAUSE_S,
                     "energy_callback": "defaults (CUDA events on a GPU), verbose=False, log_power_figure=False"},
        "goals": goals, **analysis,
        "fits": {"long_steps": compact_fit(long_fit), "short_steps": compact_fit(short_fit)},
        "wall_s": time.perf_counter() - started,
    }
    write_json_atomic(out, result)
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the fake NVML and a CPU workload")
    parser.add_argument("--quick", action="store_true", help="a short rehearsal (figures meaningless)")
    parser.add_argument("--epochs", type=int, help="epochs of 100 ms steps (default 3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    settings = Settings.quick() if args.quick else Settings()
    if args.epochs:
        settings = Settings(**{**settings.__dict__, "epochs": args.epochs})
    run(args.dry_run, settings, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
