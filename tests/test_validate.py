"""``lightning-energy validate``: a run's energy beside a meter's log, checked against analytic truth.

Our sensor draws a known power (an analytic function of time, or a programmed SimulatedSensor trace in a
real fake-time ``Trainer.fit``); the "meter" sees the node: that power plus ``BASE_W`` (fans, PSU losses).
Meter logs are synthesised from the same function: readings at 1 Hz or 10 Hz (each the mean power over the
interval before it, as a PTDaemon / Yokogawa reading is; or instantaneous), on a clock offset from ours (and
drifting), with gaps, as power in W or kW or as a Wh counter, in CSV (Unix, ISO 8601, relative times) or
PTDaemon's format. The energies, errors, offsets and MLPerf checks the command reports are asserted against
the analytic figures.
"""

from __future__ import annotations

import datetime
import json
import math
import types

import numpy as np
import pytest

from lightning_energy.analysis.reference_log import MeterLogError, read_meter_log, unit_of_name
from lightning_energy.analysis.runs import load_run
from lightning_energy.analysis.validate import read_report, validate, wall_clock_anchor
from lightning_energy.cli.main import main
from lightning_energy.measure.sampler import Reading
from lightning_energy.outputs.trace import TraceWriter

UNIX0 = 1.7e9  # the trace's wall clock at its time 0
BASE_W = 40.0  # what the meter sees beyond our sensor
# our sensor's power (W) at trace time t (s): incommensurate sines, so no shift of the curve looks like another
TERMS = ((60.0, 13.1), (30.0, 5.3), (20.0, 97.0))
MEAN_W = 150.0
MAX_SLOPE_W_PER_S = sum(2 * math.pi * a / period for a, period in TERMS)
FIT_S = 330.0  # five and a half minutes: MLPerf's five one-minute windows fit
RUN_EPOCHS = [(0.0, 100.0, 90.0, 100.0), (100.0, 200.0, 190.0, 200.0), (200.0, 320.0, 310.0, 320.0)]


def power_W(t):
    t = np.asarray(t, dtype=float)
    return MEAN_W + sum(a * np.sin(2 * np.pi * t / period) for a, period in TERMS)


def energy_J(t):
    """The exact integral of :func:`power_W` from 0 to ``t`` (J)."""
    t = np.asarray(t, dtype=float)
    return MEAN_W * t + sum(a * period / (2 * np.pi) * (1 - np.cos(2 * np.pi * t / period)) for a, period in TERMS)


def node_J(t, gain=1.0, base=BASE_W):
    return base * np.asarray(t, dtype=float) + gain * energy_J(t)


# --------------------------------------------------------------------------------------------- run dirs
def write_run_dir(folder, duration_s=FIT_S, epochs=RUN_EPOCHS, dt_s=0.1, report_extra=None):
    """A run dir written by the product's own TraceWriter: samples of the analytic sensor every ``dt_s`` from
    the fit's start (trace time 0, Unix ``UNIX0``) to its end, the epochs' and validation loops' events, and
    an energy_report.json with each epoch's bound."""
    writer = TraceWriter(folder, ["gpu"], warn=False)
    writer.origin_perf, writer.origin_unix = 0.0, UNIX0
    events = [(0.0, "fit_start", None)]
    for i, (start, end, v_start, v_end) in enumerate(epochs):
        events += [(start, "epoch_start", i), (v_start, "validation_start", i), (v_end, "validation_end", i),
                   (end, "epoch_end", i)]
    events.append((duration_s, "fit_end", None))
    events.sort(key=lambda e: e[0])
    for t in np.round(np.arange(0.0, duration_s + dt_s / 2, dt_s), 9):
        while events and events[0][0] <= t:
            when, name, epoch = events.pop(0)
            writer.event(name, when, epoch)
        writer(float(t), [Reading("gpu", float(energy_J(t)), float(power_W(t)), {})])
    writer.close()
    assert writer.complete
    report = {"provenance": "simulated", "total_J": float(energy_J(duration_s)),
              "sensors": [{"name": "gpu", "rank": 0, "scope": "device", "provenance": "simulated",
                           "source": "analytic test power", "energy_J": float(energy_J(duration_s))}],
              "epochs": [{"epoch": i, "bound_J": 5.0} for i in range(len(epochs))], **(report_extra or {})}
    (folder / "energy_report.json").write_text(json.dumps(report))
    return folder


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run_dir(tmp_path_factory.mktemp("validate") / "run")


