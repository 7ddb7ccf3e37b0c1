"""Other processes on this rank's GPU: telling them apart from this one, labelling a shared card's figures,
and the rule of the estimated split of its energy. No NVML call here: the sensors that query NVML
(:class:`~lightning_energy.measure.sensors.nvml.NvmlGpuSensor`,
:class:`~lightning_energy.measure.sensors.nvml_share.NvmlProcessShareSensor`) hand over what it answered.

**Why it matters.** NVML measures a whole card. When other processes compute on this rank's card (another
job on a shared node, a notebook holding a CUDA context, a second training script), every figure of the
card's sensor holds their energy too: two jobs on one card each get the whole card's energy.

**Who is another process.** NVML lists the processes holding a CUDA context on a card
(``nvmlDeviceGetComputeRunningProcesses``) by their PIDs in the host's PID namespace, from inside a container
too: "the nvidia-driver itself does not support pid-namespaces" (an NVIDIA maintainer, NVIDIA/nvidia-docker
#1483), so it lists every process on the card, other containers' included. This process's own PIDs are
``os.getpid()`` and, where ``/proc`` shows them, the PIDs of the ``NSpid`` line of ``/proc/self/status`` (this
process in each PID namespace that ``/proc`` sees; a container's own ``/proc`` shows only its own).
A launcher that knows this process's host PID can pass it (the sensors' ``own_pids``).
:func:`count_other_processes`:

- a listed PID is one of ours: the others are the rest (``rule == "matched"``);
- none is, and this process runs in a PID namespace of its own (a container: ``/proc/self/ns/pid`` is not
  the initial namespace's): NVML's PIDs cannot be told apart from ours, so one of the listed processes is
  taken to be this one and the others are one fewer (``"assumed"``); this counts one too few while this
  process holds no context on the card yet (before the model reaches it), which the next query corrects;
- none is, in the host's namespace: this process holds no CUDA context on the card (yet), every listed
  process is another (``"not listed"``).

Ranks of one job on one card (MPS) are other processes to each other: the card is labelled shared (the report
counts it once, by UUID). :class:`CardSharing` says which rule made each count.

**The label.** A card found shared at any query of the run stays labelled: its figures hold the other
processes' energy from whenever they ran. :meth:`CardSharing.label` is put before the sensor's ``source``
(shown on each sensor's row of the report) and :meth:`CardSharing.describe` goes into its ``describe()``
(the report's JSON); the first time a card is found shared, one warning goes to the ``lightning_energy``
logger (a log record, not a Python warning: it may be found on the sampling thread, where a warning filter
that raises would cost a reading).

**The split (estimated).** :class:`ShareRule` turns NVML's per-process utilisation samples
(``nvmlDeviceGetProcessUtilization``: for each process with non-zero utilisation, its latest sample of SM,
memory, encoder and decoder utilisation in %, each stamped with the driver's CPU time in µs, those newer
than a given timestamp; ``NVML_ERROR_NOT_FOUND`` when there are none) into this process's share of the card:

- each process's SM utilisation is its latest sample no older than :data:`SAMPLE_HORIZON_S` (nvidia-smi(1)
  gives 1/6 s to 1 s, by product, for its utilisation sample period, so one window may hold no new sample of a
  process still computing; NVML returns a stopped process's last sample again, so its age is what ends it);
  samples above 100 % (reported from NVML in Syllo/nvtop#110) are dropped;
- share = this process's SM utilisation / the sum over every sampled process (graphics processes
  included: they draw power too);
- no SM utilisation at all (``NVML_ERROR_NOT_FOUND``, or only memory/codec activity): the idle card is
  split equally among the processes holding a context on it, this one counted (``1 / (others + 1)``);
- this process's samples cannot be told apart (``"assumed"`` above: in a container, unless ``own_pids`` names
  its host PID): equal split too.

What the share leaves out, and so the error of the split: SM utilisation is the fraction of time a kernel
of the process ran, not how many SMs it kept busy nor how much power its kernels drew (a memory-bound
kernel and a tensor-core kernel of equal time weigh the same); the idle power is split by the same share;
and a share is known only once its samples are (see the sensor for how it is applied, and the timing
bound it reports).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

logger = logging.getLogger(__name__)

PROCESS_QUERY_INTERVAL_S = 2.0  # the card's compute processes are listed again at most this often (s)
SHARE_WINDOW_S = 1.0  # the split's share is updated at most this often (s), as nvidia-smi pmon's default period
SAMPLE_HORIZON_S = 1.0  # a process's latest sample counts this long (s): the longest sample period nvidia-smi(1) gives
MAX_PIDS_KEPT = 64  # other processes' PIDs kept for the report (a bound: short-lived processes may be many)
PROC_PID_INIT_INO = 0xEFFFFFFC  # the initial PID namespace's inode number (Linux >= 3.8, include/linux/proc_ns.h)
US_PER_S = 1_000_000  # NVML's utilisation timestamps count microseconds
DUE_SLACK_S = 1e-6  # a read due exactly at an interval is due (float noise of a clock summed from ticks)

RULE_MATCHED = "matched"  # this process's PID is among NVML's
RULE_ASSUMED = "assumed"  # in a PID namespace of its own: one of NVML's processes is taken to be this one
RULE_NOT_LISTED = "not listed"  # host namespace, this process not among NVML's: it holds no context there (yet)
RULE_NONE = "none listed"  # NVML lists no compute process on the card
RULES = {
    RULE_MATCHED: "this process's PID is among NVML's",
    RULE_ASSUMED: "this process runs in a PID namespace of its own, so its PID is not NVML's: one of the listed "
                  "processes is taken to be this one",
    RULE_NOT_LISTED: "this process holds no CUDA context on the card (yet): every listed process is another",
    RULE_NONE: "NVML lists no compute process on the card",
}

SPLIT_SM = "SM utilisation"  # share of the summed SM utilisation
SPLIT_IDLE = "idle: equal"  # no SM utilisation in the horizon: split equally
SPLIT_UNTOLD = "untold: equal"  # this process's samples cannot be told apart: split equally
SPLIT_UNSUPPORTED = "unsupported: equal"  # the card has no per-process utilisation: split equally


# ------------------------------------------------------------------------------------------- this process
_nspid_cache: tuple[int, frozenset[int]] | None = None


def own_process_ids() -> frozenset[int]:
    """This process's PIDs: ``os.getpid()`` and those of the ``NSpid`` line of ``/proc/self/status`` (the
    same process in each PID namespace ``/proc`` shows; one entry outside containers). Read once per PID."""
    global _nspid_cache
    pid = os.getpid()
    if _nspid_cache is not None and _nspid_cache[0] == pid:
        return _nspid_cache[1]
    pids = {pid}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    pids.update(int(p) for p in line.split()[1:] if p.isdigit())
                    break
    except OSError:
        pass  # no /proc (not Linux): os.getpid() alone
    _nspid_cache = (pid, frozenset(pids))
    return _nspid_cache[1]


def pid_namespace_is_initial() -> bool | None:
    """Whether this process runs in the initial (host) PID namespace, whose PIDs NVML reports; None where
    ``/proc`` does not say (not Linux)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == PROC_PID_INIT_INO
    except OSError:
        return None


