"""Numeric precision modes: what each runs, its logged code, where it is available.

Modes (``code`` is the number logged as ``precision/mode``; higher means less precise):

====  ====================  ==============================================================================
code  name                  what runs
====  ====================  ==============================================================================
0     ``64-true``           float64 parameters and inputs (Baler's original arithmetic); fixed at setup
1     ``32-true``           float32, TF32 off for matmul and cuDNN on CUDA: the full-precision reference
2     ``tf32``              float32 with TF32 matmul and cuDNN convolutions (CUDA, compute capability >= 8)
3     ``bf16-mixed``        autocast to bfloat16 (CPU and CUDA)
4     ``16-mixed``          autocast to float16 with dynamic gradient scaling (``torch.amp.GradScaler``)
5     ``16-mixed-noscale``  autocast to float16 without gradient scaling
====  ====================  ==============================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionMode:
    """One way of running the numerics of a training step."""

    name: str
    code: int  # logged as ``precision/mode``; the order is the fallback order (lower = safer)
    autocast_dtype: torch.dtype | None  # dtype of ``torch.autocast`` in the forward pass, None: no autocast
    grad_scaling: bool  # dynamic loss scaling with ``torch.amp.GradScaler``
    tf32: bool  # TF32 allowed for float32 matmul and cuDNN convolutions (CUDA only)
    param_dtype: torch.dtype  # master dtype of the parameters
    lightning_precision: str  # what ``trainer.precision`` reports in this mode
    description: str

    @property
    def reduced(self) -> bool:
        """True for modes less precise than the float32 reference."""
        return self.code > REFERENCE_CODE


_MODES = (
    PrecisionMode("64-true", 0, None, False, False, torch.float64, "64-true", "float64 parameters and inputs"),
    PrecisionMode("32-true", 1, None, False, False, torch.float32, "32-true", "float32, TF32 off"),
    PrecisionMode("tf32", 2, None, False, True, torch.float32, "32-true", "float32 with TF32 matmul/cuDNN (CUDA)"),
    PrecisionMode("bf16-mixed", 3, torch.bfloat16, False, False, torch.float32, "bf16-mixed",
                  "autocast bfloat16"),
    PrecisionMode("16-mixed", 4, torch.float16, True, False, torch.float32, "16-mixed",
                  "autocast float16 with gradient scaling"),
    PrecisionMode("16-mixed-noscale", 5, torch.float16, False, False, torch.float32, "16-mixed",
                  "autocast float16 without gradient scaling"),
)
MODES: dict[str, PrecisionMode] = {m.name: m for m in _MODES}
MODE_NAMES: tuple[str, ...] = tuple(m.name for m in _MODES)  # safest first: the fallback order
REFERENCE_MODE = "32-true"
REFERENCE_CODE = MODES[REFERENCE_MODE].code
MODE_LEGEND = ", ".join(f"{m.code} = {m.name}" for m in _MODES)


def get_mode(name: str, argument: str = "mode") -> PrecisionMode:
    """The mode called ``name``; a ``ValueError`` naming ``argument`` otherwise."""
    if not isinstance(name, str) or name not in MODES:
        raise ValueError(f"`{argument}` must be one of {list(MODE_NAMES)}, got {name!r}")
    return MODES[name]


def unavailable_reason(mode: PrecisionMode, device_type: str) -> str | None:
    """Why ``mode`` cannot run on ``device_type`` (``"cpu"``, ``"cuda"``, ...), or None if it can."""
    if mode.tf32:
        if device_type != "cuda":
            return "TF32 is a CUDA feature"
        if torch.cuda.get_device_capability()[0] < 8:
            return "TF32 needs a CUDA GPU of compute capability 8.0 or newer (Ampere)"
    if mode.autocast_dtype is not None:
        if not torch.amp.is_autocast_available(device_type):
            return f"torch.autocast does not support device type {device_type!r}"
        if mode.autocast_dtype == torch.bfloat16 and device_type == "cuda" and not torch.cuda.is_bf16_supported():
            return "this CUDA GPU does not support bfloat16"
    return None
