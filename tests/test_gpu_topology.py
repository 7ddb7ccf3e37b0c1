"""Which GPUs a process and its ranks measure: several GPUs in one process, and one card read by two ranks.

On CPU: ``torch.device("cuda", i)`` objects need no CUDA, the model is a stand-in with parameters on them, and
NVML is the fake of ``fakes_nvml`` (the mapping reads ``CUDA_VISIBLE_DEVICES`` where torch has no CUDA).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fakes_nvml import FakeNvml, gh200, h100s
from lightning_energy.measure.sensors import detect
from lightning_energy.measure.sensors.nvml import NvmlGpuSensor


@pytest.fixture(autouse=True)
def no_cuda_environment(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def model_on(parameter_devices: list[str], buffer_devices: tuple[str, ...] = ()):
    """A stand-in module whose parameters and buffers sit on these devices (only ``.device`` is read)."""
    tensors = lambda devices: [types.SimpleNamespace(device=torch.device(d)) for d in devices]  # noqa: E731
    return types.SimpleNamespace(parameters=lambda: iter(tensors(parameter_devices)),
                                 buffers=lambda: iter(tensors(buffer_devices)))


# ------------------------------------------------------------ several GPUs in one process
def test_other_cuda_devices_are_those_besides_the_root_holding_parameters_or_buffers():
    model = model_on(["cuda:0", "cuda:2", "cuda:0", "cpu", "cuda:2"], buffer_devices=("cuda:1", "meta"))
    assert detect.other_cuda_devices(model, torch.device("cuda", 0)) == [torch.device("cuda", 1),
                                                                       torch.device("cuda", 2)]
    assert detect.other_cuda_devices(model, torch.device("cuda", 2)) == [torch.device("cuda", 0),
                                                                       torch.device("cuda", 1)]
    assert detect.other_cuda_devices(model_on(["cuda:0"]), torch.device("cuda", 0)) == []
    assert detect.other_cuda_devices(model_on(["cpu"]), torch.device("cpu")) == []


def test_a_pipeline_over_three_gpus_gets_a_sensor_for_each_other_gpu_and_a_note(monkeypatch, clock):
    """Stages on cuda:0-2 with the root on cuda:0 (CUDA_VISIBLE_DEVICES=3,1,2 on four cards: the root is NVML
    GPU 3): the other stages' cards (NVML 1 and 2) are measured, and one line says so and that marks wait on
    cuda:0 only."""
    fake = FakeNvml(h100s(4), clock)
    model = model_on(["cuda:0", "cuda:1", "cuda:2"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,2")
    sensors, notes = detect.other_device_sensors(model, torch.device("cuda", 0), pynvml_module=fake)
    assert [(s.name, s.nvml_index) for s in sensors] == [("gpu1", 1), ("gpu2", 2)]
    assert len(notes) == 1 and "cuda:1, cuda:2" in notes[0] and "gpu1, gpu2" in notes[0]
    assert "cuda:0's stream only" in notes[0]
    assert fake.init_count == 0  # every mapping gave its nvmlInit back
    assert detect.other_device_sensors(model_on(["cuda:0"]), torch.device("cuda", 0), fake) == ([], [])


def test_a_device_that_cannot_be_mapped_is_named_not_guessed(monkeypatch, clock):
    fake = FakeNvml(h100s(2), clock)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # CUDA sees one device: cuda:1 is nowhere
    sensors, notes = detect.other_device_sensors(model_on(["cuda:0", "cuda:1"]), torch.device("cuda", 0), fake)
    assert sensors == []
    assert "not measured" in notes[0] and "cuda:1's energy cannot be read" in notes[1]


def test_other_device_sensors_through_the_default_binding(monkeypatch, clock):
    fake = FakeNvml(h100s(2), clock)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sensors, _ = detect.other_device_sensors(model_on(["cuda:0", "cuda:1"]), torch.device("cuda", 0))
    assert [s.nvml_index for s in sensors] == [1]


# ------------------------------------------------------------ one card, several ranks
def test_every_nvml_sensor_names_its_card_by_uuid(clock):
    fake = FakeNvml(h100s(2), clock)
    sensor = NvmlGpuSensor(1, pynvml_module=fake)
    assert sensor.describe()["device_uuid"] is None  # not known before it opens
    sensor.open()
    assert sensor.device_uuid == fake.gpus[1].uuid and sensor.describe()["device_uuid"] == fake.gpus[1].uuid
    sensor.close()


def test_two_ranks_on_one_card_count_it_once_the_lowest_rank_keeps_it(clock):
    """Ranks 0 and 2 read NVML GPU 0 (MPS, or CUDA_VISIBLE_DEVICES set alike), rank 1 GPU 1: rank 2's reading is
    left out of the sums; host sensors and sensors without a UUID never are."""
    fake = FakeNvml(h100s(2), clock)
    opened = []
    for index in (0, 1, 0):
        sensor = NvmlGpuSensor(index, pynvml_module=fake)
        sensor.open()
        opened.append(sensor)
    host = {"name": "cpu_package0", "scope": "host"}
    per_rank = [[opened[0].describe(), host], [opened[1].describe()], [opened[2].describe(), {"name": "user_meter"}]]
    assert detect.duplicate_device_sensors(per_rank) == {(2, "gpu0")}
    for sensor in opened:
        sensor.close()


def test_duplicates_are_found_by_uuid_whatever_the_names_and_prefixes():
    uuid = "GPU-8f3a1b2c-0000-0000-0000-000000000000"
    per_rank = [
        [{"name": "gpu3", "device_uuid": uuid}],
        [{"name": "zeus_gpu3", "device_uuid": uuid.upper().replace("GPU-", "")}],  # same card, torch's spelling
        [{"name": "gpu1", "device_uuid": "GPU-1234abcd-0000-0000-0000-000000000000"},
         {"name": "gpu1_again", "device_uuid": "GPU-1234abcd-0000-0000-0000-000000000000"}],
        [],
    ]
    assert detect.duplicate_device_sensors(per_rank) == {(1, "zeus_gpu3"), (2, "gpu1_again")}
    assert detect.duplicate_device_sensors([[{"name": "gpu0", "device_uuid": None}]] * 2) == set()
    assert detect.duplicate_device_sensors([]) == set()


def test_a_grace_hopper_module_is_one_card_too(clock):
    fake = FakeNvml([gh200()], clock)
    a, b = NvmlGpuSensor(0, pynvml_module=fake), NvmlGpuSensor(0, pynvml_module=fake)
    a.open()
    b.open()
    assert detect.duplicate_device_sensors([[a.describe()], [b.describe()]]) == {(1, "gpu0")}
    a.close()
    b.close()
