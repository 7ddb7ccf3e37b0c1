"""``lightning-energy monitor``: any command measured, its signals and exit code kept, its markers read.

The commands are ``tests/monitor_child.py``; the power is a simulated trace given on the command line
(``--sensors simulated:...``), so the exact energy of the measured span is known from the reported times. No
assertion depends on how long anything takes: a test that waits for a child does so on a file the child writes,
or on the child's end, with no deadline of its own (on a machine at load 30 a monitor's start can take tens of
seconds): pytest-timeout's limit (pyproject.toml) is the one safety net for a monitor that hangs.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from conftest import scaled_interval
from fakes_nvml import FakeClock, FakeNvml, h100s
from lightning_energy.cli.commands import CommandError
from lightning_energy.cli.commands import monitor
from lightning_energy.measure.sensors.process_tree import ProcessTreeCpuSensor, ProcessTreeGpuSensor

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().parent / "monitor_child.py"
INTERVAL = str(scaled_interval(0.02))  # the monitor's --interval (s)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1"}


def monitor_argv(out: Path, *command: str, sensors: str = "simulated:device_W=100,host_W=20",
                 extra: tuple = ()) -> list[str]:
    return [sys.executable, "-m", "lightning_energy.cli", "monitor", "--out", str(out), "--interval", INTERVAL,
            "--sensors", sensors, *extra, "--", *command]


def run_monitor(out: Path, *command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(monitor_argv(out, *command, **kwargs), env=env(), cwd=ROOT, capture_output=True,
                          text=True)


def wait_for_file(path: Path, process: subprocess.Popen) -> None:
    """Until ``process`` has written ``path`` (or it ended first: a failure, with its output)."""
    while not path.exists() or not path.read_text():
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)


def kill_if_running(pid_file: Path) -> None:
    """Kill the child whose PID ``pid_file`` holds, if it is still there (a test that failed halfway)."""
    try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def events(out: Path) -> dict[str, dict]:
    with open(out / "energy_events.csv", newline="") as file:
        return {row["event"]: row for row in csv.DictReader(file) if row["event"] in ("fit_start", "fit_end")}


# ------------------------------------------------------------------ the command line
def test_help_imports_neither_lightning_nor_torch():
    code = """
import contextlib, io, sys
from lightning_energy.cli.main import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(["monitor", "--help"])
    except SystemExit:
        pass
