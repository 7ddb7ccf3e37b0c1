"""Per-epoch thread CPU and wall seconds of a ``baler-lit fit`` run, for ``benchmarks/baler_speed.py``.

Added on the command line (``--trainer.callbacks+=benchmarks.baler_speed_timer.EpochTimes``); writes
``{"cpu_s": [...], "wall_s": [...]}`` to the file named by ``BALER_SPEED_EPOCH_TIMES`` at the end of the fit.
Thread CPU time counts only the training thread's own work, so a busy machine inflates it far less than wall time.
"""

from __future__ import annotations

import json
import os
import time

import lightning as L


class EpochTimes(L.Callback):
    def __init__(self) -> None:
        self.cpu_s: list[float] = []
        self.wall_s: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._cpu, self._wall = time.thread_time(), time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.cpu_s.append(time.thread_time() - self._cpu)
        self.wall_s.append(time.perf_counter() - self._wall)

    def on_fit_end(self, trainer, pl_module) -> None:
        with open(os.environ["BALER_SPEED_EPOCH_TIMES"], "w") as f:
            json.dump({"cpu_s": self.cpu_s, "wall_s": self.wall_s}, f)
