"""How close the energy predicted before a run comes to the energy the run measures, over several models.

For each config (an MLP, Baler's AE at two sizes from ``baler_lit.models``, a small CNN, a small
transformer; random data of the model's shape, Adam, a fixed batch size) and each repetition:

1. the calibrated prediction (:func:`lightning_energy.predict.probe_run.probe_fit`): two probe epochs of
   2 warm-up + ``--probe-batches`` training batches and 3 validation batches, extrapolated to the plan
   (``--epochs`` epochs of the config's batches, validation every epoch), with its 95 % bound;
2. the real run with the same sensors (:func:`~lightning_energy.predict.probe_run.measure_run`:
   ``on_train_start`` to ``on_train_end``, validation and epoch ends included);
3. once per config, the layer-fit prediction of ``estimate`` (:func:`~lightning_energy.predict.pre_run.
   estimate_energy`) times the run's training steps, for comparison (it prices Linear/Conv layers only), and
   the ratio of the measured energy to the theoretical 45 nm figure (a relative score, not joules).

Printed: per config the mean |error| of each prediction over the repetitions and how often the measured
energy fell inside the calibrated bound; overall the mean absolute error. On a machine without RAPL or NVML
the sensor is the labelled CPU estimate (TDP x load curve): every joule here is then an ESTIMATE, and
prediction and measurement go through that same sensor. ``os.getloadavg()`` is recorded before and after each
run: other work on the machine moves both the probe and the run.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prediction_error.py [--repeats 3] [--epochs 3]``.
Writes ``benchmarks/results/prediction_error.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one CPU thread, set before torch is imported
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baler_lit.models import AE  # noqa: E402
from lightning_energy.io import atomic_write_json  # noqa: E402
from lightning_energy.predict.pre_run import estimate_energy  # noqa: E402
from lightning_energy.predict.probe_run import RunPlan, measure_run, probe_fit  # noqa: E402

torch.set_num_threads(1)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "prediction_error.json"


class Tokens(nn.Module):
    """A small transformer regressor: (batch, 32 tokens, 16 features) -> 1."""

    def __init__(self, d_model: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 128, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 1)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(dim=1))


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(256, 10))


CONFIGS = {  # name -> (model builder, input shape per row, target: "self" (autoencoder) or output width, batch)
    "mlp": (lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                  nn.Linear(256, 1)), (64,), 1, 256),
    "baler_ae_24": (lambda: AE((24,), 15), (24,), "self", 512),
    "baler_ae_wide": (lambda: AE((128,), 32, hidden=(512, 256, 128)), (128,), "self", 512),
    "cnn": (small_cnn, (1, 28, 28), 10, 64),
    "transformer": (Tokens, (32, 16), 1, 32),
}


class Regression(L.LightningModule):
    def __init__(self, net: nn.Module, autoencoder: bool) -> None:
        super().__init__()
        self.net, self.autoencoder = net, autoencoder

    def _loss(self, batch):
        x, y = batch
        out = self.net(x)
        return nn.functional.mse_loss(out, x if self.autoencoder else y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def loaders(name: str, train_batches: int, val_batches: int):
    _, shape, target, batch = CONFIGS[name]
    g = torch.Generator().manual_seed(0)

    def dataset(n):
        x = torch.rand(n * batch, *shape, generator=g)
        y = x if target == "self" else torch.rand(n * batch, target, generator=g)
        return torch.utils.data.TensorDataset(x, y)

    return (torch.utils.data.DataLoader(dataset(train_batches), batch_size=batch),
            torch.utils.data.DataLoader(dataset(val_batches), batch_size=batch))


def module(name: str) -> Regression:
    torch.manual_seed(0)
    builder, _, target, _ = CONFIGS[name]
    return Regression(builder(), target == "self")


def trainer_kwargs(tmp: str) -> dict:
    return {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": tmp}


def run_config(name: str, args) -> dict:
    train, val = loaders(name, args.train_batches, args.val_batches)
    plan = RunPlan(args.epochs, args.train_batches, args.val_batches)
    reps = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            load_before = os.getloadavg()
            estimate = probe_fit(lambda: module(name), train, plan, val, probe_batches=args.probe_batches,
                                 **trainer_kwargs(tmp))

            def fit(marks, tmp=tmp):
                trainer = L.Trainer(max_epochs=args.epochs, num_sanity_val_steps=0, callbacks=[marks],
                                    **trainer_kwargs(tmp))
                trainer.fit(module(name), train, val)

            measured_J, measured_s, provenance = measure_run(fit)
            reps.append({"predicted_J": estimate.predicted_J, "bound_J": estimate.bound_J, "measured_J": measured_J,
                         "measured_s": measured_s, "error": (estimate.predicted_J - measured_J) / measured_J,
                         "inside_bound": abs(estimate.predicted_J - measured_J) <= estimate.bound_J,
                         "statistical_J": estimate.statistical_J,
                         "inside_statistical": abs(estimate.predicted_J - measured_J) <= estimate.statistical_J,
                         "probe_J": estimate.probe.total_J, "probe_s": estimate.probe.total_s,
                         "provenance": provenance, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                         "parts_J": estimate.parts_J})
        # the layer-fit estimate (estimate's "empirical"), once: training steps x its energy per step
        builder, shape, _, batch = CONFIGS[name]
        pre_run = estimate_energy(builder(), torch.rand(batch, *shape), args.epochs * args.train_batches,
                                  min_seconds=args.bench_seconds)
        layer_fit, theoretical = pre_run.empirical, pre_run.theoretical
    measured = statistics.fmean(r["measured_J"] for r in reps)
    return {"config": name, "plan": vars(plan) if hasattr(plan, "__dict__") else str(plan), "repeats": reps,
            "mae": statistics.fmean(abs(r["error"]) for r in reps),
            "inside_bound": sum(r["inside_bound"] for r in reps),
            "inside_statistical": sum(r["inside_statistical"] for r in reps),
            "layer_fit_J": layer_fit.training_J, "layer_fit_error": (layer_fit.training_J - measured) / measured,
            "layer_fit_coverage": layer_fit.coverage,
            "theoretical_45nm_J": theoretical.training_J, "measured_over_theoretical": measured / theoretical.training_J}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-batches", type=int, default=40)
    parser.add_argument("--val-batches", type=int, default=10)
    parser.add_argument("--probe-batches", type=int, default=10)
    parser.add_argument("--bench-seconds", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")  # Lightning's tips about workers and logging intervals
    results = [run_config(name, args) for name in args.configs]
    provenance = sorted({r["provenance"] for c in results for r in c["repeats"]})
    print(f"Predicted vs measured energy, {args.epochs} epochs x {args.train_batches} batches + {args.val_batches} "
          f"validation batches per epoch, {args.repeats} repetitions, 1 thread; joules: {', '.join(provenance)}")
    print(f"  {'config':<15}{'measured J':>12}{'calibrated J':>14}{'stat bnd':>9}{'|err| mean':>12}{'in stat/all/n':>14}"
          f"{'layer-fit err':>15}{'load 1 min':>12}{'meas/45nm':>14}")
    for c in results:
        reps = c["repeats"]
        print(f"  {c['config']:<15}{statistics.fmean(r['measured_J'] for r in reps):>12.4g}"
              f"{statistics.fmean(r['predicted_J'] for r in reps):>14.4g}"
              f"{statistics.fmean(r['statistical_J'] / r['predicted_J'] for r in reps):>9.1%}{c['mae']:>12.1%}"
              f"{c['inside_statistical']:>4}/{c['inside_bound']}/{len(reps)}{c['layer_fit_error']:>+15.1%}"
              f"{statistics.fmean(r['loadavg_before'][0] for r in reps):>12.2f}"
              f"{c['measured_over_theoretical']:>14.3g}")
    overall = statistics.fmean(abs(r["error"]) for c in results for r in c["repeats"])
    layer_overall = statistics.fmean(abs(c["layer_fit_error"]) for c in results)
    print(f"  mean absolute error: calibrated {overall:.1%}, layer fit {layer_overall:.1%}; "
          f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "threads": 1, "warmup_batches": 2, "probe_val_batches": 3, "confidence": 0.95},
        "provenance": provenance,
        "mean_absolute_error": overall,
        "layer_fit_mean_absolute_error": layer_overall,
        "configs": results,
    }
    print(f"written: {atomic_write_json(args.out, result)}")


if __name__ == "__main__":
    main()
