"""Energy of a training run predicted before it starts: theoretical and empirical.

Theoretical: the operations of one training step (forward + backward, from :mod:`lightning_energy.predict.flops`)
priced with the 45 nm CMOS table (Horowitz, ISSCC 2014), in pJ per operation on one word:

==========  =====  =====  =====
bits        8      16     32
==========  =====  =====  =====
float add   0.2    0.4    0.9
float mult  0.6    1.1    3.7
R/W <8 KB   1.25   2.5    5.0
R/W <32 KB  2.5    5.0    10.0
R/W <1 MB   12.5   25     50
R/W >1 MB   250    500    1000
==========  =====  =====  =====

Counting rule per layer: each multiply-accumulate of the step (FlopCounterMode FLOPs / 2, forward and
backward) is one mult and one add; a bias adds one add per output element in the forward and one in
the backward (the bias gradient's sum). Memory: the forward reads the layer's parameters and input and
writes its output; the backward touches twice as many words (gradients of inputs and weights); each
word is priced by the size class of the tensor it belongs to. 64-bit is not in the table: it is
EXTRAPOLATED with the table's own 16 -> 32-bit ratios (add x2.25, mult x3.36, memory x2) and flagged.
A RELATIVE measure, for comparing models with one another: it prices arithmetic and memory traffic on a
45 nm chip and nothing else (no idle or static power, no framework overhead, no host), so it is far below
what a run draws (``benchmarks/prediction_error.py`` records the ratio per model); never read it as the
joules a run will take.

Empirical: Linear and Conv2d layers of several sizes (a fixed range plus the model's own sizes) run a
training pass (forward + backward) on the current device while the shared meter measures them;
``energy per call = a x MACs + b`` is fitted per layer type (MACs: forward, bias excluded) with its
R^2, then applied to the model's Linear and Conv layers (the Conv2d fit serves Conv1d/3d too). The
rest of a step (activations, loss, optimiser, data, Python) is not covered: the coverage says which
share of the counted FLOPs the fits priced, and :class:`~lightning_energy.callbacks.prediction_check.
EnergyPredictionCheck` measures how much the uncovered part weighs in a real fit. Where the sensors
are estimates (the CPU estimate), the result is labelled an estimate.

For the joules a run will take, use the calibrated prediction of :mod:`lightning_energy.predict.probe_run`: a
short measured probe of the run itself (``lightning-energy estimate --probe``, or ``probe_fit`` with the
run's own module and dataloaders).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from lightning_energy.predict.flops import FlopsTable, count_model
from lightning_energy.measure.meter import Meter, measure
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S, get_sampler
from lightning_energy.measure.sensors.base import Sensor, validate_sensors

PJ = 1e-12
TABLE_BITS = (8, 16, 32)
ADD_PJ = {8: 0.2, 16: 0.4, 32: 0.9}
MUL_PJ = {8: 0.6, 16: 1.1, 32: 3.7}
MEMORY_PJ = [  # (tensor smaller than bytes, {bits: pJ per word read or written})
    (8 * 1024, {8: 1.25, 16: 2.5, 32: 5.0}),
    (32 * 1024, {8: 2.5, 16: 5.0, 32: 10.0}),
    (1024 * 1024, {8: 12.5, 16: 25.0, 32: 50.0}),
    (math.inf, {8: 250.0, 16: 500.0, 32: 1000.0}),
]
BACKWARD_MEMORY_FACTOR = 2  # backward words touched per forward word
DTYPE_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64, torch.int8: 8,
              torch.uint8: 8}
FIT_KINDS = {"Linear": "linear", "Conv1d": "conv", "Conv2d": "conv", "Conv3d": "conv"}
MIN_BENCH_SECONDS = 0.25  # per benchmark point: >= 12 samples at the default 50 Hz


# ============================================================================ theoretical
def price_pj(bits: int) -> tuple[float, float, list[tuple[float, float]], bool]:
    """(add pJ, mult pJ, [(size limit bytes, memory pJ)], extrapolated) for a bit width."""
    if bits in TABLE_BITS:
        return ADD_PJ[bits], MUL_PJ[bits], [(limit, prices[bits]) for limit, prices in MEMORY_PJ], False
    if bits == 64:
        add = ADD_PJ[32] * ADD_PJ[32] / ADD_PJ[16]
        mul = MUL_PJ[32] * MUL_PJ[32] / MUL_PJ[16]
        return add, mul, [(limit, prices[32] * prices[32] / prices[16]) for limit, prices in MEMORY_PJ], True
    raise ValueError(f"the 45 nm table prices 8-, 16- and 32-bit operations (64-bit extrapolated); got {bits} bits")


def memory_pj(tensor_bytes: float, bits: int) -> float:
    """pJ per word of a tensor of ``tensor_bytes`` (the size class it fits in)."""
    for limit, price in price_pj(bits)[2]:
        if tensor_bytes < limit:
            return price
    raise AssertionError("unreachable: the last size class is unbounded")


@dataclass
class LayerPrice:
    layer: str
    kind: str
    mults: int
    adds: int
    words: int
    compute_J: float
    memory_J: float

    @property
    def energy_J(self) -> float:
        return self.compute_J + self.memory_J


@dataclass
class TheoreticalEstimate:
    bits: int
    extrapolated: bool
    layers: list[LayerPrice]
    steps: int

    @property
    def step_J(self) -> float:
        return sum(layer.energy_J for layer in self.layers)

    @property
    def training_J(self) -> float:
        return self.step_J * self.steps


def theoretical_estimate(table: FlopsTable, bits: int, steps: int) -> TheoreticalEstimate:
    """Price one training step of ``table`` with the 45 nm table (see the module docstring)."""
    add_pj, mul_pj, _, extrapolated = price_pj(bits)
    word_bytes = bits / 8
    layers = []
    for row in table.rows:
        macs = row.train_FLOPs // 2
        out_words = math.prod(row.output_shape) * row.calls if row.output_shape else 0
        in_words = math.prod(row.input_shape) * row.calls if row.input_shape else 0
        param_words = row.params * row.calls
        adds = macs + (2 * out_words if row.bias else 0)
        forward_pj = (param_words * memory_pj(row.params * word_bytes, bits)
                      + in_words * memory_pj(math.prod(row.input_shape or (0,)) * word_bytes, bits)
                      + out_words * memory_pj(math.prod(row.output_shape or (0,)) * word_bytes, bits))
        factor = 1 + BACKWARD_MEMORY_FACTOR
        layers.append(LayerPrice(row.name, row.kind, macs, adds, factor * (param_words + in_words + out_words),
                                 (macs * mul_pj + adds * add_pj) * PJ, factor * forward_pj * PJ))
    return TheoreticalEstimate(bits, extrapolated, layers, steps)


# ============================================================================ empirical
@dataclass(frozen=True)
class LayerSpec:
    """A layer to benchmark: ``kind`` "linear" (batch, in, out) or "conv" (batch, C_in, C_out, kernel, side)."""

    kind: str
    batch: int
    in_size: int
    out_size: int
    kernel: int = 1
    side: int = 1

    @property
    def macs(self) -> int:
        """Forward MACs, bias excluded."""
        if self.kind == "linear":
            return self.batch * self.in_size * self.out_size
        out_side = self.side - self.kernel + 1
        return self.batch * out_side * out_side * self.kernel * self.kernel * self.in_size * self.out_size

    def build(self, device, dtype) -> tuple[nn.Module, torch.Tensor]:
        if self.kind == "linear":
            module = nn.Linear(self.in_size, self.out_size)
            shape = (self.batch, self.in_size)
        elif self.kind == "conv":
            module = nn.Conv2d(self.in_size, self.out_size, self.kernel)
            shape = (self.batch, self.in_size, self.side, self.side)
        else:
            raise ValueError(f"LayerSpec.kind must be 'linear' or 'conv', got {self.kind!r}")
        module = module.to(device=device, dtype=dtype)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
        return module, x.requires_grad_(True)


DEFAULT_SPECS = (  # forward MACs from 1.3e5 to 2.7e8, about x4-8 apart
    LayerSpec("linear", 128, 32, 32), LayerSpec("linear", 256, 64, 64), LayerSpec("linear", 512, 128, 128),
    LayerSpec("linear", 512, 256, 256), LayerSpec("linear", 512, 512, 512), LayerSpec("linear", 1024, 512, 512),
    LayerSpec("conv", 4, 4, 8, 3, 16), LayerSpec("conv", 8, 8, 8, 3, 32), LayerSpec("conv", 8, 16, 16, 3, 32),
    LayerSpec("conv", 16, 16, 32, 3, 32), LayerSpec("conv", 16, 32, 32, 3, 32),
)


def model_specs(table: FlopsTable) -> list[LayerSpec]:
    """Benchmark points at the model's own Linear and Conv2d sizes (a Conv2d only where a square, stride-1,
    unpadded kernel reproduces its forward MACs)."""
    specs = []
    for row in table.rows:
        if row.calls == 0 or not row.input_shape or not row.output_shape:
            continue
        if row.kind == "Linear":
            spec = LayerSpec("linear", math.prod(row.input_shape[:-1]), row.input_shape[-1], row.output_shape[-1])
        elif row.kind == "Conv2d" and len(row.input_shape) == 4 and row.input_shape[2] == row.input_shape[3]:
            n, c_in, side, _ = row.input_shape
            spec = LayerSpec("conv", n, c_in, row.output_shape[1], side - row.output_shape[2] + 1, side)
        else:
            continue
        if spec.kernel >= 1 and spec.macs * row.calls == row.forward_MACs and spec not in specs:
            specs.append(spec)
    return specs


@dataclass
class BenchPoint:
    kind: str
    macs: int
    energy_J: float  # per call (one forward + backward)
    seconds: float  # per call
    calls: int


@dataclass
class Fit:
    """``energy per call (J) = a_J_per_MAC x MACs + b_J`` over ``n`` points, with R^2."""

    kind: str
    a_J_per_MAC: float
    b_J: float
    r2: float
    n: int

    def predict_J(self, macs: float) -> float:
        return self.a_J_per_MAC * macs + self.b_J


def fit_energy(kind: str, macs, energies_J) -> Fit:
    """Least-squares line through (MACs, J) points with both coefficients >= 0; R^2 = 1 - SS_res / SS_tot
    (1.0 when SS_tot is 0).

    A call's energy is a cost per MAC plus a fixed cost per call, neither of which can be negative: where
    the free line's intercept (or slope) comes out below zero (noisy points of small layers), the best line
    with that coefficient at zero is taken instead (non-negative least squares), so no prediction is negative.
    """
    x, y = np.asarray(macs, float), np.asarray(energies_J, float)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise ValueError(f"fitting {kind!r} needs points at two or more MAC counts, got {len(x)} point(s)")
    a, b = np.polyfit(x, y, 1)
    if b < 0:  # through the origin
        a, b = max(float((x * y).sum() / (x * x).sum()), 0.0), 0.0
    if a < 0:  # a flat line at the mean
        a, b = 0.0, max(float(y.mean()), 0.0)
    residual = float(((y - (a * x + b)) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    return Fit(kind, float(a), float(b), 1.0 - residual / total if total > 0 else 1.0, len(x))


MeasureFn = Callable[[LayerSpec, Callable[[], None]], tuple[float, float, int]]


class MeterProbe:
    """Measures callables with the shared sampler (attached while open; no thread of its own)."""

    def __init__(self, sensors: list[Sensor] | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 min_seconds: float = MIN_BENCH_SECONDS, device: str | torch.device = "cpu") -> None:
        if not min_seconds > 0:
            raise ValueError(f"`min_seconds` must be > 0, got {min_seconds!r}")
        self.device = torch.device(device)
        if sensors is None:
            from lightning_energy.measure.sensors.detect import default_sensors

            cuda_index = None
            if self.device.type == "cuda":
                cuda_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            sensors, self.notes = default_sensors(cuda_index, True)
        else:
            sensors, self.notes = validate_sensors(sensors), []
        self.sensors = sensors
        self.interval_s = interval_s
        self.min_seconds = min_seconds
        self.estimated = any(s.estimated for s in sensors)
        self._meter: Meter | None = None

    @property
    def meter(self) -> Meter:
        """The meter on the shared sampler while :meth:`attached` (a ``RuntimeError`` outside)."""
        if self._meter is None:
            raise RuntimeError("MeterProbe has a meter only inside `with probe.attached():`")
        return self._meter

    @contextlib.contextmanager
    def attached(self):
        sampler = get_sampler()
        names = sampler.acquire(self, self.sensors, self.interval_s)
        meter = Meter(sampler, names)
        sampler.add_meter(meter)
        self._meter = meter
        try:
            yield self
        finally:
            self._meter = None
            sampler.remove_meter(meter)
            sampler.release(self)

    def __call__(self, spec: LayerSpec, run: Callable[[], None]) -> tuple[float, float, int]:
        """(J, s, calls) of calling ``run`` repeatedly for at least ``min_seconds``."""
        meter = self._meter
        if meter is None:
            raise RuntimeError("MeterProbe measures only inside `with probe.attached():`")
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        run()
        sync()
        start = meter.mark()
        calls, began = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - began < self.min_seconds:
            run()
            calls += 1
        sync()
        end = meter.wait(meter.mark())
        m = measure(start, end)
        return m.total_J, m.duration_s, calls


def benchmark_layers(measure_fn: MeasureFn, specs=DEFAULT_SPECS, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> list[BenchPoint]:
    """Energy per training pass (forward + backward) of each layer in ``specs``."""
    points = []
    for spec in specs:
        module, x = spec.build(device, dtype)

        def run(module=module, x=x) -> None:
            module.zero_grad(set_to_none=True)
            x.grad = None
            module(x).sum().backward()

        energy_J, seconds, calls = measure_fn(spec, run)
        points.append(BenchPoint(spec.kind, spec.macs, energy_J / calls, seconds / calls, calls))
    return points


def fit_points(points: list[BenchPoint]) -> dict[str, Fit]:
    kinds = sorted({p.kind for p in points})
    return {k: fit_energy(k, [p.macs for p in points if p.kind == k], [p.energy_J for p in points if p.kind == k])
            for k in kinds}


@dataclass
class EmpiricalEstimate:
    fits: dict[str, Fit]
    points: list[BenchPoint]
    layers: list[tuple[str, str, int, float]]  # (layer, kind, forward MACs, J per step)
    coverage: float  # share of the counted training FLOPs in layers the fits price
    steps: int
    estimated: bool  # True when the benchmark's sensors are estimates
    sensors: list[str] = field(default_factory=list)

    @property
    def step_J(self) -> float:
        return sum(j for *_, j in self.layers)

    @property
    def training_J(self) -> float:
        return self.step_J * self.steps


def empirical_estimate(table: FlopsTable, fits: dict[str, Fit], steps: int, points=(), estimated: bool = False,
                       sensors=()) -> EmpiricalEstimate:
    """Apply per-kind fits to the model's Linear/Conv layers (one entry per call)."""
    layers, covered = [], 0
    for row in table.rows:
        kind = FIT_KINDS.get(row.kind)
        if kind is None or kind not in fits or row.calls == 0:
            continue
        per_call_macs = row.forward_MACs // row.calls
        layers.append((row.name, kind, row.forward_MACs, row.calls * fits[kind].predict_J(per_call_macs)))
        covered += row.train_FLOPs
    coverage = covered / table.train_FLOPs if table.train_FLOPs else 0.0
    return EmpiricalEstimate(fits, list(points), layers, coverage, steps, estimated, list(sensors))


