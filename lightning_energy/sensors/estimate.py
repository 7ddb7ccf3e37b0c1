"""A labelled CPU power estimate for machines where nothing can be measured.

Model (CodeCarbon's CPU-load mode): P = TDP x (0.1 + 0.9 x load^3), with load the system-wide CPU
utilisation in [0, 1] from /proc/stat (psutil elsewhere). The TDP comes from the user, else from CodeCarbon's table of CPU
models (read as a data file, without importing codecarbon), else CodeCarbon's default of 85 W.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import platform
from pathlib import Path

from lightning_energy.sensors.base import Sensor

IDLE_FRACTION = 0.1  # CodeCarbon: a loaded CPU model draws at least 10 % of TDP
# /proc/stat counts in 10 ms ticks: a load measured over less than 0.1 s is mostly quantisation noise.
LOAD_READ_INTERVAL_S = 0.1
PROC_STAT = "/proc/stat"
LOAD_EXPONENT = 3  # CodeCarbon's cubic load curve
DEFAULT_TDP_W = 85.0  # CodeCarbon's POWER_CONSTANT when the CPU model is unknown


class CpuEstimateSensor(Sensor):
    """Estimated CPU power from TDP and load (scope ``"host"``, ``estimated=True``)."""

    estimated = True
    min_read_interval_s = LOAD_READ_INTERVAL_S

    def __init__(self, tdp_w: float | None = None, name: str = "cpu_estimate") -> None:
        if tdp_w is not None and not tdp_w > 0:
            raise ValueError(f"`tdp_w` must be > 0 W, got {tdp_w}")
        model = cpu_model_name()
        if tdp_w is not None:
            self.tdp_w, how = float(tdp_w), "given by the user"
        else:
            found = lookup_tdp_w(model)
            self.tdp_w, how = (found, "CodeCarbon's CPU table") if found else (DEFAULT_TDP_W, "default, CPU model unknown")
        self.cpu_model = model
        super().__init__(
            name,
            "host",
            source=f"ESTIMATE: TDP {self.tdp_w:g} W ({how}; CPU {model or 'unknown'}) x (0.1 + 0.9 load^3), system CPU load",
        )
        self._load = None

    def identity(self) -> tuple:
        return (*super().identity(), self.tdp_w)

    def open(self) -> None:
        if self._load is None:
            self._load = SystemLoad()

    def close(self) -> None:
        if self._load is not None:
            self._load.close()
            self._load = None

    def power_w(self) -> float:
        self.open()
        load = self._load.fraction()
        return self.tdp_w * (IDLE_FRACTION + (1 - IDLE_FRACTION) * load**LOAD_EXPONENT)

    def describe(self) -> dict:
        return {**super().describe(), "assumed_tdp_W": self.tdp_w, "cpu_model": self.cpu_model}


class SystemLoad:
    """System-wide CPU utilisation in [0, 1] since the previous call.

    On Linux the first line of /proc/stat is read through a file descriptor kept open (one ``pread``
    per call, a quarter of psutil's cost); elsewhere psutil.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open(PROC_STAT, os.O_RDONLY)
            self._previous = self._busy_total()
        except (OSError, ValueError, IndexError):
            self.close()
            import psutil

            self._psutil = psutil
            psutil.cpu_percent(interval=None)  # prime: the first call has no reference point

    def _busy_total(self) -> tuple[int, int]:
        first_line = os.pread(self._fd, 512, 0).split(b"\n", 1)[0]
        ticks = [int(v) for v in first_line.split()[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
        return total - idle, total

    def fraction(self) -> float:
        if self._fd is None:
            return self._psutil.cpu_percent(interval=None) / 100.0
        busy, total = self._busy_total()
        previous_busy, previous_total = self._previous
        self._previous = (busy, total)
        elapsed = total - previous_total
        return min(max((busy - previous_busy) / elapsed, 0.0), 1.0) if elapsed > 0 else 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform), '' if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def lookup_tdp_w(model: str) -> float | None:
    """TDP in W for the CPU model from CodeCarbon's ``cpu_power.csv`` (longest name contained in the model)."""
    if not model:
        return None
    spec = importlib.util.find_spec("codecarbon")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    table = Path(list(spec.submodule_search_locations)[0]) / "data" / "hardware" / "cpu_power.csv"
    if not table.exists():
        return None
    normalised = _normalise(model)
    best: tuple[int, float] | None = None
    with table.open(newline="") as fh:
        for row in csv.DictReader(fh):
            name = _normalise(row.get("Name", ""))
            if len(name) >= 4 and _contains_word(normalised, name):
                try:
                    tdp = float(row["TDP"])
                except (TypeError, ValueError):
                    continue
                if best is None or len(name) > best[0]:
                    best = (len(name), tdp)
    return best[1] if best else None


def _normalise(text: str) -> str:
    for noise in ("(R)", "(TM)", "CPU", "Processor", "@"):
        text = text.replace(noise, " ")
    return " ".join(text.lower().split())


def _contains_word(text: str, name: str) -> bool:
    padded = f" {text} "
    return f" {name} " in padded
