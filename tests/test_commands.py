"""The workbench commands: report, compare, fit, sweep; their errors on missing or malformed input."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.catalog import CATALOG_FILE, Catalog
from lightning_energy.cli.main import main
from lightning_energy.simulate.gpu_sim import SimulatedGPU
from lightning_energy.sweep.config import SweepConfigError, load_config, parse_config
from lightning_energy.sweep.runner import GpuPowerLimits, SweepError, run_sweep, sweep_order
from power_limit_helpers import install_fake_time
from workbench_helpers import write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------- report
def test_report_of_a_hand_made_run(tmp_path, capsys):
    run = write_run(tmp_path / "run", {"gpu": 100.0, "cpu": 20.0}, duration_s=10.0, dt_s=0.5,
                    epochs=[(1.0, 4.0, 3.0, 4.0), (4.5, 8.0)])
    code, out, err = run_cli(capsys, "report", run, "--out", tmp_path / "plots")
    assert code == 0, err
    assert "10.00 s, 1200.00 J (provenance unknown), mean 120.00 W" in out
    assert "gpu" in out and "1000.00" in out and "83.33" in out
    report = json.loads((tmp_path / "plots" / "trace_report.json").read_text())
    assert report["total_J"] == pytest.approx(1200.0) and report["edp_Js"] == pytest.approx(12000.0)
    assert [e["energy_J"] for e in report["epochs"]] == pytest.approx([360.0, 420.0])
    assert report["epochs"][0]["validation_J"] == pytest.approx(120.0)
    for name in ("power.png", "cumulative_energy.png", "epoch_boxplots.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(PNG_MAGIC), name


def test_power_plot_marks_every_epoch_start_and_end(tmp_path):
    from lightning_energy.analysis.plots import power_plot
    from lightning_energy.analysis.runs import load_run

    run = load_run(write_run(tmp_path / "run", {"gpu": 100.0}, duration_s=10.0, dt_s=0.5,
                             epochs=[(1.0, 4.0, 3.0, 4.0), (4.5, 8.0), (8.25, 9.5)]))
    (ax,) = power_plot(run).axes
    vertical = [line for line in ax.get_lines() if len(set(line.get_xdata())) == 1]
    starts = sorted(line.get_xdata()[0] for line in vertical if line.get_color() == "grey")
    ends = sorted(line.get_xdata()[0] for line in vertical if line.get_color() == "black")
    assert starts == pytest.approx([1.0, 4.5, 8.25]) and ends == pytest.approx([4.0, 8.0, 9.5])
    (curve,) = [line for line in ax.get_lines() if line not in vertical]
    assert curve.get_ydata().tolist() == [100.0] * 21  # the power trace itself
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["power (all sensors)", "epoch start", "epoch end"]


def real_fit(root: Path, batch_size: int, max_epochs: int = 2) -> Path:
    """A real short fit of the tiny autoencoder with EnergyCallback on 120 W device + 30 W host sensors."""
    from lightning_energy.simulate.example_model import TinyAutoencoder

    callback = EnergyCallback(sensors=[SimulatedSensor("device", 120.0), SimulatedSensor("host", 30.0, scope="host")],
                              verbose=False, interval_s=0.005)
    trainer = L.Trainer(callbacks=[callback], **trainer_kwargs(root, max_epochs=max_epochs))
    trainer.fit(TinyAutoencoder(n_train=256, n_val=64, batch_size=batch_size))
    assert callback.report["total_J"] == pytest.approx(150.0 * callback.report["duration_s"], rel=1e-9)
    return Path(trainer.log_dir)


def test_compare_and_report_of_real_energy_callback_runs(tmp_path, capsys):
    runs = [real_fit(tmp_path / "a", 32), real_fit(tmp_path / "b", 64)]
    code, out, err = run_cli(capsys, "compare", *runs, "--by", "batch_size", "--out", tmp_path / "cmp")
    assert code == 0, err
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["group"] for r in result["runs"]] == ["32", "64"]
    for row, run_dir in zip(result["runs"], runs):
        events = {line.split(",")[2]: float(line.split(",")[0])
                  for line in (run_dir / "energy_events.csv").read_text().splitlines()[1:]}
        fit_s = events["fit_end"] - events["fit_start"]
        assert row["duration_s"] == pytest.approx(fit_s, abs=1e-9)
        # constant 150 W over the whole fit; sample and event times are written to 1 us
        assert row["energy_J"] == pytest.approx(150.0 * fit_s, abs=150.0 * 2e-6)
        assert row["edp_Js"] == pytest.approx(150.0 * fit_s**2, abs=150.0 * 2e-6 * fit_s)
        assert row["extrapolated_s"] < 2 * 0.005 + 1e-6  # at most two sampling intervals continued
    for key, run_dir, row in zip(("32", "64"), runs, result["runs"]):
        group = result["groups"][key]
        t = np.array(group["time_s"])
        # power derived from energy over each grid point's interval (h = 1/4 s around it, cut to the fit: the
        # last one can be much shorter), whose edges are written to 1 us: off by up to 150 W x 2 us / length
        from lightning_energy.analysis.resample import DEFAULT_RATE_HZ

        half = 0.5 / DEFAULT_RATE_HZ
        length = np.minimum(t + half, row["duration_s"]) - np.maximum(t - half, 0.0)
        assert np.all(np.abs(np.array(group["curve_power_W_mean"]) - 150.0) <= 150.0 * 2e-6 / length + 1e-9)
        np.testing.assert_allclose(group["curve_energy_J_mean"], 150.0 * t, rtol=1e-5, atol=1e-4)  # 1 us times
    for name in ("compare_power.png", "compare_energy.png"):
        assert (tmp_path / "cmp" / name).read_bytes().startswith(PNG_MAGIC)

    code, out, err = run_cli(capsys, "report", runs[0], "--out", tmp_path / "report")
    assert code == 0, err
    report = json.loads((tmp_path / "report" / "trace_report.json").read_text())
    assert report["total_J"] == pytest.approx(150.0 * report["duration_s"], abs=150.0 * 2e-6)
    # the trace's times are written to 1 us: a mean power over its span is off by up to 2 us / span
    # (1.04e-5 was seen on a short fit: fits got shorter once the epoch end stopped waiting for samples)
    quantum = max(1e-5, 2e-6 / report["duration_s"])
    assert {s["name"]: s["mean_power_W"] for s in report["sensors"]} == pytest.approx({"device": 120.0, "host": 30.0},
                                                                                    rel=quantum)
    assert [e["epoch"] for e in report["epochs"]] == [0, 1]
    assert report["attributes"]["batch_size"] == 32 and report["attributes"]["steps"] == 16  # 256 / 32 x 2 epochs


def test_plain_runs_have_attributes_from_hparams_and_the_energy_report(tmp_path, capsys):
    runs = [real_fit(tmp_path / str(size), size, max_epochs=1) for size in (32, 64, 128)]
    code, out, err = run_cli(capsys, "fit", *runs, "--by", "batch_size", "--out", tmp_path / "fit", "--no-plots")
    assert code == 0, err
    rows = json.loads((tmp_path / "fit" / "fit.json").read_text())["runs"]
    assert [r["batch_size"] for r in rows] == [32, 64, 128]
    code, out, err = run_cli(capsys, "compare", *runs, "--by", "steps", "--out", tmp_path / "cmp", "--no-plots")
    assert code == 0, err
    groups = json.loads((tmp_path / "cmp" / "compare.json").read_text())["groups"]
    assert sorted(groups, key=int) == ["2", "4", "8"]  # 256 samples in batches of 128, 64, 32
    code, out, err = run_cli(capsys, "compare", *runs, "--by", "power_limit_W", "--out", tmp_path / "o")
    assert code == 2 and "have no attribute 'power_limit_W'" in err
    available = err.split("attributes every run has: ")[1].split(";")[0].split(", ")
    assert {"batch_size", "lr", "n_train", "world_size", "epochs", "steps", "host", "estimated",
            "sampling_interval_s", "sensors"} <= set(available)
    assert not (tmp_path / "o").exists()


def test_report_of_a_real_fit_agrees_with_the_energy_callback(tmp_path, capsys):
    callback = EnergyCallback(sensors=[SimulatedSensor("device", 120.0), SimulatedSensor("host", 30.0, scope="host")],
                              verbose=False, interval_s=0.005)
    trainer = L.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path, max_epochs=2))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    code, out, err = run_cli(capsys, "report", trainer.log_dir)
    assert code == 0, err
    report = json.loads((Path(trainer.log_dir) / "energy_plots" / "trace_report.json").read_text())
    assert report["total_J"] == pytest.approx(callback.report["total_J"], rel=1e-3)
    assert report["duration_s"] == pytest.approx(callback.report["duration_s"], rel=1e-3)
    assert [e["epoch"] for e in report["epochs"]] == [0, 1]
    for ours, theirs in zip(report["epochs"], callback.report["epochs"]):  # epoch windows: training + validation
        assert ours["energy_J"] == pytest.approx(theirs["train_J"] + theirs["validation_J"], rel=1e-3)
        assert ours["mean_power_W"] == pytest.approx(150.0, rel=1e-4)  # event times have 1 us resolution


# ---------------------------------------------------------------- compare and fit
def test_compare_groups_by_attribute_and_writes_plots(tmp_path, capsys):
    runs = [write_run(tmp_path / name, {"gpu": watts}, duration_s=1.0, attributes={"precision": precision})
            for name, watts, precision in (("a", 100.0, "32"), ("b", 140.0, "32"), ("c", 60.0, "16"))]
    code, out, err = run_cli(capsys, "compare", *runs, "--by", "precision", "--out", tmp_path / "cmp")
    assert code == 0, err
    assert "precision" in out and "120.00" in out  # mean energy of the 32-bit pair
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["groups"]["32"]["runs"] == 2 and result["groups"]["16"]["energy_J_mean"] == pytest.approx(60.0)
    assert [r["edp_Js"] for r in result["runs"]] == pytest.approx([100.0, 140.0, 60.0])
    for name in ("compare_power.png", "compare_energy.png"):
        assert (tmp_path / "cmp" / name).read_bytes().startswith(PNG_MAGIC)


def test_fit_recovers_a_quadratic_time_curve(tmp_path, capsys):
    limits = [100, 150, 200, 250]
    runs = []
    for limit in limits:
        seconds = 1e-5 * limit**2 - 0.004 * limit + 1.5  # 1.2, 1.125, 1.1, 1.125 s
        runs.append(write_run(tmp_path / f"pl{limit}", {"gpu": float(limit)}, duration_s=seconds, dt_s=0.025,
                              attributes={"power_limit_W": limit}))
    code, out, err = run_cli(capsys, "fit", *runs, "--by", "power_limit_W", "--out", tmp_path / "fit")
    assert code == 0, err
    fits = json.loads((tmp_path / "fit" / "fit.json").read_text())["fits"]
    assert fits["time"]["a"] == pytest.approx(1e-5, rel=1e-6)
    assert fits["time"]["b"] == pytest.approx(-0.004, rel=1e-6)
    assert fits["time"]["c"] == pytest.approx(1.5, rel=1e-6)
    assert fits["time"]["r2"] == pytest.approx(1.0, abs=1e-9)
    assert fits["time"]["vertex_x"] == pytest.approx(200.0, rel=1e-6)
    assert 0.9 < fits["energy"]["r2"] <= 1.0  # energy = limit x time is cubic: close, not exact
    assert (tmp_path / "fit" / "fit.png").read_bytes().startswith(PNG_MAGIC)
    assert "R²" in out


# ---------------------------------------------------------------- errors on bad run dirs
def malformed_runs(tmp_path) -> dict[str, tuple[Path, str]]:
    good = write_run(tmp_path / "good", {"gpu": 10.0}, duration_s=1.0, attributes={"precision": "32"})
    cases = {"missing": (tmp_path / "nope", "does not exist")}
    empty = tmp_path / "empty"
    empty.mkdir()
    cases["no trace"] = (empty, "no energy_trace.csv")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "energy_trace.csv").write_text("time_s,unix_time_s,gpu:energy_J\n0.0,1.0,abc\n")
    cases["garbage"] = (garbage, "not a lightning-energy trace")
    no_energy = tmp_path / "no_energy"
    no_energy.mkdir()
    (no_energy / "energy_trace.csv").write_text("time_s,unix_time_s,gpu:power_W\n0,1,5\n1,2,5\n")
    cases["no energy column"] = (no_energy, "no <sensor>:energy_J column")
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "energy_trace.csv").write_text("")
    cases["empty trace"] = (blank, "is empty")
    one = tmp_path / "one_row"
    one.mkdir()
    (one / "energy_trace.csv").write_text("time_s,unix_time_s,gpu:energy_J\n0,1,0\n")
    cases["one sample"] = (one, "at least 2 samples")
    bad_events = write_run(tmp_path / "bad_events", {"gpu": 1.0}, duration_s=1.0)
    (bad_events / "energy_events.csv").write_text("when,what\n1,2\n")
    cases["bad events"] = (bad_events, "not a lightning-energy events file")
    bad_attributes = write_run(tmp_path / "bad_attributes", {"gpu": 1.0}, duration_s=1.0)
    (bad_attributes / "run_attributes.json").write_text("{oops")
    cases["bad attributes"] = (bad_attributes, "not valid JSON")
    return good, cases


@pytest.mark.parametrize("command", ["report", "compare", "fit"])
def test_missing_or_malformed_run_dirs_exit_2_with_one_line(tmp_path, capsys, command):
    good, cases = malformed_runs(tmp_path)
    out_dir = tmp_path / "out"
    for label, (path, message) in cases.items():
        argv = [command, path, "--out", out_dir] if command == "report" else [command, good, path, "--out", out_dir]
        if command == "fit":
            argv += ["--by", "precision"]
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, label
        assert message in err, (label, err)
        assert err.count("\n") == 1 and err.startswith(f"lightning-energy {command}: error:"), err
    assert not out_dir.exists()  # nothing half-written


def test_attribute_errors_of_compare_and_fit(tmp_path, capsys):
    runs = [write_run(tmp_path / n, {"gpu": w}, duration_s=1.0, attributes={"precision": p, "bs": b})
            for n, w, p, b in (("a", 10.0, "32", 64), ("b", 20.0, "16", 128))]
    code, _, err = run_cli(capsys, "compare", *runs, "--by", "power_limit_W", "--out", tmp_path / "o")
    assert code == 2 and "no attribute 'power_limit_W'" in err
    code, _, err = run_cli(capsys, "fit", *runs, "--by", "precision", "--out", tmp_path / "o")
    assert code == 2 and "not a finite number" in err  # precision '32' is a string
    code, _, err = run_cli(capsys, "fit", *runs, "--by", "bs", "--out", tmp_path / "o")
    assert code == 2 and "3 distinct x values" in err
    code, _, err = run_cli(capsys, "compare", *runs, "--rate-hz", "0", "--out", tmp_path / "o")
    assert code == 2 and "--rate-hz" in err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- sweep
def test_sweep_order_is_a_permutation_of_the_grid_per_repetition():
    points = [{"precision": p, "batch_size": b, "power_limit_W": None} for p in ("32-true", "bf16-mixed")
              for b in (32, 64, 128)]
    order = sweep_order(points, repetitions=4, seed=7)
    assert len(order) == 24
    blocks = [[point for rep, point in order[i * 6:(i + 1) * 6]] for i in range(4)]
    for repetition, block in enumerate(blocks):
        assert [rep for rep, _ in order[repetition * 6:(repetition + 1) * 6]] == [repetition] * 6
        assert sorted(map(str, block)) == sorted(map(str, points))  # every point exactly once
    assert len({tuple(map(str, block)) for block in blocks}) > 1  # orders differ between repetitions
    assert sweep_order(points, 4, seed=7) == order  # reproducible from the seed


def test_shipped_tiny_sweep_config_is_valid(capsys):
    config = load_config(ROOT / "configs" / "sweep_tiny.yaml")
    assert len(config.points()) == 8 and config.repetitions == 2
    assert max(len(set(values)) for values in config.grid.values()) >= 3  # `fit --by` needs 3 values on an axis
    code, out, err = run_cli(capsys, "sweep", "--config", ROOT / "configs" / "sweep_tiny.yaml", "--dry-run")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 16


BASE_CONFIG = {
    "model": {"class_path": "lightning_energy.simulate.example_model.TinyAutoencoder", "init_args": {"n_train": 128, "n_val": 32}},
    "grid": {"precision": ["32-true"], "batch_size": [32], "power_limit_W": [150, 200, 300]},
    "sensors": {"simulated": {"gpu": {"workload": "compute_bound"}, "host_W": 20}},
    "trainer": {"max_epochs": 1, "accelerator": "cpu", "devices": 1, "log_every_n_steps": 1},
}


@pytest.mark.parametrize("change, match", [
    ({"colour": "red"}, r"unknown key\(s\) \['colour'\]"),
    ({"model": {"class_path": "lightning_energy.simulate.example_model.Nope"}}, "has no class 'Nope'"),
    ({"model": {"class_path": "no_such_module.Model"}}, "cannot import 'no_such_module'"),
    ({"model": {"class_path": "tiny_lightning.TinyRegressor"}}, "takes no `batch_size`"),
    ({"model": {"class_path": "lightning_energy.simulate.example_model.TinyAutoencoder", "init_args": {"batch_size": 8}}},
     "set by the grid"),
    ({"sensors": "auto"}, "sets the power limit of real NVIDIA GPUs, but trainer.accelerator is 'cpu'"),
    ({"sensors": {"simulated": {"device_W": 100, "gpu": {}}}}, "remove device_W"),
    ({"grid": {"batch_size": [32], "power_limit_W": [100]}}, r"whole watts in \[150, 300\] W"),
    ({"grid": {"batch_size": [32], "power_limit_W": [175.5]}}, "whole watts"),
    ({"sensors": {"simulated": {"gpu": {"workload": "huge"}}}}, "workload must be one of"),
    ({"sensors": {"simulated": {"gpu": {"cores": 5}}}}, r"unknown key\(s\) \['cores'\]"),
    ({"sensors": {"simulated": {"gpu": {"step": {"speed": 2}}}}}, "StepModel fields"),
    ({"sensors": {"simulated": {"gpu": {"step": {"compute_fraction": 2.0}}}}}, "compute_fraction"),
    ({"sensors": {"simulated": {"gpu": {"default_limit_W": 400}}}}, "default_limit_W"),
    ({"sensors": {"simulated": {"host_W": 5}}, "grid": {"batch_size": [32]}}, "device_W must be a number"),
    ({"grid": {"batch_size": [0]}}, "positive integers"),
    ({"grid": {"batch_size": [32], "power_limit_W": [-5]}}, "watts > 0"),
    ({"grid": {"batch_size": [32, 32]}}, "repeats a value"),
    ({"grid": {"batch_size": [32], "gpus": [1]}}, "unknown grid axis"),
    ({"trainer": {"precision": "16-mixed"}}, "trainer.precision is set by the sweep"),
    ({"repetitions": 0}, "repetitions"),
    ({"energy": {"interval": 0.1}}, r"`energy` has argument\(s\) \['interval'\]"),
    ({"carbon": {"sensors": []}}, r"`carbon` has argument\(s\) \['sensors'\]"),
])
def test_sweep_config_errors_name_the_key(change, match):
    with pytest.raises(SweepConfigError, match=match):
        parse_config({**BASE_CONFIG, **change})


def test_sweep_command_errors(tmp_path, capsys):
    code, _, err = run_cli(capsys, "sweep", "--config", tmp_path / "missing.yaml")
    assert code == 2 and "does not exist" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    code, _, err = run_cli(capsys, "sweep", "--config", bad)
    assert code == 2 and "not valid YAML" in err


def test_sweep_runs_the_grid_and_its_runs_feed_compare_and_fit(tmp_path, capsys):
    import yaml

    config = tmp_path / "sweep_test.yaml"
    config.write_text(yaml.safe_dump({**BASE_CONFIG, "output_dir": str(tmp_path / "out"), "seed": 3,
                                      "carbon": {"intensity_g_per_kWh": 100.0}}))
    code, out, err = run_cli(capsys, "sweep", "--config", config)
    assert code == 0, err
    assert "CERN est J" in out and "SIMULATED on lightning_energy.simulate.gpu_sim's GPU" in out
    assert "energies are SIMULATED: SIMULATED sensors follow" in out and " SIMULATED " in out.splitlines()[2]
    results = json.loads((tmp_path / "out" / "sweep_results.json").read_text())
    rows = results["runs"]
    assert sorted(r["power_limit_W"] for r in rows) == [150, 200, 300]
    model = SimulatedGPU(gpu_index=-2)  # the same simulated V100, to read its model
    for row in rows:
        limit = row["power_limit_W"]
        # the host sensor draws a constant 20 W; the rest is the simulated GPU's counter
        assert row["energy_J"] - row["device_J"] == pytest.approx(20.0 * row["duration_s"], rel=1e-6)
        assert row["model_time_per_step_s"] == pytest.approx(model.step_time_s(limit, 32), rel=1e-12)
        assert row["model_device_J_per_step"] == pytest.approx(model.step_energy_J(limit, 32), rel=1e-12)
        # real time: each step sleeps the model's time on top of the tiny model's own compute, at the step's draw
        assert row["time_per_step_s"] >= row["model_time_per_step_s"]
        assert row["device_J_per_step"] >= 0.99 * row["model_device_J_per_step"]
        assert row["device_J_per_step"] <= model.step_power_W(limit, 32) * row["time_per_step_s"] * 1.001
        assert row["batches"] == row["steps"] == 4 and row["epochs"] == 1
        assert row["cern_sampled"] == 4  # fewer batches than the 10 to sample
        assert row["cern_estimate_J"] == pytest.approx(row["cern_batch_J"] * row["batches"], rel=1e-12)
        assert 0 < row["cern_estimate_J"] < row["train_J"]  # steps only: no data loading between them
        recorded = Catalog(tmp_path / "out" / CATALOG_FILE).get(row["catalog_id"])
        assert row["gCO2e"] == pytest.approx(recorded["energy_J"] / 3.6e6 * 100.0, rel=1e-12)
        assert recorded["config"]["run"]["power_limit"] == "simulated GPU"
        # a simulated card and a simulated host sensor: simulated joules, not measured (nor "estimated: false")
        assert row["provenance"] == recorded["provenance"] == "simulated"
        assert row["energy_J"] == recorded["energy_J"]  # the sweep table and the catalog: one figure
    assert (tmp_path / "out" / "sweep_results.csv").read_text().startswith("run,")
    assert len(Catalog(tmp_path / "out" / CATALOG_FILE).list()) == 3
    run_dirs = [r["run_dir"] for r in rows]
    code, out, err = run_cli(capsys, "compare", *run_dirs, "--by", "power_limit_W", "--out", tmp_path / "cmp",
                             "--no-plots")
    assert code == 0, err
    compared = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert set(compared["groups"]) == {"150", "200", "300"}
    for row in rows:
        assert compared["groups"][str(row["power_limit_W"])]["energy_J_mean"] == pytest.approx(row["energy_J"],
                                                                                              rel=1e-3)
    code, out, err = run_cli(capsys, "fit", *run_dirs, "--by", "power_limit_W", "--out", tmp_path / "fit",
                             "--no-plots")
    assert code == 0, err
    fits = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert fits["fits"]["energy"]["r2"] is None  # three points: an exact parabola, no spare point to test it
    assert fits["fits"]["energy"]["spare_points"] == 0


def test_simulated_power_limits_follow_the_gpu_model(tmp_path, monkeypatch):
    """On fake time every second is a simulated step: time and device energy per step are the model's, exactly."""
    clock = install_fake_time(monkeypatch.setattr)
    config = parse_config({**BASE_CONFIG, "output_dir": str(tmp_path / "out"),
                           "model": {"class_path": "lightning_energy.simulate.example_model.TinyAutoencoder",
                                     "init_args": {"n_train": 512, "n_val": 64}},
                           "grid": {"batch_size": [128], "power_limit_W": [150, 225, 300]}})
    rows = run_sweep(config, sweep_order(config.points(), repetitions=1, seed=0), clock=clock)
    model = SimulatedGPU(gpu_index=-2)
    by_limit = {r["power_limit_W"]: r for r in rows}
    assert sorted(by_limit) == [150, 225, 300]
    for limit, row in by_limit.items():
        step_s, step_J = model.step_time_s(limit, 128), model.step_energy_J(limit, 128)
        assert row["steps"] == 4
        assert row["time_per_step_s"] == pytest.approx(step_s, rel=1e-9)
        assert row["device_J_per_step"] == pytest.approx(step_J, rel=1e-9)
        assert row["duration_s"] == pytest.approx(4 * step_s, rel=1e-9)  # nothing but the steps takes time
        assert row["device_J"] == pytest.approx(4 * step_J, rel=1e-9)
        assert row["energy_J"] == pytest.approx(4 * step_J + 20.0 * 4 * step_s, rel=1e-9)  # + the 20 W host
        assert row["cern_batch_J"] == pytest.approx(step_J + 20.0 * step_s, rel=1e-9)
    # a batch of 128 asks for 300 W: every lower limit slows the steps and saves energy per step
    times = [by_limit[limit]["time_per_step_s"] for limit in (150, 225, 300)]
    energies = [by_limit[limit]["device_J_per_step"] for limit in (150, 225, 300)]
    assert times[0] > times[1] > times[2] and energies[0] < energies[1] < energies[2]
    assert times[0] / times[2] == pytest.approx(0.9 * ((300 - 60) / (150 - 60)) ** (1 / 3) + 0.1, rel=1e-9)


