"""A 2-process DDP fit with Carbon, Forecast and Catalog callbacks and checkpoints; run by test_catalog.py
as two ranks forked by rank_zygote.py (by hand, Lightning relaunches it per rank)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from conftest import close_process_group, TinyRegressor, tiny_loader  # noqa: E402
from lightning_energy import EnergyCallback, SimulatedSensor  # noqa: E402
from lightning_energy.callbacks.carbon import CarbonCallback  # noqa: E402
from lightning_energy.callbacks.catalog import CatalogCallback  # noqa: E402
from lightning_energy.callbacks.forecast import ForecastCallback  # noqa: E402

DEVICE_W, HOST_W = 80.0, 25.0

if __name__ == "__main__":
    out_dir = sys.argv[1]
    callbacks = [
        EnergyCallback(sensors=[SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")],
                       verbose=False, log_power_figure=False),
        CarbonCallback(intensity_g_per_kWh=500.0, verbose=False),
        ForecastCallback(verbose=False, budget_J=1.0, on_budget="stop"),  # over budget: every rank must stop
        CatalogCallback(config={"ddp": True}),
        ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), save_last=True),
    ]
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, default_root_dir=out_dir, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2,
    )
    trainer.fit(TinyRegressor(), tiny_loader(n=320), tiny_loader(n=64))
    close_process_group()
