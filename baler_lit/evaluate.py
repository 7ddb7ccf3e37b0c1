"""Compare original and restored data: per-column error summaries, Baler's plots, ratio/error trade-off.

For each column (frames are treated as one column of pixel values):

- residual ``r = restored − original`` in the column's physical units: mean, std, RMS, max |r|;
- errors relative to the column's range ``max − min`` of the original (dimensionless, comparable across
  columns and meaningful near zero): ``norm_rms = RMS(r) / range`` (the headline ``mean_norm_rms`` is its
  mean over columns), ``norm_median_abs = median |r| / range`` and ``norm_max_abs = max |r| / range``;
- response, the error relative to each value ``(restored − original) / original`` over the entries with
  ``original ≠ 0``: mean, std, mean |·| and median |·| (dimensionless; it explodes where values sit near zero
  compared with their range, so a median |response| above 1 flags such a column, not necessarily a bad fit);
- for integer columns, the fraction restored exactly;
- the earth mover's distance (1-D Wasserstein-1) between the column's original and restored distributions of
  values, ``emd`` in the column's units and ``norm_emd = emd / range`` (``mean_norm_emd``: its mean over columns):
  how far the restored histogram is from the original's, whatever the row order (:func:`earth_movers_distance`).
  Baler configures ``emd`` but never reads it; its unused ``mse_loss_emd_l1`` compares each row's values instead.

:func:`format_summary` prints every column's figures, then the worst columns by ``norm_rms`` and every
column whose median |response| exceeds :data:`RESPONSE_FLAG`, so the mean over columns hides none of them.

Figures (PNG in the output folder, and in TensorBoard when a log folder is given, beside the per-column
table in the Text tab): residual box plots
(``residual_boxplot.png``, residual / column range), before/after histograms (``histograms.png``), response
histograms (``response.png``), and, when the ``.baler`` file is given, the compression-ratio / error
trade-off over the latent storage dtypes (``tradeoff.png``). Frames also get ``frames.png``
(original, restored, difference of the first frame). matplotlib and TensorBoard are imported lazily.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .compression import LATENT_DTYPES, CompressedFile, decode
from .errors import BalerInputError, BalerOutputError, output_error
from .row_source import RowSource
from .table import Table, process_umask, removed_on_termination

#: Columns per figure row in the per-column histogram grids.
GRID_COLUMNS = 6
# A panel's title at a fixed height above its axes: matplotlib otherwise measures every axis's ticks to place
# each title (most of the drawing time of a 24-panel grid); the grids' tick labels are all below the axes.
PANEL_TITLE = {"fontsize": 7, "y": 1.0, "pad": 3}
HIST_BINS = 50
#: Resolution of the PNG figures (dots per inch).
FIG_DPI = 90
#: Worst columns (by RMS / range) named after the per-column table.
WORST_COLUMNS = 3
#: A median |response| (error relative to the value) above this is flagged.
RESPONSE_FLAG = 0.5


def _columns(table: Table) -> tuple[np.ndarray, list[str], np.ndarray]:
    """``(n_values, n_columns)`` view, column names and integer mask (frames → one ``value`` column)."""
    if table.is_frames:
        return table.data.reshape(-1, 1), ["value"], table.integer_mask[:1]
    return table.data, list(table.names), table.integer_mask


def check_comparable(original: Table | RowSource, restored: Table | RowSource) -> None:
    """Raise a clear error when the two tables cannot be compared entry by entry (row sources are compared from
    their headers, before either is read)."""
    if original.sample_shape != restored.sample_shape:
        raise BalerInputError(
            f"column-count mismatch: original {original.source} has samples of shape {original.sample_shape},"
            f" restored {restored.source} has {restored.sample_shape}"
        )
    if original.n_rows != restored.n_rows:
        raise BalerInputError(
            f"row-count mismatch: original {original.source} has {original.n_rows} rows,"
            f" restored {restored.source} has {restored.n_rows}"
        )


def earth_movers_distance(u: np.ndarray, v: np.ndarray) -> float:
    """Wasserstein-1 distance between the empirical distributions of the 1-D samples ``u`` and ``v`` (each value
    weighted 1/len), in their units: ``∫ |F_u(t) − F_v(t)| dt`` over the two step CDFs, exact, O(n log n)."""
    u, v = np.sort(np.asarray(u, dtype=np.float64).ravel()), np.sort(np.asarray(v, dtype=np.float64).ravel())
    if not len(u) or not len(v):
        raise BalerInputError("the earth mover's distance needs two non-empty samples")
    points = np.sort(np.concatenate([u, v]))
    widths = np.diff(points)
    cdf_u = np.searchsorted(u, points[:-1], side="right") / len(u)
    cdf_v = np.searchsorted(v, points[:-1], side="right") / len(v)
    return float(np.sum(np.abs(cdf_u - cdf_v) * widths))


def column_summaries(original: Table, restored: Table) -> list[dict[str, Any]]:
    """Per-column residual and relative-error statistics (see the module docstring for units)."""
    check_comparable(original, restored)
    x, names, integer = _columns(original)
    y, _, _ = _columns(restored)
    resid = y - x
    span = x.max(axis=0) - x.min(axis=0)
    rms = np.sqrt(np.mean(resid**2, axis=0))
    nonzero = x != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        response = np.where(nonzero, resid / np.where(nonzero, x, 1.0), np.nan)
    out = []
    for j, name in enumerate(names):
        rj = response[:, j]
        rj = rj[np.isfinite(rj)]
        row: dict[str, Any] = {
            "column": name,
            "integer": bool(integer[j]),
            "residual_mean": float(resid[:, j].mean()),
            "residual_std": float(resid[:, j].std()),
            "residual_rms": float(rms[j]),
            "residual_max_abs": float(np.abs(resid[:, j]).max()),
            "range": float(span[j]),
            "norm_rms": float(rms[j] / span[j]) if span[j] > 0 else float(rms[j]),
            "norm_median_abs": float(np.median(np.abs(resid[:, j])) / (span[j] if span[j] > 0 else 1.0)),
            "norm_max_abs": float(np.abs(resid[:, j]).max() / (span[j] if span[j] > 0 else 1.0)),
            "value_median_abs_over_range": float(np.median(np.abs(x[:, j])) / (span[j] if span[j] > 0 else 1.0)),
            "response_mean": float(rj.mean()) if rj.size else None,
            "response_std": float(rj.std()) if rj.size else None,
            "response_mean_abs": float(np.abs(rj).mean()) if rj.size else None,
            "response_median_abs": float(np.median(np.abs(rj))) if rj.size else None,
        }
        emd = earth_movers_distance(x[:, j], y[:, j])
        row["emd"] = emd
        row["norm_emd"] = emd / span[j] if span[j] > 0 else emd
        if integer[j]:
            row["exact_fraction"] = float(np.mean(resid[:, j] == 0))
        out.append(row)
    return out


def overall_error(original: Table, restored_values: np.ndarray) -> float:
    """Mean over columns of ``RMS(residual) / column range`` (dimensionless)."""
    x, _, _ = _columns(original)
    y = restored_values.reshape(x.shape)
    span = x.max(axis=0) - x.min(axis=0)
    rms = np.sqrt(np.mean((y - x) ** 2, axis=0))
    return float(np.mean(np.where(span > 0, rms / np.where(span > 0, span, 1.0), rms)))


def tradeoff(original: Table, compressed: CompressedFile) -> list[dict[str, Any]]:
    """Ratio and error when the latent of ``compressed`` is stored in each latent dtype.

    The file size for another dtype is the actual file size with the latent bytes replaced by
    ``n_rows × latent_dim × itemsize``; the latent is rounded to that dtype and decoded with the stored
    decoder. Entries coarser than the stored dtype show the loss of re-rounding; finer ones cannot recover
    precision the file does not hold, so their error equals the stored one. A file's constant columns and
    error-bound corrections are applied to every entry (the corrections were chosen for the stored dtype, so
    coarser entries may miss the bound elsewhere).
    """
    h = compressed.header
    latent_bytes = h["arrays"]["latent"]["nbytes"]
    n_latent = h["n_rows"] * h["model"]["latent_dim"]
    rows = []
    for name, (_, np_dtype) in LATENT_DTYPES.items():
        size = compressed.file_bytes - latent_bytes + n_latent * np_dtype.itemsize
        try:
            error = overall_error(original, decode(compressed, latent_dtype=name).astype(np.float64, copy=False))
        except BalerInputError:
            if name == h["latent_dtype"]:
                raise
            error = None  # the latent overflows this dtype: it cannot be stored in it
        rows.append(
            {
                "latent_dtype": name,
                "stored": name == h["latent_dtype"],
                "file_bytes": int(size),
                "ratio": h["original_bytes"] / size,
                "mean_norm_rms": error,
            }
        )
    return rows


def file_parts(original: Table, restored: Table, compressed: CompressedFile) -> dict[str, Any]:
    """Constant columns and error-bound corrections of ``compressed``: their count, share and size (bytes), and
    the values of ``restored`` measured over the file's bound (0 when the guarantee holds)."""
    from .error_bound import ErrorBound

    h = compressed.header
    parts: dict[str, Any] = {"constant_columns": h.get("constants", {}).get("count", 0), "error_bound": None}
    spec = h.get("corrections")
    if spec is not None:
        bound = ErrorBound(spec["relative"], spec["absolute"])
        nbytes = sum(h["arrays"][k]["nbytes"] for k in ("corrections_index", "corrections_value"))
        over = np.abs(restored.data - original.data) > bound.allowed(original.data)
        parts["error_bound"] = {
            "relative": spec["relative"], "absolute": spec["absolute"], "corrections": spec["count"],
            "corrected_share": spec["count"] / original.data.size, "bytes": nbytes,
            "file_share": nbytes / compressed.file_bytes, "values_over_bound": int(over.sum()),
        }  # fmt: skip
    return parts


