"""Card control shared by PowerLimitOptimizer and the sweep: restore what was there (limit and persistence
mode), SIGHUP, the crash marker and ``lightning-energy restore-power-limit``, the CUDA -> NVML mapping.

Real-card paths run Zeus's own ``NVIDIAGPU`` on ``fakes_nvml.FakeNvml`` (NVML's mW units, permissions,
persistence-mode constants); the callback runs on the simulated GPU with fake time. No real card is touched.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys

import lightning as L
import pytest
from lightning.pytorch import Callback

from conftest import trainer_kwargs
from fakes_nvml import FakeNvml, h100s
from lightning_energy.cli import main as cli
from lightning_energy.optimize.power_limit import gpu_control
from lightning_energy.callbacks.power_limit import PowerLimitOptimizer
from lightning_energy.simulate.gpu_sim import SimulatedGPU, SimulatedWorkload
from power_limit_helpers import SimModule, install_fake_time, loader

ADMIN_W = 250  # an administrator's limit, not the card's default (300 W)


@pytest.fixture
def clock(monkeypatch):
    return install_fake_time(monkeypatch.setattr)


@pytest.fixture
def state(tmp_path, monkeypatch):
    directory = tmp_path / "state"
    monkeypatch.setenv(gpu_control.STATE_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def fake_nvml(monkeypatch):
    """Two H100s behind pynvml and Zeus's NVIDIA layer; CUDA sees them in the other order (by UUID), so CUDA
    device 0 is NVML GPU 1. NVML GPU 1 was left by an administrator at 450 W with persistence mode off."""
    with contextlib.redirect_stdout(io.StringIO()):
        import zeus.device.gpu.nvidia as zeus_nvidia
    gpus = h100s(2)
    gpus[1].limit_mW = 450_000
    fake = FakeNvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(zeus_nvidia, "pynvml", fake)
    monkeypatch.delenv("ZEUSD_SOCK_PATH", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpus[1].uuid},{gpus[0].uuid}")
    monkeypatch.setattr(gpu_control, "visible_gpu_count", lambda: 2)
    return fake


def admin_card(clock, **kwargs) -> SimulatedGPU:
    gpu = SimulatedGPU(clock=clock, **kwargs)
    gpu.set_power_management_limit(ADMIN_W * 1000)
    gpu.limit_log.clear()
    return gpu


def fit(tmp_path, gpu, callback, module=None, extra=(), batches=40):
    callback.gpu = gpu
    trainer = L.Trainer(callbacks=[callback, SimulatedWorkload(gpu=gpu), *extra],
                        **trainer_kwargs(tmp_path, max_epochs=1, logger=False))
    trainer.fit(module or SimModule(), loader(batches))
    return trainer


def optimizer(**kwargs) -> PowerLimitOptimizer:
    return PowerLimitOptimizer(**{"wait_steps": 1, "warmup_steps": 1, "profile_steps": 3, "log_figure": False, **kwargs})


# ------------------------------------------------------------------------------------------ restore what was there
def test_the_limit_and_persistence_mode_in_force_before_the_fit_come_back_not_the_default(tmp_path, clock, state):
    gpu = admin_card(clock, persistence_mode=False)
    callback = optimizer(selector="energy")
    fit(tmp_path, gpu, callback)
    assert callback.chosen_limit_W == 150
    assert gpu.persistence_log == [True, False]  # on while profiling (as Zeus), then as it was
    assert gpu.power_limit_W == ADMIN_W and gpu.limit_log[-1] == ADMIN_W  # not NVML's default of 300 W
    assert not state.exists() or not list(state.iterdir())  # a simulated card leaves no marker


@pytest.mark.parametrize("exception", [RuntimeError, KeyboardInterrupt])
def test_what_was_there_comes_back_on_an_exception_and_ctrl_c(tmp_path, clock, state, exception):
    gpu = admin_card(clock, persistence_mode=False)
    module = SimModule(fail_at_step=9, exception=exception)
    try:
        with pytest.raises(SystemExit if exception is KeyboardInterrupt else RuntimeError):
            fit(tmp_path, gpu, optimizer(), module=module)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT after a Ctrl-C
    assert any(limit != ADMIN_W for limit in gpu.limit_log)  # it was profiling ...
    assert gpu.power_limit_W == ADMIN_W and gpu.get_persistence_mode() is False  # ... and it is back


class HangUpAt(Callback):
    """Sends this process SIGHUP at a training step (a closed terminal)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            import os

            os.kill(os.getpid(), signal.SIGHUP)


