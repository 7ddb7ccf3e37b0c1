"""The ``lightning-energy`` command's shared behaviour and the show-report command."""

import json

import pytest

from lightning_energy.cli.main import main


def test_show_report_prints_the_table(tmp_path, capsys):
    report = {
        "duration_s": 2.0, "total_J": 300.0, "total_kWh": 300 / 3.6e6, "epochs": [{}], "world_size": 1,
        "sensors": [{"name": "gpu0", "rank": 0, "scope": "device", "energy_J": 300.0, "mean_power_W": 150.0,
                     "estimated": False, "source": "NVML", "failure": None}],
        "mean_power_W": 150.0, "train_J": 250.0, "validation_J": 20.0, "other_J": 30.0, "estimated": False,
        "estimated_J": 0.0,
    }
    (tmp_path / "energy_report.json").write_text(json.dumps(report))
    assert main(["show-report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gpu0" in out and "300.00" in out and "150.00" in out


def test_show_report_errors_name_the_problem(tmp_path, capsys):
    assert main(["show-report", str(tmp_path)]) == 2
    assert "no energy_report.json" in capsys.readouterr().err
    (tmp_path / "energy_report.json").write_text("{not json")
    assert main(["show-report", str(tmp_path)]) == 2
    assert "not a lightning-energy report" in capsys.readouterr().err


def test_unknown_command_exits_non_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
