"""A 2-process DDP fit of BalerModule on a streamed .npy (rows not divisible by 2); run by test_baler_streaming.py.

Column 0 of the data is the row number, so each rank can write which rows it trained on in every epoch
(``rank<r>.json``: per epoch the batch count, the loader's length and the row numbers). test_baler_streaming.py
forks the two ranks from rank_zygote.py; by hand, Lightning relaunches this script per rank.
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402

from conftest import close_process_group  # noqa: E402
from baler_lit.data import BalerDataModule  # noqa: E402
from baler_lit.module import BalerModule  # noqa: E402

ROWS, CHUNK_ROWS, WINDOW_CHUNKS, BATCH, VAL_FRACTION, EPOCHS = 1001, 128, 2, 32, 0.1, 2


class RowsSeen(L.Callback):
    """Row numbers of every training batch, per epoch (column 0 in physical units)."""

    def __init__(self) -> None:
        self.epochs: list[dict] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epochs.append({"batches": 0, "rows": [], "num_training_batches": trainer.num_training_batches})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first = pl_module.normalizer.inverse(batch[:, :1].cpu().numpy())[:, 0]
        self.epochs[-1]["batches"] += 1
        self.epochs[-1]["rows"] += np.rint(first).astype(int).tolist()


if __name__ == "__main__":
    out_dir, data = sys.argv[1], sys.argv[2]
    seen = RowsSeen()
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS, default_root_dir=out_dir,
                        callbacks=[seen], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    dm = BalerDataModule(data, batch_size=BATCH, val_fraction=VAL_FRACTION, streaming=True, chunk_rows=CHUNK_ROWS,
                         window_chunks=WINDOW_CHUNKS)  # fmt: skip
    model = BalerModule(input_shape=dm.input_shape, latent_dim=3, dtype="float64", lr_patience=None,
                        early_stopping_patience=None)  # fmt: skip
    trainer.fit(model, dm)
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as fh:
        json.dump({"world_size": trainer.world_size, "epochs": seen.epochs}, fh)
    close_process_group()
