"""What the optimizer receives in a reduced mode against a float32 replay of the same step.

A forward loss can agree with float32 to 1e-5 while the gradients do not: float16 without a gradient scaler
flushes gradients below 6e-8 to zero (with a loss scaled by 1e-6, 89 % of a small MLP's gradient elements;
the forward loss gap stays below 1e-4). ``PrecisionSwitch`` therefore compares, on the steps it already
replays in ``32-true`` (the profiling windows of each candidate and the ``probe_batches`` steps before each
guard check, never other steps), the gradient the optimizer is handed (after the scaler's unscale, before
clipping) with the float32 gradient of the same batch, weights and random numbers.

:func:`compare_gradients` sums, per step, on the device (no host synchronisation): the statistics of
:data:`GRAD_FIELDS`; they add over steps and ranks. :func:`gradient_summary` turns a sum into

- ``grad_error``: ``sqrt(sum ||g - g32||^2 / sum ||g32||^2)``, the relative error of the gradient vector
  (it holds both a wrong direction and a wrong norm: ``error^2 = 1 + r^2 - 2 r cos``);
- ``grad_cosine``: the mean cosine similarity of ``g`` and ``g32`` per step: the direction of an SGD update
  against float32's (for adaptive optimizers such as Adam, the direction of the gradient they are fed);
- ``grad_norm_ratio``: ``sqrt(sum ||g||^2 / sum ||g32||^2)``;
- ``grad_zero_share``: the share of gradient elements that are exactly zero where float32's are not
  (underflow);
- ``grad_nonfinite_share``: the share of gradient elements that are NaN or infinite.

:func:`gradient_verdict` rejects a mode whose ``grad_error`` exceeds the tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# the layout of the statistics (float64, summed over steps and ranks)
GRAD_N, GRAD_DIFF_SQ, GRAD_REF_SQ, GRAD_SQ, GRAD_COS_SUM, GRAD_ZERO, GRAD_NONFINITE, GRAD_ELEMS = range(8)
GRAD_FIELDS = ("steps", "diff_sq", "ref_sq", "grad_sq", "cos_sum", "zero", "nonfinite", "elements")
N_GRAD_STATS = len(GRAD_FIELDS)
# relative gradient error. Measured on the tests' 16-32-1 MLP: bf16-mixed 0.004, 16-mixed-noscale with the loss
# scaled by 1e-6 0.67; a loss 10 % off (gradients x 1.1) is 0.1, which the loss gap already catches
DEFAULT_GRAD_TOLERANCE = 0.25


def compare_gradients(grads: Sequence[Tensor | None], reference: Sequence[Tensor | None]) -> Tensor:
    """The statistics (:data:`GRAD_FIELDS`) of one step's gradients against float32's, a float64 tensor on the
    gradients' device; no host-device synchronisation. A missing gradient counts as zeros."""
    pairs = [(g, r) for g, r in zip(grads, reference) if g is not None or r is not None]
    device = next((t.device for pair in pairs for t in pair if t is not None), torch.device("cpu"))
    stats = torch.zeros(N_GRAD_STATS, dtype=torch.float64, device=device)
    if not pairs:
        return stats
    g = torch.cat([(x if x is not None else torch.zeros_like(r)).detach().reshape(-1).double() for x, r in pairs])
    r = torch.cat([(y if y is not None else torch.zeros_like(x)).detach().reshape(-1).double() for x, y in pairs])
    finite = torch.isfinite(g)
    # a step with a non-finite gradient is skipped (by the plugin, or by the scaler in 16-mixed): the optimizer
    # receives nothing, so only its non-finite elements are counted
    used = finite.all().double()
    g_finite = torch.where(finite, g, torch.zeros_like(g))
    ref_sq, grad_sq = (r * r).sum(), (g_finite * g_finite).sum()
    stats[GRAD_N] = used
    stats[GRAD_DIFF_SQ] = ((g_finite - r) ** 2).sum() * used
    stats[GRAD_REF_SQ] = ref_sq * used
    stats[GRAD_SQ] = grad_sq * used
    norms = torch.sqrt(ref_sq * grad_sq)
    cosine = torch.where(norms > 0, (g_finite * r).sum() / norms.clamp_min(1e-300), (ref_sq == grad_sq).double())
    stats[GRAD_COS_SUM] = cosine * used
    stats[GRAD_ZERO] = ((g == 0) & (r != 0)).sum() * used
    stats[GRAD_NONFINITE] = (~finite).sum()
    stats[GRAD_ELEMS] = g.numel()
    return stats


def gradient_summary(stats: Sequence[float]) -> dict:
    """The figures of summed statistics (None values when no step was compared)."""
    n = stats[GRAD_N]
    out = {"grad_steps": int(n), "grad_error": None, "grad_cosine": None, "grad_norm_ratio": None,
           "grad_zero_share": None, "grad_nonfinite_share": None}
    if not n:
        return out
    ref = stats[GRAD_REF_SQ]
    diff = stats[GRAD_DIFF_SQ]
    out["grad_error"] = math.sqrt(diff / ref) if ref > 0 else (0.0 if diff == 0 else math.inf)
    out["grad_norm_ratio"] = math.sqrt(stats[GRAD_SQ] / ref) if ref > 0 else None
    out["grad_cosine"] = stats[GRAD_COS_SUM] / n
    elements = stats[GRAD_ELEMS]
    out["grad_zero_share"] = stats[GRAD_ZERO] / elements if elements else None
    out["grad_nonfinite_share"] = stats[GRAD_NONFINITE] / elements if elements else None
    return out


def gradient_verdict(summary: dict, tolerance: float) -> str | None:
    """Why the gradients of ``summary`` (:func:`gradient_summary`) are not float32's, or None."""
    error = summary.get("grad_error")
    if error is None or error <= tolerance:
        return None
    return (f"gradient error {error:.3g} > grad_tolerance {tolerance:g} against a float32 replay (cosine "
            f"{_fmt(summary['grad_cosine'])}, norm ratio {_fmt(summary['grad_norm_ratio'])}, "
            f"{_pct(summary['grad_zero_share'])} underflowed to zero, {_pct(summary['grad_nonfinite_share'])} "
            f"non-finite, {summary['grad_steps']} steps)")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.3g} %"
