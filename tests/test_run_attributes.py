"""`--by` reads what users have: LightningCLI's config.yaml, hparams.yaml with python tags; compare's groups."""

from __future__ import annotations

import json

import pytest

from lightning_energy.analysis.compare import compare_runs
from lightning_energy.analysis.runs import RunError, attribute, load_run, read_yaml_mapping
from lightning_energy.cli.main import main
from workbench_helpers import write_run

LIGHTNING_HPARAMS = """_instantiator: lightning.pytorch.cli.instantiate_module
compression_ratio: 1.6
input_shape: !!python/tuple
- 24
lr: 0.001
model: AE
"""

CLI_CONFIG = """seed_everything: 0
trainer:
  max_epochs: {epochs}
  callbacks:
  - class_path: lightning_energy.EnergyCallback
model:
  lr: 0.001
data:
  path: null
  batch_size: {batch}
  seed: 0
"""


def test_hparams_with_a_python_tuple_keep_every_hparam(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 1.0}, duration_s=1.0)
    (folder / "hparams.yaml").write_text(LIGHTNING_HPARAMS)
    run = load_run(folder)
    assert attribute(run, "lr") == 0.001 and attribute(run, "model") == "AE"
    assert attribute(run, "compression_ratio") == 1.6
    assert read_yaml_mapping(folder / "hparams.yaml")["input_shape"] == [24]  # a tuple read as a list


def test_python_tags_are_never_executed(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 1.0}, duration_s=1.0)
    marker = tmp_path / "executed"
    (folder / "hparams.yaml").write_text(
        f"lr: 0.01\nhook: !!python/object/apply:os.system [\"touch {marker}\"]\n"
        "cls: !!python/name:os.system ''\nother: !custom {a: 1}\n")
    run = load_run(folder)
    assert not marker.exists()
    assert attribute(run, "lr") == 0.01
    assert {"hook", "cls", "other"}.isdisjoint(run.attributes)  # unknown tags: left out, not guessed


def test_lightning_cli_config_gives_nested_and_short_names(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 1.0}, duration_s=1.0)
    (folder / "config.yaml").write_text(CLI_CONFIG.format(epochs=3, batch=256))
    run = load_run(folder)
    assert attribute(run, "data.batch_size") == 256 and attribute(run, "batch_size") == 256
    assert attribute(run, "trainer.max_epochs") == 3 and attribute(run, "max_epochs") == 3
    assert attribute(run, "model.lr") == 0.001
    assert "seed" in run.attributes  # data.seed, unambiguous


def test_an_ambiguous_short_name_is_left_out_and_the_error_names_the_full_ones(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 1.0}, duration_s=1.0)
    (folder / "config.yaml").write_text("model:\n  seed: 1\ndata:\n  seed: 2\n  batch_size: 8\n")
    run = load_run(folder)
    assert "seed" not in run.attributes and attribute(run, "batch_size") == 8
    with pytest.raises(RunError, match=r"no attribute 'seed' \(it has: .*data.seed.*model.seed.*config.yaml"):
        attribute(run, "seed")


def test_hparams_override_the_cli_config_and_run_attributes_override_both(tmp_path):
    folder = write_run(tmp_path / "run", {"gpu": 1.0}, duration_s=1.0)
    (folder / "config.yaml").write_text("model:\n  lr: 0.1\n")
    (folder / "hparams.yaml").write_text("lr: 0.2\n")
    assert attribute(load_run(folder), "lr") == 0.2
    (folder / "run_attributes.json").write_text(json.dumps({"lr": 0.3}))
    assert attribute(load_run(folder), "lr") == 0.3


def test_fit_by_batch_size_on_runs_that_have_it_only_in_the_cli_config(tmp_path, capsys):
    dirs = []
    for batch, watts in ((64, 100.0), (128, 80.0), (256, 70.0)):
        folder = write_run(tmp_path / f"bs{batch}", {"gpu": watts}, duration_s=1.0)
        (folder / "config.yaml").write_text(CLI_CONFIG.format(epochs=2, batch=batch))
        (folder / "hparams.yaml").write_text(LIGHTNING_HPARAMS)
        dirs.append(str(folder))
    code = main(["fit", *dirs, "--by", "batch_size", "--no-plots", "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    document = json.loads((tmp_path / "out" / "fit.json").read_text())
    assert [r["batch_size"] for r in document["runs"]] == [64, 128, 256]
    assert [r["energy"] for r in document["runs"]] == pytest.approx([100.0, 80.0, 70.0])


def test_compare_without_by_keeps_unrelated_runs_apart(tmp_path):
    runs = [load_run(write_run(tmp_path / name, {"gpu": watts}, duration_s=1.0)) for name, watts in
            (("small", 10.0), ("large", 300.0))]
    result = compare_runs(runs)
    assert set(result["groups"]) == {"small", "large"}
    assert result["groups"]["small"]["energy_J_mean"] == pytest.approx(10.0)
    assert result["groups"]["large"]["energy_J_mean"] == pytest.approx(300.0)
    assert all(g["runs"] == 1 for g in result["groups"].values())
