"""A physical model of DVFS power capping, fitted from a few profiled limits (issue 30 item 2).

Under a power limit ``L`` (W) the card runs the highest SM clock ``f`` (a fraction of the maximum) whose draw
fits: busy power ``P(f) = static_W + (demand_W - static_W) * f * V(f)**2`` with the voltage
``V(f) = max(f, voltage_floor)`` (dynamic power goes with f*V^2; DVFS lowers the voltage with the clock down to
a floor, below which only the clock falls). A limit at or above ``demand_W`` does not cap (``f = 1``, the card
draws ``demand_W``); below it the card draws the limit. Time per step is ``fixed_s + clock_s / f``: the
compute-bound share scales with the clock, the rest (memory-bound work, the host) does not
(``c / f + (1 - c)`` with ``c = clock_s / (fixed_s + clock_s)``). The measured mean power is
``power_scale * min(L, demand_W)`` (a sensor that reads a constant share off, otherwise 1).

What it does not capture, on purpose: cliffs (a clock floor below which the card throttles hard), plateaus of
discrete clock bins, thermal throttling (a top limit slower than a lower one), memory-clock steps, a card that
idles part of each step (mean power below the limit). Profiles with those shapes leave residuals beyond the
noise, and :func:`fit_dvfs` says so (:attr:`DvfsFit.max_residual`); the search then stops using the model.

The fit is a grid over the three nonlinear parameters (static power, demand, voltage floor), zoomed twice
around the best, with the linear ones (``fixed_s``, ``clock_s``, ``power_scale``) solved by weighted least
squares of relative residuals for each: deterministic, no iterative solver, about a millisecond.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOLTAGE_FLOORS = np.array([0.0, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95])
STATIC_SHARES = np.linspace(0.0, 0.95, 20)  # static power as a share of the lowest limit it must stay under
DEMAND_FACTORS = np.array([1.0, 1.03, 1.06, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0])
ZOOMS = 2  # finer grids around the best candidate
MIN_LIMITS = 4  # distinct limits a fit needs: 8 figures for 6 parameters


def clock_under_cap(limit_W, static_W, demand_W, voltage_floor):
    """The clock fraction (0-1] a limit allows (broadcasting numpy arrays); 0 where the limit is at or below the
    static power (the model cannot run there)."""
    limit_W, static_W = np.asarray(limit_W, dtype=float), np.asarray(static_W, dtype=float)
    demand_W, voltage_floor = np.asarray(demand_W, dtype=float), np.asarray(voltage_floor, dtype=float)
    head = np.clip((limit_W - static_W) / np.maximum(demand_W - static_W, 1e-9), 0.0, 1.0)
    knee = voltage_floor**3  # the head at which the clock reaches the voltage floor
    below = head / np.maximum(voltage_floor**2, 1e-12)
    clock = np.where(head >= knee, np.cbrt(head), below)
    return np.where(limit_W >= demand_W, 1.0, clock)


@dataclass(frozen=True)
class DvfsModel:
    """One card and step under DVFS capping (module docstring): watts, seconds per step, clock fractions."""

    static_W: float
    demand_W: float
    voltage_floor: float
    fixed_s: float
    clock_s: float
    power_scale: float = 1.0

    @property
    def compute_share(self) -> float:
        """``c``: the share of a step at full clock that scales with the clock."""
        return self.clock_s / (self.fixed_s + self.clock_s)

    def clock(self, limit_W):
        return clock_under_cap(limit_W, self.static_W, self.demand_W, self.voltage_floor)

    def time_per_step_s(self, limit_W):
        return self.fixed_s + self.clock_s / np.maximum(self.clock(limit_W), 1e-9)

    def power_W(self, limit_W):
        """Mean measured power (W) at ``limit_W``."""
        return self.power_scale * np.minimum(np.asarray(limit_W, dtype=float), self.demand_W)

    def energy_per_step_J(self, limit_W):
        return self.power_W(limit_W) * self.time_per_step_s(limit_W)


@dataclass(frozen=True)
class DvfsFit:
    """A fit and how well it holds: ``residuals`` are (time, power) relative residuals per fitted limit."""

    model: DvfsModel
    limits_W: tuple[int, ...]
    residuals: tuple[tuple[float, float], ...]

    @property
    def max_residual(self) -> float:
        return max(max(abs(t), abs(p)) for t, p in self.residuals)


def _solve(limits, power, time, weights, static, demand, floor):
    """Best linear parameters and the weighted squared error of candidates (arrays of shape (K,))."""
    clock = clock_under_cap(limits[None, :], static[:, None], demand[:, None], floor[:, None])  # (K, m)
    ok = np.all(clock > 1e-6, axis=1)
    x = 1.0 / np.maximum(clock, 1e-6)
    # time: minimise sum w (a/T + b x/T - 1)^2 over a, b >= 0
    u, v = 1.0 / time[None, :], x / time[None, :]
    w = weights[None, :]
    suu, svv, suv = np.sum(w * u * u, 1), np.sum(w * v * v, 1), np.sum(w * u * v, 1)
    su, sv = np.sum(w * u, 1), np.sum(w * v, 1)
    det = suu * svv - suv * suv
    safe = np.where(np.abs(det) > 1e-300, det, 1.0)
    a = np.where(np.abs(det) > 1e-300, (su * svv - sv * suv) / safe, 0.0)
    b = np.where(np.abs(det) > 1e-300, (sv * suu - su * suv) / safe, sv / np.maximum(svv, 1e-300))
    only_b = a < 0  # a fully clock-bound step: a = 0
    a = np.where(only_b, 0.0, a)
    b = np.where(only_b, sv / np.maximum(svv, 1e-300), b)
    only_a = b < 0  # a step the clock does not touch (memory-bound): b = 0
    b = np.where(only_a, 0.0, b)
    a = np.where(only_a, su / np.maximum(suu, 1e-300), a)
    time_res = (a[:, None] + b[:, None] * x) / time[None, :] - 1.0
    # power: minimise sum w (k q - 1)^2, q = min(L, D) / P
    q = np.minimum(limits[None, :], demand[:, None]) / power[None, :]
    scale = np.sum(w * q, 1) / np.maximum(np.sum(w * q * q, 1), 1e-300)
    power_res = scale[:, None] * q - 1.0
    error = np.sum(w * (time_res**2 + power_res**2), 1)
    return np.where(ok, error, np.inf), a, b, scale, time_res, power_res


def fit_dvfs(limits_W, energy_per_step_J, time_per_step_s, weights=None, min_limit_W: float | None = None,
             max_limit_W: float | None = None) -> DvfsFit | None:
    """The model closest (weighted relative least squares on time and power) to profiled limits; None when
    fewer than :data:`MIN_LIMITS` distinct limits are given or no candidate runs at every limit.

    ``weights``: per limit (e.g. its window count); ``min_limit_W`` / ``max_limit_W``: the grid's range (the
    static power stays under the lowest limit the model must predict; the demand grid starts at the highest)."""
    limits = np.asarray(limits_W, dtype=float)
    if limits.size < MIN_LIMITS or np.unique(limits).size < MIN_LIMITS:
        return None
    time = np.asarray(time_per_step_s, dtype=float)
    power = np.asarray(energy_per_step_J, dtype=float) / time
    w = np.ones_like(limits) if weights is None else np.asarray(weights, dtype=float)
    low = float(min(limits.min(), min_limit_W if min_limit_W is not None else limits.min()))
    high = float(max(limits.max(), max_limit_W if max_limit_W is not None else limits.max()))
    top_power = float(power[np.argmax(limits)])
    demand_values = np.unique(np.concatenate([high * DEMAND_FACTORS, top_power * np.array([0.97, 1.0, 1.03])]))
    demand_values = demand_values[demand_values > low]
    static_values = low * STATIC_SHARES
    floor_values = VOLTAGE_FLOORS
    best = None
    for zoom in range(1 + ZOOMS):
        s, d, v = np.meshgrid(static_values, demand_values, floor_values, indexing="ij")
        s, d, v = s.ravel(), d.ravel(), v.ravel()
        keep = d > s
        s, d, v = s[keep], d[keep], v[keep]
        error, a, b, scale, time_res, power_res = _solve(limits, power, time, w, s, d, v)
        i = int(np.argmin(error))
        if not np.isfinite(error[i]):
            return None
        if best is None or error[i] <= best[0]:
            best = (float(error[i]), DvfsModel(float(s[i]), float(d[i]), float(v[i]), float(a[i]), float(b[i]),
                                               float(scale[i])), time_res[i], power_res[i])
        model = best[1]
        static_step = max(np.ptp(static_values) / max(len(static_values) - 1, 1), 1e-6)
        demand_step = model.demand_W * 0.05 / 4**zoom
        static_values = np.clip(model.static_W + static_step * np.linspace(-1, 1, 9), 0.0, 0.99 * low)
        demand_values = np.unique(np.clip(model.demand_W + demand_step * np.linspace(-1, 1, 9), low * 1.0001, None))
        floor_values = np.unique(np.clip(model.voltage_floor + np.linspace(-0.05, 0.05, 11) / 4**zoom, 0.0, 0.99))
    _, model, time_res, power_res = best
    return DvfsFit(model, tuple(int(x) for x in limits),
                   tuple((float(t), float(p)) for t, p in zip(time_res, power_res)))


# The coarser grid the search bounds gaps with (every candidate that fits within noise, not only the best).
BOUND_STATIC_SHARES = np.linspace(0.0, 0.9, 13)
BOUND_DEMAND_FACTORS = np.array([1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0])
BOUND_VOLTAGE_FLOORS = np.array([0.0, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9])


def consistent_predictions(limits_W, energy_per_step_J, time_per_step_s, margins, grid_W):
    """Energy (J) and time (s) per step at every limit of ``grid_W`` of every candidate model that fits each
    profiled limit within its margin (relative, time and power alike): arrays of shape (candidates, len(grid_W)),
    or None when fewer than :data:`MIN_LIMITS` distinct limits are profiled or no candidate fits (the profiles
    break the model). The candidates span static power, demand and voltage floor (the linear parameters at
    their least-squares values), so the spread of the predictions is what the profiles leave open."""
    limits = np.asarray(limits_W, dtype=float)
    if np.unique(limits).size < MIN_LIMITS:
        return None
    time = np.asarray(time_per_step_s, dtype=float)
    power = np.asarray(energy_per_step_J, dtype=float) / time
    margins = np.asarray(margins, dtype=float)
    grid = np.asarray(grid_W, dtype=float)
    low, high = float(min(limits.min(), grid.min())), float(max(limits.max(), grid.max()))
    top_power = float(power[np.argmax(limits)])
    demand_values = np.unique(np.concatenate([high * BOUND_DEMAND_FACTORS, top_power * np.array([0.97, 1.0, 1.03])]))
    s, d, v = np.meshgrid(low * BOUND_STATIC_SHARES, demand_values[demand_values > low], BOUND_VOLTAGE_FLOORS,
                          indexing="ij")
    s, d, v = s.ravel(), d.ravel(), v.ravel()
    weights = 1.0 / np.maximum(margins, 1e-6) ** 2
    error, a, b, scale, time_res, power_res = _solve(limits, power, time, weights, s, d, v)
    fits = np.isfinite(error) & np.all((np.abs(time_res) <= margins) & (np.abs(power_res) <= margins), axis=1)
    if not fits.any():
        return None
    s, d, v, a, b, scale = s[fits], d[fits], v[fits], a[fits], b[fits], scale[fits]
    clock = clock_under_cap(grid[None, :], s[:, None], d[:, None], v[:, None])
    if np.any(clock <= 1e-6):
        keep = np.all(clock > 1e-6, axis=1)
        if not keep.any():
            return None
        s, d, v, a, b, scale, clock = s[keep], d[keep], v[keep], a[keep], b[keep], scale[keep], clock[keep]
    times = a[:, None] + b[:, None] / clock
    energies = scale[:, None] * np.minimum(grid[None, :], d[:, None]) * times
    return energies, times
