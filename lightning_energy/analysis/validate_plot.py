"""The figure of ``lightning-energy validate``: our power and the meter's, aligned, and both energies.

Top: power over time since the fit's start; ours (every sensor summed) as sampled, the meter's as MLPerf
counts it (each reading held over the interval before it), its gaps shaded, the epochs' starts and ends
dotted. Bottom: both cumulative energies from the fit's start. Each curve says where its joules come from.
"""

from __future__ import annotations

import numpy as np

from lightning_energy.analysis.plots import render_png
from lightning_energy.extras import check_installed
from lightning_energy.provenance import word

DPI = 110
MAX_POINTS = 20_000  # our curve is drawn from at most this many points (a long trace is binned)


def validation_figure(validation) -> bytes:
    """The figure as PNG bytes."""
    check_installed("matplotlib", "lightning-energy validate's plot (--no-plots prints the tables only)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    result, run = validation.result, validation.run
    fig = Figure(figsize=(9.0, 6.4), dpi=DPI)
    FigureCanvasAgg(fig)
    power, energy = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    origin = run.start_s
    ours_t, ours_W = _ours_curve(run)
    sensors = ", ".join(s["name"] for s in result["sensors"]) or "all sensors"
    ours_label = f"ours ({sensors}; {word(run.provenance)})"
    meter_label = f"meter ({result['reference']['format']} log; measured)"
    lo, hi = run.start_s - 0.1 * run.duration_s, run.end_s + 0.1 * run.duration_s
    inside = np.flatnonzero((validation.meter_t >= lo) & (validation.meter_t <= hi))
    shown = slice(max(inside[0] - 1, 0), inside[-1] + 2) if inside.size else slice(0, 0)  # one reading beyond each edge
    power.step(validation.meter_t[shown] - origin, validation.meter_W[shown], where="pre", lw=1.0, color="tab:orange",
               label=meter_label)
    power.plot(ours_t - origin, ours_W, lw=1.0, color="tab:blue", label=ours_label)
    for i, (a, b) in enumerate(validation.gaps):
        if b >= lo and a <= hi:
            power.axvspan(a - origin, b - origin, color="red", alpha=0.15, lw=0,
                          label="meter gap" if i == 0 else None)
    opened = None
    for event in run.events:  # validation loops shaded
        if event["event"] == "validation_start":
            opened = event["time_s"]
        elif event["event"] == "validation_end" and opened is not None:
            power.axvspan(opened - origin, event["time_s"] - origin, color="tab:green", alpha=0.12, lw=0,
                          label="validation" if not any(p.get_label() == "validation" for p in power.patches) else None)
            opened = None
    for ax in (power, energy):
        ax.axvspan(lo - origin, 0.0, color="grey", alpha=0.08, lw=0)
        ax.axvspan(run.end_s - origin, hi - origin, color="grey", alpha=0.08, lw=0)
        for event in run.events:
            if event["event"] in ("epoch_start", "epoch_end"):
                ax.axvline(event["time_s"] - origin, color="black", ls=":", lw=0.6)
    alignment = result["alignment"]
    how = {"auto": f"cross-correlation r = {alignment['correlation']:.3f}", "given": "given with --offset",
           "assumed": "assumed: nothing to correlate"}[alignment["how"]]
    drift = f", drift {alignment['drift_ppm']:+.0f} ppm" if alignment["drift_ppm"] else ""
    power.set(ylabel="power (W)",
              title=f"{result['run']} vs {_short(result['reference']['file'])}: offset {alignment['offset_s']:+.3f} s "
                    f"({how}{drift})")
    power.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small")
    fit = result["fit"]
    grid = np.linspace(fit["start_s"] + origin, fit["end_s"] + origin, 400)
    energy.plot(grid - origin, [run.energy_between(grid[0], t) for t in grid], color="tab:blue",
                label=f"ours: {fit['ours_J']:,.1f} J ({word(run.provenance)})")
    meter_cum = np.interp(grid, validation.meter_t, _meter_cumulative(validation))
    energy.plot(grid - origin, meter_cum - meter_cum[0], color="tab:orange",
                label=f"meter: {fit['meter_J']:,.1f} J (measured)")
    error = f", ours {fit['error_pct']:+.2f} %" if fit["error_pct"] is not None else ""
    energy.set(xlabel="time since the fit's start (s); the fit unshaded, epochs dotted",
               ylabel="energy since start (J)", title=f"energy over the fit{error}")
    energy.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small")
    power.set_xlim(lo - origin, hi - origin)
    return render_png(fig)


def _ours_curve(run) -> tuple[np.ndarray, np.ndarray]:
    """Our total power as sampled, or binned to ``MAX_POINTS`` means (from the cumulative energy) when longer."""
    if len(run.time_s) <= MAX_POINTS:
        return run.time_s, run.power_W
    edges = np.linspace(run.time_s[0], run.time_s[-1], MAX_POINTS + 1)
    cumulative = np.interp(edges, run.time_s, run.energy_J)
    return (edges[:-1] + edges[1:]) / 2, np.diff(cumulative) / np.diff(edges)


def _meter_cumulative(validation) -> np.ndarray:
    t, watts = validation.meter_t, validation.meter_W
    return np.concatenate(([0.0], np.cumsum(watts[1:] * np.diff(t))))


def _short(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]
