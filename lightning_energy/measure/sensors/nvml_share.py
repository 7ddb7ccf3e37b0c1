"""ESTIMATE: this process's share of a shared NVIDIA GPU's energy, split by the processes' SM utilisation.

:class:`NvmlProcessShareSensor` reads the card as :class:`~lightning_energy.measure.sensors.nvml.NvmlGpuSensor`
does (the same counter, or power on cards without one) and reports only the part of it that the split rule of
:mod:`lightning_energy.measure.sensors.shared_gpu` gives this process: its figures are ``estimated``.

**How the share is applied.** Every ``window_s`` (1 s by default), on the sampling thread, the sensor asks NVML
for the processes' utilisation samples (``nvmlDeviceGetProcessUtilization``) and sets the share from them. A
window's samples are known only at its end, so the share set at the end of one window splits the card's
energy of the next: the sensor's counter is ``sum over reads of (card energy since the last read) x (the share
in force)``, a counter that moves when the card's does (the series treats it as the card's, unshaped).

**Its error.** (1) The model: SM utilisation is time with a kernel running, not power (see
:mod:`~lightning_energy.measure.sensors.shared_gpu`); no bound is claimed for it. (2) NVML's samples: a process's
last sample counts for up to ``SAMPLE_HORIZON_S`` after it stops, so after the work moves between processes the
share follows within a window and the horizon (2 s by default); nothing below bounds this either. (3) The
window lag: when the share moves from ``s_prev`` to ``s`` at a window's end, the window's energy ``E`` was split
by ``s_prev`` while its own samples say ``s``: the figure differs from splitting each window by its own samples by
``E x (s - s_prev)``. Summed over windows since the sensor opened: ``describe()["split"]["lag_J"]``, and its
absolute sum ``timing_bound_J``, which bounds the lag's error where this process's true share in each window lay
between the two shares. At any one time the rule's shares of the processes on a card add up to one (when each is
told apart by PID); processes that each run this sensor set theirs at their own window ends, so their figures
add up to the card's within the sum of their timing bounds (tested on the fake NVML in
``tests/test_shared_gpu.py``).

**With the card's own sensor.** Its description carries the card's ``device_uuid``, as the card's sensor does,
so a report never counts one card twice: listed after ``NvmlGpuSensor`` (``sensors=[NvmlGpuSensor(0),
NvmlProcessShareSensor(0)]``, or beside the detected sensors:
``extra_sensors=[NvmlProcessShareSensor.for_cuda_device(0)]``) the share is shown but the total keeps the card's
measured figure; alone (``sensors=[NvmlProcessShareSensor(0), ...]``) the total holds this process's estimated
share.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from lightning_energy.measure.sensors.nvml import (
    NvmlError,
    NvmlGpuSensor,
    NvmlNotFoundError,
    is_absent,
    nvml_errors,
    nvml_index_of_cuda_device,
)
from lightning_energy.measure.sensors.shared_gpu import (
    DUE_SLACK_S,
    SHARE_WINDOW_S,
    SPLIT_UNSUPPORTED,
    PicklesWithoutLock,
    ShareRule,
    own_process_ids,
    samples_of,
)


class NvmlProcessShareSensor(PicklesWithoutLock, NvmlGpuSensor):
    """This process's estimated share of NVIDIA GPU ``nvml_index``'s energy (scope ``"device"``,
    ``estimated=True``; named ``gpu<index>_share`` by default). ``window_s``: how often (s) the share is set
    again from NVML's per-process samples; the other arguments are
    :class:`~lightning_energy.measure.sensors.nvml.NvmlGpuSensor`'s. ``share`` (0 to 1): the share in force;
    ``split_rule``: the rule that set it (:mod:`~lightning_energy.measure.sensors.shared_gpu`'s ``SPLIT_*``).
    Its telemetry: ``share_pct`` and ``other_processes`` (the card's other telemetry is its sensor's)."""

    estimated = True
    warns_when_shared = False  # its figure is the split: the card's own sensor warns

    def __init__(self, nvml_index: int, name: str | None = None, pynvml_module=None,
                 own_pids: Callable[[], Iterable[int]] | None = None, clock: Callable[[], float] | None = None,
                 window_s: float = SHARE_WINDOW_S) -> None:
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s > 0:
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        super().__init__(nvml_index, name or f"gpu{nvml_index}_share", pynvml_module, own_pids, clock)
        self.window_s = float(window_s)
        self.share = 1.0
        self.split_rule: str | None = None
        self._lock = threading.Lock()
        self._rule = ShareRule()
        self._utilisation: bool | None = None  # whether the card answers nvmlDeviceGetProcessUtilization
        self._card_J: float | None = None
        self._share_J = 0.0
        self._window_card_J = 0.0
        self._window_start_s = 0.0
        self.timing_bound_J = 0.0
        self.lag_J = 0.0
        self.windows = 0
        self.windows_by_rule: dict[str, int] = {}
        self.query_errors = 0
        self.last_query_error: str | None = None

    @classmethod
    def for_cuda_device(cls, cuda_index: int = 0, **kwargs) -> NvmlProcessShareSensor:
        """The split of the card behind this process's CUDA device ``cuda_index``, found by the CUDA -> NVML mapping
        that measurement uses (:func:`~lightning_energy.measure.sensors.nvml.nvml_index_of_cuda_device`; raises
        as it does). ``kwargs``: the constructor's other arguments."""
        return cls(nvml_index_of_cuda_device(cuda_index, kwargs.get("pynvml_module")), **kwargs)

    # ------------------------------------------------------------------ labels
    @property
    def source(self) -> str:
        """What is estimated, in words, with how many other processes the card was found shared with."""
        sharing = self.sharing
        if sharing is None or not sharing.checked:
            return self._plain_source
        if not sharing.shared:
            return self._plain_source + "; no other process found on the card so far"
        return self._plain_source + f"; the card was shared with up to {sharing.max_others} other process(es)"

    @source.setter
    def source(self, value: str) -> None:
        self._plain_source = value

    def describe(self) -> dict:
        with self._lock:
            split = {
                "rule": ("this process's SM utilisation / the sum over the card's processes, set every "
                         f"{self.window_s:g} s and applied to the card's energy until the next"),
                "window_s": self.window_s,
                "share": self.share,
                "split_rule": self.split_rule,
                "per_process_utilisation": self._utilisation,
                "windows": self.windows,
                "windows_by_rule": dict(self.windows_by_rule),
                # since the sensor opened; not tracked where the card has no counter (power polled)
                "timing_bound_J": self.timing_bound_J if self._mode == "energy" else None,
                "lag_J": self.lag_J if self._mode == "energy" else None,
                "query_errors": self.query_errors,
                "last_query_error": self.last_query_error,
            }
        return {**super().describe(), "split": split}

    # ------------------------------------------------------------------ life cycle
    def open(self) -> None:
        """Open the card (:meth:`NvmlGpuSensor.open`), then ask NVML for the processes' utilisation once: a card
        without it ("not supported", or a driver without the call) is split equally, and the source says so."""
        if self._handle is not None:
            return
        super().open()
        # the card's shaping model describes the card's power, not a share of it; its telemetry is its own sensor's
        self.shaping_family = self.shape_power_field = self.shape_window_s = self.shape_lag_s = None
        self._telemetry = {}
        self._pcie_supported = False
        card = self._plain_source
        self._utilisation = None
        self._rule = ShareRule()
        self._card_J, self._share_J, self._window_card_J = None, 0.0, 0.0
        self._window_start_s = self._sharing_clock()
        self._set_share(first=True)
        if self._utilisation is False:
            how = ("NVML has no per-process utilisation on this card (nvmlDeviceGetProcessUtilization not "
                   "supported), so it is split equally among the processes holding a CUDA context on it")
        else:
            how = (f"split every {self.window_s:g} s by this process's share of the processes' summed SM "
                   "utilisation (nvmlDeviceGetProcessUtilization; an idle card equally)")
        self.source = f"ESTIMATE: this process's share of {card}; {how}"

    # ------------------------------------------------------------------ readings
    def energy_j(self) -> float:
        """This process's estimated cumulative energy (J, from 0 at the first read): the card's energy since
        each read times the share in force."""
        card_J = super().energy_j()
        with self._lock:
            if self._card_J is not None:
                delta_J = max(card_J - self._card_J, 0.0)  # the card's counter never goes back (the series checks)
                self._share_J += delta_J * self.share
                self._window_card_J += delta_J
            self._card_J = card_J
            return self._share_J

    def power_w(self) -> float:
        """The card's power (W) times the share in force (cards without an energy counter)."""
        return super().power_w() * self.share

    def read_fields(self) -> dict[str, float]:
        """``other_processes`` and ``share_pct``; sets the share again when a window has passed (sampling thread)."""
        fields = self._sharing_fields()
        if self._sharing_clock() - self._window_start_s >= self.window_s - DUE_SLACK_S:
            self._set_share()
        fields["share_pct"] = 100.0 * self.share
        return fields

    def _set_share(self, first: bool = False) -> None:
        """End the window: the share from NVML's samples (or the equal split), and the timing bound of the window."""
        self._window_start_s = self._sharing_clock()
        sharing = self.sharing
        others = sharing.now if sharing is not None else None
        if self._utilisation is False:
            share, rule = 1.0 / ((others.count if others is not None else 0) + 1), SPLIT_UNSUPPORTED
        else:
            samples = self._utilisation_samples(first)
            if samples is None:  # the query failed this time: the share stands
                with self._lock:
                    self._window_card_J = 0.0
                return
            if self._utilisation is False:  # found absent at this first query
                share, rule = 1.0 / ((others.count if others is not None else 0) + 1), SPLIT_UNSUPPORTED
            else:
                own = self._own_pids() if self._own_pids is not None else own_process_ids()
                share, rule = self._rule.update(samples, own, others, self._window_start_s)
        with self._lock:
            if not first:
                change = share - self.share
                self.timing_bound_J += self._window_card_J * abs(change)
                self.lag_J += self._window_card_J * change
                self.windows += 1
                self.windows_by_rule[rule] = self.windows_by_rule.get(rule, 0) + 1
            self.share, self.split_rule = share, rule
            self._window_card_J = 0.0

    def _utilisation_samples(self, first: bool) -> list | None:
        """NVML's samples since the rule's timestamp (``[]``: ``NVML_ERROR_NOT_FOUND``, none); None when the
        query failed otherwise (counted). At the first query "not supported" or a missing call marks the card
        as having no per-process utilisation."""
        nvml = self._nvml
        if not hasattr(nvml, "nvmlDeviceGetProcessUtilization"):
            self._utilisation = False
            return []
        try:
            with nvml_errors(nvml, f"nvmlDeviceGetProcessUtilization on NVML GPU {self.nvml_index}"):
                raw = nvml.nvmlDeviceGetProcessUtilization(self._handle, self._rule.since_us)
        except NvmlNotFoundError:
            self._utilisation = True
            return []
        except NvmlError as err:
            if first and is_absent(err):
                self._utilisation = False
                return []
            with self._lock:
                self.query_errors += 1
                self.last_query_error = str(err)
            return None
        self._utilisation = True
        return samples_of(raw)
