"""Resampling, masked averaging, quadratic fits and run loading, against hand-computed values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lightning_energy.analysis.compare import compare_runs
from lightning_energy.analysis.fit import quadratic_fit
from lightning_energy.analysis.resample import even_grid, mean_std, pad_and_mask, resample, resample_power
from lightning_energy.analysis.runs import RunError, attribute, load_run
from workbench_helpers import write_run


# ---------------------------------------------------------------- resampling
def test_even_grid_at_4_hz_includes_the_end_when_it_falls_on_the_grid():
    assert even_grid(1.0).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert even_grid(0.9).tolist() == [0.0, 0.25, 0.5, 0.75]
    assert even_grid(0.0).tolist() == [0.0]
    assert even_grid(1.0, rate_hz=2.0).tolist() == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="rate"):
        even_grid(1.0, rate_hz=0)


def test_linear_resampling_goes_through_the_samples_and_keeps_a_monotone_series_monotone():
    t = [0.0, 0.3, 0.7, 1.1, 1.6, 2.0]
    grid, values = resample(t, [x**2 for x in t])  # 4 Hz
    assert grid.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    np.testing.assert_allclose(values, np.interp(grid, t, [x**2 for x in t]), rtol=0, atol=1e-12)
    assert np.all(np.diff(values) >= 0)


def test_resampling_window_is_relative_to_its_start():
    t = [0.0, 0.3, 0.7, 1.1, 1.6, 2.0]
    grid, values = resample(t, [x**2 for x in t], start_s=0.3, end_s=1.6)
    assert grid.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    np.testing.assert_allclose(values, np.interp(0.3 + grid, t, [x**2 for x in t]), atol=1e-12)


def test_nan_samples_are_dropped_and_bad_windows_refused():
    grid, values = resample([0.0, 0.5, 1.0, 1.5, 2.0], [0.0, math.nan, 1.0, 1.5, 2.0], rate_hz=1.0)
    assert values.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="at least 2"):
        resample([0.0], [1.0])
    with pytest.raises(ValueError, match="outside"):
        resample([0.0, 1.0], [0.0, 1.0], end_s=2.0)


def spiky_samples(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sensor reading 8.5 or 85 W at random, every 1-3 ms for 3 s (the issue's trace), and its
    cumulative energy by the trapezoid rule: (time s, power W, energy J)."""
    rng = np.random.default_rng(seed)
    t = np.concatenate(([0.0], np.cumsum(rng.uniform(0.001, 0.003, 1500))))
    power = rng.choice([8.5, 85.0], size=len(t))
    energy = np.concatenate(([0.0], np.cumsum(np.diff(t) * (power[1:] + power[:-1]) / 2)))
    return t, power, energy


def test_power_from_resampled_energy_never_leaves_the_samples_range_and_keeps_the_energy():
    t, power, energy = spiky_samples()
    grid, resampled = resample_power(t, energy, rate_hz=4.0, start_s=0.0, end_s=2.9)
    assert resampled.min() >= 8.5 - 1e-9 and resampled.max() <= 85.0 + 1e-9
    # the mean power over the centred grid intervals: their energies add up to the energy between the outer edges
    edges = np.clip(np.concatenate((grid - 0.125, [grid[-1] + 0.125])), 0.0, 2.9)
    assert np.sum(resampled * np.diff(edges)) == pytest.approx(np.interp(edges[-1], t, energy), rel=1e-12)
    _, at_500_hz = resample_power(t, energy, rate_hz=500.0)  # finer than the samples: still within range
    assert at_500_hz.min() >= 8.5 - 1e-9 and at_500_hz.max() <= 85.0 + 1e-9


