"""Plots and tables that tell the truth (issue 32, items 7-10): the data behind each figure and table.

Every test checks what a figure is drawn from (the points, curves, labels, counts), never pixels; time is a
fake clock the test advances.
"""

from __future__ import annotations

import pytest

from fakes_nvml import FakeClock
from test_output_faults import WAIT_S, FakeTrainer, FakeWriter

import lightning_energy.outputs.tensorboard as tensorboard_module
from lightning_energy.outputs.tensorboard import TensorBoardExtras

EPOCH_S = 0.5  # fake seconds per epoch
DRAW_S = 0.1  # fake seconds one power figure takes to draw (about what it takes on one core)


def epoch_points(start_s: float, watts: float = 100.0, n: int = 20) -> list:
    """An epoch's power points: ``n`` samples 25 ms apart at ``watts`` on one device and 20 W on the host."""
    return [(start_s + 0.025 * i, {"device": watts, "host": 20.0}) for i in range(n)]


def run_epochs(monkeypatch, watts_per_epoch: list[float], **kwargs) -> tuple[TensorBoardExtras, FakeWriter]:
    """Feed TensorBoardExtras epochs of EPOCH_S fake seconds; drawing a figure advances the clock by DRAW_S."""
    clock = FakeClock()
    real_power_figure = tensorboard_module.power_figure

    def slow_power_figure(*args):
        clock.advance(DRAW_S)
        return real_power_figure(*args)

    monkeypatch.setattr(tensorboard_module, "power_figure", slow_power_figure)
    writer = FakeWriter()
    extras = TensorBoardExtras([writer], **kwargs)
    extras.clock = clock  # an attribute, so that the same test runs against code without the argument
    for epoch, watts in enumerate(watts_per_epoch):
        clock.advance(EPOCH_S)
        extras.after_epoch(FakeTrainer(), epoch, epoch_points(clock(), watts))
        assert extras.worker.drain(WAIT_S)  # the figure (if any) drawn before the next epoch: deterministic
    extras.close(WAIT_S)
    return extras, writer


def drawn_epochs(writer: FakeWriter) -> list[int]:
    return [step for tag, step in writer.images if tag == tensorboard_module.FIGURE_TAG]


# ---------------------------------------------------------------- item 7: power figures of short runs
def test_a_three_epoch_run_gets_a_power_figure_per_epoch(monkeypatch):
    extras, writer = run_epochs(monkeypatch, [100.0, 100.0, 100.0])
    assert drawn_epochs(writer) == [0, 1, 2]
    assert extras.figure_summary()["drawn"] == 3 and extras.figure_summary()["epochs"] == 3


def test_a_long_run_of_short_epochs_gets_its_first_last_and_most_expensive_figures(monkeypatch):
    watts = [100.0] * 25
    watts[10] = 300.0  # the most expensive epoch
    extras, writer = run_epochs(monkeypatch, watts)
    drawn = drawn_epochs(writer)
    assert {0, 1, 2, 10, 24} <= set(drawn)
    assert len(drawn) < 25  # the others only within the 1 % budget
    summary = extras.figure_summary()
    assert summary == {"drawn": len(drawn), "epochs": 25, "rule": summary["rule"]}
    assert "most expensive" in summary["rule"] and "1%" in summary["rule"]
    assert any(f"{len(drawn)} drawn" in note for note in extras.notes)  # the skipped ones are a note


def test_the_figure_budget_is_an_argument(monkeypatch):
    _, every = run_epochs(monkeypatch, [100.0] * 12, figure_budget=None)
    assert drawn_epochs(every) == list(range(12))
    _, least = run_epochs(monkeypatch, [100.0] * 12, figure_budget=0.0)
    assert drawn_epochs(least) == [0, 1, 2, 11]  # the first three and the last only
    with pytest.raises(ValueError, match="figure_budget"):
        TensorBoardExtras([], figure_budget=5)


def test_the_console_report_says_how_many_power_figures_were_drawn():
    from lightning_energy.outputs.report import build_report, format_report

    sensor = {"name": "gpu0", "rank": 0, "scope": "device", "energy_J": 10.0, "mean_power_W": 5.0,
              "source": "NVML", "estimated": False}
    summary = {"sensors": [sensor], "duration_s": 2.0, "train_J": 8.0, "validation_J": 1.0}
    figures = {"drawn": 5, "epochs": 25, "rule": "the first 3, the last and each most expensive epoch so far"}
    text = format_report(build_report([summary], [], {"power_figures": figures}))
    assert "power figures in TensorBoard: 5 of 25 epoch(s) (the first 3, the last" in text
    assert "power figures" not in format_report(build_report([dict(summary, sensors=[dict(sensor)])], [], {}))


