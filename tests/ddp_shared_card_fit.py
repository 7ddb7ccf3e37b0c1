"""A 2-process DDP fit on CPU whose two ranks read ONE card (MPS, a mis-set CUDA_VISIBLE_DEVICES): each rank's
device sensor names the same card UUID; run by test_ddp.py (Lightning relaunches it per rank)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from conftest import close_process_group, TinyRegressor, tiny_loader  # noqa: E402
from lightning_energy import EnergyCallback, SimulatedSensor  # noqa: E402

CARD_W, HOST_W = 80.0, 25.0


class SharedCard(SimulatedSensor):
    """The whole card's power, as NVML gives it to every process on the card, named by the card's UUID."""

    device_uuid = "GPU-5f2a0c1e-0000-4000-8000-000000000001"

    def describe(self) -> dict:
        return {**super().describe(), "device_uuid": self.device_uuid}


if __name__ == "__main__":
    out_dir = sys.argv[1]
    callback = EnergyCallback(sensors=[SharedCard("device", CARD_W), SimulatedSensor("host", HOST_W, scope="host")],
                              verbose=False, log_power_figure=False)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, default_root_dir=out_dir,
                        callbacks=[callback], logger=CSVLogger(out_dir, name="csv"), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=2)
    trainer.fit(TinyRegressor(), tiny_loader(n=320), tiny_loader(n=64))
    close_process_group()
