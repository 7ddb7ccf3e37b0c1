"""The AMD GPU sensor and the torch (HIP) -> amdsmi mapping against a fake ``amdsmi`` that follows AMD SMI's
documented semantics (``fakes_amdsmi.FakeAmdSmi``; checked here against the installed amdsmi package), on a
fake clock and through the real sampler."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import math
import sys
import types

import pytest

from fakes_amdsmi import (
    AMDSMI_STATUS_NO_PERM,
    AMDSMI_STATUS_NOT_SUPPORTED,
    AMDSMI_STATUS_UNKNOWN_ERROR,
    FakeAmdGpu,
    FakeAmdSmi,
    mi300x,
)
from fakes_nvml import FakeClock, FakeNvml, FakeTorch, h100s
from lightning_energy.measure.sampler import Sampler
from lightning_energy.measure.sensors import amdsmi as amd_module
from lightning_energy.measure.sensors import detect
from lightning_energy.measure.sensors.amdsmi import AmdSmiGpuSensor, amd_gpu_for_torch_device

VISIBLE = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture(autouse=True)
def no_visible_devices(monkeypatch):
    for name in VISIBLE:
        monkeypatch.delenv(name, raising=False)


def opened(fake: FakeAmdSmi, index: int = 0) -> AmdSmiGpuSensor:
    sensor = AmdSmiGpuSensor(index, amdsmi_module=fake)
    sensor.open()
    return sensor


@contextlib.contextmanager
def real_amdsmi(monkeypatch):
    """The installed amdsmi package, imported with a stand-in for ROCm's libamd_smi.so (absent here; the
    package binds its symbols at import and calls none of them). Removed from sys.modules afterwards."""
    class AnyLibrary:
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            symbol = types.SimpleNamespace()
            object.__setattr__(self, name, symbol)
            return symbol

    before = {name for name in sys.modules if name == "amdsmi" or name.startswith("amdsmi.")}
    for name in before:
        monkeypatch.delitem(sys.modules, name)
    with monkeypatch.context() as patch:
        patch.setattr(ctypes, "CDLL", lambda *args, **kwargs: AnyLibrary())
        try:
            module = importlib.import_module("amdsmi")
        except ImportError:
            pytest.skip("the amdsmi package is not installed")
    try:
        yield module
    finally:
        for name in [n for n in sys.modules if n == "amdsmi" or n.startswith("amdsmi.")]:
            del sys.modules[name]


# ------------------------------------------------------------------ the fake is faithful to amdsmi
def test_the_fake_mirrors_amdsmis_names_signatures_enums_and_exceptions(monkeypatch):
    with real_amdsmi(monkeypatch) as amdsmi:
        fake = FakeAmdSmi(mi300x(1))
        functions = [n for n in dir(FakeAmdSmi) if n.startswith("amdsmi_")]
        assert len(functions) > 15
        for name in functions:
            real = inspect.signature(getattr(amdsmi, name))
            assert list(inspect.signature(getattr(fake, name)).parameters) == list(real.parameters), name
        for enum in ("AmdSmiInitFlags", "AmdSmiClkType", "AmdSmiTemperatureType", "AmdSmiTemperatureMetric",
                     "AmdSmiComputePartitionType"):
            for member in getattr(fake, enum):
                assert getattr(getattr(amdsmi, enum), member.name) == member.value, (enum, member.name)
        for name in ("AmdSmiException", "AmdSmiLibraryException", "AmdSmiRetryException", "AmdSmiTimeoutException",
                     "AmdSmiParameterException"):
            assert getattr(fake, name).__mro__[1].__name__ == getattr(amdsmi, name).__mro__[1].__name__, name
        wrapper = amdsmi.amdsmi_wrapper
        for name in [n for n in dir(FakeAmdSmi) if n.startswith("AMDSMI_STATUS_")]:
            code = getattr(fake, name)
            assert getattr(wrapper, name) == code, name
            ours, theirs = fake.AmdSmiLibraryException(code), amdsmi.AmdSmiLibraryException(code)
            assert str(ours) == str(theirs) and ours.get_error_code() == theirs.get_error_code(), name
        assert str(fake.AmdSmiRetryException()) == str(amdsmi.AmdSmiRetryException())
        assert amdsmi.MAX_NUM_PROCESSES == 1024 if hasattr(amdsmi, "MAX_NUM_PROCESSES") else True
        # the interface's own documentation of what the fake returns: keys and units
        source = inspect.getsource(amdsmi.amdsmi_get_energy_count)
        assert all(key in source for key in ("'energy_accumulator'", "'counter_resolution'", "'timestamp'"))
        source = inspect.getsource(amdsmi.amdsmi_get_power_info)
        assert all(key in source for key in ('"current_socket_power"', '"average_socket_power"', '"N/A"'))
        source = inspect.getsource(amdsmi.amdsmi_get_power_cap_info)
        assert all(f'"{key}"' in source for key in fake.amdsmi_get_power_cap_info.__code__.co_consts
                   if isinstance(key, str) and key.endswith("_cap"))


def test_the_sensors_status_codes_are_amdsmis(monkeypatch):
    with real_amdsmi(monkeypatch) as amdsmi:
        names = [n for n in dir(amd_module) if n.startswith("AMDSMI_STATUS_")]
        assert len(names) >= 5
        for name in names:
            assert getattr(amd_module, name) == getattr(amdsmi.amdsmi_wrapper, name), name
        assert amd_module.SPX == amdsmi.AmdSmiComputePartitionType.SPX.name


def test_the_library_loader_says_why_amdsmi_cannot_load_here():
    """Without ROCm, importing amdsmi prints and raises KeyError: the loader turns it into one ImportError."""
    if "amdsmi" in sys.modules:
        pytest.skip("amdsmi already imported in this process")
    try:
        amd_module.load_amdsmi()
    except ImportError as err:
        assert "libamd_smi.so" in str(err) or "amdsmi" in str(err)
    finally:
        for name in [n for n in sys.modules if n == "amdsmi" or n.startswith("amdsmi.")]:
            del sys.modules[name]


# ------------------------------------------------------------------ what the sensor reads
def test_the_accumulator_is_read_in_joules_from_its_resolution(clock):
    fake = FakeAmdSmi(mi300x(1, power_W=300.0), clock)
    sensor = opened(fake)
    clock.advance(0.5)
    count = fake.amdsmi_get_energy_count(fake.amdsmi_get_processor_handles()[0])
    assert count["counter_resolution"] == 15.3 and count["timestamp"] == 1000.5e9
    assert sensor.energy_j() == pytest.approx(150.0, abs=15.3e-6)
    assert sensor.kind == "energy" and sensor.reading == "energy counter"
    assert sensor.counter_update_period_s == amd_module.COUNTER_UPDATE_PERIOD_S == 0.01
    described = sensor.describe()
    assert described["library"] == "amdsmi" and described["provenance"] == "measured"
    assert described["device_uuid"] == fake.gpus[0].uuid and described["bdf"] == "0000:0c:00.0"
    assert "amdsmi_get_energy_count" in sensor.source and "µJ" in sensor.source and "assumed" in sensor.source
    sensor.close()
    assert not fake.initialised


def test_the_accumulator_key_of_amdsmi_before_rocm_6_4_is_read_too(clock):
    fake = FakeAmdSmi(mi300x(1, legacy_power_key=True, power_W=200.0), clock)
    sensor = opened(fake)
    clock.advance(1.0)
    assert sensor.energy_j() == pytest.approx(200.0, abs=1e-4)


def sampled(fake, clock, seconds: float, interval_s: float = 0.05, sensor=None):
    """The real Sampler (no thread) reading GPU 0 of ``fake`` every ``interval_s`` on ``clock`` for ``seconds``."""
    sampler = Sampler(clock=clock)
    sensor = sensor or AmdSmiGpuSensor(0, amdsmi_module=fake)
    (name,) = sampler.acquire("amd", [sensor], interval_s=interval_s, start_thread=False)
    start = clock()
    while clock() - start < seconds:
        clock.advance(interval_s)
        sampler.sample_once()
    return sampler, name


def test_a_32_bit_accumulator_wraps_and_the_energy_goes_on_through_the_sampler(clock):
    """gpu_metrics v1.0: a 32-bit accumulator, 65.7 kJ at 15.3 µJ; started 2 s of 500 W before its wrap."""
    start = 2 ** 32 - int(1000.0 / 15.3e-6)
    fake = FakeAmdSmi(mi300x(1, counter_bits=32, counter_start=start, power_W=500.0), clock)
    sampler, name = sampled(fake, clock, 4.0)
    assert list(sampler.read_errors) == [] and list(sampler.failures) == []
    series = sampler.series[name]
    assert series.energies[-1] - series.energies[0] == pytest.approx(fake.energy_J(0, series.times[-1])
                                                                     - fake.energy_J(0, series.times[0]), rel=1e-3)
    assert series.sensor._wraps == 1
    sampler.release("amd")
    assert not fake.initialised


def test_a_64_bit_accumulator_going_backwards_costs_one_read_not_the_run(clock):
    """ROCm/amdsmi#115: a counter read going backwards once. That read is an error (the sampler's budget);
    the sensor keeps its last good value and goes on."""
    fake = FakeAmdSmi(mi300x(1, power_W=300.0), clock)
    sensor = AmdSmiGpuSensor(0, amdsmi_module=fake)
    sampler, name = sampled(fake, clock, 0.5, sensor=sensor)
    real = fake.amdsmi_get_energy_count
    glitch = {"left": 1}

    def backwards_once(handle):
        count = dict(real(handle))
        if glitch["left"]:
            glitch["left"] -= 1
            count["energy_accumulator"] -= 3_000_000  # 46 J: below the last read (15 J per 50 ms at 300 W)
        return count

    fake.amdsmi_get_energy_count = backwards_once
    for _ in range(10):
        clock.advance(0.05)
        sampler.sample_once()
    assert len(sampler.read_errors) == 1 and "went backwards" in sampler.read_errors[0].message
    assert "AmdSmiCounterError" in sampler.read_errors[0].message and list(sampler.failures) == []
    series = sampler.series[name]
    assert series.energies[-1] == pytest.approx(fake.energy_J(0, clock()), abs=0.5)
    sampler.release("amd")


def test_a_counter_reset_fails_the_sensor_past_its_error_budget(clock):
    """A GPU reset puts the accumulator back near 0 for good: every read after it is refused until the
    sampler's error budget fails the sensor (its energy up to then stays counted)."""
    fake = FakeAmdSmi(mi300x(1, counter_start=10 ** 12, power_W=300.0), clock)
    sampler, name = sampled(fake, clock, 0.5)
    fake.gpus[0].counter_start = 0
    for _ in range(20):
        clock.advance(0.05)
        sampler.sample_once()
    (failure,) = sampler.failures
    assert failure.name == name and "in a row failed" in failure.message and "AmdSmiCounterError" in failure.message
    sampler.release("amd")