# ---------------------------------------------------------------- item 9: compare's curves and legends
def test_the_mean_energy_curve_ends_at_the_tables_mean_and_n_of_t_is_drawn(tmp_path):
    import numpy as np
    from workbench_helpers import write_run

    from lightning_energy.analysis.compare import compare_runs
    from lightning_energy.analysis.plots import band_plot
    from lightning_energy.analysis.runs import load_run

    runs = [load_run(write_run(tmp_path / name, {"gpu": watts}, duration_s=seconds, attributes={"batch_size": 128}))
            for name, watts, seconds in (("short", 200.0, 1.1), ("long", 150.0, 2.3))]
    group = compare_runs(runs, by="batch_size")["groups"]["128"]
    assert group["energy_J_mean"] == pytest.approx((220.0 + 345.0) / 2)
    assert group["curve_energy_J_mean"][-1] == pytest.approx(group["energy_J_mean"])  # not the longest's 345 J
    assert group["curve_energy_J_max"][-1] == pytest.approx(345.0)
    assert group["time_s"][-1] == pytest.approx(2.3)  # the fit's end, between two 4-Hz grid points
    assert group["runs_at_time"][0] == 2 and group["runs_at_time"][-1] == 1
    t = np.array(group["time_s"])
    assert np.all(np.diff(group["curve_energy_J_mean"]) >= 0)  # a mean of cumulative curves never falls
    np.testing.assert_allclose(np.array(group["curve_energy_J_mean"])[t > 1.25], (220.0 + 150.0 * t[t > 1.25]) / 2)

    figure = band_plot(compare_runs(runs, by="batch_size")["groups"], "energy_J", "J", "energy", "measured",
                       "batch_size")
    main_axes, runs_axes = figure.axes
    assert [text.get_text() for text in main_axes.get_legend().get_texts()] == ["batch_size=128 (n=2)"]
    (n_of_t,) = runs_axes.get_lines()
    assert list(n_of_t.get_ydata()) == group["runs_at_time"]


def test_runs_with_the_same_folder_name_are_told_apart_by_their_parents_not_their_absolute_paths(tmp_path):
    from workbench_helpers import write_run

    from lightning_energy.analysis.runs import load_runs

    dirs = [write_run(tmp_path / lab / "lightning_logs" / "version_0", {"gpu": 100.0}, duration_s=1.0)
            for lab in ("a", "b")]
    assert [run.name for run in load_runs(dirs)] == ["a/lightning_logs/version_0", "b/lightning_logs/version_0"]


# ---------------------------------------------------------------- item 8: R² only where spare points test it
def power_limit_runs(tmp_path, limits, precision: str = "32") -> list:
    from workbench_helpers import write_run

    return [write_run(tmp_path / f"p{precision}_{limit}", {"gpu": float(limit)},
                      duration_s=1e-5 * limit**2 - 0.004 * limit + 1.5 + 0.01 * (i % 2), dt_s=0.025,
                      attributes={"power_limit_W": limit, "precision": precision})
            for i, limit in enumerate(limits)]


def test_a_quadratic_through_three_runs_shows_no_r2(tmp_path, capsys):
    import json

    from lightning_energy.cli.main import main

    runs = power_limit_runs(tmp_path, [100, 150, 200])
    assert main(["fit", *map(str, runs), "--by", "power_limit_W", "--out", str(tmp_path / "fit")]) == 0
    out = capsys.readouterr().out
    assert "exact fit through 3 points, no spare point to test it" in out
    assert "R² =" not in out and "1.000" not in out
    fits = json.loads((tmp_path / "fit" / "fit.json").read_text())["fits"]
    assert fits["energy"]["r2"] is None and fits["energy"]["spare_points"] == 0


