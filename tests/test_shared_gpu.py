"""A GPU shared with other processes: found, labelled on every figure, warned about once, and (optionally) split
by the processes' SM utilisation into an estimated share; against the fake ``pynvml`` (NVML's documented
semantics for ``nvmlDeviceGetComputeRunningProcesses`` and ``nvmlDeviceGetProcessUtilization``) on a fake clock."""

from __future__ import annotations

import logging
import os
import sys

import lightning as L
import pytest

from fakes_nvml import (
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    FakeClock,
    FakeNvml,
    FakeTorch,
    h100s,
)
from power_limit_helpers import SimModule, install_fake_time, loader
from lightning_energy import EnergyCallback
from lightning_energy.measure.sensors import shared_gpu
from lightning_energy.measure.sensors.nvml import NvmlGpuSensor
from lightning_energy.measure.sensors.nvml_share import NvmlProcessShareSensor
from lightning_energy.measure.sensors.shared_gpu import (
    PROCESS_QUERY_INTERVAL_S,
    SAMPLE_HORIZON_S,
    SHARE_WINDOW_S,
    RULE_ASSUMED,
    RULE_MATCHED,
    RULE_NONE,
    RULE_NOT_LISTED,
    SPLIT_IDLE,
    SPLIT_SM,
    SPLIT_UNSUPPORTED,
    SPLIT_UNTOLD,
    count_other_processes,
    own_process_ids,
)
from lightning_energy.outputs.report import format_report

ME = 100  # "this process" on the fake card (the sensors are given own_pids=lambda: {ME})
LOGGER = "lightning_energy.measure.sensors.shared_gpu"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    """The shared-card warnings logged so far (a handler of the module's logger: the lightning_energy logger
    propagates to the root only where the root had handlers when it was imported)."""
    logger, records = logging.getLogger(LOGGER), Records()
    logger.addHandler(records)
    yield lambda: list(records.messages)
    logger.removeHandler(records)


def card_sensor(fake: FakeNvml, clock, index: int = 0) -> NvmlGpuSensor:
    sensor = NvmlGpuSensor(index, pynvml_module=fake, own_pids=lambda: {ME}, clock=clock)
    sensor.open()
    return sensor


def share_sensor(fake: FakeNvml, clock, me: int = ME, **kwargs) -> NvmlProcessShareSensor:
    sensor = NvmlProcessShareSensor(0, pynvml_module=fake, own_pids=lambda: {me}, clock=clock,
                                    name=f"share{me}", **kwargs)
    sensor.open()
    return sensor


# ------------------------------------------------------------------ the fake follows NVML
def test_the_fake_returns_each_processs_latest_sample_newer_than_the_timestamp(clock):
    fake = FakeNvml(h100s(1), clock)
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(fake.NVMLError_NotFound):  # no process has used the card: NVML_ERROR_NOT_FOUND
        fake.nvmlDeviceGetProcessUtilization(handle, 0)
    fake.set_process_utilisation(0, {ME: (60, 20), 200: 30})
    clock.advance(1.0)
    samples = fake.nvmlDeviceGetProcessUtilization(handle, 0)
    assert [(s.pid, s.smUtil, s.memUtil) for s in samples] == [(ME, 60, 20), (200, 30, 0)]
    newest = max(s.timeStamp for s in samples)
    assert newest == pytest.approx(1001.0 * 1e6, abs=1 / 6 * 1e6)  # the driver's CPU clock, in us
    with pytest.raises(fake.NVMLError_NotFound):  # nothing newer than the newest seen
        fake.nvmlDeviceGetProcessUtilization(handle, newest)
    fake.set_process_utilisation(0, {200: 30})  # ours stops
    clock.advance(1.0)
    assert [s.pid for s in fake.nvmlDeviceGetProcessUtilization(handle, newest)] == [200]
    (ours,) = [s for s in fake.nvmlDeviceGetProcessUtilization(handle, 0) if s.pid == ME]
    assert ours.timeStamp == newest and ours.smUtil == 60  # its last sample stays the latest, returned again
    fake.gpus[0].has_process_utilisation = False
    with pytest.raises(fake.NVMLError_NotSupported):
        fake.nvmlDeviceGetProcessUtilization(handle, 0)


