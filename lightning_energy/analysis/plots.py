"""PNG figures of runs, drawn with matplotlib's Agg canvas (no display, no global backend change)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from lightning_energy.extras import check_installed
from lightning_energy.io import atomic_write_bytes
from lightning_energy.provenance import word

DPI = 110
MARKERS = "os^Dv"  # a new marker for each further 10 groups (matplotlib cycles 10 colours)


def _figure(rows: int = 1, cols: int = 1, size=(8.0, 4.5), height_ratios=None):
    check_installed("matplotlib", "lightning-energy's plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, height_ratios=height_ratios)
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
    """Cumulative energy in total and per sensor, as PNG (see :func:`cumulative_energy_plot`)."""
    return render_png(cumulative_energy_plot(run))


def cumulative_energy_plot(run):
    """Cumulative energy since fit start: the total (thick) and, with more than one sensor, each sensor
    (thin); with one sensor the total is that sensor's curve, drawn once and labelled so."""
    fig, axes = _figure()
    ax = axes[0][0]
    t0 = run.start_s
    base = np.interp(t0, run.time_s, run.energy_J)
    names = list(run.sensor_energy_J)
    label = f"total (the only sensor: {names[0]})" if len(names) == 1 else "total"
    ax.plot(run.time_s - t0, run.energy_J - base, lw=2.0, color="black", label=label)
    if len(names) > 1:
        for name, curve in run.sensor_energy_J.items():
            ax.plot(run.time_s - t0, curve - np.interp(t0, run.time_s, curve), lw=1.0, label=name)
    ax.set(xlabel="time since fit start (s)", ylabel="cumulative energy (J)",
           title=f"{run.name}: energy, {word(run.provenance)}")
    ax.legend(loc="best", fontsize="small")
    return fig


def epoch_boxplots_figure(run, epochs: list[dict]) -> bytes:
    """Box plots of the per-epoch energy and time, as PNG (see :func:`epoch_boxplots_plot`)."""
    return render_png(epoch_boxplots_plot(run, epochs))


def epoch_boxplots_plot(run, epochs: list[dict]):
    """Box plots of the per-epoch energy (J) and time (s): the figure's title names the run, the number of
    epochs and where the joules come from; each panel's title says what it shows."""
    fig, axes = _figure(1, 2, size=(8.0, 4.0))
    energy = [e["energy_J"] for e in epochs]
    seconds = [e["duration_s"] for e in epochs]
    fig.suptitle(f"{run.name}: {len(epochs)} epoch(s), energy {word(run.provenance)}", fontsize="medium")
    for ax, values, what, unit in ((axes[0][0], energy, "energy", "J"), (axes[0][1], seconds, "time", "s")):
        ax.boxplot([values], tick_labels=[f"{len(values)} epoch(s)"])
        ax.set(ylabel=f"{what} per epoch ({unit})", title=f"{what} per epoch")
    return fig


def band_figure(groups: dict[str, dict], key: str, ylabel: str, title: str, provenance: str,
                by: str | None = None) -> bytes:
    """Mean ± std curves, one per group, and the runs still going, as PNG (see :func:`band_plot`)."""
    return render_png(band_plot(groups, key, ylabel, title, provenance, by))


def group_label(name: str, runs: int, by: str | None = None) -> str:
    """A group's legend entry: ``batch_size=128 (n=1)`` when grouped by an attribute, ``<run> (n=1)`` otherwise."""
    return f"{by}={name} (n={runs})" if by else f"{name} (n={runs})"