def test_without_a_counter_the_instant_power_is_polled_and_says_so(clock):
    fake = FakeAmdSmi(mi300x(1, has_energy_counter=False, power_W=420.0), clock)
    sensor = opened(fake)
    assert sensor.kind == "power" and sensor.counter_update_period_s is None
    assert sensor.reading == "instant power" and sensor.power_w() == 420.0
    assert "current_socket_power" in sensor.source and "polled" in sensor.source
    sampler, name = sampled(fake, clock, 1.0, sensor=sensor)
    assert sampler.series[name].energies[-1] == pytest.approx(420.0 * 1.0, rel=0.06)
    sampler.release("amd")


def test_mi200_average_power_is_the_fallback_and_a_gpu_with_neither_is_refused(clock):
    mi250 = FakeAmdGpu(bdf="0000:c1:00.0", uuid="u0", hip_id=0, market_name="AMD Instinct MI250X",
                       has_energy_counter=False, has_current_power=False, has_average_power=True,
                       compute_partition=None, power_W=100.0)
    fake = FakeAmdSmi([mi250], clock)
    sensor = opened(fake)
    clock.advance(2.0)
    fake.set_power(0, 300.0)
    clock.advance(0.5)
    assert sensor.reading == "average power" and sensor.power_w() == 200.0  # a 1-s mean, in this fake
    assert sensor.power_scope == "package" and "MI250" in sensor.source and "GCD" in sensor.source
    sensor.close()
    fake.gpus[0].has_average_power = False
    with pytest.raises(RuntimeError, match="neither its energy counter nor its power") as raised:
        AmdSmiGpuSensor(0, amdsmi_module=fake).open()
    assert type(raised.value).__name__ == "AmdSmiNotSupportedError" and not fake.initialised


