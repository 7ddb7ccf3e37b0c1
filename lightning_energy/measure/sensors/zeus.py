"""Zeus as an alternative measurement backend, to cross-check our figures on the same run.

``ZeusBackend`` holds one ``zeus.monitor.ZeusMonitor`` for this rank's GPU (and the CPU packages on
local rank 0). Its sensors read energy through the monitor's own device objects (the same calls
``ZeusMonitor.end_window`` makes), so that every window of ours is a Zeus measurement; in addition the
callback reports Zeus's own figure for each training epoch beside ours, from real ``begin_window`` /
``end_window`` calls over the same interval as ``energy/epoch_J``: the window is closed while validation
runs and reopened after it. Zeus is imported lazily: importing it pulls ``amdsmi``, which prints when
ROCm is absent.
"""

from __future__ import annotations

import contextlib
import io

from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.units import J_PER_MJ, W_PER_MW

ZEUS_EPOCH_WINDOW = "lightning_energy_epoch"


def _import_zeus_monitor():
    with contextlib.redirect_stdout(io.StringIO()):  # amdsmi prints to stdout without ROCm
        from zeus.monitor import ZeusMonitor
    return ZeusMonitor


class ZeusBackend:
    """One ZeusMonitor for this rank: GPU ``cuda_index`` (if any) and CPU packages (if ``with_cpu``)."""

    def __init__(self, cuda_index: int | None, with_cpu: bool, monitor=None) -> None:
        if monitor is None:
            ZeusMonitor = _import_zeus_monitor()
            monitor = ZeusMonitor(
                gpu_indices=[cuda_index] if cuda_index is not None else [],
                cpu_indices=None if with_cpu else [],
            )
        self.monitor = monitor
        self.cuda_index = cuda_index
        self._epoch_J = 0.0
        self._in_epoch = False
        self._window_open = False

    def sensors(self) -> list[Sensor]:
        found: list[Sensor] = []
        gpus = self.monitor.gpus
        for index in self.monitor.gpu_indices:
            found.append(ZeusGpuSensor(gpus, index))
        for index in self.monitor.cpu_indices:
            found.append(ZeusCpuSensor(self.monitor.cpus, index, dram=False))
            if self.monitor.cpus.supports_get_dram_energy_consumption(index):
                found.append(ZeusCpuSensor(self.monitor.cpus, index, dram=True))
        return found

    def begin_epoch(self) -> None:
        """Start a training epoch: open a Zeus window."""
        self._epoch_J, self._in_epoch = 0.0, True
        self._open_window()

    def pause_epoch(self) -> None:
        """Validation starts inside the epoch: close the window, keep its energy."""
        if self._window_open:
            self._close_window()

    def resume_epoch(self) -> None:
        """Validation ended: reopen the window if the epoch is still running."""
        if self._in_epoch and not self._window_open:
            self._open_window()

    def end_epoch(self) -> float:
        """Zeus's own energy (J) of the training epoch without its validation, GPU + CPU + DRAM."""
        self.pause_epoch()
        self._in_epoch = False
        return self._epoch_J

    def _open_window(self) -> None:
        self.monitor.begin_window(ZEUS_EPOCH_WINDOW, sync_execution=False, restart=True)
        self._window_open = True

    def _close_window(self) -> None:
        m = self.monitor.end_window(ZEUS_EPOCH_WINDOW, sync_execution=False)
        self._window_open = False
        self._epoch_J += (sum(m.gpu_energy.values()) + sum((m.cpu_energy or {}).values())
                          + sum((m.dram_energy or {}).values()))


class ZeusGpuSensor(Sensor):
    """A GPU read through Zeus's device layer: energy counter, or power for pre-Volta parts."""

    def __init__(self, gpus, index: int) -> None:
        super().__init__(f"zeus_gpu{index}", "device")
        self._gpus, self._index = gpus, index
        self._counter = gpus.supports_get_total_energy_consumption(index)
        self.counter_update_period_s = 0.1 if self._counter else None
        what = "getTotalEnergyConsumption" if self._counter else "getInstantPowerUsage (integrated)"
        self.source = f"Zeus ZeusMonitor device layer, GPU {index}, {what}"

    @property
    def kind(self) -> str:
        return "energy" if self._counter else "power"

    def energy_j(self) -> float:
        return self._gpus.get_total_energy_consumption(self._index) * J_PER_MJ

    def power_w(self) -> float:
        return self._gpus.get_instant_power_usage(self._index) * W_PER_MW


class ZeusCpuSensor(Sensor):
    """A CPU package (or its DRAM) read through Zeus's RAPL layer (wrap-around handled by Zeus)."""

    def __init__(self, cpus, index: int, dram: bool) -> None:
        part = "dram" if dram else "package"
        super().__init__(f"zeus_cpu{index}_{part}", "host", source=f"Zeus RAPL, CPU {index} {part}")
        self._cpus, self._index, self._dram = cpus, index, dram

    def energy_j(self) -> float:
        m = self._cpus.get_total_energy_consumption(self._index)
        value = m.dram_mj if self._dram else m.cpu_mj
        return float(value) * J_PER_MJ