# ------------------------------------------------------------------ who is another process
def test_other_processes_are_counted_by_pid_or_said_to_be_assumed():
    matched = count_other_processes({1, 2, 3}, {2}, True)
    assert matched == shared_gpu.OtherProcesses(2, frozenset({1, 3}), RULE_MATCHED, 3) and matched.identifiable
    assert count_other_processes({1, 2, 3}, {2}, False).rule == RULE_MATCHED  # found: the namespace does not matter
    assert count_other_processes([], {2}, False) == shared_gpu.OtherProcesses(0, frozenset(), RULE_NONE, 0)
    # in a container's PID namespace our PID is not NVML's: one of those listed is taken to be this process
    assumed = count_other_processes({7001, 7002}, {2}, False)
    assert (assumed.count, assumed.rule, assumed.identifiable) == (1, RULE_ASSUMED, False)
    # on the host, a process not listed holds no context on the card (yet): all listed are others
    assert count_other_processes({7001, 7002}, {2}, True).count == 2
    assert count_other_processes({7001}, {2}, None).rule == RULE_NOT_LISTED  # no /proc: PIDs taken as comparable
    assert os.getpid() in own_process_ids()


@pytest.mark.parametrize("others", [0, 1, 3])
def test_a_card_with_other_processes_is_labelled_and_warned_about(clock, warnings_logged, others):
    fake = FakeNvml(h100s(1), clock)
    fake.gpus[0].compute_pids = [ME, *range(7000, 7000 + others)]
    sensor = card_sensor(fake, clock)
    shared = sensor.describe()["shared"]
    assert shared["checked"] and shared["rule"] == RULE_MATCHED
    assert shared["shared"] is (others > 0) and shared["other_processes_max"] == others
    assert shared["other_pids"] == list(range(7000, 7000 + others))
    assert sensor.read_fields()["other_processes"] == float(others)
    assert sensor.describe()["source"] == sensor.source
    if others:
        plural = "es" if others > 1 else ""
        assert sensor.source.startswith(f"SHARED with {others} other process{plural} (the whole card's energy, "
                                        "theirs included): NVML nvmlDeviceGetTotalEnergyConsumption")
        (warning,) = warnings_logged()
        assert f"{others} other compute process(es)" in warning and "7000" in warning and "NVML GPU 0" in warning
    else:
        assert sensor.source.startswith("NVML ") and "SHARED" not in sensor.source
        assert warnings_logged() == []
    sensor.close()


def test_processes_coming_and_going_are_listed_at_most_every_interval_and_warned_about_once(clock, warnings_logged):
    fake = FakeNvml(h100s(1), clock)
    fake.gpus[0].compute_pids = [ME]
    sensor = card_sensor(fake, clock)
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1  # at open
    fake.gpus[0].compute_pids = [ME, 7001]
    for _ in range(10):  # 20 Hz reads: no listing before the interval has passed
        clock.advance(0.05)
        assert sensor.read_fields()["other_processes"] == 0.0
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1 and "SHARED" not in sensor.source
    clock.advance(PROCESS_QUERY_INTERVAL_S)
    assert sensor.read_fields()["other_processes"] == 1.0 and sensor.source.startswith("SHARED with 1 other process ")
    fake.gpus[0].compute_pids = [ME, 7001, 7002, 7003]
    clock.advance(PROCESS_QUERY_INTERVAL_S)
    assert sensor.read_fields()["other_processes"] == 3.0
    fake.gpus[0].compute_pids = [ME, 7003]
    clock.advance(PROCESS_QUERY_INTERVAL_S)
    assert sensor.read_fields()["other_processes"] == 1.0
    fake.gpus[0].compute_pids = [ME]  # they have all gone: the figures still hold their energy
    clock.advance(PROCESS_QUERY_INTERVAL_S)
    assert sensor.read_fields()["other_processes"] == 0.0
    assert sensor.source.startswith("SHARED with up to 3 other processes")  # the most at one listing
    shared = sensor.describe()["shared"]
    assert (shared["other_processes_max"], shared["other_processes_now"]) == (3, 0)
    assert shared["other_pids"] == [7001, 7002, 7003] and shared["queries"] == 5
    assert len(warnings_logged()) == 1  # once, when first found shared
    sensor.close()