# ------------------------------------------------------------------ typed errors, not NaN or a silent fallback
def test_only_not_supported_means_no_counter_and_errors_name_the_call_and_gpu(clock):
    fake = FakeAmdSmi(mi300x(2), clock)
    fake.fail("amdsmi_get_energy_count", AMDSMI_STATUS_NO_PERM)
    with pytest.raises(RuntimeError, match="Permission Denied") as raised:
        AmdSmiGpuSensor(1, amdsmi_module=fake).open()  # not demoted to power polling
    assert type(raised.value).__name__ == "AmdSmiNoPermissionError" and raised.value.code == AMDSMI_STATUS_NO_PERM
    assert "AMD GPU 1" in str(raised.value) and not fake.initialised
    fake.fail("amdsmi_get_energy_count", None)
    sensor = opened(fake, 1)
    fake.fail("amdsmi_get_energy_count", AMDSMI_STATUS_UNKNOWN_ERROR)
    with pytest.raises(RuntimeError, match="energy_j on AMD GPU 1") as raised:
        sensor.energy_j()
    assert isinstance(raised.value.__cause__, fake.AmdSmiLibraryException)


def test_telemetry_uses_nvmls_names_reads_nan_on_errors_and_leaves_out_what_is_not_supported(clock):
    fake = FakeAmdSmi(mi300x(1, power_W=250.0, process_pids=[]), clock)
    fake.fail("amdsmi_get_clock_info", AMDSMI_STATUS_NOT_SUPPORTED)
    sensor = opened(fake)
    fields = sensor.read_fields()
    assert fields == {"power_W": 250.0, "gpu_util_pct": 95.0, "mem_util_pct": 40.0, "temperature_C": 65.0,
                      "other_processes": 0.0}
    fake.fail("amdsmi_get_temp_metric", AMDSMI_STATUS_UNKNOWN_ERROR)
    fields = sensor.read_fields()
    assert math.isnan(fields["temperature_C"]) and fields["gpu_util_pct"] == 95.0