def check_compressed_matches(original: Table | RowSource, compressed: CompressedFile) -> None:
    """Raise a clear error when ``compressed`` does not hold ``original``'s rows and columns."""
    h = compressed.header
    if (h["n_rows"], tuple(h["sample_shape"])) != (original.n_rows, original.sample_shape):
        raise BalerInputError(
            f"compressed file {compressed.path} holds {h['n_rows']} rows of shape {tuple(h['sample_shape'])},"
            f" the original {original.source} {original.n_rows} rows of shape {original.sample_shape}:"
            " it is not the compressed form of this data"
        )
    if not original.is_frames and _named(h["names"]) and _named(original.names) and h["names"] != original.names:
        raise BalerInputError(
            f"compressed file {compressed.path} has other columns than the original {original.source}"
            f" (first difference: {next(a for a, b in zip(h['names'], original.names) if a != b)!r})"
        )


def _named(names: list[str]) -> bool:
    return not all(n == f"col_{i}" for i, n in enumerate(names))


# -- figures -----------------------------------------------------------------------------------------------
#: A histogram panel whose fullest bin holds at least this share of the values is a spike: drawn on a log y axis
#: (the panel says so), so the other values stay visible beside it.
SPIKE_SHARE = 0.5
#: The response histograms span the central values: |response| up to this percentile of the nonzero ones; the
#: values beyond are counted in the panel, never piled into the edge bins.
RESPONSE_PERCENTILE = 99
#: The trade-off plot's error axis spans at least this fraction of the error either side of the mean: errors that
#: differ by less read as one level, not as 7-digit ticks.
TRADEOFF_MIN_SPAN = 0.02


