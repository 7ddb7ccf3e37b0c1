"""Multi-node DDP, simulated: 2 nodes x 2 CPU ranks on this host (issue 12 item 2).

Host sensors are read once per node (by its local rank 0), device sensors once per rank, and the total is
exactly the sum of each sensor's constant power times its rank's measured duration. The four processes are
forked by rank_zygote.py, one per global rank, with the variables an external launcher sets (see
multinode_fit.py).
"""

import json
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEVICE_W, HOST_W, NODE_W = 80.0, 25.0, 400.0  # as in multinode_fit.py
NUM_NODES, DEVICES = 2, 2
WORLD_SIZE = NUM_NODES * DEVICES
EPOCHS = 3
TIMEOUT_S = 90
WATTS = {"device": DEVICE_W, "host": HOST_W}


@pytest.fixture(scope="module")
def report(tmp_path_factory, rank_zygote) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "CODECARBON_LOG_LEVEL": "error"}
    for attempt in range(2):  # a second try only for a port taken between choosing and binding it
        base = tmp_path_factory.mktemp(f"multinode{attempt}")
        out_dir = base / "out"
        out_dir.mkdir()
        run = rank_zygote.run(HERE / "multinode_fit.py", [out_dir], base / "logs", nodes=NUM_NODES, devices=DEVICES,
                              env=env, timeout_s=TIMEOUT_S)
        if run.returncode == 0 or "address already in use" not in run.stderr.lower():
            break
    assert run.returncode == 0, f"exit codes by rank {run.codes} (MASTER_PORT={run.port})\n{run.stderr[-5000:]}"
    (report_path,) = out_dir.rglob("energy_report.json")
    return json.loads(report_path.read_text())


def _durations(report: dict) -> dict[int, float]:
    return {r["rank"]: r["duration_s"] for r in report["ranks"]}


@pytest.mark.slow
def test_host_sensor_once_per_node_device_sensor_once_per_rank(report):
    assert report["world_size"] == WORLD_SIZE
    assert sorted(r["rank"] for r in report["ranks"]) == list(range(WORLD_SIZE))
    assert sorted((r["rank"], r["local_rank"]) for r in report["ranks"]) == [(0, 0), (1, 1), (2, 0), (3, 1)]
    owners = sorted((s["name"], s["rank"]) for s in report["sensors"])
    # host on global ranks 0 and 2: local rank 0 of node 0 and of node 1
    assert owners == [("device", 0), ("device", 1), ("device", 2), ("device", 3), ("host", 0), ("host", 2)]
    assert {s["name"]: s["scope"] for s in report["sensors"]} == {"device": "device", "host": "host"}
    assert all(d > 0 for d in _durations(report).values())


@pytest.mark.slow
def test_total_is_exact_sum_of_sensor_power_times_rank_duration(report):
    durations = _durations(report)
    expected = {}
    for s in report["sensors"]:
        joules = WATTS[s["name"]] * durations[s["rank"]]
        assert s["energy_J"] == pytest.approx(joules, rel=1e-9), s  # each row: its constant power x its rank's time
        expected[s["name"]] = expected.get(s["name"], 0.0) + joules
    # 4 device sensors and 2 host sensors in all
    assert expected["device"] == pytest.approx(DEVICE_W * sum(durations.values()), rel=1e-12)
    assert expected["host"] == pytest.approx(HOST_W * (durations[0] + durations[2]), rel=1e-12)
    assert report["total_J"] == pytest.approx(sum(expected.values()), rel=1e-9)
    assert sum(s["energy_J"] for s in report["sensors"]) == pytest.approx(report["total_J"], rel=1e-9)


@pytest.mark.slow
def test_epochs_per_sensor_energy_adds_up_to_train_energy(report):
    epochs = report["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS))
    durations = _durations(report)
    for epoch in epochs:
        per_sensor = epoch["per_sensor_J"]
        assert set(per_sensor) == {"device", "host"}
        assert epoch["train_J"] == pytest.approx(sum(per_sensor.values()), rel=1e-12)
        assert epoch["train_s"] > 0 and all(j > 0 for j in per_sensor.values())
    # no epoch can hold more of a sensor than the whole fit does (alignment-free bounds)
    assert sum(e["per_sensor_J"]["device"] for e in epochs) <= DEVICE_W * sum(durations.values()) * (1 + 1e-9)
    assert sum(e["per_sensor_J"]["host"] for e in epochs) <= HOST_W * (durations[0] + durations[2]) * (1 + 1e-9)
    assert sum(e["train_J"] for e in epochs) <= report["total_J"] * (1 + 1e-9)


@pytest.mark.slow
def test_epoch_power_is_all_sensors_power(report):
    expected_W = WORLD_SIZE * DEVICE_W + NUM_NODES * HOST_W  # 4 device sensors + 2 host sensors
    powers = [e["train_J"] / e["train_s"] for e in report["epochs"]]
    assert powers == pytest.approx([expected_W] * EPOCHS, rel=1e-6)


@pytest.mark.slow
def test_the_node_figure_is_counted_once_per_node_beside_its_components_and_never_in_the_total(report):
    """Issue 28: a node-scope sensor (a BMC's stand-in, 400 W) is read by each node's local rank 0 only; the report's
    node entry has one host per node, node = components + other on each, and the total holds no node figure."""
    node, durations = report["node"], _durations(report)
    assert "bmc" not in {s["name"] for s in report["sensors"]}  # never a component, never in total_J
    hosts = {h["host"]: h for h in node["hosts"]}
    assert sorted(hosts) == ["simnode0", "simnode1"] and node["hosts_without_node_figure"] == []
    for number, host in enumerate(("simnode0", "simnode1")):
        entry, local_zero = hosts[host], 2 * number  # global rank of the node's local rank 0
        assert [s["rank"] for s in entry["sensors"]] == [local_zero]  # read once per node
        ranks = (local_zero, local_zero + 1)
        components = HOST_W * durations[local_zero] + DEVICE_W * sum(durations[r] for r in ranks)
        assert entry["components_J"] == pytest.approx(components, rel=1e-9)
        assert entry["node_J"] == pytest.approx(NODE_W * durations[local_zero], rel=0.02)  # its own ledger's window
        assert entry["other_J"] == pytest.approx(entry["node_J"] - entry["components_J"], rel=1e-12)
        assert entry["node_provenance"] == "simulated" and entry["other_provenance"] == "simulated"
    assert node["node_J"] == pytest.approx(sum(h["node_J"] for h in hosts.values()), rel=1e-12)
    assert node["components_J"] == pytest.approx(report["total_J"], rel=1e-9)
