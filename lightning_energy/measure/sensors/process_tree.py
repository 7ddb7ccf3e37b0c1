"""Sensors for a process tree the meter does not run in: a command ``lightning-energy monitor`` started, or a
running process it attached to (``--pid``).

- :class:`ProcessTreeWatch`: the tree's PIDs (a root process and its descendants, listed again every
  ``rescan_s`` seconds) and their CPU seconds. Before :meth:`~ProcessTreeWatch.attach` it watches nothing.
- :class:`ProcessTreeCpuSensor`: the CPU estimate of :mod:`~lightning_energy.measure.sensors.cpu_model` in its
  ``"process"`` mode, charged for the tree's CPU time instead of this process's: ``P = TDP x (the tree's CPU
  seconds / wall seconds) / logical CPUs``; ``estimated``, with the same provenance label and report fields.
  What it misses: a descendant's CPU time between the last read and its exit (at most one read interval per
  process), and descendants that start and end between two listings of the tree (``rescan_s``).
- :class:`ProcessTreeGpuSensor`: one NVIDIA GPU, counted from the first read at which NVML lists a process of
  the tree among the GPU's compute processes (a CUDA context); until then it reads 0 J. Once counted, it is
  counted to the end (a training script's context lives until it exits). The read that first sees the
  context charges the whole interval before it (at most ``interval_s`` of the card's draw before the
  context was seen).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

from lightning_energy.measure.sensors.cpu_model import CpuEstimateSensor, ProcessLoad
from lightning_energy.measure.sensors.nvml import (
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NvmlError,
    NvmlGpuSensor,
    compute_process_pids,
    nvml_session,
    whole_gpu_indices,
)

TREE_RESCAN_S = 1.0  # how often the tree's descendants are listed again (s); the monitor process is otherwise idle


class ProcessTreeWatch:
    """A root process and its descendants: their PIDs and CPU seconds, shared by the sensors of one run.

    ``root_pid``: the tree's root (None: nothing until :meth:`attach`). ``rescan_s``: how often the
    descendants are listed (each listing reads every ``/proc/<pid>/stat``); in between only the known
    processes are read. ``clock`` (s) is injectable for tests. Safe to use from several threads.
    """

    def __init__(self, root_pid: int | None = None, rescan_s: float = TREE_RESCAN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import psutil

        self._psutil = psutil
        self._rescan_s = rescan_s
        self._clock = clock
        self._lock = threading.Lock()
        self._root = None
        self._processes: list = []
        self._scanned_at: float | None = None
        if root_pid is not None:
            self.attach(root_pid)

    @property
    def root_pid(self) -> int | None:
        return None if self._root is None else self._root.pid

    def attach(self, root_pid: int) -> None:
        """Watch ``root_pid`` and its descendants from now on (raises ``psutil.NoSuchProcess`` if it is gone)."""
        root = self._psutil.Process(root_pid)
        with self._lock:
            self._root, self._processes, self._scanned_at = root, [root], None

    def _current(self) -> list:
        """The tree's processes, listed again when the last listing is ``rescan_s`` old (lock held)."""
        now = self._clock()
        if self._root is not None and (self._scanned_at is None or now - self._scanned_at >= self._rescan_s):
            with contextlib.suppress(self._psutil.Error):
                self._processes = [self._root, *self._root.children(recursive=True)]
            self._scanned_at = now
        return self._processes

    def pids(self) -> set[int]:
        """The PIDs of the tree as last listed (empty before :meth:`attach`)."""
        with self._lock:
            return {process.pid for process in self._current()}

    def cpu_seconds(self) -> dict[int, float]:
        """CPU seconds (user + system) of each live process of the tree, by PID."""
        with self._lock:
            processes = list(self._current())
        out = {}
        for process in processes:
            with contextlib.suppress(self._psutil.Error):  # a process that has exited since the listing
                times = process.cpu_times()
                out[process.pid] = times.user + times.system
        return out