def beyond_whiskers(values: np.ndarray) -> np.ndarray:
    """Per column of ``values`` ``(n, columns)``: how many values lie beyond the box plot's whiskers (further
    than 1.5 × the interquartile range from the quartiles, matplotlib's rule), the points a box plot without
    fliers leaves out."""
    q1, q3 = np.percentile(values, [25, 75], axis=0)
    reach = 1.5 * (q3 - q1)
    return ((values < q1 - reach) | (values > q3 + reach)).sum(axis=0)


def histogram_panel(original: np.ndarray, restored: np.ndarray) -> dict[str, Any]:
    """How one column's before/after histogram is drawn: ``bins`` spanning both the original and the restored
    values (none falls outside), ``log_y`` where the original is a spike (its fullest bin holds at least
    :data:`SPIKE_SHARE` of the values), a ``note`` for the panel's title (a constant, a spike's share) and
    ``ticks`` (the value of a constant column, else None: the axis chooses)."""
    lo = float(min(original.min(), restored.min()))
    hi = float(max(original.max(), restored.max()))
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    bins = np.linspace(lo, hi, HIST_BINS + 1)
    counts, _ = np.histogram(original, bins=bins)
    share = counts.max() / original.size
    if original.min() == original.max():  # one bar however drawn: a log axis adds nothing
        return {"bins": bins, "log_y": False, "note": f"constant {original[0]:.6g}", "ticks": [float(original[0])]}
    if share >= SPIKE_SHARE:
        fullest = int(counts.argmax())
        note = f"{100 * share:.3g}% in [{bins[fullest]:.3g}, {bins[fullest + 1]:.3g}], log y"
        return {"bins": bins, "log_y": True, "note": note, "ticks": None}
    return {"bins": bins, "log_y": False, "note": None, "ticks": None}