def test_the_library_is_shut_down_by_its_last_user_only(clock):
    """amdsmi_init is not reference counted: one amdsmi_shut_down would end it for every sensor."""
    fake = FakeAmdSmi(mi300x(2), clock)
    first, second = opened(fake, 0), opened(fake, 1)
    assert fake.init_calls == 1
    first.close()
    clock.advance(0.1)
    assert second.energy_j() > 0 and fake.shutdown_calls == 0
    second.close()
    second.close()
    assert fake.shutdown_calls == 1 and not fake.initialised


# ------------------------------------------------------------------ partitions (as MIG on NVIDIA)
@pytest.mark.parametrize("mode", ["CPX", "DPX", "QPX"])
def test_a_gpu_in_a_compute_partition_mode_is_refused(clock, mode):
    fake = FakeAmdSmi(mi300x(1, compute_partition=mode), clock)
    with pytest.raises(RuntimeError, match=f"{mode} compute-partition mode.*every other partition") as raised:
        AmdSmiGpuSensor(0, amdsmi_module=fake).open()
    assert type(raised.value).__name__ == "PartitionedGpuError" and not fake.initialised
    fake.amdsmi_init()
    with pytest.raises(RuntimeError, match="compute-partition"):
        amd_gpu_for_torch_device(fake, 0)


def test_spx_and_gpus_without_partitions_are_measured(clock):
    assert opened(FakeAmdSmi(mi300x(1, compute_partition="SPX"), clock)).kind == "energy"
    assert opened(FakeAmdSmi(mi300x(1, compute_partition=None), clock)).kind == "energy"


# ------------------------------------------------------------------ torch (HIP) -> amdsmi
def rocm_torch(clock, count: int = 4) -> FakeTorch:
    """torch as a ROCm build shows itself: ``torch.version.hip`` set, AMD GPUs as ``cuda`` devices."""
    torch = FakeTorch(clock, device_count=count)
    torch.version = types.SimpleNamespace(hip="6.4.43482", cuda=None)
    return torch


def shuffled_node(clock) -> FakeAmdSmi:
    """Four MI300X whose HIP numbering is not amdsmi's (PCI) order, as on some MI350X nodes."""
    gpus = mi300x(4)
    for gpu, hip_id in zip(gpus, (2, 0, 3, 1)):
        gpu.hip_id = hip_id
    fake = FakeAmdSmi(gpus, clock)
    fake.amdsmi_init()
    return fake


