"""The crash marker of a card is honoured, not overwritten (issue 29, item 5).

- A marker whose process is gone (SIGKILL, OOM kill) is put back before the next controller records what
  was there: an administrator's 275 W stays 275 W, not the killed run's profiled 225 W.
- A marker whose process still runs makes a second controller refuse, the card and the marker untouched.
- ``lightning-energy restore-power-limit`` reads the markers written so far and never acts on a marker
  that a new run replaced after the command read it.

Real-card paths run Zeus's ``NVIDIAGPU`` on ``fakes_nvml.FakeNvml`` (limits survive ``nvmlShutdown``, as on
a card); "killed" runs are controllers dropped without restoring, their marker given a pid that is surely
dead (a child process spawned and reaped). No real card is touched, nothing depends on timing.
"""

from __future__ import annotations

import gc
import json
import logging
import socket
import subprocess
import sys

import pytest

from lightning_energy.cli import main as cli
from lightning_energy.optimize.power_limit import gpu_control
from test_gpu_control import dead_pid, fake_nvml, state  # noqa: F401 (fixtures)

ADMIN_mW = 275_000  # what an administrator set on the card
PROFILED_mW = 225_000  # what the killed run was profiling when it died
CARD = 1  # NVML index of CUDA device 0 in the fake_nvml fixture