def cards_for_the_sweep(monkeypatch, gpus: list) -> None:
    """The sweep opens CUDA device i as ``gpus[i]`` (lightning_energy.optimize.power_limit.gpu_control, the card-control module)."""
    from lightning_energy.optimize.power_limit import gpu_control

    monkeypatch.setattr(gpu_control, "visible_gpu_count", lambda: len(gpus))
    monkeypatch.setattr(gpu_control, "open_gpu", lambda cuda_index: gpus[cuda_index])


def test_real_power_limits_without_permission_fail_before_any_run(tmp_path, capsys, monkeypatch):
    import yaml

    config = tmp_path / "sweep_real.yaml"
    config.write_text(yaml.safe_dump({**BASE_CONFIG, "output_dir": str(tmp_path / "out"), "sensors": "auto",
                                      "trainer": {"max_epochs": 1, "accelerator": "gpu", "devices": 1}}))
    locked = SimulatedGPU(gpu_index=0, can_set_limits=False)
    cards_for_the_sweep(monkeypatch, [locked])
    code, out, err = run_cli(capsys, "sweep", "--config", config)
    assert code == 2
    assert "cannot set GPU power limits (GPU 0: the simulated GPU was created with can_set_limits=False)" in err
    assert "no run was started" in err and "SYS_ADMIN" in err and "zeusd" in err
    assert locked.limit_log == [] and not (tmp_path / "out").exists()  # nothing trained, nothing written


