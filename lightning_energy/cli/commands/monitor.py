"""``lightning-energy monitor``: the energy of any process, a command it starts or one already running.

``monitor [--out DIR] [--interval S] [--gpus I,J] [--sensors SPEC] -- CMD ARGS...`` starts ``CMD`` and measures
it until it ends; ``monitor --pid PID`` attaches to a running process until it ends (or Ctrl-C). Either way the
run folder gets the same ``energy_report.json``, ``energy_trace.csv`` and ``energy_events.csv`` as a Lightning
fit, the report with a ``"command"`` section (argv, PID, exit code, the signal that ended it).

What is measured (``--sensors auto``): the GPUs of ``--gpus`` (NVML indices, as ``nvidia-smi -i``) for the whole
run; without it, each NVIDIA GPU from the first sampling read at which NVML lists a process of the command's
tree among its compute processes (see :mod:`lightning_energy.measure.sensors.process_tree`); the host's RAPL
counters where readable (the whole CPU package: every process on it), else an estimate of the command's
process tree's CPU power (labelled estimated). ``--sensors simulated:...`` replaces them all by a power trace
given on the command line (a dry run; see :func:`simulated_sensors`).

The command (only when it is started here): its stdin and stderr are the monitor's; its stdout is read through
a pipe and forwarded chunk by chunk as it arrives, to find the marker lines (``MARKERS``); ``--no-markers``
leaves stdout alone. ``PYTHONUNBUFFERED=1`` is set for it (unless set already) so that a Python command's
lines arrive when printed. SIGINT, SIGTERM and SIGHUP sent to the monitor are forwarded to it, except a
signal the terminal sent to the whole foreground process group (Ctrl-C), which the command has received
itself. The monitor exits with the command's exit code (a death by signal N: 128 + N, as shells report it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning_energy.cli.commands import CommandError

HELP = "Measure the energy of any command (or a running process, --pid) and write the same report as a fit."

MARKER_PREFIX = "lightning-energy:"
MARKERS = """marker lines (on the command's stdout, each on a line of its own, still shown):
  lightning-energy: step                a training step ended (the next one starts)
  lightning-energy: epoch               a training epoch ended
  lightning-energy: window start NAME   a window NAME ([A-Za-z0-9_.-]+) starts
  lightning-energy: window end NAME     it ends: its joules, seconds and watts go in the report
Print them flushed (print(..., flush=True)); they are timed when the monitor reads them."""
_MARKER = re.compile(r"lightning-energy:\s+(?:(step|epoch)|window\s+(start|end)\s+([A-Za-z0-9_.\-]+))\s*")

SIMULATED_HELP = """--sensors simulated:device_W=TRACE[,host_W=TRACE][,kind=power|energy]: a dry run. TRACE is watts, or
watts from the start then TIME:WATTS changes (seconds since the sensor opened, just before the measurement
starts; the report gives each sensor's trace_time_at_start_s), e.g. 100/0.5:300/2:50 (100 W, 300 W from 0.5 s,
50 W from 2 s)."""

# Signals the monitor forwards to its command. SIGCHLD is waited for with them (the command's end).
FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
SI_KERNEL = 0x80  # siginfo si_code (Linux): sent by the kernel, e.g. a terminal's Ctrl-C to its foreground group
WAIT_TICK_S = 0.1  # how often an attached process is checked for its end where there is no pidfd (s)
DEFAULT_OUT = "energy_monitor"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.usage = ("lightning-energy monitor [--out DIR] [--interval S] [--gpus I,J] [--sensors SPEC] -- CMD ARGS...\n"
                    "       lightning-energy monitor [options] --pid PID")
    parser.epilog = (f"{MARKERS}\n\n{SIMULATED_HELP}\n\nThe monitor exits with the command's exit code "
                     "(128 + N when a signal N ended it); 2 when the command cannot be started.")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"run folder for the report, trace and events (default: {DEFAULT_OUT}/version_N, "
                             "the next free N)")
    parser.add_argument("--interval", type=float, default=0.1, metavar="S", help="sampling interval in s (0.1)")
    parser.add_argument("--gpus", default=None, metavar="I,J",
                        help="NVML indices (nvidia-smi -i) of the GPUs to measure for the whole run; default: "
                             "each GPU from when the command's process tree uses it; 'none': no GPU")
    parser.add_argument("--sensors", default="auto", metavar="SPEC",
                        help="'auto' (NVML, RAPL, else a CPU estimate) or simulated:... (see below)")
    parser.add_argument("--pid", type=int, default=None, help="attach to this running process instead of "
                                                              "starting a command (no signals forwarded)")
    parser.add_argument("--no-markers", action="store_true",
                        help="leave the command's stdout alone (no marker lines are looked for)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD ARGS",
                        help="the command to run, after --")  # not `command`: the sub-command's own name


# ----------------------------------------------------------------------------------------- checks
def parse_gpus(text: str | None) -> list[int] | None:
    """``--gpus``: None (not given: the GPUs the command uses), [] for 'none', else the NVML indices."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return []
    try:
        indices = [int(part) for part in text.split(",")]
    except ValueError:
        raise CommandError(f"--gpus takes NVML indices such as 0,1 (or 'none'), got {text!r}") from None
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise CommandError(f"--gpus takes distinct non-negative NVML indices, got {text!r}")
    return indices


def parse_trace(text: str, key: str) -> list[tuple[float, float]]:
    """A ``TRACE`` of ``--sensors simulated:``: ``W`` or ``W/T1:W1/T2:W2...`` -> ``[(0, W), (T1, W1), ...]``."""
    first, *changes = text.split("/")
    try:
        points = [(0.0, float(first))] + [(float(t), float(w)) for t, w in (c.split(":") for c in changes)]
    except ValueError:
        raise CommandError(f"--sensors simulated: {key}={text!r} is not watts or W/T1:W1/... "
                           "(e.g. 100/0.5:300)") from None
    if any(not (w >= 0 and w < float("inf")) for _, w in points):
        raise CommandError(f"--sensors simulated: {key}={text!r}: watts must be finite and >= 0")
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise CommandError(f"--sensors simulated: {key}={text!r}: times must increase from 0")
    return points


def parse_simulated(spec: str) -> dict:
    """``simulated:device_W=TRACE,host_W=TRACE,kind=power|energy`` -> {"device_W": trace, "host_W": trace, "kind"}."""
    body = spec[len("simulated:"):]
    parsed: dict = {"kind": "power"}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key in ("device_W", "host_W"):
            parsed[key] = parse_trace(value, key)
        elif key == "kind" and value in ("power", "energy"):
            parsed[key] = value
        else:
            raise CommandError(f"--sensors simulated: unknown or malformed {item!r}; "
                               "use device_W=TRACE, host_W=TRACE, kind=power|energy")
    if "device_W" not in parsed and "host_W" not in parsed:
        raise CommandError("--sensors simulated: give device_W=TRACE and/or host_W=TRACE (e.g. simulated:device_W=100)")
    return parsed


def resolve_command(argv: list[str]) -> str:
    """The executable ``argv[0]`` names (PATH searched as ``execvp`` does), or a one-line CommandError."""
    if not argv:
        raise CommandError("give the command to measure after -- (e.g. monitor -- python train.py), or --pid PID")
    found = shutil.which(argv[0])
    if found is None:
        why = "not an executable file" if os.path.sep in argv[0] and os.path.exists(argv[0]) else "command not found"
        raise CommandError(f"{argv[0]}: {why}")
    return found


def next_run_folder(base: Path) -> Path:
    """``base/version_N`` for the smallest N not taken."""
    n = 0
    while (base / f"version_{n}").exists():
        n += 1
    return base / f"version_{n}"


# ----------------------------------------------------------------------------------------- sensors
def simulated_sensors(spec: dict) -> list:
    """Sensors following the power traces of a parsed ``--sensors simulated:`` spec (t = 0 when the sensor opens).

    Each describes its trace and where the measurement sits on it: ``trace_time_at_start_s``, the trace's time
    (s since its t = 0) at the report's start, exact on the sampler's clock (see :func:`start_meter`), so
    that the exact energy of the measured span is the trace's integral from there over the report's
    ``duration_s``; and ``trace_origin_unix_s``, the Unix time of its t = 0 (to the wall clock's precision)."""
    try:
        from lightning_energy.simulate.simulated_sensor import SimulatedSensor
    except ImportError:  # before the simulators moved out of lightning_energy.testing
        from lightning_energy.testing.simulated_sensor import SimulatedSensor

    class TraceSensor(SimulatedSensor):
        """A simulated sensor whose description holds its trace and where the measurement started on it."""

        trace_origin_unix_s: float | None = None
        trace_time_at_start_s: float | None = None

        def open(self) -> None:
            if self._origin is None:
                self.trace_origin_unix_s = time.time()
            super().open()

        def measurement_started(self, t: float) -> None:
            """The measurement started at ``t`` (the sampler's clock, s: this sensor's clock too)."""
            self.trace_time_at_start_s = t - self._origin if self._origin is not None else None

        def describe(self) -> dict:
            return {**super().describe(), "trace_W": [list(point) for point in self.trace_points],
                    "trace_origin_unix_s": self.trace_origin_unix_s,
                    "trace_time_at_start_s": self.trace_time_at_start_s}

    sensors = []
    for key, name, scope in (("device_W", "simulated_device", "device"), ("host_W", "simulated_host", "host")):
        if key in spec:
            sensor = TraceSensor(name, spec[key], scope=scope, kind=spec["kind"])
            sensor.trace_points = spec[key]
            sensors.append(sensor)
    return sensors


def start_meter(meter, sensors: list) -> None:
    """Start ``meter`` and tell each simulated sensor of ``sensors`` when the measurement started (the run's
    first boundary, on the sampler's clock, which the simulated sensors read too)."""
    meter.start()
    start = meter.timeline.fit_start
    for sensor in sensors:
        if hasattr(sensor, "measurement_started"):
            sensor.measurement_started(start.t)


def auto_sensors(gpus: list[int] | None, watch) -> tuple[list, list[str]]:
    """NVML GPUs (those of ``gpus``, else each once the process tree of ``watch`` uses it), the host's RAPL
    zones where readable, else the process tree's CPU estimate; and notes to show."""
    from lightning_energy.measure.sensors.nvml import NvmlGpuSensor
    from lightning_energy.measure.sensors.process_tree import ProcessTreeCpuSensor, process_tree_gpu_sensors
    from lightning_energy.measure.sensors.rapl import RaplSensor, find_rapl_zones, unreadable_rapl_message

    notes: list[str] = []
    if gpus is None:
        sensors, notes = process_tree_gpu_sensors(watch)
    else:
        sensors = [NvmlGpuSensor(index) for index in gpus]
    zones, unreadable = find_rapl_zones()
    if zones:
        sensors.extend(RaplSensor(zone) for zone in zones)
        notes.append("Host: RAPL counters, the whole CPU package (every process on it, not only the command's).")
    else:
        if unreadable:
            notes.append(unreadable_rapl_message(unreadable))
        sensors.append(ProcessTreeCpuSensor(watch))
    return sensors, notes


# ----------------------------------------------------------------------------------------- the command's output
def parse_marker(line: str) -> tuple[str, str | None] | None:
    """A marker line -> ("step" | "epoch" | "window start" | "window end", NAME or None); None for other lines."""
    match = _MARKER.fullmatch(line.strip())
    if match is None:
        return None
    if match.group(1):
        return match.group(1), None
    return f"window {match.group(2)}", match.group(3)


class MarkerActions:
    """What marker lines do to a meter: ``meter.step()``, ``meter.epoch()``, and windows entered and left by name.
    ``problems``: markers that could not be applied (an end without a start), one line each."""

    def __init__(self, meter) -> None:
        self.meter = meter
        self.counts = {"step": 0, "epoch": 0, "window": 0}
        self.windows: list = []  # finished windows, in end order: (name, the meter's window object)
        self.problems: list[str] = []
        self._open: dict[str, tuple] = {}

    def __call__(self, marker: str, name: str | None) -> None:
        if marker == "step":
            self.meter.step()
            self.counts["step"] += 1
        elif marker == "epoch":
            self.meter.epoch()
            self.counts["epoch"] += 1
        elif marker == "window start":
            if name in self._open:
                self.problems.append(f"window {name!r} started again before it ended: the second start is ignored")
                return
            context = self.meter.window(name)
            self._open[name] = (context, context.__enter__())
        elif name not in self._open:
            self.problems.append(f"window {name!r} ended without a start: ignored")
        else:
            self._finish(name)

    def _finish(self, name: str) -> None:
        context, window = self._open.pop(name)
        context.__exit__(None, None, None)
        self.windows.append((name, window if window is not None else context))
        self.counts["window"] += 1

    def close(self) -> None:
        """End the windows still open when the command ended (each with a problem line saying so)."""
        for name in list(self._open):
            self.problems.append(f"window {name!r} had no end marker: it ends with the command")
            self._finish(name)


class OutputPump(threading.Thread):
    """Copies the command's stdout (``source_fd``) to ``sink`` (a binary file) as each chunk arrives, and calls
    ``on_marker(marker, name)`` for each marker line, at the moment its line's end is read. A sink that fails
    (a reader that went away) is dropped; the command's output is still drained so that it never blocks."""

    CHUNK = 65536

    def __init__(self, source_fd: int, sink, on_marker) -> None:
        super().__init__(name="lightning-energy-monitor-stdout", daemon=True)
        self.source_fd = source_fd
        self.sink = sink
        self.on_marker = on_marker
        self.errors: list[str] = []

    def run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.source_fd, self.CHUNK)
            except InterruptedError:
                continue
            if not chunk:
                break
            self._forward(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._look_at(line)
            if len(pending) > self.CHUNK:  # a very long line (a progress bar's \r updates): not a marker
                pending = pending[-self.CHUNK:]
        if pending:
            self._look_at(pending)

    def _forward(self, chunk: bytes) -> None:
        if self.sink is None:
            return
        try:
            self.sink.write(chunk)
            self.sink.flush()
        except (OSError, ValueError):
            self.sink = None

    def _look_at(self, line: bytes) -> None:
        if MARKER_PREFIX.encode() not in line:
            return
        marker = parse_marker(line.decode("utf-8", "replace"))
        if marker is not None:
            try:
                self.on_marker(*marker)
            except Exception as err:  # a meter refusing a mark must not stop the output
                self.errors.append(f"{' '.join(marker[:1] + tuple(filter(None, marker[1:])))}: {err}")


# ----------------------------------------------------------------------------------------- signals
@dataclass
class Outcome:
    """How the measured process ended: ``exit_code`` (None for an attached process), ``signal`` (the name of the
    signal that killed the command, if one did), signals forwarded to it and received by the monitor."""

    exit_code: int | None = None
    signal: str | None = None
    forwarded: list[str] = field(default_factory=list)
    received: list[str] = field(default_factory=list)


def exit_code_of(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def sent_by_terminal(info, child_pid: int) -> bool:
    """Whether a received signal came from the kernel to our process group, which holds the command too (a
    terminal's Ctrl-C or Ctrl-\\): the command has it already, and forwarding it would deliver it twice."""
    if getattr(info, "si_code", None) != SI_KERNEL:
        return False
    try:
        return os.getpgid(child_pid) == os.getpgrp()
    except OSError:
        return False


class SignalGate:
    """The monitor's signals taken as messages rather than interruptions.

    While open (a context manager on the main thread, entered before any thread starts so that every thread
    inherits the mask) the FORWARDED signals and SIGCHLD are blocked and collected with :meth:`wait`, which
    returns the siginfo of one, or None after ``timeout_s``. :meth:`unblocked` lets a child be forked with the
    default mask (a signal arriving meanwhile is kept and returned by the next :meth:`wait`)."""

    def __init__(self) -> None:
        self.signals = set(FORWARDED) | ({signal.SIGCHLD} if hasattr(signal, "SIGCHLD") else set())
        self._held: list = []
        self._previous_handlers: dict = {}

    def __enter__(self) -> SignalGate:
        for signum in FORWARDED:  # only reached in the unblocked window around a fork
            self._previous_handlers[signum] = signal.signal(signum, self._hold)
        signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        return self

    def __exit__(self, *exc) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)

    def _hold(self, signum, frame) -> None:
        self._held.append(_HeldSignal(signum))

    def unblocked(self):
        gate = self

        class _Unblocked:
            def __enter__(self):
                signal.pthread_sigmask(signal.SIG_UNBLOCK, gate.signals)

            def __exit__(self, *exc):
                signal.pthread_sigmask(signal.SIG_BLOCK, gate.signals)

        return _Unblocked()

    def wait(self, timeout_s: float):
        if self._held:
            return self._held.pop(0)
        return signal.sigtimedwait(self.signals, timeout_s)


@dataclass
class _HeldSignal:
    si_signo: int
    si_code: int = 0  # SI_USER: forwarded (the window around a fork is too short to tell)


def wait_for_child(child: subprocess.Popen, gate: SignalGate, outcome: Outcome) -> None:
    """Wait for the command to end, forwarding the signals the monitor receives meanwhile."""
    while child.poll() is None:
        info = gate.wait(0.5)  # SIGCHLD wakes it at the command's end; the timeout only guards a lost one
        if info is None or info.si_signo not in FORWARDED:
            continue
        name = signal_name(info.si_signo)
        outcome.received.append(name)
        if not sent_by_terminal(info, child.pid):
            try:
                os.kill(child.pid, info.si_signo)
                outcome.forwarded.append(name)
            except ProcessLookupError:  # ended meanwhile
                pass
    outcome.exit_code = exit_code_of(child.returncode)
    if child.returncode < 0:
        outcome.signal = signal_name(-child.returncode)


def wait_for_process(process, gate: SignalGate, outcome: Outcome) -> str:
    """Wait for an attached process (psutil) to end, or for a signal to the monitor; which one, in words."""
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(process.pid)
        except OSError:
            pidfd = None
    try:
        import select

        while True:
            if pidfd is not None:
                poller = select.poll()
                poller.register(pidfd, select.POLLIN)
                if poller.poll(WAIT_TICK_S * 1000):
                    return "the process exited"
            elif not _alive(process):
                return "the process exited"
            info = gate.wait(0 if pidfd is not None else WAIT_TICK_S)
            if info is not None and info.si_signo in FORWARDED:
                outcome.received.append(signal_name(info.si_signo))
                return f"the monitor received {signal_name(info.si_signo)}"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ----------------------------------------------------------------------------------------- the run
def supervise(argv: list[str], meter, gate: SignalGate, watch=None, markers: bool = True,
              stdout=None) -> tuple[Outcome, MarkerActions, int]:
    """Start the meter, then ``argv``, and wait for its end, forwarding signals (``gate`` open); the meter is
    left running. Returns how the command ended, the marker actions taken and its PID. ``watch``: a process-tree
    watch to attach to the command. ``stdout``: where the command's output goes when markers are looked for
    (default: this process's stdout, binary)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    actions = MarkerActions(meter)
    outcome = Outcome()
    meter.start()
    try:
        with gate.unblocked():
            child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if markers else None, bufsize=0)
    except OSError as err:  # resolve_command found it, yet it does not start (not a program: no #! line)
        raise CommandError(f"{argv[0]}: {err.strerror or err}") from None
    if watch is not None:
        try:
            watch.attach(child.pid)
        except Exception:  # ended already: nothing left to watch
            pass
    pump = None
    if markers:
        pump = OutputPump(child.stdout.fileno(), stdout if stdout is not None else sys.stdout.buffer, actions)
        pump.start()
    try:
        wait_for_child(child, gate, outcome)
    finally:
        if pump is not None:
            pump.join()  # the output to its end (a grandchild that kept the pipe open: until it closes it)
            child.stdout.close()
            actions.problems.extend(pump.errors)
        actions.close()
    return outcome, actions, child.pid


def run(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if args.pid is not None and argv:
        raise CommandError("give either a command after -- or --pid PID, not both")
    if not args.interval > 0:
        raise CommandError(f"--interval must be > 0 s, got {args.interval}")
    gpus = parse_gpus(args.gpus)
    spec = parse_simulated(args.sensors) if args.sensors.startswith("simulated:") else None
    if spec is None and args.sensors != "auto":
        raise CommandError(f"--sensors must be 'auto' or simulated:..., got {args.sensors!r}")
    process = _attached_process(args.pid) if args.pid is not None else None
    if process is None:
        resolve_command(argv)
    out = Path(args.out) if args.out is not None else next_run_folder(Path(DEFAULT_OUT))
    # every thread starts under the gate (the sampler's, the output pump's), so that they all leave the
    # signals to the main thread's wait
    with SignalGate() as gate:
        from lightning_energy.core.collective import SINGLE_PROCESS
        from lightning_energy.measure.sensors.process_tree import ProcessTreeWatch
        from lightning_energy.plain import EnergyMeter

        watch = ProcessTreeWatch(args.pid)
        sensors, notes = (simulated_sensors(spec), []) if spec is not None else auto_sensors(gpus, watch)
        for note in notes:
            print(f"lightning-energy monitor: {note}", file=sys.stderr)
        # one process, whatever the command runs (it may be a torchrun job: the monitor joins no process group);
        # no CUDA device of its own (the command's GPUs are read through NVML)
        meter = EnergyMeter(log_dir=out, sensors=sensors, interval_s=args.interval, device="cpu",
                            write_trace=True, verbose=False, collective=SINGLE_PROCESS)
        if process is None:
            try:
                start_meter(meter, sensors)  # supervise's own start is then a no-op
                outcome, actions, pid = supervise(argv, meter, gate, watch, markers=not args.no_markers)
            finally:
                report = meter.stop()
            section = {"argv": argv, "pid": pid, "attached": False, "exit_code": outcome.exit_code,
                       "signal": outcome.signal, "signals_forwarded": outcome.forwarded,
                       "signals_received": outcome.received}
        else:
            outcome, actions = Outcome(), MarkerActions(meter)
            start_meter(meter, sensors)
            print(f"lightning-energy monitor: measuring PID {process.pid} until it exits (Ctrl-C to stop)",
                  file=sys.stderr, flush=True)
            try:
                ended = wait_for_process(process, gate, outcome)
            finally:
                report = meter.stop()
            section = {"argv": _cmdline(process), "pid": process.pid, "attached": True, "ended": ended,
                       "exit_code": None, "signal": None, "signals_forwarded": [],
                       "signals_received": outcome.received}
    section["markers"] = dict(actions.counts)
    section["windows"] = [_window_figures(name, window) for name, window in actions.windows]
    section["problems"] = actions.problems
    _add_command_section(out, report, section)
    _print_summary(out, report, section)
    return 0 if process is not None else outcome.exit_code


def _attached_process(pid: int):
    import psutil

    try:
        process = psutil.Process(pid)
        if not _alive(process):
            raise psutil.NoSuchProcess(pid)
    except psutil.NoSuchProcess:
        raise CommandError(f"--pid {pid}: no such process") from None
    if pid == os.getpid():
        raise CommandError("--pid: that is the monitor itself")
    return process


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _window_figures(name: str, window) -> dict:
    figures = {"name": name}
    for key in ("energy_J", "duration_s", "power_W", "bound_J", "provenance", "per_sensor_J"):
        figures[key] = getattr(window, key, None)
    return figures


def _add_command_section(out: Path, report: dict, section: dict) -> None:
    """The report, written by the meter, gains the ``"command"`` section (rewritten whole, atomically)."""
    from lightning_energy.filenames import REPORT_FILE
    from lightning_energy.io import atomic_write_json

    report["command"] = section
    path = out / REPORT_FILE
    if path.exists():
        atomic_write_json(path, report)


def _print_summary(out, report: dict, section: dict) -> None:
    """One line on stderr (stdout is the command's): the total, the duration and where the report is."""
    total = report.get("total_J")
    duration = report.get("duration_s")
    figures = (f"{total:.3g} J ({report.get('provenance', 'unlabelled')}) over {duration:.3g} s"
               if isinstance(total, (int, float)) and duration else "no figures")
    print(f"lightning-energy monitor: {figures}; report in {Path(out) / 'energy_report.json'}", file=sys.stderr)
    for window in section["windows"]:
        if isinstance(window.get("energy_J"), (int, float)):
            print(f"lightning-energy monitor: window {window['name']}: {window['energy_J']:.3g} J "
                  f"({window.get('provenance', 'unlabelled')}) over {window['duration_s']:.3g} s", file=sys.stderr)
    for problem in section["problems"]:
        print(f"lightning-energy monitor: {problem}", file=sys.stderr)
