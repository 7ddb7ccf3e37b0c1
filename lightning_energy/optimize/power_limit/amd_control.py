"""An AMD GPU's power cap through amdsmi, behind the card interface :mod:`.gpu_control` drives (Zeus's ``GPU``
methods, in mW), so that ``PowerLimitOptimizer``, the sweep, the crash marker and ``lightning-energy
restore-power-limit`` treat AMD and NVIDIA cards alike.

amdsmi's units: ``amdsmi_get_power_cap_info`` and ``amdsmi_set_power_cap(handle, sensor_ind, cap)`` are in µW
(AMD SMI Python API reference); this object converts to and from the mW the controller uses. Setting a cap
writes the card's hwmon ``power1_cap``: root only (``AMDSMI_STATUS_NO_PERM`` otherwise). AMD GPUs have no
persistence mode: its getter and setter raise :class:`AmdSmiNotSupportedError`, which the controller takes as
"nothing to record or restore". A card in a compute partition mode other than SPX is refused, as for
measurement (its cap is the whole chip's, shared with every other partition).
"""

from __future__ import annotations

import os
from typing import Callable

from lightning_energy.measure.sensors.amdsmi import (
    AMDSMI_STATUS_NOT_SUPPORTED,
    AmdSmiNoPermissionError,
    AmdSmiNotSupportedError,
    _describe_gpu,
    _handle,
    acquire_library,
    amdsmi_errors,
    load_amdsmi,
    refuse_partition,
    release_library,
)

UW_PER_MW = 1000  # microwatts per milliwatt: amdsmi takes and reports power caps in µW
POWER_CAP_SENSOR = 0  # amdsmi_set_power_cap's sensor index: "Normally, this will be 0" (AMD)


class AmdSmiCard:
    """One AMD GPU by its amdsmi index (``amd-smi -g``), as :class:`.gpu_control.LimitController` drives it.

    Holds a share of amdsmi (:func:`~lightning_energy.measure.sensors.amdsmi.acquire_library`) until
    :meth:`close`. ``is_root``: whether this process may set caps (default: effective uid 0).
    """

    vendor = "amd"

    def __init__(self, amdsmi_index: int, amdsmi_module=None, is_root: Callable[[], bool] | None = None) -> None:
        self.gpu_index = amdsmi_index
        self._amdsmi = load_amdsmi() if amdsmi_module is None else amdsmi_module
        self._is_root = is_root or (lambda: os.geteuid() == 0)
        acquire_library(self._amdsmi)
        self._held = True
        try:
            self.handle = _handle(self._amdsmi, amdsmi_index)
            refuse_partition(self._amdsmi, self.handle, f"AMD GPU {amdsmi_index}")
            self._gpu = _describe_gpu(self._amdsmi, amdsmi_index, self.handle)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._held:
            self._held = False
            release_library(self._amdsmi)

    def _cap_info(self) -> dict:
        with amdsmi_errors(self._amdsmi, f"amdsmi_get_power_cap_info on AMD GPU {self.gpu_index}"):
            return self._amdsmi.amdsmi_get_power_cap_info(self.handle)

    def get_name(self) -> str:
        return self._gpu.name

    def card_uuid(self) -> str:
        """amdsmi's UUID of the card (the crash marker's key)."""
        return self._gpu.uuid

    def get_power_management_limit_constraints(self) -> tuple[int, int]:
        """(min, max) cap in mW."""
        info = self._cap_info()
        return int(info["min_power_cap"]) // UW_PER_MW, int(info["max_power_cap"]) // UW_PER_MW

    def get_power_management_limit(self) -> int:
        """The cap in force, mW."""
        return int(self._cap_info()["power_cap"]) // UW_PER_MW

    def get_default_power_management_limit(self) -> int:
        """The card's default cap, mW."""
        return int(self._cap_info()["default_power_cap"]) // UW_PER_MW

    def set_power_management_limit(self, power_limit_mw: int, block: bool = True) -> None:
        """Set the cap (mW); raises :class:`AmdSmiNoPermissionError` without root."""
        with amdsmi_errors(self._amdsmi, f"amdsmi_set_power_cap on AMD GPU {self.gpu_index}"):
            self._amdsmi.amdsmi_set_power_cap(self.handle, POWER_CAP_SENSOR, int(power_limit_mw) * UW_PER_MW)

    def get_persistence_mode(self) -> bool:
        raise AmdSmiNotSupportedError("AMD GPUs have no persistence mode", AMDSMI_STATUS_NOT_SUPPORTED)

    def set_persistence_mode(self, enabled: bool, block: bool = True) -> None:
        raise AmdSmiNotSupportedError("AMD GPUs have no persistence mode", AMDSMI_STATUS_NOT_SUPPORTED)

    def permission_problem(self) -> str | None:
        """Why this process cannot set the cap, or None when it can (read-only check)."""
        if self._is_root():
            return None
        return (f"setting AMD GPU {self.gpu_index}'s power cap writes its hwmon power1_cap, which only root may "
                "do; run as root (or `sudo amd-smi set -g <index> -o <W>` by hand)")


PERMISSION_ERRORS = (AmdSmiNoPermissionError,)
