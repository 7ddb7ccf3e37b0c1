"""Peak FLOP/s of the device a run uses, for model FLOPs utilisation (MFU).

GPU figures are NVIDIA's datasheet peaks WITHOUT structured sparsity (datasheets quote tensor-core
figures "with sparsity", twice the dense rate; the table holds the dense half), in TFLOP/s:

===========  =====  =====  ======  ======  ======  ==========================================
GPU          FP64   FP32   TF32    BF16    FP16    source (datasheet)
===========  =====  =====  ======  ======  ======  ==========================================
V100 SXM2    7.8    15.7   --      --      125     NVIDIA V100 Tensor Core GPU datasheet (2020)
V100 PCIe    7.0    14.0   --      --      112     same
T4           --     8.1    --      --      65      NVIDIA T4 datasheet (FP16 mixed precision)
A100         9.7    19.5   156     312     312     NVIDIA A100 datasheet (SXM4 and PCIe alike)
H100 SXM     34     67     494.5   989.5   989.5   NVIDIA H100 datasheet (SXM5)
H100 PCIe    26     51     378     756     756     same (PCIe)
H200         34     67     494.5   989.5   989.5   NVIDIA H200 datasheet (SXM)
L4           --     30.3   60      121     121     NVIDIA L4 datasheet
===========  =====  =====  ======  ======  ======  ==========================================

FP64 is the non-tensor-core rate. TF32 applies to float32 matrix products when
``torch.backends.cuda.matmul.allow_tf32`` is on or ``torch.get_float32_matmul_precision()`` is not
``"highest"``. On a CPU, a GPU not in the table (H100 NVL, L40S, consumer cards) or a precision marked
"--" (not on the datasheet, or no such tensor-core format), the peak is MEASURED: the best rate of a
square matrix product (:data:`CPU_BENCH_SIZE`) with the current thread settings, cached per process.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

TFLOPS = 1e12
# (regex searched in order in the lower-case device name, label, {precision: dense TFLOP/s} or None: measure)
GPU_PEAKS_TFLOPS: list[tuple[str, str, dict[str, float] | None]] = [
    (r"\bh100\b.*\bnvl\b", "H100 NVL", None),  # other clocks and limits: measured rather than mislabelled
    (r"\bh100\b.*\bpcie\b", "H100 PCIe", {"fp64": 26.0, "fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"\bh100\b", "H100 SXM", {"fp64": 34.0, "fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    (r"\bh200\b", "H200", {"fp64": 34.0, "fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    (r"\ba100\b", "A100", {"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"\bv100\b.*\bpcie\b", "V100 PCIe", {"fp64": 7.0, "fp32": 14.0, "fp16": 112.0}),
    (r"\bv100\b", "V100 SXM2", {"fp64": 7.8, "fp32": 15.7, "fp16": 125.0}),
    (r"\bt4\b", "T4", {"fp32": 8.1, "fp16": 65.0}),
    (r"\bl4\b", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
]
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")
CPU_BENCH_SIZE = 512  # n of the n x n matrix product (2 n^3 FLOPs; about 5 ms per product in float32 on one core)
CPU_BENCH_REPEATS = 5
_TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                 "fp16": torch.float16}
_measured: dict[tuple, float] = {}


@dataclass(frozen=True)
class Peak:
    """A peak rate in FLOP/s and where it comes from."""

    flops_per_s: float
    precision: str
    device: str
    source: str
    measured: bool


def precision_of(trainer_precision: str | int | None, device_type: str = "cpu") -> str:
    """The table's precision key for a Trainer precision ('32-true', 'bf16-mixed', '16-mixed', ...) or a
    ``SwitchablePrecision`` mode name ('tf32', '16-mixed-noscale', ...)."""
    text = str(trainer_precision if trainer_precision is not None else "32-true").lower()
    if text == "tf32":
        return "tf32"
    if text.startswith("64"):
        return "fp64"
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16"):
        return "fp16"
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    if device_type == "cuda" and tf32:
        return "tf32"
    return "fp32"


def gpu_peak(device_name: str, precision: str) -> Peak | None:
    """The datasheet peak for a GPU name such as 'NVIDIA A100-SXM4-80GB', or None if not in the table."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    name = device_name.lower()
    for pattern, label, peaks in GPU_PEAKS_TFLOPS:
        if re.search(pattern, name):
            if peaks is None or precision not in peaks:
                return None
            return Peak(peaks[precision] * TFLOPS, precision, label, f"NVIDIA {label} datasheet, dense", False)
    return None


def measured_peak(precision: str = "fp32", device: str | torch.device = "cpu", size: int = CPU_BENCH_SIZE,
                  repeats: int = CPU_BENCH_REPEATS) -> float:
    """Best FLOP/s of an n x n matrix product on ``device`` (cached per process, thread count and size)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if size < 16 or repeats < 1:
        raise ValueError(f"need size >= 16 and repeats >= 1, got size={size}, repeats={repeats}")
    device = torch.device(device)
    key = (precision, str(device), torch.get_num_threads(), size)
    if key in _measured:
        return _measured[key]
    dtype = _TORCH_DTYPES[precision]
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    best_s = float("inf")
    with torch.no_grad():
        torch.mm(a, b)  # warm-up
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            best_s = min(best_s, time.perf_counter() - start)
    _measured[key] = 2.0 * size**3 / best_s
    return _measured[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_peak(device: str | torch.device, precision: str = "fp32") -> Peak:
    """Peak FLOP/s for ``device`` at ``precision``: datasheet for known GPUs, else measured."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, precision)
        if peak is not None:
            return peak
        rate = measured_peak(precision, device)
        return Peak(rate, precision, name, f"measured: {CPU_BENCH_SIZE}x{CPU_BENCH_SIZE} matrix product", True)
    rate = measured_peak(precision, device)
    threads = torch.get_num_threads()
    return Peak(rate, precision, "cpu",
                f"measured: {CPU_BENCH_SIZE}x{CPU_BENCH_SIZE} matrix product, {threads} thread(s)", True)
