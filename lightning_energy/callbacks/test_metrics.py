"""TestMetrics: a test run's scalar metrics in a JSON file, for ``recommend``'s held-out check
(:class:`~lightning_energy.optimize.recommend_config.HeldOutConfigRunner`)."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_energy.io import atomic_write_json


class TestMetrics(Callback):
    """The test run's scalar metrics (``trainer.callback_metrics``, as floats) written to ``path`` (JSON) once,
    when the test ends.

    Args:
        path: the JSON file written.
    """

    __test__ = False  # not a pytest class

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                       if getattr(v, "numel", lambda: 1)() == 1}
            atomic_write_json(self.path, metrics)