def test_compare_plots_only_powers_within_the_samples_range(tmp_path):
    from lightning_energy.analysis.plots import band_plot

    runs = []
    for seed in range(3):
        t, power, energy = spiky_samples(seed)
        folder = tmp_path / f"run{seed}"
        folder.mkdir()
        rows = ["time_s,unix_time_s,cpu:energy_J,cpu:power_W"]
        rows += [f"{a:.6f},{1.7e9 + a:.6f},{e:.10g},{p:g}" for a, p, e in zip(t, power, energy)]
        (folder / "energy_trace.csv").write_text("\n".join(rows) + "\n")
        (folder / "energy_events.csv").write_text(
            f"time_s,unix_time_s,event,epoch,step\n0.001,{1.7e9 + 0.001},fit_start,,\n"
            f"{t[-1] - 0.001:.6f},{1.7e9 + t[-1] - 0.001:.6f},fit_end,,\n")
        (folder / "run_attributes.json").write_text('{"config": "spiky"}')  # three repetitions of one config
        runs.append(load_run(folder))
    result = compare_runs(runs, by="config")
    group = result["groups"]["spiky"]
    for key in ("mean", "min", "max"):
        assert 8.5 - 1e-9 <= min(group[f"curve_power_W_{key}"]) and max(group[f"curve_power_W_{key}"]) <= 85.0 + 1e-9
    ax = band_plot(result["groups"], "power_W", "power (W)", "power", result["provenance"]).axes[0]  # [1]: n(t)
    plotted = [line.get_ydata() for line in ax.get_lines()]
    plotted += [path.vertices[:, 1] for band in ax.collections for path in band.get_paths()]
    assert plotted and all(8.5 - 1e-9 <= np.min(y) and np.max(y) <= 85.0 + 1e-9 for y in plotted)
    assert ax.get_title() == "power, provenance unknown"  # no energy_report.json says where the joules come from


def test_padding_masks_the_shorter_runs_and_the_mean_uses_only_runs_still_going():
    stacked = pad_and_mask([[1.0, 2.0, 3.0, 4.0], [3.0, 4.0], [5.0]])
    assert stacked.shape == (3, 4)
    assert stacked.mask.tolist() == [[False] * 4, [False, False, True, True], [False, True, True, True]]
    mean, std, count = mean_std(stacked)
    assert mean.tolist() == [3.0, 3.0, 3.0, 4.0]  # (1+3+5)/3, (2+4)/2, 3, 4
    np.testing.assert_allclose(std, [math.sqrt(8 / 3), 1.0, 0.0, 0.0], atol=1e-15)
    assert count.tolist() == [3, 2, 1, 1]


def test_compare_of_runs_of_different_lengths(tmp_path):
    long_run = write_run(tmp_path / "a", {"gpu": 100.0}, duration_s=2.0, attributes={"model": "m", "seed": 1})
    short_run = write_run(tmp_path / "b", {"gpu": 200.0}, duration_s=1.0, attributes={"model": "m", "seed": 2})
    result = compare_runs([load_run(long_run), load_run(short_run)], by="model")
    group = result["groups"]["m"]
    assert group["runs"] == 2
    assert group["time_s"] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    # both runs up to 1 s: power (100 + 200) / 2 = 150 ± 50; after, only the 100 W run
    np.testing.assert_allclose(group["curve_power_W_mean"], [150.0] * 5 + [100.0] * 4, atol=1e-9)
    np.testing.assert_allclose(group["curve_power_W_std"], [50.0] * 5 + [0.0] * 4, atol=1e-9)
    t = np.array(group["time_s"])
    # the short run's energy held at its 200 J total after it ends: the mean ends at the mean of the totals
    np.testing.assert_allclose(group["curve_energy_J_mean"], np.where(t <= 1.0, 150.0 * t, (100.0 * t + 200.0) / 2),
                               atol=1e-9)
    np.testing.assert_allclose(group["curve_energy_J_std"], np.where(t <= 1.0, 50.0 * t, np.abs(100.0 * t - 200.0) / 2),
                               atol=1e-9)
    assert group["runs_at_time"] == [2] * 5 + [1] * 4
    rows = {r["run"]: r for r in result["runs"]}
    assert rows["a"]["energy_J"] == pytest.approx(200.0) and rows["a"]["edp_Js"] == pytest.approx(400.0)
    assert rows["b"]["energy_J"] == pytest.approx(200.0) and rows["b"]["edp_Js"] == pytest.approx(200.0)
    assert group["edp_Js_mean"] == pytest.approx(300.0) and group["edp_Js_std"] == pytest.approx(100.0)


def test_grouping_by_an_attribute_averages_repetitions(tmp_path):
    runs = [load_run(write_run(tmp_path / name, {"gpu": watts}, duration_s=1.0, attributes={"batch_size": size}))
            for name, watts, size in (("r1", 100.0, 64), ("r2", 140.0, 64), ("r3", 300.0, 256))]
    result = compare_runs(runs, by="batch_size")
    assert set(result["groups"]) == {"64", "256"}
    assert result["groups"]["64"]["runs"] == 2
    assert result["groups"]["64"]["energy_J_mean"] == pytest.approx(120.0)
    assert result["groups"]["64"]["energy_J_std"] == pytest.approx(20.0)
    np.testing.assert_allclose(result["groups"]["256"]["curve_power_W_mean"], 300.0)
    with pytest.raises(RunError, match="no attribute 'precision'"):
        compare_runs(runs, by="precision")