def test_a_listing_nvml_cannot_give_leaves_the_card_unchecked_and_an_error_keeps_the_last(clock):
    for code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION):
        fake = FakeNvml(h100s(1), clock)
        fake.fail("nvmlDeviceGetComputeRunningProcesses", code)
        sensor = card_sensor(fake, clock)
        shared = sensor.describe()["shared"]
        assert not shared["checked"] and shared["other_processes_max"] is None and shared["unchecked"]
        clock.advance(10.0)
        assert "other_processes" not in sensor.read_fields()
        assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1  # not asked again
        assert "SHARED" not in sensor.source
        sensor.close()
    fake = FakeNvml(h100s(1), clock)
    fake.gpus[0].compute_pids = [ME, 7001]
    sensor = card_sensor(fake, clock)
    fake.fail("nvmlDeviceGetComputeRunningProcesses", NVML_ERROR_UNKNOWN)
    fake.gpus[0].compute_pids = [ME]
    clock.advance(PROCESS_QUERY_INTERVAL_S)
    assert sensor.read_fields()["other_processes"] == 1.0  # the last listing stands
    assert sensor.describe()["shared"]["errors"] == 1 and "Unknown" in sensor.sharing.last_error
    fake.fail("nvmlDeviceGetComputeRunningProcesses", None)
    clock.advance(PROCESS_QUERY_INTERVAL_S)
    assert sensor.read_fields()["other_processes"] == 0.0 and sensor.source.startswith("SHARED with up to 1 other")
    sensor.close()


def test_a_binding_without_the_listing_reads_as_before(clock):
    fake = FakeNvml(h100s(1), clock)

    class OldBinding:
        def __getattr__(self, name):
            if name == "nvmlDeviceGetComputeRunningProcesses":
                raise AttributeError(name)
            return getattr(fake, name)

    sensor = NvmlGpuSensor(0, pynvml_module=OldBinding(), clock=clock)
    sensor.open()
    assert "other_processes" not in sensor.read_fields() and "SHARED" not in sensor.source
    assert sensor.describe()["shared"]["unchecked"].endswith("no nvmlDeviceGetComputeRunningProcesses")
    sensor.close()


def test_in_a_containers_pid_namespace_one_listed_process_is_taken_to_be_this_one(clock, monkeypatch):
    monkeypatch.setattr(shared_gpu, "pid_namespace_is_initial", lambda: False)
    fake = FakeNvml(h100s(1), clock)
    fake.gpus[0].compute_pids = [88001, 88002]  # host PIDs: neither is os.getpid() in here
    sensor = NvmlGpuSensor(0, pynvml_module=fake, clock=clock)
    sensor.open()
    shared = sensor.describe()["shared"]
    assert (shared["other_processes_max"], shared["rule"]) == (1, RULE_ASSUMED)
    assert "PID namespace of its own" in shared["rule_means"] and shared["other_pids"] == []
    assert sensor.source.startswith("SHARED with 1 other process ")
    sensor.close()


# ------------------------------------------------------------------ the estimated split
def run(clock, sensors, seconds: float, tick_s: float = 0.05) -> None:
    """Read every sensor (value, then telemetry, as the sampler does) each ``tick_s`` for ``seconds``."""
    for _ in range(round(seconds / tick_s)):
        clock.advance(tick_s)
        for sensor in sensors:
            sensor.energy_j()
            sensor.read_fields()


