"""The loss a training step would have had in full precision: ``training_step`` replayed without side effects.

Used by ``PrecisionSwitch`` to measure the loss gap of a reduced-precision mode on the very batch, weights
and random numbers of the real step. The replay runs before the real step under ``torch.no_grad`` in
``32-true``; the random number generators are forked (so dropout draws the same masks in both), logging
calls are ignored, and buffers (BatchNorm statistics) and torchmetrics states are put back afterwards.
``PrecisionSwitch`` runs it inside the step as the Trainer timeline's sub-window ``precision_probe``: it is
in no step figure, and is reported apart.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Generator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_energy.optimize.precision.modes import MODES, REFERENCE_MODE


def reference_loss(trainer, pl_module, plugin, batch: Any, batch_idx: int) -> Tensor | None:
    """``training_step(batch, batch_idx)``'s loss in ``32-true``, detached (None if it returns no loss)."""
    device = trainer.strategy.root_device
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
    metric_states = _metric_states(pl_module)
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad(), \
                plugin.mode_context(MODES[REFERENCE_MODE]), _silenced_logging(pl_module):
            output = pl_module.training_step(batch, batch_idx)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        _restore_metric_states(metric_states)
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss.detach() if isinstance(loss, Tensor) else None


@contextlib.contextmanager
def _silenced_logging(module) -> Generator[None, None, None]:
    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    module.log = ignore
    module.log_dict = ignore
    try:
        yield
    finally:
        del module.log
        del module.log_dict


def _metric_states(module) -> list[tuple[Any, dict]]:
    from torchmetrics import Metric

    saved = []
    for sub in module.modules():
        if isinstance(sub, Metric):
            extra = {k: getattr(sub, k) for k in ("_update_count", "_computed") if hasattr(sub, k)}
            saved.append((sub, {**copy.deepcopy(sub.metric_state), **copy.deepcopy(extra)}))
    return saved


def _restore_metric_states(saved: list[tuple[Any, dict]]) -> None:
    for metric, state in saved:
        for name, value in state.items():
            setattr(metric, name, value)
