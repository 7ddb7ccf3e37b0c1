"""EnergyMonitor: the energy of a Lightning Fabric loop, logged through Fabric's loggers.

::

    fabric = Fabric(accelerator="auto", devices=2, strategy="ddp", loggers=TensorBoardLogger("runs"))
    fabric.launch()
    with EnergyMonitor(fabric) as energy:
        for epoch in range(epochs):
            for batch in loader:
                ...; optimizer.step()
                energy.step()
            energy.epoch()

:class:`~lightning_energy.plain.EnergyMeter` with Fabric's parts: its loggers (``fabric.log_dict``, from
rank zero), its device, its ranks (objects gathered over the process group its strategy started), and the
first logger's directory for the report, trace and events files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_energy.core.collective import SINGLE_PROCESS, Collective
from lightning_energy.plain import DEFAULT_LOG_DIR, EnergyMeter


def fabric_collective(fabric) -> Collective:
    """Fabric's ranks; values gathered with ``torch.distributed.all_gather_object`` over the default process
    group that Fabric's strategy initialised (a single process when there is none)."""
    if fabric.world_size <= 1:
        return SINGLE_PROCESS
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return SINGLE_PROCESS

    def all_gather(value: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered

    return Collective(fabric.world_size, fabric.global_rank, fabric.local_rank, all_gather)


def fabric_log_dir(fabric) -> Path:
    """The first logger's directory (its ``log_dir``, else ``root_dir``), else ``energy_logs``. The logger's
    experiment is created first (rank zero), so that it does not find our files in its new version folder."""
    for logger in fabric.loggers:
        if fabric.global_rank == 0:
            getattr(logger, "experiment", None)
        folder = getattr(logger, "log_dir", None) or getattr(logger, "root_dir", None)
        if folder:
            return Path(folder)
    return Path(DEFAULT_LOG_DIR)


class EnergyMonitor(EnergyMeter):
    """An :class:`~lightning_energy.plain.EnergyMeter` for a ``lightning.fabric.Fabric`` loop (launched:
    ``fabric.launch()`` first; built on every rank, a collective). ``log_dir``: None for the first logger's
    directory (rank zero's); other arguments as ``EnergyMeter``'s (not ``writer``, ``device`` or
    ``collective``: Fabric's)."""

    def __init__(self, fabric, log_dir: str | Path | None = None, **kwargs: Any) -> None:
        for taken in ("writer", "device", "collective"):
            if taken in kwargs:
                raise TypeError(f"EnergyMonitor takes `{taken}` from the Fabric object; do not pass it")
        self.fabric = fabric
        collective = fabric_collective(fabric)
        # rank zero's folder on every rank (a logger's next version folder is found per rank otherwise: rank 1
        # would pick version_1 once rank 0 created version_0); collective, as every rank builds the monitor
        log_dir = collective.gather(str(log_dir if log_dir is not None else fabric_log_dir(fabric)))[0]
        super().__init__(log_dir, writer=fabric if fabric.loggers else None, device=fabric.device,
                         collective=collective, **kwargs)
