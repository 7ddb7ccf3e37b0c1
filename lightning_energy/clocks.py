"""Where step boundaries are put on the sampler's time axis (``time.perf_counter`` seconds).

On the host a boundary is simply "now". On CUDA the work of a step runs asynchronously after the Python
call returns, so a boundary is a CUDA event recorded in the stream; the sampling thread converts it to
host time once the GPU has reached it, using an anchor event whose host time is known. No
``torch.cuda.synchronize()`` runs per step.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any


class HostClock:
    """Boundaries at the host time of the call."""

    asynchronous = False

    def record(self) -> float:
        return time.perf_counter()

    def resolve(self, token: Any) -> float | None:
        return token

    def reanchor(self) -> None:
        """Nothing to do on the host."""


class CudaEventClock:
    """Boundaries as CUDA events, resolved to host seconds later on the sampling thread.

    The anchor (one event plus the host time at which it completed) is taken with a synchronize at
    construction and by :meth:`reanchor` (called once per epoch), which bounds the drift between the GPU
    and host clocks to that of one epoch.
    """

    asynchronous = True

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self._spare_events: deque = deque()
        self.reanchor()

    def reanchor(self) -> None:
        torch = self._torch
        with torch.cuda.device(self.device):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            self._anchor = (event, time.perf_counter())

    def record(self) -> tuple:
        event = self._spare_events.pop() if self._spare_events else self._torch.cuda.Event(enable_timing=True)
        event.record()
        return (event, self._anchor)

    def resolve(self, token: tuple) -> float | None:
        event, (anchor_event, anchor_t) = token
        if not event.query():
            return None
        t = anchor_t + anchor_event.elapsed_time(event) / 1000.0
        self._spare_events.append(event)
        return t