def test_r2_is_shown_with_spare_runs_and_per_group(tmp_path, capsys):
    import json

    from lightning_energy.analysis.plots import fit_plot
    from lightning_energy.analysis.runs import load_runs
    from lightning_energy.cli.commands.fit import fit_runs
    from lightning_energy.cli.main import main

    runs = power_limit_runs(tmp_path, [100, 150, 200, 250, 300], "32") + power_limit_runs(tmp_path, [100, 200, 300], "16")
    assert main(["fit", *map(str, runs), "--by", "power_limit_W,precision", "--out", str(tmp_path / "fit")]) == 0
    out = capsys.readouterr().out
    document = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert set(document["groups"]) == {"32", "16"}
    assert document["groups"]["32"]["time"]["spare_points"] == 2 and document["groups"]["32"]["time"]["r2"] > 0.9
    assert document["groups"]["16"]["time"]["r2"] is None
    assert "(5 points, 2 spare)" in out and "exact fit through 3 points" in out

    result = fit_runs(load_runs(runs), "power_limit_W", "precision")
    legend = [t.get_text() for t in fit_plot("power_limit_W", result["groups"], "simulated",
                                             "precision").axes[1].get_legend().get_texts()]
    assert legend[0] == "precision=32: runs" and legend[1].startswith("precision=32: quadratic, R² = ")
    assert legend[3] == "precision=16: quadratic, exact fit through 3 points, no spare point to test it"


# ---------------------------------------------------------------- item 10: the report's plots, catalog show
def test_the_power_plot_has_no_false_zero_watt_point_at_fit_start(tmp_path):
    from workbench_helpers import write_run

    from lightning_energy.analysis import plots
    from lightning_energy.analysis.runs import load_run

    folder = write_run(tmp_path / "run", {"gpu": 100.0}, duration_s=1.0)
    trace = folder / "energy_trace.csv"
    lines = trace.read_text().splitlines()
    first = lines[1].split(",")
    first[-1] = "0"  # as the sampler writes a counter's first read: no interval before it, 0 W
    lines[1] = ",".join(first)
    trace.write_text("\n".join(lines) + "\n")
    run = load_run(folder)
    assert run.power_W[0] == pytest.approx(100.0)
    (power_line,) = [line for line in plots.power_plot(run).axes[0].get_lines() if len(line.get_xdata()) > 2]
    assert min(power_line.get_ydata()) == pytest.approx(100.0)
    assert run.total_J == pytest.approx(100.0)  # the energy is the counter's: untouched


def test_the_cumulative_energy_plot_draws_one_sensor_once_and_several_beside_the_total(tmp_path):
    from workbench_helpers import write_run

    from lightning_energy.analysis import plots
    from lightning_energy.analysis.runs import load_run

    one = plots.cumulative_energy_plot(load_run(write_run(tmp_path / "one", {"gpu": 100.0}, duration_s=1.0)))
    assert [line.get_label() for line in one.axes[0].get_lines()] == ["total (the only sensor: gpu)"]
    two = plots.cumulative_energy_plot(load_run(write_run(tmp_path / "two", {"gpu": 100.0, "cpu": 20.0},
                                                          duration_s=1.0)))
    assert [line.get_label() for line in two.axes[0].get_lines()] == ["total", "gpu", "cpu"]


def test_the_epoch_boxplots_say_what_each_panel_shows(tmp_path):
    from workbench_helpers import write_run

    from lightning_energy.analysis import plots
    from lightning_energy.analysis.runs import load_run

    run = load_run(write_run(tmp_path / "run", {"gpu": 100.0}, duration_s=2.0, epochs=[(0.0, 1.0), (1.0, 2.0)]))
    figure = plots.epoch_boxplots_plot(run, [e.as_dict() for e in run.epochs()])
    assert [ax.get_title() for ax in figure.axes] == ["energy per epoch", "time per epoch"]
    assert figure._suptitle.get_text() == "run: 2 epoch(s), energy provenance unknown"


def test_catalog_show_rounds_its_numbers():
    from lightning_energy.cli.commands.catalog import COMPARED, format_fit

    fit = {key: None for key in COMPARED} | {
        "id": 1, "model": "m.Net", "duration_s": 12.3456789012, "energy_J": 1234.56789012, "gCO2e": 0.000123456789,
        "intensity_label": "CHE", "run_dir": "runs/x", "sensors": [], "metrics": {}, "config": {}}
    text = format_fit(fit)
    assert "duration_s           12.35" in text and "energy_J             1234.57" in text
    assert "gCO2e                0.0001235" in text and "12.3456789" not in text


def test_the_group_axis_is_the_run_that_ends_last_when_two_have_as_many_grid_points(tmp_path):
    from workbench_helpers import write_run

    from lightning_energy.analysis.compare import compare_runs
    from lightning_energy.analysis.runs import load_run

    runs = [load_run(write_run(tmp_path / name, {"gpu": 100.0}, duration_s=seconds, attributes={"batch_size": 256}))
            for name, seconds in (("a", 0.8), ("b", 0.9))]  # both: 0, 0.25, 0.5, 0.75 and their end
    group = compare_runs(runs, by="batch_size")["groups"]["256"]
    assert group["time_s"][-1] == pytest.approx(0.9)
    assert group["curve_energy_J_mean"][-1] == pytest.approx(85.0)
    assert group["runs_at_time"][-1] == 1  # the 0.8-s run's end power lies off this axis: not drawn at 0.9 s