def killed_run(fake_nvml, pid: int) -> dict:
    """A run that took the card (administrator's 275 W, persistence off), set 225 W and was killed: its
    marker stays with ``pid`` as its writer. Returns the marker's document."""
    fake_nvml.gpus[CARD].limit_mW = ADMIN_mW
    controller = gpu_control.LimitController(gpu_control.open_gpu(0), "PowerLimitOptimizer (pid killed)")
    controller.take()
    controller.set_limit(PROFILED_mW // 1000)
    path = controller.marker
    del controller  # SIGKILL: no restore runs
    gc.collect()
    document = {**json.loads(path.read_text()), "pid": pid}
    path.write_text(json.dumps(document))
    return document


def card_limit_mW(fake_nvml) -> int:
    return fake_nvml.gpus[CARD].limit_mW


def test_the_next_run_puts_a_killed_runs_card_back_first_and_ends_at_the_administrators_limit(
        fake_nvml, state, caplog):
    left = killed_run(fake_nvml, dead_pid())
    assert (left["limit_mW"], card_limit_mW(fake_nvml)) == (ADMIN_mW, PROFILED_mW)
    gpu = gpu_control.open_gpu(0)  # a new process opens the card again: the 225 W is still in force
    controller = gpu_control.LimitController(gpu, "PowerLimitOptimizer (pid next)")
    with caplog.at_level(logging.WARNING, logger=gpu_control.__name__):
        before = controller.take()
    assert before == gpu_control.Settings(ADMIN_mW, False)  # old code: 225 W, persistence on
    assert card_limit_mW(fake_nvml) == ADMIN_mW  # put back before anything else
    (line,) = [r.getMessage() for r in caplog.records if r.name == gpu_control.__name__]
    assert "\n" not in line and "225 W" in line and "275 W" in line and "no longer running" in line
    (marker,) = gpu_control.list_markers(state)
    saved = gpu_control.read_marker(marker)
    assert (saved.limit_mW, saved.persistence_mode, saved.pid) == (ADMIN_mW, False, __import__("os").getpid())
    controller.set_limit(200)
    assert controller.restore() == []
    assert card_limit_mW(fake_nvml) == ADMIN_mW  # old code: ends at 225 W for good
    assert fake_nvml.gpus[CARD].persistence_mode == fake_nvml.NVML_FEATURE_DISABLED
    assert gpu_control.list_markers(state) == []


def test_a_marker_this_process_left_after_a_failed_restore_is_honoured_by_its_next_fit(fake_nvml, state):
    fake_nvml.gpus[CARD].limit_mW = ADMIN_mW
    first = gpu_control.LimitController(gpu_control.open_gpu(0), "first fit")
    first.take()
    first.set_limit(PROFILED_mW // 1000)
    fake_nvml.gpus[CARD].root = False
    assert first.restore() != []  # the marker stays, with this process's pid
    del first
    gc.collect()
    fake_nvml.gpus[CARD].root = True
    second = gpu_control.LimitController(gpu_control.open_gpu(0), "second fit")
    assert second.take().limit_mW == ADMIN_mW and card_limit_mW(fake_nvml) == ADMIN_mW
    assert second.restore() == [] and gpu_control.list_markers(state) == []


@pytest.fixture
def live_child():
    """A process that runs until the test ends (its pid is surely alive meanwhile)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield child.pid
    child.stdin.close()
    child.wait()


def test_a_second_controller_of_a_card_another_live_process_controls_refuses_and_changes_nothing(
        fake_nvml, state, live_child):
    killed_run(fake_nvml, live_child)  # its writer still runs: it controls the card
    (marker,) = gpu_control.list_markers(state)
    written = marker.read_bytes()
    limits_set = list(fake_nvml.gpus[CARD].limit_log)
    controller = gpu_control.LimitController(gpu_control.open_gpu(0), "PowerLimitOptimizer (pid second)")
    with pytest.raises(gpu_control.GpuControlError, match=rf"pid {live_child} .*nothing was changed") as refused:
        controller.take()  # old code: takes it, records 225 W
    assert isinstance(refused.value, gpu_control.CardInUseError) and "\n" not in str(refused.value)
    assert controller.before is None and controller.restore() == []
    assert card_limit_mW(fake_nvml) == PROFILED_mW and fake_nvml.gpus[CARD].limit_log == limits_set
    assert marker.read_bytes() == written  # old code: overwritten with 225 W as "what was there"


def test_two_controllers_in_one_process_do_not_share_a_card(fake_nvml, state):
    first = gpu_control.LimitController(gpu_control.open_gpu(0), "sweep")
    first.take()
    first.set_limit(300)
    second = gpu_control.LimitController(gpu_control.open_gpu(0), "PowerLimitOptimizer")
    with pytest.raises(gpu_control.GpuControlError, match="already under power-limit control by sweep"):
        second.take()
    assert card_limit_mW(fake_nvml) == 300_000
    assert first.restore() == [] and card_limit_mW(fake_nvml) == 450_000
    assert second.take().limit_mW == 450_000  # free again
    assert second.restore() == []


def test_an_unreadable_marker_is_refused_in_one_line_and_left_alone(fake_nvml, state):
    path = gpu_control.marker_path(state, CARD, fake_nvml.gpus[CARD].uuid)
    state.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(gpu_control.GpuControlError, match="cannot be read") as refused:
        gpu_control.LimitController(gpu_control.open_gpu(0), "test").take()
    assert "\n" not in str(refused.value) and path.read_text() == "{not json"
    assert fake_nvml.gpus[CARD].limit_log == []


def test_the_power_limit_optimizer_fails_at_setup_in_one_line_while_another_process_controls_the_card(
        fake_nvml, state, live_child, tmp_path, monkeypatch):
    import lightning as L

    from conftest import trainer_kwargs
    from lightning_energy.callbacks import power_limit
    from power_limit_helpers import SimModule, loader

    killed_run(fake_nvml, live_child)
    monkeypatch.setattr(power_limit, "limit_permission_problem", lambda gpu: None)  # as with SYS_ADMIN
    callback = power_limit.PowerLimitOptimizer(gpu=gpu_control.open_gpu(0), wait_steps=1, warmup_steps=1,
                                               profile_steps=3, log_figure=False)
    trainer = L.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path, max_epochs=1, logger=False))
    with pytest.raises(gpu_control.GpuControlError, match=rf"PowerLimitOptimizer .*pid {live_child}"):
        trainer.fit(SimModule(), loader(4))
    assert card_limit_mW(fake_nvml) == PROFILED_mW and fake_nvml.gpus[CARD].persistence_mode == 1


# ------------------------------------------------------------------------------------------ restore-power-limit
def old_marker(state, fake_nvml, pid: int) -> dict:
    """A marker exactly as the first release wrote it (format 1), of a run killed at 225 W."""
    gpu = fake_nvml.gpus[CARD]
    gpu.limit_mW = PROFILED_mW
    document = {"format": "lightning-energy power-limit marker 1", "nvml_index": CARD, "uuid": gpu.uuid,
                "gpu_name": "NVIDIA H100 80GB HBM3", "limit_mW": ADMIN_mW, "persistence_mode": False, "pid": pid,
                "host": socket.gethostname(), "owner": "PowerLimitOptimizer (pid 4242)", "created": 1.8e9,
                "restore": f"lightning-energy restore-power-limit (or: nvidia-smi -i {CARD} -pl 275 && "
                           f"nvidia-smi -i {CARD} -pm 0)"}
    state.mkdir(parents=True, exist_ok=True)
    (state / f"power-limit-{gpu.uuid}.json").write_text(json.dumps(document, indent=2) + "\n")
    return document


def test_the_command_restores_a_marker_written_by_the_first_release(fake_nvml, state, capsys):
    old_marker(state, fake_nvml, dead_pid())
    assert cli.main(["restore-power-limit", "--list"]) == 0
    assert "GPU 1" in capsys.readouterr().out and card_limit_mW(fake_nvml) == PROFILED_mW
    assert cli.main(["restore-power-limit"]) == 0
    assert "1 card(s) restored" in capsys.readouterr().out
    assert card_limit_mW(fake_nvml) == ADMIN_mW and gpu_control.list_markers(state) == []


def test_a_run_honours_a_marker_written_by_the_first_release(fake_nvml, state):
    old_marker(state, fake_nvml, dead_pid())
    controller = gpu_control.LimitController(gpu_control.open_gpu(0), "test")
    assert controller.take() == gpu_control.Settings(ADMIN_mW, False)
    assert controller.restore() == [] and card_limit_mW(fake_nvml) == ADMIN_mW


def test_the_command_leaves_a_marker_a_new_run_wrote_after_it_was_read(fake_nvml, state):
    old_marker(state, fake_nvml, dead_pid())
    (path,) = gpu_control.list_markers(state)
    read_by_the_command = gpu_control.read_marker(path)
    run = gpu_control.LimitController(gpu_control.open_gpu(0), "new run")  # takes the card meanwhile
    run.take()
    run.set_limit(200)
    assert gpu_control.restore_from_marker(read_by_the_command) == []
    assert card_limit_mW(fake_nvml) == 200_000  # the new run's limit, untouched
    assert gpu_control.read_marker(path).owner == "new run"  # old code: the run's marker deleted
    assert run.restore() == [] and card_limit_mW(fake_nvml) == ADMIN_mW



def test_the_command_says_so_when_a_new_run_took_the_card_while_it_ran(fake_nvml, state, capsys, monkeypatch):
    old_marker(state, fake_nvml, dead_pid())
    runs = []
    restore_from_marker = gpu_control.restore_from_marker

    def a_run_starts_first(marker, *args):
        runs.append(gpu_control.LimitController(gpu_control.open_gpu(0), "new run"))
        runs[-1].take()
        return restore_from_marker(marker, *args)

    monkeypatch.setattr(gpu_control, "restore_from_marker", a_run_starts_first)
    assert cli.main(["restore-power-limit"]) == 0
    out = capsys.readouterr().out
    assert "a new run has taken GPU 1" in out and "0 card(s) restored" in out
    assert gpu_control.read_marker(gpu_control.list_markers(state)[0]).owner == "new run"
    assert runs[0].restore() == [] and card_limit_mW(fake_nvml) == ADMIN_mW

# ------------------------------------------------------------------------------------------ two processes at once
CHILD_TAKES_THE_CARD = """
import contextlib, io, sys
sys.path[:0] = [{tests!r}, {root!r}]
from fakes_nvml import FakeNvml, h100s
with contextlib.redirect_stdout(io.StringIO()):
    import zeus.device.gpu.nvidia as zeus_nvidia
fake = FakeNvml(h100s(2))
sys.modules["pynvml"] = fake
zeus_nvidia.pynvml = fake
from lightning_energy.optimize.power_limit import gpu_control
try:
    gpu_control.LimitController(gpu_control.open_nvml_gpu({card}), "child").take()
    print("took", flush=True)
except gpu_control.GpuControlError as err:
    print("refused", err, flush=True)
"""


def waits_for_a_lock(pid: int) -> bool:
    """Whether process ``pid`` is blocked waiting for a file lock (``/proc/locks`` lists waiters with ``->``)."""
    with open("/proc/locks") as locks:
        return any("->" in line and line.split()[5] == str(pid) for line in locks)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/locks")
def test_the_look_and_the_write_are_one_step_for_two_processes(fake_nvml, state, tmp_path):
    """This process holds the marker's lock while a second process starts taking the same card; once that
    one waits for the lock, this one writes its marker and lets go: the second must see it and refuse (without
    the lock it would have found no marker and overwritten this one)."""
    import os
    import time
    from pathlib import Path

    import fakes_nvml

    uuid = fake_nvml.gpus[CARD].uuid
    path = gpu_control.marker_path(state, CARD, uuid)
    state.mkdir(parents=True)
    tests, root = str(Path(fakes_nvml.__file__).parent), str(Path(gpu_control.__file__).parents[3])
    script = CHILD_TAKES_THE_CARD.format(tests=tests, root=root, card=CARD)
    env = {**os.environ, gpu_control.STATE_DIR_ENV: str(state), "PYTHONPATH": root}
    env.pop("ZEUSD_SOCK_PATH", None)
    with gpu_control.marker_lock(path):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env)
        try:
            while child.poll() is None and not waits_for_a_lock(child.pid):
                time.sleep(0.01)  # waits for a condition, asserts no duration: the child gets there after its imports
            controller = gpu_control.LimitController(gpu_control.open_gpu(0), "parent")
            controller._write_marker(path, uuid, gpu_control.Settings(450_000, False))
        except BaseException:
            child.kill()
            raise
    out, err = child.communicate(timeout=120)
    assert out.startswith("refused") and "already under power-limit control by parent" in out, err[-2000:]
    assert gpu_control.read_marker(path).owner == "parent"

