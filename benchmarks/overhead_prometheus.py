"""Training-thread cost of ``PrometheusCallback``: a fit scraped hard and pushed every epoch, beside the same fit
without it.

Two configurations, interleaved within every repetition (the order alternates from one repetition to the next):

- ``energy``      ``EnergyCallback`` with two simulated sensors (one counter, one power), no trace, no figure;
- ``prometheus``  the same, plus ``PrometheusCallback(port=0, pushgateway=<a real Pushgateway>)``, its endpoint
                  scraped by a separate process 10 times a second (a Prometheus scraping every 15 s asks 150
                  times less often), and a push at every epoch end (short epochs: many pushes).

Step time is measured from inside the loop: a timing callback placed first records the time between consecutive
``on_train_batch_start`` calls (set-up and tear-down excluded); per fit the median step after warm-up. The
exporter's own calls on the training thread (``on_step_measured``, ``on_epoch_measured``, ``run_ended``), and
one push on its worker thread (the exporter's private ``_push_now``: what a push costs the process), are
timed by wrapping them on the instance (wall time, ``perf_counter_ns``, and the training thread's CPU time,
``thread_time_ns``: the wall time also counts the moments the thread waits for the GIL or a core). Reported: the median over repetitions of each
configuration's median step time, the median of the per-repetition ratios, the exporter's time per step
(its per-step and per-epoch calls summed over the fit, divided by the steps) and per epoch end, and the scrapes
and pushes served.

Needs Debian's ``prometheus-pushgateway`` (the Pushgateway binary) and the ``prometheus`` extra.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead_prometheus.py [--reps 5] [--epochs 20] [--steps 25]``.
Writes ``benchmarks/results/overhead_prometheus.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one CPU thread, set before torch is imported
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from torch import nn  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import machine  # noqa: E402
import prometheus_servers  # noqa: E402  (starts the real Pushgateway)

from lightning_energy import EnergyCallback, SimulatedSensor  # noqa: E402
from lightning_energy.callbacks.prometheus import PrometheusCallback  # noqa: E402

WARMUP_STEPS = 10
SCRAPE_HZ = 10.0  # a Prometheus scraping every 15 s asks 150 times less often
SCRAPER = """
import sys, time, urllib.request
url, period, n = sys.argv[1], 1.0 / float(sys.argv[2]), 0
next_s = time.monotonic()
while True:
    try:
        urllib.request.urlopen(url, timeout=5).read()
        n += 1
        print(n, flush=True)
    except OSError:
        pass
    next_s += period
    time.sleep(max(next_s - time.monotonic(), 0.0))
