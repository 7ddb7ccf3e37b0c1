"""A Baler user's project moves over: ``new-project``, ``convert-config`` (parsed, never run), the percent/fraction
rule of ``--max-relative-error``, the field table in docs/baler_fields.md, and Baler's own example workflow
(newProject → train → compress → decompress → plot) run with baler-lit from a converted config."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from baler_conftest_helpers import REPO, one_thread  # noqa: F401 (fixture)

from baler_lit.cli import main, relative_error
from baler_lit.convert_config import BALER_FIELDS, convert, read_baler_config
from baler_lit.errors import BalerInputError
from baler_lit.project import TEMPLATE_FIELDS, template

pytestmark = pytest.mark.usefixtures("one_thread")

#: Baler's CFD example config (workspaces/CFD_workspace/CFD_project_animation), as the original ships it.
CFD_ANIMATION = '''def set_config(c):
    c.input_path = "workspaces/CFD_workspace/data/CFD_animation.npz"
    c.compression_ratio = 100
    # c.number_of_columns = 24
    c.epochs = 200
    c.early_stopping = False
    c.early_stopping_patience = 100
    c.min_delta = 0
    c.lr_scheduler = False
    c.lr_scheduler_patience = 50
    c.model_name = "CFD_dense_AE"
    c.model_type = "dense"
    c.custom_norm = True
    c.l1 = True
    c.reg_param = 0.001
    c.RHO = 0.05
    c.lr = 0.001
    c.batch_size = 6000
    c.test_size = 0
    c.data_dimension = 2
    c.apply_normalization = False
    c.extra_compression = False
    c.intermittent_model_saving = False
    c.intermittent_saving_patience = 100
    c.activation_extraction = False
    c.deterministic_algorithm = False
    c.compress_to_latent_space = False
    c.save_error_bounded_deltas = True
    c.error_bounded_requirement = 10
    c.convert_to_blocks = False
    c.separate_model_saving = False
'''


def _baler_layout(tmp_path: Path, text: str, project: str = "P") -> Path:
    config = tmp_path / "workspaces" / "W" / project / "config" / f"{project}_config.py"
    config.parent.mkdir(parents=True)
    config.write_text(text)
    return config


def test_a_baler_config_is_parsed_never_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    hostile = f"import os\nos.system('touch {marker}')\n\ndef set_config(c):\n    c.input_path = 'd.npz'\n"
    fields, lines = read_baler_config(_baler_layout(tmp_path, hostile))
    assert fields == {"input_path": "d.npz"} and lines == {"input_path": 5} and not marker.exists()
    calls = "def set_config(c):\n    c.epochs = __import__('os').system('touch ran')\n"
    with pytest.raises(BalerInputError, match="line 2: epochs is not a literal"):
        read_baler_config(_baler_layout(tmp_path, calls, "Q"))
    code = "def set_config(c):\n    import os\n    c.epochs = 3\n"
    with pytest.raises(BalerInputError, match=r"line 2: only `c.field = value` assignments are read"):
        read_baler_config(_baler_layout(tmp_path, code, "R"))
    with pytest.raises(BalerInputError, match="defines no set_config"):
        read_baler_config(_baler_layout(tmp_path, "x = 1\n", "S"))
    deep = "def set_config(c):\n    c.type_list = " + "[" * 40 + "]" * 40 + "\n"
    with pytest.raises(BalerInputError, match="nested deeper"):
        read_baler_config(_baler_layout(tmp_path, deep, "T"))
    assert not marker.exists()


def test_baler_s_cfd_example_converts_field_by_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    converted = convert(_baler_layout(tmp_path, CFD_ANIMATION, "CFD_project_animation"))
    cfg = converted.config
    assert cfg["data"]["path"] == "workspaces/CFD_workspace/data/CFD_animation.npz"
    assert cfg["data"]["apply_normalization"] is False  # raw values, as the original trains them
    assert cfg["model"] == {"model": "CFD_dense_AE", "compression_ratio": 100.0, "dtype": "float32", "lr": 0.001,
                            "early_stopping_patience": None, "early_stopping_min_delta": 0.0, "lr_patience": None,
                            "loss": "sum", "reg_param": 0.0, "rho": None}  # fmt: skip
    assert cfg["trainer"]["max_epochs"] == 200 and cfg["data"]["batch_size"] == 6000
    assert cfg["data"]["val_fraction"] == 0.0 and cfg["data"]["shuffle"] is False
    compress = next(c for c in converted.commands if c.startswith("baler-lit compress"))
    assert compress.endswith("--max-relative-error 10%")  # Baler's percent, written so our parser reads it right
    assert relative_error("10%") == pytest.approx(0.1)
    assert not converted.unknown
    text = converted.to_yaml("cfd.yaml")
    assert yaml.safe_load(text) == cfg and "error_bounded_requirement 10 (percent)" in text


def test_blocks_hls4ml_and_unknown_fields_become_commands_and_notes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = ("def set_config(c):\n    c.input_path = 'workspaces/W/data/x.npz'\n    c.convert_to_blocks = [1, 10, 25]\n"
            "    c.model_name = 'FPGA_prototype_model'\n    c.Part = 'xcvu9p-flga2104-2L-e'\n    c.synth = True\n"
            "    c.default_precision = 'ap_fixed<16,8>'\n    c.extra_compression = True\n    c.my_own_field = 3\n")  # fmt: skip
    converted = convert(_baler_layout(tmp_path, text))
    assert converted.commands[0].startswith("(first) baler-lit blocks --input workspaces/W/data/x.npz --shape 10 25")
    assert converted.config["data"]["path"] == "workspaces/W/data/x_blocks_10x25.npz"
    assert any(c.endswith("--extra-compression") for c in converted.commands)
    hls = next(c for c in converted.commands if "convert-with-hls4ml" in c)
    assert "--fpga-part xcvu9p-flga2104-2L-e" in hls and "'ap_fixed<16,8>'" in hls and hls.endswith("--build synth")
    assert converted.unknown == ["my_own_field"]
    with pytest.raises(BalerInputError, match="not a Baler model"):
        convert(_baler_layout(tmp_path, "def set_config(c):\n    c.input_path = 'a'\n    c.model_name = 'Nope'\n", "Q"))


@pytest.mark.parametrize(("text", "value"), [("0.1", 0.1), ("10%", 0.1), ("1", 1.0), ("2.5 %", 0.025), ("0", 0.0)])
def test_max_relative_error_takes_a_fraction_or_a_percentage(text, value):
    assert relative_error(text) == pytest.approx(value)


@pytest.mark.parametrize("command", ["compress", "compress-many"])
def test_a_bare_number_above_one_is_refused_with_the_fix(command, tmp_path, capsys):
    args = ["--ckpt", "x.ckpt", "--output" if command == "compress" else "--output-dir", str(tmp_path / "o"),
            "--max-relative-error", "10"]  # fmt: skip
    args += ["--input", "x.npz"] if command == "compress" else ["--inputs", "x.npz"]
    with pytest.raises(SystemExit) as exc:
        main([command, *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "1000 % bound" in err and "write 10% or 0.1" in err and not (tmp_path / "o").exists()


def test_every_baler_field_is_in_the_docs_table():
    table = (REPO / "docs" / "baler_fields.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")}
    assert set(BALER_FIELDS) <= rows, sorted(set(BALER_FIELDS) - rows)
    assert {name for name, _ in TEMPLATE_FIELDS} <= set(BALER_FIELDS)


def test_new_project_makes_baler_s_layout_and_leaves_an_existing_one_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["new-project", "W", "P"]) == 0
    root = Path("workspaces")
    for folder in ("W/data", "W/P/config", *(f"W/P/output/{f}" for f in
                   ("training", "compressed_output", "decompressed_output", "plotting"))):  # fmt: skip
        assert (root / folder).is_dir(), folder
    assert (root / "W/P/config/P_config.py").read_text() == template("W", "P")
    fields, _ = read_baler_config(root / "W/P/config/P_config.py")
    assert fields["input_path"] == "workspaces/W/data/P_data.npz" and fields["epochs"] == 5
    assert yaml.safe_load((root / "W/P/config/P_config.yaml").read_text())["model"]["model"] == "AE"
    capsys.readouterr()
    assert main(["new-project", "W", "P"]) == 0
    assert "already exist" in capsys.readouterr().out
    assert main(["new-project", "W", "../x"]) == 2


def test_baler_s_example_workflow_runs_with_baler_lit_from_a_converted_config(tmp_path, monkeypatch, capsys):
    """newProject → train → compress → decompress → plot, as in Baler's README, from the project's converted
    config (its Baler template with epochs set to 2, converted again)."""
    from baler_lit.synthetic import synthetic_cms_jets
    from baler_lit.table import save_npz

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["baler-lit"])
    assert main(["new-project", "W", "P"]) == 0
    project = Path("workspaces/W/P")
    baler_config, config, out = project / "config/P_config.py", project / "config/P_config.yaml", project / "output"
    save_npz("workspaces/W/data/P_data.npz", synthetic_cms_jets(400, seed=2))
    baler_config.write_text(baler_config.read_text().replace("= 5\n", "= 2\n").replace("= 512\n", "= 128\n"))
    assert main(["convert-config", str(baler_config), "--output", str(config), "--overwrite"]) == 0
    assert main(["fit", "--config", str(config), "--trainer.enable_progress_bar", "false",
                 "--trainer.enable_model_summary", "false"]) == 0  # fmt: skip
    ckpt = out / "training" / "model.ckpt"
    assert ckpt.is_file()
    baler = out / "compressed_output" / "compressed.baler"
    restored = out / "decompressed_output" / "decompressed.npz"
    assert main(["compress", "--ckpt", str(ckpt), "--input", "workspaces/W/data/P_data.npz", "--output", str(baler),
                 "--max-relative-error", "10%", "--extra-compression"]) == 0  # fmt: skip
    assert main(["decompress", "--input", str(baler), "--output", str(restored)]) == 0
    assert main(["evaluate", "--original", "workspaces/W/data/P_data.npz", "--restored", str(restored),
                 "--out", str(out / "plotting"), "--overwrite", "--no-plots"]) == 0  # figures: test_baler_cli
    assert (out / "plotting" / "summary.json").is_file()
    original = np.load("workspaces/W/data/P_data.npz")["data"].astype(float)
    back = np.load(restored)["data"].astype(float)
    assert (np.abs(back - original) <= 0.1 * np.abs(original) * (1 + 1e-6) + 1e-9).all()
    assert "earth mover's distance" in capsys.readouterr().out