class PicklesWithoutLock:
    """Copies and pickles (DDP spawn pickles the callbacks and their sensors) without ``_lock``, which cannot be
    copied: the copy gets a fresh one."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


@dataclass(frozen=True)
class OtherProcesses:
    """One listing's other processes: ``count``, their PIDs (``pids``; under ``"assumed"`` every listed PID,
    ours among them) and the ``rule`` that told them apart (see :func:`count_other_processes`)."""

    count: int
    pids: frozenset[int]
    rule: str
    listed: int  # how many processes NVML listed

    @property
    def identifiable(self) -> bool:
        """Whether this process's own samples can be found by PID."""
        return self.rule != RULE_ASSUMED


def count_other_processes(listed: Iterable[int], own: Iterable[int],
                          initial_namespace: bool | None) -> OtherProcesses:
    """The processes other than this one among NVML's ``listed`` PIDs (the rules in the module docstring).
    ``own``: this process's PIDs; ``initial_namespace``: :func:`pid_namespace_is_initial`."""
    listed = frozenset(int(p) for p in listed)
    mine = listed & frozenset(own)
    if mine:
        return OtherProcesses(len(listed - mine), listed - mine, RULE_MATCHED, len(listed))
    if not listed:
        return OtherProcesses(0, frozenset(), RULE_NONE, 0)
    if initial_namespace is False:
        return OtherProcesses(len(listed) - 1, listed, RULE_ASSUMED, len(listed))
    return OtherProcesses(len(listed), listed, RULE_NOT_LISTED, len(listed))


