"""Comparison of runs: curves on an even grid averaged per group, and per-run and per-group totals."""

from __future__ import annotations

import numpy as np

from lightning_energy.analysis import DEFAULT_RATE_HZ
from lightning_energy.analysis.resample import mean_std, pad_and_hold, pad_and_mask, resample, resample_power
from lightning_energy.analysis.runs import Run, require_attribute
from lightning_energy.provenance import combine


def run_curves(run: Run, rate_hz: float = DEFAULT_RATE_HZ) -> dict[str, np.ndarray]:
    """Power (W) and cumulative energy (J, 0 at fit start) from fit start to fit end on an even grid.

    The energy is the trace's cumulative energy interpolated linearly; the power, the mean power over
    the grid interval around each point, derived from that energy (:func:`resample_power`). Where the fit's
    end falls between grid points, it is added as the last point (the energy there is the run's total; the
    power, the mean over the grid interval centred on it, cut to the fit as for every point). Fit boundaries slightly outside the samples are
    covered as in :meth:`Run.covering_samples` (the nearest sample's power continued); :class:`RunError`
    when they lie further out.
    """
    time_s, _, energy_J = run.covering_samples(run.start_s, run.end_s)
    grid, power = resample_power(time_s, energy_J, rate_hz, run.start_s, run.end_s)
    _, energy = resample(time_s, energy_J, rate_hz, run.start_s, run.end_s)
    duration_s = run.end_s - run.start_s
    if grid[-1] < duration_s - 1e-9:  # the end between grid points: the run's total at its end
        half_s = min(0.5 / rate_hz, duration_s)  # the interval centred on the end, cut to the fit
        at_end, before_end = np.interp([run.end_s, run.end_s - half_s], time_s, energy_J)
        grid, energy = np.append(grid, duration_s), np.append(energy, at_end)
        power = np.append(power, (at_end - before_end) / half_s)
    return {"time_s": grid, "power_W": power, "energy_J": energy - energy[0]}


def _on_axis(curves: list[dict], axis: np.ndarray) -> list[np.ndarray]:
    """Each run's power on the group's time axis (the longest run's): a run's last point is left out where it
    lies off that axis (its fit end between two grid points), since the axis would draw it at another time."""
    return [c["power_W"] if np.isclose(c["time_s"][-1], axis[len(c["time_s"]) - 1]) else c["power_W"][:-1]
            for c in curves]


def compare_runs(runs: list[Run], by: str | None = None, rate_hz: float = DEFAULT_RATE_HZ) -> dict:
    """Per-run totals and, per group, mean ± std curves and totals.

    The power curves are averaged over the runs still going at each time (``runs_at_time``, n(t)); the
    cumulative-energy curves hold a finished run at its total, so the mean energy curve ends at the group's
    ``energy_J_mean``.

    Groups: the runs sharing a value of attribute ``by`` (repetitions averaged); without ``by`` each run is
    its own group (named by the run): unrelated runs are never averaged into one curve unasked.
    """
    rows, curves_by_group = [], {}
    keys = [run.name for run in runs] if by is None else [str(v) for v in require_attribute(runs, by)]
    for run, key in zip(runs, keys):
        rows.append({"run": run.name, "group": key, "duration_s": run.duration_s, "energy_J": run.total_J,
                     "mean_power_W": run.total_J / run.duration_s if run.duration_s > 0 else None,
                     "edp_Js": run.edp_Js, "extrapolated_s": run.extrapolated_s, "provenance": run.provenance,
                     **to_target(run.attributes)})
        curves_by_group.setdefault(key, []).append(run_curves(run, rate_hz))
    groups = {}
    for key, curves in curves_by_group.items():
        members = [r for r in rows if r["group"] == key]
        longest = max(curves, key=lambda c: (len(c["time_s"]), c["time_s"][-1]))["time_s"]  # the axis: ends last
        groups[key] = {"runs": len(curves), "time_s": longest.tolist(),
                       "provenance": combine(m["provenance"] for m in members)}
        # power: over the runs still going; cumulative energy: a finished run held at its total
        power = pad_and_mask(_on_axis(curves, longest))
        energy = np.ma.asarray(pad_and_hold([c["energy_J"] for c in curves]))
        for name, stacked in (("power_W", power), ("energy_J", energy)):
            mean, std, _ = mean_std(stacked)
            groups[key].update({  # the envelope of the runs (min, max) bounds the band drawn around the mean
                f"curve_{name}_mean": mean.tolist(), f"curve_{name}_std": std.tolist(),
                f"curve_{name}_min": np.ma.filled(stacked.min(axis=0), np.nan).tolist(),
                f"curve_{name}_max": np.ma.filled(stacked.max(axis=0), np.nan).tolist()})
        groups[key].update({
            "runs_at_time": power.count(axis=0).tolist(),  # n(t): the runs still going at each grid point
            **{f"{name}_{stat}": float(fn([m[name] for m in members]))
               for name in ("energy_J", "duration_s", "edp_Js") for stat, fn in (("mean", np.mean), ("std", np.std))},
        })
        reached = [m for m in members if m["energy_to_target_J"] is not None]
        groups[key]["reached_target"] = len(reached)
        for name in TO_TARGET:
            values = [m[name] for m in reached]
            groups[key].update({f"{name}_mean": float(np.mean(values)) if values else None,
                                f"{name}_std": float(np.std(values)) if values else None})
    for index in frontier([(r["time_to_target_s"], r["energy_to_target_J"]) for r in rows]):
        rows[index]["on_frontier"] = True
    return {"by": by, "rate_hz": rate_hz, "runs": rows, "groups": groups,
            "provenance": combine(r["provenance"] for r in rows)}


TO_TARGET = ("energy_to_target_J", "time_to_target_s")  # EnergyToAccuracy's figures, from run_attributes.json


def to_target(attributes: dict) -> dict:
    """A run's energy (J) and time (s) to its EnergyToAccuracy target, None where it did not reach one."""
    values = {name: attributes.get(name) for name in TO_TARGET}
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in values.values())
    return {name: float(v) if ok else None for name, v in values.items()} | {"on_frontier": False}


def frontier(points: list[tuple[float | None, float | None]]) -> list[int]:
    """Indexes of the points no other point beats in both time and energy (the Pareto frontier), fastest first.

    ``(time_s, energy_J)`` pairs; a pair with None (no target reached) is never on it. Among equal points
    the first counts.
    """
    ranked = sorted((t, e, i) for i, (t, e) in enumerate(points) if t is not None and e is not None)
    out, best_energy = [], np.inf
    for t, e, i in ranked:
        if e < best_energy:
            out.append(i)
            best_energy = e
    return out
