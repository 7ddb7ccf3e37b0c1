"""A 2-process DDP fit on CPU with simulated sensors; run by test_ddp.py (Lightning relaunches it per rank)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from conftest import close_process_group, TinyRegressor, tiny_loader  # noqa: E402
from lightning_energy import EnergyCallback, SimulatedSensor  # noqa: E402

DEVICE_W, HOST_W = 80.0, 25.0

if __name__ == "__main__":
    out_dir = sys.argv[1]
    callback = EnergyCallback(
        sensors=[SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")],
        verbose=False,
        log_power_figure=False,
    )
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, default_root_dir=out_dir,
        # a checkpoint 5 steps into the second epoch: EnergyCallback.state_dict is collective there
        callbacks=[callback, ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), every_n_train_steps=15,
                                             save_top_k=-1, filename="{step}")],
        logger=CSVLogger(out_dir, name="csv"), enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=2,
    )
    trainer.fit(TinyRegressor(), tiny_loader(n=320), tiny_loader(n=64))
    close_process_group()