# --------------------------------------------------------------------------------------------- meter logs
def meter_readings(rate_hz, start_s=-30.0, end_s=FIT_S + 30.0, offset_s=0.0, drift=0.0, gain=1.0,
                   averaged=True, skip=None, node=None):
    """(meter clock times on the trace axis, true times, power W) of a meter reading evenly by its own clock.

    Its clock: ``m = t (1 + drift) - offset_s`` for true time ``t``: ``offset_s`` is what validate should add.
    ``averaged``: each reading the node's mean power over the interval before it (else its power at the
    reading). ``skip(t)``: readings to leave out (a gap)."""
    node = node or (lambda t: node_J(t, gain))
    m_start = start_s * (1 + drift) - offset_s
    m = m_start + np.arange(int((end_s - start_s) * rate_hz) + 1) / rate_hz
    true = (m + offset_s) / (1 + drift)
    if averaged:
        previous = np.concatenate(([true[0] - 1 / rate_hz], true[:-1]))
        watts = (node(true) - node(previous)) / (true - previous)
    else:
        watts = BASE_W + gain * power_W(true)
    if skip is not None:
        keep = ~skip(true)
        m, true, watts = m[keep], true[keep], watts[keep]
    return m, true, watts


def write_meter(path, m, values, fmt="unix"):
    """A meter log of ``values`` at meter times ``m`` (s on the trace axis) in one of the formats users have."""
    lines = []
    if fmt == "unix":
        lines = ["time,power_W"] + [f"{UNIX0 + t:.3f},{v:.4f}" for t, v in zip(m, values)]
    elif fmt == "iso":  # a PDU's export: ISO 8601 with a zone, kW, semicolons
        zone = datetime.timezone(datetime.timedelta(hours=2))
        lines = ["timestamp;Power (kW)"] + [
            f"{datetime.datetime.fromtimestamp(UNIX0 + t, zone).isoformat(timespec='milliseconds')};{v / 1e3:.7f}"
            for t, v in zip(m, values)]
    elif fmt == "relative":
        lines = ["# exported by a wall plug", "seconds,watts"] + [f"{t - m[0]:.3f},{v:.4f}" for t, v in zip(m, values)]
    elif fmt == "ptd":
        utc = datetime.timezone.utc
        lines = [f"Time,{datetime.datetime.fromtimestamp(UNIX0 + t, utc).strftime('%m-%d-%Y %H:%M:%S.%f')[:-3]},"
                 f"Watts,{v:.4f},Volts,230.1,Amps,{v / 230.1:.4f},PF,0.9800,Mark,testing" for t, v in zip(m, values)]
    elif fmt == "counter_wh":  # cumulative energy in Wh from an arbitrary count, as a PDU outlet keeps it
        lines = ["time,energy_Wh"] + [f"{UNIX0 + t:.3f},{12345.0 + v / 3600:.5f}" for t, v in zip(m, values)]
    else:
        raise ValueError(fmt)
    path.write_text("\n".join(lines) + "\n")
    return path


def compare(run_dir, meter_path, **kwargs):
    run = load_run(run_dir)
    meter = read_meter_log(meter_path, kwargs.pop("columns", None), kwargs.pop("unit", None))
    return validate(run, meter, wall_clock_anchor(run_dir), report=read_report(run_dir), **kwargs).result


def edge_tolerance_J(rate_hz, offset_error_s):
    """How far a window's meter figure may be from the truth: at each edge the cut reading interval (the power
    moving by at most the slope over it) and the residual offset (the node's power over it)."""
    interval = 1.0 / rate_hz
    return 2 * (MAX_SLOPE_W_PER_S * interval ** 2 + (BASE_W + MEAN_W + sum(a for a, _ in TERMS)) * offset_error_s)


