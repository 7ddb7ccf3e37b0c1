"""The power-limit profile file (Zeus-compatible ``{"measurements": [...]}`` with our keys beside them),
the fits of its curves and its figure. The search itself is :mod:`lightning_energy.optimize.power_limit.search`."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import numpy as np

from lightning_energy.extras import check_installed
from lightning_energy.fitting import QUADRATIC_PARAMETERS, quadratic_fit
from lightning_energy.io import atomic_write_bytes, atomic_write_json
from lightning_energy.measure.zeus_codecarbon_internals import zeus_profile_list_model
from lightning_energy.optimize.power_limit.search import (
    LimitProfile,
    MIN_SPARE_POINTS,
    Objective,
    _zeus_power_limit,
)

PROFILE_FILE = "power_limit_profile.json"
FIGURE_FILE = "power_limit_profile.png"
PROFILE_FORMAT = "lightning-energy power-limit profile 1"


def profile_document(profiles: list[LimitProfile], objective: Objective, chosen_W: int | None, **meta) -> dict:
    """The JSON document of a profile: Zeus's ``measurements`` plus costs, fits and how it was made."""
    ordered = sorted(profiles, key=lambda p: p.limit_W, reverse=True)
    costs = objective.costs(ordered)
    return {
        "format": PROFILE_FORMAT,
        **meta,
        "selector": objective.describe(),
        "cost_unit": objective.cost_unit,
        "chosen_limit_W": chosen_W,
        "measurements": [p.to_json(costs[p.limit_W]) for p in ordered],
        "fits": {name: (fit_summary(fit, ordered[-1].limit_W, ordered[0].limit_W) if fit is not None else None)
                 for name, fit in profile_fits(ordered, objective).items()},
    }


def write_profile(path: str | os.PathLike, document: dict) -> Path:
    return atomic_write_json(path, document)


def read_profile(path: str | os.PathLike) -> tuple[list[LimitProfile], dict]:
    """Profiles and the whole document from a profile file of ours or of Zeus's ``GlobalPowerLimitOptimizer``.

    Zeus's files carry no ``steps``: their energy and time (one window each, all of the same length)
    are then compared per window.
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"power-limit profile {path} cannot be read: {err}") from err
    zpl = _zeus_power_limit()
    try:
        parsed = zeus_profile_list_model(zpl).parse_obj(document)
    except Exception as err:  # pydantic's ValidationError names the bad field
        raise ValueError(f"power-limit profile {path} is not a valid profile: {err}") from err
    rows = document["measurements"]
    profiles = []
    for row, m in zip(rows, parsed.measurements):
        steps = row.get("steps", 1) if isinstance(row, dict) else 1
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"power-limit profile {path}: `steps` of limit {m.power_limit} W must be an integer >= 1")
        profiles.append(LimitProfile(int(m.power_limit), float(m.energy), float(m.time), steps,
                                     _windows(row, path, int(m.power_limit))))
    if not profiles:
        raise ValueError(f"power-limit profile {path} holds no measurements")
    if len({p.limit_W for p in profiles}) != len(profiles):
        raise ValueError(f"power-limit profile {path} lists a power limit twice")
    return profiles, document


def _windows(row, path: Path, limit_W: int) -> tuple[tuple[float, float, int], ...]:
    """The per-window figures of a profile row (ours; absent in Zeus's files), checked."""
    windows = row.get("windows") if isinstance(row, dict) else None
    if windows is None:
        return ()
    problem = f"power-limit profile {path}: `windows` of limit {limit_W} W must be a list of [energy J, time s, steps]"
    if not isinstance(windows, list) or not 1 <= len(windows) <= 1000:
        raise ValueError(problem)
    out = []
    for w in windows:
        if (not isinstance(w, list) or len(w) != 3 or any(isinstance(v, bool) for v in w)
                or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in w)
                or not isinstance(w[2], int)):
            raise ValueError(problem)
        out.append((float(w[0]), float(w[1]), int(w[2])))
    if len(out) == 1:
        return ()
    return tuple(out)


# ---------------------------------------------------------------------------------------------- fits and figure
FIT_QUANTITIES = ("energy_per_step_J", "time_per_step_s", "cost")


