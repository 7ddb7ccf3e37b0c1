"""The whole node: Redfish and IPMI DCMI sensors (scope "node") against a Redfish server on 127.0.0.1 and a fake
ipmitool, through the real sampler, and the report's node / components / other split from real fits.

Debian's ``ipmi_sim`` (openipmi 2.0.x) has no DCMI handler (its lanserv library registers group extensions only
for plug-ins; ``strings`` shows no DCMI command), so ``tests/fake_ipmitool`` prints what ipmitool 1.8 prints.
No wall clock: the BMC's power follows the count of its reads or a value the test sets, fits run on fake time
(``install_fake_time``); only the timeout tests wait, for a reply the test holds back.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import lightning as L
import pytest

from conftest import FakeTimeSteps, RecordingLogger, tiny_loader, trainer_kwargs
from fake_bmc import FakeBmc, make_certificate
from lightning_energy import EnergyCallback, EnergyMeter, SimulatedSensor
from lightning_energy.core.run import checked_extra_sensors, sensors_for_rank
from lightning_energy.measure.sampler import READ_ERROR_STREAK_LIMIT, Sampler
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.ipmi import DcmiError, DcmiPowerSensor, parse_power_reading
from lightning_energy.measure.sensors.node_config import NodeConfigError, node_sensors_from_env, read_secret_file
from lightning_energy.measure.sensors.redfish import (
    Credentials, RedfishClient, RedfishEnergySensor, RedfishError, RedfishPowerSensor, find_reading,
    redfish_node_sensor,
)
from lightning_energy.outputs.report import build_report, format_report
from power_limit_helpers import install_fake_time

HERE = Path(__file__).resolve().parent
PASSWORD = "s3cret-BMC-pw"
SLOW_OK_S = 20.0  # a read's bound where the test does not test timeouts (a loaded machine is slow, never this slow)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl CLI makes the BMC's certificate")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return make_certificate(tmp_path_factory.mktemp("bmc-cert"))


@pytest.fixture
def bmc(certificate):
    server = FakeBmc(password=PASSWORD, certificate=certificate)
    yield server
    server.close()


@pytest.fixture
def plain_bmc():
    server = FakeBmc(password=PASSWORD)
    yield server
    server.close()


def creds() -> Credentials:
    return Credentials("admin", PASSWORD)


def power_sensor(bmc, certificate, **kwargs) -> RedfishPowerSensor:
    return RedfishPowerSensor(bmc.url, creds(), ca_bundle=str(certificate[0]), timeout_s=SLOW_OK_S, **kwargs)


# ---------------------------------------------------------------------- Redfish: transport and auth
def test_https_session_is_made_once_reused_and_deleted(bmc, certificate):
    sensor = power_sensor(bmc, certificate)
    sensor.open()
    bmc.power_W = lambda reads: 400.0 + reads  # the power follows the BMC's read count
    before = bmc.power_reads
    values = [sensor.power_w() for _ in range(5)]
    sensor.close()
    assert values == [400.0 + before + i for i in range(1, 6)]
    assert bmc.logins == 1 and bmc.logouts == 1  # one Redfish session, deleted at close
    assert bmc.connections == 1  # one kept-alive connection for the probe and every read
    assert sensor.reading.path == "/redfish/v1/Chassis/1/EnvironmentMetrics"  # not the GPU baseboard's
    assert "certificate verified" in sensor.source and "PowerWatts" in sensor.source


def test_certificate_checks_are_on_by_default_and_insecure_is_labelled(bmc, certificate):
    unchecked = RedfishPowerSensor(bmc.url, creds(), timeout_s=SLOW_OK_S)  # system CAs: a self-signed cert fails
    with pytest.raises(RedfishError, match="CERTIFICATE_VERIFY_FAILED|SSL"):
        unchecked.open()
    insecure = RedfishPowerSensor(bmc.url, creds(), insecure=True, timeout_s=SLOW_OK_S)
    insecure.open()
    assert insecure.power_w() == 500.0
    assert "NOT VERIFIED" in insecure.source and "NOT VERIFIED" in insecure.describe()["tls"]
    insecure.close()


def test_credentials_never_show(bmc, certificate):
    sensor = power_sensor(bmc, certificate)
    sensor.open()
    texts = [repr(creds()), str(creds()), repr(sensor), sensor.source, json.dumps(sensor.describe())]
    bmc.expire_sessions()  # a new login, a new token, still hidden
    sensor.power_w()
    bmc.fail_next(1, 503)
    with pytest.raises(RedfishError) as caught:
        sensor.power_w()
    texts.append(str(caught.value))
    sensor.close()
    for token in bmc.issued_tokens:
        assert not any(token in text for text in texts)
    assert not any(PASSWORD in text for text in texts)
    with pytest.raises(ValueError, match="must not hold credentials") as bad_url:
        RedfishClient(f"https://admin:{PASSWORD}@127.0.0.1:1")
    assert PASSWORD not in str(bad_url.value)
    with pytest.raises(ValueError, match="plain http"):
        RedfishClient("http://127.0.0.1:1", creds())


def test_wrong_password_and_an_expired_session(bmc, certificate):
    wrong = RedfishPowerSensor(bmc.url, Credentials("admin", "nope"), ca_bundle=str(certificate[0]), timeout_s=SLOW_OK_S)
    with pytest.raises(RedfishError, match="HTTP 401.*wrong user or password"):
        wrong.open()
    sensor = power_sensor(bmc, certificate)
    sensor.open()
    bmc.expire_sessions()  # the BMC's session timeout: the next GET gets 401, the client logs in again once
    assert sensor.power_w() == 500.0
    assert bmc.logins == 2
    sensor.close()


def test_basic_auth_where_there_is_no_session_service(certificate):
    server = FakeBmc(password=PASSWORD, certificate=certificate, sessions=False)
    try:
        sensor = power_sensor(server, certificate)
        sensor.open()
        assert sensor.power_w() == 500.0 and server.logins == 0
        sensor.close()
    finally:
        server.close()


@pytest.mark.parametrize("fault, match", [("status", "HTTP 503"), ("malformed", "malformed JSON"),
                                          ("null", "no usable reading")])
def test_faults_raise_for_the_sampler_to_count(bmc, certificate, fault, match):
    sensor = power_sensor(bmc, certificate)
    sensor.open()
    {"status": lambda: bmc.fail_next(1, 503), "malformed": lambda: bmc.malformed_next(1),
     "null": lambda: bmc.null_next(1)}[fault]()
    with pytest.raises(RedfishError, match=match):
        sensor.power_w()
    assert sensor.power_w() == 500.0  # the next read is fine again, on the same session
    sensor.close()


def test_a_reply_that_does_not_come_is_a_timeout(bmc, certificate):
    sensor = RedfishPowerSensor(bmc.url, creds(), ca_bundle=str(certificate[0]), timeout_s=0.2)
    sensor.open()
    bmc.hold_next(1)
    with pytest.raises(RedfishError, match="no reply within 0.2 s"):
        sensor.power_w()
    bmc.release.set()
    sensor.close()


def test_legacy_power_resource(plain_bmc):
    plain_bmc.legacy_only = True
    sensor = RedfishPowerSensor(plain_bmc.url, creds(), insecure=True, timeout_s=SLOW_OK_S)  # plain http: opt-in
    sensor.open()
    assert "NOT ENCRYPTED" in sensor.source
    assert sensor.reading.field == "PowerConsumedWatts" and sensor.power_w() == 500.0
    sensor.close()


# ---------------------------------------------------------------------- Redfish: the energy counter
def test_counter_preferred_resets_continue_and_resolution_follows_decimals(bmc, certificate):
    bmc.energy_J, bmc.energy_step_J = 1000.0, 0.0
    sensor = redfish_node_sensor(bmc.url, creds(), ca_bundle=str(certificate[0]), timeout_s=SLOW_OK_S)
    assert isinstance(sensor, RedfishEnergySensor) and sensor.kind == "energy"
    sensor.open()
    assert "EnergyJoules counter" in sensor.source
    first = sensor.energy_j()
    bmc.energy_J = 1500.0
    assert sensor.energy_j() - first == 500.0
    bmc.energy_J, bmc.reset_time = 20.0, "2024-06-01T00:00:00Z"  # ResetMetrics: the counter starts again
    after_reset = sensor.energy_j()
    bmc.energy_J = 70.0
    assert sensor.energy_j() - after_reset == 50.0 and after_reset >= 1500.0 and sensor.resets == 1
    sensor.close()


def test_a_coarse_kwh_counter_is_passed_over_for_power(bmc, certificate):
    bmc.energy_J, bmc.energy_unit, bmc.kwh_decimals = 3.6e6 * 12.345, "kWh", 3  # 3.6 kJ steps
    sensor = redfish_node_sensor(bmc.url, creds(), ca_bundle=str(certificate[0]), timeout_s=SLOW_OK_S)
    assert isinstance(sensor, RedfishPowerSensor)
    bmc.kwh_decimals = 6  # 3.6 J steps: the counter is worth it
    fine = redfish_node_sensor(bmc.url, creds(), ca_bundle=str(certificate[0]), timeout_s=SLOW_OK_S)
    assert isinstance(fine, RedfishEnergySensor)
    fine.open()
    fine.energy_j()
    assert fine.counter_resolution_J == pytest.approx(3.6)
    fine.close()


def test_the_node_chassis_is_found_by_its_links(bmc, certificate):
    client = RedfishClient(bmc.url, creds(), str(certificate[0]), timeout_s=SLOW_OK_S)
    assert find_reading(client).chassis == "/redfish/v1/Chassis/1"
    bmc.fail_next(1)  # one 503 in the probe: retried, never a fall back to the baseboard's power
    assert find_reading(client).chassis == "/redfish/v1/Chassis/1"
    bmc.fail_next(4)
    with pytest.raises(RedfishError, match="HTTP 503"):
        find_reading(client)
    assert find_reading(client, "GPU_Baseboard").chassis == "/redfish/v1/Chassis/GPU_Baseboard"  # when asked
    client.close()


# ---------------------------------------------------------------------- Redfish through the real sampler
def test_through_the_sampler_errors_are_counted_then_fail_the_sensor(bmc, certificate, clock):
    sampler = Sampler(clock=clock)
    sensor = power_sensor(bmc, certificate, min_read_interval_s=1.0)
    bmc.power_W = 300.0
    sampler.acquire("test", [sensor], 0.05, start_thread=False)
    for _ in range(3):  # 0.5 s apart: every other tick reads the BMC (min_read_interval_s)
        clock.advance(0.5)
        sampler.sample_once()
    series = sampler.series[sensor.name]
    assert len(series.times) == 2 and series.energy_at(series.times[-1]) == pytest.approx(300.0)
    bmc.fail_next(1, 503)
    clock.advance(1.0)
    sampler.sample_once()
    assert sampler.read_error_counts[sensor.name] == 1 and series.live  # one error: within the budget
    bmc.fail_next(READ_ERROR_STREAK_LIMIT, 503)
    for _ in range(READ_ERROR_STREAK_LIMIT):
        clock.advance(1.0)
        sampler.sample_once()
    assert not series.live and "HTTP 503" in sampler.read_errors[-1].message
    sampler.release("test")


# ---------------------------------------------------------------------- IPMI DCMI
DCMI_OUTPUT = """
    Instantaneous power reading:                   225 Watts
    Minimum during sampling period:                 10 Watts
    Maximum during sampling period:                330 Watts
    Average power reading over sample period:      223 Watts
    IPMI timestamp:                           Thu Jan  1 00:00:00 1970
    Sampling period:                          00000005 Seconds.
    Power reading state is:                   activated
