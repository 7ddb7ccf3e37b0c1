"""Who else runs this run: world size, this process's rank, and an all-gather passed in by the front end.

The core never imports a framework's distributed layer: the Lightning front end passes the Trainer's
strategy, Fabric its own collectives, the plain meter ``torch.distributed`` when it is initialised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Collective:
    """This process's place in a run of ``world_size`` processes.

    ``all_gather(value) -> list`` (one picklable value per rank, in rank order) is called by every rank
    at the same boundaries; None: a single process. ``local_rank``: the rank on this node (host sensors
    are read by local rank 0 only).
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    all_gather: Callable[[Any], list] | None = None

    @property
    def distributed(self) -> bool:
        """More than one process, with a gather to settle common figures."""
        return self.world_size > 1 and self.all_gather is not None

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    def gather(self, value: Any) -> list[Any]:
        """``value`` from every rank (a list of one in a single process). Collective: all ranks call it."""
        return list(self.all_gather(value)) if self.distributed else [value]


SINGLE_PROCESS = Collective()


def torch_distributed() -> Collective:
    """The default process group of ``torch.distributed`` if it is initialised, else a single process."""
    import os

    try:
        import torch.distributed as dist
    except ImportError:
        return SINGLE_PROCESS
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return SINGLE_PROCESS

    def all_gather(value: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered

    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return Collective(dist.get_world_size(), dist.get_rank(), local_rank, all_gather)