@pytest.mark.parametrize("env, torch_index, expected", [
    ({}, 0, 1),  # HIP id 0 is amdsmi GPU 1
    ({"HIP_VISIBLE_DEVICES": "3,2"}, 0, 2),
    ({"CUDA_VISIBLE_DEVICES": "3,2"}, 1, 0),
    ({"ROCR_VISIBLE_DEVICES": "1,3"}, 1, 2),
    ({"ROCR_VISIBLE_DEVICES": "0,1,3", "HIP_VISIBLE_DEVICES": "2"}, 0, 2),  # HIP indexes what ROCr leaves
    ({"HIP_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "2"}, 0, 0),
    ({"ROCR_VISIBLE_DEVICES": "GPU-033b1c2d3e4f5a6b"}, 0, 3),
])
def test_each_visible_devices_variable_is_read_as_rocm_reads_it(monkeypatch, clock, env, torch_index, expected):
    fake = shuffled_node(clock)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert amd_gpu_for_torch_device(fake, torch_index).amdsmi_index == expected


@pytest.mark.parametrize("env, torch_index, message", [
    ({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "2"}, 0, "disagree"),
    ({"HIP_VISIBLE_DEVICES": "1,1"}, 0, "twice"),
    ({"HIP_VISIBLE_DEVICES": "x"}, 0, "cannot read"),
    ({"ROCR_VISIBLE_DEVICES": "1"}, 1, "not in ROCR_VISIBLE_DEVICES"),
    ({"ROCR_VISIBLE_DEVICES": "GPU-ffff"}, 0, "0 amdsmi GPUs have this UUID"),
    ({}, 4, "0 amdsmi GPUs have HIP id 4"),
])
def test_a_device_that_cannot_be_told_for_certain_is_refused(monkeypatch, clock, env, torch_index, message):
    fake = shuffled_node(clock)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=message) as raised:
        amd_gpu_for_torch_device(fake, torch_index)
    assert type(raised.value).__name__ == "RocmDeviceMappingError"


def test_without_enumeration_info_only_a_one_gpu_node_can_be_told(monkeypatch, clock):
    fake = shuffled_node(clock)
    monkeypatch.delattr(FakeAmdSmi, "amdsmi_get_gpu_enumeration_info")
    with pytest.raises(RuntimeError, match="not HIP's on every node"):
        amd_gpu_for_torch_device(fake, 0)
    single = FakeAmdSmi(mi300x(1), clock)
    single.amdsmi_init()
    assert amd_gpu_for_torch_device(single, 0).amdsmi_index == 0


def test_the_pci_address_and_uuid_torch_reports_win_over_the_environment(monkeypatch, clock):
    fake = shuffled_node(clock)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")  # says HIP 0 (amdsmi 1); torch knows better
    torch = rocm_torch(clock, 1)
    plain = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(
        **vars(plain(i)), pci_domain_id=0, pci_bus_id=0x6c, pci_device_id=0)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert amd_gpu_for_torch_device(fake, 0).amdsmi_index == 3  # 0000:6c:00.0
    # a torch without PCI ids: the UUID, as HIP's 16 ASCII hex digits printed as the hex of their bytes
    hip_uuid = fake.gpus[2].hip_uuid[len("GPU-"):]
    as_bytes = hip_uuid.encode().hex()
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(
        uuid=f"{as_bytes[:8]}-{as_bytes[8:12]}-{as_bytes[12:16]}-{as_bytes[16:20]}-{as_bytes[20:]}")
    assert amd_gpu_for_torch_device(fake, 0).amdsmi_index == 2
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(
        uuid="00000000-0000-0000-0000-000000000000", pci_domain_id=0, pci_bus_id=0x99, pci_device_id=0)
    with pytest.raises(RuntimeError, match="amdsmi lists 0 GPUs"):
        amd_gpu_for_torch_device(fake, 0)


# ------------------------------------------------------------------ sensors="auto" on ROCm
def test_auto_detection_on_rocm_torch_picks_the_amd_sensor_and_nvml_elsewhere(monkeypatch, clock, tmp_path):
    fake = FakeAmdSmi(mi300x(2, power_W=400.0), clock)
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    nvml = FakeNvml(h100s(1), clock)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setitem(sys.modules, "torch", rocm_torch(clock, 2))
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    sensors, notes = detect.default_sensors(0, read_host=False)
    assert notes == [] and [(type(s).__name__, s.name, s.amdsmi_index) for s in sensors] == [
        ("AmdSmiGpuSensor", "gpu1", 1)]
    assert not fake.initialised and nvml.calls["nvmlInit"] == 0  # NVML never tried on ROCm
    sensors[0].open()
    clock.advance(0.5)
    assert sensors[0].energy_j() == pytest.approx(200.0, abs=1e-3)
    sensors[0].close()
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(clock, device_count=1))  # a CUDA torch: NVML, as before
    sensors, notes = detect.default_sensors(0, read_host=False)
    assert [type(s).__name__ for s in sensors] == ["NvmlGpuSensor"]
    sensors, notes = detect.default_sensors(0, read_host=False, rocm=True)
    assert [type(s).__name__ for s in sensors] == ["AmdSmiGpuSensor"]