def shift_fit_boundaries(folder, start_s: float, end_s: float) -> None:
    """Move the fit_start / fit_end events of a hand-made run to these times."""
    events = folder / "energy_events.csv"
    lines = events.read_text().splitlines()
    for i, line in enumerate(lines):
        t, unix, name, *rest = line.split(",")
        if name in ("fit_start", "fit_end"):
            new_t = start_s if name == "fit_start" else end_s
            lines[i] = ",".join([f"{new_t:.6f}", f"{1.7e9 + new_t:.6f}", name, *rest])
    events.write_text("\n".join(lines) + "\n")


def test_fit_boundaries_just_outside_the_samples_continue_the_edge_power(tmp_path):
    # as EnergyCallback writes them: fit_start 0.2 ms before the first sample, fit_end 0.3 ms after the last
    folder = write_run(tmp_path / "run", {"gpu": 100.0, "cpu": 20.0}, duration_s=2.0, dt_s=0.05)
    shift_fit_boundaries(folder, -0.0002, 2.0003)
    run = load_run(folder)
    assert run.total_J == pytest.approx(120.0 * 2.0005, rel=1e-12)
    assert run.extrapolated_s == pytest.approx(0.0005, abs=1e-9)
    t, power, energy = run.covering_samples(run.start_s, run.end_s)
    assert (t[0], t[-1]) == pytest.approx((-0.0002, 2.0003), abs=1e-12) and len(t) == len(run.time_s) + 2
    assert power[0] == power[-1] == 120.0
    assert energy[-1] - energy[0] == pytest.approx(run.total_J, rel=1e-12)
    result = compare_runs([run], rate_hz=4.0)
    group = result["groups"]["run"]
    assert group["time_s"][:9] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    assert group["time_s"][9:] == [pytest.approx(2.0005)]  # the fit's end, off the grid: the run's total there
    assert group["curve_energy_J_mean"][-1] == pytest.approx(run.total_J, rel=1e-12)
    np.testing.assert_allclose(group["curve_power_W_mean"], 120.0, rtol=1e-12)
    np.testing.assert_allclose(group["curve_energy_J_mean"], 120.0 * np.array(group["time_s"]), atol=1e-9)
    assert result["runs"][0]["extrapolated_s"] == pytest.approx(0.0005, abs=1e-9)


@pytest.mark.parametrize("start_s, end_s", [(-0.5, 2.0), (0.0, 7.0)])
def test_fit_window_far_outside_the_samples_is_an_error(tmp_path, start_s, end_s):
    folder = write_run(tmp_path / "run", {"gpu": 100.0}, duration_s=2.0, dt_s=0.05)
    shift_fit_boundaries(folder, start_s, end_s)
    with pytest.raises(RunError, match=r"the trace covers \[0.000000, 2.000000\] s but the fit ran over .* at most 2 "
                                       r"sampling intervals \(0.1 s\)"):
        compare_runs([load_run(folder)])


# ---------------------------------------------------------------- runs from files
def test_a_run_is_read_back_from_trace_and_events(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 100.0, "cpu": 20.0}, duration_s=10.0, dt_s=0.5,
                       epochs=[(1.0, 4.0, 3.0, 4.0), (4.5, 8.0)], counter_every=3)
    run = load_run(folder)
    assert run.duration_s == pytest.approx(10.0)
    assert run.total_J == pytest.approx(1200.0)
    assert run.sensor_totals_J() == pytest.approx({"gpu": 1000.0, "cpu": 200.0})
    first, second = (e.as_dict() for e in run.epochs())
    assert first["energy_J"] == pytest.approx(360.0) and first["validation_J"] == pytest.approx(120.0)
    assert first["train_J"] == pytest.approx(240.0) and first["mean_power_W"] == pytest.approx(120.0)
    assert second["duration_s"] == pytest.approx(3.5) and second["edp_Js"] == pytest.approx(420.0 * 3.5)
    assert run.power_W.tolist() == [120.0] * len(run.time_s)


