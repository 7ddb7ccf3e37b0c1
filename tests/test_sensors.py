"""Built-in sensors against fake hardware: RAPL files, a fake NVML, psutil load, Zeus's device layer."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lightning_energy import Sensor, SimulatedSensor
from lightning_energy.measure.sensors import cpu_model as estimate
from lightning_energy.measure.sensors import rapl
from lightning_energy.measure.sensors.base import validate_sensors
from lightning_energy.measure.sensors.detect import default_sensors, zeus_sensors
from lightning_energy.measure.sensors.nvml import NvmlGpuSensor, nvml_index_for_cuda_device
from lightning_energy.measure.sensors.zeus import ZeusBackend


# ------------------------------------------------------------------ base class
class WallPlug(Sensor):
    def __init__(self):
        super().__init__("wall_plug", "host")

    def power_w(self):
        return 42.0


def test_kind_follows_the_overridden_method():
    assert WallPlug().kind == "power"

    class Counter(Sensor):
        def energy_j(self):
            return 1.0

    assert Counter("c", "device").kind == "energy"


def test_sensor_without_a_reading_method_is_rejected():
    with pytest.raises(TypeError, match="overrides neither"):
        validate_sensors([Sensor("empty")])


@pytest.mark.parametrize("bad", [["not a sensor"], [WallPlug(), object()], "gpu", 3])
def test_non_sensors_are_rejected(bad):
    with pytest.raises(TypeError, match="sensors"):
        validate_sensors(bad)


def test_duplicate_names_and_bad_scope_are_rejected():
    with pytest.raises(ValueError, match="two sensors named"):
        validate_sensors([WallPlug(), WallPlug()])
    with pytest.raises(ValueError, match="scope"):
        SimulatedSensor("x", 1.0, scope="rack")
    with pytest.raises(ValueError, match="name"):
        Sensor("  ")


# ------------------------------------------------------------------ simulated
def test_simulated_trace_integral_is_exact():
    now = [0.0]
    s = SimulatedSensor("s", [(0.0, 100.0), (2.0, 50.0)], kind="energy", clock=lambda: now[0])
    s.open()
    now[0] = 3.0
    assert s.energy_j() == pytest.approx(250.0)
    assert s.power_w() == 50.0


def test_simulated_counter_is_quantised():
    now = [0.0]
    s = SimulatedSensor("s", 10.0, kind="energy", counter_update_period_s=0.5, clock=lambda: now[0])
    s.open()
    now[0] = 1.2
    assert s.energy_j() == pytest.approx(10.0)  # counter last moved at 1.0 s


@pytest.mark.parametrize("trace", [[(1.0, 5.0)], [(0.0, 5.0), (0.0, 6.0)], [(0.0, -1.0)]])
def test_simulated_trace_is_validated(trace):
    with pytest.raises(ValueError, match="trace"):
        SimulatedSensor("s", trace)


# ------------------------------------------------------------------ RAPL
def make_zone(root: Path, name: str, label: str, energy_uj: int, max_uj: int = 1_000_000) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(label + "\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return zone


def test_rapl_finds_package_and_dram_but_not_core(tmp_path):
    make_zone(tmp_path, "intel-rapl:0", "package-0", 100)
    make_zone(tmp_path / "intel-rapl:0", "intel-rapl:0:0", "core", 5)
    make_zone(tmp_path / "intel-rapl:0", "intel-rapl:0:1", "dram", 7)
    make_zone(tmp_path, "intel-rapl:1", "psys", 1)
    zones, unreadable = rapl.find_rapl_zones(tmp_path)
    assert [z.label for z in zones] == ["package-0", "package-0/dram"]
    assert unreadable == []
    sensors = [rapl.RaplSensor(z) for z in zones]
    assert [s.name for s in sensors] == ["cpu_package0", "cpu_package0_dram"]
    assert all(s.scope == "host" and s.kind == "energy" and not s.estimated for s in sensors)


def test_amd_rapl_is_found(tmp_path):
    make_zone(tmp_path, "amd-rapl:0", "package-0", 100)
    zones, _ = rapl.find_rapl_zones(tmp_path)
    assert [z.label for z in zones] == ["package-0"]


def test_rapl_counter_wrap_around(tmp_path):
    zone_dir = make_zone(tmp_path, "intel-rapl:0", "package-0", 900_000, max_uj=1_000_000)
    (zone,), _ = rapl.find_rapl_zones(tmp_path)
    sensor = rapl.RaplSensor(zone)
    first = sensor.energy_j()
    (zone_dir / "energy_uj").write_text("50000\n")  # the counter wrapped at 1 000 000 uJ
    second = sensor.energy_j()
    assert second - first == pytest.approx(0.15)  # 900 000 -> 1 000 000 -> 50 000 uJ = 150 000 uJ
    (zone_dir / "energy_uj").write_text("60000\n")
    assert sensor.energy_j() - second == pytest.approx(0.01)


def test_unreadable_rapl_warns_with_the_fix_and_falls_back_to_estimate(tmp_path, monkeypatch):
    make_zone(tmp_path, "intel-rapl:0", "package-0", 100)
    monkeypatch.setattr(rapl, "_readable", lambda path: False)
    sensors, notes = default_sensors(None, read_host=True, powercap_root=tmp_path)
    assert [type(s).__name__ for s in sensors] == ["CpuEstimateSensor"]
    assert len(notes) == 1 and "not readable" in notes[0] and "chmod" in notes[0] and "root" in notes[0]


def test_no_host_sensors_on_other_local_ranks(tmp_path):
    sensors, notes = default_sensors(None, read_host=False, powercap_root=tmp_path)
    assert sensors == [] and notes == []


# ------------------------------------------------------------------ CPU estimate
def test_cpu_estimate_follows_codecarbons_load_models():
    machine = estimate.CpuEstimateSensor(tdp_w=100.0, tracking_mode="machine", load=lambda: 0.5)
    assert machine.power_w() == pytest.approx(100.0 * (0.1 + 0.9 * 0.5**3))
    process = estimate.CpuEstimateSensor(tdp_w=100.0, load=lambda: 0.5)  # the default: this process's share
    assert process.tracking_mode == "process" and process.power_w() == pytest.approx(50.0)
    assert estimate.CpuEstimateSensor(tdp_w=100.0, load=lambda: 0.0).power_w() == 0.0  # an idle process: 0 W
    described = process.describe()
    assert described["estimated"] is True and described["provenance"] == "estimated"
    assert described["assumed_tdp_W"] == 100.0 and described["tdp_source"] == "given by the user"
    assert described["tracking_mode"] == "process"
    assert described["source"].startswith("ESTIMATE, process mode:") and "TDP 100 W from given by the user" in \
        described["source"]


XEON_8380 = "Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz"


def test_cpu_tdp_comes_from_codecarbons_table_for_a_model_it_knows():
    sensor = estimate.CpuEstimateSensor(cpu_model=XEON_8380, threads=80, load=lambda: 0.25)
    assert sensor.tdp_w == 270.0  # cpu_power.csv: Intel Xeon Platinum 8380, 270 W
    assert sensor.tdp_source == "CodeCarbon's CPU table (Intel Xeon Platinum 8380)"
    assert sensor.power_w() == pytest.approx(270.0 * 0.25)
    assert estimate.lookup_tdp_w(XEON_8380) == (270.0, "CodeCarbon's CPU table (Intel Xeon Platinum 8380)")
    assert estimate.lookup_tdp_w("A CPU nobody has heard of") is None
    with pytest.raises(ValueError, match="tdp_w"):
        estimate.CpuEstimateSensor(tdp_w=0)
    with pytest.raises(ValueError, match="tracking_mode"):
        estimate.CpuEstimateSensor(tdp_w=10.0, tracking_mode="everything")


def test_an_unknown_cpu_gets_codecarbons_4_w_per_thread_not_85_w():
    vm = estimate.CpuEstimateSensor(cpu_model="AMD EPYC", threads=2, tracking_mode="machine", load=lambda: 1.0)
    assert vm.tdp_w == 8.0 and vm.power_w() == pytest.approx(8.0)  # a fully loaded 2-vCPU VM: 8 W, not 85 W
    assert vm.tdp_source == "CodeCarbon's per-thread rule (2 threads x 4 W: a CPU model not in its table)"
    assert "machine mode" in vm.source and "TDP 8 W" in vm.source and "CPU AMD EPYC" in vm.source


def test_process_mode_charges_this_process_tree_not_the_machine():
    seconds = {"now": 100.0}
    cpu = {101: 10.0, 102: 5.0}  # this process and a DataLoader worker: CPU seconds so far
    load = estimate.ProcessLoad(threads=2, cpu_times=lambda: dict(cpu), clock=lambda: seconds["now"])
    seconds["now"] += 1.0
    cpu.update({101: 10.6, 102: 5.2, 103: 3.0})  # a new worker's past seconds are not this interval's
    assert load.fraction() == pytest.approx((0.6 + 0.2) / (1.0 * 2))
    seconds["now"] += 0.5
    cpu.pop(102)  # a worker that exited
    cpu.update({101: 11.1, 103: 3.5})
    assert load.fraction() == pytest.approx((0.5 + 0.5) / (0.5 * 2))
    sensor = estimate.CpuEstimateSensor(cpu_model="AMD EPYC", threads=2, load=lambda: 0.4)
    assert sensor.power_w() == pytest.approx(8.0 * 0.4)


def test_process_mode_lists_child_processes_at_most_every_rescan_period(monkeypatch):
    """Listing children scans every pid in /proc (~9 ms here) and held the sampling thread, and the GIL,
    at every read; it is refreshed every CHILDREN_RESCAN_S, and a child started meanwhile is counted
    from the first read after that."""
    import subprocess
    import sys

    import psutil

    scans = []
    original = psutil.Process.children

    def counting_children(self, *args, **kwargs):
        scans.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(psutil.Process, "children", counting_children)
    seconds = {"now": 0.0}
    tree = estimate.ProcessTree(rescan_s=5.0, clock=lambda: seconds["now"])
    reads = [tree()]
    seconds["now"] += 0.125
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for _ in range(79):  # 10 s of reads at 8 Hz (steps exact in binary)
            reads.append(tree())
            seconds["now"] += 0.125
        assert len(scans) == 2  # at 0 s and at 5 s, not 80
        assert os.getpid() in reads[0] and all(os.getpid() in r for r in reads)
        first_with_child = next(i for i, r in enumerate(reads) if child.pid in r)
        assert first_with_child == 40  # the child started after the first scan is seen by the next one
    finally:
        child.kill()
        child.wait()
    seconds["now"] += 5.0
    assert child.pid not in tree()  # an exited child drops out at the next scan


def test_the_process_mode_sensor_does_not_scan_every_pid_at_each_read(monkeypatch):
    import psutil

    scans = []
    original = psutil.Process.children
    monkeypatch.setattr(psutil.Process, "children", lambda self, *a, **k: scans.append(1) or original(self, *a, **k))
    load = estimate.ProcessLoad(threads=2)
    for _ in range(20):  # 20 reads within well under CHILDREN_RESCAN_S (5 s): one scan, two if a stall passes 5 s
        load.fraction()
    assert len(scans) <= 2  # the old sensor scanned /proc at every read: 21


def test_the_report_says_which_tdp_and_mode_the_estimate_used():
    from lightning_energy.outputs.report import build_report, format_report

    sensor = estimate.CpuEstimateSensor(cpu_model="AMD EPYC", threads=2, load=lambda: 0.5)
    summary = {"duration_s": 10.0, "train_J": 30.0, "validation_J": 0.0,
               "sensors": [{**sensor.describe(), "rank": 0, "energy_J": 40.0, "mean_power_W": 4.0, "failure": None}]}
    report = build_report([summary], [], {})
    (entry,) = report["sensors"]
    assert entry["tdp_source"].startswith("CodeCarbon's per-thread rule") and entry["tracking_mode"] == "process"
    assert report["provenance"] == "estimated" and report["estimated_J"] == 40.0 and report["measured_J"] == 0.0
    text = format_report(report)
    assert "40.0 J = 1.11e-05 kWh (ESTIMATED)" in text.splitlines()[0]
    assert "process mode" in text and "TDP 8 W from CodeCarbon's per-thread rule (2 threads x 4 W" in text


def test_system_load_from_proc_stat(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 50 0 50 400 0 0 0 0 0 0\n")
    monkeypatch.setattr(estimate, "PROC_STAT", str(stat))
    load = estimate.SystemLoad()
    stat.write_text("cpu  200 0 150 840 10 0 0 0 0 0\ncpu0 100 0 75 420 5 0 0 0 0 0\n")
    assert load.fraction() == pytest.approx(150 / 200)  # busy +150 ticks of +200
    assert load.fraction() == 0.0  # no ticks since
    load.close()


def test_cpu_estimate_is_read_at_most_every_100_ms(manual_sampler, clock):
    from lightning_energy.measure.meter import Meter

    reads = []

    class CountingEstimate(estimate.CpuEstimateSensor):
        def power_w(self):
            reads.append(clock())
            return 10.0

    names = manual_sampler.acquire("t", [CountingEstimate(tdp_w=50.0)], start_thread=False)
    meter = Meter(manual_sampler, names)
    meter.clock.record = clock
    manual_sampler.add_meter(meter)
    for _ in range(20):
        clock.advance(0.02)
        manual_sampler.sample_once(read_all=False)
    assert len(reads) == 1 + 20 * 0.02 / 0.1  # the first read at acquire, then one per 100 ms
    clock.advance(0.02)
    mark = meter.mark()
    meter.wait(mark, timeout_s=0.01)  # a wait never forces a read: the estimate keeps its 100 ms
    assert mark.resolved and mark.extrapolated and len(reads) == 5
    clock.advance(0.08)
    manual_sampler.sample_once()
    assert len(reads) == 6 and reads[-1] - reads[-2] == pytest.approx(0.1)


# ------------------------------------------------------------------ NVML (fake library)
class FakeNvml:
    """Just enough of pynvml for the sensor: one or two GPUs with a counter, or power only."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    class NVMLError(Exception):
        pass

    def __init__(self, has_counter=True, uuids=("GPU-aaaa", "GPU-bbbb")):
        self.has_counter = has_counter
        self.uuids = uuids
        self.energy_mj = 5_000_000
        self.power_mw = 250_000
        self.shutdowns = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return self.uuids[h]

    def nvmlDeviceGetName(self, h):
        return b"Fake H100"

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.has_counter:
            raise self.NVMLError("Not Supported")
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, h):
        return self.power_mw

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=97, memory=40)

    def nvmlDeviceGetClockInfo(self, h, which):
        return {1: 1980, 2: 2619}[which]

    def nvmlDeviceGetPerformanceState(self, h):
        return 0

    def nvmlDeviceGetTemperature(self, h, which):
        return 61

    def nvmlDeviceGetPcieThroughput(self, h, which):
        raise self.NVMLError("Not Supported")