# ---------------------------------------------------------------- item 10: baler-lit evaluate's figures
def evaluate_figures(trade=None) -> dict:
    """``baler_lit.evaluate._figures`` for 200 rows of 3 columns: a spread one, a spike (95 % zeros) and one
    whose restored values miss a few originals by far (response outliers, residuals beyond the whiskers)."""
    import numpy as np

    from baler_lit.evaluate import _figures
    from baler_lit.table import Table

    rng = np.random.default_rng(0)
    spread = rng.normal(10.0, 2.0, 200)
    spike = np.where(np.arange(200) < 190, 0.0, rng.uniform(1.0, 5.0, 200))
    wide = rng.uniform(1.0, 2.0, 200)
    original = np.column_stack([spread, spike, wide])
    restored = original * (1 + rng.normal(0.0, 0.01, original.shape))
    restored[:4, 2] *= 50.0  # four values restored 50 times too large
    return _figures(Table(original, ["spread", "spike", "wide"]), Table(restored, ["spread", "spike", "wide"]), trade)


def test_evaluate_histograms_draw_a_spike_on_a_log_axis_and_say_so():
    figures = evaluate_figures()
    try:
        spread_ax, spike_ax, _ = figures["histograms"].axes[:3]
        assert spike_ax.get_yscale() == "log" and "log y" in spike_ax.get_title()
        assert "95% in [" in spike_ax.get_title()  # the share of the fullest bin, and where it lies
        assert spread_ax.get_yscale() == "linear" and spread_ax.get_title() == "spread"
    finally:
        close_figures(figures)


def test_evaluate_response_counts_its_overflow_instead_of_piling_it_into_the_edge_bins():
    import numpy as np

    from baler_lit.evaluate import response_histogram

    response = np.concatenate([np.linspace(-0.1, 0.1, 296), [49.0, 49.0]])  # 2 of 298 beyond the 99th percentile
    hist = response_histogram(response)
    assert hist["above"] == 2 and hist["below"] == 0
    assert hist["counts"].sum() == 296 and hist["counts"][-1] < 10  # the edge bin holds its own values only
    figures = evaluate_figures()
    try:
        wide_ax = figures["response"].axes[2]
        assert "beyond ±" in wide_ax.get_title() and "not shown" in wide_ax.get_title()
        assert wide_ax.get_yscale() == "log" and wide_ax.yaxis.get_ticklabels()  # the counts have ticks
    finally:
        close_figures(figures)


def test_evaluate_residual_boxplot_says_how_many_values_it_does_not_draw():
    import numpy as np

    from baler_lit.evaluate import beyond_whiskers

    values = np.column_stack([np.r_[np.zeros(96), 1.0, 1.0, -1.0, 0.5] + np.linspace(0, 0.01, 100), np.zeros(100)])
    assert beyond_whiskers(values).tolist() == [4, 0]
    figures = evaluate_figures()
    try:
        ax = figures["residual_boxplot"].axes[0]
        assert "beyond the" in ax.get_title() and "not drawn" in ax.get_title()
        assert any("beyond)" in label.get_text() for label in ax.get_yticklabels())
    finally:
        close_figures(figures)


def test_evaluate_tradeoff_has_plain_ticks_and_one_label_per_point():
    trade = [{"latent_dtype": name, "ratio": ratio, "mean_norm_rms": error, "stored": False}
             for name, ratio, error in (("float64", 0.327, 0.19483344), ("float32", 0.415, 0.19483343),
                                        ("float16", 0.479, 0.19483341), ("bfloat16", 0.479, 0.19482412))]
    figures = evaluate_figures(trade)
    try:
        figure = figures["tradeoff"]
        figure.canvas.draw()
        ax = figure.axes[0]
        assert ax.yaxis.get_offset_text().get_text() == ""
        assert all(len(label.get_text()) <= 6 for label in ax.get_yticklabels())
        assert sorted(text.get_text() for text in ax.texts) == ["float16, bfloat16", "float32", "float64"]
    finally:
        close_figures(figures)


def close_figures(figures: dict) -> None:
    import matplotlib.pyplot as plt

    for figure in figures.values():
        plt.close(figure)