class ProcessTreeCpuSensor(CpuEstimateSensor):
    """The estimated CPU power of a process tree (scope ``"host"``, ``estimated=True``): CodeCarbon's
    process mode, charged for the tree of ``watch`` (see the module docstring). The other arguments are
    :class:`~lightning_energy.measure.sensors.cpu_model.CpuEstimateSensor`'s."""

    def __init__(self, watch: ProcessTreeWatch, tdp_w: float | None = None, name: str = "cpu_estimate",
                 cpu_model: str | None = None, threads: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(tdp_w=tdp_w, name=name, tracking_mode="process", cpu_model=cpu_model, threads=threads)
        self.watch = watch
        self._clock = clock
        self.source = (f"ESTIMATE, process mode: the command's process tree's share of the CPU time x TDP; "
                       f"TDP {self.tdp_w:g} W from {self.tdp_source}; CPU {self.cpu_model or 'unknown'}")

    def open(self) -> None:
        if self._load is None:
            self._opened = ProcessLoad(self.threads, cpu_times=self.watch.cpu_seconds, clock=self._clock)
            self._load = self._opened.fraction

    def describe(self) -> dict:
        return {**super().describe(), "tracking_mode": "process tree", "root_pid": self.watch.root_pid}


class ProcessTreeGpuSensor(NvmlGpuSensor):
    """One NVIDIA GPU by NVML index, counted once a process of ``watch``'s tree holds a CUDA context on it
    (see the module docstring). ``counted_from`` (set on the first such read): ``time.time()`` of that read.
    The counter is not shaped by the instant power (its reads before the context are 0 J while the power
    field reads the card's draw); marks from a monitored command's output are late by the pipe's latency
    anyway. Otherwise as :class:`~lightning_energy.measure.sensors.nvml.NvmlGpuSensor`."""

    def __init__(self, nvml_index: int, watch: ProcessTreeWatch, name: str | None = None,
                 pynvml_module=None) -> None:
        # the watched tree is "this process": its CUDA contexts are not another job's sharing the card
        super().__init__(nvml_index, name=name, pynvml_module=pynvml_module, own_pids=watch.pids)
        self.watch = watch
        self.counted_from: float | None = None
        self._counter_at_start_J: float | None = None

    def open(self) -> None:
        super().open()
        self.shaping_family = self.shape_power_field = self.shape_window_s = self.shape_lag_s = None
        self.source += "; counted from the first read at which a process of the command's tree uses this GPU"

    def _tree_uses_gpu(self) -> bool:
        pids = self.watch.pids()
        return bool(pids) and not pids.isdisjoint(compute_process_pids(self._nvml, self.nvml_index))

    def energy_j(self) -> float:
        """Cumulative energy in J since the tree was first seen on the GPU (0 J before)."""
        if self._counter_at_start_J is None:
            if not self._tree_uses_gpu():
                return 0.0
            self._counter_at_start_J = super().energy_j()
            self.counted_from = time.time()
            return 0.0
        return super().energy_j() - self._counter_at_start_J

    def power_w(self) -> float:
        """Power in W once the tree uses the GPU, 0 W before (a GPU without an energy counter)."""
        if self.counted_from is None:
            if not self._tree_uses_gpu():
                return 0.0
            self.counted_from = time.time()
        return super().power_w()

    def describe(self) -> dict:
        return {**super().describe(), "used_by_command": self.counted_from is not None,
                "counted_from_unix_s": self.counted_from}


def process_tree_gpu_sensors(watch: ProcessTreeWatch, pynvml_module=None) -> tuple[list[NvmlGpuSensor], list[str]]:
    """One :class:`ProcessTreeGpuSensor` per NVIDIA GPU whose energy can be read alone, and notes to show
    (GPUs in MIG mode, or why NVML cannot be read at all)."""
    try:
        if pynvml_module is None:
            import pynvml as pynvml_module
        with nvml_session(pynvml_module) as nvml:
            indices, notes = whole_gpu_indices(nvml)
    except ImportError:
        return [], []  # no NVIDIA binding: a machine without NVIDIA GPUs
    except NvmlError as err:
        if err.code == NVML_ERROR_LIBRARY_NOT_FOUND:
            return [], []  # no NVIDIA driver: a machine without NVIDIA GPUs
        return [], [f"NVML cannot be read ({err}); GPU energy is not counted."]
    return [ProcessTreeGpuSensor(index, watch, pynvml_module=pynvml_module) for index in indices], notes
