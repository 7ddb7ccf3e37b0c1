"""FitProbe: the training process's CPU time over a fit and its final weights, for ``recommend``'s held-out check
(:class:`~lightning_energy.optimize.recommend_config.HeldOutConfigRunner`)."""

from __future__ import annotations

import math
import time

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_energy.io import atomic_write_json


class FitProbe(Callback):
    """CPU time of the training process over the fit (s, ``time.process_time``: all its threads, the energy
    sampler's included) and the final weights, both written once, when the fit has ended.

    Args:
        probe_path: JSON written at the fit's end: ``{"cpu_s": ..., "epochs": ...}``.
        weights_path: the final weights (a Lightning checkpoint), for ``CLI test --ckpt_path``.
    """

    def __init__(self, probe_path: str, weights_path: str) -> None:
        super().__init__()
        self.probe_path, self.weights_path = probe_path, weights_path
        self._start: float | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.process_time()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        cpu_s = time.process_time() - self._start if self._start is not None else math.nan
        trainer.save_checkpoint(self.weights_path)
        if trainer.is_global_zero:
            atomic_write_json(self.probe_path, {"cpu_s": cpu_s, "epochs": trainer.current_epoch})