def test_real_power_limits_are_set_per_run_and_restored_even_when_a_run_fails(tmp_path, monkeypatch):
    gpus = [SimulatedGPU(gpu_index=0), SimulatedGPU(gpu_index=1)]
    config = parse_config({**BASE_CONFIG, "output_dir": str(tmp_path / "out"), "sensors": "auto",
                           "grid": {"batch_size": [32], "power_limit_W": [175, None, 250]},
                           "trainer": {"max_epochs": 1, "accelerator": "gpu", "devices": [1]}})
    seen = []

    def fake_run(config, repetition, point, index, clock=None):
        seen.append((point["power_limit_W"], gpus[0].power_limit_W, gpus[1].power_limit_W))
        if len(seen) == 3:
            raise RuntimeError("out of memory")
        return {"run": index}

    monkeypatch.setattr("lightning_energy.sweep.runner.run_one", fake_run)
    order = [(0, {**config.points()[0], "power_limit_W": limit}) for limit in (175, None, 250)]
    cards_for_the_sweep(monkeypatch, gpus)
    with pytest.raises(SweepError, match=r"run rep0_prec32-true_bs32_pl250W \(3/3\) failed: "
                                                                   "RuntimeError: out of memory"):
        run_sweep(config, order)
    assert seen == [(175, 300, 175), (None, 300, 300), (250, 300, 250)]  # only the Trainer's GPU 1 is limited
    # set, then back to what was in force before the sweep (300 W), which a null run also uses, ...
    assert gpus[1].limit_log == [175, 300, 300, 300, 250, 300]
    assert gpus[1].persistence_log == [True, False]  # ... and persistence mode as it was, at the end
    assert gpus[0].limit_log == []
    with pytest.raises(SweepError, match=r"\[400\] W outside GPU 1's range \[150, 300\] W"):
        GpuPowerLimits.open({"devices": [1]}, [200, 400])
