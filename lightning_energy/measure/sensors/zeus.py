"""Zeus as an alternative measurement backend, to cross-check our figures on the same run.

``ZeusBackend`` holds one ``zeus.monitor.ZeusMonitor`` for this rank's GPU (and the CPU packages on
local rank 0). Its sensors read energy through the monitor's own device objects (the same calls
``ZeusMonitor.end_window`` makes), so that every window of ours is a Zeus measurement; in addition the
callback reports Zeus's own figure for each training epoch beside ours, from real ``begin_window`` /
``end_window`` calls over the same interval as ``energy/epoch_J``: the window is closed while validation
runs and reopened after it. Zeus is imported lazily: importing it pulls ``amdsmi``, which prints when
ROCm is absent.

Which card: the project's own CUDA -> NVML mapping
(:func:`lightning_energy.measure.sensors.nvml.nvml_index_of_cuda_device`: torch's UUID, ``GPU-`` UUIDs in
``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``), and the monitor is given Zeus's device object for that NVML
index. Zeus's own ``get_gpus()`` would int-parse ``CUDA_VISIBLE_DEVICES`` (failing on UUID lists) and count
ordinals in NVML's order whatever ``CUDA_DEVICE_ORDER`` says.
"""

from __future__ import annotations

from unittest import mock

from lightning_energy.extras import check_installed, require
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.nvml import nvml_gpu_of_cuda_device
from lightning_energy.measure.sensors.nvml_families import NVML_COUNTER_UPDATE_PERIOD_S
from lightning_energy.units import J_PER_MJ, W_PER_MW

ZEUS_EPOCH_WINDOW = "lightning_energy_epoch"
ZEUS_FEATURE = "backend='zeus'"  # what needs Zeus here, as the user asked for it


def _import_zeus_monitor():
    """Zeus's ``ZeusMonitor``, imported quietly (amdsmi prints to stdout without ROCm); the ``zeus`` extra."""
    return require("zeus.monitor", ZEUS_FEATURE).ZeusMonitor


def _zeus_gpus(nvml_indices: list[int]):
    """Zeus's GPU collection (``zeus.device.gpu.GPUs``) over these NVML indices, in this order; NVML is
    initialised for its life as Zeus's own collection does (``NVIDIAGPUs``)."""
    from zeus.device.gpu.common import EmptyGPUs
    from zeus.device.gpu.nvidia import NVIDIAGPU, NVIDIAGPUs

    if not nvml_indices:
        return EmptyGPUs()

    class NvmlIndexedGpus(NVIDIAGPUs):
        def _init_gpus(self) -> None:  # instead of reading CUDA_VISIBLE_DEVICES
            self._gpus = [NVIDIAGPU(index) for index in nvml_indices]

    return NvmlIndexedGpus()


def zeus_monitor(nvml_index: int | None, with_cpu: bool):
    """A ``ZeusMonitor`` over NVML GPU ``nvml_index`` (its monitor index 0; none if None) and, if ``with_cpu``,
    the CPU packages. ``ZeusMonitor`` takes its GPUs from ``get_gpus()``, which reads ``CUDA_VISIBLE_DEVICES``
    itself: while the monitor is built, that call returns the collection of the mapped card instead. (A
    pre-Volta card, without a counter, makes the monitor start Zeus's ``PowerMonitor``, which calls
    ``get_gpus()`` again in a process of its own: Zeus's epoch figure for such a card follows Zeus's mapping;
    the sensors read the mapped card.)"""
    ZeusMonitor = _import_zeus_monitor()
    from zeus.monitor import energy as zeus_energy

    gpus = _zeus_gpus([] if nvml_index is None else [nvml_index])
    with mock.patch.object(zeus_energy, "get_gpus", lambda *args, **kwargs: gpus):
        return ZeusMonitor(gpu_indices=list(range(len(gpus))), cpu_indices=None if with_cpu else [])


class ZeusBackend:
    """One ZeusMonitor for this rank: GPU ``cuda_index`` (if any) and CPU packages (if ``with_cpu``).

    The GPU is found with the project's CUDA -> NVML mapping (``pynvml_module``: the NVML binding for it,
    default ``import pynvml``); ``nvml_index`` and ``device_uuid`` name the card. ``monitor``: a ready
    monitor (tests), whose GPU indices are then taken as they are.
    """

    def __init__(self, cuda_index: int | None, with_cpu: bool, monitor=None, pynvml_module=None) -> None:
        self.nvml_index: int | None = None
        self.device_uuid: str | None = None
        if monitor is None:
            check_installed("zeus", ZEUS_FEATURE)
            if cuda_index is not None:
                gpu = nvml_gpu_of_cuda_device(cuda_index, pynvml_module)
                self.nvml_index, self.device_uuid = gpu.nvml_index, gpu.uuid
            monitor = zeus_monitor(self.nvml_index, with_cpu)
        self.monitor = monitor
        self.cuda_index = cuda_index
        self._epoch_J = 0.0
        self._in_epoch = False
        self._window_open = False

    def sensors(self) -> list[Sensor]:
        found: list[Sensor] = []
        gpus = self.monitor.gpus
        for index in self.monitor.gpu_indices:
            found.append(ZeusGpuSensor(gpus, index, self.nvml_index, self.device_uuid))
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
    """A GPU read through Zeus's device layer: energy counter, or power for pre-Volta parts.

    ``index``: the GPU's index in the monitor's collection; ``nvml_index`` and ``device_uuid``: the card
    (None where a monitor was given ready-made); the sensor is named by the NVML index where known.
    On a Grace Hopper in C2C mode Zeus reads the whole module (GPU, Grace CPU and memory).
    """

    def __init__(self, gpus, index: int, nvml_index: int | None = None, device_uuid: str | None = None) -> None:
        super().__init__(f"zeus_gpu{index if nvml_index is None else nvml_index}", "device")
        self._gpus, self._index = gpus, index
        self.nvml_index, self.device_uuid = nvml_index, device_uuid
        self._counter = gpus.supports_get_total_energy_consumption(index)
        self.counter_update_period_s = NVML_COUNTER_UPDATE_PERIOD_S if self._counter else None
        what = "getTotalEnergyConsumption" if self._counter else "getInstantPowerUsage (integrated)"
        card = f"NVML GPU {nvml_index}" if nvml_index is not None else f"GPU {index}"
        self.source = f"Zeus ZeusMonitor device layer, {card}, {what}"

    @property
    def kind(self) -> str:
        return "energy" if self._counter else "power"

    def describe(self) -> dict:
        return {**super().describe(), "nvml_index": self.nvml_index, "device_uuid": self.device_uuid}

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