# ============================================================================ both
@dataclass
class EnergyEstimate:
    """A model's predicted energy per training step and for ``steps`` steps (J)."""

    table: FlopsTable
    steps: int
    device: str
    dtype: str
    theoretical: TheoreticalEstimate
    empirical: EmpiricalEstimate | None

    def as_dict(self) -> dict:
        out: dict[str, Any] = {
            "steps": self.steps, "device": self.device, "dtype": self.dtype, "flops": self.table.as_dict(),
            "theoretical": {"bits": self.theoretical.bits, "extrapolated": self.theoretical.extrapolated,
                            "step_J": self.theoretical.step_J, "training_J": self.theoretical.training_J,
                            "layers": [{**asdict(l), "energy_J": l.energy_J} for l in self.theoretical.layers]},
        }
        if self.empirical is not None:
            e = self.empirical
            out["empirical"] = {
                "estimated": e.estimated, "sensors": e.sensors, "step_J": e.step_J, "training_J": e.training_J,
                "coverage": e.coverage, "fits": {k: asdict(f) for k, f in e.fits.items()},
                "points": [asdict(p) for p in e.points],
                "layers": [{"layer": n, "kind": k, "forward_MACs": m, "step_J": j} for n, k, m, j in e.layers],
            }
        return out

    def format(self) -> str:
        t = self.theoretical
        lines = [self.table.format(), "",
                 f"Predicted energy ({self.steps:,} steps, {self.dtype} on {self.device})",
                 f"  theoretical (45 nm table, {t.bits}-bit{', EXTRAPOLATED' if t.extrapolated else ''}): "
                 f"score {_fmt_J(t.step_J)} per step, {_fmt_J(t.training_J)} in all at 45 nm operation prices -- "
                 "a RELATIVE comparison between models, NOT the joules to expect (it leaves out static power, "
                 "the host and the framework)"]
        if self.empirical is not None:
            e = self.empirical
            label = "ESTIMATE (estimated sensors)" if e.estimated else "measured sensors"
            lines.append(f"  empirical (layer fits; {label}: {', '.join(e.sensors)}): {_fmt_J(e.step_J)} per step, "
                         f"{_fmt_J(e.training_J)} in all; covers {e.coverage:.1%} of the counted FLOPs and only "
                         "Linear/Conv layers (not activations, loss, optimizer, data loading, validation); "
                         "--probe measures the whole run")
            for kind, fit in sorted(e.fits.items()):
                lines.append(f"    fit {kind:6s}: energy = {fit.a_J_per_MAC:.4g} J/MAC x MACs + {fit.b_J:.4g} J"
                             f"   R^2 = {fit.r2:.4f} ({fit.n} points)")
        return "\n".join(lines)


