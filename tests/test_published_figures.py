"""Callbacks reach each other's figures through the run's board (``session.published``), never by importing each
other: CarbonCallback publishes its intensity and PUE, EnergyToAccuracy its result or give-up; CatalogCallback and
ForecastCallback read them. The setup order of callbacks follows ``Trainer(callbacks=[...])``, so every pair runs
in both orders: the publisher before the reader and after it.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
from lightning.pytorch import Callback

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import SimulatedSensor
from lightning_energy.callbacks.carbon import CarbonCallback
from lightning_energy.callbacks.catalog import RUN_ATTRIBUTES_FILE, CatalogCallback
from lightning_energy.callbacks.energy_to_accuracy import EnergyToAccuracy
from lightning_energy.callbacks.forecast import ForecastCallback
from lightning_energy.catalog import CATALOG_FILE, Catalog
from lightning_energy.integration.session import session_of

WATTS = 100.0
ORDERS = ("publisher_first", "reader_first")


def sensors():
    return [SimulatedSensor("device", WATTS)]


class BoardProbe(Callback):
    """Keeps what the run's board holds at fit start (every callback's setup has run) and at fit end."""

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}

    def _look(self, trainer, when: str) -> None:
        board = session_of(trainer).published
        self.seen[when] = {name: board.get(name) for name in ("carbon", "energy_to_accuracy")}

    def on_fit_start(self, trainer, pl_module) -> None:
        self._look(trainer, "fit_start")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._look(trainer, "fit_end")


def fit(tmp_path, publishers: list, readers: list, order: str, **overrides):
    probe = BoardProbe()
    callbacks = [*publishers, *readers] if order == "publisher_first" else [*readers, *publishers]
    trainer = L.Trainer(callbacks=[probe, *callbacks], **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    return trainer, probe


@pytest.mark.parametrize("order", ORDERS)
def test_catalog_and_forecast_read_the_carbon_callbacks_intensity_and_pue_in_either_order(tmp_path, order):
    carbon = CarbonCallback(intensity_g_per_kWh=300.0, pue=1.25, sensors=sensors(), verbose=False)
    catalog = CatalogCallback(sensors=sensors())
    forecast = ForecastCallback(sensors=sensors(), verbose=False)
    _, probe = fit(tmp_path, [carbon], [catalog, forecast], order)

    published = probe.seen["fit_start"]["carbon"]
    assert published == {"intensity": carbon.intensity, "pue": 1.25}
    record = Catalog(tmp_path / CATALOG_FILE).get(catalog.record_id)
    assert record["gCO2e"] == pytest.approx(record["energy_J"] / 3.6e6 * 300.0 * 1.25, rel=1e-12)
    report = forecast.report
    assert report["intensity"]["g_per_kWh"] == 300.0 and report["pue"] == 1.25
    assert report["forecasts"]
    for one in report["forecasts"]:
        assert one["total_gCO2e"] == pytest.approx(one["total_J"] / 3.6e6 * 300.0 * 1.25, rel=1e-12)


def test_without_a_carbon_callback_both_use_the_labelled_world_average(tmp_path):
    catalog = CatalogCallback(sensors=sensors())
    forecast = ForecastCallback(sensors=sensors(), verbose=False)
    _, probe = fit(tmp_path, [], [catalog, forecast], "publisher_first")

    assert probe.seen["fit_start"]["carbon"] is None
    assert forecast.report["intensity"]["kind"] == "world_average" and forecast.report["pue"] == 1.0
    assert "no CarbonCallback" in forecast.report["intensity"]["label"]
    record = Catalog(tmp_path / CATALOG_FILE).get(catalog.record_id)
    assert record["gCO2e"] == pytest.approx(record["energy_J"] / 3.6e6 * forecast.report["intensity"]["g_per_kWh"],
                                            rel=1e-12)


@pytest.mark.parametrize("order", ORDERS)
def test_catalog_records_the_energy_to_accuracy_result_in_either_order(tmp_path, order):
    eta = EnergyToAccuracy(monitor="val/loss", target=1e9, mode="min", sensors=sensors())  # reached at once
    catalog = CatalogCallback(sensors=sensors())
    _, probe = fit(tmp_path, [eta], [catalog], order)

    assert eta.result is not None and probe.seen["fit_end"]["energy_to_accuracy"] == {"result": eta.result,
                                                                                      "gave_up": None}
    record = Catalog(tmp_path / CATALOG_FILE).get(catalog.record_id)
    for key in ("energy_to_target_J", "time_to_target_s", "epochs_to_target"):
        assert record["metrics"][key] == pytest.approx(float(eta.result[key]), rel=1e-12)
    attributes = json.loads((tmp_path / "lightning_logs" / "version_0" / RUN_ATTRIBUTES_FILE).read_text())
    assert attributes["epochs_to_target"] == 1.0


@pytest.mark.parametrize("order", ORDERS)
def test_catalog_records_the_energy_to_accuracy_give_up_in_either_order(tmp_path, order):
    eta = EnergyToAccuracy(monitor="val/loss", target=-1.0, mode="min", budget_s=1e-9, sensors=sensors())
    catalog = CatalogCallback(sensors=sensors())
    _, probe = fit(tmp_path, [eta], [catalog], order, max_epochs=3)

    assert eta.result is None and eta.gave_up is not None
    assert probe.seen["fit_end"]["energy_to_accuracy"] == {"result": None, "gave_up": eta.gave_up}
    metrics = Catalog(tmp_path / CATALOG_FILE).get(catalog.record_id)["metrics"]
    assert metrics["target_budget_exceeded"] == 1.0
    assert metrics["energy_at_give_up_J"] == pytest.approx(eta.gave_up["energy_J"], rel=1e-12)
    assert metrics["time_at_give_up_s"] == pytest.approx(eta.gave_up["time_s"], rel=1e-12)
    assert "energy_to_target_J" not in metrics
