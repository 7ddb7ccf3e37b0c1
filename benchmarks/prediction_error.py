"""How close the energy predicted before training comes to the energy a real fit measures.

Baler's autoencoder (24-200-100-50-15-50-100-200-24, LeakyReLU; built here with plain ``nn`` so the
benchmark depends on ``lightning_energy`` only) is trained with Adam on uniform random data of Baler's
shape (24 columns, batch 512). Before the fit, :func:`lightning_energy.predict.pre_run.estimate_energy`
benchmarks Linear and Conv2d layers on this device with the auto-detected sensors and predicts the energy
per step; during the fit ``EnergyPredictionCheck`` measures the training steps with the same sensors,
``FlopsCallback`` the FLOP rate, MFU and energy per GFLOP. Printed: the fits (a, b, R^2), predicted and
measured step energy, the relative error of both predictions, MFU. On a machine without RAPL or NVML the
sensor is the labelled CPU estimate (TDP x load curve), so every joule here is an ESTIMATE.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prediction_error.py [--rows 32768] [--epochs 3]``.
Writes ``benchmarks/results/prediction_error.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # one CPU thread, set before torch is imported
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_energy.callbacks.flops import FlopsCallback  # noqa: E402
from lightning_energy.callbacks.prediction_check import EnergyPredictionCheck  # noqa: E402
from lightning_energy.io import atomic_write_json  # noqa: E402
from lightning_energy.predict.pre_run import estimate_energy  # noqa: E402

torch.set_num_threads(1)
N_COLUMNS, LATENT, BATCH = 24, 15, 512
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "prediction_error.json"


def autoencoder() -> nn.Sequential:
    sizes = [N_COLUMNS, 200, 100, 50, LATENT]

    def stack(s):
        layers = []
        for i, (a, b) in enumerate(zip(s, s[1:])):
            layers += [nn.Linear(a, b)] + ([nn.LeakyReLU(0.01)] if i < len(s) - 2 else [])
        return nn.Sequential(*layers)

    return nn.Sequential(stack(sizes), stack(sizes[::-1]))


class AutoencoderModule(L.LightningModule):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.net = autoencoder().to(dtype)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return ((self.net(x) - x) ** 2).sum() / N_COLUMNS  # Baler's applied loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--bench-seconds", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    data = torch.rand(args.rows, N_COLUMNS, generator=torch.Generator().manual_seed(0), dtype=dtype)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=BATCH)
    steps = len(loader) * args.epochs

    estimate = estimate_energy(autoencoder().to(dtype), data[:BATCH], steps, min_seconds=args.bench_seconds)
    check, flops = EnergyPredictionCheck(estimate), FlopsCallback()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's tips about workers and logging intervals
        trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp, callbacks=[check, flops])
        trainer.fit(AutoencoderModule(dtype), loader)
    measured = check.result
    measured_step_J = measured["measured_J"] / measured["steps"]
    empirical, theoretical = estimate.empirical, estimate.theoretical
    rows = [
        ("predicted step energy, empirical", f"{empirical.step_J * 1e3:.3f} mJ"),
        ("predicted step energy, theoretical (45 nm)", f"{theoretical.step_J * 1e3:.6f} mJ"),
        ("measured step energy", f"{measured_step_J * 1e3:.3f} mJ"),
        ("error of the empirical prediction", f"{measured['error']:+.1%}"),
        ("error of the theoretical prediction", f"{(theoretical.step_J - measured_step_J) / measured_step_J:+.1%}"),
        ("FLOPs covered by the fits", f"{empirical.coverage:.1%}"),
        *[(f"fit {k}: a (J/MAC), b (J), R^2", f"{f.a_J_per_MAC:.3e}, {f.b_J:.3e}, {f.r2:.4f}")
          for k, f in sorted(empirical.fits.items())],
        ("MFU, last epoch", f"{flops.epochs[-1]['flops/mfu']:.2%} of {flops.peak.flops_per_s / 1e9:.1f} GFLOP/s"),
        ("energy per GFLOP, last epoch", f"{flops.epochs[-1]['energy/J_per_GFLOP']:.3f} J"),
        ("sensors", ", ".join(empirical.sensors) + (" (ESTIMATE)" if empirical.estimated else "")),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"Prediction vs measurement, Baler AE, {steps} steps of batch {BATCH}, {args.dtype}, 1 thread")
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "steps": steps},
        "estimate": estimate.as_dict(),
        "measured": measured,
        "flops_epochs": flops.epochs,
        "peak": {"flops_per_s": flops.peak.flops_per_s, "source": flops.peak.source},
    }
    print(f"written: {atomic_write_json(args.out, result)}")


if __name__ == "__main__":
    main()