def _fmt_J(joules: float) -> str:
    for unit, scale in (("MJ", 1e6), ("kJ", 1e3), ("J", 1.0), ("mJ", 1e-3)):
        if abs(joules) >= scale:
            return f"{joules / scale:.4g} {unit}"
    return f"{joules * 1e6:.4g} uJ"


def dtype_bits(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_BITS:
        raise ValueError(f"no bit width known for {dtype}; pass `bits` explicitly (8, 16, 32 or 64)")
    return DTYPE_BITS[dtype]


def estimate_energy(
    model: nn.Module,
    example_input: Any,
    steps: int,
    *,
    bits: int | None = None,
    empirical: bool = True,
    fits: dict[str, Fit] | None = None,
    measure_fn: MeasureFn | None = None,
    specs=None,
    sensors: list[Sensor] | None = None,
    min_seconds: float = MIN_BENCH_SECONDS,
) -> EnergyEstimate:
    """Predict the energy of ``steps`` training steps of ``model`` on batches like ``example_input``.

    The model runs where its parameters are, in their dtype. ``fits`` reuses earlier fits; otherwise
    (``empirical=True``) the layer benchmarks run now, measured by ``measure_fn`` or the shared meter
    with ``sensors`` (auto-detected when None), on ``specs`` (default: :data:`DEFAULT_SPECS` plus the
    model's own layer sizes, :func:`model_specs`).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be an integer >= 1, got {steps!r}")
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None else torch.float32
    bits = dtype_bits(dtype) if bits is None else bits
    table = count_model(model, example_input)
    theoretical = theoretical_estimate(table, bits, steps)
    if specs is None:
        specs = list(DEFAULT_SPECS) + [spec for spec in model_specs(table) if spec not in DEFAULT_SPECS]
    result = None
    if fits is not None:
        result = empirical_estimate(table, fits, steps)
    elif empirical:
        if measure_fn is not None:
            points = benchmark_layers(measure_fn, specs, device, dtype)
            result = empirical_estimate(table, fit_points(points), steps, points, sensors=["given measure_fn"])
        else:
            probe = MeterProbe(sensors, min_seconds=min_seconds, device=device)
            with probe.attached():
                points = benchmark_layers(probe, specs, device, dtype)
            result = empirical_estimate(table, fit_points(points), steps, points, probe.estimated,
                                        [s.name for s in probe.sensors])
    return EnergyEstimate(table, steps, str(device), str(dtype).replace("torch.", ""), theoretical, result)


def compare_prediction(predicted_step_J: float, measured_J: float, steps: int) -> dict:
    """Predicted vs measured energy of ``steps`` steps: relative error = (predicted - measured) / measured."""
    if steps < 1 or not measured_J > 0:
        raise ValueError(f"need steps >= 1 and a measured energy > 0 J, got steps={steps}, measured_J={measured_J}")
    predicted = predicted_step_J * steps
    return {"steps": steps, "predicted_J": predicted, "measured_J": measured_J,
            "error": (predicted - measured_J) / measured_J}