# --------------------------------------------------------------------------------------------- alignment and energies
@pytest.mark.parametrize(("fmt", "rate_hz", "offset_s", "offset_tol_s"), [
    ("unix", 1.0, 7.5, 0.1), ("unix", 10.0, -33.2, 0.02), ("iso", 1.0, -2.0, 0.1), ("ptd", 10.0, 0.8, 0.02),
    ("relative", 10.0, None, 0.02), ("relative", 1.0, None, 0.1), ("counter_wh", 1.0, 3.0, 0.1),
], ids=lambda v: str(v))
def test_energies_and_errors_match_the_truth_with_the_offset_found(run_dir, tmp_path, fmt, rate_hz, offset_s,
                                                                    offset_tol_s):
    m, true, watts = meter_readings(rate_hz, offset_s=offset_s or 0.0)
    values = np.cumsum(np.concatenate(([0.0], watts[1:] * np.diff(true)))) if fmt == "counter_wh" else watts
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, values, fmt))
    # a relative log's offset is its first reading's time after the fit's start
    expected = true[0] if fmt == "relative" else offset_s
    assert result["alignment"]["how"] == "auto"
    assert result["alignment"]["offset_s"] == pytest.approx(expected, abs=offset_tol_s)
    assert result["alignment"]["correlation"] > 0.95
    tolerance = edge_tolerance_J(rate_hz, offset_tol_s) + (2 * 0.005 * 3600 if fmt == "counter_wh" else 0.0)
    fit = result["fit"]
    assert fit["ours_J"] == pytest.approx(energy_J(FIT_S), rel=1e-9)
    assert fit["meter_J"] == pytest.approx(node_J(FIT_S) - node_J(0.0), abs=tolerance)
    truth_error = 100 * (energy_J(FIT_S) - node_J(FIT_S)) / node_J(FIT_S)
    assert fit["error_pct"] == pytest.approx(truth_error, abs=100 * tolerance / node_J(FIT_S))
    assert fit["difference_W"] == pytest.approx(BASE_W, abs=tolerance / FIT_S)
    for row, (start, end, *_) in zip(result["epochs"], RUN_EPOCHS):
        assert row["ours_J"] == pytest.approx(energy_J(end) - energy_J(start), rel=1e-9)
        assert row["meter_J"] == pytest.approx(node_J(end) - node_J(start), abs=tolerance)
        assert row["bound_J"] == 5.0 and row["within_bound"] is False  # the meter also sees BASE_W


def test_phases_split_training_validation_and_the_idle_meter_before_and_after(run_dir, tmp_path):
    m, true, watts = meter_readings(10.0, offset_s=0.0)
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, watts), offset_s=0.0)
    phases = {p["phase"]: p for p in result["phases"]}
    validation = [(v0, v1) for _, _, v0, v1 in RUN_EPOCHS]
    assert phases["validation"]["duration_s"] == pytest.approx(sum(b - a for a, b in validation))
    assert phases["validation"]["ours_J"] == pytest.approx(sum(energy_J(b) - energy_J(a) for a, b in validation))
    assert phases["training"]["duration_s"] == pytest.approx(RUN_EPOCHS[-1][1] - 30.0)
    assert phases["rest of the fit"]["duration_s"] == pytest.approx(FIT_S - RUN_EPOCHS[-1][1])
    before = phases["before the fit (meter only)"]
    assert before["ours_J"] is None and before["meter_W"] == pytest.approx(
        (node_J(0.0) - node_J(true[0])) / -true[0], rel=1e-3)
    assert "after the fit (meter only)" in phases
    assert sum(p["ours_J"] for p in result["phases"] if p["ours_J"] is not None) == pytest.approx(energy_J(FIT_S))


def test_a_drifting_meter_clock_is_measured_and_corrected(run_dir, tmp_path):
    drift = 600e-6  # the meter's clock gains 0.6 ms a second: 0.2 s over the fit
    m, true, watts = meter_readings(10.0, offset_s=4.0, drift=drift)
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, watts))
    alignment = result["alignment"]
    assert alignment["drift_ppm"] == pytest.approx(-drift / (1 + drift) * 1e6, abs=100)
    assert alignment["offset_s"] == pytest.approx(4.0, abs=0.02)
    assert len(alignment["segments"]) == 4
    for row, (start, end, *_) in zip(result["epochs"], RUN_EPOCHS):
        assert row["meter_J"] == pytest.approx(node_J(end) - node_J(start), abs=edge_tolerance_J(10.0, 0.02))


