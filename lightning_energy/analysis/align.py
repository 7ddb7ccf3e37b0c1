"""A meter's readings put on a run's time axis: the clock offset, and drift, that line its power up with ours.

Both power curves go onto one even grid of ``h``-second bins, each bin the mean power over it (from the
cumulative energy, so no reading is lost or counted twice). For every candidate offset the Pearson
correlation of the two curves is taken over the bins both cover (a meter's gaps and the ends of either
curve left out: a masked, normalised cross-correlation, all lags at once through FFTs). Pearson's r ignores
scale and level, so a wall meter that also sees fans and PSU losses still lines up with a GPU sensor.
The best lag is refined between bins by a parabola through its neighbours. The runner-up (the best other
local peak, at least ``exclusion`` away) is reported: a periodic load (equal epochs) can make a shift of
one period look almost as good, and then the alignment is ambiguous.

Drift (the meter's clock running at another rate): where the fit is long enough the offset is found again
on each of four parts of it. Where the offsets change by more than a quarter bin, lie near a straight line
(scatter under a quarter of the change) and the slope is one a clock can have (``MAX_DRIFT``), the line is
applied as a linear map of the meter's clock; otherwise a note says the offset wanders. Drift matters
little to the energies (100 ppm over an hour moves an edge by 0.36 s) but keeps a long run aligned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_GRID_BINS = 1 << 19  # per curve; a finer grid is coarsened (peak memory: see the README paragraph)
MIN_BIN_S = 0.01
MIN_CORRELATION = 0.3  # below this the best lag is no evidence of an alignment
AMBIGUOUS_MARGIN = 0.02  # a runner-up within this of the best r makes the alignment ambiguous
MIN_OVERLAP = 0.8  # share of our curve's bins a lag must overlap with the meter's
DEFAULT_MAX_OFFSET_S = 120.0  # wall clocks: how far apart the clocks may be (NTP keeps them within ms)
DRIFT_SEGMENTS = 4  # the offset is measured on this many parts of the fit to see a drift
MIN_DRIFT_SEGMENT_S = 15.0  # each part needs this long (and 20 bins)
DRIFT_MAX_SCATTER = 0.25  # the parts' offsets must lie this close (x the change) to a straight line
MAX_DRIFT = 1e-3  # 1000 ppm: a quartz clock drifts 20-100 ppm; more is noise of the estimate, not a clock
DRIFT_RESOLUTION_BINS = 0.25  # parts' offsets closer than this many bins show no drift (the parabola's
# refinement resolves a peak to ~2 % of a bin on the tests' loads: 3.697 vs 3.695 s on 0.25 s bins)
FLAT_RELATIVE_STD = 1e-3  # our power varying by less than this share of its mean has nothing to align on


def cumulative_J(kind: str, time_s: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A meter's cumulative energy (J) at its reading times, from 0 at the first: a counter's own values, or
    for a power log MLPerf's rule (each reading times the time since the previous one)."""
    if kind == "energy":
        return values - values[0]
    return np.concatenate(([0.0], np.cumsum(values[1:] * np.diff(time_s))))


def find_gaps(time_s: np.ndarray, factor: float) -> list[tuple[float, float]]:
    """The intervals between readings longer than ``factor`` x the median interval: (start s, end s)."""
    steps = np.diff(time_s)
    longest = factor * float(np.median(steps))
    return [(float(time_s[i]), float(time_s[i + 1])) for i in np.flatnonzero(steps > longest)]


def binned_power(time_s: np.ndarray, cumulative: np.ndarray, start_s: float, bin_s: float, bins: int,
                 gaps=()) -> tuple[np.ndarray, np.ndarray]:
    """(mean power W per bin, mask of the bins the readings cover) on ``bins`` bins of ``bin_s`` from
    ``start_s``; bins outside the readings or touching a gap are masked out."""
    edges = start_s + bin_s * np.arange(bins + 1)
    power = np.diff(np.interp(edges, time_s, cumulative)) / bin_s
    covered = (edges[:-1] >= time_s[0]) & (edges[1:] <= time_s[-1])
    for gap_start, gap_end in gaps:
        first = max(int(np.searchsorted(edges, gap_start, side="right")) - 1, 0)
        last = int(np.searchsorted(edges, gap_end, side="left"))
        covered[first:last] = False
    return power, covered


