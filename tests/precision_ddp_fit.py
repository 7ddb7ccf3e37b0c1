"""A 2-process DDP fit on CPU with PrecisionSwitch; run by test_precision.py as two ranks
forked by rank_zygote.py (by hand, Lightning relaunches it per rank).

Each rank's simulated power differs per mode, so that the ranks would pick different modes on their own;
rank 1 alone gets a NaN loss at step NAN_STEP. Every rank writes what it saw to ``<out_dir>/rank<N>.json``.
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from conftest import close_process_group, tiny_loader  # noqa: E402
from lightning_energy.callbacks.precision import PrecisionSwitch  # noqa: E402
from precision_helpers import SAMPLER_INTERVAL_S, FaultyRegressor, FollowMode, ModePowerSensor  # noqa: E402

# rank 0 alone: bf16-mixed cheapest; rank 1 alone: 16-mixed cheapest; summed: bf16-mixed (110 W vs 1001 W,
# a margin no timing difference between the modes' steps on a loaded machine can undo)
WATTS = [{"32-true": 400.0, "bf16-mixed": 10.0, "16-mixed": 1000.0},
         {"32-true": 400.0, "bf16-mixed": 100.0, "16-mixed": 1.0}]
NAN_STEP = 14


class Record(L.Callback):
    def __init__(self, out_dir, switch):
        self.out_dir, self.switch, self.modes = out_dir, switch, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.modes.append(trainer.precision_plugin.mode_name)

    def on_fit_end(self, trainer, pl_module):
        s = self.switch
        record = {"chosen": s.chosen, "profiles": s.profiles, "switches": s.switches, "modes": self.modes,
                  "finite_params": all(bool(torch.isfinite(p).all()) for p in pl_module.parameters())}
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as fh:
            json.dump(record, fh)


if __name__ == "__main__":
    out_dir = sys.argv[1]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sensor = ModePowerSensor(WATTS[rank])
    switch = PrecisionSwitch(candidates=["32-true", "bf16-mixed", "16-mixed"], tolerance=0.5, warmup_steps=1,
                             profile_steps=3, check_every_n_steps=2, sensors=[sensor], interval_s=SAMPLER_INTERVAL_S,
                             confidence=0.5, min_profile_rounds=1, noise_floor=False,  # real time, 3 steps: a bound of ~0.8 standard
                             verbose=False)  # errors; one round (the 1000x gaps need no confirmation)
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, default_root_dir=out_dir,
        callbacks=[switch, FollowMode(sensor, pause_s=0.05), Record(out_dir, switch)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=2,
    )
    model = FaultyRegressor(fault="nan", fault_step=NAN_STEP, fault_steps=1, ranks=(1,))
    trainer.fit(model, tiny_loader(n=320), tiny_loader(n=64))
    close_process_group()