def test_without_drift_none_is_applied(run_dir, tmp_path):
    m, _, watts = meter_readings(1.0, offset_s=-1.0)
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, watts))
    assert result["alignment"]["drift_ppm"] == 0.0
    assert result["alignment"]["runner_up_correlation"] < result["alignment"]["correlation"] - 0.02


def test_a_given_offset_is_used_as_given(run_dir, tmp_path):
    m, _, watts = meter_readings(1.0, offset_s=2.5)
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, watts), offset_s=2.5)
    assert result["alignment"]["how"] == "given" and result["alignment"]["offset_s"] == 2.5
    assert result["fit"]["meter_J"] == pytest.approx(node_J(FIT_S) - node_J(0.0), abs=edge_tolerance_J(1.0, 0.0))


def test_instantaneous_readings_at_10_hz_come_within_a_tenth_of_a_percent(run_dir, tmp_path):
    m, _, watts = meter_readings(10.0, offset_s=1.0, averaged=False)
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, watts))
    assert result["fit"]["meter_J"] == pytest.approx(node_J(FIT_S) - node_J(0.0), rel=1e-3)


def test_a_periodic_load_is_flagged_as_an_ambiguous_alignment(tmp_path, monkeypatch):
    """A load that repeats every 20 s: a relative log lines up a period early or late about as well."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "TERMS", ((60.0, 20.0),))
    run = write_run_dir(tmp_path / "run", duration_s=120.0,
                        epochs=[(0.0, 60.0, 50.0, 60.0), (60.0, 120.0, 110.0, 120.0)])
    m, _, watts = meter_readings(10.0, start_s=-60.0, end_s=180.0)
    result = compare(run, write_meter(tmp_path / "meter.csv", m, watts, "relative"))
    assert any("ambiguous alignment" in note for note in result["notes"]), result["notes"]


# --------------------------------------------------------------------------------------------- MLPerf's rules
def checks(result) -> dict:
    return {c["rule"].split(" ")[2] if c["rule"].startswith("at least") else c["rule"].split(" ")[0]: c
            for c in result["mlperf"]["checks"]}


def test_a_gap_in_the_log_fails_the_once_a_second_rule_and_counts_as_mlperf_counts_it(run_dir, tmp_path):
    in_gap = lambda t: (t > 140.0) & (t < 160.0)  # noqa: E731  twenty seconds without readings
    m, true, watts = meter_readings(1.0, skip=in_gap)
    lines = write_meter(tmp_path / "meter.csv", m, watts).read_text().splitlines()
    lines.insert(28, f"{UNIX0 + m[27] + 0.5:.3f},nan")  # a failed reading after m[27] (line 0: the header): dropped
    (tmp_path / "meter.csv").write_text("\n".join(lines) + "\n")
    result = compare(run_dir, tmp_path / "meter.csv", offset_s=0.0)
    found = checks(result)
    assert found["one"]["passed"] is False and "longest 20.000 s" in found["one"]["detail"]
    assert [(round(g["start_s"]), round(g["end_s"])) for g in result["gaps"]] == [(140, 160)]
    assert result["reference"]["dropped_rows"] == 1
    # MLPerf's rule: the reading after the gap times the whole gap
    inside = (true > 100.0) & (true <= 200.0)
    expected = float(np.sum(watts[inside] * np.diff(true)[inside[1:]]))
    epoch = result["epochs"][1]
    assert epoch["meter_J"] == pytest.approx(expected, rel=1e-6)  # the log holds 4 decimals
    assert epoch["gap_s"] == pytest.approx(20.0)


@pytest.mark.parametrize(("rate_hz", "passes"), [(1.0, False), (10.0, True)])
def test_fewer_than_60_readings_over_the_fit_are_flagged(tmp_path, rate_hz, passes):
    run = write_run_dir(tmp_path / "run", duration_s=40.0, epochs=[(0.0, 40.0, 35.0, 40.0)])
    m, _, watts = meter_readings(rate_hz, start_s=-5.0, end_s=45.0)
    result = compare(run, write_meter(tmp_path / "meter.csv", m, watts), offset_s=0.0)
    found = checks(result)
    assert found["60"]["passed"] is passes
    assert found["60"]["detail"].startswith(f"{int(40 * rate_hz) + 1} reading")  # 0 s and 40 s both count
    assert found["one"]["passed"] is True
    assert found["5"]["passed"] is None  # 40 s: no five one-minute windows


def test_a_meter_slower_than_1_hz_fails_the_rate_rule(run_dir, tmp_path):
    m, _, watts = meter_readings(0.5)
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, watts), offset_s=0.0)
    assert checks(result)["one"]["passed"] is False and result["mlperf"]["passed"] is False


def test_a_log_that_starts_after_the_fit_fails_the_coverage_rule(run_dir, tmp_path):
    m, _, watts = meter_readings(1.0, start_s=20.0)
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, watts), offset_s=0.0)
    assert checks(result)["the"]["passed"] is False
    assert result["fit"]["start_s"] == pytest.approx(20.0, abs=1.0)
    assert result["epochs"][0]["covered"] is False
    assert any("covers" in note for note in result["notes"])


@pytest.mark.parametrize(("gain", "passes"), [(1.03, True), (1.08, False)])
def test_the_olympic_five_percent_test_over_five_one_minute_windows(run_dir, tmp_path, gain, passes):
    m, _, watts = meter_readings(1.0, gain=gain, node=lambda t: node_J(t, gain, base=0.0))
    result = compare(run_dir, write_meter(tmp_path / "meter.csv", m, watts), offset_s=0.0)
    accuracy = checks(result)["5"]
    assert accuracy["passed"] is passes
    assert accuracy["error_pct"] == pytest.approx(100 * (1 / gain - 1), abs=0.05)
    assert len(result["mlperf"]["windows"]) == 5
    assert [w["start_s"] for w in result["mlperf"]["windows"]] == pytest.approx([0, 60, 120, 180, 240])


# --------------------------------------------------------------------------------------------- a real fit
STEP_S = 0.25
VALIDATION_S = 3.0


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A real fake-time Trainer.fit with EnergyCallback and a SimulatedSensor following a programmed trace:
    2 epochs of 40 steps of 0.25 s and a 3 s validation each (26 s). Its trace's wall clock is pinned
    (Unix ``UNIX0`` + the fake clock) so the meter log can be made from the same trace."""
    import lightning as L

    import lightning_energy.outputs.trace as trace_module
    from lightning_energy import EnergyCallback, SimulatedSensor
    from power_limit_helpers import ValidatingSimModule, install_fake_time, loader

    folder = tmp_path_factory.mktemp("fit")
    with pytest.MonkeyPatch.context() as patch:
        clock = install_fake_time(patch.setattr)
        patch.setattr(trace_module, "time", types.SimpleNamespace(perf_counter=lambda: 0.0, time=lambda: UNIX0))
        programme = [(i * STEP_S, float(power_W(i * STEP_S))) for i in range(400)]
        sensor = SimulatedSensor("gpu", programme, kind="energy", clock=clock)

        class Timed(ValidatingSimModule):
            def training_step(self, batch, batch_idx):
                self.clock.advance(STEP_S)
                return super().training_step(batch, batch_idx)

        trainer = L.Trainer(callbacks=[EnergyCallback(sensors=[sensor], verbose=False)], max_epochs=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            accelerator="cpu", devices=1, default_root_dir=str(folder), num_sanity_val_steps=0)
        trainer.fit(Timed(clock=clock, validation_s=VALIDATION_S), loader(40, batch_size=4), loader(2, batch_size=4))
    report = json.loads((folder / "energy_report.json").read_text())
    return types.SimpleNamespace(folder=folder, sensor=sensor, origin=sensor._origin, report=report)