def _quantity(profiles: list[LimitProfile], objective: Objective, name: str) -> list[float]:
    if name == "cost":
        costs = objective.costs(profiles)
        return [costs[p.limit_W] for p in profiles]
    return [getattr(p, name) for p in profiles]


def profile_fits(profiles: list[LimitProfile], objective: Objective) -> dict:
    """Quadratic fit of energy, time and cost per step vs the limit, or None where the profiled limits leave
    fewer than :data:`MIN_SPARE_POINTS` points beyond the fit's three parameters (through three points any
    quadratic has R² = 1: it says nothing). A fit's vertex is reported only where it lies inside the
    profiled range (``vertex_x`` None otherwise): an extrapolated vertex is no finding."""
    x = [p.limit_W for p in profiles]
    enough = len(set(x)) >= QUADRATIC_PARAMETERS + MIN_SPARE_POINTS
    fits = {}
    for name in FIT_QUANTITIES:
        fits[name] = quadratic_fit(x, _quantity(profiles, objective, name)) if enough else None
    return fits


def fit_summary(fit, low_W: float, high_W: float) -> dict:
    """A fit as JSON: coefficients, R² with its spare points, the vertex only where it is inside the range."""
    row = fit.as_dict()
    row["spare_points"] = fit.n - QUADRATIC_PARAMETERS
    inside = math.isfinite(row["vertex_x"]) and low_W <= row["vertex_x"] <= high_W
    row["vertex_x"] = row["vertex_x"] if inside else None
    row["vertex_note"] = None if inside else "the vertex lies outside the profiled range: not a finding"
    return row


def profile_figure(profiles: list[LimitProfile], objective: Objective, chosen_W: int | None,
                   gpu_name: str | None = None, simulated: bool = False):
    """A matplotlib Figure: energy, time and cost per step vs power limit (profiled points; repeated windows
    as small marks), and a quadratic fit with its R² only where spare points test it (no vertex drawn); each
    panel's legend sits below it, covering no data. ``simulated``: every panel says "simulated GPU"."""
    check_installed("matplotlib", "the power-limit profile plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ordered = sorted(profiles, key=lambda p: p.limit_W)
    fits = profile_fits(ordered, objective)
    x = np.array([p.limit_W for p in ordered], dtype=float)
    fig = Figure(figsize=(12.0, 5.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    source = "simulated GPU" if simulated else "measured"
    labels = {"energy_per_step_J": f"energy per step (J, {source})", "time_per_step_s": f"time per step (s, {source})",
              "cost": f"{objective.cost_label} ({objective.cost_unit}, {source})"}
    for ax, name in zip(axes, FIT_QUANTITIES):
        ax.plot(x, _quantity(ordered, objective, name), "o", label="profiled (mean of its windows)")
        if name != "cost":
            repeats = [(p.limit_W, w[0 if name == "energy_per_step_J" else 1] / w[2])
                       for p in ordered if p.window_count > 1 for w in p.window_figures()]
            if repeats:
                ax.plot(*zip(*repeats), "x", color="grey", ms=4, label="single windows")
        fit = fits[name]
        if fit is not None:
            grid = np.linspace(x.min(), x.max(), 200)
            ax.plot(grid, fit(grid), "-", lw=1.0,
                    label=f"quadratic fit, R²={fit.r2:.3f} ({fit.n - QUADRATIC_PARAMETERS} spare points)")
        if chosen_W is not None:
            ax.axvline(chosen_W, color="grey", ls="--", lw=1.0, label=f"chosen {chosen_W} W")
        ax.set(xlabel="power limit (W)", ylabel=labels[name])
        # below the panel, outside its axes: a legend inside covered profiled points and the fit
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.17), fontsize="small", frameon=False)
    title = f"power-limit profile: {gpu_name or 'GPU'}"
    fig.suptitle(f"{title} (simulated GPU)" if simulated else title)
    fig.tight_layout()
    return fig


def write_figure_png(fig, path: str | os.PathLike) -> Path:
    """Save a figure as PNG through a private temporary file (unpredictable name, created exclusively) and an
    atomic rename."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return atomic_write_bytes(path, buffer.getvalue())