def test_the_share_is_this_processs_part_of_the_summed_sm_utilisation(clock):
    fake = FakeNvml(h100s(1, power_W=300.0), clock)
    fake.gpus[0].compute_pids = [ME, 200, 300]
    fake.set_process_utilisation(0, {ME: 60, 200: 30, 300: (10, 5)})
    clock.advance(1.0)
    sensor = share_sensor(fake, clock)
    assert sensor.estimated and sensor.provenance == "estimated" and sensor.name == "share100"
    assert sensor.share == pytest.approx(0.6) and sensor.split_rule == SPLIT_SM
    assert sensor.source.startswith("ESTIMATE: this process's share of NVML nvmlDeviceGetTotalEnergyConsumption")
    assert sensor.source.endswith("the card was shared with up to 2 other process(es)")
    assert sensor.shape_power_field is None and sensor.kind == "energy"
    first = sensor.energy_j()
    run(clock, [sensor], 3.0)
    assert sensor.energy_j() - first == pytest.approx(0.6 * 300.0 * 3.0, abs=0.6 * 30.0)  # one counter period
    fields = sensor.read_fields()
    assert fields == {"other_processes": 2.0, "share_pct": pytest.approx(60.0)}
    split = sensor.describe()["split"]
    assert split["windows"] == 3 and split["windows_by_rule"] == {SPLIT_SM: 3}
    assert split["timing_bound_J"] == pytest.approx(0.0) and split["per_process_utilisation"] is True
    assert sensor.describe()["device_uuid"] == fake.gpus[0].uuid  # the report counts the card once
    sensor.close()
    assert fake.init_count == 0


def test_shares_of_every_process_add_up_to_the_card_within_their_timing_bounds(clock):
    """Three processes each run the split over one card, their windows out of step, while the work moves between
    them: the three figures add up to the card's within the sum of their timing bounds, and each is near the
    truth (the card's energy split by the programmed utilisation) within its own bound and a window's lag."""
    fake = FakeNvml(h100s(1, power_W=200.0), clock)
    pids = (ME, 200, 300)
    fake.gpus[0].compute_pids = list(pids)
    fake.set_process_utilisation(0, {ME: 50, 200: 50})
    clock.advance(1.0)
    card = card_sensor(fake, clock)
    shares = []
    for pid in pids:  # opened 0.3 s apart: their windows do not line up
        shares.append(share_sensor(fake, clock, me=pid))
        run(clock, [card, *shares], 0.3)
    start = [s.energy_j() for s in (card, *shares)]
    truth, moved = dict.fromkeys(pids, 0.0), dict.fromkeys(pids, 0.0)  # J; the sum of each true share's changes
    before = {ME: 0.5, 200: 0.5, 300: 0.0}
    for table, seconds in (({ME: 50, 200: 50}, 2.0), ({ME: 90, 300: 10}, 3.0), ({200: 40, 300: 40}, 2.5)):
        fake.set_process_utilisation(0, table)
        for pid in pids:
            true_share = table.get(pid, 0) / sum(table.values())
            truth[pid] += 200.0 * seconds * true_share
            moved[pid] += abs(true_share - before[pid])
            before[pid] = true_share
        run(clock, [card, *shares], seconds)
    clock.advance(0.05)
    end = [s.energy_j() for s in (card, *shares)]
    card_J, *share_J = (e - s for e, s in zip(end, start))
    bounds = [s.describe()["split"]["timing_bound_J"] for s in shares]
    assert all(b > 0 for b in bounds)  # the work moved: the timing mattered
    assert sum(share_J) == pytest.approx(card_J, abs=sum(bounds) + 1e-6)
    # against the truth: the window lag (the bound) and a process's last sample counting for the horizon after
    # it stops, each change of the true share off by at most a window and the horizon of the card's power
    lag_s = SHARE_WINDOW_S + SAMPLE_HORIZON_S
    for pid, figure, bound in zip(pids, share_J, bounds):
        assert figure == pytest.approx(truth[pid], abs=bound + lag_s * 200.0 * moved[pid]), pid
    for sensor in (card, *shares):
        sensor.close()


