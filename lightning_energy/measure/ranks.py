"""Collectives for per-epoch figures: every rank's value gathered, merged by a fixed rule."""

from __future__ import annotations

from typing import Any


def initialised() -> bool:
    """Whether ``torch.distributed``'s default process group is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def gather(trainer, value: Any) -> list[Any]:
    """``value`` from every rank (a list of one outside distributed runs). Collective: all ranks call it."""
    if trainer.world_size <= 1 or not initialised():
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def merge(values: list[dict]) -> dict:
    """Merge per-rank dicts: numbers and per-sensor dicts are summed, lists concatenated, ``seconds`` takes
    the slowest rank."""
    merged: dict = {}
    for value in values:
        for key, item in value.items():
            if key == "seconds":
                merged[key] = max(merged.get(key, 0.0), item)
            elif isinstance(item, list):
                merged.setdefault(key, []).extend(item)
            elif isinstance(item, dict):
                bucket = merged.setdefault(key, {})
                for name, joules in item.items():
                    bucket[name] = bucket.get(name, 0.0) + joules
            else:
                merged[key] = merged.get(key, 0) + item
    return merged
