"""A 2-process DDP fit on CPU whose rank 0 does extra work at every epoch end; run by test_ddp.py.

argv: out_dir, "val" or "noval". Rank 0 sleeps at each epoch end (what a TensorBoard figure or a rank-0-only
callback costs), so the ranks reach the next epoch at different times; checkpointing is off.
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

DEVICE_W, HOST_W = 10.0, 20.0
RANK0_EPOCH_END_S = 0.3


class RankZeroEpochEndWork(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            time.sleep(RANK0_EPOCH_END_S)


if __name__ == "__main__":
    out_dir, validation = sys.argv[1], sys.argv[2] == "val"
    callback = EnergyCallback(
        sensors=[SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")],
        verbose=False,
    )
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=4, default_root_dir=out_dir,
        callbacks=[RankZeroEpochEndWork(), callback], enable_checkpointing=False,
        logger=CSVLogger(out_dir, name="csv"), enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=2, limit_val_batches=2 if validation else 0, num_sanity_val_steps=0,
    )
    trainer.fit(TinyRegressor(), tiny_loader(n=160), tiny_loader(n=64) if validation else None)
    close_process_group()