def test_an_idle_card_is_split_equally_and_a_card_without_per_process_utilisation_too(clock):
    fake = FakeNvml(h100s(1, power_W=100.0), clock)
    fake.gpus[0].compute_pids = [ME, 200, 300, 400]
    sensor = share_sensor(fake, clock)  # nobody has used the card: NVML_ERROR_NOT_FOUND
    assert sensor.share == pytest.approx(0.25) and sensor.split_rule == SPLIT_IDLE
    assert sensor.describe()["split"]["per_process_utilisation"] is True
    fake.set_process_utilisation(0, {200: 80})
    run(clock, [sensor], 1.5)
    assert sensor.share == 0.0 and sensor.split_rule == SPLIT_SM  # ours idle while another computes
    fake.set_process_utilisation(0, {})
    run(clock, [sensor], 3.5)  # its last sample ages past the horizon: idle again
    assert sensor.share == pytest.approx(0.25) and sensor.split_rule == SPLIT_IDLE
    sensor.close()

    fake = FakeNvml(h100s(1, power_W=100.0, has_process_utilisation=False), clock)
    fake.gpus[0].compute_pids = [ME, 200]
    sensor = share_sensor(fake, clock)
    assert sensor.share == 0.5 and sensor.split_rule == SPLIT_UNSUPPORTED
    assert "no per-process utilisation on this card" in sensor.source and "split equally" in sensor.source
    first = sensor.energy_j()
    run(clock, [sensor], 2.0)
    assert sensor.energy_j() - first == pytest.approx(0.5 * 100.0 * 2.0, abs=0.5 * 10.0)
    assert sensor.describe()["split"]["windows_by_rule"] == {SPLIT_UNSUPPORTED: 2}
    assert fake.calls["nvmlDeviceGetProcessUtilization"] == 1  # asked once, at open
    sensor.close()


def test_a_failing_utilisation_query_keeps_the_share_and_is_counted(clock):
    fake = FakeNvml(h100s(1), clock)
    fake.gpus[0].compute_pids = [ME, 200]
    fake.set_process_utilisation(0, {ME: 75, 200: 25})
    clock.advance(1.0)
    sensor = share_sensor(fake, clock)
    fake.fail("nvmlDeviceGetProcessUtilization", NVML_ERROR_UNKNOWN)
    fake.set_process_utilisation(0, {200: 100})
    run(clock, [sensor], 2.0)
    split = sensor.describe()["split"]
    assert sensor.share == pytest.approx(0.75) and split["query_errors"] == 2 and "Unknown" in split["last_query_error"]
    fake.fail("nvmlDeviceGetProcessUtilization", None)
    run(clock, [sensor], 1.0)
    assert sensor.share == 0.0
    sensor.close()


def test_samples_that_cannot_be_told_apart_are_split_equally(clock, monkeypatch):
    monkeypatch.setattr(shared_gpu, "pid_namespace_is_initial", lambda: False)
    fake = FakeNvml(h100s(1), clock)
    fake.gpus[0].compute_pids = [88001, 88002]  # host PIDs, ours among them but not ours to name
    fake.set_process_utilisation(0, {88001: 70, 88002: 30})
    clock.advance(1.0)
    sensor = NvmlProcessShareSensor(0, pynvml_module=fake, clock=clock)
    sensor.open()
    assert sensor.share == 0.5 and sensor.split_rule == SPLIT_UNTOLD
    sensor.close()


def test_the_split_sensor_can_be_copied_and_pickled_before_it_opens():
    """DDP spawn pickles the callbacks, and their sensors with them."""
    import copy
    import pickle

    sensor = NvmlProcessShareSensor(0, window_s=2.0)
    for twin in (copy.deepcopy(sensor), pickle.loads(pickle.dumps(sensor))):
        assert twin.window_s == 2.0 and twin.describe()["split"]["windows"] == 0 and twin.source == sensor.source
    with pytest.raises(ValueError, match="window_s"):
        NvmlProcessShareSensor(0, window_s=0)


def test_the_split_of_this_processs_cuda_device_is_found_by_the_measurement_mapping(clock, monkeypatch):
    # CUDA device 0 is NVML GPU 1, by the UUID torch reports (as under CUDA_VISIBLE_DEVICES=1)
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(clock, device_count=1,
                                                        uuids=["00000001-1111-2222-3333-444444444444"]))
    fake = FakeNvml(h100s(2), clock)
    sensor = NvmlProcessShareSensor.for_cuda_device(0, pynvml_module=fake, clock=clock)
    assert (sensor.nvml_index, sensor.name) == (1, "gpu1_share")  # beside the detected "gpu1"
    assert fake.init_count == 0


