"""CPU package and DRAM energy from RAPL powercap counters (Intel ``intel-rapl``, AMD ``amd-rapl``).

Each zone directory under ``/sys/class/powercap`` holds ``name`` (``package-0``, ``dram`` ...),
``energy_uj`` (a counter in microjoules that wraps at ``max_energy_range_uj``). Package zones and their
``dram`` sub-zones are read; ``core``/``uncore`` sub-zones are skipped because the package already
includes them. Counters are host-wide (scope ``"host"``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.units import J_PER_UJ

POWERCAP_ROOT = Path("/sys/class/powercap")


@dataclass(frozen=True)
class RaplZone:
    path: Path
    label: str  # e.g. "package-0", "package-0/dram"


class RaplSensor(Sensor):
    """One RAPL zone as a cumulative counter in joules, with wrap-around handled."""

    def __init__(self, zone: RaplZone) -> None:
        name = "cpu_" + zone.label.replace("/", "_").replace("-", "")
        super().__init__(name, "host", source=f"RAPL powercap {zone.path}/energy_uj")
        self.zone = zone
        self._max_range_uj = int((zone.path / "max_energy_range_uj").read_text())
        self._last_raw_uj: int | None = None
        self._wraps = 0

    def identity(self) -> tuple:
        return (*super().identity(), str(self.zone.path))

    def _read_raw_uj(self) -> int:
        return int((self.zone.path / "energy_uj").read_text())

    def energy_j(self) -> float:
        raw = self._read_raw_uj()
        if self._last_raw_uj is not None and raw < self._last_raw_uj:
            self._wraps += 1
        self._last_raw_uj = raw
        return (self._wraps * self._max_range_uj + raw) * J_PER_UJ


def find_rapl_zones(root: Path = POWERCAP_ROOT) -> tuple[list[RaplZone], list[Path]]:
    """The package and DRAM zones under ``root``: (readable zones, zones that exist but are unreadable)."""
    readable, unreadable = [], []
    if not root.is_dir():
        return readable, unreadable
    for top in sorted(root.glob("*-rapl:*")):
        if top.name.count(":") != 1:
            continue
        package = _zone_name(top)
        if package is None or not package.startswith("package"):
            continue
        candidates = [(top, package)]
        for sub in sorted(top.glob(f"{top.name}:*")):
            if _zone_name(sub) == "dram":
                candidates.append((sub, f"{package}/dram"))
        for path, label in candidates:
            energy_file = path / "energy_uj"
            if not energy_file.exists():
                continue
            if os.access(energy_file, os.R_OK) and _readable(energy_file):
                readable.append(RaplZone(path, label))
            else:
                unreadable.append(energy_file)
    return readable, unreadable


def unreadable_rapl_message(paths: list[Path]) -> str:
    return (
        f"RAPL energy counters exist but are not readable ({', '.join(map(str, paths[:3]))}"
        f"{' ...' if len(paths) > 3 else ''}); CPU energy falls back to an estimate. To measure it, run "
        "`sudo chmod a+r /sys/class/powercap/*-rapl:*/energy_uj /sys/class/powercap/*-rapl:*/*-rapl:*/energy_uj` "
        "(resets at reboot; a udev rule makes it permanent) or run training as root."
    )


def _zone_name(path: Path) -> str | None:
    try:
        return (path / "name").read_text().strip()
    except OSError:
        return None


def _readable(path: Path) -> bool:
    try:
        int(path.read_text())
        return True
    except (OSError, ValueError):
        return False