assert "lightning-energy: window start NAME" in out.getvalue()
print([m for m in ("lightning", "torch", "pytorch_lightning") if m in sys.modules])
"""
    done = subprocess.run([sys.executable, "-c", code], env=env(), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("line, marker", [
    ("lightning-energy: step", ("step", None)),
    ("  lightning-energy: epoch \r", ("epoch", None)),
    ("lightning-energy: window start eval-1.b", ("window start", "eval-1.b")),
    ("lightning-energy:  window  end eval", ("window end", "eval")),
    ("lightning-energy: stepping", None),
    ("loss 0.3 lightning-energy: step", None),
    ("lightning-energy: window start two words", None),
    ("lightning-energy: window start", None),
])
def test_marker_lines_are_exact(line, marker):
    assert monitor.parse_marker(line) == marker


def test_a_simulated_trace_reads_as_watts_then_time_watt_changes():
    spec = monitor.parse_simulated("simulated:device_W=100/0.5:300/2:50,host_W=20,kind=energy")
    assert spec == {"device_W": [(0.0, 100.0), (0.5, 300.0), (2.0, 50.0)], "host_W": [(0.0, 20.0)], "kind": "energy"}


@pytest.mark.parametrize("spec", ["simulated:", "simulated:device_W=abc", "simulated:device_W=100/0.5",
                                  "simulated:device_W=100/0.5:300/0.2:5", "simulated:device_W=-1",
                                  "simulated:gpu_W=5", "simulated:device_W=5,kind=counter"])
def test_a_malformed_simulated_spec_is_one_line(spec):
    with pytest.raises(CommandError):
        monitor.parse_simulated(spec)


@pytest.mark.parametrize("text, indices", [(None, None), ("none", []), ("0", [0]), ("1,3", [1, 3])])
def test_gpus_are_nvml_indices(text, indices):
    assert monitor.parse_gpus(text) == indices


@pytest.mark.parametrize("text", ["a", "0,0", "-1", "0;1"])
def test_bad_gpus_are_refused(text):
    with pytest.raises(CommandError):
        monitor.parse_gpus(text)


def test_a_command_that_cannot_start_is_one_line_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    done = run_monitor(out, "no-such-command-for-lightning-energy", "--flag")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "lightning-energy monitor: error: no-such-command-for-lightning-energy: command not found"]
    assert done.stdout == ""
    assert not out.exists()


def test_a_file_that_is_not_a_program_is_one_line_exit_2(tmp_path):
    script = tmp_path / "not_executable.sh"
    script.write_text("echo hi\n")
    done = run_monitor(tmp_path / "run", str(script))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"lightning-energy monitor: error: {script}: not an executable file"]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ signals, without a meter
def test_a_signal_from_the_terminal_is_not_forwarded_twice():
    same_group = os.getpid()  # this process stands for the command: it is in this process group
    terminal = types.SimpleNamespace(si_signo=signal.SIGINT, si_code=monitor.SI_KERNEL)
    user = types.SimpleNamespace(si_signo=signal.SIGINT, si_code=0)  # SI_USER: kill(2) aimed at the monitor
    assert monitor.sent_by_terminal(terminal, same_group)
    assert not monitor.sent_by_terminal(user, same_group)


@pytest.mark.parametrize("returncode, shell_code", [(0, 0), (3, 3), (-signal.SIGTERM, 143), (-signal.SIGINT, 130)])
def test_exit_codes_are_reported_as_a_shell_does(returncode, shell_code):
    assert monitor.exit_code_of(returncode) == shell_code


class RecordingMeter:
    """Records the calls a monitored command's markers make."""

    def __init__(self) -> None:
        self.calls: list = []

    def start(self):
        self.calls.append("start")
        return self

    def step(self):
        self.calls.append("step")

    def epoch(self):
        self.calls.append("epoch")

    def window(self, name):
        meter = self

        class Window:
            def __enter__(self):
                meter.calls.append(f"enter {name}")
                return types.SimpleNamespace(energy_J=1.0, duration_s=2.0)

            def __exit__(self, *exc):
                meter.calls.append(f"exit {name}")

        return Window()


def test_markers_drive_the_meter_and_the_output_passes_through_unchanged(tmp_path):
    meter = RecordingMeter()
    sink = tmp_path / "stdout"
    with open(sink, "wb") as stdout, monitor.SignalGate() as gate:
        outcome, actions, _ = monitor.supervise([sys.executable, str(CHILD), "markers", "2", "3"], meter, gate,
                                                stdout=stdout)
    assert outcome.exit_code == 0 and outcome.signal is None
    epoch = ["step"] * 3 + ["epoch", "enter eval", "exit eval"]
    assert meter.calls == ["start"] + epoch * 2
    assert actions.counts == {"step": 6, "epoch": 2, "window": 2}
    alone = subprocess.run([sys.executable, str(CHILD), "markers", "2", "3"], capture_output=True)
    assert sink.read_bytes() == alone.stdout  # every byte, markers included


def test_unmatched_window_markers_are_problems_not_errors():
    actions = monitor.MarkerActions(RecordingMeter())
    actions("window end", "eval")
    actions("window start", "fit")
    actions("window start", "fit")
    actions.close()
    assert [name for name, _ in actions.windows] == ["fit"]
    assert len(actions.problems) == 3


