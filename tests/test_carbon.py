"""Carbon intensity (mix, country, region, user figure, world average) and CarbonCallback in real fits."""

from __future__ import annotations

import contextlib
import io
import json
import math

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

import torch

from conftest import RecordingLogger, TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.callbacks.carbon import CARBON_REPORT_FILE, CarbonCallback
from lightning_energy.carbon import (
    SOURCE_INTENSITY_G_PER_KWH, WORLD_AVERAGE_G_PER_KWH, co2e_g, intensity_from_mix, location_intensity,
    resolve_intensity, validate_pue,
)

DEVICE_W, HOST_W = 120.0, 30.0


def sensors():
    return [SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")]


# ---------------------------------------------------------------- the mix calculator
def test_mix_is_the_share_weighted_sum_of_the_table():
    assert intensity_from_mix({"coal": 0.5, "wind": 0.5}) == pytest.approx(0.5 * 995 + 0.5 * 26, abs=1e-12)
    assert intensity_from_mix({"nuclear": 0.7, "hydro": 0.2, "solar": 0.1}) == pytest.approx(30.3, abs=1e-12)
    expected = {"coal": 995, "petroleum": 816, "natural_gas": 743, "geothermal": 38, "hydro": 26, "nuclear": 29,
                "solar": 48, "wind": 26}
    assert SOURCE_INTENSITY_G_PER_KWH == expected
    for source, grams in expected.items():
        assert intensity_from_mix({source: 1.0}) == grams


def test_mix_shares_may_miss_one_by_at_most_1e_6():
    assert intensity_from_mix({"coal": 0.5, "wind": 0.5000005}) == pytest.approx(510.5, abs=1e-3)
    with pytest.raises(ValueError, match="sum to 1"):
        intensity_from_mix({"coal": 0.5, "wind": 0.50001})
    with pytest.raises(ValueError, match=r"sum to 1 .*0\.9"):
        intensity_from_mix({"coal": 0.4, "wind": 0.5})


@pytest.mark.parametrize("mix, match", [
    ({"oil": 1.0}, r"unknown energy source\(s\) \['oil'\].*known sources"),
    ({"coal": 0.5, "biomass": 0.5}, "biomass"),
    ({"coal": -0.5, "wind": 1.5}, "share of 'coal' must be in"),
    ({"coal": math.nan}, "finite"),
    ({"coal": True}, "finite number"),
    ({}, "non-empty"),
    ([("coal", 1.0)], "non-empty dict"),
])
def test_mix_rejects_bad_input_with_a_clear_error(mix, match):
    with pytest.raises(ValueError, match=match):
        intensity_from_mix(mix)


# ---------------------------------------------------------------- where the intensity comes from
def test_co2e_is_kwh_times_intensity_times_pue():
    assert co2e_g(3.6e6, 475.0) == pytest.approx(475.0)
    assert co2e_g(1.8e6, 400.0, pue=1.5) == pytest.approx(300.0)


def test_resolve_intensity_sources_and_fallback():
    user = resolve_intensity(g_per_kWh=123.0)
    assert (user.g_per_kWh, user.kind) == (123.0, "user")
    mix = resolve_intensity(mix={"hydro": 1.0})
    assert (mix.g_per_kWh, mix.kind) == (26.0, "mix")
    fallback = resolve_intensity()
    assert fallback.g_per_kWh == WORLD_AVERAGE_G_PER_KWH == 475.0
    assert fallback.kind == "world_average" and "world average" in fallback.label
    unknown = location_intensity("XYZ")
    assert unknown.kind == "world_average" and "'XYZ'" in unknown.label


@pytest.mark.parametrize("kwargs, match", [
    (dict(g_per_kWh=100.0, country_iso_code="FRA"), "one source"),
    (dict(region="california"), "needs `country_iso_code`"),
    (dict(country_iso_code="FR"), "3-letter ISO"),
    (dict(g_per_kWh=-1.0), "intensity_g_per_kWh"),
])
def test_resolve_intensity_rejects_contradictions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_intensity(**kwargs)


@pytest.mark.parametrize("pue", [0.9, math.inf, "1.2", True])
def test_pue_below_one_or_not_a_number_is_rejected(pue):
    with pytest.raises(ValueError, match="pue"):
        validate_pue(pue)


@pytest.mark.parametrize("iso, region", [("FRA", None), ("DEU", None), ("USA", "california"), ("CAN", "ontario"),
                                         ("CHN", "beijing"), ("SWE", "SE3"), ("USA", None)])
def test_country_and_region_figures_match_codecarbons_own_computation(iso, region):
    with contextlib.redirect_stdout(io.StringIO()):
        from codecarbon.core.emissions import Emissions
        from codecarbon.core.units import Energy
        from codecarbon.external.geography import GeoMetadata
        from codecarbon.input import DataSource

        kg = Emissions(DataSource()).get_private_infra_emissions(
            Energy.from_energy(kWh=1.0), GeoMetadata(country_iso_code=iso, region=region))
    ours = location_intensity(iso, region)
    assert ours.g_per_kWh == pytest.approx(kg * 1000.0, rel=1e-9)
    assert ours.kind == ("country" if region is None else "region")


def test_unknown_region_falls_back_to_the_country_with_a_note():
    found = location_intensity("USA", "atlantis")
    assert found.kind == "country" and found.g_per_kWh == location_intensity("USA").g_per_kWh
    assert "atlantis" in found.label


# ---------------------------------------------------------------- CarbonCallback in fits
def fit(tmp_path, *callbacks, **overrides):
    trainer = L.Trainer(callbacks=list(callbacks), **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    return trainer


def test_co2_per_epoch_is_energy_times_intensity_times_pue(tmp_path, capsys):
    carbon = CarbonCallback(intensity_g_per_kWh=400.0, pue=1.5, sensors=sensors())
    logger = RecordingLogger(tmp_path)
    trainer = fit(tmp_path, carbon, max_epochs=3, logger=logger)
    report = json.loads((carbon.report_path).read_text())
    assert carbon.report_path.name == CARBON_REPORT_FILE
    rows = report["epochs"]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["energy_J"] == pytest.approx((DEVICE_W + HOST_W) * row["duration_s"], rel=1e-9)
        assert row["gCO2e"] == pytest.approx(row["energy_J"] / 3.6e6 * 400.0 * 1.5, rel=1e-12)
        assert row["total_gCO2e"] == pytest.approx(row["total_J"] / 3.6e6 * 400.0 * 1.5, rel=1e-12)
    assert rows[0]["total_J"] < rows[1]["total_J"] < rows[2]["total_J"] < report["total_J"]
    assert report["total_J"] == pytest.approx((DEVICE_W + HOST_W) * report["duration_s"], rel=1e-9)
    assert report["total_gCO2e"] == pytest.approx(report["total_J"] / 3.6e6 * 600.0, rel=1e-12)
    assert report["intensity"]["kind"] == "user" and report["pue"] == 1.5 and report["estimated"] is False
    # through every logger, once per epoch at the epoch's step
    assert logger.values("carbon/epoch_gCO2e") == pytest.approx([r["gCO2e"] for r in rows], rel=1e-12)
    assert logger.values("carbon/total_gCO2e") == pytest.approx([r["total_gCO2e"] for r in rows], rel=1e-12)
    assert logger.steps("carbon/epoch_gCO2e") == [9, 19, 29]  # where Lightning logs its epoch metrics
    assert trainer.progress_bar_metrics["gCO2e"] == pytest.approx(rows[-1]["total_gCO2e"], rel=1e-6)
    assert "gCO2e" in capsys.readouterr().out


def test_carbon_reuses_the_energy_callbacks_sensors_and_agrees_with_it(tmp_path):
    energy = EnergyCallback(sensors=sensors(), verbose=False)
    carbon = CarbonCallback(country_iso_code="FRA", verbose=False)
    fit(tmp_path, energy, carbon)
    assert carbon.report["intensity"]["g_per_kWh"] == pytest.approx(location_intensity("FRA").g_per_kWh)
    # no sensors of its own: had it not shared the simulated ones, it would read this machine's CPU estimate
    assert carbon.report["estimated"] is False
    assert carbon.report["total_J"] == pytest.approx((DEVICE_W + HOST_W) * carbon.report["duration_s"], rel=1e-9)
    # one timeline: the same fit window as the EnergyCallback's, so the same joules
    assert carbon.report["total_J"] == pytest.approx(energy.report["total_J"], rel=1e-12)
    assert carbon.report["duration_s"] == energy.report["duration_s"]
    for row, energy_row in zip(carbon.report["epochs"], energy.report["epochs"], strict=True):
        assert row["energy_J"] == pytest.approx(energy_row["train_J"] + energy_row["validation_J"], rel=1e-12)
        assert row["total_J"] == pytest.approx(energy_row["total_J"], rel=1e-12)


def test_world_average_is_used_with_a_warning(tmp_path):
    carbon = CarbonCallback(sensors=sensors(), verbose=False)
    with pytest.warns(UserWarning, match="world average 475 g/kWh"):
        fit(tmp_path, carbon, max_epochs=1)
    assert carbon.report["intensity"]["kind"] == "world_average"
    assert carbon.report["total_gCO2e"] == pytest.approx(carbon.report["total_J"] / 3.6e6 * 475.0, rel=1e-12)


def test_estimated_energy_gives_estimated_co2(tmp_path):
    carbon = CarbonCallback(intensity_g_per_kWh=100.0, verbose=False,
                            sensors=[SimulatedSensor("cpu", 50.0, scope="host", estimated=True)])
    fit(tmp_path, carbon, max_epochs=1)
    assert carbon.report["estimated"] is True


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_total_co2_continues_across_a_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = CarbonCallback(intensity_g_per_kWh=300.0, sensors=sensors(), verbose=False)
    fit(tmp_path, first, ModelCheckpoint(dirpath=ckpt, save_last=True), max_epochs=1, enable_checkpointing=True)
    before_J = first.report["epochs"][-1]["total_J"]
    saved = torch.load(ckpt / "last.ckpt", weights_only=False)["callbacks"]["CarbonCallback"]
    second = CarbonCallback(intensity_g_per_kWh=300.0, sensors=sensors(), verbose=False)
    trainer = L.Trainer(callbacks=[second, ModelCheckpoint(dirpath=ckpt, save_last=True)],
                        **trainer_kwargs(tmp_path, max_epochs=2, enable_checkpointing=True))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48), ckpt_path=ckpt / "last.ckpt")
    report = second.report
    # the checkpoint's total runs to when it was written: after the epoch's end, before the fit's
    assert before_J < saved["total_J"] < first.report["total_J"]
    # the epoch's row, measured (or, when its figures had not arrived yet, estimated from the samples then)
    assert saved["epochs"][0]["energy_J"] == pytest.approx(first.report["epochs"][0]["energy_J"], rel=1e-9)
    assert [r["epoch"] for r in report["epochs"]] == [0, 1]
    assert report["resumed_total_J"] == saved["total_J"]
    assert report["total_J"] == pytest.approx(saved["total_J"] + (DEVICE_W + HOST_W) * report["duration_s"],
                                              rel=1e-9)


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_checkpoint_inside_an_epoch_keeps_the_energy_so_far(tmp_path):
    """Before: the state held the total at the last epoch's end only, so a mid-epoch checkpoint of the
    first epoch carried nothing and the resumed fit started again from 0 J."""
    ckpt = tmp_path / "ckpt"
    first = CarbonCallback(intensity_g_per_kWh=300.0, sensors=sensors(), verbose=False)
    fit(tmp_path, first, ModelCheckpoint(dirpath=ckpt, every_n_train_steps=5, save_last=True), max_steps=5,
        enable_checkpointing=True)
    saved = torch.load(ckpt / "last.ckpt", weights_only=False)["callbacks"]["CarbonCallback"]
    assert saved["epochs"] == []
    assert 0 < saved["total_J"] < first.report["total_J"]
    second = CarbonCallback(intensity_g_per_kWh=300.0, sensors=sensors(), verbose=False)
    trainer = L.Trainer(callbacks=[second, ModelCheckpoint(dirpath=ckpt, every_n_train_steps=5, save_last=True)],
                        **trainer_kwargs(tmp_path, max_epochs=1, enable_checkpointing=True))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48), ckpt_path=ckpt / "last.ckpt")
    report = second.report
    assert report["resumed_total_J"] == saved["total_J"]
    assert report["total_J"] == pytest.approx(saved["total_J"] + (DEVICE_W + HOST_W) * report["duration_s"],
                                              rel=1e-9)
    assert [r["epoch"] for r in report["epochs"]] == [0]
    assert report["epochs"][0]["total_J"] > saved["total_J"]


def test_codecarbon_offline_tracker_runs_beside_ours(tmp_path):
    carbon = CarbonCallback(country_iso_code="FRA", codecarbon_crosscheck=True, sensors=sensors(), verbose=False)
    fit(tmp_path, carbon, max_epochs=1)
    saved = json.loads(carbon.report_path.read_text())
    theirs = saved["codecarbon"]
    assert "error" not in theirs, theirs
    assert theirs["energy_J"] > 0 and theirs["gCO2e"] > 0
    assert theirs["country_iso_code"] == "FRA"
    assert theirs["intensity_g_per_kWh"] == pytest.approx(location_intensity("FRA").g_per_kWh, rel=1e-6)
    assert saved["total_gCO2e"] == pytest.approx(saved["total_J"] / 3.6e6 * location_intensity("FRA").g_per_kWh)
    assert not list(tmp_path.rglob("emissions.csv"))  # offline cross-check writes no files of its own
