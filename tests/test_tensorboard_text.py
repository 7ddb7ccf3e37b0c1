"""Issue 32 item 11: what TensorBoard shows stays readable — the report in the Text tab is a table whose cells wrap
(a code block ran off the page's right edge), and one sensor gives one epoch-energy card, not two identical ones."""

from __future__ import annotations

from lightning_energy.core.metrics import epoch_metrics
from lightning_energy.outputs.tensorboard import report_markdown

LONG_SOURCE = ("ESTIMATE, process mode: this process's share of the CPU time x TDP; TDP 8 W from CodeCarbon's "
               "per-thread rule (2 threads x 4 W: a CPU model not in its table); CPU Some | Vendor CPU @ 2.50GHz")


def report(sensors):
    """A report as the recorder builds it, from one rank's summary."""
    from lightning_energy.outputs.report import build_report

    summary = {"rank": 0, "local_rank": 0, "node": "n", "duration_s": 3.0, "train_J": 10.0, "validation_J": 2.0,
               "sensors": sensors}
    return build_report([summary], [], {"sampling": {}, "notes": [], "sections": {}})


def test_the_text_tab_report_is_a_table_not_a_code_block():
    text = report_markdown(report([{"name": "cpu_estimate", "rank": 0, "scope": "host", "energy_J": 12.5,
                                    "mean_power_W": 4.17, "estimated": True, "provenance": "estimated",
                                    "source": LONG_SOURCE, "failure": None, "missing_from_s": None}]))
    lines = text.splitlines()
    assert not any(line.startswith("    ") for line in lines)  # no preformatted block: nothing runs off the page
    header = next(i for i, line in enumerate(lines) if line.startswith("| sensor |"))
    assert lines[header + 1].startswith("|---")
    row = lines[header + 2]
    assert row.count("|") == lines[header].count("|") and "12.50" in row and "estimated" in row
    assert any(line.startswith("| **total**") and "**12.50**" in line for line in lines)
    source = next(line for line in lines if line.startswith("- **cpu_estimate**"))  # below the table: it is long
    assert "Some \\| Vendor" in source  # a '|' in it cannot open a column


def test_one_sensor_gives_one_epoch_energy_card_several_give_one_each():
    row = {"train_J": 5.0, "power_W": 2.0, "train_s": 2.5, "edp_Js": 12.5, "between_steps_J": 0.5, "total_J": 7.0,
           "per_sensor_J": {"gpu0": 5.0}}
    assert not any(name.startswith("energy/sensor/") for name in epoch_metrics(row))
    row["per_sensor_J"] = {"gpu0": 4.0, "cpu": 1.0}
    assert {n for n in epoch_metrics(row) if n.startswith("energy/sensor/")} == {
        "energy/sensor/gpu0/epoch_J", "energy/sensor/cpu/epoch_J"}


def test_the_text_tab_shows_the_node_beside_its_components_and_the_rest_each_labelled():
    """Issue 28: a run with a node sensor (a BMC) shows node = components + other per host in the Text tab too."""
    from lightning_energy.outputs.report import build_report

    gpu = {"name": "gpu0", "rank": 0, "scope": "device", "energy_J": 300.0, "mean_power_W": 100.0, "estimated": False,
           "provenance": "measured", "source": "NVML", "failure": None, "missing_from_s": None}
    bmc = {"name": "node_redfish", "rank": 0, "scope": "node", "energy_J": 450.0, "mean_power_W": 150.0,
           "estimated": False, "provenance": "measured", "source": "Redfish", "covers_run": True, "bound_J": 3.0,
           "failure": None, "missing_from_s": None}
    summary = {"rank": 0, "local_rank": 0, "node": "n1", "duration_s": 3.0, "train_J": 250.0, "validation_J": 20.0,
               "sensors": [gpu], "node_sensors": [bmc], "node_epochs": {}}
    text = report_markdown(build_report([summary], [], {"sampling": {}, "notes": [], "sections": {}}))
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| node |"))
    row = lines[header + 2]
    assert row.startswith("| n1 |") and "450.00 (measured)" in row and "300.00 (measured)" in row
    assert "150.00 (measured)" in row and "node_redfish" in row
    assert any("fans, PSU losses" in line for line in lines[header:])
    assert "- **node_redfish** (node n1): Redfish" in lines  # its source listed with the others
    assert "| node |" not in report_markdown(report([gpu]))  # no node sensor: no node table
