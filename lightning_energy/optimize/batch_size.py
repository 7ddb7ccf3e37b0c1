"""Batch-size helpers shared by the batch-size search, Zeus's BSO client, the FLOPs counter and the GPU simulator."""

from __future__ import annotations

from typing import Any

from lightning_energy.integration.lightning_internals import first_batch_size


def batch_length(batch: Any) -> int | None:
    """Samples in a batch as Lightning counts them for ``self.log``: the first dimension of its first tensor,
    depth first through sequences, mappings and dataclasses (a 0-d tensor counts 1); None if there is none."""
    return first_batch_size(batch)