# ------------------------------------------------------------------ the process tree's sensors
def test_the_tree_cpu_estimate_charges_the_trees_share_of_the_machine():
    clock = FakeClock(0.0)
    cpu = {101: 0.0, 102: 5.0}
    watch = types.SimpleNamespace(cpu_seconds=lambda: dict(cpu), root_pid=101)
    sensor = ProcessTreeCpuSensor(watch, tdp_w=80.0, threads=4, cpu_model="test CPU", clock=clock)
    sensor.open()
    clock.advance(2.0)
    cpu.update({101: 1.0, 102: 6.0, 103: 9.0})  # 2 CPU-seconds in 2 s on 4 threads (103 is new: from its next read)
    assert sensor.power_w() == pytest.approx(80.0 * 2.0 / (2.0 * 4))
    assert sensor.estimated and sensor.provenance == "estimated" and sensor.scope == "host"
    assert sensor.describe()["root_pid"] == 101 and "process tree" in sensor.source


def test_the_tree_watch_lists_a_commands_descendants(tmp_path):
    from lightning_energy.measure.sensors.process_tree import ProcessTreeWatch

    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, str(CHILD), "signals", str(ready), str(tmp_path / "got")])
    try:
        wait_for_file(ready, child)
        watch = ProcessTreeWatch(os.getpid())
        assert {os.getpid(), child.pid} <= watch.pids()
        assert set(watch.cpu_seconds()) >= {os.getpid(), child.pid}
    finally:
        child.terminate()
        child.wait()


def test_a_gpu_counts_from_the_read_at_which_the_tree_uses_it():
    clock = FakeClock(1000.0)
    fake = FakeNvml(h100s(2, power_W=200.0), clock)
    watch = types.SimpleNamespace(pids=lambda: {4242, 4243}, root_pid=4242)
    sensor = ProcessTreeGpuSensor(1, watch, pynvml_module=fake)
    sensor.open()
    clock.advance(1.0)
    assert sensor.energy_j() == 0.0  # no process of the tree on GPU 1 yet
    fake.gpus[0].compute_pids.append(4243)  # on another GPU: not this one
    clock.advance(1.0)
    assert sensor.energy_j() == 0.0 and sensor.counted_from is None
    fake.gpus[1].compute_pids.append(4243)
    clock.advance(1.0)
    assert sensor.energy_j() == 0.0 and sensor.counted_from is not None  # from here on
    clock.advance(2.0)
    assert sensor.energy_j() == pytest.approx(2.0 * 200.0)
    assert sensor.describe()["used_by_command"] is True
    assert sensor.shape_power_field is None  # not shaped: its counter reads 0 J while the card draws power
    sensor.close()


# ------------------------------------------------------------------ end to end, through the meter
TRACE = [(0.0, 100.0), (0.05, 300.0), (0.4, 50.0)]  # W from the sensor's t = 0 (s)
HOST_TRACE = [(0.0, 20.0)]


def test_the_energy_of_a_known_power_trace_is_exact(tmp_path):
    """Each sensor's joules over the measured span are its trace's integral over the span, placed on the trace by
    the report itself (``trace_time_at_start_s`` and ``duration_s``, exact on the sampler's clock), within what
    the samples leave open (:func:`bound_of_samples`). Nothing is inferred from the reads' timing."""
    out = tmp_path / "run"
    done = run_monitor(out, sys.executable, str(CHILD), "markers", "2", "3",
                       sensors="simulated:device_W=100/0.05:300/0.4:50,host_W=20,kind=energy")
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "energy_report.json").read_text())
    for name, trace in (("simulated_device", TRACE), ("simulated_host", HOST_TRACE)):
        sensor = next(s for s in report["sensors"] if s["name"] == name)
        assert sensor["trace_W"] == [list(point) for point in trace]
        start_s = sensor["trace_time_at_start_s"]
        assert start_s > 0  # the sensor opens before the measurement starts
        end_s = start_s + report["duration_s"]
        timing_J, changes_J = bound_of_samples(out, name, trace, start_s, end_s)
        truth_J = exact_energy(trace, start_s, end_s)
        assert sensor["energy_J"] == pytest.approx(truth_J, abs=timing_J + changes_J), name
        # what the reads' timing leaves open still says something (a power change next to a boundary is the
        # trace's doing: on a loaded machine the reads around the start can reach its first change)
        assert timing_J < 0.02 * truth_J or timing_J < 0.5, (name, timing_J)
    assert report["command"]["exit_code"] == 0
    assert report["command"]["markers"] == {"step": 6, "epoch": 2, "window": 2}


