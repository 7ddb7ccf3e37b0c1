"""Energy predictions before training: 45 nm pricing, per-layer fits, the estimate command, the check."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.callbacks.prediction_check import PREDICTION_FILE, EnergyPredictionCheck
from lightning_energy.cli.main import main
from lightning_energy.predict.flops import count_model
from lightning_energy.predict.pre_run import (
    DEFAULT_SPECS, Fit, LayerSpec, MeterProbe, benchmark_layers, compare_prediction, estimate_energy, fit_energy,
    fit_points, memory_pj, model_specs, price_pj, theoretical_estimate,
)
from lightning_energy.measure.sampler import get_sampler
from test_flops import baler_ae

LINEAR_ARGS = ["torch.nn.Linear", "--init-args", '{"in_features": 24, "out_features": 200}', "--input-shape", "512,24"]


def linear_step_pj(bits, add, mul, params_pj, input_pj, output_pj):
    """One training step of Linear(24, 200) on a batch of 512, priced by hand (pJ)."""
    macs = 512 * 24 * 200 * 2  # forward + weight gradient (the input needs no gradient)
    adds = macs + 2 * 512 * 200  # bias: one add per output element forward, one backward
    forward_words_pj = 5000 * params_pj + 512 * 24 * input_pj + 512 * 200 * output_pj
    return macs * mul + adds * add + 3 * forward_words_pj  # backward touches twice the forward's words


# ------------------------------------------------------------------------------ theoretical
def test_theoretical_price_of_a_linear_layer_is_hand_computed():
    table = count_model(nn.Linear(24, 200), torch.randn(512, 24))
    est32 = theoretical_estimate(table, 32, steps=1000)
    # 32-bit: params 20 kB (<32 kB: 10 pJ), input 49 kB and output 410 kB (<1 MB: 50 pJ)
    assert est32.step_J == pytest.approx(linear_step_pj(32, 0.9, 3.7, 10.0, 50.0, 50.0) * 1e-12, rel=1e-12)
    assert est32.step_J == pytest.approx(40.14744e-6, rel=1e-12)
    assert est32.training_J == pytest.approx(1000 * est32.step_J)
    est16 = theoretical_estimate(table, 16, steps=1)
    # 16-bit: params 10 kB and input 25 kB (<32 kB: 5 pJ), output 205 kB (<1 MB: 25 pJ)
    assert est16.step_J == pytest.approx(linear_step_pj(16, 0.4, 1.1, 5.0, 5.0, 25.0) * 1e-12, rel=1e-12)
    assert not est32.extrapolated and est16.step_J < est32.step_J


def test_bit_widths_outside_the_table():
    add, mul, memory, extrapolated = price_pj(64)
    assert extrapolated and add == pytest.approx(0.9 * 0.9 / 0.4) and mul == pytest.approx(3.7 * 3.7 / 1.1)
    assert memory[-1][1] == pytest.approx(2000.0)
    assert memory_pj(100, 8) == 1.25 and memory_pj(2 * 1024 * 1024, 32) == 1000.0
    with pytest.raises(ValueError, match="8-, 16- and 32-bit"):
        price_pj(12)


# ------------------------------------------------------------------------------ empirical fits
def test_fit_recovers_known_coefficients_from_simulated_measurements():
    a, b = 2.5e-9, 0.004
    macs = [spec.macs for spec in DEFAULT_SPECS if spec.kind == "linear"]
    exact = fit_energy("linear", macs, [a * m + b for m in macs])
    assert exact.a_J_per_MAC == pytest.approx(a, rel=1e-9) and exact.b_J == pytest.approx(b, rel=1e-6)
    assert exact.r2 == pytest.approx(1.0) and exact.n == len(macs)
    noisy = fit_energy("linear", macs, [(a * m + b) * (1 + 0.005 * (-1) ** i) for i, m in enumerate(macs)])
    assert noisy.a_J_per_MAC == pytest.approx(a, rel=0.02) and 0.999 < noisy.r2 < 1.0
    with pytest.raises(ValueError, match="two or more MAC counts"):
        fit_energy("conv", [10, 10], [1.0, 2.0])


def test_fits_never_have_a_negative_cost_per_call_or_per_mac():
    """Noisy small layers can tilt the free line below zero at small MAC counts (seen: an intercept of
    -1.2 mJ and a predicted step energy of -652 uJ); each coefficient is a cost and stays >= 0."""
    macs = [1e6, 2e6, 4e6, 8e6]
    tilted = [0.5e-3, 1.0e-3, 3.0e-3, 7.0e-3]  # the free line: 0.93 nJ/MAC x MACs - 0.66 mJ
    through_origin = fit_energy("linear", macs, tilted)
    assert through_origin.b_J == 0.0
    assert through_origin.a_J_per_MAC == pytest.approx(sum(m * e for m, e in zip(macs, tilted)) / sum(m * m for m in macs))
    assert through_origin.predict_J(1e5) > 0
    falling = fit_energy("linear", macs, [4e-3, 3e-3, 2e-3, 1e-3])  # more MACs, less energy: noise, not physics
    assert falling.a_J_per_MAC == 0.0 and falling.b_J == pytest.approx(2.5e-3)


SMALL_SPECS = (LayerSpec("linear", 8, 4, 4), LayerSpec("linear", 16, 8, 8), LayerSpec("linear", 32, 16, 8),
               LayerSpec("conv", 2, 1, 2, 3, 6), LayerSpec("conv", 2, 2, 4, 3, 8), LayerSpec("conv", 4, 2, 4, 3, 8))
TRUE_FITS = {"linear": (3e-9, 0.002), "conv": (5e-9, 0.001)}


def simulated_measure(spec, run):
    """Runs the layer for real, reports the energy a known line predicts for 4 calls."""
    for _ in range(4):
        run()
    a, b = TRUE_FITS[spec.kind]
    return 4 * (a * spec.macs + b), 4 * 1e-3, 4


def test_benchmark_and_fit_per_layer_type_recover_the_simulated_lines():
    points = benchmark_layers(simulated_measure, SMALL_SPECS)
    assert [p.macs for p in points] == [8 * 4 * 4, 16 * 8 * 8, 32 * 16 * 8, 2 * 4 * 4 * 9 * 1 * 2,
                                        2 * 6 * 6 * 9 * 2 * 4, 4 * 6 * 6 * 9 * 2 * 4]
    assert all(p.calls == 4 and p.seconds == pytest.approx(1e-3) for p in points)
    fits = fit_points(points)
    for kind, (a, b) in TRUE_FITS.items():
        assert fits[kind].a_J_per_MAC == pytest.approx(a, rel=1e-6)
        assert fits[kind].b_J == pytest.approx(b, rel=1e-6)
        assert fits[kind].r2 == pytest.approx(1.0)


def test_empirical_prediction_of_the_ae_step_and_training():
    model, batch = baler_ae(), torch.randn(512, 24)
    fits = {"linear": Fit("linear", 1e-9, 2e-4, 1.0, 6)}
    est = estimate_energy(model, batch, steps=1000, fits=fits)
    sizes = [24, 200, 100, 50, 15, 50, 100, 200, 24]
    expected = sum(1e-9 * 512 * a * b + 2e-4 for a, b in zip(sizes, sizes[1:]))
    assert est.empirical.step_J == pytest.approx(expected, rel=1e-12)
    assert est.empirical.training_J == pytest.approx(1000 * expected)
    assert est.empirical.coverage == 1.0  # LeakyReLU has no counted FLOPs: the Linear layers are all of them
    assert est.theoretical.bits == 32 and est.dtype == "float32"
    simulated = estimate_energy(model, batch, steps=10, measure_fn=simulated_measure, specs=SMALL_SPECS)
    a, b = TRUE_FITS["linear"]
    assert simulated.empirical.step_J == pytest.approx(sum(a * 512 * x * y + b for x, y in zip(sizes, sizes[1:])))
    data = json.loads(json.dumps(simulated.as_dict()))
    assert data["empirical"]["fits"]["linear"]["a_J_per_MAC"] == pytest.approx(a)
    assert data["flops"]["study_MACs"] == 31_283_939
    assert "R^2" in simulated.format() and "theoretical" in simulated.format()
    with pytest.raises(ValueError, match="`steps`"):
        estimate_energy(model, batch, steps=0, empirical=False)


def test_benchmarks_include_the_model_own_layer_sizes():
    specs = model_specs(count_model(baler_ae(), torch.randn(512, 24)))
    sizes = [24, 200, 100, 50, 15, 50, 100, 200, 24]
    assert specs == [LayerSpec("linear", 512, a, b) for a, b in zip(sizes, sizes[1:])]
    convs = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3, stride=2))  # the strided one has no LayerSpec
    assert model_specs(count_model(convs, torch.randn(2, 3, 8, 8))) == [LayerSpec("conv", 2, 3, 4, 3, 8)]
    seen = []
    estimate_energy(nn.Linear(24, 200), torch.randn(512, 24), steps=1,
                    measure_fn=lambda spec, run: seen.append(spec) or simulated_measure(spec, run))
    assert seen == [*DEFAULT_SPECS, LayerSpec("linear", 512, 24, 200)]


def test_meter_probe_measures_with_the_shared_sampler():
    probe = MeterProbe([SimulatedSensor("dev", 50.0)], interval_s=0.002, min_seconds=0.02)
    assert not probe.estimated
    spec = LayerSpec("linear", 8, 4, 4)
    module, x = spec.build("cpu", torch.float32)
    calls = []
    with pytest.raises(RuntimeError, match="probe.attached"):
        probe(spec, lambda: None)
    with probe.attached():
        energy_J, seconds, n = probe(spec, lambda: calls.append(module(x).sum().backward()))
        assert probe in get_sampler()._owners
    assert probe not in get_sampler()._owners  # released
    assert n >= 1 and len(calls) == n + 1  # one warm-up call outside the window
    assert seconds >= 0.02 and energy_J == pytest.approx(50.0 * seconds, rel=1e-9)
    assert MeterProbe([SimulatedSensor("dev", 5.0, estimated=True)]).estimated


# ------------------------------------------------------------------------------ prediction vs a real fit
def test_compare_prediction():
    assert compare_prediction(2.0, 25.0, 10) == {"steps": 10, "predicted_J": 20.0, "measured_J": 25.0, "error": -0.2}
    with pytest.raises(ValueError, match="measured energy > 0"):
        compare_prediction(2.0, 0.0, 10)


def test_prediction_check_reports_the_error_of_a_real_fit(tmp_path):
    power_W, step_J = 100.0, 0.05
    sensors = [SimulatedSensor("device", power_W)]
    check = EnergyPredictionCheck(step_J)
    trainer = L.Trainer(callbacks=[EnergyCallback(sensors=sensors, verbose=False), check],
                        logger=CSVLogger(str(tmp_path)), **trainer_kwargs(tmp_path, max_epochs=2))
    trainer.fit(TinyRegressor(), tiny_loader(n=160), tiny_loader(n=48))
    result = check.result
    assert result["steps"] == 20 and result["predicted_J"] == pytest.approx(20 * step_J)
    assert result["error"] == pytest.approx((result["predicted_J"] - result["measured_J"]) / result["measured_J"])
    report = json.loads((tmp_path / "lightning_logs" / "version_0" / "energy_report.json").read_text())
    steps_J = sum(e["steps_J"] for e in report["epochs"])
    assert result["fit_J"] == pytest.approx(power_W * result["fit_s"], rel=1e-9)
    assert 0 < result["measured_J"] < result["fit_J"]
    assert result["measured_J"] == pytest.approx(steps_J, rel=0.25)  # the same steps, marked by two callbacks
    assert [s["name"] for s in result["sensors"]] == ["device"]  # the EnergyCallback's sensors, reused
    saved = json.loads((tmp_path / "lightning_logs" / "version_0" / PREDICTION_FILE).read_text())
    assert saved == json.loads(json.dumps(result))
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "prediction/error" in metrics and "prediction/measured_J" in metrics


def test_prediction_check_can_check_the_theoretical_part():
    est = estimate_energy(nn.Linear(4, 2), torch.randn(3, 4), steps=5, empirical=False)
    assert EnergyPredictionCheck(est, source="theoretical").predicted_step_J == est.theoretical.step_J


# ------------------------------------------------------------------------------ the command
def test_estimate_command_prints_and_saves_the_theoretical_prediction(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    assert main(["estimate", *LINEAR_ARGS, "--steps", "1000", "--no-empirical", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2,457,800" in printed and "theoretical (45 nm table, 32-bit)" in printed
    data = json.loads(out.read_text())
    assert data["theoretical"]["step_J"] == pytest.approx(40.14744e-6, rel=1e-12)
    assert data["theoretical"]["training_J"] == pytest.approx(40.14744e-3, rel=1e-12)
    assert data["steps"] == 1000 and data["input_shape"] == [512, 24] and "empirical" not in data
    assert main(["estimate", *LINEAR_ARGS, "--epochs", "3", "--steps-per-epoch", "10", "--no-empirical",
                 "--dtype", "float64", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["steps"] == 30 and data["theoretical"]["bits"] == 64 and data["theoretical"]["extrapolated"]
    assert "EXTRAPOLATED" in capsys.readouterr().out


def test_estimate_command_runs_the_benchmarks(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    assert main(["estimate", *LINEAR_ARGS, "--steps", "100", "--bench-seconds", "0.01", "--json", str(out)]) == 0
    data = json.loads(out.read_text())["empirical"]
    assert set(data["fits"]) == {"linear", "conv"} and len(data["points"]) == len(DEFAULT_SPECS) + 1  # + the model
    assert all(p["energy_J"] > 0 for p in data["points"])
    assert data["training_J"] == pytest.approx(100 * data["step_J"]) and data["step_J"] > 0
    printed = capsys.readouterr().out
    assert "empirical (" in printed and "R^2" in printed
    if data["estimated"]:
        assert "ESTIMATE" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*LINEAR_ARGS[:2], "{in_features: 24}", *LINEAR_ARGS[3:], "--steps", "5"], "--init-args is not valid JSON"),
        ([*LINEAR_ARGS[:2], "3", *LINEAR_ARGS[3:], "--steps", "5"], "must be a JSON object or list"),
        ([*LINEAR_ARGS[:4], "512,abc", "--steps", "5"], "--input-shape must be positive integers"),
        ([*LINEAR_ARGS[:4], "512,25", "--steps", "5"], "cannot take an input of shape (512, 25)"),
        (["no_such_pkg.Model", "--input-shape", "4,2", "--steps", "5"], "cannot import module 'no_such_pkg'"),
        (["torch.nn.Nope", "--input-shape", "4,2", "--steps", "5"], "has no attribute 'Nope'"),
        (["Linear", "--input-shape", "4,2", "--steps", "5"], "must be an import path"),
        ([*LINEAR_ARGS[:2], '{"in_features": 24}', *LINEAR_ARGS[3:], "--steps", "5"], "cannot build torch.nn.Linear"),
        ([*LINEAR_ARGS, "--steps", "0"], "--steps must be >= 1"),
        ([*LINEAR_ARGS, "--epochs", "3"], "--epochs needs --steps-per-epoch"),
        ([*LINEAR_ARGS, "--steps", "5", "--bench-seconds", "0"], "--bench-seconds must be > 0"),
    ],
)
def test_estimate_command_errors_name_the_problem(tmp_path, capsys, argv, message):
    out = tmp_path / "estimate.json"
    assert main(["estimate", *argv, "--no-empirical", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert not out.exists()