def test_hparams_and_run_attributes_are_attributes(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 1.0}, duration_s=1.0, attributes={"precision": "bf16-mixed"})
    (folder / "hparams.yaml").write_text("batch_size: 128\nlr: 0.001\nlayers: [1, 2]\n")
    run = load_run(folder)
    assert attribute(run, "precision") == "bf16-mixed"
    assert attribute(run, "batch_size") == 128 and attribute(run, "lr") == 0.001
    assert "layers" not in run.attributes  # only scalars


def test_plain_run_attributes_come_from_the_energy_report_and_nested_hparams(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 1.0}, duration_s=1.0)
    report = {"world_size": 2, "host": "node7", "estimated": False, "precision": "bf16-mixed", "total_J": 5.0,
              "sampling": {"interval_s": 0.05, "samples": 21},
              "epochs": [{"epoch": 0, "steps": 10}, {"epoch": 1, "steps": 6}],
              "sensors": [{"name": "gpu0", "rank": 0}, {"name": "rapl", "rank": 0}, {"name": "gpu0", "rank": 1}]}
    (folder / "energy_report.json").write_text(json.dumps(report))
    (folder / "hparams.yaml").write_text("model:\n  hidden: 64\n  act: relu\ndata:\n  batch_size: 256\nprecision: 16-mixed\n")
    run = load_run(folder)
    assert run.attributes == {"world_size": 2, "host": "node7", "estimated": False, "sampling_interval_s": 0.05,
                              "epochs": 2, "steps": 16, "sensors": "gpu0,rapl", "model.hidden": 64,
                              "model.act": "relu", "data.batch_size": 256, "precision": "16-mixed",
                              # dotted names also answer to their last part
                              "hidden": 64, "act": "relu", "batch_size": 256}
    (folder / "run_attributes.json").write_text(json.dumps({"precision": "32-true"}))
    assert load_run(folder).attributes["precision"] == "32-true"  # the explicit attributes win
    with pytest.raises(RunError, match=r"no attribute 'lr' \(it has: act, batch_size, data.batch_size, epochs, "
                                       r"estimated, hidden, host, model.act, model.hidden, precision, "
                                       r"sampling_interval_s, sensors, steps, world_size\)"):
        attribute(run, "lr")
    (folder / "energy_report.json").write_text("{oops")
    with pytest.raises(RunError, match="energy_report.json is not valid JSON"):
        load_run(folder)


# ---------------------------------------------------------------- quadratic fit
def test_quadratic_fit_recovers_known_coefficients():
    x = np.array([100.0, 150.0, 200.0, 250.0, 300.0])
    fit = quadratic_fit(x, 2e-3 * x**2 - 0.9 * x + 150.0)
    assert fit.a == pytest.approx(2e-3, rel=1e-9)
    assert fit.b == pytest.approx(-0.9, rel=1e-9)
    assert fit.c == pytest.approx(150.0, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.vertex_x == pytest.approx(225.0, rel=1e-9)
    assert fit(200.0) == pytest.approx(2e-3 * 200**2 - 0.9 * 200 + 150.0)


def test_r2_of_a_fit_that_explains_nothing_is_zero():
    # at each x the two y values average to 1: the best quadratic is y = 1; SS_res = 2, SS_tot = 2
    fit = quadratic_fit([-1, -1, 0, 0, 1, 1], [1, 1, 0, 2, 1, 1])
    assert (fit.a, fit.b, fit.c) == pytest.approx((0.0, 0.0, 1.0), abs=1e-12)
    assert fit.r2 == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("x, y, match", [
    ([1, 2, 2], [1, 2, 3], "3 distinct x"),
    ([1, 2, 3], [1, math.nan, 3], "finite"),
    ([1, 2, 3], [1, 2], "same length"),
])
def test_quadratic_fit_rejects_unusable_points(x, y, match):
    with pytest.raises(ValueError, match=match):
        quadratic_fit(x, y)


def test_other_ranks_traces_are_added_on_rank_zeros_time_axis(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 100.0}, duration_s=1.0)
    other = write_run(tmp_path / "rank1", {"gpu": 50.0}, duration_s=1.0)
    (folder / "energy_trace_rank1.csv").write_text((other / "energy_trace.csv").read_text())
    run = load_run(folder)
    assert run.sensor_totals_J() == pytest.approx({"gpu": 100.0, "gpu@rank1": 50.0})
    assert run.total_J == pytest.approx(150.0)
    np.testing.assert_allclose(run.power_W, 150.0)