def _correlations(a: np.ndarray, b: np.ndarray, size: int, fb=None) -> np.ndarray:
    """``sum_i a[i] b[i + d]`` for d = -(len(a)-1) .. len(b)-1 (FFT of length ``size``)."""
    fa = np.fft.rfft(a, size)
    fb = np.fft.rfft(b, size) if fb is None else fb
    full = np.fft.irfft(np.conj(fa) * fb, size)
    return np.concatenate((full[size - (len(a) - 1):], full[:len(b)])) if len(a) > 1 else full[:len(b)]


def masked_correlation(x: np.ndarray, mx: np.ndarray, y: np.ndarray, my: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(Pearson r, bins overlapped) for every lag d = -(n-1) .. m-1 of ``y`` against ``x``: r over the bins
    ``i`` where ``mx[i]`` and ``my[i + d]`` both hold (NaN where either curve is flat there)."""
    mx, my = mx.astype(float), my.astype(float)
    x = np.where(mx > 0, x - (x[mx > 0].mean() if mx.any() else 0.0), 0.0)
    y = np.where(my > 0, y - (y[my > 0].mean() if my.any() else 0.0), 0.0)
    size = 1 << int(math.ceil(math.log2(len(x) + len(y))))
    f_my, f_y, f_yy = (np.fft.rfft(v, size) for v in (my, y, y * y))
    count = np.rint(_correlations(mx, my, size, f_my))
    sx, sxx = _correlations(x, my, size, f_my), _correlations(x * x, my, size, f_my)
    sy, syy = _correlations(mx, y, size, f_y), _correlations(mx, y * y, size, f_yy)
    sxy = _correlations(x, y, size, f_y)
    with np.errstate(invalid="ignore", divide="ignore"):
        vx = sxx - sx * sx / count
        vy = syy - sy * sy / count
        r = (sxy - sx * sy / count) / np.sqrt(vx * vy)
    scale_x = np.max(x * x) * np.maximum(count, 1) * 1e-9
    scale_y = np.max(y * y) * np.maximum(count, 1) * 1e-9
    r[(count < 3) | (vx <= scale_x) | (vy <= scale_y)] = np.nan
    return np.clip(r, -1.0, 1.0), count


@dataclass
class Peak:
    """The best offset (s, added to the meter's times) with its r, and the runner-up peak's."""

    offset_s: float
    correlation: float
    runner_up_offset_s: float | None = None
    runner_up_correlation: float | None = None

    @property
    def ambiguous(self) -> bool:
        return self.runner_up_correlation is not None and \
            self.runner_up_correlation >= self.correlation - AMBIGUOUS_MARGIN


def best_offset(ours_t, ours_cum, window: tuple[float, float], meter_t, meter_cum, gaps, search: tuple[float, float],
                bin_s: float, exclusion_s: float, min_overlap: float = MIN_OVERLAP) -> Peak | str:
    """The offset in ``search`` (s) that best lines the meter's power up with ours over ``window`` (our
    axis, s), or a line saying why there is none (our power is flat; no lag overlaps enough)."""
    start, end = window
    n = max(int((end - start) / bin_s), 1)
    x, mx = binned_power(ours_t, ours_cum, start, bin_s, n)
    if mx.sum() < 3 or np.std(x[mx]) <= FLAT_RELATIVE_STD * max(abs(float(np.mean(x[mx]))), 1e-9):
        return "our power hardly varies over the fit: there is nothing to line the meter's curve up with"
    lo = max(search[0], start - meter_t[-1])
    hi = min(search[1], end - meter_t[0])
    meter_start = max(start - hi, meter_t[0])  # meter times the searched lags can put under our window
    meter_end = min(end - lo, meter_t[-1])
    if meter_end - meter_start < min_overlap * (end - start):
        return "the meter's log does not cover the fit at any offset searched"
    m = int((meter_end - meter_start) / bin_s) + 1
    y, my = binned_power(meter_t, meter_cum, meter_start, bin_s, m, gaps)
    r, count = masked_correlation(x, mx, y, my)
    lags = np.arange(-(n - 1), m)
    offsets = start - meter_start - lags * bin_s
    usable = (count >= min_overlap * mx.sum()) & (offsets >= lo - 1e-9) & (offsets <= hi + 1e-9) & np.isfinite(r)
    if not usable.any():
        return "no offset searched lets the meter's readings cover enough of the fit"
    scores = np.where(usable, r, -np.inf)
    best = int(np.argmax(scores))
    refined = float(best)
    if 0 < best < len(r) - 1 and usable[best - 1] and usable[best + 1]:
        a, b, c = scores[best - 1], scores[best], scores[best + 1]
        curve = a - 2 * b + c
        if curve < 0:
            refined = best + 0.5 * (a - c) / curve
    peak = Peak(float(start - meter_start - (refined - (n - 1)) * bin_s), float(scores[best]))
    local = usable.copy()
    local[1:] &= scores[1:] >= scores[:-1]
    local[:-1] &= scores[:-1] >= scores[1:]
    local &= np.abs(offsets - peak.offset_s) >= exclusion_s
    if local.any():
        other = int(np.argmax(np.where(local, scores, -np.inf)))
        peak.runner_up_offset_s, peak.runner_up_correlation = float(offsets[other]), float(scores[other])
    return peak


@dataclass
class Alignment:
    """How the meter's clock maps onto ours: ``ours = t + offset_s + drift * (t - reference_s)`` for a meter
    time ``t`` (s); ``offset_s`` is the offset at the fit's start (``reference_s``: that moment on the meter's
    clock). ``how``: ``"given"`` (``--offset``), ``"auto"`` (cross-correlation) or ``"assumed"`` (the clocks
    taken to agree: nothing to correlate)."""

    offset_s: float
    how: str
    drift: float = 0.0
    reference_s: float = 0.0
    correlation: float | None = None
    runner_up_offset_s: float | None = None
    runner_up_correlation: float | None = None
    bin_s: float | None = None
    segments: list[dict] = field(default_factory=list)  # the offset found on each part of the fit (drift)
    notes: list[str] = field(default_factory=list)

    def to_ours(self, meter_t: np.ndarray) -> np.ndarray:
        return meter_t + self.offset_s + self.drift * (meter_t - self.reference_s)

    @property
    def drift_ppm(self) -> float:
        """How much faster our clock runs than the meter's (parts per million)."""
        return self.drift * 1e6

    def as_dict(self) -> dict:
        return {"offset_s": self.offset_s, "how": self.how, "drift_ppm": self.drift_ppm,
                "correlation": self.correlation, "runner_up_offset_s": self.runner_up_offset_s,
                "runner_up_correlation": self.runner_up_correlation, "bin_s": self.bin_s,
                "segments": self.segments, "notes": list(self.notes)}


