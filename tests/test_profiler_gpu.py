"""On a CUDA GPU: the EnergyProfiler's trace holds the GPU's power counter tracks beside its kernels, the
GPU's energy goes to its kernels and, through the launches, to the host ops; the fallback peak is a large
product timed with CUDA events. Read-only NVML queries only. Skipped without CUDA (``make test-gpu``).
"""

from __future__ import annotations

import csv
import io
import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from conftest import trainer_kwargs
from lightning_energy import EnergyCallback
from lightning_energy.callbacks.profiler import EnergyProfiler
from lightning_energy.outputs.op_energy import DEVICE, DEVICE_IDLE_ROW, HOST, device_of
from test_gpu import MatmulModel, loader  # large products: each step keeps the GPU busy for milliseconds

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_gpu_trace_has_power_tracks_beside_the_kernels_and_device_energy_on_them(tmp_path):
    profiler = EnergyProfiler(wait=2, warmup=1, active=5, interval_s=0.01)
    trainer = L.Trainer(callbacks=[EnergyCallback(verbose=False), profiler],
                        logger=TensorBoardLogger(str(tmp_path), name="tb"),
                        **trainer_kwargs(tmp_path, max_epochs=1, accelerator="gpu", devices=1))
    trainer.fit(MatmulModel(), loader())
    (window,) = profiler.windows
    device = trainer.strategy.root_device.index or 0
    trace = json.loads(window.trace_path.read_text())  # valid JSON: Perfetto and chrome://tracing open it
    events = trace["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and device_of(e) == device]
    assert kernels, "no kernel of the training GPU in the trace"
    gpu_pid = kernels[0]["pid"]
    device_sensors = sorted(name for name, track in window.attribution.sensor_track.items() if track == DEVICE)
    assert device_sensors, f"no device-scoped sensor among {window.attribution.sensor_track}"
    meta = trace["lightningEnergy"]
    # the device sync marker's kernel pins the device tracks' clock: launch + synchronise take well under 1 ms
    assert meta["device"] == device and 0 <= meta["device_clock_uncertainty_us"] < 1000, meta
    assert abs(meta["device_clock_offset_us"] - meta["clock_offset_us"]) < 5000, meta  # Kineto's conversion holds
    for name in device_sensors:  # the power counter track sits in the GPU's process, beside its streams
        track = [e for e in events if e.get("ph") == "C" and e["name"].startswith(f"power {name} (W")]
        assert track and {e["pid"] for e in track} == {gpu_pid}
        start = meta["window_start_ts_us"] - meta["clock_offset_us"] + meta["device_clock_offset_us"]
        end = meta["window_end_ts_us"] - meta["clock_offset_us"] + meta["device_clock_offset_us"]
        assert all(start - 1e-3 <= e["ts"] <= end + 1e-3 for e in track)
        assert all(e["args"]["W"] > 0 for e in track)
    a = window.attribution
    for name, total in a.sensor_J.items():  # exact sum per sensor
        assert sum(r.by_sensor.get(name, 0.0) for r in a.rows) == pytest.approx(total, rel=1e-9, abs=1e-9)
    device_rows = [r for r in a.rows if r.track == DEVICE and r.op != DEVICE_IDLE_ROW]
    assert device_rows and sum(r.energy_J for r in device_rows) > 0
    launched = {r.op: r.launched_J for r in a.rows if r.track == HOST and r.launched_calls}
    assert any(op in launched for op in ("aten::addmm", "aten::mm")), launched  # the products' kernels
    device_ops_J = sum(r.energy_J for r in device_rows)
    assert sum(launched.values()) + a.unlinked_device_J == pytest.approx(device_ops_J, rel=1e-9)
    assert a.unlinked_device_J <= 0.1 * device_ops_J  # Kineto links almost every kernel to its launch
    rows = list(csv.DictReader(io.StringIO(window.csv_path.read_text())))
    assert {r["sensors"] for r in rows if r["track"] == "device"} == {";".join(device_sensors)}


def test_measured_gpu_peak_is_a_large_product_timed_with_events():
    from lightning_energy.predict.peaks import GPU_BENCH_MIN_SIZE, gpu_peak, measured_peak

    device = torch.device("cuda", torch.cuda.current_device())
    rate = measured_peak("fp32", device)
    assert math.isfinite(rate) and rate > 1e12  # any datacenter GPU of the last decade exceeds 1 TFLOP/s in FP32
    datasheet = gpu_peak(device, "fp32")
    if datasheet is not None:  # a measurement never beats the datasheet (10 % for boost clocks)
        assert rate <= 1.1 * datasheet.flops_per_s
    small = measured_peak("fp32", device, size=GPU_BENCH_MIN_SIZE // 2)
    assert small < rate  # smaller products are launch-bound: the reason the fallback is large
