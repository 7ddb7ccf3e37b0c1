"""What NVML's energy and power readings mean on each NVIDIA card family: the one table.

The energy counter (``nvmlDeviceGetTotalEnergyConsumption``, Volta and newer) advances about every
``NVML_COUNTER_UPDATE_PERIOD_S``. From Ampere on, the card's power sensor observes only part of each
counter period, and the instant power field (``NVML_FI_DEV_POWER_INSTANT``) is the mean power over that
observed window, ending some lag before each of the field's refreshes; the series uses the window and lag to
share each counter period's exact energy out across step boundaries
(``lightning_energy.measure.sensors.nvml.NvmlGpuSensor.shape_window_s``).

Those figures were measured on one card only (``benchmarks/nvml_semantics.py`` on an H200, driver
580.159.04: ``benchmarks/results/nvml_semantics*.json``). Every other family below reuses them and says so
(``measured=False``): run the benchmark on a card of that family, and replace its row with what it finds.
Grace Hopper in C2C mode has a row of its own: its counter and the power it is shaped by are the whole
module's (GPU, Grace CPU and memory: ``NVML_POWER_SCOPE_MODULE``), a different sensor from the GPU's.

Also here: which parts answer ``nvmlDeviceGetPowerUsage`` with a 1-s average. NVML's API reference: "On
Ampere (except GA100) or newer GPUs, the API returns power averaged over 1 sec interval. On GA100 and older
architectures, instantaneous power is returned."
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# nvml.h's nvmlDeviceArchitecture_t values (pynvml's NVML_DEVICE_ARCH_*), used directly so that a pynvml that
# predates a name still maps correctly
NVML_DEVICE_ARCH_VOLTA = 5
NVML_DEVICE_ARCH_TURING = 6
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_ADA = 8
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10
NVML_DEVICE_ARCH_UNKNOWN = 0xFFFFFFFF

NVML_COUNTER_UPDATE_PERIOD_S = 0.1  # the total-energy counter advances about every 100 ms (every family)

MEASURED_ON_H200 = ("measured on an NVIDIA H200, driver 580.159.04 (benchmarks/nvml_semantics.py: "
                    "benchmarks/results/nvml_semantics*.json)")
ASSUMED_FROM_H200 = "assumed, not measured: the H200's figures (driver 580.159.04) reused"

# GA100 parts (A100, A100X, A800, A30, A30X): nvmlDeviceGetPowerUsage is instantaneous there, as on older parts
GA100_NAME = re.compile(r"\bA(100|800|30)X?\b")


@dataclass(frozen=True)
class ShapingFamily:
    """How one family's instant power relates to its energy counter.

    ``period_s``: the counter's (and the instant field's) update period; ``window_s``: the stretch of each
    period the power sensor observes, whose mean the instant field holds; ``lag_s``: how long before each
    refresh of the field that window ends; ``provenance``: where these figures come from.
    """

    family: str
    period_s: float
    window_s: float
    lag_s: float
    measured: bool
    provenance: str

    def describe(self) -> str:
        """One line for a sensor's source: the family, its figures, and whether they were measured."""
        return (f"{self.family}: {self.window_s * 1000:g} ms windows ending {self.lag_s * 1000:g} ms before each "
                f"{self.period_s * 1000:g} ms refresh, {self.provenance}")


def _family(family: str, measured: bool) -> ShapingFamily:
    return ShapingFamily(family, period_s=NVML_COUNTER_UPDATE_PERIOD_S, window_s=0.025, lag_s=0.011,
                         measured=measured, provenance=MEASURED_ON_H200 if measured else ASSUMED_FROM_H200)


SHAPING_FAMILIES: dict[int, ShapingFamily] = {
    NVML_DEVICE_ARCH_AMPERE: _family("Ampere", measured=False),
    NVML_DEVICE_ARCH_ADA: _family("Ada Lovelace", measured=False),
    NVML_DEVICE_ARCH_HOPPER: _family("Hopper", measured=True),
    NVML_DEVICE_ARCH_BLACKWELL: _family("Blackwell", measured=False),
}
GRACE_MODULE = _family("Grace superchip module (C2C mode: GPU, Grace CPU and memory)", measured=False)


def shaping_family(architecture: int | None, module_scope: bool = False) -> ShapingFamily | None:
    """The row for a card of ``architecture`` (``nvmlDeviceGetArchitecture``), or None where its power
    sensor is not known to observe windows (before Ampere, or architecture unknown): no shaping there.

    ``module_scope``: a Grace superchip module in C2C mode (GH200) (counter and power of the whole module). An
    architecture newer than the table's gets the H200's figures, labelled as assumed for that architecture.
    """
    if architecture in (None, NVML_DEVICE_ARCH_UNKNOWN) or architecture < NVML_DEVICE_ARCH_AMPERE:
        return None
    if module_scope:
        return GRACE_MODULE
    known = SHAPING_FAMILIES.get(architecture)
    if known is not None:
        return known
    if architecture > max(SHAPING_FAMILIES):
        return _family(f"architecture {architecture} (newer than this table)", measured=False)
    return None


def is_ga100(gpu_name: str) -> bool:
    """Whether ``nvmlDeviceGetName`` names a GA100 part (A100, A100X, A800, A30, A30X)."""
    return GA100_NAME.search(gpu_name) is not None


def power_usage_is_average(architecture: int | None, gpu_name: str) -> bool:
    """Whether ``nvmlDeviceGetPowerUsage`` is a 1-s average: Ampere and newer except GA100 (NVML's API
    reference); also where the architecture is unknown, unless the name says GA100."""
    if is_ga100(gpu_name):
        return False
    return architecture in (None, NVML_DEVICE_ARCH_UNKNOWN) or architecture >= NVML_DEVICE_ARCH_AMPERE