def test_nvml_counter_and_telemetry():
    nvml = FakeNvml()
    sensor = NvmlGpuSensor(1, pynvml_module=nvml)
    sensor.open()
    assert sensor.kind == "energy" and sensor.counter_update_period_s == pytest.approx(0.1)
    assert sensor.scope == "device" and sensor.name == "gpu1"
    assert sensor.energy_j() == pytest.approx(5000.0)
    fields = sensor.read_fields()
    assert fields == {"gpu_util_pct": 97.0, "mem_util_pct": 40.0, "sm_clock_MHz": 1980.0, "mem_clock_MHz": 2619.0,
                      "pstate": 0.0, "power_W": 250.0, "temperature_C": 61.0}  # PCIe not exposed: left out
    assert "Fake H100" in sensor.source and "counter" in sensor.source
    sensor.close()
    assert nvml.shutdowns == 1


def test_nvml_falls_back_to_power_polling_before_volta():
    sensor = NvmlGpuSensor(0, pynvml_module=FakeNvml(has_counter=False))
    sensor.open()
    assert sensor.kind == "power" and sensor.power_w() == pytest.approx(250.0)
    assert "polled" in sensor.source


def test_cuda_visible_devices_maps_to_nvml_index(monkeypatch):
    nvml = FakeNvml(uuids=("GPU-aaaa", "GPU-bbbb", "GPU-cccc"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert nvml_index_for_cuda_device(nvml, 0) == 2
    assert nvml_index_for_cuda_device(nvml, 1) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    assert nvml_index_for_cuda_device(nvml, 0) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(RuntimeError, match="not in CUDA_VISIBLE_DEVICES"):
        nvml_index_for_cuda_device(nvml, 1)


# ------------------------------------------------------------------ Zeus backend (fake monitor)
def test_zeus_backend_reads_through_the_monitor_device_layer():
    gpus = types.SimpleNamespace(
        supports_get_total_energy_consumption=lambda i: True,
        get_total_energy_consumption=lambda i: 12_000.0,  # mJ
        get_instant_power_usage=lambda i: 0.0,
    )
    cpus = types.SimpleNamespace(
        supports_get_dram_energy_consumption=lambda i: True,
        get_total_energy_consumption=lambda i: types.SimpleNamespace(cpu_mj=3_000.0, dram_mj=500.0),
    )
    monitor = types.SimpleNamespace(gpus=gpus, cpus=cpus, gpu_indices=[0], cpu_indices=[0])
    sensors = ZeusBackend(0, True, monitor=monitor).sensors()
    assert [(s.name, s.scope) for s in sensors] == [("zeus_gpu0", "device"), ("zeus_cpu0_package", "host"),
                                                     ("zeus_cpu0_dram", "host")]
    assert [s.energy_j() for s in sensors] == [pytest.approx(12.0), pytest.approx(3.0), pytest.approx(0.5)]


def test_zeus_backend_without_devices_fails_with_a_clear_message(monkeypatch):
    from lightning_energy.measure.sensors.zeus import _import_zeus_monitor

    _import_zeus_monitor()  # imports zeus quietly (amdsmi prints without ROCm)
    from zeus.device.cpu.common import ZeusCPUInitError
    from zeus.monitor import energy as zeus_energy

    def no_rapl():  # hermetic: as on a machine without RAPL, whatever this one has
        raise ZeusCPUInitError("RAPL unavailable (test)")

    monkeypatch.setattr(zeus_energy, "get_cpus", no_rapl)
    with pytest.raises(RuntimeError, match="Zeus found no GPU or RAPL"):
        zeus_sensors(None, read_host=True)


@pytest.fixture
def zeus_on_fake_nvml(monkeypatch, clock):
    """Zeus and the project's mapping both on a fake NVML (``fakes_nvml``) with an A10 and two H100s; no
    RAPL; Zeus's GPU singleton reset, so that its own ``get_gpus()`` would run if called."""
    from fakes_nvml import NVML_DEVICE_ARCH_AMPERE, FakeGpu, FakeNvml, h100s
    from lightning_energy.measure.sensors.zeus import _import_zeus_monitor

    _import_zeus_monitor()
    import zeus.device.gpu as zeus_gpu
    import zeus.device.gpu.nvidia as zeus_nvidia
    from zeus.device.cpu.common import ZeusCPUInitError
    from zeus.monitor import energy as zeus_energy

    gpus = [FakeGpu(uuid="GPU-a10a10a1-0000-0000-0000-000000000000", name="NVIDIA A10",
                    architecture=NVML_DEVICE_ARCH_AMPERE, power_W=60.0), *h100s(2, power_W=300.0)]
    gpus[2].power_W = 500.0
    fake = FakeNvml(gpus, clock)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(zeus_nvidia, "pynvml", fake)
    monkeypatch.setattr(zeus_gpu, "nvml_is_available", lambda: True)
    monkeypatch.setattr(zeus_gpu, "_gpus", None)

    def no_rapl():
        raise ZeusCPUInitError("RAPL unavailable (test)")

    monkeypatch.setattr(zeus_energy, "get_cpus", no_rapl)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return fake


def test_zeus_backend_reads_the_card_the_projects_mapping_names(monkeypatch, clock, zeus_on_fake_nvml):
    """CUDA_VISIBLE_DEVICES with a GPU- UUID: Zeus's own get_gpus() int-parses it (ValueError, the old
    backend failed); the project's mapping names NVML GPU 2, and Zeus is given that card."""
    fake = zeus_on_fake_nvml
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000001")  # a unique prefix of NVML GPU 2's UUID
    sensors, backend = zeus_sensors(0, read_host=False)
    (sensor,) = sensors
    assert (backend.nvml_index, sensor.name, sensor.nvml_index) == (2, "zeus_gpu2", 2)
    assert sensor.describe()["device_uuid"] == fake.gpus[2].uuid and "NVML GPU 2" in sensor.source
    assert sensor.counter_update_period_s == 0.1
    start = sensor.energy_j()
    clock.advance(1.0)
    assert sensor.energy_j() - start == pytest.approx(500.0)  # NVML GPU 2 draws 500 W, the others 60/300
    assert fake.init_count == 1  # the mapping gave its nvmlInit back; Zeus's collection holds its own


def test_zeus_backend_refuses_ordinals_on_mixed_gpus_without_pci_bus_order(monkeypatch, zeus_on_fake_nvml):
    """An A10 and H100s: CUDA numbers them fastest first, NVML in PCI bus order, so ordinal 1 is not NVML GPU 1
    for certain. Zeus's get_gpus() ignores CUDA_DEVICE_ORDER and would read NVML GPU 1 silently."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(RuntimeError, match="backend='zeus'.*CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        zeus_sensors(0, read_host=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    sensors, backend = zeus_sensors(0, read_host=False)
    assert [s.name for s in sensors] == ["zeus_gpu1"] and backend.nvml_index == 1


def test_zeus_epoch_figure_leaves_validation_out():
    """Zeus's epoch figure: windows opened at epoch start, closed over validation, summed at epoch end."""
    calls = []

    class FakeMonitor:
        def begin_window(self, name, sync_execution=True, restart=False):
            calls.append(("begin", name, sync_execution))

        def end_window(self, name, sync_execution=True):
            calls.append(("end", name, sync_execution))
            joules = 10.0 * sum(c[0] == "end" for c in calls)  # 10 J, then 20 J, ...
            return types.SimpleNamespace(gpu_energy={0: joules}, cpu_energy={0: 1.0}, dram_energy=None)

    backend = ZeusBackend(None, False, monitor=FakeMonitor())
    backend.begin_epoch()
    backend.pause_epoch()  # validation inside the epoch
    backend.pause_epoch()  # no window open: nothing to close
    backend.resume_epoch()
    assert backend.end_epoch() == pytest.approx((10.0 + 1.0) + (20.0 + 1.0))
    backend.resume_epoch()  # validation after the epoch (or in trainer.validate): no window opens
    assert [c[0] for c in calls] == ["begin", "end", "begin", "end"]
    assert all(c[2] is False for c in calls)  # never synchronises the device


def test_import_prints_nothing():
    code = "import lightning_energy, lightning_energy.measure.sensors.zeus, lightning_energy.measure.sensors.detect"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == ""