def fitted_meter(fitted, tmp_path, rate_hz, clock_ahead_s):
    """A PTDaemon log of the node (the sensor's programme + BASE_W, mean power over each interval)."""
    sensor, origin = fitted.sensor, fitted.origin

    def node(t):
        return np.asarray([BASE_W * u + sensor.energy_at(u - origin) if u >= origin else BASE_W * u
                           for u in np.atleast_1d(t)])

    m, true, watts = meter_readings(rate_hz, start_s=origin - 10.0, end_s=origin + 36.0, offset_s=-clock_ahead_s,
                                    node=node)
    return write_meter(tmp_path / "ptd.txt", m, watts, "ptd"), node


def test_a_real_fit_against_a_ptdaemon_log_through_the_command(fitted, tmp_path, capsys):
    meter_path, node = fitted_meter(fitted, tmp_path, 10.0, clock_ahead_s=1.3)
    out = tmp_path / "out"
    assert main(["validate", str(fitted.folder), "--reference", str(meter_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "validation.json").read_text())
    assert (out / "validation_power.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["alignment"]["offset_s"] == pytest.approx(-1.3, abs=0.1)
    fit = result["fit"]
    assert fit["ours_J"] == pytest.approx(fitted.report["total_J"], rel=1e-9)
    start, end = fitted.origin, fitted.origin + 26.0
    assert fit["duration_s"] == pytest.approx(26.0)
    assert fit["meter_J"] == pytest.approx(float(node(end)[0] - node(start)[0]), abs=edge_tolerance_J(10.0, 0.1))
    for row, report_row in zip(result["epochs"], fitted.report["epochs"]):
        assert row["bound_J"] == report_row["bound_J"]
        assert row["difference_W"] == pytest.approx(BASE_W, abs=edge_tolerance_J(10.0, 0.1) / 13.0)
    assert result["provenance"] == {"ours": "simulated", "meter": "measured"}
    assert "(SIMULATED)" in printed and "PASS  at least 60 readings over the fit: 26" in printed
    assert "n/a   5 % accuracy" in printed and f"wrote {out / 'validation_power.png'}" in printed


def test_a_real_fit_of_26_s_at_1_hz_has_too_few_readings_for_mlperf(fitted, tmp_path, capsys):
    meter_path, _ = fitted_meter(fitted, tmp_path, 1.0, clock_ahead_s=0.0)
    assert main(["validate", str(fitted.folder), "--reference", str(meter_path), "--no-plots",
                 "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "FAIL  at least 60 readings over the fit: 26 reading(s): MLPerf suggests running longer" in printed
    assert not (tmp_path / "out" / "validation_power.png").exists()


# --------------------------------------------------------------------------------------------- units
def test_a_power_log_1000x_off_is_refused_naming_the_unit(run_dir, tmp_path, capsys):
    m, _, watts = meter_readings(1.0)
    meter = write_meter(tmp_path / "meter.csv", m, watts / 1e3)  # kW values under a header saying W
    out = tmp_path / "out"
    assert main(["validate", str(run_dir), "--reference", str(meter), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert captured.err.count("\n") == 1 and captured.err.startswith("lightning-energy validate: error: ")
    assert "pass --unit kW" in captured.err and "--trust-units" in captured.err
    assert main(["validate", str(run_dir), "--reference", str(meter), "--unit", "kW", "--no-plots",
                 "--out", str(out)]) == 0


def test_a_wh_counter_read_as_joules_is_refused_naming_wh(run_dir, tmp_path):
    m, true, watts = meter_readings(1.0)
    counter = np.cumsum(np.concatenate(([0.0], watts[1:] * np.diff(true))))
    meter = tmp_path / "meter.csv"
    meter.write_text("time,energy_J\n" + "".join(f"{UNIX0 + t:.3f},{e / 3600:.6f}\n" for t, e in zip(m, counter)))
    with pytest.raises(MeterLogError, match="pass --unit Wh"):
        compare(run_dir, meter)
    assert compare(run_dir, meter, trust_units=True)["fit"]["meter_J"] < 1e3  # compared anyway, as asked


@pytest.mark.parametrize(("name", "unit"), [
    ("power_W", "W"), ("Power (kW)", "kW"), ("watts", "W"), ("Watt", "W"), ("energy_kWh", "kWh"), ("joules", "J"),
    ("Energy [Wh]", "Wh"), ("kilowatt hours", "kWh"), ("P_mW", "mW"), ("power", None), ("time", None),
])
def test_units_are_read_from_column_names(name, unit):
    assert unit_of_name(name) == unit


def test_a_headerless_log_is_named_by_columns_and_a_semicolon_log_with_comments_is_read(tmp_path):
    plain = tmp_path / "plain.csv"
    plain.write_text(f"{UNIX0:.1f},0.15\n{UNIX0 + 1:.1f},0.16\n{UNIX0 + 2:.1f},0.17\n")
    log = read_meter_log(plain, ("time", "kW"))
    assert (log.kind, log.unit, log.clock) == ("power", "kW", "wall")
    assert log.values.tolist() == pytest.approx([150.0, 160.0, 170.0])
    with pytest.raises(MeterLogError, match="does not say its unit: pass --unit"):
        read_meter_log(plain)
    named = tmp_path / "named.csv"
    named.write_text("time,power\n1,2\n2,3\n")
    with pytest.raises(MeterLogError, match="column 'power' does not say its unit: pass --unit"):
        read_meter_log(named)
    assert read_meter_log(named, unit="kW").values.tolist() == [2e3, 3e3]
    semicolons = tmp_path / "pdu.csv"
    semicolons.write_text("# PDU outlet 3\n#\nDate;Outlet;Active power (W)\n"
                          "2024-05-01T12:00:00Z;3;100\n2024-05-01T12:00:01Z;3;101\n2024-05-01 12:00:02;3;\n"
                          "2024-05-01 12:00:03;3;102\n")
    log = read_meter_log(semicolons)
    assert log.value_column == "Active power (W)" and log.time_column == "Date"
    assert log.time_s[0] == datetime.datetime(2024, 5, 1, 12, tzinfo=datetime.timezone.utc).timestamp()
    assert log.dropped_rows == 1 and len(log.time_s) == 3
    millis = tmp_path / "ms.csv"
    millis.write_text(f"t,W\n{UNIX0 * 1e3:.0f},1\n{UNIX0 * 1e3 + 500:.0f},2\n")
    assert read_meter_log(millis).time_s.tolist() == [UNIX0, UNIX0 + 0.5]


def test_ptdaemon_failed_readings_are_dropped_and_its_times_read_as_utc(tmp_path):
    ptd = tmp_path / "spl.txt"
    ptd.write_text("Time,05-01-2024 12:00:00.000,Watts,100.5,Volts,230,Amps,0.43,PF,0.99,Mark,ranging\n"
                   "Time,05-01-2024 12:00:01.000,Watts,-1.000000,Volts,-1,Amps,-1,PF,-1,Mark,ranging\n"
                   "Time,05-01-2024 12:00:02.000,Watts,101.5,Volts,230,Amps,0.44,PF,0.99,Mark,ranging\n")
    log = read_meter_log(ptd)
    assert log.format == "ptdaemon" and log.dropped_rows == 1 and log.first_dropped_line == 2
    assert log.time_s.tolist() == [datetime.datetime(2024, 5, 1, 12, 0, s, tzinfo=datetime.timezone.utc).timestamp()
                                   for s in (0, 2)]
    with pytest.raises(MeterLogError, match="--columns and --unit do not apply"):
        read_meter_log(ptd, unit="W")


# --------------------------------------------------------------------------------------------- refusals
def _lines(*rows):
    return "time,power_W\n" + "".join(f"{UNIX0 + t},{w}\n" for t, w in rows)


@pytest.mark.parametrize(("content", "match"), [
    (_lines((0, 100), (1, -5)), "line 3: power_W is -5 W: a meter's power is never negative"),
    (_lines((0, 100), (2, 100), (1, 100)), "line 4: the time does not increase"),
    (_lines((0, 100), (1, 100), (1, 100)), "line 4: the time does not increase"),
    (_lines((0, 100), (1, "inf")), "not a finite number"),
    (_lines((0, 100), (1, "lots")), "line 3: power_W is 'lots', not a number"),
    (_lines((0, 100)), "holds 1 reading"),
    ("", "holds no readings"),
    ("time\n1\n2\n", "one column only"),
    ("time,energy_Wh\n1700000000,5\n1700000001,4\n", "runs backwards"),
    ("when,value\n1700000000,5\n1700000001,4\n", "no column says it holds the time"),
    (b"time,power_W\n1700000000,1\xff\n", "not UTF-8"),
    ("time,power_W\n" + "9" * 5000 + ",1\n", "longer than 4096 characters"),
    ("time,power_W\nyesterday,1\n", "neither a number of seconds, ISO 8601"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_bad_logs_are_refused_with_the_line(tmp_path, content, match):
    path = tmp_path / "meter.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(MeterLogError, match=match):
        read_meter_log(path)


def test_size_and_row_limits_are_checked_before_and_while_reading(tmp_path, monkeypatch):
    from lightning_energy.analysis import reference_log

    path = tmp_path / "meter.csv"
    path.write_text(_lines(*((t, 100) for t in range(10))))
    with pytest.raises(MeterLogError, match="more than 5 rows"):
        read_meter_log(path, max_rows=5)
    monkeypatch.setattr(reference_log, "MAX_REFERENCE_BYTES", 100)
    with pytest.raises(MeterLogError, match="MiB, more than"):
        read_meter_log(path)


@pytest.mark.parametrize("case", ["missing", "directory", "bad offset", "bad columns", "a day later", "flat relative",
                                  "unknown unit"])
def test_the_command_refuses_in_one_line_and_writes_nothing(run_dir, tmp_path, capsys, case):
    meter = tmp_path / "meter.csv"
    m, true, watts = meter_readings(1.0)
    write_meter(meter, m, watts)
    extra = []
    if case == "missing":
        meter = tmp_path / "absent.csv"
    elif case == "directory":
        meter = tmp_path
    elif case == "bad offset":
        extra = ["--offset", "soon"]
    elif case == "bad columns":
        extra = ["--columns", "time"]
    elif case == "a day later":
        write_meter(meter, m + 86400.0, watts)
    elif case == "flat relative":  # nothing to correlate and no wall clock: an offset is needed
        flat = write_run_dir(tmp_path / "flat", duration_s=60.0, epochs=[(0.0, 60.0, 50.0, 60.0)])
        rows = "".join(f"{t},{200.0}\n" for t in range(100))
        (flat / "energy_trace.csv").write_text(
            "time_s,unix_time_s,gpu:energy_J,gpu:power_W\n" +
            "".join(f"{t:.6f},{UNIX0 + t:.6f},{150.0 * t:.6f},150\n" for t in np.arange(0, 60.05, 0.1)))
        meter.write_text("seconds,watts\n" + rows)
        run_dir = flat
    elif case == "unknown unit":
        extra = ["--unit", "hp"]
    out = tmp_path / "out"
    assert main(["validate", str(run_dir), "--reference", str(meter), "--out", str(out), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert captured.err.count("\n") == 1 and captured.err.startswith("lightning-energy validate: error: "), captured.err
    expected = {"missing": "cannot read meter log", "directory": "is a directory", "bad offset": "--offset must be",
                "bad columns": "--columns takes TIME,VALUE",
                "a day later": "24 h after the fit: is its clock in another time zone? Try --offset -86400",
                "flat relative": "give --offset SECONDS", "unknown unit": "unknown unit 'hp'"}[case]
    assert expected in captured.err


def test_the_plot_needs_the_analysis_extra_and_says_so_before_printing(run_dir, tmp_path, capsys, monkeypatch):
    import sys

    m, _, watts = meter_readings(1.0)
    meter = write_meter(tmp_path / "meter.csv", m, watts)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["validate", str(run_dir), "--reference", str(meter), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "[analysis]" in captured.err and "--no-plots" in captured.err
    assert not (tmp_path / "out").exists()


def test_validate_without_plots_loads_neither_torch_nor_lightning_nor_matplotlib(run_dir, tmp_path):
    from test_cli_startup import loaded_after

    m, _, watts = meter_readings(1.0)
    meter = write_meter(tmp_path / "meter.csv", m, watts)
    result = loaded_after(["validate", str(run_dir), "--reference", str(meter), "--no-plots", "--out", str(tmp_path)])
    assert result["rc"] == 0 and result["heavy"] == []