def grid_bin_s(meter_interval_s: float, ours_interval_s: float, span_s: float) -> float:
    """The correlation grid's bin (s): a quarter of the meter's interval (half of ours if coarser), at least
    ``MIN_BIN_S``, coarsened so that ``span_s`` fits ``MAX_GRID_BINS``."""
    return max(meter_interval_s / 4, ours_interval_s / 2, MIN_BIN_S, span_s / MAX_GRID_BINS)


def find_alignment(ours_t, ours_cum, fit: tuple[float, float], meter_t, meter_cum, gaps, search: tuple[float, float],
                   meter_interval_s: float, ours_interval_s: float) -> Alignment | str:
    """The alignment found by cross-correlation over the fit (our axis, s), searching offsets in ``search``;
    a line saying why when none is found."""
    span = (fit[1] - fit[0]) + (min(meter_t[-1], fit[1] - search[0]) - max(meter_t[0], fit[0] - search[1]))
    bin_s = grid_bin_s(meter_interval_s, ours_interval_s, max(span, 0.0))
    exclusion = max(3 * bin_s, 2 * meter_interval_s, 1.0)
    peak = best_offset(ours_t, ours_cum, fit, meter_t, meter_cum, gaps, search, bin_s, exclusion)
    if isinstance(peak, str):
        return peak
    if peak.correlation < MIN_CORRELATION:
        return (f"the best offset found ({peak.offset_s:+.3f} s) correlates the two power curves with r = "
                f"{peak.correlation:.2f} only: no alignment (is the log this run's, and its clock near ours?)")
    alignment = Alignment(peak.offset_s, "auto", 0.0, fit[0] - peak.offset_s, peak.correlation,
                          peak.runner_up_offset_s, peak.runner_up_correlation, bin_s)
    if peak.ambiguous:
        alignment.notes.append(
            f"ambiguous alignment: an offset of {peak.runner_up_offset_s:+.3f} s fits almost as well "
            f"(r = {peak.runner_up_correlation:.3f} against {peak.correlation:.3f}; a load that repeats, such as "
            "equal epochs?): check the plot, or give --offset")
    _add_drift(alignment, ours_t, ours_cum, fit, meter_t, meter_cum, gaps, bin_s)
    return alignment


