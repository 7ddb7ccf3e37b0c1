"""NVIDIA GPU energy through NVML (``pynvml`` from the ``nvidia-ml-py`` distribution).

Volta and newer: the total-energy counter ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver
load, updated about every 0.1 s). Older parts: ``nvmlDeviceGetPowerUsage`` (mW) polled and integrated.
At each sample the telemetry of the GPU power study is recorded where the card exposes it: utilisation,
memory utilisation, SM and memory clocks, power state, power, temperature and PCIe TX/RX throughput.
"""

from __future__ import annotations

import os
import time
from typing import Any

from lightning_energy.sensors.base import Sensor

NVML_COUNTER_UPDATE_PERIOD_S = 0.1  # the total-energy counter advances about every 100 ms
PCIE_READ_INTERVAL_S = 1.0  # each PCIe throughput query blocks ~20 ms in the driver: read it at most 1 Hz
MILLI = 1e-3


def load_pynvml():
    """Import ``pynvml`` and initialise NVML; raises ImportError/RuntimeError with a reason."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def nvml_index_for_cuda_device(pynvml, cuda_index: int) -> int:
    """The NVML index of CUDA device ``cuda_index`` after ``CUDA_VISIBLE_DEVICES`` (NVML ignores it).

    Matches by UUID when torch can report it, else maps through the ``CUDA_VISIBLE_DEVICES`` list
    (indices or ``GPU-``/``MIG-`` UUIDs).
    """
    uuid = _torch_uuid(cuda_index)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if uuid is None and visible:
        if cuda_index >= len(visible):
            raise RuntimeError(f"CUDA device {cuda_index} is not in CUDA_VISIBLE_DEVICES={','.join(visible)}")
        entry = visible[cuda_index]
        if entry.isdigit():
            return int(entry)
        uuid = entry
    if uuid is None:
        return cuda_index
    for i in range(pynvml.nvmlDeviceGetCount()):
        candidate = _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
        if candidate == uuid or candidate.startswith(uuid) or uuid.startswith(candidate):
            return i
    raise RuntimeError(f"no NVML device has the UUID {uuid} of CUDA device {cuda_index}")


def _torch_uuid(cuda_index: int) -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = torch.cuda.get_device_properties(cuda_index).uuid
        return f"GPU-{uuid}" if uuid is not None else None
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlGpuSensor(Sensor):
    """The energy of one NVIDIA GPU (scope ``"device"``), with per-sample telemetry."""

    def __init__(self, nvml_index: int, name: str | None = None, pynvml_module=None) -> None:
        super().__init__(name or f"gpu{nvml_index}", "device")
        self.nvml_index = nvml_index
        self._nvml = pynvml_module
        self._handle = None
        self._mode = "energy"
        self._telemetry: dict[str, Any] = {}
        self._last_pcie_read = -float("inf")
        self._pcie_fields = {"pcie_tx_KBps": float("nan"), "pcie_rx_KBps": float("nan")}

    @property
    def kind(self) -> str:
        return self._mode

    def identity(self) -> tuple:
        # not the kind: it is settled when the sensor opens (counter, or power on pre-Volta parts)
        return (type(self), self.name, self.nvml_index)

    def open(self) -> None:
        if self._handle is not None:
            return
        nvml = self._nvml = self._nvml or load_pynvml()
        self._handle = handle = nvml.nvmlDeviceGetHandleByIndex(self.nvml_index)
        gpu_name = _text(nvml.nvmlDeviceGetName(handle))
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self._mode = "energy"
            self.counter_update_period_s = NVML_COUNTER_UPDATE_PERIOD_S
            how = "nvmlDeviceGetTotalEnergyConsumption (energy counter)"
        except nvml.NVMLError:
            self._mode = "power"
            self.counter_update_period_s = None
            how = "nvmlDeviceGetPowerUsage polled and integrated (no energy counter on this GPU)"
        self.source = f"NVML {how} on GPU {self.nvml_index} ({gpu_name})"
        self._telemetry = self._supported_telemetry()

    def close(self) -> None:
        if self._nvml is not None and self._handle is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._handle = None

    def energy_j(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) * MILLI

    def power_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) * MILLI

    def read_fields(self) -> dict[str, float]:
        fields = {}
        for field, query in self._telemetry.items():
            try:
                fields.update(query())
            except Exception:
                fields[field] = float("nan")
        now = time.perf_counter()
        if self._pcie_supported and now - self._last_pcie_read >= PCIE_READ_INTERVAL_S:
            self._last_pcie_read = now
            self._pcie_fields = self._read_pcie()
            fields.update(self._pcie_fields)
        return fields

    def _supported_telemetry(self) -> dict[str, Any]:
        nvml, h = self._nvml, self._handle

        def utilisation():
            u = nvml.nvmlDeviceGetUtilizationRates(h)
            return {"gpu_util_pct": float(u.gpu), "mem_util_pct": float(u.memory)}

        queries = {
            "utilisation": utilisation,
            "sm_clock_MHz": lambda: {"sm_clock_MHz": float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))},
            "mem_clock_MHz": lambda: {"mem_clock_MHz": float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM))},
            "pstate": lambda: {"pstate": float(nvml.nvmlDeviceGetPerformanceState(h))},
            "power_W": lambda: {"power_W": nvml.nvmlDeviceGetPowerUsage(h) * MILLI},
            "temperature_C": lambda: {
                "temperature_C": float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
            },
        }
        supported = {}
        for field, query in queries.items():
            try:
                query()
                supported[field] = query
            except Exception:
                continue
        try:
            self._read_pcie()
            self._pcie_supported = True
        except Exception:
            self._pcie_supported = False
        return supported

    def _read_pcie(self) -> dict[str, float]:
        nvml, h = self._nvml, self._handle
        return {
            "pcie_tx_KBps": float(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)),
            "pcie_rx_KBps": float(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)),
        }
