"""A 2-process DDP fit on CPU whose rank 0 does extra work at every epoch end; run by test_ddp.py (once, its tests
sharing the report; two ranks forked by rank_zygote.py) and by benchmarks/fidelity.py (Lightning relaunches it).

argv: out_dir, validation ("val": after every epoch, "noval": none, "mixed": after every second epoch, so that
epochs with and without a validation loop follow each other), and optionally "card". Rank 0 sleeps at each epoch
end (what a TensorBoard figure or a rank-0-only callback costs), so the ranks reach the next epoch at different
times; checkpointing is off. With "card", each rank also reads ONE shared card (MPS, a mis-set
CUDA_VISIBLE_DEVICES): both ranks' ``card`` sensors name the same card UUID, which every all-rank figure must
count once.
"""

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from conftest import TinyRegressor, close_process_group, tiny_loader  # noqa: E402
from lightning_energy import EnergyCallback, SimulatedSensor  # noqa: E402

DEVICE_W, HOST_W, CARD_W = 10.0, 20.0, 80.0
EPOCHS = 4
VALIDATE_EVERY = {"val": 1, "mixed": 2}  # epochs between validation loops ("noval": none)
RANK0_EPOCH_END_S = 0.3


class SharedCard(SimulatedSensor):
    """The whole card's power, as NVML gives it to every process on the card, named by the card's UUID."""

    device_uuid = "GPU-5f2a0c1e-0000-4000-8000-000000000001"

    def describe(self) -> dict:
        return {**super().describe(), "device_uuid": self.device_uuid}


class RankZeroEpochEndWork(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            time.sleep(RANK0_EPOCH_END_S)


if __name__ == "__main__":
    out_dir, validation, *options = sys.argv[1:]
    sensors = [SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")]
    if "card" in options:
        sensors.append(SharedCard("card", CARD_W))
    every = VALIDATE_EVERY.get(validation)
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS, default_root_dir=out_dir,
        callbacks=[RankZeroEpochEndWork(), EnergyCallback(sensors=sensors, verbose=False)],
        enable_checkpointing=False, logger=CSVLogger(out_dir, name="csv"), enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=2, limit_val_batches=2 if every else 0,
        check_val_every_n_epoch=every or 1, num_sanity_val_steps=0,
    )
    trainer.fit(TinyRegressor(), tiny_loader(n=160), tiny_loader(n=64) if every else None)
    close_process_group()
