"""Peak FLOP/s of the device a run uses, for model FLOPs utilisation (MFU).

GPU peaks come from Lightning's table (``lightning.fabric.utilities.throughput.get_available_flops``:
NVIDIA datasheet figures for Hopper, Ada, Ampere, Turing and Volta parts, per precision, TF32 as
``"tfloat32"``), except where that table or its name parser is known to be wrong, checked first
(:data:`CORRECTIONS`; Lightning 2.6):

- ``NVIDIA H200``: Lightning recognises only names holding ``sxm1``/``nvl1``, and its H200 tensor-core
  rates are the datasheet's "with sparsity" figures (twice the dense rate, unlike its H100 entries).
  Here the dense H200 SXM datasheet figures: FP64 34, FP32 67, TF32 494.5, BF16/FP16 989.5 TFLOP/s.
- ``H100 NVL``, ``H200 NVL``: Lightning's H100 NVL entry holds the two-GPU pair's FP64/FP32 rates
  (133.8 TFLOP/s FP32); measured instead.
- ``L40``, ``L40S``: Lightning's parser reads any name holding ``l4`` as the L4 (30.3 TFLOP/s FP32 for
  a 91.6 TFLOP/s card: MFU 3x too high); measured instead.

FP32 means IEEE float32 matrix products (``torch.get_float32_matmul_precision() == "highest"``); TF32
applies when it is not (:func:`precision_of`). On a CPU, a GPU not in the table or a precision the
table lacks (no BF16 on a T4), the peak is MEASURED: the best rate of a square matrix product, cached
per process. On a GPU the product is large (:data:`GPU_BENCH_SIZE`, less where free memory is short:
:func:`gpu_bench_size`) and timed with CUDA events over :data:`GPU_BENCH_INNER` back-to-back products,
so launch overhead (microseconds) is negligible against its milliseconds; a 512 x 512 product would be
launch-bound on an H100 and inflate MFU. On a CPU, :data:`CPU_BENCH_SIZE` timed with ``perf_counter``.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from dataclasses import dataclass

import torch
from lightning_energy.units import MS_PER_S

TFLOPS = 1e12
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")
# Lightning's dtype keys: TF32 is the string "tfloat32"
LIGHTNING_DTYPES: dict[str, torch.dtype | str] = {"fp64": torch.float64, "fp32": torch.float32, "tf32": "tfloat32",
                                                 "bf16": torch.bfloat16, "fp16": torch.float16}
# (regex searched in the lower-case device name, label, {precision: dense TFLOP/s} or None: measure, why)
CORRECTIONS: list[tuple[str, str, dict[str, float] | None, str]] = [
    (r"\b(h100|h200)\b.*\bnvl\b", "H100/H200 NVL", None, "Lightning's NVL entry holds the two-GPU pair's rates"),
    (r"\bh200\b", "H200", {"fp64": 34.0, "fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
     "NVIDIA H200 SXM datasheet, dense (Lightning misses the name and quotes sparse tensor rates)"),
    (r"\bl40", "L40/L40S", None, "Lightning's parser reads L40 and L40S as the L4"),
]
CPU_BENCH_SIZE = 512  # n of the n x n matrix product on a CPU (2 n^3 FLOPs; about 5 ms in float32 on one core)
CPU_BENCH_REPEATS = 5
GPU_BENCH_SIZE = 8192  # 1.1 TFLOP per product: ~1.1 ms at 1 PFLOP/s, against launch overheads of ~5 us
GPU_BENCH_MIN_SIZE = 1024
GPU_BENCH_INNER = 10  # products between two CUDA events
GPU_BENCH_REPEATS = 5
GPU_BENCH_MEMORY_SHARE = 0.25  # of the free GPU memory the three matrices may take
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


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def gpu_peak(device: str | torch.device, precision: str) -> Peak | None:
    """The datasheet peak of the CUDA ``device`` at ``precision``: :data:`CORRECTIONS`, else Lightning's
    ``get_available_flops``; None where neither knows it (then measure)."""
    _check_precision(precision)
    device = torch.device(device)
    name = torch.cuda.get_device_name(device)
    for pattern, label, peaks, why in CORRECTIONS:
        if re.search(pattern, name.lower()):
            if peaks is None or precision not in peaks:
                return None
            return Peak(peaks[precision] * TFLOPS, precision, name, why, False)
    from lightning.fabric.utilities.throughput import get_available_flops

    # "highest" for fp32: Lightning swaps float32 for TF32 otherwise; its "FLOPs not found" warning: None says it
    with warnings.catch_warnings(), _matmul_precision(precision):
        warnings.simplefilter("ignore")
        flops = get_available_flops(device, LIGHTNING_DTYPES[precision])
    if not flops:
        return None
    return Peak(float(flops), precision, name, "Lightning's get_available_flops (NVIDIA datasheet)", False)


def gpu_bench_size(free_bytes: int, element_bytes: int, largest: int = GPU_BENCH_SIZE) -> int:
    """n of the n x n GPU product: ``largest``, less where the three matrices would take more than
    :data:`GPU_BENCH_MEMORY_SHARE` of ``free_bytes`` (a multiple of 256, at least :data:`GPU_BENCH_MIN_SIZE`)."""
    fits = int((GPU_BENCH_MEMORY_SHARE * free_bytes / (3 * element_bytes)) ** 0.5) // 256 * 256
    return max(GPU_BENCH_MIN_SIZE, min(largest, fits))


@contextlib.contextmanager
def _matmul_precision(precision: str):
    """float32 products in TF32 for ``tf32``, in full float32 for ``fp32`` (restored afterwards)."""
    before = torch.get_float32_matmul_precision()
    if precision in ("fp32", "tf32"):
        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def measured_peak(precision: str = "fp32", device: str | torch.device = "cpu", size: int | None = None,
                  repeats: int | None = None) -> float:
    """Best FLOP/s of an n x n matrix product on ``device`` (cached per process, device, thread count and size).

    ``size`` defaults to :data:`CPU_BENCH_SIZE` on a CPU and :func:`gpu_bench_size` of the free memory on
    a GPU, where the products are timed with CUDA events.
    """
    _check_precision(precision)
    device = torch.device(device)
    dtype = _TORCH_DTYPES[precision]
    if size is None:
        if device.type == "cuda":
            size = gpu_bench_size(torch.cuda.mem_get_info(device)[0], torch.finfo(dtype).bits // 8)
        else:
            size = CPU_BENCH_SIZE
    repeats = repeats if repeats is not None else (GPU_BENCH_REPEATS if device.type == "cuda" else CPU_BENCH_REPEATS)
    if size < 16 or repeats < 1:
        raise ValueError(f"need size >= 16 and repeats >= 1, got size={size}, repeats={repeats}")
    key = (precision, str(device), torch.get_num_threads(), size)
    if key in _measured:
        return _measured[key]
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    with torch.no_grad(), _matmul_precision(precision):
        best_s = _best_cuda_s(a, b, repeats) if device.type == "cuda" else _best_cpu_s(a, b, repeats)
    _measured[key] = 2.0 * size**3 / best_s
    return _measured[key]


def _best_cpu_s(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    torch.mm(a, b)  # warm-up
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best_s = min(best_s, time.perf_counter() - start)
    return best_s


def _best_cuda_s(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """Seconds per product: the best of ``repeats`` runs of :data:`GPU_BENCH_INNER` products between events."""
    out = torch.mm(a, b)  # warm-up: cuBLAS picks its kernel, the clocks ramp up
    torch.cuda.synchronize(a.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best_s = float("inf")
    for _ in range(repeats):
        start.record()
        for _ in range(GPU_BENCH_INNER):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        best_s = min(best_s, start.elapsed_time(end) / MS_PER_S / GPU_BENCH_INNER)  # elapsed_time: ms
    return best_s


def device_peak(device: str | torch.device, precision: str = "fp32") -> Peak:
    """Peak FLOP/s for ``device`` at ``precision``: the datasheet for known GPUs (:func:`gpu_peak`), else measured."""
    device = torch.device(device)
    if device.type == "cuda":
        peak = gpu_peak(device, precision)
        if peak is not None:
            return peak
        dtype = _TORCH_DTYPES[precision]
        size = gpu_bench_size(torch.cuda.mem_get_info(device)[0], torch.finfo(dtype).bits // 8)
        rate = measured_peak(precision, device, size)
        return Peak(rate, precision, torch.cuda.get_device_name(device),
                    f"measured: {size}x{size} matrix product, timed with CUDA events", True)
    rate = measured_peak(precision, device)
    threads = torch.get_num_threads()
    return Peak(rate, precision, "cpu",
                f"measured: {CPU_BENCH_SIZE}x{CPU_BENCH_SIZE} matrix product, {threads} thread(s)", True)