def test_nvml_not_found_from_the_real_binding_shape_is_handled(clock):
    """pynvml raises NVMLError(NVML_ERROR_NOT_FOUND) from its first (size) call when there are no samples."""
    fake = FakeNvml(h100s(1), clock)
    fake.gpus[0].compute_pids = [ME]
    fake.fail("nvmlDeviceGetProcessUtilization", NVML_ERROR_NOT_FOUND)
    sensor = share_sensor(fake, clock)
    assert sensor.share == 1.0 and sensor.split_rule == SPLIT_IDLE and sensor.describe()["split"]["query_errors"] == 0
    sensor.close()


# ------------------------------------------------------------------ through a real Trainer.fit
class TimedModule(SimModule):
    def training_step(self, batch, batch_idx):
        self.clock.advance(0.1)
        return super().training_step(batch, batch_idx)


def shared_fit(tmp_path, monkeypatch, sensors_for):
    clock = install_fake_time(monkeypatch.setattr)
    fake = FakeNvml(h100s(1, power_W=150.0), clock)
    fake.gpus[0].compute_pids = [os.getpid(), 4242, 4343]  # this process and two others
    fake.set_process_utilisation(0, {os.getpid(): 50, 4242: 25, 4343: 25})
    clock.advance(1.0)  # they have been running a while: NVML holds samples
    energy = EnergyCallback(sensors=sensors_for(fake, clock), verbose=False, write_trace=True, log_power_figure=False)
    trainer = L.Trainer(callbacks=[energy], logger=False, max_epochs=2, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
                        default_root_dir=str(tmp_path))
    trainer.fit(TimedModule(clock=clock), loader(8, batch_size=4))
    return energy.report


def test_a_fit_on_a_shared_card_labels_its_figures_in_the_report(tmp_path, monkeypatch, warnings_logged):
    report = shared_fit(tmp_path, monkeypatch, lambda fake, clock: [NvmlGpuSensor(0, pynvml_module=fake, clock=clock)])
    (sensor,) = report["sensors"]
    assert sensor["source"].startswith("SHARED with 2 other processes (the whole card's energy, theirs included)")
    assert sensor["shared"]["other_processes_max"] == 2 and sensor["shared"]["other_pids"] == [4242, 4343]
    assert sensor["provenance"] == "measured" and sensor["energy_J"] > 0
    assert "SHARED with 2 other processes" in format_report(report)
    assert len(warnings_logged()) == 1
    traces = list(tmp_path.rglob("*.csv"))
    assert any("gpu0:other_processes" in t.read_text().splitlines()[0] for t in traces)


def test_a_fit_with_the_split_beside_the_card_counts_the_card_once_and_labels_the_split(tmp_path, monkeypatch):
    def sensors(fake, clock):
        return [NvmlGpuSensor(0, pynvml_module=fake, clock=clock),
                NvmlProcessShareSensor(0, pynvml_module=fake, clock=clock, window_s=0.5)]

    report = shared_fit(tmp_path, monkeypatch, sensors)
    card, split = report["sensors"]
    assert split["name"] == "gpu0_share" and split["provenance"] == "estimated" and split["estimated"]
    assert split["source"].startswith("ESTIMATE: this process's share")
    assert split["counted"] is False and report["total_J"] == pytest.approx(card["energy_J"])
    assert split["energy_J"] == pytest.approx(0.5 * card["energy_J"], rel=0.05)
    assert split["split"]["share"] == pytest.approx(0.5)


def test_a_fit_with_the_split_alone_reports_an_estimated_total(tmp_path, monkeypatch):
    report = shared_fit(tmp_path, monkeypatch,
                        lambda fake, clock: [NvmlProcessShareSensor(0, pynvml_module=fake, clock=clock, window_s=0.5)])
    (split,) = report["sensors"]
    assert report["provenance"] == "estimated" and report["estimated_J"] == pytest.approx(report["total_J"])
    assert split["energy_J"] == pytest.approx(0.5 * 150.0 * report["duration_s"], rel=0.05)
    assert "ESTIMATE" in format_report(report)
