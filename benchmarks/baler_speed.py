"""Speed of baler_lit against a Baler-style loop: training, compression, decompression, memory.

Data: the synthetic CMS-jet table of ``baler_lit.synthetic`` (same shape and kinds of columns as Baler's CMS
set: 24 columns, 15 float, 9 integer, heavy tails), 100k rows for training and compression, 400k rows for the
linearity check. One CPU thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), batch 512, 5 epochs.

Training variants (each trains the same AE 24→200→100→50→15 from the same seed):

- ``baler_style_f64``: Baler's loop re-created: float64, ``DataLoader(TensorDataset)`` without shuffling
  (per-sample indexing + collate), Adam (for-loop), ``loss.item()`` every step;
- ``plain_lightning``: a straightforward LightningModule: float32, shuffled ``DataLoader``, ``self.log``
  every step, default Adam;
- ``baler_lit_f32``: ``BalerModule`` + ``BalerDataModule`` (on-device table, index-sliced batches, fused Adam,
  epoch-mean logging) in float32;
- ``baler_lit_f32_fixed_order``: the same without shuffling (Baler's batch order), to separate the effect of
  shuffling on the 5-epoch loss from that of float32 and of the faster loop;
- ``baler_lit_f64``: the same in float64;
- ``raw_torch_f32``: the same model and batches in a bare PyTorch loop (no Lightning): the framework floor;
- ``gemm_floor_f32``: only the 23 matrix products of each step (forward, weight and input gradients): the
  arithmetic floor of this model at batch 512 on this CPU.

Reported per variant: seconds per epoch (median of epochs 2..N; epoch 1 includes warm-up), samples/s,
the loss of the last epoch (mean of Baler's per-batch Σ(x̂−x)²/24), wall and thread-CPU seconds.
Compression: ``compress``/``decompress`` of 100k and 400k rows (median of 7 after one warm-up, function calls
including file I/O), MB/s of original data, the whole-file compression ratio, and the 400k/100k time ratio
(linear: ≤ 4.4).
Peak RSS (MB) after each phase. On a CUDA machine, also samples/s of ``baler_lit`` float32 at batch 512 on
520k rows.

Reference figures for the original Baler on this kind of machine (../shared/CONTEXT.md): 2.07–2.66 s per
epoch, loss 0.77 after 5 epochs (real CMS data), compress 1.5–1.8 s and decompress 1.0 s at 100k rows,
growing 4.7× and 6.9× at 400k rows.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/baler_speed.py`` (about 5 minutes; ``--loss-seeds 1``
for a quicker run).
Writes ``benchmarks/results/baler_speed.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from baler_lit import __version__  # noqa: E402
from baler_lit.compression import compress, decompress  # noqa: E402
from baler_lit.data import BalerDataModule, TensorBatches  # noqa: E402
from baler_lit.models import build_model  # noqa: E402
from baler_lit.module import BalerModule  # noqa: E402
from baler_lit.synthetic import synthetic_cms_jets  # noqa: E402
from baler_lit.table import Table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "baler_speed.json"
#: Goals from the issue (1 thread, 100k × 24, batch 512).
GOAL_EPOCH_S = 0.5
GOAL_CODEC_SPEEDUP = 5.0
GOAL_LINEAR = 4.4
GOAL_GPU_SAMPLES_S = 2e6
#: Original Baler figures measured on this kind of machine (../shared/CONTEXT.md).
ORIGINAL = {"epoch_s": (2.07, 2.66), "loss_5_epochs": 0.77, "compress_s": (1.5, 1.8), "decompress_s": 1.0}

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class EpochTimer:
    """Wall and thread-CPU seconds of each training epoch, plus the epoch's mean batch loss."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []

    def start(self) -> None:
        self._t, self._c = time.perf_counter(), time.thread_time()

    def stop(self, loss: float) -> None:
        self.wall.append(time.perf_counter() - self._t)
        self.cpu.append(time.thread_time() - self._c)
        self.losses.append(loss)

    def summary(self, rows: int) -> dict:
        steady = self.wall[1:] or self.wall
        per_epoch = statistics.median(steady)
        return {
            "s_per_epoch": per_epoch,
            "s_per_epoch_min": min(steady),
            "cpu_s_per_epoch": statistics.median(self.cpu[1:] or self.cpu),
            "first_epoch_s": self.wall[0],
            "samples_per_s": rows / per_epoch,
            "final_loss": self.losses[-1],
            "epoch_s": self.wall,
            "losses": self.losses,
        }


class TimerCallback(L.Callback):
    def __init__(self, timer: EpochTimer) -> None:
        self.timer = timer

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.timer.start()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.timer.stop(float(trainer.callback_metrics["train/loss"]))


