"""End-to-end demo: ``python -m baler_lit.demo`` (what ``make demo`` runs).

On the embedded synthetic CMS-jet table, with :class:`lightning_energy.EnergyCallback`,
:class:`~lightning_energy.callbacks.carbon.CarbonCallback` and
:class:`~lightning_energy.callbacks.forecast.ForecastCallback` attached:

1. writes the table to ``<out>/data.npz`` (Baler's layout),
2. trains Baler's AE (float32, batch 512) and keeps the best checkpoint,
3. compresses the data to ``<out>/data.baler``, decompresses it to ``<out>/restored.npz``,
4. evaluates: per-column errors, Baler's plots and the ratio / error trade-off in ``<out>/report/``,
5. prints what the tool is for, side by side: the compression ratio and the reconstruction error (per
   column, worst columns named), the energy of the fit, its CO2e (CodeCarbon's offline intensity of the
   country given by ``--country``, default Switzerland, where CERN's main site is; no network) and the
   forecast made after the first epoch against what the fit took.

TensorBoard logs (losses, energy metrics, evaluation figures) go to ``<out>/tb/version_N``; view them with
``.venv/bin/tensorboard --logdir runs/demo`` (the command the demo prints works as printed). Files from an earlier demo run in the same folder are replaced. On 2 CPU
cores the default settings finish in well under 2 minutes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

DEFAULT_OUT = Path("runs/demo")
DEFAULT_ROWS = 50_000
DEFAULT_EPOCHS = 25
DEFAULT_COUNTRY = "CHE"  # ISO 3166 alpha-3; CodeCarbon's offline per-country intensity



def tensorboard_command() -> str:
    """How to start TensorBoard from the current folder: ``tensorboard`` when that name on PATH is the one beside
    this interpreter, else that one's path (``.venv/bin/tensorboard`` after ``make demo`` without an activated
    venv), relative to the current folder when it lies below it."""
    beside = Path(sys.executable).parent / "tensorboard"
    on_path = shutil.which("tensorboard")
    if on_path is not None and Path(on_path).resolve() == beside.resolve():
        return "tensorboard"
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m baler_lit.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: runs/demo)")
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="synthetic jets to generate")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="training epochs")
    p.add_argument("--latent-dtype", default="float16", choices=["float64", "float32", "float16", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--country", default=DEFAULT_COUNTRY,
                   help="ISO 3166 alpha-3 code of the grid for the CO2e figure (default CHE, offline data)")
    return p


def run(
    out: Path = DEFAULT_OUT,
    rows: int = DEFAULT_ROWS,
    epochs: int = DEFAULT_EPOCHS,
    latent_dtype: str = "float16",
    seed: int = 0,
    country: str = DEFAULT_COUNTRY,
) -> dict:
    """Run the whole chain; return a dict with paths, ratio, errors and the energy report."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning_energy import EnergyCallback
    from lightning_energy.callbacks.carbon import CarbonCallback
    from lightning_energy.callbacks.forecast import ForecastCallback

    from .cli import load_checkpoint
    from .compression import compress, decompress, read_compressed
    from .data import BalerDataModule
    from .evaluate import error_headline, evaluate, format_summary
    from .module import BalerModule
    from .synthetic import synthetic_cms_jets
    from .table import save_npz

    start = time.perf_counter()
    # Lightning 2.6 deprecation noise from its own pytree helper; says nothing about the demo
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_path, baler_path, restored_path = out / "data.npz", out / "data.baler", out / "restored.npz"
    report_dir, ckpt_dir = out / "report", out / "checkpoints"
    for stale in (report_dir, ckpt_dir):
        shutil.rmtree(stale, ignore_errors=True)

    L.seed_everything(seed, verbose=False)
    table = synthetic_cms_jets(rows, seed)
    save_npz(data_path, table, overwrite=True)
    print(f"[1/5] data: {rows} synthetic CMS jets × {table.n_columns} columns → {data_path}")

    datamodule = BalerDataModule(path=str(data_path), batch_size=512, val_fraction=0.2, seed=seed)
    module = BalerModule(input_shape=datamodule.input_shape, step_log_interval=10)
    energy = EnergyCallback()
    carbon = CarbonCallback(country_iso_code=country, verbose=False)
    forecast = ForecastCallback(verbose=False)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val/loss", mode="min")
    logger = TensorBoardLogger(save_dir=str(out), name="tb")
    trainer = L.Trainer(
        max_epochs=epochs,
        logger=logger,
        callbacks=[energy, carbon, forecast, checkpoint],
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    print(f"[2/5] training AE {table.n_columns}→{module.latent_dim} for {epochs} epochs (logs: {logger.log_dir})")
    trainer.fit(module, datamodule)
    val_loss = float(trainer.callback_metrics["val/loss"])

    best = load_checkpoint(checkpoint.best_model_path)
    result = compress(best.model, best.normalizer, table, baler_path, latent_dtype, dict(best.hparams), overwrite=True)
    print(f"[3/5] compressed → {baler_path} ({result.file_bytes} bytes) in {result.seconds:.3f} s")
    restored = decompress(baler_path, restored_path, overwrite=True)
    print(f"[4/5] decompressed → {restored_path}")
    summary = evaluate(
        table, restored, report_dir, read_compressed(baler_path), tensorboard_dir=logger.log_dir, overwrite=True
    )
    print(f"[5/5] evaluation → {report_dir}")
    print(format_summary(summary))
    report = energy.report
    print()
    print(f"compression ratio (whole file, latent {latent_dtype}): {result.ratio:.3f}")
    print(f"reconstruction error: {error_headline(summary)}; val/loss {val_loss:.4f} (Baler's per-batch loss)")
    print(energy_line(report, energy.report_path))
    print(carbon_line(carbon.report))
    print(forecast_line(forecast.report, forecast.forecasts))
    print(f"TensorBoard: {tensorboard_command()} --logdir {out}  (HParams: energy per run; Text: the report and the "
          "evaluation)")
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return {
        "ratio": result.ratio,
        "val_loss": val_loss,
        "mean_norm_rms": summary["mean_norm_rms"],
        "energy_J": report["total_J"],
        "carbon_gCO2e": carbon.report["total_gCO2e"],
        "carbon_intensity": carbon.report["intensity"],
        "forecast": forecast.report,
        "energy_report": str(energy.report_path),
        "log_dir": logger.log_dir,
        "checkpoint": checkpoint.best_model_path,
        "compressed": str(baler_path),
        "restored": str(restored_path),
        "report_dir": str(report_dir),
    }


def energy_line(report: dict, report_path) -> str:
    """The demo's energy line (one function, so how the energy was obtained is labelled in one place)."""
    from lightning_energy.provenance import of_report, tagged  # measured / estimated / simulated

    energy = tagged(format(report["total_J"], ".1f") + " J", of_report(report))
    return f"energy: {energy} for the whole fit (breakdown in the report above: {report_path})"


def carbon_line(carbon_report: dict) -> str:
    """CO2e of the fit, the intensity and where it came from (country, offline data), estimated or not."""
    intensity = carbon_report["intensity"]
    estimated = " (from ESTIMATED energy)" if carbon_report.get("estimated") else ""
    return (f"CO2e: {carbon_report['total_gCO2e']:.3g} g{estimated} for {carbon_report['total_J']:.1f} J at "
            f"{intensity['label']} (offline, no network), PUE {carbon_report['pue']:g}")


def forecast_line(forecast_report: dict | None, forecasts: list) -> str:
    """The first forecast (made after epoch 1) beside what the fit took."""
    if not forecast_report or not forecasts:
        return "forecast: none (the fit ended before the first forecast)"
    first = next((f for f in forecasts if f.epoch is not None), forecasts[0])
    actual = forecast_report["actual"]
    when = f"after epoch {first.epoch + 1}" if first.epoch is not None else f"after {first.batches_done} batches"
    off = (first.total_J - actual["total_J"]) / actual["total_J"] if actual["total_J"] > 0 else float("nan")
    return (f"forecast {when} of {forecast_report['plan'].get('epochs')}: {first.total_J:.1f} J, {first.total_s:.1f} s, "
            f"{first.total_gCO2e:.3g} gCO2e; the fit took {actual['total_J']:.1f} J, {actual['total_s']:.1f} s "
            f"(forecast off by {off:+.1%})")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.rows < 10 or args.epochs < 1:
        print("demo: error: --rows must be >= 10 and --epochs >= 1", file=sys.stderr)
        return 2
    run(args.out, args.rows, args.epochs, args.latent_dtype, args.seed, args.country)
    return 0


if __name__ == "__main__":
    sys.exit(main())
