"""Energy attribution on a GPU trace: device sensors to the rank's kernels, host sensors to CPU threads.

The fixture ``fixtures/kineto_gpu_window.json`` is a Chrome trace in the format torch.profiler writes
(``torch/profiler/_chrome_trace_export.py``: ``pid`` = the process for CPU threads and the device index
for GPU streams, ``tid`` = thread or stream; kernels carry ``args.device/stream/correlation/External id``;
``ac2g`` flows go from the launch (``ph: s``) to the kernel (``ph: f``, ``bp: e``)). Its timeline, in
seconds of ``perf_counter`` (the sampler's clock), window [0, 10]:

host tracks (trace ts = perf x 1e6 + H), thread 4242:
    sync marker [0.095, 0.105]; device sync marker [0.2, 0.3] holding aten::add_ [0.205, 0.23] ->
    cudaLaunchKernel [0.21, 0.22] (correlation 100); aten::linear [1, 4] > aten::addmm [1.5, 3.5] >
    cudaLaunchKernel [2, 2.5] (101); aten::mm [5, 6] > cudaLaunchKernel [5.2, 5.4] (102) and a flow start
    at 5.6 (id 103) with no runtime event; cudaDeviceSynchronize [6.5, 8]
thread 4250 (autograd): aten::mul [3, 4.5] (beside a Python frame [2.9, 4.6], not an op)
GPU 0 (trace ts = perf x 1e6 + D, D = H + 0.5 s): stream 7: add kernel [0.24, 0.26] (100), sgemm
    [2.6, 4.6] (101), xmma gemm [5.5, 6] (102), Context Sync [6, 7] (a wait, not work), memcpy [8, 8.5]
    (no link); stream 13: splitKreduce [5.8, 6.5] (flow 103 only), reduce [7, 7.5] (External id 10 only)
GPU 1: a kernel [3, 4] -- another rank's device: nothing. CUPTI overhead (pid -1) [3.2, 3.3]: not an op.

Sensors: ``gpu`` (device) 100 W until 5 s then 300 W; ``rapl`` (host) 20 W; ``cpu_estimate`` (host,
an estimate) 10 W.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from lightning_energy.outputs.op_energy import (
    DEVICE, DEVICE_IDLE_ROW, HOST, IDLE_ROW, EnergyCurve, attribute_energy, clock_offset_us, counter_events,
    device_clock_offset_us,
)

FIXTURE = Path(__file__).parent / "fixtures" / "kineto_gpu_window.json"
H = 4779591000000.0
D = H + 500000.0
SCOPES = {"gpu": "device", "rapl": "host", "cpu_estimate": "host"}
SGEMM = "ampere_sgemm_32x32_sliced1x4_tn"
XMMA = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32"
SPLITK = "void splitKreduce_kernel<32, 16, int, float, float, float, float, true, false, false>"
REDUCE = "void at::native::reduce_kernel<512, 1>"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>"
MEMCPY = "Memcpy HtoD (Pageable -> Device)"


def events() -> list[dict]:
    return json.loads(FIXTURE.read_text())["traceEvents"]


def curve() -> EnergyCurve:
    samples = [(2.5, {"gpu": (250.0, 100.0), "rapl": (50.0, 20.0), "cpu_estimate": (25.0, 10.0)}),
               (5.0, {"gpu": (500.0, 300.0), "rapl": (100.0, 20.0), "cpu_estimate": (50.0, 10.0)})]
    return EnergyCurve.from_window(0.0, {"gpu": 0.0, "rapl": 0.0, "cpu_estimate": 0.0}, 10.0,
                                   {"gpu": 2000.0, "rapl": 200.0, "cpu_estimate": 100.0}, samples)


def attribution(**overrides):
    kwargs = dict(estimated={"cpu_estimate"}, scopes=SCOPES, device=0, device_offset_us=D)
    return attribute_energy(events(), curve(), H, **{**kwargs, **overrides})


def rows(a, track):
    return {r.op: r for r in a.rows if r.track == track}


def test_device_energy_goes_to_the_kernels_on_the_ranks_gpu():
    a = attribution()
    device = rows(a, DEVICE)
    got = {op: (r.calls, pytest.approx(r.self_time_s), pytest.approx(r.energy_J)) for op, r in device.items()}
    # 100 W before 5 s, 300 W after; [5.8, 6.0] is shared by two streams (30 J each)
    assert got == {
        ADD: (1, 0.02, 2.0), SGEMM: (1, 2.0, 200.0), XMMA: (1, 0.5, 90.0 + 30.0), SPLITK: (1, 0.7, 30.0 + 150.0),
        REDUCE: (1, 0.5, 150.0), MEMCPY: (1, 0.5, 150.0),
        DEVICE_IDLE_ROW: (0, 5.98, 2.98 * 100 + 3.0 * 300),  # the Context Sync wait included
    }
    assert all(set(r.by_sensor) == {"gpu"} for r in device.values())  # the device's energy only
    assert "void other_device_kernel" not in {r.op for r in a.rows}  # GPU 1 is another rank's
    assert a.device_idle_s == pytest.approx(5.98)


def test_host_energy_goes_to_the_cpu_threads_per_sensor():
    a = attribution()
    host = rows(a, HOST)
    watts = {"rapl": 20.0, "cpu_estimate": 10.0}
    held = {  # seconds of the window each op holds alone / shared with the other thread
        "aten::add_": (0.015, 0.0), "cudaLaunchKernel": (0.71, 0.0), "aten::linear": (0.5, 0.5),
        "aten::addmm": (1.0, 0.5), "aten::mul": (0.5, 1.0), "aten::mm": (0.8, 0.0),
        "cudaDeviceSynchronize": (1.5, 0.0),
    }
    assert set(host) == set(held) | {IDLE_ROW}
    for op, (alone, shared) in held.items():
        for sensor, w in watts.items():
            assert host[op].by_sensor[sensor] == pytest.approx(w * (alone + shared / 2), rel=1e-9), (op, sensor)
        assert set(host[op].by_sensor) == {"rapl", "cpu_estimate"}  # never the GPU's energy
        assert host[op].self_time_s == pytest.approx(alone + shared)
    assert host["cudaLaunchKernel"].calls == 3
    assert host[IDLE_ROW].energy_J == pytest.approx(30.0 * 3.975) and a.idle_s == pytest.approx(3.975)


def test_each_sensor_keeps_its_window_energy_exactly():
    a = attribution()
    assert a.sensor_J == {"gpu": 2000.0, "rapl": 200.0, "cpu_estimate": 100.0}
    assert a.sensor_track == {"gpu": DEVICE, "rapl": HOST, "cpu_estimate": HOST}
    for sensor, total in a.sensor_J.items():
        assert sum(r.by_sensor.get(sensor, 0.0) for r in a.rows) == pytest.approx(total, rel=1e-12)
    assert a.ops_J + a.idle_J == pytest.approx(a.window_J) and a.window_J == 2300.0
    assert sum(r.share for r in a.rows) == pytest.approx(1.0)


def test_each_host_op_reports_the_device_energy_of_the_kernels_it_launched():
    a = attribution()
    host = rows(a, HOST)
    launched = {op: (r.launched_calls, pytest.approx(r.launched_J)) for op, r in host.items() if r.launched_calls}
    assert launched == {
        "aten::add_": (1, 2.0),  # the device sync marker's kernel
        "aten::addmm": (1, 200.0),  # correlation -> cudaLaunchKernel inside aten::addmm (not aten::linear)
        "aten::mm": (2, 120.0 + 180.0),  # one by correlation, one by its ac2g flow alone
        "aten::linear": (1, 150.0),  # by External id alone
    }
    assert a.unlinked_device_J == pytest.approx(150.0)  # the memcpy
    device_ops_J = sum(r.energy_J for r in rows(a, DEVICE).values() if r.op != DEVICE_IDLE_ROW)
    assert sum(r.launched_J for r in a.rows) + a.unlinked_device_J == pytest.approx(device_ops_J)
    assert host["aten::addmm"].energy_J == pytest.approx(30.0 * 1.25)  # its own energy is the host's


def test_the_device_clock_offset_comes_from_the_device_sync_marker():
    evts = events()
    offset, uncertainty = clock_offset_us(evts, [(0.09, 0.11)])
    assert offset == pytest.approx(H) and uncertainty == pytest.approx(5000.0)
    device_offset, device_uncertainty = device_clock_offset_us(evts, [(0.2, 0.3)], device=0)
    assert device_offset == pytest.approx(D) and device_uncertainty == pytest.approx(40000.0)
    assert all(map(lambda v: v != v, device_clock_offset_us(evts, [(0.2, 0.3)], device=1)))  # NaN: no marker kernel
    # placed with the host offset, the kernels would sit 0.5 s late: the sgemm at [3.1, 5.1] would read 300 W
    late = rows(attribution(device_offset_us=H), DEVICE)
    assert late[SGEMM].energy_J == pytest.approx(1.9 * 100 + 0.1 * 300)


def test_a_run_without_a_gpu_splits_every_sensor_among_cpu_threads():
    a = attribution(device=None)
    assert {r.track for r in a.rows} == {HOST} and a.sensor_track == dict.fromkeys(SCOPES, HOST)
    assert rows(a, HOST)["aten::mm"].energy_J == pytest.approx(0.8 * (300.0 + 30.0))  # alone on the CPU after 5 s
    assert a.ops_J + a.idle_J == pytest.approx(2300.0)


def test_csv_and_table_say_which_sensors_each_figure_includes():
    a = attribution()
    table = list(csv.DictReader(io.StringIO(a.csv_text())))
    by_op = {r["op"]: r for r in table}
    mm = by_op["aten::mm"]
    assert (mm["track"], mm["sensors"], mm["energy_source"]) == ("host", "cpu_estimate;rapl", "estimated")
    assert (mm["launched_kernels"], float(mm["launched_device_J"]), mm["launched_device_sensors"],
            mm["launched_device_source"]) == ("2", 300.0, "gpu", "measured")
    gemm = by_op[SGEMM]
    assert (gemm["track"], gemm["sensors"], gemm["energy_source"], gemm["launched_device_J"]) == (
        "device", "gpu", "measured", "")
    assert [r["op"] for r in table[-2:]] == [IDLE_ROW, DEVICE_IDLE_ROW]
    assert sum(float(r["energy_J"]) for r in table) == pytest.approx(2300.0, rel=1e-6)
    text = a.markdown()
    short = a.markdown(top=2).splitlines()
    # host ops ranked by their energy plus their kernels': aten::mm (24 + 300 J) first, then aten::addmm
    assert [line.split(" | ")[0] for line in short[2:6]] == ["| aten::mm", "| aten::addmm", "| (5 more ops)",
                                                             f"| {IDLE_ROW}"]
    assert short[2].endswith("| 300000.000 |") and short[4].endswith("| 152000.000 |")  # 150 + 2 J launched
    assert [line.split(" | ")[0] for line in short[6:10]] == [f"| {SGEMM}", f"| {SPLITK}", "| (4 more ops)",
                                                              f"| {DEVICE_IDLE_ROW}"]
    assert "host rows: energy of cpu_estimate (ESTIMATE), rapl (measured), split among CPU threads" in text
    assert "device rows: energy of gpu (measured)" in text
    assert "kernels whose launch is not in the trace: 150000.000 mJ" in text
    assert text.endswith("energy: ESTIMATED where it includes cpu_estimate (modelled sensors), not measured")


def test_device_sensors_counter_tracks_sit_beside_the_kernels():
    samples = [(2.5, {"gpu": (250.0, 100.0), "rapl": (50.0, 20.0)})]
    c = EnergyCurve.from_window(0.0, {"gpu": 0.0, "rapl": 0.0}, 10.0, {"gpu": 2000.0, "rapl": 200.0}, samples)
    tracks = counter_events(samples, c, H, pid=4242, placement={"gpu": (0, D)})
    gpu = [e for e in tracks if e["name"] == "power gpu (W)"]
    assert {e["pid"] for e in gpu} == {0} and gpu[0]["ts"] == pytest.approx(D + 2.5e6)
    rapl = [e for e in tracks if e["name"] == "power rapl (W)"]
    assert {e["pid"] for e in rapl} == {4242} and rapl[0]["ts"] == pytest.approx(H + 2.5e6)


def test_the_fixture_passes_torchs_own_trace_validator():
    from torch.profiler._trace_validator import validate_trace  # rules torch checks its exported traces with

    passed, violations = validate_trace(str(FIXTURE))
    assert passed and violations == []
    kinds = {(e.get("ph"), e.get("cat")) for e in events()}
    assert {("X", "kernel"), ("X", "gpu_memcpy"), ("X", "cpu_op"), ("X", "cuda_runtime"), ("s", "ac2g"),
            ("f", "ac2g")} <= kinds