def band_plot(groups: dict[str, dict], key: str, ylabel: str, title: str, provenance: str, by: str | None = None):
    """Mean ± std curves, one per group: ``groups[name] = {"time_s", "curve_<key>_mean", "curve_<key>_std"}``,
    and below them n(t), the runs of each group still going (``runs_at_time``), where that number changes
    (a group whose runs end at different times).

    The band is cut to the envelope of the group's runs (``curve_<key>_min`` / ``_max`` where given): a
    standard deviation is no power a run drew, and mean + std can exceed the largest one. The legend names
    each group by the attribute it shares (``by=value``, see :func:`group_label`); the title says where the
    joules come from (``provenance``).
    """
    counted = any(len(set(g.get("runs_at_time", ()))) > 1 for g in groups.values())  # some run ends before another
    fig, axes = _figure(2 if counted else 1, 1, size=(8.0, 5.6 if counted else 4.5), height_ratios=[4, 1] if counted else None)
    ax = axes[0][0]
    for name, g in groups.items():
        t = np.asarray(g["time_s"])
        mean = np.asarray(g[f"curve_{key}_mean"])
        std = np.asarray(g[f"curve_{key}_std"])
        low, high = mean - std, mean + std
        if f"curve_{key}_min" in g:
            low = np.maximum(low, np.asarray(g[f"curve_{key}_min"], dtype=float))
            high = np.minimum(high, np.asarray(g[f"curve_{key}_max"], dtype=float))
        line, = ax.plot(t, mean, lw=1.2, label=group_label(name, g["runs"], by))
        ax.fill_between(t, low, high, alpha=0.25, color=line.get_color())
        if counted:
            axes[1][0].step(t, g["runs_at_time"], where="post", lw=1.0, color=line.get_color(),
                            label=group_label(name, g["runs"], by))
    ax.set(ylabel=ylabel, title=f"{title}, {word(provenance)}")
    ax.legend(loc="best", fontsize="small")
    if counted:
        runs_axes = axes[1][0]
        runs_axes.set(xlabel="time since fit start (s)", ylabel="runs going")
        runs_axes.set_ylim(0, max(g["runs"] for g in groups.values()) + 0.5)
        runs_axes.yaxis.get_major_locator().set_params(integer=True)
        runs_axes.sharex(ax)
    else:
        ax.set_xlabel("time since fit start (s)")
    return fig


def fit_figure(attribute: str, groups: dict[str, dict], provenance: str = "unknown",
               group_by: str | None = None) -> bytes:
    """Energy, time and EDP vs a numeric attribute, each with its quadratic fit, as PNG (see :func:`fit_plot`)."""
    return render_png(fit_plot(attribute, groups, provenance, group_by))


def fit_plot(attribute: str, groups: dict[str, dict], provenance: str = "unknown", group_by: str | None = None):
    """One panel per quantity (energy, time, EDP) vs ``attribute``: each group's runs and its quadratic fit.

    ``groups[label] = {"points": {quantity: (x, y, unit)}, "fits": {quantity: QuadraticFit}}`` (one group
    ``"all"`` when not grouped). A fit's legend gives its R² only where spare points test it
    (:func:`~lightning_energy.analysis.goodness.describe_r2`); through as many points as parameters it says
    "exact fit".
    """
    from lightning_energy.analysis.goodness import describe_r2

    quantities = list(next(iter(groups.values()))["points"])
    fig, axes = _figure(1, len(quantities), size=(4.6 * len(quantities), 4.4 + 0.25 * 2 * len(groups)))
    fig.suptitle(f"energy {word(provenance)}", fontsize="medium")
    for ax, name in zip(axes[0], quantities):
        for label, group in groups.items():
            x, y, unit = group["points"][name]
            fit = group["fits"][name]
            prefix = f"{group_by}={label}: " if group_by else ""
            dots, = ax.plot(x, y, "o", label=f"{prefix}runs" if group_by else "runs")
            grid = np.linspace(min(x), max(x), 200)
            ax.plot(grid, fit(grid), "-", color=dots.get_color(),
                    label=f"{prefix}quadratic, {describe_r2(fit.r2, fit.n)}")
        ax.set(xlabel=attribute, ylabel=f"{name} ({unit})", title=f"{name} vs {attribute}")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize="x-small")  # below: never on a point
    return fig


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