def response_histogram(response: np.ndarray) -> dict[str, Any]:
    """The response histogram of one column: ``counts`` over ``edges`` spanning ±``limit`` (the
    :data:`RESPONSE_PERCENTILE` th percentile of the nonzero |response|), and how many values lie ``below`` and
    ``above`` it (counted apart, not piled into the edge bins)."""
    nonzero = np.abs(response[response != 0])  # exactly restored integers would shrink the range to nothing
    limit = float(np.percentile(nonzero, RESPONSE_PERCENTILE)) if nonzero.size else 1.0
    edges = np.linspace(-limit, limit, HIST_BINS + 1)
    counts, _ = np.histogram(response[np.abs(response) <= limit], bins=edges)
    return {"counts": counts, "edges": edges, "limit": limit,
            "below": int((response < -limit).sum()), "above": int((response > limit).sum())}


def tradeoff_points(trade: list[dict[str, Any]], tolerance: float = 1e-3) -> list[tuple[float, float, str]]:
    """``(ratio, error, label)`` per distinct point of the trade-off: dtypes whose ratio and error agree to
    ``tolerance`` (relative) share one point and one label (``"float16, bfloat16"``), so no two labels collide."""
    points: list[list] = []
    for t in trade:
        for point in points:
            if np.isclose(point[0], t["ratio"], rtol=tolerance) and np.isclose(point[1], t["mean_norm_rms"],
                                                                                rtol=tolerance):
                point[2].append(t["latent_dtype"])
                break
        else:
            points.append([t["ratio"], t["mean_norm_rms"], [t["latent_dtype"]]])
    return [(ratio, error, ", ".join(names)) for ratio, error, names in points]


