"""Every suite callback refuses a bad argument at construction, before any Trainer exists: one table per
callback of (arguments, the error raised, a fragment of its message, which names the argument).

Refusals that need a Trainer (checked in ``setup``) stay with their callback's tests.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_energy import SimulatedSensor
from lightning_energy.callbacks.batch_size import BatchSizeSearch
from lightning_energy.callbacks.carbon import CarbonCallback
from lightning_energy.callbacks.catalog import CatalogCallback
from lightning_energy.callbacks.energy import EnergyCallback
from lightning_energy.callbacks.energy_to_accuracy import EnergyToAccuracy
from lightning_energy.callbacks.flops import FlopsCallback
from lightning_energy.callbacks.forecast import ForecastCallback
from lightning_energy.callbacks.power_limit import PowerLimitOptimizer
from lightning_energy.callbacks.precision import PrecisionSwitch
from lightning_energy.callbacks.prediction_check import EnergyPredictionCheck
from lightning_energy.callbacks.profiler import EnergyProfiler
from lightning_energy.callbacks.zeus_batch_size import ZeusBatchSizeOptimizer


def refused(callback, kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        callback(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sensors=["gpu"]), TypeError, "sensors"),
    (dict(sensors=SimulatedSensor("x", 1.0), backend="zeus"), ValueError, "backend"),
    (dict(backend="rapl"), ValueError, "backend"),
    (dict(interval_s=0), ValueError, "interval_s"),
    (dict(interval_s="fast"), ValueError, "interval_s"),
    (dict(verbose="yes"), TypeError, "verbose"),
    (dict(telemetry="on"), TypeError, "telemetry"),
    (dict(power_figure_budget=2), ValueError, "figure_budget"),
    (dict(power_figure_budget=True), ValueError, "figure_budget"),
])
def test_energy_callback(kwargs, error, match):
    refused(EnergyCallback, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(pue=0.5), ValueError, "pue"),
    (dict(energy_mix={"coal": 2.0}), ValueError, "share of 'coal'"),
    (dict(codecarbon_crosscheck=True), ValueError, "country_iso_code"),
    (dict(verbose="no"), TypeError, "verbose"),
    (dict(backend="rapl"), ValueError, "backend"),
])
def test_carbon_callback(kwargs, error, match):
    refused(CarbonCallback, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(warmup_steps=-1), ValueError, "warmup_steps"),
    (dict(start_after_steps=0), ValueError, "start_after_steps"),
    (dict(warmup_steps=5, start_after_steps=5), ValueError, "greater than `warmup_steps`"),
    (dict(budget_J=0), ValueError, "budget_J"),
    (dict(budget_gCO2e=math.nan), ValueError, "budget_gCO2e"),
    (dict(on_budget="pause"), ValueError, "on_budget"),
    (dict(verbose=1), TypeError, "verbose"),
])
def test_forecast_callback(kwargs, error, match):
    refused(ForecastCallback, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(config=["a"]), TypeError, "config"),
    (dict(flops_per_step=0), ValueError, "flops_per_step"),
    (dict(count_flops="yes"), TypeError, "count_flops"),
])
def test_catalog_callback(kwargs, error, match):
    refused(CatalogCallback, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batch_sizes=[]), ValueError, "batch_sizes"),
    (dict(batch_sizes=[8, 16]), ValueError, "give `monitor`.* or method='per_sample'"),  # no silent per-sample ranking
    (dict(batch_sizes=[8], method="per_sample", cost="carbon"), ValueError, "cost"),
    (dict(batch_sizes=[8], monitor="val/loss", target=0.1, mode="lowest"), ValueError, "mode"),
    (dict(batch_sizes=[8], monitor="val/loss", target=0.1, beta_knob=1.0), ValueError, "beta_knob"),
    (dict(batch_sizes=[8], method="per_sample", interval_s=0.0), ValueError, "interval_s"),
])
def test_batch_size_search(kwargs, error, match):
    refused(BatchSizeSearch, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(server_url="http://127.0.0.1:1", job_id_prefix="x", batch_sizes=[8, 16], default_batch_size=32),
     ValueError, "Default BS\\(32\\) not in batch_sizes"),  # Zeus's own validation of the job
    (dict(server_url="127.0.0.1:8000", job_id_prefix="x", batch_sizes=[8], default_batch_size=8),
     ValueError, "server_url"),
    (dict(server_url="http://127.0.0.1:1", job_id_prefix="x", batch_sizes=[8], default_batch_size=8, interval_s=0.0),
     ValueError, "interval_s"),
])
def test_zeus_batch_size_optimizer(kwargs, error, match):
    refused(ZeusBatchSizeOptimizer, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(monitor="val/acc", target=0.5, mode="up"), ValueError, "mode"),
    (dict(monitor="val/acc", target=float("nan")), ValueError, "target"),
    *[(dict(monitor="val/loss", target=0.1, budget_J=bad), ValueError, "budget_J")
      for bad in (0, -1.0, math.inf, True, "5")],
])
def test_energy_to_accuracy(kwargs, error, match):
    refused(EnergyToAccuracy, kwargs, error, match)


def _theoretical_only():
    from lightning_energy.predict.pre_run import estimate_energy

    return estimate_energy(nn.Linear(4, 2), torch.randn(3, 4), steps=5, empirical=False)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prediction=_theoretical_only), ValueError, "no empirical part"),  # built in the test: a callable here
    (dict(prediction="a lot"), TypeError, "`prediction`"),
    (dict(prediction=1.0, source="guess"), ValueError, "`source`"),
])
def test_energy_prediction_check(kwargs, error, match):
    kwargs = {name: value() if callable(value) else value for name, value in kwargs.items()}
    refused(EnergyPredictionCheck, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(warmup=0), ValueError, "`warmup` must be an integer >= 1"),
    (dict(active=0), ValueError, "`active`"),
    (dict(activities=["gpu"]), ValueError, "`activities`"),
])
def test_energy_profiler(kwargs, error, match):
    refused(EnergyProfiler, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(peak_flops_per_s=0), ValueError, "peak_flops_per_s"),
])
def test_flops_callback(kwargs, error, match):
    refused(FlopsCallback, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"candidates": ["32-true", "fp8"]}, ValueError, "`candidates` must be one of"),
    ({"candidates": "bf16-mixed"}, ValueError, "`candidates` must be a non-empty list"),
    ({"candidates": ["bf16-mixed", "bf16-mixed"]}, ValueError, "duplicates"),
    ({"mode": "bf16-mixed", "candidates": ["32-true"]}, ValueError, "either `mode`"),
    ({"mode": "half"}, ValueError, "`mode` must be one of"),
    ({"tolerance": 0}, ValueError, "`tolerance` must be a finite number > 0"),
    ({"tolerance": float("nan")}, ValueError, "`tolerance`"),
    ({"profile_steps": 0}, ValueError, "`profile_steps` must be an integer >= 1"),
    ({"warmup_steps": -1}, ValueError, "`warmup_steps`"),
    ({"explode_factor": 1.0}, ValueError, "`explode_factor` must be > 1"),
    ({"objective": "carbon"}, ValueError, "`objective` must be one of"),
    ({"drift_patience": 0}, ValueError, "`drift_patience`"),
    ({"interval_s": 0}, ValueError, "`interval_s`"),
    ({"sensors": [SimulatedSensor("x", 1.0)], "backend": "zeus"}, ValueError, "give either `sensors` or `backend`"),
])
def test_precision_switch(kwargs, error, match):
    refused(PrecisionSwitch, kwargs, error, match)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(selector="fastest"), ValueError, "selector"),
    (dict(eta_knob=1.5), ValueError, "eta_knob"),
    (dict(profile_steps=0), ValueError, "profile_steps"),
    (dict(search="random"), ValueError, "search"),
    (dict(gpu="cuda:0"), TypeError, "gpu"),
])
def test_power_limit_optimizer(kwargs, error, match):
    refused(PowerLimitOptimizer, kwargs, error, match)