def _add_drift(alignment: Alignment, ours_t, ours_cum, fit, meter_t, meter_cum, gaps, bin_s: float) -> None:
    """Find the offset on each of ``DRIFT_SEGMENTS`` parts of the fit; where they follow a steady drift
    (a straight line through them, see the module docstring), apply it."""
    start, end = fit
    part = (end - start) / DRIFT_SEGMENTS
    if part < max(MIN_DRIFT_SEGMENT_S, 20 * bin_s):
        return
    radius = max(2.0, 4 * bin_s)
    search = (alignment.offset_s - radius, alignment.offset_s + radius)
    centres, offsets = [], []
    for k in range(DRIFT_SEGMENTS):
        window = (start + k * part, start + (k + 1) * part)
        peak = best_offset(ours_t, ours_cum, window, meter_t, meter_cum, gaps, search, bin_s, radius)
        if isinstance(peak, str) or peak.correlation < MIN_CORRELATION:
            alignment.notes.append(f"clock drift not measured: part {k + 1} of {DRIFT_SEGMENTS} of the fit gives no "
                                   "alignment of its own")
            return
        centres.append(sum(window) / 2)
        offsets.append(peak.offset_s)
        alignment.segments.append({"centre_s": centres[-1] - start, "offset_s": peak.offset_s,
                                   "correlation": peak.correlation})
    slope, intercept = (float(v) for v in np.polyfit(centres, offsets, 1))  # offset (s) against our time (s)
    change = slope * (centres[-1] - centres[0])
    residual = float(np.sqrt(np.mean((np.polyval([slope, intercept], centres) - offsets) ** 2)))
    if abs(change) <= DRIFT_RESOLUTION_BINS * bin_s:
        return  # within what the refined peaks resolve: no drift to speak of
    if residual > DRIFT_MAX_SCATTER * abs(change) or abs(slope) > MAX_DRIFT:
        alignment.notes.append(
            f"the offset varies by {change:+.3f} s over the fit without a steady clock drift (scatter "
            f"{residual:.3f} s, "
            f"{slope * 1e6:+.0f} ppm): not corrected")
        return
    # ours = meter + offset(ours), offset(ours) = intercept + slope * ours  =>  ours = (meter + intercept) / (1 - slope)
    rate = 1.0 / (1.0 - slope)
    reference = start - (intercept + slope * start)  # the fit's start on the meter's clock
    alignment.drift, alignment.reference_s, alignment.offset_s = rate - 1.0, reference, start - reference
