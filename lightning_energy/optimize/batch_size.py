"""Batch-size helpers shared by the batch-size search, Zeus's BSO client and the GPU simulator."""

from __future__ import annotations

from typing import Any


def batch_length(batch: Any) -> int | None:
    """Samples in a batch: the first dimension of its first tensor (None if there is none)."""
    import torch

    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() > 0 else None
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None
