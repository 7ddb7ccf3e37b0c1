"""Zeus's own epoch figure beside ours: ``ZeusMonitor`` windows opened and closed at the Trainer's epoch
hooks, next to the timeline's marks, so that both cover the same interval (validation left out)."""

from __future__ import annotations

from lightning_energy.measure import ranks


class ZeusEpochWindows:
    """The ``energy/zeus_epoch_J`` figure of each epoch (J, summed over ranks) from a ``ZeusBackend``."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._epochs: dict[int, float] = {}

    def epoch_started(self) -> None:
        self.backend.begin_epoch()

    def epoch_ended(self, trainer) -> None:
        """Close the epoch's window and sum it over ranks (collective)."""
        self.backend.pause_epoch()
        self._epochs[trainer.current_epoch] = sum(ranks.gather(trainer, self.backend.end_epoch()))

    def validation_started(self, trainer) -> None:
        if not trainer.sanity_checking:
            self.backend.pause_epoch()  # Zeus's epoch figure leaves validation out, like ours

    def validation_ended(self, trainer) -> None:
        if not trainer.sanity_checking:
            self.backend.resume_epoch()

    def take(self, epoch: int) -> float | None:
        """The epoch's figure (J), once; None if its window was never closed."""
        return self._epochs.pop(epoch, None)