def bound_of_samples(out: Path, name: str, trace: list[tuple[float, float]], start_s: float,
                     end_s: float) -> tuple[float, float]:
    """How far (J) the meter may be from the trace's integral between ``start_s`` and ``end_s`` (s on the trace)
    given its samples, in two parts: (the reads' timing, the power changes near a boundary). The samples are the
    trace CSV's reads of this sensor, placed on the trace through the fit_start event (written to the
    microsecond, as the rows are). At each of the two boundaries, with ``u0 <= b < u1`` the reads
    around it and ``u-1``, ``u2`` their neighbours (the counter's boundary rule of
    :mod:`lightning_energy.measure.series` takes the power of the periods before and after):

    - a read's row time is its tick's, taken before the sensor was read: the value holds at a later time (its
      residual, known exactly from the value through the trace's integral). The figure at ``b`` leans on the
      four reads; a neighbour period's power, extrapolated over ``b - u0`` (or ``u1 - b``), carries their
      residuals multiplied by how much longer the boundary's period is than the neighbour's; the figure is
      clamped between the energies at ``u0`` and ``u1`` whatever it does (the peak power over ``u1 - u0``);
    - a power change among those reads may be placed anywhere between them (|dP| x their span);
    - times are written to the microsecond."""
    column = f"{name}:energy_J"
    to_trace_s = start_s - float(events(out)["fit_start"]["time_s"])
    with open(out / "energy_trace.csv", newline="") as file:
        reads = [(float(row["time_s"]) + to_trace_s, float(row[column])) for row in csv.DictReader(file) if row[column]]
    times = [t for t, _ in reads]
    residual_s = [abs(time_at_energy(trace, energy_J) - t) for t, energy_J in reads]
    peak_W = max(w for _, w in trace)
    timing_J, changes_J = peak_W * 1e-6 * 4, 0.0
    for boundary in (start_s, end_s):
        i = max(k for k, t in enumerate(times) if t <= boundary)  # u0 (a read precedes the start and follows the end)
        near = range(max(i - 1, 0), min(i + 3, len(times)))  # u-1 .. u2
        period_s = times[i + 1] - times[i]
        neighbour_s = min([times[k + 1] - times[k] for k in (i - 1, i + 1) if 0 <= k < len(times) - 1])
        residual = max(residual_s[k] for k in near)
        timing_J += peak_W * min(residual * (1 + 2 * period_s / neighbour_s), period_s + residual)
        first, last = times[near[0]], times[near[-1]]
        changes_J += sum(abs(w - w_before) * (last - first) for (_, w_before), (t, w) in zip(trace, trace[1:])
                         if first < t < last)
    return timing_J, changes_J


def time_at_energy(trace: list[tuple[float, float]], energy_J: float) -> float:
    """The time (s from the trace's origin) at which its integral reaches ``energy_J`` (every power > 0)."""
    for (t0, watts), (t1, _) in zip(trace, trace[1:] + [(math.inf, 0.0)]):
        if energy_J <= watts * (t1 - t0):
            return t0 + energy_J / watts
        energy_J -= watts * (t1 - t0)
    raise AssertionError("unreachable: the last segment never ends")


