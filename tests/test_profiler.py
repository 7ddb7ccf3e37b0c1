"""EnergyProfiler: counter tracks in valid Chrome traces, clock alignment, energy attribution per op."""

from __future__ import annotations

import csv
import io
import json
import time

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.callbacks.profiler import EnergyProfiler
from lightning_energy.outputs.op_energy import (
    IDLE_ROW, SYNC_MARKER, EnergyCurve, WindowRecorder, attribute_energy, clock_offset_us, counter_events,
    read_chrome_trace, self_segments, write_chrome_trace,
)
from lightning_energy.measure.sampler import Reading

DEVICE_W, HOST_W = 90.0, 30.0


def sensors():
    return [SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")]


def profiled_fit(tmp_path, callback, max_epochs=1, others=(), **overrides):
    trainer = L.Trainer(callbacks=[*others, callback], logger=TensorBoardLogger(str(tmp_path), name="tb"),
                        **trainer_kwargs(tmp_path, max_epochs=max_epochs, **overrides))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    return trainer


# ------------------------------------------------------------------------------ a real profiled fit
def test_trace_gets_power_counters_inside_the_profiled_window(tmp_path):
    callback = EnergyProfiler(wait=1, warmup=1, active=3, interval_s=0.002)  # the EnergyCallback's sensors
    profiled_fit(tmp_path, callback, others=[EnergyCallback(sensors=sensors(), verbose=False)])
    assert len(callback.windows) == 1
    window = callback.windows[0]
    assert window.trace_path.parent == tmp_path / "tb" / "version_0" == window.csv_path.parent
    assert window.trace_path.name.endswith(".pt.trace.json")
    trace = json.loads(window.trace_path.read_text())  # valid JSON after the rewrite
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name")).startswith("ProfilerStep#")]
    assert len(steps) == 3
    first_ts, last_end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    meta = trace["lightningEnergy"]
    slack = meta["clock_uncertainty_us"] + 1.0  # the window lies inside the profiled steps, on the trace clock
    assert first_ts - slack <= meta["window_start_ts_us"] < meta["window_end_ts_us"] <= last_end + slack, meta
    first_step = min(steps, key=lambda e: e["ts"])
    assert meta["window_start_ts_us"] <= first_step["ts"] + first_step["dur"] + slack  # opened in the first step
    counters = [e for e in events if e.get("ph") == "C"]
    assert counters and len(counters) == window.counter_events
    assert {e["name"] for e in counters} == {"power device (W)", "power host (W)", "energy device (J)",
                                             "energy host (J)"}
    for e in counters:
        assert meta["window_start_ts_us"] - 1e-3 <= e["ts"] <= meta["window_end_ts_us"] + 1e-3
    assert {e["args"]["W"] for e in counters if e["name"] == "power device (W)"} == {DEVICE_W}
    energy_track = [e for e in counters if e["name"] == "energy host (J)"]
    assert energy_track[-1]["args"]["J"] == pytest.approx(HOST_W * window.window_s, rel=1e-9)
    assert 0 <= meta["clock_uncertainty_us"] < 1000  # the sync markers pin the offset well under a millisecond
    assert meta["estimated"] is False and meta["estimated_sensors"] == []
    # a CPU run: no GPU tracks, so the device sensor is split among the CPU threads with the host sensor
    assert meta["device"] is None and meta["device_clock_offset_us"] is None
    assert meta["sensor_tracks"] == {"device": "host", "host": "host"} and meta["unlinked_device_J"] == 0.0
    assert window.window_J == pytest.approx((DEVICE_W + HOST_W) * window.window_s, rel=1e-9)


def test_attribution_conserves_the_window_energy_and_is_saved(tmp_path):
    callback = EnergyProfiler(wait=0, warmup=1, active=2, repeat=2, sensors=sensors(), interval_s=0.002)
    trainer = profiled_fit(tmp_path, callback)
    assert [w.step for w in callback.windows] == [3, 6]
    for window in callback.windows:
        a = window.attribution
        assert a.ops_J + a.idle_J == pytest.approx(window.window_J, rel=1e-9)  # ops + idle = window
        assert a.window_J == pytest.approx(window.window_J, rel=1e-9)
        assert sum(r.share for r in a.rows) == pytest.approx(1.0, rel=1e-9)
        ops = {r.op: r for r in a.rows}
        assert "aten::addmm" in ops and ops["aten::addmm"].calls == 2  # one forward Linear per step
        assert all(r.energy_J >= 0 for r in a.rows)
        # constant power: every op's energy is the power times the time it held (alone here: one thread)
        for r in a.rows:
            assert r.energy_J == pytest.approx((DEVICE_W + HOST_W) * r.self_time_s, rel=1e-6, abs=1e-12)
        rows = list(csv.DictReader(io.StringIO(window.csv_path.read_text())))
        assert list(rows[0]) == ["op", "track", "calls", "time_s", "energy_J", "share_of_step_energy", "sensors",
                                 "energy_source", "launched_kernels", "launched_device_J", "launched_device_sensors",
                                 "launched_device_source"]
        assert {r["energy_source"] for r in rows} == {"measured"}
        # a CPU run: the device is the CPU, so both sensors go to its threads and no kernel is launched
        assert {(r["track"], r["sensors"], r["launched_device_J"]) for r in rows} == {("host", "device;host", "")}
        assert rows[-1]["op"] == IDLE_ROW
        assert sum(float(r["energy_J"]) for r in rows) == pytest.approx(window.window_J, rel=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(trainer.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert "energy/ops/text_summary" in acc.Tags()["tensors"]
    text = acc.Tensors("energy/ops/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "aten::addmm" in text and "share of step energy" in text and "ESTIMATED" not in text
    logged = [e.value for e in acc.Scalars("profiler/window_J")]
    assert logged == pytest.approx([w.window_J for w in callback.windows], rel=1e-6)


def test_estimated_sensors_are_labelled_in_trace_csv_and_table(tmp_path, caplog):
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    estimate = [SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host", estimated=True)]
    callback = EnergyProfiler(wait=0, warmup=1, active=2, sensors=estimate, interval_s=0.002)
    with caplog.at_level(logging.INFO):
        trainer = profiled_fit(tmp_path, callback)
    (window,) = callback.windows
    assert window.attribution.estimated is True
    trace = json.loads(window.trace_path.read_text())
    assert trace["lightningEnergy"]["estimated"] is True and trace["lightningEnergy"]["estimated_sensors"] == ["host"]
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "C"}
    assert names == {"power device (W)", "energy device (J)", "power host (W, estimate)", "energy host (J, estimate)"}
    rows = list(csv.DictReader(io.StringIO(window.csv_path.read_text())))
    assert {r["energy_source"] for r in rows} == {"estimated"}
    assert sum(float(r["energy_J"]) for r in rows) == pytest.approx((DEVICE_W + HOST_W) * window.window_s, rel=1e-6)
    acc = EventAccumulator(trainer.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("energy/ops/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.endswith("energy: ESTIMATED where it includes host (modelled sensors), not measured")
    assert "host rows: energy of device (measured), host (ESTIMATE), split among CPU threads" in text
    infos = [r.getMessage() for r in caplog.records if r.getMessage().startswith("EnergyProfiler: sensors")]
    assert infos == ["EnergyProfiler: sensors ['host'] are estimates, not measurements; the energy in the traces "
                     "and per-op tables is labelled estimated"]


def test_training_ending_inside_the_active_steps_keeps_the_partial_window(tmp_path):
    callback = EnergyProfiler(wait=0, warmup=1, active=50, sensors=sensors(), use_gzip=True, record_shapes=True,
                              profile_memory=True, with_stack=True)
    profiled_fit(tmp_path, callback, max_steps=4)
    (window,) = callback.windows
    assert window.trace_path.name.endswith(".pt.trace.json.gz")
    trace = read_chrome_trace(window.trace_path)
    events = trace["traceEvents"]
    assert any("Input Dims" in e.get("args", {}) for e in events if e.get("name") == "aten::addmm")  # shapes
    assert any(e.get("name") == "[memory]" for e in events)  # memory
    assert any(e.get("cat") == "python_function" for e in events)  # stacks (Python frames: not ops)
    frames = {e["name"] for e in events if e.get("cat") == "python_function"}
    assert not {r.op for r in window.attribution.rows} & frames
    # steps 1-3 recorded, plus the ProfilerStep opened after the last batch and closed when training ended
    assert sum(1 for e in trace["traceEvents"] if str(e.get("name")).startswith("ProfilerStep#")) == 4
    assert window.attribution.ops_J + window.attribution.idle_J == pytest.approx(window.window_J, rel=1e-9)


def test_a_failing_step_inside_the_window_stops_the_profiler_cleanly(tmp_path):
    from lightning_energy.measure.sampler import get_sampler

    callback = EnergyProfiler(wait=0, warmup=1, active=5, sensors=sensors())
    trainer = L.Trainer(callbacks=[callback], logger=TensorBoardLogger(str(tmp_path), name="tb"),
                        **trainer_kwargs(tmp_path))
    with pytest.raises(RuntimeError, match="injected training failure"):
        trainer.fit(TinyRegressor(fail_at_step=3), tiny_loader(), tiny_loader(n=48))
    assert callback.windows == []  # a failed run's trace is left as torch wrote it
    assert callback not in get_sampler()._owners  # detached from the shared sampler


def test_schedule_that_never_records_warns(tmp_path):
    callback = EnergyProfiler(wait=20, warmup=1, active=1, sensors=sensors())
    with pytest.warns(UserWarning, match="never|before the schedule"):
        profiled_fit(tmp_path, callback, max_steps=3)
    assert callback.windows == []
    assert not list((tmp_path / "tb" / "version_0").glob("*.pt.trace.json*"))


def test_conflicts_and_bad_arguments_are_named(tmp_path):
    callback = EnergyProfiler(sensors=sensors())
    trainer = L.Trainer(callbacks=[callback], logger=False, profiler="pytorch", **trainer_kwargs(tmp_path))
    with pytest.raises(ValueError, match="profiler='pytorch'"):  # checked first thing in setup, before training
        callback.setup(trainer, TinyRegressor(), "fit")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        L.Trainer(callbacks=[EnergyProfiler(activities=["cuda"], sensors=sensors())], logger=False,
                  **trainer_kwargs(tmp_path)).fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))


# ------------------------------------------------------------------------------ clock alignment
def test_sync_markers_map_perf_counter_onto_the_trace_clock():
    from torch.profiler import ProfilerActivity, profile, record_function

    syncs, checks = [], []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(3):
            before = time.perf_counter()
            with record_function(SYNC_MARKER):
                pass
            syncs.append((before, time.perf_counter()))
            torch.randn(64, 64) @ torch.randn(64, 64)
            time.sleep(0.01)
            before = time.perf_counter()
            with record_function(f"check{i}"):
                pass
            checks.append((before, time.perf_counter()))
    events = [{"ph": "X", "name": e.name, "ts": e.time_range.start, "dur": e.time_range.elapsed_us()}
              for e in prof.events()]
    # events() ts are relative to the profiler start; the exported trace shifts them all the same way
    offset, uncertainty = clock_offset_us(events, syncs)
    assert 0 <= uncertainty < 200  # three markers 10 ms apart pin the offset to well under a millisecond
    for i, (before, after) in enumerate(checks):  # other ops land between the perf_counter readings around them
        (marker,) = [e for e in events if e["name"] == f"check{i}"]
        assert before * 1e6 + offset - uncertainty - 1 <= marker["ts"]
        assert marker["ts"] + marker["dur"] <= after * 1e6 + offset + uncertainty + 1


def test_exported_trace_clock_matches_the_unix_fallback(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        unix_minus_perf = time.time() - time.perf_counter()
        before = time.perf_counter()
        with record_function(SYNC_MARKER):
            pass
        sync = (before, time.perf_counter())
    path = tmp_path / "t.pt.trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    by_marker, _ = clock_offset_us(trace["traceEvents"], [sync])
    by_clock, _ = clock_offset_us([], [], trace["baseTimeNanoseconds"], unix_minus_perf)
    assert abs(by_marker - by_clock) < 5000  # baseTimeNanoseconds + ts is Unix time (to within ms)
    with pytest.raises(ValueError, match="no clock-sync marker"):
        clock_offset_us([], [])


# ------------------------------------------------------------------------------ the attribution rule
def curve_10_then_30_W() -> EnergyCurve:
    """Window [0, 10] s: 10 W until 5 s, then 30 W (cumulative 0, 50, 200 J)."""
    samples = [(2.5, {"s": (25.0, 10.0)}), (5.0, {"s": (50.0, 10.0)}), (7.5, {"s": (125.0, 30.0)})]
    return EnergyCurve.from_window(0.0, {"s": 0.0}, 10.0, {"s": 200.0}, samples)


def op(name, start_s, end_s, tid, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": start_s * 1e6,
            "dur": (end_s - start_s) * 1e6}


def test_offset_bounds_from_markers_are_intersected():
    markers = [{"ph": "X", "name": SYNC_MARKER, "ts": 1000.0 + 10, "dur": 2.0},  # tight: offset in [9, 10]
               {"ph": "X", "name": SYNC_MARKER, "ts": 5000.0 + 300, "dur": 2.0}]  # preempted: wide bounds
    syncs = [(1000e-6, 1003e-6), (5000e-6, 5400e-6)]
    offset, uncertainty = clock_offset_us(markers, syncs)
    assert offset == pytest.approx(9.5) and uncertainty == pytest.approx(0.5)


def test_attribution_rule_splits_overlaps_equally_by_hand():
    events = [
        op("outer", 1, 7, tid=1), op("inner", 2, 4, tid=1), op("b", 3, 6, tid=2),
        # bookkeeping the rule ignores
        op("ProfilerStep#4", 0, 10, tid=1, cat="user_annotation"), op(SYNC_MARKER, 0.5, 0.6, tid=1),
        op("train.py(12): step", 1, 9, tid=1, cat="python_function"), op("PyTorch Profiler (0)", 0, 10, 0, "Trace"),
        {"ph": "C", "name": "power s (W)", "pid": 1, "ts": 1e6, "args": {"W": 1.0}},
    ]
    a = attribute_energy(events, curve_10_then_30_W(), offset_us=0.0)
    got = {r.op: (r.calls, r.self_time_s, r.energy_J) for r in a.rows}
    # pieces: [1,2] outer 10 J; [2,3] inner 10; [3,4] inner+b 10 -> 5/5; [4,5] outer+b 10 -> 5/5;
    # [5,6] outer+b 30 -> 15/15; [6,7] outer 30; idle [0,1] 10 + [7,10] 90
    assert got == {"outer": (1, 4.0, 60.0), "inner": (1, 2.0, 15.0), "b": (1, 3.0, 25.0), IDLE_ROW: (0, 4.0, 100.0)}
    assert a.window_J == 200.0 and a.ops_J + a.idle_J == 200.0
    assert [r.op for r in a.rows] == ["outer", "b", "inner", IDLE_ROW]
    assert a.rows[0].share == pytest.approx(0.3)


def test_attribution_clips_ops_to_the_window_and_shifts_by_the_offset():
    events = [op("early", -2, 1, tid=1), op("late", 9, 12, tid=2)]
    offset_us = 5e6  # the trace clock runs 5 s ahead of perf_counter
    for e in events:
        e["ts"] += offset_us
    a = attribute_energy(events, curve_10_then_30_W(), offset_us)
    got = {r.op: (r.self_time_s, r.energy_J) for r in a.rows}
    assert got["early"] == pytest.approx((1.0, 10.0)) and got["late"] == pytest.approx((1.0, 30.0))
    assert got[IDLE_ROW] == pytest.approx((8.0, 160.0))


def test_self_segments_hold_the_innermost_op_and_cut_runaway_children():
    segments = self_segments([(0, 10, "parent"), (2, 4, "child"), (3, 3.5, "grandchild"), (8, 12, "runaway")])
    assert segments == [(0, 2, "parent"), (2, 3, "child"), (3, 3.5, "grandchild"), (3.5, 4, "child"),
                        (4, 8, "parent"), (8, 10, "runaway")]
    assert self_segments([]) == []


def test_counter_events_and_trace_rewrite(tmp_path):
    curve = curve_10_then_30_W()
    samples = [(-1.0, {"s": (0.0, 10.0)}), (2.5, {"s": (25.0, 10.0)}), (7.5, {"s": (125.0, 30.0)}),
               (11.0, {"s": (230.0, 30.0)})]
    events = counter_events(samples, curve, offset_us=100.0, pid=7)
    power = [(e["ts"], e["args"]["W"]) for e in events if e["name"] == "power s (W)"]
    assert power == [(100.0, 10.0), (2.5e6 + 100, 10.0), (7.5e6 + 100, 30.0), (10e6 + 100, 30.0)]
    energy = [(e["ts"], e["args"]["J"]) for e in events if e["name"] == "energy s (J)"]
    assert energy[0] == (100.0, 0.0) and energy[-1] == (10e6 + 100, 200.0)
    assert all(e["pid"] == 7 and e["ph"] == "C" for e in events)
    for name in ("t.pt.trace.json", "t.pt.trace.json.gz"):
        path = tmp_path / name
        write_chrome_trace(path, {"traceEvents": events})
        assert read_chrome_trace(path)["traceEvents"] == events
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.pt.trace.json", "t.pt.trace.json.gz"]  # no temp left


def test_window_recorder_keeps_the_last_sample_before_the_window():
    recorder = WindowRecorder()
    reading = lambda j, w: [Reading("s", j, w, {})]  # noqa: E731
    recorder(1.0, reading(1.0, 5.0))
    recorder(2.0, reading(2.0, 5.0))
    recorder.open()
    recorder(3.0, reading(3.0, 6.0))
    points = recorder.close()
    assert [t for t, _ in points] == [2.0, 3.0] and points[-1][1]["s"] == (3.0, 6.0, 3.0)  # (J, W, read time)
    recorder(4.0, reading(4.0, 6.0))
    recorder.open()
    assert recorder.close() == [(4.0, {"s": (4.0, 6.0, 4.0)})]
    curve = EnergyCurve.from_window(2.5, {"s": 2.5}, 3.5, {"s": 3.5}, points)
    assert curve.energy_J == pytest.approx(1.0)
    assert np.allclose(curve.total_at(np.array([2.5, 3.0, 3.5])), [0.0, 0.5, 1.0])
