"""The loss a training step would have had in full precision: ``training_step`` replayed without side effects.

Used by ``PrecisionSwitch`` to measure the loss gap of a reduced-precision mode on the very batch, weights
and random numbers of the real step. The replay runs before the real step under ``torch.no_grad`` in
``32-true``; the random number generators are forked (so dropout draws the same masks in both), logging
calls are ignored, and buffers (BatchNorm statistics) and torchmetrics states are put back afterwards.
``PrecisionSwitch`` runs it inside the step as the Trainer timeline's sub-window ``precision_probe``: it is
in no step figure, and is reported apart.

:func:`reference_step` also returns the float32 gradient of that loss with respect to the parameters
(``torch.autograd.grad``: the parameters' ``.grad`` are untouched), one more backward pass, for the
gradient comparison of :mod:`~lightning_energy.optimize.precision.gradients`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Generator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_energy.optimize.precision.modes import MODES, REFERENCE_MODE


_REPLAYING = contextvars.ContextVar("precision_probe_replaying", default=False)


def replaying() -> bool:
    """True while ``training_step`` runs as the probe's float32 replay (for a test or a model that must tell
    the replay from the real step; the replay computes gradients, so ``torch.is_grad_enabled()`` cannot)."""
    return _REPLAYING.get()


def reference_loss(trainer, pl_module, plugin, batch: Any, batch_idx: int) -> Tensor | None:
    """``training_step(batch, batch_idx)``'s loss in ``32-true``, detached (None if it returns no loss)."""
    return reference_step(trainer, pl_module, plugin, batch, batch_idx, gradients=False)[0]


def reference_step(trainer, pl_module, plugin, batch: Any, batch_idx: int,
                   gradients: bool = True) -> tuple[Tensor | None, list[Tensor | None] | None]:
    """``training_step(batch, batch_idx)``'s loss in ``32-true`` (detached) and, with ``gradients``, its
    gradient for each parameter that requires one (None for a parameter the loss does not reach; the list
    None when the loss is None or has no graph)."""
    device = trainer.strategy.root_device
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
    metric_states = _metric_states(pl_module)
    grads = None
    token = _REPLAYING.set(True)
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.set_grad_enabled(gradients), \
                plugin.mode_context(MODES[REFERENCE_MODE]), _silenced_logging(pl_module):
            output = pl_module.training_step(batch, batch_idx)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if gradients and isinstance(loss, Tensor) and loss.requires_grad:
                params = [p for p in pl_module.parameters() if p.requires_grad]
                grads = [None if g is None else g.detach()
                         for g in torch.autograd.grad(loss, params, allow_unused=True)]
    finally:
        _REPLAYING.reset(token)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        _restore_metric_states(metric_states)
    return (loss.detach() if isinstance(loss, Tensor) else None), grads


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