"""


def test_parse_dcmi_power_reading():
    reading = parse_power_reading(DCMI_OUTPUT)
    assert (reading.instantaneous_W, reading.average_W, reading.sampling_period_s, reading.active) == (225, 223, 5, True)
    assert not parse_power_reading(DCMI_OUTPUT.replace("activated", "deactivated")).active
    assert parse_power_reading(DCMI_OUTPUT.replace("00000005 Seconds.", "1000 Milliseconds")).sampling_period_s == 1.0
    with pytest.raises(DcmiError, match="instantaneous power reading"):
        parse_power_reading("Could not open device at /dev/ipmi0")


@pytest.fixture
def ipmitool(tmp_path, monkeypatch):
    state, log = tmp_path / "state.json", tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_IPMITOOL_STATE", str(state))
    monkeypatch.setenv("FAKE_IPMITOOL_LOG", str(log))

    def set_state(**values):
        base = {"instantaneous": 412, "average": 398, "minimum": 20, "maximum": 640, "period_s": 5,
                "state": "activated", "fail": None, "password": PASSWORD}
        state.write_text(json.dumps({**base, **values}))

    set_state()
    set_state.log = log
    return set_state


def test_dcmi_sensor_says_which_reading_and_keeps_the_password_off_the_command_line(ipmitool):
    fake = str(HERE / "fake_ipmitool")
    instantaneous = DcmiPowerSensor(ipmitool=fake, timeout_s=SLOW_OK_S)
    instantaneous.open()
    assert instantaneous.power_w() == 412.0 and "instantaneous" in instantaneous.source
    average = DcmiPowerSensor(name="node_dcmi_avg", reading="average", host="127.0.0.1", credentials=creds(),
                              ipmitool=fake, timeout_s=SLOW_OK_S)
    average.open()
    assert average.power_w() == 398.0
    assert "average power over the BMC's 5 s sampling period" in average.source
    calls = [json.loads(line) for line in ipmitool.log.read_text().splitlines()]
    assert all(PASSWORD not in " ".join(call["argv"]) for call in calls)
    assert calls[-1]["env_password"] == PASSWORD and "-E" in calls[-1]["argv"] and calls[0]["env_password"] is None


@pytest.mark.parametrize("fail, match", [("auth", "exited with 1: Error: Unable to establish"),
                                         ("no-dcmi", "Invalid command"), ("garbage", "no 'instantaneous")])
def test_dcmi_errors(ipmitool, fail, match):
    ipmitool(fail=fail)
    sensor = DcmiPowerSensor(ipmitool=str(HERE / "fake_ipmitool"), timeout_s=SLOW_OK_S)
    with pytest.raises(DcmiError, match=match):
        sensor.power_w()
    ipmitool(state="deactivated")
    with pytest.raises(DcmiError, match="deactivated"):
        sensor.power_w()


def test_dcmi_timeout(ipmitool):
    ipmitool(fail="hang")
    with pytest.raises(DcmiError, match="within 0.3 s"):
        DcmiPowerSensor(ipmitool=str(HERE / "fake_ipmitool"), timeout_s=0.3).power_w()


# ---------------------------------------------------------------------- configuration from the environment
def secret_file(tmp_path, mode=0o600) -> Path:
    path = tmp_path / "bmc-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(mode)
    return path


def test_environment_configures_node_sensors(bmc, certificate, tmp_path, ipmitool):
    env = {"LIGHTNING_ENERGY_REDFISH_URL": bmc.url, "LIGHTNING_ENERGY_REDFISH_USER": "admin",
           "LIGHTNING_ENERGY_REDFISH_PASSWORD_FILE": str(secret_file(tmp_path)),
           "LIGHTNING_ENERGY_REDFISH_CA_BUNDLE": str(certificate[0]), "LIGHTNING_ENERGY_REDFISH_INTERVAL_S": "2",
           "LIGHTNING_ENERGY_IPMI": "1", "LIGHTNING_ENERGY_IPMITOOL": str(HERE / "fake_ipmitool"),
           "LIGHTNING_ENERGY_IPMI_READING": "average"}
    sensors, notes = node_sensors_from_env(env)
    assert notes == []
    assert [type(s).__name__ for s in sensors] == ["RedfishPowerSensor", "DcmiPowerSensor"]
    assert sensors[0].min_read_interval_s == 2.0 and sensors[1].reading == "average"
    assert all(s.scope == "node" for s in sensors)


def test_bad_settings_give_one_note_and_no_sensor(bmc, tmp_path):
    readable = secret_file(tmp_path, 0o644)
    with pytest.raises(NodeConfigError, match="may be read by others"):
        read_secret_file(readable)
    env = {"LIGHTNING_ENERGY_REDFISH_URL": bmc.url, "LIGHTNING_ENERGY_REDFISH_USER": "admin",
           "LIGHTNING_ENERGY_REDFISH_PASSWORD_FILE": str(readable)}
    sensors, notes = node_sensors_from_env(env)
    assert sensors == [] and len(notes) == 1 and "chmod 600" in notes[0]
    sensors, notes = node_sensors_from_env({"LIGHTNING_ENERGY_REDFISH_URL": "https://127.0.0.1:1",
                                            "LIGHTNING_ENERGY_REDFISH_USER": "admin",
                                            "LIGHTNING_ENERGY_REDFISH_PASSWORD": PASSWORD,
                                            "LIGHTNING_ENERGY_REDFISH_TIMEOUT_S": "2"})
    assert sensors == [] and len(notes) == 1 and PASSWORD not in notes[0]  # a BMC that does not answer


def test_node_sensors_are_read_on_local_rank_zero_only(plain_bmc, monkeypatch):
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_URL", plain_bmc.url)
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_USER", "admin")
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_PASSWORD", PASSWORD)
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_INSECURE", "1")
    on_zero, _, _ = sensors_for_rank(None, True)
    on_one, _, _ = sensors_for_rank(None, False)
    assert [s.scope for s in on_zero].count("node") == 1 and all(s.scope != "node" for s in on_one)
    explicit = SimulatedSensor("pdu", 600.0, scope="host")
    node = _constant_node(700.0)
    assert [s.name for s in sensors_for_rank(None, False, extra_sensors=[explicit, node])[0]
            if s.name in ("pdu", "node_const")] == []
    with_extra, _, _ = sensors_for_rank(None, True, extra_sensors=[node])
    assert [s.name for s in with_extra if s.scope == "node"] == ["node_const"]  # replaces the environment's
    with pytest.raises(ValueError, match="with `sensors` given"):
        checked_extra_sensors([node], [explicit])


class _ConstantNode(Sensor):
    def __init__(self, watts: float) -> None:
        super().__init__("node_const", "node", source="constant node power (test)")
        self.watts = watts

    def power_w(self) -> float:
        return self.watts


def _constant_node(watts: float) -> Sensor:
    return _ConstantNode(watts)


# ---------------------------------------------------------------------- end to end
EPOCHS, STEP_S = 2, 0.05
DEVICE_W, HOST_W, NODE_W = 100.0, 50.0, 500.0


def _fit_with_bmc(tmp_path, monkeypatch, bmc, certificate, interval_s="0.1", rows=64):
    clock = install_fake_time(monkeypatch.setattr)
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_URL", bmc.url)
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_USER", "admin")
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_PASSWORD_FILE", str(secret_file(tmp_path)))
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_CA_BUNDLE", str(certificate[0]))
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_TIMEOUT_S", str(SLOW_OK_S))
    monkeypatch.setenv("LIGHTNING_ENERGY_REDFISH_INTERVAL_S", interval_s)  # 0.1: on fake time, every other step
    # the auto-detected GPU / CPU sensors are simulated here: the node sensor comes from the environment
    import lightning_energy.core.run as core_run

    monkeypatch.setattr(core_run, "default_sensors", lambda cuda_index, read_host: (
        [SimulatedSensor("device", DEVICE_W, kind="energy", clock=clock),
         *([SimulatedSensor("host", HOST_W, scope="host", kind="energy", clock=clock)] if read_host else [])], []))
    logger = RecordingLogger(tmp_path / "fit")
    callback = EnergyCallback(verbose=True)
    trainer = L.Trainer(callbacks=[callback], logger=logger,
                        **trainer_kwargs(tmp_path / "fit", max_epochs=EPOCHS, log_every_n_steps=1,
                                         num_sanity_val_steps=0))
    trainer.fit(FakeTimeSteps(clock, STEP_S), tiny_loader(rows, 16), tiny_loader(32, 16))
    return callback, logger


def test_fit_reports_node_components_and_other(tmp_path, monkeypatch, bmc, certificate, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback, logger = _fit_with_bmc(tmp_path, monkeypatch, bmc, certificate)
    report = callback.report
    node = report["node"]
    duration = report["duration_s"]
    assert node["node_J"] == pytest.approx(NODE_W * duration, rel=1e-6)
    assert node["components_J"] == pytest.approx(report["total_J"]) == pytest.approx((DEVICE_W + HOST_W) * duration)
    assert node["other_J"] == pytest.approx(node["node_J"] - node["components_J"])
    # the components here are simulated: the rest, node less components, is labelled as both
    assert (node["node_provenance"], node["components_provenance"], node["other_provenance"]) == (
        "measured", "simulated", "measured+simulated")
    assert [s["scope"] for s in report["sensors"]] == ["device", "host"]  # the node is never in the total
    for row in report["epochs"]:
        assert row["node_J"] == pytest.approx(NODE_W * row["train_s"], rel=1e-6)
        assert row["node_other_J"] == pytest.approx(row["node_J"] - row["train_J"])
    node_epochs = [(step, m) for step, m in logger.metrics if "energy/node/epoch_J" in m]
    assert len(node_epochs) == EPOCHS
    epoch_steps = [step for step, m in logger.metrics if "energy/epoch_J" in m]
    assert [step for step, _ in node_epochs] == epoch_steps  # at the epoch's own step
    for _, m in node_epochs:
        assert m["energy/other/epoch_J"] == pytest.approx(m["energy/node/epoch_J"] * (1 - (DEVICE_W + HOST_W) / NODE_W))
    out = capsys.readouterr()
    assert "other" in out.out and "node " in out.out
    # no credential anywhere: report, trace, events, console, warnings
    texts = [p.read_text() for p in (tmp_path / "fit").rglob("*") if p.is_file() and p.suffix in (".json", ".csv")]
    texts += [out.out, out.err, json.dumps(report), *(str(w.message) for w in caught)]
    for secret in [PASSWORD, *bmc.issued_tokens]:
        assert not any(secret in text for text in texts)
    assert bmc.logouts == bmc.logins  # the sessions were closed


def test_a_bmc_that_fails_mid_fit_costs_one_warning(tmp_path, monkeypatch, bmc, certificate):
    bmc.fail_from_read = 10  # a few good reads (the probe's and the fit's first), then the BMC goes bad for good
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback, _ = _fit_with_bmc(tmp_path, monkeypatch, bmc, certificate, interval_s="0", rows=160)
    failures = [w for w in caught if "node_redfish" in str(w.message) and "failed" in str(w.message)]
    assert len(failures) == 1
    report = callback.report
    entry = report["node"]["hosts"][0]["sensors"][0]
    assert "503" in entry["failure"] and entry["missing_from_s"] is not None and not entry["covers_run"]
    assert report["total_J"] == pytest.approx((DEVICE_W + HOST_W) * report["duration_s"])  # training went on
    assert "node sensor node_redfish" in format_report(report)


def test_plain_meter_extra_sensor(tmp_path, monkeypatch, plain_bmc):
    clock = install_fake_time(monkeypatch.setattr)
    import lightning_energy.plain as plain_module

    monkeypatch.setattr(plain_module, "get_sampler", lambda: __import__(
        "lightning_energy.integration.session", fromlist=["get_sampler"]).get_sampler())
    node = RedfishPowerSensor(plain_bmc.url, creds(), insecure=True, timeout_s=SLOW_OK_S, min_read_interval_s=0.0)
    with EnergyMeter(log_dir=tmp_path, sensors=None, extra_sensors=[node], device="cpu", verbose=False) as meter:
        meter_sensors = meter._recorder.attachment
        assert node in meter_sensors.node_sensors and node not in meter_sensors.sensors
        for _ in range(4):
            clock.advance(0.1)
            meter.step()
        meter.epoch()
    node_report = meter.report["node"]
    assert node_report["node_J"] == pytest.approx(NODE_W * meter.report["duration_s"], rel=1e-6)
    assert node_report["components_J"] == pytest.approx(meter.report["total_J"])


def test_report_split_over_two_hosts_one_without_a_node_sensor():
    def summary(rank, host, component_J, node_J=None, epochs=None):
        sensors = [{"name": "gpu", "scope": "device", "kind": "energy", "estimated": False, "provenance": "measured",
                    "source": "x", "rank": rank, "energy_J": component_J, "mean_power_W": 1.0, "failure": None}]
        out = {"rank": rank, "local_rank": 0, "node": host, "duration_s": 10.0, "train_J": 0.0, "validation_J": 0.0,
               "sensors": sensors}
        if node_J is not None:
            out["node_sensors"] = [{"name": "node_redfish", "scope": "node", "provenance": "measured",
                                    "estimated": False, "energy_J": node_J, "covers_run": True, "bound_J": 1.0,
                                    "failure": None}]
            out["node_epochs"] = epochs or {}
        return out

    epochs = [{"epoch": 0, "train_J": 300.0}]
    report = build_report([summary(0, "a", 200.0, 500.0, {"0": {"energy_J": {"node_redfish": 450.0}, "missing": []}}),
                           summary(1, "b", 100.0)], epochs, {})
    node = report["node"]
    assert (node["node_J"], node["components_J"], node["other_J"]) == (500.0, 200.0, 300.0)
    assert node["hosts_without_node_figure"] == ["b"]
    assert "node_J" not in epochs[0]  # not every host has a node figure: no per-epoch split
    assert report["total_J"] == 300.0
    text = format_report(report)
    assert "no node figure for b" in text and "other 300.0 J (measured)" in text
