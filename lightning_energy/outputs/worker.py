"""A small background worker for output work that must not run on the training thread.

Figures, TensorBoard flushes and other file output are handed to one daemon thread through a bounded
queue: :meth:`OutputWorker.submit` only appends a job (a few microseconds, a lock held for a deque
operation, never while a job runs). When the queue is full the oldest pending job is dropped; a job
submitted with a ``key`` replaces a pending job with the same key (coalescing: only the newest power
figure waits). A job that raises never reaches the caller: its failure becomes one line in
:attr:`OutputWorker.problems` (and one warning), repeated failures of the same kind are counted, not
repeated. :meth:`close` drains the queue within a bound and records what was left undone.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from typing import Any, Callable

from lightning_energy.io import describe_error

DEFAULT_MAX_PENDING = 8
DEFAULT_CLOSE_TIMEOUT_S = 5.0
IDLE_EXIT_S = 30.0  # an idle worker thread exits; the next submit starts a new one
WARNING_PREFIX = "lightning-energy: "


class ProblemLog:
    """One line per kind of output problem, counted when it repeats; warns once per kind (thread-safe)."""

    def __init__(self, warn: bool = True) -> None:
        self.warn = warn
        self.problems: list[str] = []
        self.counts: dict[str, int] = {}
        self._index: dict[str, int] = {}
        self._lines: dict[str, str] = {}
        self._lock = threading.Lock()

    def record(self, kind: str, message: str, warn: bool | None = None) -> bool:
        """Record ``message`` under ``kind``; True when it is the first of its kind (then warned about)."""
        line = " ".join(message.split())
        with self._lock:
            count = self.counts.get(kind, 0) + 1
            self.counts[kind] = count
            if count > 1:
                self.problems[self._index[kind]] = f"{self._lines[kind]} ({count} times)"
                return False
            self._index[kind] = len(self.problems)
            self._lines[kind] = line
            self.problems.append(line)
        if self.warn if warn is None else warn:
            warnings.warn(WARNING_PREFIX + line, UserWarning, stacklevel=3)
        return True

    def __contains__(self, kind: str) -> bool:
        return kind in self.counts


class _Job:
    __slots__ = ("fn", "args", "kwargs", "what", "key")

    def __init__(self, fn, args, kwargs, what, key) -> None:
        self.fn, self.args, self.kwargs, self.what, self.key = fn, args, kwargs, what, key


class OutputWorker:
    """One daemon thread running output jobs in submission order, off the caller's thread.

    Args:
        name: the thread's name.
        max_pending: jobs waiting at most; a submit beyond it drops the oldest waiting job.
        warn: warn (``UserWarning``) once per kind of failure, besides recording it in :attr:`problems`.
    """

    def __init__(self, name: str = "lightning-energy-outputs", max_pending: int = DEFAULT_MAX_PENDING,
                 warn: bool = True) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.name = name
        self.max_pending = int(max_pending)
        self.log = ProblemLog(warn)
        self.dropped: dict[str, int] = {}  # per `what`: jobs dropped or replaced before they ran
        self.done = 0  # jobs run (whether they succeeded or not)
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._closed = False

    @property
    def problems(self) -> list[str]:
        """One line per kind of failure (``what: error``), with a count when it repeated."""
        return self.log.problems

    @property
    def closed(self) -> bool:
        return self._closed

    def record(self, kind: str, message: str, warn: bool | None = None) -> bool:
        """Record a problem found inside a job (e.g. one writer of several failing); see :class:`ProblemLog`."""
        return self.log.record(kind, message, warn)

    # ---------------------------------------------------------------- caller's side (cheap, never waits on a job)
    def submit(self, fn: Callable[..., Any], *args, what: str, key: str | None = None, **kwargs) -> bool:
        """Queue ``fn(*args, **kwargs)``; False (and nothing queued) once the worker is closed.

        ``what`` names the job in problems ("power figure"); a pending job with the same ``key`` is
        replaced by this one, and when ``max_pending`` jobs wait the oldest is dropped.
        """
        job = _Job(fn, args, kwargs, what, key)
        with self._cond:
            if self._closed:
                self.dropped[what] = self.dropped.get(what, 0) + 1
                return False
            replaced = False
            if key is not None:
                for i, pending in enumerate(self._jobs):
                    if pending.key == key:
                        self.dropped[pending.what] = self.dropped.get(pending.what, 0) + 1
                        self._jobs[i] = job
                        replaced = True
                        break
            if not replaced:
                if len(self._jobs) >= self.max_pending:
                    oldest = self._jobs.popleft()
                    self.dropped[oldest.what] = self.dropped.get(oldest.what, 0) + 1
                self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def pending(self) -> int:
        """Jobs waiting or running."""
        with self._cond:
            return len(self._jobs) + int(self._busy)

    # ---------------------------------------------------------------- the worker thread
    def _run(self) -> None:
        while True:
            with self._cond:
                deadline = time.monotonic() + IDLE_EXIT_S
                while not self._jobs and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if not self._jobs:  # closed, or idle long enough: let the thread go
                    self._thread = None
                    self._cond.notify_all()
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job.fn(*job.args, **job.kwargs)
            except Exception as err:  # an output failure never reaches training: one line, counted
                self.log.record(job.what, f"{job.what} failed: {describe_error(err)}")
            finally:
                with self._cond:
                    self._busy = False
                    self.done += 1
                    self._cond.notify_all()

    # ---------------------------------------------------------------- draining
    def drain(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> bool:
        """Wait until every queued job ran, at most ``timeout_s``; True when nothing is left."""
        deadline = time.monotonic() + max(float(timeout_s), 0.0)
        with self._cond:
            while self._jobs or self._busy:
                if threading.current_thread() is self._thread:
                    return False  # a job waiting for itself would deadlock
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> bool:
        """Run what is queued (at most ``timeout_s``), then stop; never raises.

        True when every job ran. Otherwise the jobs still waiting are dropped, and one line in
        :attr:`problems` says which; a job still running goes on in the daemon thread on its own.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        finished = self.drain(timeout_s)
        if not finished:
            with self._cond:
                left = list(self._jobs)
                self._jobs.clear()
                running = self._busy
            for job in left:
                self.dropped[job.what] = self.dropped.get(job.what, 0) + 1
            names = sorted({job.what for job in left})
            self.log.record(
                "close timeout",
                f"output work not finished within {timeout_s:g} s: "
                + ("one job still running" if running else "no job running")
                + (f"; {len(left)} dropped ({', '.join(names)})" if left else ""),
            )
        thread = self._thread
        if finished and thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)
        return finished
