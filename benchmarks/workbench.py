"""Speed of the energy workbench: the tiny sweep, the analysis commands, and the per-step hook time of
CarbonCallback, ForecastCallback, CatalogCallback and BatchSampleEstimate.

- ``sweep_tiny``: wall time of ``lightning-energy sweep --config configs/sweep_tiny.yaml`` (16 fits);
  goal: well under a minute on one CPU core.
- ``report`` / ``compare`` / ``catalog list``: wall time of each command on the sweep's output (plots
  included; ``fit`` needs three values of an axis and the tiny sweep has two).
- hook time: each callback's ``on_train_batch_start`` and ``on_train_batch_end`` are wrapped with
  ``time.perf_counter_ns()`` during a fit of ``TinyAutoencoder``; quoted is the median per step over the
  steps after the first (the first step counts FLOPs in CatalogCallback); goal: <= 50 us per step per
  callback (the EnergyCallback goal).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/workbench.py [--steps 300]``.
Writes ``benchmarks/results/workbench.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime as dt  # noqa: E402
import io  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402

from lightning_energy import EnergyCallback, SimulatedSensor  # noqa: E402
from lightning_energy.callbacks.batch_sample_estimate import BatchSampleEstimate  # noqa: E402
from lightning_energy.callbacks.carbon import CarbonCallback  # noqa: E402
from lightning_energy.callbacks.catalog import CatalogCallback  # noqa: E402
from lightning_energy.callbacks.forecast import ForecastCallback  # noqa: E402
from lightning_energy.cli.main import main  # noqa: E402
from lightning_energy.simulate.example_model import TinyAutoencoder  # noqa: E402
from lightning_energy.io import atomic_write_json  # noqa: E402
from lightning_energy.sweep.runner import quiet_lightning  # noqa: E402

HOOK_GOAL_US = 50.0
SWEEP_GOAL_S = 60.0
HOOKS = ("on_train_batch_start", "on_train_batch_end")


def timed_command(argv: list[str]) -> float:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"command failed: {argv}")
    return time.perf_counter() - start


def wrap_hooks(callback, per_step: list[int]) -> None:
    """Add each step's time inside the callback's per-step hooks to ``per_step`` (ns)."""
    for name in HOOKS:
        original = getattr(callback, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter_ns()
            _original(*args, **kwargs)
            spent = time.perf_counter_ns() - start
            if _name == "on_train_batch_start":
                per_step.append(spent)
            else:
                per_step[-1] += spent

        setattr(callback, name, timed)


def hook_times(steps: int, folder: Path) -> dict[str, float]:
    sensors = [SimulatedSensor("device", 150.0), SimulatedSensor("host", 20.0, scope="host")]
    callbacks = {
        "EnergyCallback (reference)": EnergyCallback(sensors=sensors, verbose=False),
        "CarbonCallback": CarbonCallback(intensity_g_per_kWh=300.0, verbose=False),
        "ForecastCallback": ForecastCallback(verbose=False),
        "CatalogCallback": CatalogCallback(catalog_path=folder / "catalog.sqlite"),
        "BatchSampleEstimate": BatchSampleEstimate(),
    }
    per_step = {name: [] for name in callbacks}
    for name, callback in callbacks.items():
        wrap_hooks(callback, per_step[name])
    model = TinyAutoencoder(n_train=steps * 16, n_val=64, batch_size=16)
    with quiet_lightning():
        trainer = L.Trainer(callbacks=list(callbacks.values()), max_epochs=1, accelerator="cpu", devices=1,
                            default_root_dir=str(folder), enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, logger=False)
        trainer.fit(model)
    return {name: statistics.median(times[1:]) / 1000.0 for name, times in per_step.items()}


def run(steps: int) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tmp = Path(tmp)
        results["sweep_tiny_s"] = timed_command(["sweep", "--config", str(ROOT / "configs" / "sweep_tiny.yaml"),
                                                 "--output-dir", str(tmp / "sweep")])
        runs = sorted(str(p) for p in (tmp / "sweep" / "runs").iterdir())
        results["report_s"] = timed_command(["report", runs[0], "--out", str(tmp / "report")])
        results["compare_s"] = timed_command(["compare", *runs, "--by", "power_limit_W", "--out", str(tmp / "cmp")])
        results["catalog_list_s"] = timed_command(["catalog", "list", "--root", str(tmp / "sweep")])
        results["hook_us_per_step"] = hook_times(steps, tmp)
    return results


def main_benchmark() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = run(args.steps)
    load_after = os.getloadavg()
    print(f"{'what':<34} {'value':>10}  goal")
    print("-" * 60)
    print(f"{'sweep_tiny (16 fits), s':<34} {results['sweep_tiny_s']:>10.2f}  < {SWEEP_GOAL_S:g} s")
    for key in ("report_s", "compare_s", "catalog_list_s"):
        print(f"{key.replace('_s', '') + ' command, s':<34} {results[key]:>10.2f}")
    for name, us in results["hook_us_per_step"].items():
        print(f"{name + ', us/step':<34} {us:>10.1f}  <= {HOOK_GOAL_US:g} us")
    document = {
        "benchmark": "workbench", "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "load_before": load_before,
                    "load_after": load_after},
        "steps": args.steps, "results": results,
        "goals": {"sweep_tiny_s": SWEEP_GOAL_S, "hook_us_per_step": HOOK_GOAL_US},
        "met": {"sweep_tiny": results["sweep_tiny_s"] < SWEEP_GOAL_S,
                "hooks": all(us <= HOOK_GOAL_US for us in results["hook_us_per_step"].values())},
    }
    path = atomic_write_json(ROOT / "benchmarks" / "results" / "workbench.json", document)
    print(f"wrote {path}")


if __name__ == "__main__":
    main_benchmark()
