"""A labelled CPU power estimate for machines where nothing can be measured, CodeCarbon's way.

**TDP.** Given by the user; else CodeCarbon's table of CPU models (``cpu_power.csv``, matched by
CodeCarbon's own fuzzy rule, ``codecarbon.core.cpu.TDP``); else, for a model the table does not know,
CodeCarbon's per-thread rule: ``DEFAULT_POWER_PER_CORE`` (4 W) x the logical CPUs (``count_cpus``, which
also honours a SLURM allocation). A 2-vCPU VM then gets 8 W, not a desktop part's 85 W. CodeCarbon (the
``carbon`` extra) is imported lazily and quietly, once (its import pulls pandas; amdsmi prints and CodeCarbon
warns about AMD GPUs where there are none: :func:`lightning_energy.extras.quiet_import`). Without it the
estimate still works: 4 W per logical CPU (``os.cpu_count``), and the TDP's source says that CodeCarbon is
not installed and which extra brings its table.

**Load** (``tracking_mode``, as CodeCarbon's):

- ``"process"`` (default): this process and its children (DataLoader workers) are charged their share
  of the machine: ``P = TDP x (their CPU seconds / wall seconds) / logical CPUs``, from their CPU times
  (psutil). Other users' processes on the machine cost this run nothing; an idle process draws 0 W.
- ``"machine"``: the whole machine's load (``/proc/stat``; psutil elsewhere) with CodeCarbon's curve
  ``P = TDP x (0.1 + 0.9 x load^3)``: what the CPU package draws, whoever runs on it.

The sensor's ``source`` (shown in every report) names the TDP, where it came from and the mode; its
:meth:`~CpuEstimateSensor.describe` adds ``tdp_source`` and ``tracking_mode`` to the JSON report.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from pathlib import Path
from typing import Callable

from lightning_energy.extras import install_command, is_installed, quiet_import
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.zeus_codecarbon_internals import codecarbon_cpu_matcher

IDLE_FRACTION = 0.1  # CodeCarbon, machine mode: a loaded CPU model draws at least 10 % of TDP
LOAD_EXPONENT = 3  # CodeCarbon's cubic load curve (machine mode)
# /proc/stat counts in 10 ms ticks: a load measured over less than 0.1 s is mostly quantisation noise.
LOAD_READ_INTERVAL_S = 0.1
PROC_STAT = "/proc/stat"
WATTS_PER_THREAD = 4.0  # CodeCarbon's DEFAULT_POWER_PER_CORE, used when codecarbon cannot be imported
#: the TDP's source without CodeCarbon (its CPU table and per-thread figure come with the ``carbon`` extra)
NO_CODECARBON_RULE = ("{threads} logical CPUs x {per_thread:g} W (CodeCarbon not installed, so no CPU table: "
                      f"{install_command('carbon')})")
TRACKING_MODES = ("process", "machine")

LoadReader = Callable[[], float]  # the load in [0, 1] since its previous call


class CpuEstimateSensor(Sensor):
    """Estimated CPU power from TDP and load (scope ``"host"``, ``estimated=True``).

    Args:
        tdp_w: the CPU's thermal design power (W); default: CodeCarbon's table, else its per-thread rule.
        name: sensor name.
        tracking_mode: ``"process"`` (this process and its children, their share of the machine) or
            ``"machine"`` (the whole machine's load); see the module docstring.
        cpu_model: the CPU's model name (default: ``/proc/cpuinfo``); for tests and for remote hosts.
        threads: logical CPUs (default: CodeCarbon's ``count_cpus``, else ``os.cpu_count``).
        load: a load reader returning the load in [0, 1] since its previous call (default: the mode's
            own, opened by :meth:`open`); for tests.
    """

    estimated = True
    min_read_interval_s = LOAD_READ_INTERVAL_S

    def __init__(self, tdp_w: float | None = None, name: str = "cpu_estimate", tracking_mode: str = "process",
                 cpu_model: str | None = None, threads: int | None = None, load: LoadReader | None = None) -> None:
        if tdp_w is not None and not tdp_w > 0:
            raise ValueError(f"`tdp_w` must be > 0 W, got {tdp_w}")
        if tracking_mode not in TRACKING_MODES:
            raise ValueError(f"`tracking_mode` must be one of {TRACKING_MODES}, got {tracking_mode!r}")
        if threads is not None and not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"`threads` must be a positive integer, got {threads!r}")
        self.cpu_model = cpu_model_name() if cpu_model is None else cpu_model
        self.threads = threads if threads is not None else logical_cpus()
        self.tracking_mode = tracking_mode
        if tdp_w is not None:
            self.tdp_w, self.tdp_source = float(tdp_w), "given by the user"
        else:
            self.tdp_w, self.tdp_source = cpu_tdp_w(self.cpu_model, self.threads)
        how = ("this process's share of the CPU time x TDP" if tracking_mode == "process"
               else "TDP x (0.1 + 0.9 load^3), the whole machine's load")
        super().__init__(name, "host", source=f"ESTIMATE, {tracking_mode} mode: {how}; TDP {self.tdp_w:g} W from "
                                               f"{self.tdp_source}; CPU {self.cpu_model or 'unknown'}")
        self._given_load = load
        self._load: LoadReader | None = load
        self._opened: SystemLoad | ProcessLoad | None = None

    def identity(self) -> tuple:
        return (*super().identity(), self.tdp_w, self.tracking_mode)

    def open(self) -> None:
        if self._load is None:
            self._opened = ProcessLoad(self.threads) if self.tracking_mode == "process" else SystemLoad()
            self._load = self._opened.fraction

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None
        self._load = self._given_load

    def power_w(self) -> float:
        self.open()
        return power_from_load(self.tdp_w, self._load(), self.tracking_mode)

    def describe(self) -> dict:
        return {**super().describe(), "assumed_tdp_W": self.tdp_w, "tdp_source": self.tdp_source,
                "tracking_mode": self.tracking_mode, "cpu_model": self.cpu_model, "threads": self.threads}


def power_from_load(tdp_w: float, load: float, tracking_mode: str) -> float:
    """CodeCarbon's CPU power (W) for a load in [0, 1]: ``TDP x load`` for a process's share of the
    machine, ``TDP x (0.1 + 0.9 x load^3)`` for the whole machine."""
    load = min(max(float(load), 0.0), 1.0)
    if tracking_mode == "process":
        return tdp_w * load
    return tdp_w * (IDLE_FRACTION + (1 - IDLE_FRACTION) * load**LOAD_EXPONENT)


# ---------------------------------------------------------------- TDP
def cpu_tdp_w(model: str, threads: int) -> tuple[float, str]:
    """(TDP in W, where it comes from) for a CPU model: CodeCarbon's table, else its per-thread rule."""
    known = lookup_tdp_w(model)
    if known is not None:
        return known
    table, _, per_thread = _codecarbon_cpu()
    if table is None:
        return threads * per_thread, NO_CODECARBON_RULE.format(threads=threads, per_thread=per_thread)
    rule = f"CodeCarbon's per-thread rule ({threads} threads x {per_thread:g} W: a CPU model not in its table)"
    return threads * per_thread, rule


def lookup_tdp_w(model: str) -> tuple[float, str] | None:
    """(TDP in W, "CodeCarbon's CPU table (<matched name>)") for the model, or None where the table (or
    CodeCarbon) does not know it. Matched by CodeCarbon's own rule (exact name, then token set)."""
    if not model:
        return None
    return _lookup_tdp_w(model)


@functools.lru_cache(maxsize=16)
def _lookup_tdp_w(model: str) -> tuple[float, str] | None:
    table, matcher, _ = _codecarbon_cpu()
    if table is None:
        return None
    match = matcher(model, table)
    if not match:
        return None
    return float(table[table["Name"] == match]["TDP"].values[0]), f"CodeCarbon's CPU table ({match})"


@functools.lru_cache(maxsize=1)
def _codecarbon_cpu():
    """(CPU power table, CodeCarbon's matching function, W per thread); (None, None, 4.0) without CodeCarbon."""
    if not is_installed("codecarbon"):
        return None, None, WATTS_PER_THREAD
    try:
        with quiet_import():
            from codecarbon.core.cpu import DEFAULT_POWER_PER_CORE, TDP
            from codecarbon.input import DataSource

            table = DataSource().get_cpu_power_data()
        matcher = codecarbon_cpu_matcher(TDP)  # the rule TDP() applies to the detected model
    except (ImportError, AttributeError, OSError, ValueError):
        return None, None, WATTS_PER_THREAD
    return table, matcher, float(DEFAULT_POWER_PER_CORE)


def logical_cpus() -> int:
    """Logical CPUs as CodeCarbon counts them (a SLURM job's allocation where there is one)."""
    count = None
    if is_installed("codecarbon"):
        try:
            with quiet_import():
                from codecarbon.core.util import count_cpus

                count = count_cpus()
        except Exception:  # scontrol failing, a broken install: the machine's own count
            count = None
    return int(count) if count else (os.cpu_count() or 1)


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform), '' if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


# ---------------------------------------------------------------- load
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


class ProcessLoad:
    """This process's and its children's share of the machine's CPU capacity in [0, 1] since the previous
    call: their CPU seconds (user + system, per process since it was last seen) over wall seconds x
    logical CPUs, as CodeCarbon's process mode. ``cpu_times`` and ``clock`` are injectable for tests."""

    def __init__(self, threads: int, cpu_times: Callable[[], dict[int, float]] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.threads = threads
        self._cpu_times = cpu_times if cpu_times is not None else ProcessTree()
        self._clock = clock if clock is not None else time.monotonic
        self._previous = self._cpu_times()
        self._previous_t = self._clock()
        if cpu_times is None and clock is None:
            self._since_process_start()

    def _since_process_start(self) -> None:
        """Make the first reading this process's mean share since it started, not a few milliseconds' worth
        of 10 ms CPU-time ticks (the sensor is opened just before its first read)."""
        import psutil

        with contextlib.suppress(psutil.Error, OSError):
            me = psutil.Process()
            lived_s = time.time() - me.create_time()
            if lived_s > 0:
                self._previous[me.pid] = 0.0
                self._previous_t -= lived_s

    def fraction(self) -> float:
        now, times = self._clock(), self._cpu_times()
        elapsed = now - self._previous_t
        used = sum(max(t - self._previous.get(pid, t), 0.0) for pid, t in times.items())
        self._previous, self._previous_t = times, now
        return min(max(used / (elapsed * self.threads), 0.0), 1.0) if elapsed > 0 else 0.0

    def close(self) -> None:
        pass


CHILDREN_RESCAN_S = 5.0  # how often the list of child processes is refreshed (s): DataLoader workers and
# other children count from the first read after this period at the latest


class ProcessTree:
    """CPU seconds (user + system) of this process and of each of its children, by pid.

    Listing the children scans every pid's ``/proc/<pid>/stat`` (psutil's ``children``: ~9 ms on a 2-vCPU
    VM, 80 processes), too slow for a sensor read at 10-20 Hz on the sampling thread, where it holds the
    GIL the training thread needs: the list is refreshed at most every ``rescan_s`` seconds and in between
    only the known children are read (one stat file each); this process's own times come from ``os.times``.
    ``clock`` is injectable for tests.
    """

    def __init__(self, rescan_s: float = CHILDREN_RESCAN_S, clock: Callable[[], float] | None = None) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._children: list = []
        self._rescan_s = rescan_s
        self._clock = clock if clock is not None else time.monotonic
        self._scanned_at: float | None = None

    def __call__(self) -> dict[int, float]:
        now = self._clock()
        if self._scanned_at is None or now - self._scanned_at >= self._rescan_s:
            with contextlib.suppress(self._psutil.Error):
                self._children = self._me.children(recursive=True)
            self._scanned_at = now
        own = os.times()  # this process, every thread: one system call, no /proc file to parse
        out = {self._me.pid: own.user + own.system}
        for process in self._children:
            with contextlib.suppress(self._psutil.Error):  # a child that has exited since the scan
                times = process.cpu_times()
                out[process.pid] = times.user + times.system
        return out
