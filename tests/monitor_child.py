"""A command for ``tests/test_monitor.py`` to run under ``lightning-energy monitor``.

    monitor_child.py markers EPOCHS STEPS   print marker lines (a window "eval" after each epoch), then exit 0
    monitor_child.py exit CODE              print a line and exit with CODE
    monitor_child.py signals READY GOT      write READY once its handlers are in place, then wait for SIGINT or
                                            SIGTERM: write the signal's name to GOT and die of that signal
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

WAIT_LIMIT_S = 600.0  # a test that never sends its signal must not leave this process behind (beyond pytest-timeout)


def markers(epochs: int, steps: int) -> int:
    for _ in range(epochs):
        for step in range(steps):
            print(f"working on step {step}")
            print("lightning-energy: step", flush=True)
        print("lightning-energy: epoch", flush=True)
        print("lightning-energy: window start eval", flush=True)
        print("evaluating", flush=True)
        print("lightning-energy: window end eval", flush=True)
    return 0


def wait_for_signal(ready: Path, got: Path) -> int:
    received = threading.Event()

    def handler(signum, frame):
        got.write_text(signal.Signals(signum).name)
        received.set()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die of it, as an unhandled signal would (exit code 128 + N in a shell)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
    ready.write_text(str(os.getpid()))
    received.wait(WAIT_LIMIT_S)
    return 99  # no signal came


def main(argv: list[str]) -> int:
    mode, *rest = argv
    if mode == "markers":
        return markers(int(rest[0]), int(rest[1]))
    if mode == "exit":
        print(f"exiting with {rest[0]}", flush=True)
        return int(rest[0])
    if mode == "signals":
        return wait_for_signal(Path(rest[0]), Path(rest[1]))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