def test_sighup_puts_the_card_back_before_the_previous_handler_runs(tmp_path, clock, state):
    gpu = admin_card(clock, persistence_mode=False)
    seen = []

    def previous(signum, frame):  # what the process did on SIGHUP before (here: end the run)
        seen.append((gpu.power_limit_W, gpu.get_persistence_mode()))
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGHUP, previous)
    try:
        with pytest.raises(SystemExit):
            fit(tmp_path, gpu, optimizer(), extra=[HangUpAt(7)])  # while 275 W is profiled
    finally:
        signal.signal(signal.SIGHUP, old)
    assert any(limit != ADMIN_W for limit in gpu.limit_log[:-1])  # it was profiling when hung up
    assert seen == [(ADMIN_W, False)]


@pytest.mark.parametrize("disposition", ["SIG_DFL", "SIG_IGN"])
def test_sighup_with_the_default_disposition_ends_the_process_after_restoring_and_nohup_goes_on(tmp_path, disposition,
                                                                                              rank_zygote):
    """A real process. SIGHUP's default disposition: the limit comes back, then the process dies of SIGHUP. SIGHUP
    ignored (``nohup``, whose children inherit it): the guard is not installed and the run goes on (the limit comes
    back at its end as usual). The disposition is set in the child: the test's own may be either (the old test
    inherited it and failed when the suite ran under ``nohup``)."""
    script = tmp_path / "hangup.py"
    script.write_text(f"""
import os, signal, sys
signal.signal(signal.SIGHUP, signal.{disposition})
sys.path.insert(0, {str(tmp_path.parent)!r})
from lightning_energy.optimize.power_limit import gpu_control
from lightning_energy.simulate.gpu_sim import SimulatedGPU
gpu = SimulatedGPU(persistence_mode=False)
gpu.set_power_management_limit({ADMIN_W * 1000})
controller = gpu_control.LimitController(gpu, "test")
controller.take()
controller.set_limit(150)
def restore():
    controller.restore()
    print("restored", gpu.power_limit_W, gpu.get_persistence_mode(), flush=True)
guard = gpu_control.HangupGuard(restore)
guard.install()
os.kill(os.getpid(), signal.SIGHUP)
print("still running", flush=True)
""")
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    run = rank_zygote.run_python(script.read_text(), tmp_path, env)  # a real process, forked warm
    if disposition == "SIG_DFL":
        assert run.returncode == -signal.SIGHUP, run.stderr[-2000:]
        assert run.stdout.splitlines() == [f"restored {ADMIN_W} False"]
    else:
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.splitlines() == ["still running"]


# ------------------------------------------------------------------------------------------ real cards (fake NVML)
def test_the_controller_opens_the_card_through_the_cuda_to_nvml_mapping(fake_nvml, state):
    gpu = gpu_control.open_gpu(0)
    assert gpu.gpu_index == 1  # CUDA device 0 is NVML GPU 1 (by UUID), as the energy sensor finds it
    controller = gpu_control.LimitController(gpu, "test")
    controller.take()
    assert fake_nvml.gpus[1].persistence_mode == fake_nvml.NVML_FEATURE_ENABLED
    controller.set_limit(300)
    assert fake_nvml.gpus[1].limit_mW == 300_000 and fake_nvml.gpus[0].limit_log == []
    (marker,) = gpu_control.list_markers(state)
    saved = json.loads(marker.read_text())
    assert (saved["nvml_index"], saved["uuid"], saved["limit_mW"], saved["persistence_mode"]) == (
        1, fake_nvml.gpus[1].uuid, 450_000, False)
    assert "nvidia-smi -i 1 -pl 450" in saved["restore"]
    assert controller.restore() == []
    assert fake_nvml.gpus[1].limit_mW == 450_000 and fake_nvml.gpus[1].persistence_mode == 0
    assert gpu_control.list_markers(state) == []


