"""Per-layer activation statistics of a trained model: Baler's ``--mode diagnose``, for every baler_lit model.

Baler records the outputs of its hidden layers (after LeakyReLU) during training and plots the mean activation
of every node as a "Neural Activation Pattern" heat map (layers × nodes). Here the trained model runs over the
data (normalised as in training, in chunks, no autograd) with forward hooks on every hidden activation, the
latent code and the output, and for each of these layers records:

- the mean activation of each node (unit of a dense layer, channel of a convolution, feature of a transformer
  token) over all samples (and pixels / tokens),
- the layer's mean, standard deviation, minimum and maximum, and the fraction of values ≤ 0 (inactive units of
  a ReLU-like layer; a layer near 1 is mostly dead).

Outputs (in ``out_dir``): ``diagnostics.png`` (the heat map and the per-layer statistics), ``summary.json``;
optionally TensorBoard histograms of each layer's node means, the figure and the scalars. Activations are
dimensionless (the model works on min-max normalised data).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from .errors import BalerInputError
from .models import BalerAutoencoder
from .normalization import MinMaxNormalizer
from .table import Table

#: Modules whose output is a hidden activation worth recording.
ACTIVATIONS = (nn.LeakyReLU, nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.TransformerEncoderLayer)
#: Samples per forward pass while collecting statistics.
CHUNK_SAMPLES = 4096


class _LayerStats:
    """Running sums of one layer's activations: per node (sum, count) and overall (sum, sum², min, max, ≤0)."""

    def __init__(self, node_dim: int) -> None:
        self.node_dim = node_dim
        self.node_sum: torch.Tensor | None = None
        self.node_count = 0
        self.total = self.total_sq = 0.0
        self.count = self.inactive = 0
        self.low, self.high = math.inf, -math.inf

    def add(self, out: torch.Tensor) -> None:
        x = out.detach().to(torch.float64)
        moved = x.movedim(self.node_dim, -1)
        per_node = moved.reshape(-1, moved.shape[-1])
        sums = per_node.sum(dim=0)
        self.node_sum = sums if self.node_sum is None else self.node_sum + sums
        self.node_count += per_node.shape[0]
        self.total += float(x.sum())
        self.total_sq += float((x * x).sum())
        self.count += x.numel()
        self.inactive += int((x <= 0).sum())
        self.low, self.high = min(self.low, float(x.min())), max(self.high, float(x.max()))

    def summary(self, name: str) -> dict[str, Any]:
        mean = self.total / self.count
        return {
            "layer": name,
            "nodes": int(self.node_sum.numel()),
            "mean": mean,
            "std": math.sqrt(max(self.total_sq / self.count - mean * mean, 0.0)),
            "min": self.low,
            "max": self.high,
            "inactive_fraction": self.inactive / self.count,
            "node_means": (self.node_sum / self.node_count).tolist(),
        }


def _recorded_layers(model: BalerAutoencoder) -> list[tuple[str, nn.Module, int]]:
    """(name, module, node dimension) of each hidden activation, in forward order within encoder then decoder."""
    layers = []
    for part in ("encoder", "decoder"):
        for name, module in getattr(model, part).named_modules():
            if isinstance(module, ACTIVATIONS):
                node_dim = -1 if isinstance(module, nn.TransformerEncoderLayer) else 1
                layers.append((f"{part}.{name}", module, node_dim))
    return layers