def test_a_trace_with_a_column_named_twice_is_read_by_its_first_copy(tmp_path):
    # traces of a simulated GPU before the writer's fix named `sim_gpu:power_W` twice
    folder = tmp_path / "run"
    folder.mkdir()
    rows = ["time_s,unix_time_s,sim_gpu:energy_J,sim_gpu:power_W,sim_gpu:power_W,sim_gpu:power_limit_W"]
    rows += [f"{t:.6f},{1.7e9 + t:.6f},{200.0 * t:.6f},200,199,250" for t in (0.0, 0.5, 1.0)]
    (folder / "energy_trace.csv").write_text("\n".join(rows) + "\n")
    run = load_run(folder)
    assert run.power_W.tolist() == [200.0, 200.0, 200.0] and run.total_J == pytest.approx(200.0)


def test_runs_in_version_folders_are_named_with_their_parent(tmp_path):
    run = load_run(write_run(tmp_path / "fit_a" / "version_3", {"gpu": 1.0}, duration_s=1.0))
    assert run.name == "fit_a/version_3"


# ---------------------------------------------------------------- provenance of the joules
def test_provenance_combines_and_reads_older_files():
    from lightning_energy.provenance import combine, of_entry, of_report, tagged

    assert combine(["estimated", "measured", "estimated"]) == "measured+estimated"
    assert combine(["simulated", "measured+estimated"]) == "measured+estimated+simulated"
    assert of_entry({"estimated": True}) == "estimated" and of_entry({"estimated": False}) == "measured"
    assert of_report({"sensors": [{"provenance": "simulated"}, {"estimated": True}]}) == "estimated+simulated"
    assert tagged("5.0 J", "measured") == "5.0 J (measured)" and tagged("5.0 J", "simulated") == "5.0 J (SIMULATED)"
    with pytest.raises(ValueError, match="unknown provenance"):
        combine(["guessed"])


def test_simulated_sensors_are_labelled_simulated_and_the_tensorboard_figure_says_so():
    from lightning_energy import CpuEstimateSensor, SimulatedSensor
    from lightning_energy.simulate.gpu_sim import SimulatedGpuSensor
    from lightning_energy.outputs.tensorboard import power_figure

    assert SimulatedSensor("gpu", 100.0).describe()["provenance"] == "simulated"
    assert SimulatedGpuSensor(0).provenance == "simulated"
    assert SimulatedSensor("cpu", 10.0, estimated=True).provenance == "estimated"  # a stand-in for an estimate
    assert CpuEstimateSensor(tdp_w=10.0, load=lambda: 0.5).provenance == "estimated"
    points = [(i * 0.01, {"gpu": 100.0, "cpu": 5.0}) for i in range(20)]
    (ax,) = power_figure(points, 3, {"gpu": "simulated", "cpu": "estimated"}).axes
    assert ax.get_title() == "epoch 3 power, ESTIMATED+SIMULATED"
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["cpu (ESTIMATED)", "gpu (SIMULATED)"]


def test_compare_and_fit_say_where_the_joules_come_from(tmp_path, capsys):
    from lightning_energy.cli.main import main

    runs = []
    for i, (batch, watts) in enumerate([(16, 100.0), (32, 80.0), (64, 70.0)]):
        folder = write_run(tmp_path / f"run{i}", {"gpu": watts}, duration_s=4.0, dt_s=0.5,
                           attributes={"batch_size": batch})
        (folder / "energy_report.json").write_text(json.dumps(
            {"sensors": [{"name": "gpu", "estimated": False, "provenance": "simulated"}]}))
        runs.append(str(folder))
    assert main(["compare", *runs, "--out", str(tmp_path / "cmp"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert out.count("SIMULATED") == 6  # three runs, each its own group (no --by)
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["provenance"] == "simulated"
    assert main(["fit", *runs, "--by", "batch_size", "--out", str(tmp_path / "fit")]) == 0
    assert capsys.readouterr().out.count("SIMULATED") == 3
    assert json.loads((tmp_path / "fit" / "fit.json").read_text())["provenance"] == "simulated"
    assert main(["report", runs[0], "--out", str(tmp_path / "report")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "run run0: 4.00 s, 400.00 J (SIMULATED), mean 100.00 W, EDP 1600 J*s"