# ------------------------------------------------------------------------------------------- detection
class CardSharing(PicklesWithoutLock):
    """Whether other processes compute on one card, from NVML's listings over a run.

    The sensor asks :meth:`due` (at most every ``interval_s`` on ``clock``), queries NVML and hands the answer
    to :meth:`observe` (or :meth:`failed`). ``what``: the card in words, for the label and the warning;
    ``own_pids()``: this process's PIDs (default :func:`own_process_ids`); ``warn``: log the one warning of
    a shared card. Thread-safe: the sampling thread
    observes, the training thread describes; the lock guards bookkeeping only, never an NVML call.
    """

    def __init__(self, what: str, own_pids: Callable[[], Iterable[int]] | None = None,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = PROCESS_QUERY_INTERVAL_S,
                 warn: bool = True, namespace_is_initial: Callable[[], bool | None] | None = None) -> None:
        self.what = what
        self._own_pids = own_pids or own_process_ids
        self._clock = clock
        self.interval_s = interval_s
        self._namespace_is_initial = namespace_is_initial
        self._lock = threading.Lock()
        self._last_query_s = -float("inf")
        self.queries = 0
        self.errors = 0
        self.unchecked: str | None = None  # why NVML cannot list this card's processes (then never asked again)
        self.last_error: str | None = None
        self.now: OtherProcesses | None = None  # the latest listing's
        self.max_others = 0
        self.other_pids_seen: set[int] = set()
        self.other_pids_dropped = 0  # seen beyond MAX_PIDS_KEPT
        self.warned = not warn  # ``warn=False``: no warning (a sensor whose figure is the split itself)

    @property
    def checked(self) -> bool:
        """Whether NVML has listed this card's processes at least once."""
        return self.queries > 0

    @property
    def shared(self) -> bool:
        """Whether another process was found on the card at any listing so far."""
        return self.max_others > 0

    def due(self) -> bool:
        """Whether to list the card's processes now (and mark it done): never once NVML has said it cannot."""
        now = self._clock()
        if self.unchecked is not None or now - self._last_query_s < self.interval_s - DUE_SLACK_S:
            return False
        self._last_query_s = now
        return True

    def observe(self, listed: Iterable[int]) -> OtherProcesses:
        """NVML listed ``listed`` (PIDs) as the card's compute processes."""
        initial = (self._namespace_is_initial or pid_namespace_is_initial)()
        others = count_other_processes(listed, self._own_pids(), initial)
        with self._lock:
            self.queries += 1
            self.now = others
            if others.rule != RULE_ASSUMED:
                for pid in sorted(others.pids):
                    if pid in self.other_pids_seen:
                        continue
                    if len(self.other_pids_seen) < MAX_PIDS_KEPT:
                        self.other_pids_seen.add(pid)
                    else:
                        self.other_pids_dropped += 1
            first = others.count > 0 and not self.shared
            self.max_others = max(self.max_others, others.count)
        if first and not self.warned:
            self.warned = True
            logger.warning("lightning-energy: %s", self.warning())
        return others

    def failed(self, reason: str, absent: bool) -> None:
        """A listing failed (``reason``); ``absent``: NVML says it has no such query here (not supported, no
        permission, a driver without the function): asked no more."""
        with self._lock:
            self.errors += 1
            self.last_error = reason
            if absent:
                self.unchecked = reason

    def warning(self) -> str:
        """The one warning of a shared card."""
        others = self.now
        pids = "" if others is None or others.rule == RULE_ASSUMED else \
            f" (PIDs {', '.join(str(p) for p in sorted(others.pids)[:8])}{', ...' if len(others.pids) > 8 else ''})"
        count = others.count if others is not None else self.max_others
        return (f"{self.what} is shared: {count} other compute process(es){pids} hold a CUDA context on it. "
                "NVML measures the whole card, so its energy figures include their work; the report labels them "
                "SHARED. NvmlProcessShareSensor estimates this process's share by SM utilisation.")

    def label(self) -> str:
        """What goes before every figure's source: ``""`` for a card never found shared."""
        if not self.shared:
            return ""
        plural = "es" if self.max_others != 1 else ""
        return (f"SHARED with {'up to ' if self._varied else ''}{self.max_others} other process{plural} "
                "(the whole card's energy, theirs included): ")

    @property
    def _varied(self) -> bool:
        return self.now is not None and self.now.count != self.max_others

    def describe(self) -> dict:
        """The report's entry: ``checked``, ``shared``, ``other_processes_max`` (most at one listing),
        ``other_processes_now`` (the latest), ``other_pids`` (host PIDs seen, at most :data:`MAX_PIDS_KEPT`),
        ``rule`` and its words, ``queries``, ``errors``, ``unchecked`` (why NVML could not list them)."""
        with self._lock:
            now = self.now
            return {
                "checked": self.checked,
                "shared": self.shared,
                "other_processes_max": self.max_others if self.checked else None,
                "other_processes_now": now.count if now is not None else None,
                "other_pids": sorted(self.other_pids_seen),
                **({"other_pids_not_kept": self.other_pids_dropped} if self.other_pids_dropped else {}),
                "rule": now.rule if now is not None else None,
                "rule_means": RULES.get(now.rule) if now is not None else None,
                "query_interval_s": self.interval_s,
                "queries": self.queries,
                "errors": self.errors,
                "unchecked": self.unchecked,
            }