"""


class MLP(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepTimer(Callback):
    def __init__(self) -> None:
        self.marks: list[int] = []

    def on_train_batch_start(self, *args) -> None:
        self.marks.append(time.perf_counter_ns())

    def median_step_s(self) -> float:
        gaps = [(b - a) / 1e9 for a, b in zip(self.marks, self.marks[1:])][WARMUP_STEPS:]
        return statistics.median(gaps)


def timed(obj, name: str, totals: dict) -> None:
    """Wrap ``obj.name`` (an instance attribute now) to add its wall time and the calling thread's CPU time (ns)
    to ``totals[name]`` and ``totals[name + "/cpu"]``."""
    method = getattr(obj, name)

    def wrapper(*args, **kwargs):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return method(*args, **kwargs)
        finally:
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            totals[name] = totals.get(name, 0) + t1 - t0
            totals[name + "/cpu"] = totals.get(name + "/cpu", 0) + c1 - c0

    setattr(obj, name, wrapper)


class Batches:
    """The same ``steps`` batches every epoch (an iterable with a length: no DataLoader workers, no collation)."""

    def __init__(self, steps: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [(torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g))
                      for _ in range(steps)]

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def one_fit(config: str, epochs: int, steps: int, pushgateway: str, folder: Path) -> dict:
    timer = StepTimer()
    energy = EnergyCallback(sensors=[SimulatedSensor("gpu0", 200.0, kind="energy", scope="device"),
                                     SimulatedSensor("cpu", 40.0, scope="host")],
                            verbose=False, write_trace=False, log_power_figure=False)
    callbacks: list = [timer, energy]
    exporter, scraper, totals = None, None, {}
    if config == "prometheus":
        exporter = PrometheusCallback(port=0, address="127.0.0.1", pushgateway=pushgateway, job="overhead")
        for name in ("on_step_measured", "on_epoch_measured", "run_ended", "_push_now"):  # the last: worker thread
            timed(exporter.exporter, name, totals)
        callbacks.append(exporter)
    trainer = Trainer(callbacks=callbacks, max_epochs=epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                      default_root_dir=str(folder))
    data = Batches(steps)

    class StartScraper(Callback):  # once the endpoint is up (setup), a separate process scrapes it nonstop
        def on_train_start(self, trainer, pl_module) -> None:
            nonlocal scraper
            if exporter is not None:
                url = f"http://127.0.0.1:{exporter.exporter.serving_port}/metrics"
                scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, url, str(SCRAPE_HZ)], stdout=subprocess.PIPE,
                                           text=True)

    trainer.callbacks.append(StartScraper())
    try:
        trainer.fit(MLP(), data)
    finally:
        scrapes = 0
        if scraper is not None:
            scraper.terminate()
            out, _ = scraper.communicate(timeout=30)
            scrapes = max([int(line) for line in out.split()] or [0])
    result = {"median_step_s": timer.median_step_s(), "steps": len(timer.marks), "report_J": energy.report["total_J"]}
    if exporter is not None:
        result.update(
            exporter_us_per_step=(totals.get("on_step_measured", 0) + totals.get("on_epoch_measured", 0)
                                  + totals.get("run_ended", 0)) / 1e3 / len(timer.marks),
            exporter_cpu_us_per_step=(totals.get("on_step_measured/cpu", 0) + totals.get("on_epoch_measured/cpu", 0)
                                      + totals.get("run_ended/cpu", 0)) / 1e3 / len(timer.marks),
            step_call_us=totals.get("on_step_measured", 0) / 1e3 / len(timer.marks),
            epoch_end_call_cpu_us=totals.get("on_epoch_measured/cpu", 0) / 1e3 / epochs,
            epoch_end_call_us=totals.get("on_epoch_measured", 0) / 1e3 / epochs,
            run_ended_us=totals.get("run_ended", 0) / 1e3,
            push_worker_us=totals.get("_push_now", 0) / 1e3 / max(exporter.exporter.pushes, 1),
            push_worker_cpu_us=totals.get("_push_now/cpu", 0) / 1e3 / max(exporter.exporter.pushes, 1),
            pushes=exporter.exporter.pushes, scrapes_at_least=scrapes, problems=exporter.exporter.problems)
        exporter.exporter.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=25, help="steps per epoch")
    args = parser.parse_args()
    if args.reps < 3:
        parser.error("--reps must be at least 3")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        gateway = prometheus_servers.start_pushgateway(Path(tmp) / "pushgateway")
        try:
            for rep in range(args.reps):
                order = ("energy", "prometheus") if rep % 2 == 0 else ("prometheus", "energy")
                fits = {c: one_fit(c, args.epochs, args.steps, gateway.url, Path(tmp) / f"{rep}{c}") for c in order}
                rows.append({"rep": rep, "order": list(order), **{c: fits[c] for c in order},
                             "ratio": fits["prometheus"]["median_step_s"] / fits["energy"]["median_step_s"]})
                p = fits["prometheus"]
                print(f"rep {rep}: step {fits['energy']['median_step_s'] * 1e3:.3f} ms -> {p['median_step_s'] * 1e3:.3f} ms"
                      f" (x{rows[-1]['ratio']:.4f}); exporter {p['exporter_us_per_step']:.2f} us/step, "
                      f"{p['epoch_end_call_us']:.0f} us/epoch end ({p['epoch_end_call_cpu_us']:.0f} us CPU); pushes {p['pushes']}, scrapes >= {p['scrapes_at_least']}",
                      flush=True)
        finally:
            gateway.stop()

    def med(config, key):
        return statistics.median(r[config][key] for r in rows)

    summary = {
        "energy_median_step_ms": med("energy", "median_step_s") * 1e3,
        "prometheus_median_step_ms": med("prometheus", "median_step_s") * 1e3,
        "step_time_ratio_median": statistics.median(r["ratio"] for r in rows),
        "exporter_us_per_step_median": med("prometheus", "exporter_us_per_step"),
        "exporter_cpu_us_per_step_median": med("prometheus", "exporter_cpu_us_per_step"),
        "exporter_step_call_us_median": med("prometheus", "step_call_us"),
        "exporter_epoch_end_call_cpu_us_median": med("prometheus", "epoch_end_call_cpu_us"),
        "exporter_epoch_end_call_us_median": med("prometheus", "epoch_end_call_us"),
        "exporter_run_ended_us_median": med("prometheus", "run_ended_us"),
        "push_worker_us_median": med("prometheus", "push_worker_us"),
        "push_worker_cpu_us_median": med("prometheus", "push_worker_cpu_us"),
        "pushes_per_fit_median": med("prometheus", "pushes"),
        "scrapes_per_fit_median": med("prometheus", "scrapes_at_least"),
    }
    print()
    print(f"{'':<44} {'median':>10}")
    print(f"{'step time, EnergyCallback (ms)':<44} {summary['energy_median_step_ms']:>10.3f}")
    print(f"{'step time, + PrometheusCallback (ms)':<44} {summary['prometheus_median_step_ms']:>10.3f}")
    print(f"{'step-time ratio (per repetition)':<44} {summary['step_time_ratio_median']:>10.4f}")
    print(f"{'exporter on the training thread (us/step)':<44} {summary['exporter_us_per_step_median']:>10.2f}")
    print(f"{'  the same, its CPU time (us/step)':<44} {summary['exporter_cpu_us_per_step_median']:>10.2f}")
    print(f"{'  on_step_measured (us/step)':<44} {summary['exporter_step_call_us_median']:>10.2f}")
    print(f"{'  on_epoch_measured (us/epoch end)':<44} {summary['exporter_epoch_end_call_us_median']:>10.1f}")
    print(f"{'  on_epoch_measured CPU (us/epoch end)':<44} {summary['exporter_epoch_end_call_cpu_us_median']:>10.1f}")
    print(f"{'  run_ended (us, once)':<44} {summary['exporter_run_ended_us_median']:>10.1f}")
    print(f"{'one push, on the worker thread (us)':<44} {summary['push_worker_us_median']:>10.0f}")
    print(f"{'  its CPU time (us)':<44} {summary['push_worker_cpu_us_median']:>10.0f}")
    print(f"{'pushes per fit':<44} {summary['pushes_per_fit_median']:>10.0f}")
    print(f"{'scrapes per fit (at least)':<44} {summary['scrapes_per_fit_median']:>10.0f}")
    out = HERE / "results" / "overhead_prometheus.json"
    machine.write_json_atomic(out, {
        "settings": {"reps": args.reps, "epochs": args.epochs, "steps_per_epoch": args.steps,
                     "warmup_steps": WARMUP_STEPS, "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
                     "model": "MLP 256-512-512-10, batch 64, CPU, 1 thread"},
        "machine": machine.machine_info(), "repetitions": rows, "summary": summary})
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