def _tradeoff_figure(trade: list[dict[str, Any]]):
    """Compression ratio vs error, one labelled point per distinct (ratio, error); plain tick labels."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    points = tradeoff_points(trade)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ordered = sorted(points)  # by compression ratio: the line joins the dtypes left to right
    ax.plot([p[0] for p in ordered], [p[1] for p in ordered], "o-")
    for ratio, error, label in points:
        ax.annotate(label, (ratio, error), xytext=(5, 5), textcoords="offset points", fontsize=8)
    errors = [p[1] for p in points]
    middle, half = 0.5 * (max(errors) + min(errors)), 0.5 * (max(errors) - min(errors))
    span = max(half * 1.3, TRADEOFF_MIN_SPAN * abs(middle)) or 1.0
    ax.set_ylim(middle - span, middle + span)
    ax.margins(x=0.15)
    for axis in (ax.xaxis, ax.yaxis):
        formatter = ScalarFormatter(useOffset=False)
        formatter.set_scientific(False)
        axis.set_major_formatter(formatter)
    ax.set_xlabel("compression ratio (original bytes / file bytes)")
    ax.set_ylabel("mean normalised RMS error")
    same = half <= TRADEOFF_MIN_SPAN * abs(middle)
    ax.set_title("Ratio / error trade-off (latent dtype)" + ("\nerrors within 2 % of each other" if same else ""),
                 fontsize=10)
    fig.tight_layout()
    return fig


def _figures(original: Table, restored: Table, trade: list[dict[str, Any]] | None) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, MaxNLocator, NullLocator

    x, names, _ = _columns(original)
    y, _, _ = _columns(restored)
    span = x.max(axis=0) - x.min(axis=0)
    resid_norm = (y - x) / np.where(span > 0, span, 1.0)
    figs: dict[str, Any] = {}

    hidden = beyond_whiskers(resid_norm)
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.3 * len(names) + 1.4)))
    ax.boxplot(resid_norm, orientation="horizontal", showfliers=False)  # thousands of fliers: slow and unreadable
    rows = np.arange(1, len(names) + 1)
    ax.plot(resid_norm.min(axis=0), rows, "x", color="grey", ms=4, label="smallest / largest")
    ax.plot(resid_norm.max(axis=0), rows, "x", color="grey", ms=4)
    ax.set_yticks(rows, [f"{n} ({k} beyond)" if k else n for n, k in zip(names, hidden)], fontsize=7)
    ax.invert_yaxis()  # first column on top
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("residual / column range (restored − original)")
    ax.set_title(f"Residuals per column: box = quartiles, whiskers = 1.5 × IQR; {int(hidden.sum())} value(s) "
                 "beyond the\nwhiskers not drawn one by one (count per column in brackets), × = smallest and largest",
                 fontsize=9)
    fig.tight_layout()
    figs["residual_boxplot"] = fig

    def grid(title: str):
        n = len(names)
        ncols = min(GRID_COLUMNS, n)
        nrows = math.ceil(n / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.0 * nrows), squeeze=False)
        # fixed margins: tight_layout over dozens of axes costs seconds
        fig.subplots_adjust(left=0.05, right=0.98, bottom=0.05, top=1 - 1.0 / (2.0 * nrows), hspace=0.75, wspace=0.35)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        for ax in axes.flat[:n]:
            # few ticks: drawing tick labels is most of the rendering time of a large grid
            ax.set_yticks([])
            ax.xaxis.set_major_locator(MaxNLocator(3))
            ax.tick_params(labelsize=6)
        fig.suptitle(title)
        return fig, axes.flat

    def log_counts(ax) -> None:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(numticks=3))
        ax.yaxis.set_minor_locator(NullLocator())  # unlabelled minor ticks of dozens of panels: seconds to draw
        ax.tick_params(axis="y", which="both", labelsize=6, left=True, labelleft=True)

    fig, axes = grid("Before (original) / after (restored); count axis linear unless the panel says log y")
    for j, ax in enumerate(axes):
        if j >= len(names):
            break
        panel = histogram_panel(x[:, j], y[:, j])
        ax.hist(x[:, j], bins=panel["bins"], histtype="step", label="original")
        ax.hist(y[:, j], bins=panel["bins"], histtype="step", label="restored")
        if panel["log_y"]:
            log_counts(ax)
        if panel["ticks"] is not None:
            ax.set_xticks(panel["ticks"], [f"{t:.6g}" for t in panel["ticks"]])
        ax.set_title(names[j] + (f"\n({panel['note']})" if panel["note"] else ""), **PANEL_TITLE)
    axes[0].legend(fontsize=6)
    figs["histograms"] = fig

    fig, axes = grid(f"Response (restored − original) / original, log count; values beyond the "
                     f"{RESPONSE_PERCENTILE}th percentile of |response| counted, not drawn")
    for j, ax in enumerate(axes):
        if j >= len(names):
            break
        nz = x[:, j] != 0
        resp = (y[nz, j] - x[nz, j]) / x[nz, j]
        title = names[j]
        if resp.size:
            hist = response_histogram(resp)
            ax.stairs(hist["counts"], hist["edges"], fill=True, alpha=0.7)
            log_counts(ax)
            beyond = hist["below"] + hist["above"]
            if beyond:
                title += f"\n({beyond} beyond ±{hist['limit']:.3g} not shown)"
        else:
            title += "\n(no nonzero original)"
        ax.set_title(title, **PANEL_TITLE)
    figs["response"] = fig

    if original.is_frames:
        fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
        for ax, img, title in zip(
            axes, (original.data[0], restored.data[0], restored.data[0] - original.data[0]),
            ("original frame 0", "restored frame 0", "difference"),
        ):
            im = ax.imshow(img, cmap="viridis")
            ax.set_title(title)
            fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        figs["frames"] = fig

    trade = [t for t in trade or [] if t["mean_norm_rms"] is not None]
    if trade:
        figs["tradeoff"] = _tradeoff_figure(trade)
    return figs


def worst_columns(summary: dict[str, Any], n: int = WORST_COLUMNS) -> list[dict[str, Any]]:
    """The ``n`` columns with the largest RMS / range, worst first."""
    return sorted(summary["columns"], key=lambda c: c["norm_rms"], reverse=True)[:n]


def flagged_columns(summary: dict[str, Any], limit: float = RESPONSE_FLAG) -> list[dict[str, Any]]:
    """Columns whose median |error relative to the value| exceeds ``limit``, largest first."""
    flagged = [c for c in summary["columns"] if (c["response_median_abs"] or 0.0) > limit]
    return sorted(flagged, key=lambda c: c["response_median_abs"], reverse=True)


def error_headline(summary: dict[str, Any]) -> str:
    """One line: the mean error over columns, the worst column, and the columns with large relative errors."""
    worst = worst_columns(summary, 1)
    line = (f"RMS/range {summary['mean_norm_rms']:.4f} (mean over {len(summary['columns'])} columns; error relative "
            f"to each column's range)")
    if worst:
        line += f", worst {worst[0]['column']} {worst[0]['norm_rms']:.4f}"
    flagged = flagged_columns(summary)
    if flagged:
        named = ", ".join(f"{c['column']} ({c['response_median_abs']:.2f})" for c in flagged[:WORST_COLUMNS])
        more = f" and {len(flagged) - WORST_COLUMNS} more" if len(flagged) > WORST_COLUMNS else ""
        line += f"; median |error/value| > {RESPONSE_FLAG:g} on {named}{more} (see the table)"
    return line


def format_summary(summary: dict[str, Any]) -> str:
    """Plain-text table of every column's errors, the worst columns, the overall error and the trade-off.

    Columns: ``rms`` (physical units), ``rms/range``, ``med|r|/range`` and ``max|r|/range`` (relative to the
    column's range: max − min of the original), ``med|r/x|`` (median error relative to the value itself),
    ``exact`` (integer columns: fraction restored exactly).
    """
    lines = [f"{'column':<28} {'rms':>10} {'rms/range':>9} {'med|r|/range':>12} {'max|r|/range':>12} "
             f"{'med|r/x|':>9} {'exact':>6}"]
    for c in summary["columns"]:
        resp = "-" if c["response_median_abs"] is None else f"{c['response_median_abs']:.3g}"
        exact = f"{c['exact_fraction']:.2f}" if "exact_fraction" in c else ""
        median = c.get("norm_median_abs")
        largest = c.get("norm_max_abs")
        lines.append(f"{c['column'][:28]:<28} {c['residual_rms']:>10.4g} {c['norm_rms']:>9.4f} "
                     f"{'-' if median is None else f'{median:.4f}':>12} {'-' if largest is None else f'{largest:.4f}':>12} "
                     f"{resp:>9} {exact:>6}")
    lines.append("errors relative to each column's range (max - min of the original): rms/range, med|r|/range, "
                 "max|r|/range; med|r/x|: median |restored - original| / |original| over nonzero originals")
    lines.append(f"mean normalised RMS error (rms/range, mean over columns): {summary['mean_norm_rms']:.5f}")
    if summary.get("mean_norm_emd") is not None:
        lines.append(f"earth mover's distance between original and restored values (emd/range, mean over columns):"
                     f" {summary['mean_norm_emd']:.5f}")
    worst = worst_columns(summary)
    if worst:
        lines.append("worst columns by rms/range: " + ", ".join(f"{c['column']} {c['norm_rms']:.4f}" for c in worst))
    flagged = flagged_columns(summary)
    if flagged:
        lines.append(f"median |error/value| above {RESPONSE_FLAG:g} (an error relative to the value explodes where "
                     "values sit near zero; med|x|/range says how near):")
        lines += [f"  {c['column']}: med|r/x| {c['response_median_abs']:.3g}, med|r|/range "
                  f"{c.get('norm_median_abs', float('nan')):.4f}, med|x|/range "
                  f"{c.get('value_median_abs_over_range', float('nan')):.4f}" for c in flagged]
    if summary.get("compression_ratio") is not None:
        lines.append(f"compression ratio (whole file): {summary['compression_ratio']:.3f}")
    for t in summary.get("tradeoff") or []:
        mark = " (stored)" if t["stored"] else ""
        error = "not representable" if t["mean_norm_rms"] is None else f"{t['mean_norm_rms']:.5f}"
        lines.append(f"  latent {t['latent_dtype']:<8} ratio {t['ratio']:7.3f}  error {error}{mark}")
    if summary.get("constant_columns"):
        lines.append(f"constant columns stored exactly in the file: {summary['constant_columns']}")
    bound = summary.get("error_bound")
    if bound:
        lines.append(
            f"error bound (relative {bound['relative']}, absolute {bound['absolute']}): {bound['corrections']} values"
            f" corrected ({100 * bound['corrected_share']:.3g} %), {bound['bytes']} bytes"
            f" ({100 * bound['file_share']:.1f} % of the file); values over the bound here: {bound['values_over_bound']}"
        )
    return "\n".join(lines)


def summary_markdown(summary: dict[str, Any]) -> str:
    """The evaluation as one markdown table (TensorBoard's Text tab), with the headline above it."""
    rows = ["| column | rms | rms/range | med\\|r\\|/range | max\\|r\\|/range | med\\|r/x\\| | exact |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for c in summary["columns"]:
        resp = "-" if c["response_median_abs"] is None else f"{c['response_median_abs']:.3g}"
        exact = f"{c['exact_fraction']:.2f}" if "exact_fraction" in c else ""
        rows.append(f"| {c['column']} | {c['residual_rms']:.4g} | {c['norm_rms']:.4f} | "
                    f"{c.get('norm_median_abs', float('nan')):.4f} | {c.get('norm_max_abs', float('nan')):.4f} | "
                    f"{resp} | {exact} |")
    parts = [f"**reconstruction error**: {error_headline(summary)}"]
    if summary.get("compression_ratio") is not None:
        parts.append(f"**compression ratio** (whole file): {summary['compression_ratio']:.3f}")
        trade = [f"- latent {t['latent_dtype']}: ratio {t['ratio']:.3f}, RMS/range {t['mean_norm_rms']:.5f}"
                 + (" (stored)" if t["stored"] else "") for t in summary.get("tradeoff") or []]
        if trade:
            parts.append("\n".join(trade))
    parts.append("\n".join(rows))
    parts.append("rms/range, med|r|/range, max|r|/range: relative to the column's range (max - min of the "
                 "original); med|r/x|: median |restored - original| / |original| over nonzero originals")
    return "\n\n".join(parts)


def evaluate(
    original: Table,
    restored: Table,
    out_dir: str | os.PathLike,
    compressed: CompressedFile | None = None,
    tensorboard_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    plots: bool = True,
) -> dict[str, Any]:
    """Write ``summary.json`` and (with ``plots``) the PNG figures to ``out_dir``; return the summary dict.

    Drawing the figures is most of the command's time (matplotlib's import and ~50 axes: about 4 s here where
    everything else takes 0.2 s beyond torch's import); ``plots=False`` skips them and never imports matplotlib.

    ``out_dir`` must not exist (it is filled under a temporary name and renamed) unless ``overwrite``.
    With ``tensorboard_dir`` the figures and the per-column table (text) are also written as TensorBoard events;
    a ``tensorboard_dir`` that cannot be a folder is refused before anything is written (:func:`check_outputs`).
    """
    check_comparable(original, restored)
    if compressed is not None:
        check_compressed_matches(original, compressed)
    if plots:  # before anything is written
        from lightning_energy.extras import check_installed

        check_installed("matplotlib", "baler-lit evaluate's figures (--no-plots skips them)", extra="baler")
    out = check_outputs(out_dir, tensorboard_dir, overwrite)
    summary: dict[str, Any] = {
        "original": original.source,
        "restored": restored.source,
        "n_rows": original.n_rows,
        "sample_shape": list(original.sample_shape),
        "columns": column_summaries(original, restored),
        "mean_norm_rms": overall_error(original, restored.data),
        "compression_ratio": None,
        "tradeoff": None,
    }
    summary["mean_norm_emd"] = float(np.mean([c["norm_emd"] for c in summary["columns"]]))
    if compressed is not None:
        summary["compression_ratio"] = compressed.header["original_bytes"] / compressed.file_bytes
        summary["file_bytes"] = compressed.file_bytes
        summary["tradeoff"] = tradeoff(original, compressed)
        summary.update(file_parts(original, restored, compressed))
    pngs: dict[str, bytes] = {}
    if plots:
        figs = _figures(original, restored, summary["tradeoff"])
        import matplotlib.pyplot as plt

        try:
            pngs = _render(figs)
        finally:
            for fig in figs.values():
                plt.close(fig)
    _write_report(out, pngs, summary)
    if tensorboard_dir is not None:
        _to_tensorboard(tensorboard_dir, pngs, summary)
    return summary


def check_outputs(
    out_dir: str | os.PathLike, tensorboard_dir: str | os.PathLike | None = None, overwrite: bool = False
) -> Path:
    """Refuse, before anything is read or written, a report folder or TensorBoard folder that cannot be written
    (see :func:`evaluate`); return the report folder as a Path."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise BalerInputError(f"output folder {out} already exists; pass --overwrite to replace its files")
    if out.exists() and not out.is_dir():
        raise BalerInputError(f"output {out} is not a folder")
    if not out.parent.is_dir():
        raise BalerInputError(f"output directory {out.parent} does not exist")
    if not os.access(out if out.exists() else out.parent, os.W_OK | os.X_OK):
        raise BalerOutputError(f"output directory {out if out.exists() else out.parent} is not writable")
    if tensorboard_dir is not None:
        _check_tensorboard_dir(Path(tensorboard_dir))
    return out


def _check_tensorboard_dir(log_dir: Path) -> None:
    """The TensorBoard folder is made (with its missing parents) when the events are written: the path and every
    existing folder above it must be folders, and the nearest existing one writable."""
    existing = next((p for p in (log_dir, *log_dir.parents) if p.exists()), log_dir)
    if not existing.is_dir():
        raise BalerInputError(f"TensorBoard folder {log_dir}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BalerOutputError(f"TensorBoard folder {log_dir}: {existing} is not writable")


def _render(figs: dict[str, Any]) -> dict[str, bytes]:
    """Render every figure once to PNG bytes (reused for the files and for TensorBoard)."""
    out = {}
    for name, fig in figs.items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=FIG_DPI)
        out[name] = buf.getvalue()
    return out


def _write_report(out: Path, pngs: dict[str, bytes], summary: dict[str, Any]) -> None:
    """Save figures and summary. A new folder is filled under a private temporary name
    (:func:`tempfile.mkdtemp`: created exclusively, unpredictable, mode 0700) and renamed at the end;
    a failure, SIGINT or SIGTERM removes it. ``OSError`` becomes :class:`BalerOutputError`."""
    try:
        target = out if out.exists() else Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise output_error(out, exc, "create") from None
    try:
        with removed_on_termination():
            for name, png in pngs.items():
                (target / f"{name}.png").write_bytes(png)
            (target / "summary.json").write_text(json.dumps(summary, indent=1))
            if target != out:
                os.chmod(target, 0o777 & ~process_umask())  # as a plain mkdir would have made it
                os.replace(target, out)
    except OSError as exc:
        raise output_error(out, exc) from None
    finally:
        if target != out:
            shutil.rmtree(target, ignore_errors=True)


def _to_tensorboard(log_dir: str | os.PathLike, pngs: dict[str, bytes], summary: dict[str, Any]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for name, png in pngs.items():
            import matplotlib.image as mpimg

            writer.add_image(f"evaluate/{name}", mpimg.imread(io.BytesIO(png), format="png"), dataformats="HWC")
        # one table in the Text tab (a scalar per column made a page of single-point charts)
        writer.add_text("evaluate/summary", summary_markdown(summary))
    finally:
        writer.close()