# ------------------------------------------------------------------------------------------- the split
@dataclass(frozen=True)
class UtilisationSample:
    """One of NVML's per-process samples: ``pid`` (as the driver sees it), ``timestamp_us`` (the driver's CPU
    time, µs), ``sm_pct`` (SM utilisation, %)."""

    pid: int
    timestamp_us: int
    sm_pct: int


def samples_of(raw: Iterable) -> list[UtilisationSample]:
    """:class:`UtilisationSample` s from pynvml's ``c_nvmlProcessUtilizationSample_t`` s (``pid``,
    ``timeStamp``, ``smUtil``); impossible ones (PID 0, SM above 100 %) are dropped."""
    out = []
    for sample in raw:
        pid, stamp, sm = int(sample.pid), int(sample.timeStamp), int(sample.smUtil)
        if pid > 0 and 0 <= sm <= 100 and stamp >= 0:
            out.append(UtilisationSample(pid, stamp, sm))
    return out


class ShareRule:
    """This process's share of the card from NVML's per-process samples (the rule in the module docstring).

    :attr:`since_us` is the ``lastSeenTimeStamp`` to ask NVML with next; :meth:`update` takes the samples it
    returned (``[]`` for ``NVML_ERROR_NOT_FOUND``) and gives the share (0 to 1) and which rule made it.

    NVML returns each process's latest sample newer than the timestamp, again at every query while it is the
    latest: a process that stops computing leaves its last sample behind. So a sample's age is told on the
    caller's clock: the driver's "now" is taken as the newest timestamp seen plus the time (caller's clock)
    since it was first seen, and samples older than the horizon before that are dropped.
    """

    def __init__(self, horizon_s: float = SAMPLE_HORIZON_S) -> None:
        self.horizon_us = int(horizon_s * US_PER_S)
        self.newest_us = 0  # the newest sample's timestamp seen (driver clock, µs); 0: none yet
        self._newest_seen_s = 0.0  # when (caller's clock, s) the newest timestamp was first seen
        self._latest: dict[int, UtilisationSample] = {}

    @property
    def since_us(self) -> int:
        """``lastSeenTimeStamp`` for the next query: the horizon before the newest sample (0: all NVML holds)."""
        return max(0, self.newest_us - self.horizon_us) if self.newest_us else 0

    def update(self, samples: list[UtilisationSample], own: Iterable[int], others: OtherProcesses | None,
               now_s: float) -> tuple[float, str]:
        """(this process's share, the rule: :data:`SPLIT_SM`, :data:`SPLIT_IDLE` or :data:`SPLIT_UNTOLD`).
        ``others``: the card's latest listing (None: never listed; the idle split then counts this process
        alone); ``now_s``: the caller's clock (s), which ages the samples."""
        for sample in samples:
            kept = self._latest.get(sample.pid)
            if kept is None or sample.timestamp_us >= kept.timestamp_us:
                self._latest[sample.pid] = sample
            if sample.timestamp_us > self.newest_us:
                self.newest_us, self._newest_seen_s = sample.timestamp_us, now_s
        driver_now_us = self.newest_us + round(max(now_s - self._newest_seen_s, 0.0) * US_PER_S)
        oldest = driver_now_us - self.horizon_us
        self._latest = {pid: s for pid, s in self._latest.items() if s.timestamp_us > oldest}
        total = sum(s.sm_pct for s in self._latest.values())
        processes = (others.count if others is not None else 0) + 1
        if total <= 0:
            return 1.0 / processes, SPLIT_IDLE
        own = frozenset(own)
        if others is not None and not others.identifiable and not own & self._latest.keys():
            return 1.0 / processes, SPLIT_UNTOLD
        return sum(s.sm_pct for pid, s in self._latest.items() if pid in own) / total, SPLIT_SM
