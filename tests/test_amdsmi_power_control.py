"""Power-cap control of AMD GPUs through amdsmi, under the same rules as NVIDIA's: what was there is put
back, a crash marker is written before the first change, a killed run's marker is honoured, and
``lightning-energy restore-power-limit`` opens an AMD marker's card through amdsmi. All on ``FakeAmdSmi``
(µW caps, root only, the cap survives amdsmi_shut_down as on a card); no card is touched."""

from __future__ import annotations

import gc
import json
import logging
import sys
import types

import pytest

from fakes_amdsmi import AMDSMI_STATUS_NO_PERM, FakeAmdSmi, mi300x
from fakes_nvml import FakeClock, FakeTorch
from lightning_energy.measure.sensors.amdsmi import AmdSmiNoPermissionError
from lightning_energy.optimize.power_limit import gpu_control
from lightning_energy.optimize.power_limit.amd_control import AmdSmiCard
from test_gpu_control import dead_pid, state  # noqa: F401 (fixtures)

ADMIN_uW = 600_000_000  # what an administrator set (the default is 750 W)


@pytest.fixture
def fake_amdsmi(monkeypatch):
    """Two MI300X behind ``import amdsmi``; torch is a ROCm build whose cuda:0 is amdsmi GPU 1
    (HIP_VISIBLE_DEVICES=1); GPU 1 was left by an administrator at 600 W."""
    for name in ("ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    gpus = mi300x(2)
    gpus[1].cap_uW = ADMIN_uW
    fake = FakeAmdSmi(gpus, FakeClock())
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    torch = FakeTorch(FakeClock(), device_count=1)
    torch.version = types.SimpleNamespace(hip="6.4.43482", cuda=None)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    return fake


def test_the_card_speaks_mw_to_the_controller_and_uw_to_amdsmi(fake_amdsmi):
    card = gpu_control.open_gpu(0)  # ROCm torch: mapped and opened through amdsmi
    assert isinstance(card, AmdSmiCard) and card.gpu_index == 1 and gpu_control.card_vendor(card) == "amd"
    assert card.get_power_management_limit_constraints() == (200_000, 750_000)
    assert card.get_power_management_limit() == 600_000 and card.get_default_power_management_limit() == 750_000
    card.set_power_management_limit(450_000)
    assert fake_amdsmi.gpus[1].cap_log == [450_000_000]
    assert gpu_control.gpu_uuid(card) == fake_amdsmi.gpus[1].uuid and gpu_control.default_limit_mW(card) == 750_000
    with pytest.raises(RuntimeError, match="no persistence mode"):
        card.get_persistence_mode()
    assert gpu_control.smi_hint(1, 450_000, vendor="amd") == "amd-smi set -g 1 -o 450"
    card.close()
    assert not fake_amdsmi.initialised


def test_take_set_restore_puts_the_administrators_cap_back_and_removes_the_marker(fake_amdsmi, state):
    controller = gpu_control.LimitController(gpu_control.open_gpu(0), "test")
    assert controller.take() == gpu_control.Settings(600_000, None)  # no persistence mode on AMD
    (path,) = gpu_control.list_markers(state)
    marker = gpu_control.read_marker(path)
    assert (marker.vendor, marker.nvml_index, marker.uuid) == ("amd", 1, fake_amdsmi.gpus[1].uuid)
    assert "amd-smi set -g 1 -o 600" in json.loads(path.read_text())["restore"]
    controller.set_limit(300)
    assert fake_amdsmi.gpus[1].cap_uW == 300_000_000
    assert controller.restore() == []
    assert fake_amdsmi.gpus[1].cap_uW == ADMIN_uW and gpu_control.list_markers(state) == []


def test_a_killed_runs_amd_marker_is_honoured_and_the_command_restores_through_amdsmi(fake_amdsmi, state, caplog):
    gone = dead_pid()
    killed = gpu_control.LimitController(gpu_control.open_gpu(0), "killed run")
    killed.take()
    killed.set_limit(250)
    path = killed.marker
    del killed  # SIGKILL: no restore
    gc.collect(0)  # the youngest generation is enough (a full collection takes a second with torch loaded)
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": gone}))
    marker = gpu_control.read_marker(path)
    assert gpu_control.restore_from_marker(marker) == []  # the command: opens AMD GPU 1 through amdsmi
    assert fake_amdsmi.gpus[1].cap_uW == ADMIN_uW and not path.exists()
    # the next run after another killed one: the card is put back before it records what was there
    second = gpu_control.LimitController(gpu_control.open_gpu(0), "killed again")
    second.take()
    second.set_limit(250)
    path = second.marker
    del second
    gc.collect(0)  # the youngest generation is enough (a full collection takes a second with torch loaded)
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": gone}))
    with caplog.at_level(logging.WARNING, logger=gpu_control.__name__):
        assert gpu_control.LimitController(gpu_control.open_gpu(0), "next").take().limit_mW == 600_000
    assert fake_amdsmi.gpus[1].cap_uW == ADMIN_uW and "250 W" in caplog.text and "600 W" in caplog.text


def test_an_amd_marker_whose_card_moved_names_amd_smi(fake_amdsmi, state):
    controller = gpu_control.LimitController(gpu_control.open_gpu(0), "run")
    controller.take()
    path = controller.marker
    document = {**json.loads(path.read_text()), "pid": dead_pid(), "nvml_index": 0}  # index 0 is another card
    path.write_text(json.dumps(document))
    (problem,) = gpu_control.restore_from_marker(gpu_control.read_marker(path))
    assert "indices changed" in problem and "amd-smi list" in problem and "amd-smi set -g <index> -o 600" in problem


def test_without_root_the_problem_is_said_before_and_the_error_is_a_permission_error(fake_amdsmi, state):
    fake_amdsmi.gpus[1].root = False
    card = AmdSmiCard(1, fake_amdsmi, is_root=lambda: False)
    assert "only root" in gpu_control.permission_problem(card)
    with pytest.raises(gpu_control.permission_errors()) as raised:
        card.set_power_management_limit(300_000)
    assert isinstance(raised.value, AmdSmiNoPermissionError) and raised.value.code == AMDSMI_STATUS_NO_PERM
    assert gpu_control.permission_problem(AmdSmiCard(1, fake_amdsmi, is_root=lambda: True)) is None
    problems = gpu_control.put_back(card, gpu_control.Settings(700_000, None))
    assert len(problems) == 1 and "set it by hand: amd-smi set -g 1 -o 700" in problems[0]


def test_a_partitioned_card_is_not_controlled(fake_amdsmi):
    fake_amdsmi.gpus[1].compute_partition = "CPX"
    with pytest.raises(gpu_control.GpuControlError, match="CPX compute-partition mode"):
        gpu_control.open_gpu(0)
    assert not fake_amdsmi.initialised


def test_power_limit_optimizer_takes_and_restores_an_amd_card(fake_amdsmi, state, monkeypatch):
    """The callback's card handling (``_take_card`` / ``_restore``) on an AMD card: the marker first, the
    administrator's cap back at the end; amdsmi's NO_PERM is the permission error it reports."""
    import torch

    from lightning_energy.callbacks.power_limit import PowerLimitOptimizer

    card = gpu_control.rank_gpu(torch.device("cuda", 0))
    assert isinstance(card, AmdSmiCard)
    optimizer = PowerLimitOptimizer()
    optimizer._take_card(card)
    assert optimizer._start_W == 600 and len(gpu_control.list_markers(state)) == 1
    card.set_power_management_limit(300_000)
    optimizer._restore()
    assert fake_amdsmi.gpus[1].cap_uW == ADMIN_uW and gpu_control.list_markers(state) == []
    fake_amdsmi.fail("amdsmi_get_power_cap_info", AMDSMI_STATUS_NO_PERM)
    with pytest.raises(RuntimeError, match="cannot set GPU power limits"):
        PowerLimitOptimizer()._take_card(card)