def test_a_failed_restore_names_the_nvml_index_in_its_nvidia_smi_hint_and_keeps_the_marker(fake_nvml, state):
    controller = gpu_control.LimitController(gpu_control.open_gpu(0), "test")
    controller.take()
    controller.set_limit(300)
    fake_nvml.gpus[1].root = False  # e.g. the capability was dropped
    problems = controller.restore()
    assert len(problems) == 2
    assert "nvidia-smi -i 1 -pl 450" in problems[0] and "nvidia-smi -i 1 -pm 0" in problems[1]
    assert len(gpu_control.list_markers(state)) == 1


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_after_sigkill_the_command_puts_the_card_back_from_the_marker(fake_nvml, state, capsys):
    controller = gpu_control.LimitController(gpu_control.open_gpu(0), "PowerLimitOptimizer (pid x)")
    controller.take()
    controller.set_limit(250)
    del controller  # SIGKILL: nothing runs after this point in that process
    (marker,) = gpu_control.list_markers(state)
    assert cli.main(["restore-power-limit", "--list"]) == 0
    assert "GPU 1" in capsys.readouterr().out
    assert cli.main(["restore-power-limit"]) == 0  # its process (this one) still runs: left alone
    assert "skipped" in capsys.readouterr().out and fake_nvml.gpus[1].limit_mW == 250_000
    saved = json.loads(marker.read_text())
    marker.write_text(json.dumps({**saved, "pid": dead_pid()}))
    assert cli.main(["restore-power-limit", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert "restored GPU 1" in out and "1 card(s) restored" in out
    assert fake_nvml.gpus[1].limit_mW == 450_000 and fake_nvml.gpus[1].persistence_mode == 0
    assert gpu_control.list_markers(state) == []
    assert cli.main(["restore-power-limit"]) == 0
    assert "nothing to restore" in capsys.readouterr().out


def test_the_command_refuses_a_bad_marker_in_one_line(fake_nvml, state, capsys):
    state.mkdir(parents=True)
    (state / "power-limit-bad.json").write_text('{"format": "lightning-energy power-limit marker 1", "nvml_index": -3}')
    assert cli.main(["restore-power-limit"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "power-limit-bad.json" in err


def test_the_sweep_controls_the_trainers_card_through_the_mapping_and_restores_what_was_there(fake_nvml, state):
    from lightning_energy.sweep.runner import GpuPowerLimits

    limits = GpuPowerLimits.open({"devices": [0]}, [200, 300])
    assert [gpu.gpu_index for gpu in limits.gpus.values()] == [1]
    with limits.applied(200):
        assert fake_nvml.gpus[1].limit_mW == 200_000 and len(gpu_control.list_markers(state)) == 1
    assert fake_nvml.gpus[1].limit_mW == 450_000  # after each run: what was there before the sweep
    with limits.applied(None):
        assert fake_nvml.gpus[1].limit_mW == 450_000  # null: that limit, not NVML's default (700 W)
    limits.close()
    assert fake_nvml.gpus[1].persistence_mode == 0 and gpu_control.list_markers(state) == []
    assert fake_nvml.gpus[0].limit_log == []  # the other card is never touched
    from lightning_energy.sweep.runner import SweepError

    limits = GpuPowerLimits.open({"devices": [0]}, [200])
    with pytest.raises(SweepError, match=r"set it by hand: nvidia-smi -i 1 -pl 450"):
        with limits.applied(200):
            fake_nvml.gpus[1].root = False  # the limit cannot be put back after this run
    fake_nvml.gpus[1].root = True
    limits.close()
    assert fake_nvml.gpus[1].limit_mW == 450_000
