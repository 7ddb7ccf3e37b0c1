"""One measurement session per Trainer: the run's :class:`~lightning_energy.core.run.RunSession`, keyed by
its Trainer, with the Trainer's ranks, device clock and device placement.

Every callback of the suite attaches to the session of its Trainer in ``setup`` and detaches in
``teardown``. The first to attach opens it; when the last callback detaches the session closes, so a
second ``fit`` on the same Trainer gets a fresh one.
"""

from __future__ import annotations

import weakref

from lightning.pytorch.utilities import rank_zero_warn

from lightning_energy.core.collective import Collective
from lightning_energy.core.run import Attachment, RunSession, sensors_for_rank
from lightning_energy.integration.timeline import TrainerTimeline
from lightning_energy.measure import ranks
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S, Sampler, get_sampler
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.clocks import device_clock
from lightning_energy.measure.sensors.detect import other_cuda_devices, other_device_sensors, other_devices_note

__all__ = ["Attachment", "TrainerSession", "attach", "detach", "rank_sensors", "session_of", "trainer_collective"]


def rank_sensors(trainer, sensors: list[Sensor] | None = None, backend: str = "auto"):
    """(sensors, notes, zeus backend) for this rank: host sensors on local rank 0 only."""
    root = trainer.strategy.root_device
    return sensors_for_rank(root.index if root.type == "cuda" else None, trainer.local_rank == 0, sensors, backend)


def trainer_collective(trainer) -> Collective:
    """The Trainer's ranks, gathering through its process group (a single process when none is initialised)."""
    distributed = trainer.world_size > 1 and ranks.initialised()
    return Collective(trainer.world_size, trainer.global_rank, trainer.local_rank,
                      (lambda value: ranks.gather(trainer, value)) if distributed else None)


class TrainerSession(RunSession):
    """The run session of one Trainer, shared by the callbacks attached to it; its ``timeline`` is the
    Trainer's view (:class:`~lightning_energy.integration.timeline.TrainerTimeline`) of the core timeline."""

    def __init__(self, trainer, sampler: Sampler, clock) -> None:
        super().__init__(sampler, clock, trainer_collective(trainer), trainer, on_train_start=self._note_other_devices)
        self.timeline = TrainerTimeline(self.timeline)

    def _note_other_devices(self, trainer) -> None:
        """Once per fit, when the model sits on its devices (train start, after the strategy and the module's
        own ``on_fit_start`` placed it): when the model has parameters on CUDA devices besides the root device
        (pipeline stages, layers placed by hand), their GPUs join the sensors of every callback whose sensors
        were auto-detected, measured from train start (their energy before it is not known: the fit's start
        counts as their first reading); one warning (rank zero) and a note in every callback's report say so,
        and that marks are timed on the root device's stream only. Callbacks given their own sensors are only
        told."""
        root = trainer.strategy.root_device
        module = trainer.lightning_module
        if root.type != "cuda" or module is None:
            return
        devices = other_cuda_devices(module, root)
        if not devices:
            return
        auto = [a for a in self.attachments.values() if a.auto]
        sensors, notes = other_device_sensors(module, root) if auto else ([], [])
        sensors = self.measure_from_now(sensors, auto)
        if sensors:
            notes[0] = (other_devices_note(root, devices, sensors) + " They are measured from train start, "
                        "for the callbacks whose sensors are auto-detected.")
        else:
            notes = [other_devices_note(root, devices, []) + " Give their sensors explicitly to measure them, "
                     "e.g. `EnergyCallback(sensors=[NvmlGpuSensor(nvml_index), ...])`.", *notes[1:]]
        for note in notes:
            rank_zero_warn(f"lightning-energy: {note}")
            for attachment in self.attachments.values():
                if note not in attachment.notes:
                    attachment.notes.append(note)


_SESSIONS: "weakref.WeakKeyDictionary[object, TrainerSession]" = weakref.WeakKeyDictionary()


def session_of(trainer) -> TrainerSession | None:
    """The open session of ``trainer``, if any callback is attached."""
    return _SESSIONS.get(trainer)


def attach(trainer, owner: object, sensors: list[Sensor] | None = None, backend: str = "auto",
           interval_s: float = DEFAULT_INTERVAL_S, cuda_events: bool = True) -> Attachment:
    """Attach ``owner`` to its Trainer's session (opening it) with this rank's sensors.

    ``sensors=None`` with ``backend="auto"``: the sensors another callback of this Trainer already uses
    by default (an EnergyCallback's own ``sensors``, or those detected once for the session), else
    auto-detected here. Host sensors are read on local rank 0 only.
    """
    session = _SESSIONS.get(trainer)
    if session is None:
        root = trainer.strategy.root_device
        clock = device_clock(root) if root.type == "cuda" and cuda_events else None
        session = _SESSIONS[trainer] = TrainerSession(trainer, get_sampler(), clock)
    zeus, notes = None, []
    if sensors is None and backend == "auto":
        chosen = _shared_default_sensors(trainer, owner, session)
        if chosen is None:
            chosen, notes, zeus = rank_sensors(trainer, None, backend)
            session.auto_sensors = chosen
    else:
        chosen, notes, zeus = rank_sensors(trainer, sensors, backend)
    attachment = Attachment(session, owner, list(chosen), list(notes), zeus, auto=sensors is None and backend == "auto")
    session.add(attachment, interval_s)
    return attachment


def detach(attachment: Attachment) -> None:
    """Detach its owner; the last callback to leave closes the session (and the sampler releases)."""
    session = attachment.session
    if session.remove(attachment.owner):
        for trainer, candidate in list(_SESSIONS.items()):
            if candidate is session:
                del _SESSIONS[trainer]


def _shared_default_sensors(trainer, owner, session: TrainerSession) -> list[Sensor] | None:
    for callback in trainer.callbacks:
        if callback is owner or not getattr(callback, "provides_default_sensors", False):
            continue
        user = getattr(callback, "user_sensors", None)
        if user is not None:
            return rank_sensors(trainer, user)[0]
    return session.auto_sensors
