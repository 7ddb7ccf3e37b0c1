"""PNG figures of runs, drawn with matplotlib's Agg canvas (no display, no global backend change)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from lightning_energy.io import atomic_write_bytes
from lightning_energy.provenance import word

DPI = 110
MARKERS = "os^Dv"  # a new marker for each further 10 groups (matplotlib cycles 10 colours)


def _figure(rows: int = 1, cols: int = 1, size=(8.0, 4.5)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def render_png(fig) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def write_files(files: dict[Path, bytes | str]) -> list[Path]:
    """Write every file through a private temporary name and a rename (all rendered before any is written)."""
    return [atomic_write_bytes(path, content.encode() if isinstance(content, str) else content)
            for path, content in files.items()]


def power_figure(run) -> bytes:
    """Total power over time with the epoch boundaries marked, as PNG."""
    return render_png(power_plot(run))


def power_plot(run):
    """The figure of :func:`power_figure`: epoch starts as grey, epoch ends as black dotted vertical lines."""
    fig, axes = _figure()
    ax = axes[0][0]
    t0 = run.start_s
    ax.plot(run.time_s - t0, run.power_W, lw=1.0, label="power (all sensors)")
    for i, e in enumerate(ev for ev in run.events if ev["event"] in ("epoch_start", "epoch_end")):
        ax.axvline(e["time_s"] - t0, color="grey" if e["event"] == "epoch_start" else "black", ls=":", lw=0.8,
                   label=None if i > 1 else e["event"].replace("_", " "))
    ax.set(xlabel="time since fit start (s)", ylabel="power (W)", title=f"{run.name}: power, {word(run.provenance)}")
    ax.legend(loc="best", fontsize="small")
    return fig


def cumulative_energy_figure(run) -> bytes:
    """Cumulative energy per sensor and in total."""
    fig, axes = _figure()
    ax = axes[0][0]
    t0 = run.start_s
    base = np.interp(t0, run.time_s, run.energy_J)
    ax.plot(run.time_s - t0, run.energy_J - base, lw=1.4, label="total")
    for name, curve in run.sensor_energy_J.items():
        ax.plot(run.time_s - t0, curve - np.interp(t0, run.time_s, curve), lw=0.9, label=name)
    ax.set(xlabel="time since fit start (s)", ylabel="cumulative energy (J)",
           title=f"{run.name}: energy, {word(run.provenance)}")
    ax.legend(loc="best", fontsize="small")
    return render_png(fig)


def epoch_boxplots_figure(run, epochs: list[dict]) -> bytes:
    """Box plots of the per-epoch energy and time."""
    fig, axes = _figure(1, 2, size=(8.0, 4.0))
    energy = [e["energy_J"] for e in epochs]
    seconds = [e["duration_s"] for e in epochs]
    axes[0][0].boxplot([energy], tick_labels=["epochs"])
    axes[0][0].set(ylabel="energy per epoch (J)", title=f"{len(epochs)} epoch(s), {word(run.provenance)}")
    axes[0][1].boxplot([seconds], tick_labels=["epochs"])
    axes[0][1].set(ylabel="time per epoch (s)", title=run.name)
    return render_png(fig)


def band_figure(groups: dict[str, dict], key: str, ylabel: str, title: str, provenance: str) -> bytes:
    """Mean ± std curves, one per group, as PNG (see :func:`band_plot`)."""
    return render_png(band_plot(groups, key, ylabel, title, provenance))


def band_plot(groups: dict[str, dict], key: str, ylabel: str, title: str, provenance: str):
    """Mean ± std curves, one per group: ``groups[name] = {"time_s", "curve_<key>_mean", "curve_<key>_std"}``.

    The band is cut to the envelope of the group's runs (``curve_<key>_min`` / ``_max`` where given): a
    standard deviation is no power a run drew, and mean + std can exceed the largest one. The title says
    where the joules come from (``provenance``).
    """
    fig, axes = _figure()
    ax = axes[0][0]
    for name, g in groups.items():
        t = np.asarray(g["time_s"])
        mean = np.asarray(g[f"curve_{key}_mean"])
        std = np.asarray(g[f"curve_{key}_std"])
        low, high = mean - std, mean + std
        if f"curve_{key}_min" in g:
            low = np.maximum(low, np.asarray(g[f"curve_{key}_min"], dtype=float))
            high = np.minimum(high, np.asarray(g[f"curve_{key}_max"], dtype=float))
        ax.plot(t, mean, lw=1.2, label=f"{name} (n={g['runs']})")
        ax.fill_between(t, low, high, alpha=0.25)
    ax.set(xlabel="time since fit start (s)", ylabel=ylabel, title=f"{title}, {word(provenance)}")
    ax.legend(loc="best", fontsize="small")
    return fig


def fit_figure(attribute: str, points: dict[str, tuple], fits: dict, provenance: str = "unknown") -> bytes:
    """Energy, time and EDP vs a numeric attribute, each with its quadratic fit and R²."""
    fig, axes = _figure(1, len(points), size=(4.0 * len(points), 3.8))
    fig.suptitle(f"energy {word(provenance)}", fontsize="medium")
    for ax, (name, (x, y, unit)) in zip(axes[0], points.items()):
        fit = fits[name]
        ax.plot(x, y, "o", label="runs")
        grid = np.linspace(min(x), max(x), 200)
        ax.plot(grid, fit(grid), "-", label=f"quadratic, R²={fit.r2:.3f}")
        ax.set(xlabel=attribute, ylabel=f"{name} ({unit})", title=f"{name} vs {attribute}")
        ax.legend(loc="best", fontsize="small")
    return render_png(fig)



def frontier_figure(rows: list[dict], by: str | None, provenance: str) -> bytes:
    """Energy vs time to target (log-log), one colour per group (legend beside the axes), the Pareto frontier
    (runs no other beats in both) ringed and joined."""
    fig, axes = _figure(size=(11.0, 4.8))
    ax = axes[0][0]
    reached = [r for r in rows if r["energy_to_target_J"] is not None]
    for index, group in enumerate(dict.fromkeys(r["group"] for r in reached)):
        members = [r for r in reached if r["group"] == group]
        ax.plot([r["time_to_target_s"] for r in members], [r["energy_to_target_J"] for r in members],
                MARKERS[index // 10 % len(MARKERS)], alpha=0.8, label=f"{group} (n={len(members)})")
    edge = sorted((r["time_to_target_s"], r["energy_to_target_J"]) for r in reached if r["on_frontier"])
    if edge:  # ringed points joined by a dashed staircase (one point: the ring alone)
        ax.step([t for t, _ in edge], [e for _, e in edge], where="post", color="black", lw=1.0, ls="--")
        ax.plot([t for t, _ in edge], [e for _, e in edge], "o", ms=11, mfc="none", mec="black", label="frontier")
    missed = len(rows) - len(reached)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="time to target (s, log)", ylabel="energy to target (J, log)",
           title=f"energy vs time to target, {word(provenance)}" + (f"; {missed} run(s) missed it" if missed else ""))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small",
              title=by, title_fontsize="x-small")
    return render_png(fig)