def test_auto_detection_on_rocm_says_why_the_gpu_is_not_measured(monkeypatch, clock):
    fake = FakeAmdSmi(mi300x(1, compute_partition="CPX"), clock)
    sensors, notes = detect.default_sensors(0, read_host=False, amdsmi_module=fake, rocm=True)
    assert sensors == [] and "amdsmi" in notes[0] and "PartitionedGpuError" in notes[0]
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # amdsmi not installed: import fails
    sensors, notes = detect.default_sensors(0, read_host=False, rocm=True)
    assert sensors == [] and "ModuleNotFoundError" in notes[0] and "not counted" in notes[0]


def test_detection_stays_free_of_a_torch_import():
    """rocm_in_use looks at torch only where it is imported already (start-up weight, tests/test_cli_startup)."""
    source = inspect.getsource(amd_module)
    assert "\nimport torch" not in source and "\nimport amdsmi" not in source
    assert "sys.modules.get(\"torch\")" in source


# ------------------------------------------------------------------ a shared card
def test_other_processes_on_the_card_are_warned_about_once_and_label_its_figures(clock, caplog):
    """Section 3's AMD half: amdsmi_get_gpu_process_list, under shared_gpu's rules (which PID is ours)."""
    import logging

    from lightning_energy.measure.sensors import shared_gpu

    fake = FakeAmdSmi(mi300x(1, process_pids=[4242]), clock)
    sensor = AmdSmiGpuSensor(0, amdsmi_module=fake, own_pids=lambda: {4242}, clock=clock)
    with caplog.at_level(logging.WARNING):
        sensor.open()
        assert not sensor.sharing.shared and not sensor.source.startswith("SHARED")
        assert sensor.read_fields()["other_processes"] == 0.0
        fake.gpus[0].process_pids.extend([1, 77])  # two others start: seen at the next listing, not before
        assert sensor.read_fields()["other_processes"] == 0.0
        clock.advance(shared_gpu.PROCESS_QUERY_INTERVAL_S)
        assert sensor.read_fields()["other_processes"] == 2.0
        fake.gpus[0].process_pids.append(78)
        clock.advance(shared_gpu.PROCESS_QUERY_INTERVAL_S)
        assert sensor.read_fields()["other_processes"] == 3.0
    warnings = [r.getMessage() for r in caplog.records if "is shared" in r.getMessage()]
    assert len(warnings) == 1 and "AMD GPU 0" in warnings[0] and "amdsmi" in warnings[0]
    assert sensor.source.startswith("SHARED with 3 other processes") and sensor.source.count("SHARED") == 1
    shared = sensor.describe()["shared"]
    assert shared["shared"] and shared["other_processes_max"] == 3 and shared["other_pids"] == [1, 77, 78]
    sensor.close()
    fake.fail("amdsmi_get_gpu_process_list", AMDSMI_STATUS_NO_PERM)  # no permission: unchecked, said so
    sensor = AmdSmiGpuSensor(0, amdsmi_module=fake, clock=clock)
    sensor.open()
    assert "other_processes" not in sensor.read_fields() and "Permission" in sensor.describe()["shared"]["unchecked"]
    sensor.close()


# ------------------------------------------------------------------ a fit, end to end
def test_a_fit_with_the_amd_sensor_reports_its_joules_as_measured_by_amdsmi(tmp_path, monkeypatch):
    import lightning as L
    from torch import nn

    from lightning_energy import EnergyCallback
    from power_limit_helpers import install_fake_time, loader

    clock = install_fake_time(monkeypatch.setattr)
    fake = FakeAmdSmi(mi300x(1, power_W=300.0), clock)

    class Steps(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            clock.advance(0.1)
            (x,) = batch
            return self.layer(x).square().mean()

        def configure_optimizers(self):
            import torch

            return torch.optim.SGD(self.parameters(), lr=0.01)

    energy = EnergyCallback(sensors=[AmdSmiGpuSensor(0, amdsmi_module=fake)], verbose=False, write_trace=False,
                            log_power_figure=False)
    trainer = L.Trainer(callbacks=[energy], logger=False, max_epochs=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
                        default_root_dir=str(tmp_path))
    trainer.fit(Steps(), loader(4, batch_size=4))
    (sensor,) = energy.report["sensors"]
    assert sensor["provenance"] == "measured" and sensor["library"] == "amdsmi"
    assert "amdsmi_get_energy_count" in sensor["source"]
    assert energy.report["total_J"] > 0
    assert not fake.initialised