def activation_statistics(
    model: BalerAutoencoder, normalizer: MinMaxNormalizer, table: Table, max_rows: int = 100_000
) -> list[dict[str, Any]]:
    """Statistics of every hidden activation, the latent code and the output over ``table``'s first rows."""
    if tuple(table.sample_shape) != tuple(model.input_shape):
        raise BalerInputError(
            f"column-count mismatch: the model expects samples of shape {tuple(model.input_shape)},"
            f" {table.source} has {tuple(table.sample_shape)}"
        )
    if max_rows < 1:
        raise BalerInputError(f"max_rows must be >= 1, got {max_rows}")
    layers = _recorded_layers(model)
    stats = {name: _LayerStats(dim) for name, _, dim in layers}
    latent, output = _LayerStats(1), _LayerStats(1)
    hooks = [
        module.register_forward_hook(lambda _m, _i, out, s=stats[name]: s.add(out[0] if isinstance(out, tuple) else out))
        for name, module, _ in layers
    ]
    param = next(model.parameters())
    np_dtype = torch.empty((), dtype=param.dtype).numpy().dtype
    n = min(table.n_rows, int(max_rows))
    step = max(1, CHUNK_SAMPLES // max(1, math.prod(table.sample_shape) // 64))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for s in range(0, n, step):
                x = torch.from_numpy(normalizer.transform(table.data[s : min(s + step, n)], np_dtype)).to(param.device)
                z = model.encode(x)
                latent.add(z)
                output.add(model.decode(z))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    names = [name for name, _, _ in layers]
    encoder = [stats[k].summary(k) for k in names if k.startswith("encoder.")]
    decoder = [stats[k].summary(k) for k in names if k.startswith("decoder.")]
    return [*encoder, latent.summary("latent"), *decoder, output.summary("output")]


def _figure(layers: list[dict[str, Any]], source: str):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    width = max(row["nodes"] for row in layers)
    grid = np.full((len(layers), width), np.nan)
    for i, row in enumerate(layers):
        grid[i, : row["nodes"]] = row["node_means"]
    fig, (ax_map, ax_stats) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [1.3, 1]})
    limit = np.nanmax(np.abs(grid)) or 1.0
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")  # no such node in this layer: grey, unlike 0
    image = ax_map.imshow(
        grid.T, aspect="auto", origin="lower", interpolation="nearest", cmap=cmap,
        norm=mcolors.TwoSlopeNorm(vcenter=0.0, vmin=-limit, vmax=limit),
    )  # fmt: skip
    fig.colorbar(image, ax=ax_map, label="mean activation (normalised units)")
    labels = [row["layer"] for row in layers]
    ax_map.set_xticks(range(len(layers)), labels, rotation=45, ha="right", fontsize=8)
    ax_map.set_ylabel("node (unit / channel)")
    ax_map.set_title("Neural activation pattern (mean per node)")
    x = np.arange(len(layers))
    means = np.array([row["mean"] for row in layers])
    stds = np.array([row["std"] for row in layers])
    ax_stats.errorbar(x, means, yerr=stds, fmt="o", capsize=3, label="mean ± std")
    ax_stats.plot(x, [row["min"] for row in layers], "v", color="grey", label="min")
    ax_stats.plot(x, [row["max"] for row in layers], "^", color="grey", label="max")
    ax_stats.set_ylabel("activation (normalised units)")
    ax_stats.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    twin = ax_stats.twinx()
    twin.bar(x, [row["inactive_fraction"] for row in layers], alpha=0.2, color="tab:red", label="fraction ≤ 0")
    twin.set_ylim(0, 1)
    twin.set_ylabel("fraction of values ≤ 0", color="tab:red")
    ax_stats.legend(loc="upper left", fontsize=8)
    ax_stats.set_title("Per-layer statistics")
    fig.suptitle(f"Activation diagnostics: {os.path.basename(source)}")
    fig.tight_layout()
    return fig


def diagnose(
    model: BalerAutoencoder,
    normalizer: MinMaxNormalizer,
    table: Table,
    out_dir: str | os.PathLike,
    tensorboard_dir: str | os.PathLike | None = None,
    max_rows: int = 100_000,
    overwrite: bool = False,
) -> str:
    """Write ``diagnostics.png`` and ``summary.json`` to ``out_dir`` (and TensorBoard events); return a summary line."""
    from pathlib import Path

    from lightning_energy.extras import check_installed

    check_installed("matplotlib", "baler-lit diagnose", extra="baler")  # before anything is written
    import matplotlib.pyplot as plt

    from .evaluate import _render, _write_report

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise BalerInputError(f"output folder {out} already exists; pass --overwrite to replace its files")
    if not out.parent.is_dir():
        raise BalerInputError(f"output directory {out.parent} does not exist")
    layers = activation_statistics(model, normalizer, table, max_rows)
    fig = _figure(layers, table.source)
    try:
        pngs = _render({"diagnostics": fig})
    finally:
        plt.close(fig)
    summary = {"source": table.source, "rows": min(table.n_rows, max_rows), "layers": layers}
    _write_report(out, pngs, summary)
    if tensorboard_dir is not None:
        _to_tensorboard(tensorboard_dir, pngs["diagnostics"], layers)
    dead = [row["layer"] for row in layers if row["inactive_fraction"] > 0.99]
    lines = [f"{'layer':<22} {'nodes':>5} {'mean':>9} {'std':>9} {'min':>9} {'max':>9} {'≤0':>6}"]
    lines += [
        f"{r['layer']:<22} {r['nodes']:5d} {r['mean']:9.4f} {r['std']:9.4f} {r['min']:9.4f} {r['max']:9.4f}"
        f" {r['inactive_fraction']:6.3f}"
        for r in layers
    ]
    if dead:
        lines.append(f"layers with more than 99% of values ≤ 0: {', '.join(dead)}")
    return "\n".join(lines) + f"\ndiagnostics written to {out}"


def _to_tensorboard(log_dir: str | os.PathLike, png: bytes, layers: list[dict[str, Any]]) -> None:
    import io

    import matplotlib.image as mpimg
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        writer.add_image("diagnose/activations", mpimg.imread(io.BytesIO(png), format="png"), dataformats="HWC")
        for row in layers:
            writer.add_histogram(f"diagnose/node_means/{row['layer']}", np.asarray(row["node_means"]))
            for key in ("mean", "std", "inactive_fraction"):
                writer.add_scalar(f"diagnose/{key}/{row['layer']}", row[key])
    finally:
        writer.close()