def exact_energy(trace: list[tuple[float, float]], start_s: float, end_s: float) -> float:
    """The integral (J) of a piecewise-constant trace [(t, W), ...] from start_s to end_s (s from its origin)."""
    total = 0.0
    for (t0, watts), (t1, _) in zip(trace, trace[1:] + [(math.inf, 0.0)]):
        total += watts * max(0.0, min(t1, end_s) - max(t0, start_s))
    return total


def test_markers_become_the_reports_epochs_and_the_output_is_unchanged(tmp_path):
    out = tmp_path / "run"
    done = run_monitor(out, sys.executable, str(CHILD), "markers", "3", "2")
    assert done.returncode == 0, done.stderr
    alone = subprocess.run([sys.executable, str(CHILD), "markers", "3", "2"], capture_output=True, text=True)
    assert done.stdout == alone.stdout
    report = json.loads((out / "energy_report.json").read_text())
    assert len(report["epochs"]) == 3
    windows = report["command"]["windows"]
    assert [w["name"] for w in windows] == ["eval"] * 3
    assert all(w["energy_J"] >= 0 and w["provenance"] for w in windows)


def test_a_failing_command_keeps_its_exit_code_and_the_report_is_written(tmp_path):
    out = tmp_path / "run"
    done = run_monitor(out, sys.executable, str(CHILD), "exit", "3")
    assert done.returncode == 3
    assert done.stdout == "exiting with 3\n"
    report = json.loads((out / "energy_report.json").read_text())
    assert report["command"]["exit_code"] == 3 and report["command"]["argv"][-2:] == ["exit", "3"]
    assert (out / "energy_trace.csv").exists() and (out / "energy_events.csv").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_reaches_the_command_and_the_report_is_still_written(tmp_path, signum):
    out, ready, got = tmp_path / "run", tmp_path / "ready", tmp_path / "got"
    process = subprocess.Popen(monitor_argv(out, sys.executable, str(CHILD), "signals", str(ready), str(got)),
                               env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_file(ready, process)  # the command's handlers are in place
        process.send_signal(signum)  # to the monitor alone, as kill(1) or a batch system sends it
        stdout, stderr = process.communicate()
    finally:
        if process.poll() is None:
            process.kill()
        kill_if_running(ready)
    name = signal.Signals(signum).name
    context = f"monitor exit code {process.returncode}; its stderr:\n{stderr}"  # for any failure below
    assert got.exists() and got.read_text() == name, context  # the command received it
    assert process.returncode == 128 + signum, context  # and died of it: the monitor says so as a shell does
    report = json.loads((out / "energy_report.json").read_text())
    command = report["command"]
    assert command["signal"] == name and command["signals_forwarded"] == [name], (command, context)
    assert command["exit_code"] == 128 + signum and command["pid"] == int(ready.read_text()), (command, context)


def test_attaching_to_a_running_process_measures_it_until_it_ends(tmp_path):
    ready, got = tmp_path / "ready", tmp_path / "got"
    target = subprocess.Popen([sys.executable, str(CHILD), "signals", str(ready), str(got)])
    out = tmp_path / "run"
    try:
        wait_for_file(ready, target)
        process = subprocess.Popen([sys.executable, "-m", "lightning_energy.cli", "monitor", "--out", str(out),
                                    "--interval", INTERVAL, "--sensors", "simulated:device_W=100", "--pid",
                                    str(target.pid)], env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        for line in process.stderr:  # the monitor says when it measures (an event, not a delay)
            if "measuring PID" in line:
                break
        else:
            pytest.fail(f"the monitor ended first: {process.communicate()}")
        target.send_signal(signal.SIGTERM)  # the process ends on its own account: the monitor follows
        target.wait()
        stdout, stderr = process.communicate()
    finally:
        for p in (target,):
            if p.poll() is None:
                p.kill()
    assert process.returncode == 0, stderr
    command = json.loads((out / "energy_report.json").read_text())["command"]
    assert command["attached"] and command["pid"] == target.pid and command["ended"] == "the process exited"
    assert command["exit_code"] is None and command["signals_forwarded"] == []