def normalised(table: Table, dtype) -> torch.Tensor:
    lo, hi = table.data.min(axis=0), table.data.max(axis=0)
    scale = np.where(hi > lo, hi - lo, 1.0)
    return torch.from_numpy(((table.data - lo) / scale).astype(dtype))


def quiet_trainer(epochs: int, callbacks: list, accelerator: str = "cpu") -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


# -- training variants ------------------------------------------------------------------------------------
def baler_style(table: Table, epochs: int, batch: int, seed: int = 0) -> dict:
    """Baler's loop: float64, unshuffled DataLoader over a TensorDataset, item() per step."""
    torch.manual_seed(seed)
    x = normalised(table, np.float64)
    model = build_model("AE", (24,), dtype="float64")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    loader = DataLoader(TensorDataset(x), batch_size=batch, shuffle=False)
    timer = EpochTimer()
    for _ in range(epochs):
        timer.start()
        running = 0.0
        for (b,) in loader:
            loss = F.mse_loss(model(b), b, reduction="sum") / b.shape[1]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item()
        timer.stop(running / len(loader))
    return timer.summary(len(x))


class PlainModule(L.LightningModule):
    """What a first Lightning port looks like: log every step, DataLoader batches, default Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model("AE", (24,))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = F.mse_loss(self.model(x), x, reduction="sum") / x.shape[1]
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def plain_lightning(table: Table, epochs: int, batch: int) -> dict:
    torch.manual_seed(0)
    x = normalised(table, np.float32)
    loader = DataLoader(TensorDataset(x), batch_size=batch, shuffle=True)
    timer = EpochTimer()
    quiet_trainer(epochs, [TimerCallback(timer)]).fit(PlainModule(), loader)
    return timer.summary(len(x))


def baler_lit(
    table: Table,
    epochs: int,
    batch: int,
    dtype: str,
    accelerator: str = "cpu",
    seed: int = 0,
    shuffle: bool = True,
) -> tuple[dict, BalerModule]:
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.npz"
        np.savez(path, data=table.data, names=np.array(table.names), dtypes=np.array(table.dtypes))
        dm = BalerDataModule(str(path), batch_size=batch, val_fraction=0.0, seed=seed, shuffle=shuffle)
        module = BalerModule(input_shape=dm.input_shape, dtype=dtype)
        timer = EpochTimer()
        quiet_trainer(epochs, [TimerCallback(timer)], accelerator).fit(module, dm)
    return timer.summary(table.n_rows), module


def raw_torch(table: Table, epochs: int, batch: int) -> dict:
    torch.manual_seed(0)
    x = normalised(table, np.float32)
    model = build_model("AE", (24,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    loader = TensorBatches(x, batch, shuffle=True)
    timer = EpochTimer()
    for _ in range(epochs):
        timer.start()
        total = torch.zeros(())
        for b in loader:
            loss = F.mse_loss(model(b), b, reduction="sum") / b.shape[1]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        timer.stop(float(total) / len(loader))
    return timer.summary(len(x))


def gemm_floor(rows: int, epochs: int, batch: int) -> dict:
    """Only the matrix products of each training step of the AE (float32)."""
    sizes = [24, 200, 100, 50, 15, 50, 100, 200, 24]
    weights = [torch.rand(sizes[i + 1], sizes[i]) for i in range(8)]
    acts = [torch.rand(batch, s) for s in sizes]
    steps = -(-rows // batch)
    timer = EpochTimer()
    for _ in range(epochs):
        timer.start()
        for _ in range(steps):
            for i in range(8):
                torch.mm(acts[i], weights[i].t())  # forward
                torch.mm(acts[i + 1].t(), acts[i])  # weight gradient
                if i:
                    torch.mm(acts[i + 1], weights[i])  # input gradient (not needed for the first layer)
        timer.stop(float("nan"))
    return timer.summary(rows)


# -- compression ------------------------------------------------------------------------------------------
def codec(module: BalerModule, table: Table, latent_dtype: str, reps: int) -> dict:
    model = module.model.cpu()
    with tempfile.TemporaryDirectory() as tmp:
        c_times, d_times = [], []
        for rep in range(reps + 1):  # the first round warms caches and the allocator; not timed
            path = Path(tmp) / "data.baler"
            t = time.perf_counter()
            result = compress(model, module.normalizer, table, path, latent_dtype, dict(module.hparams), overwrite=True)
            c_times.append(time.perf_counter() - t)
            out = Path(tmp) / "restored.npz"
            t = time.perf_counter()
            decompress(path, out, overwrite=True)
            d_times.append(time.perf_counter() - t)
            if rep == 0:
                c_times.clear()
                d_times.clear()
    mb = table.original_nbytes / 1e6
    return {
        "rows": table.n_rows,
        "latent_dtype": latent_dtype,
        "compress_s": statistics.median(c_times),
        "decompress_s": statistics.median(d_times),
        "compress_MB_s": mb / statistics.median(c_times),
        "decompress_MB_s": mb / statistics.median(d_times),
        "original_MB": mb,
        "file_MB": result.file_bytes / 1e6,
        "ratio": result.ratio,
    }


# -- report -----------------------------------------------------------------------------------------------
def print_table(results: dict) -> None:
    print(
        f"\nTraining: {results['rows']} rows × 24, batch {results['batch_size']}, {results['epochs']} epochs,"
        f" {results['threads']} thread(s)"
    )
    print(f"{'variant':<18} {'s/epoch':>8} {'min':>7} {'cpu s':>7} {'samples/s':>10} {'loss':>8}")
    for name, r in results["training"].items():
        loss = "-" if r["final_loss"] != r["final_loss"] else f"{r['final_loss']:.4f}"
        print(
            f"{name:<18} {r['s_per_epoch']:8.3f} {r['s_per_epoch_min']:7.3f} {r['cpu_s_per_epoch']:7.3f}"
            f" {r['samples_per_s']:10.0f} {loss:>8}"
        )
    for name, losses in results["loss_by_seed"].items():
        print(f"loss after {results['epochs']} epochs, {name}, by seed: " + ", ".join(f"{x:.4f}" for x in losses))
    print("\nCompression (function calls incl. file I/O, median of reps)")
    print(f"{'rows':>7} {'latent':>8} {'compress s':>10} {'MB/s':>7} {'decompress s':>12} {'MB/s':>7} {'ratio':>6}")
    for r in results["compression"]:
        print(
            f"{r['rows']:7d} {r['latent_dtype']:>8} {r['compress_s']:10.3f} {r['compress_MB_s']:7.1f}"
            f" {r['decompress_s']:12.3f} {r['decompress_MB_s']:7.1f} {r['ratio']:6.2f}"
        )
    lin = results["linearity"]
    print(
        f"{lin['rows_ratio']:.0f}× rows → time × {lin['compress']:.2f} (compress), × {lin['decompress']:.2f}"
        f" (decompress); goal ≤ {GOAL_LINEAR}"
    )
    print(f"peak RSS (MB): {results['peak_rss_MB']}")
    if results.get("gpu"):
        g = results["gpu"]
        print(f"GPU {g['device']}: {g['samples_per_s']:.0f} samples/s at batch {g['batch_size']} on {g['rows']} rows")
    print("\nGoals:")
    for k, v in results["goals"].items():
        print(f"  {k}: {v}")


def epoch_goal(training: dict) -> str:
    """The s/epoch goal with the floors that bound it on this CPU (matrix products; bare PyTorch loop)."""
    ours = training["baler_lit_f32"]["s_per_epoch"]
    gemm = training["gemm_floor_f32"]["s_per_epoch"]
    raw = training["raw_torch_f32"]["s_per_epoch"]
    verdict = "met" if ours <= GOAL_EPOCH_S else "NOT met"
    return (
        f"{ours:.3f} s → {verdict}; floors on this CPU: the step's matrix products alone {gemm:.3f} s,"
        f" a bare PyTorch loop (same model, batches, fused Adam, no Lightning) {raw:.3f} s"
    )


def loss_goal(loss_by_seed: dict) -> str:
    """Median 5-epoch loss per variant and a one-sided Mann-Whitney test of "ours is worse"."""
    from scipy.stats import mannwhitneyu

    ours = loss_by_seed["baler_lit_f32"]
    fixed = loss_by_seed["baler_lit_f32_fixed_order"]
    text = (
        f"median over {len(ours)} seeds: baler_lit f32 shuffled {statistics.median(ours):.4f},"
        f" fixed order {statistics.median(fixed):.4f}; original Baler (real CMS data) {ORIGINAL['loss_5_epochs']}"
    )
    ref = loss_by_seed.get("baler_style_f64")
    if not ref:
        return text + "; Baler-style loop skipped"
    p_worse = mannwhitneyu(ours, ref, alternative="greater").pvalue
    if statistics.median(ours) <= statistics.median(ref):
        verdict = "met"
    else:
        verdict = "met within seed noise (not significantly worse)" if p_worse > 0.05 else "NOT met"
    return (
        text + f"; Baler-style f64 loop on the same data {statistics.median(ref):.4f}; one-sided Mann-Whitney"
        f" p(ours worse) = {p_worse:.2f} → {verdict}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--big-rows", type=int, default=400_000)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--codec-reps", type=int, default=7, help="timed compress/decompress repetitions (median is kept)")
    p.add_argument("--gpu-rows", type=int, default=520_000)
    p.add_argument("--skip-baler-style", action="store_true", help="skip the slow Baler-style reference loop")
    p.add_argument(
        "--loss-seeds", type=int, default=8,
        help="seeds for the loss comparison (the loss after 5 epochs varies by up to 4x between seeds)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    load_start = load_average()
    table = synthetic_cms_jets(args.rows, seed=0)
    rss = {"data": round(peak_rss_mb(), 1)}
    training: dict[str, dict] = {}
    if not args.skip_baler_style:
        training["baler_style_f64"] = baler_style(table, args.epochs, args.batch_size)
    training["plain_lightning"] = plain_lightning(table, args.epochs, args.batch_size)
    training["baler_lit_f32"], module32 = baler_lit(table, args.epochs, args.batch_size, "float32")
    training["baler_lit_f64"], _ = baler_lit(table, args.epochs, args.batch_size, "float64")
    training["raw_torch_f32"] = raw_torch(table, args.epochs, args.batch_size)
    training["gemm_floor_f32"] = gemm_floor(args.rows, args.epochs, args.batch_size)
    training["baler_lit_f32_fixed_order"], _ = baler_lit(table, args.epochs, args.batch_size, "float32", shuffle=False)
    loss_by_seed = {
        name: [training[name]["final_loss"]]
        for name in ("baler_style_f64", "baler_lit_f32", "baler_lit_f32_fixed_order")
        if name in training
    }
    for seed in range(1, args.loss_seeds):
        ours, _ = baler_lit(table, args.epochs, args.batch_size, "float32", seed=seed)
        loss_by_seed["baler_lit_f32"].append(ours["final_loss"])
        fixed, _ = baler_lit(table, args.epochs, args.batch_size, "float32", seed=seed, shuffle=False)
        loss_by_seed["baler_lit_f32_fixed_order"].append(fixed["final_loss"])
        if not args.skip_baler_style:
            loss_by_seed["baler_style_f64"].append(baler_style(table, args.epochs, args.batch_size, seed)["final_loss"])
    rss["training"] = round(peak_rss_mb(), 1)

    big = synthetic_cms_jets(args.big_rows, seed=1)
    compression = [
        codec(module32, table, "float32", args.codec_reps),
        codec(module32, big, "float32", args.codec_reps),
        codec(module32, table, "float16", args.codec_reps),
    ]
    rss["compression"] = round(peak_rss_mb(), 1)
    scale = args.big_rows / args.rows
    linearity = {
        "rows_ratio": scale,
        "compress": compression[1]["compress_s"] / compression[0]["compress_s"],
        "decompress": compression[1]["decompress_s"] / compression[0]["decompress_s"],
    }

    gpu = None
    if torch.cuda.is_available():
        gpu_table = synthetic_cms_jets(args.gpu_rows, seed=2)
        summary, _ = baler_lit(gpu_table, 3, args.batch_size, "float32", accelerator="gpu")
        gpu = {
            "device": torch.cuda.get_device_name(0),
            "rows": args.gpu_rows,
            "batch_size": args.batch_size,
            **summary,
            "goal_samples_per_s": GOAL_GPU_SAMPLES_S,
        }

    f32 = training["baler_lit_f32"]
    goals = {
        "epoch_f32_s<=0.5": epoch_goal(training),
        "loss_no_worse_than_baler_style": loss_goal(loss_by_seed),
        "compress_>=5x_original": f"{ORIGINAL['compress_s'][0] / compression[0]['compress_s']:.1f}× vs 1.5 s",
        "decompress_>=5x_original": f"{ORIGINAL['decompress_s'] / compression[0]['decompress_s']:.1f}× vs 1.0 s",
        "linear_400k/100k<=4.4": f"compress {linearity['compress']:.2f}×, decompress {linearity['decompress']:.2f}×",
    }
    results = {
        "benchmark": "baler_speed",
        "baler_lit_version": __version__,
        "rows": args.rows,
        "big_rows": args.big_rows,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "training": training,
        "loss_by_seed": loss_by_seed,
        "compression": compression,
        "linearity": linearity,
        "peak_rss_MB": rss,
        "gpu": gpu,
        "original_reference": ORIGINAL,
        "goals": goals,
        "machine": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "lightning": L.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_average_start": load_start,
            "load_average_end": load_average(),
        },
    }
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, args.out)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
