"""The configs ship inside the package: ``baler-lit fit --config cms_ae`` works from any folder and from a wheel,
``baler-lit configs`` lists them, and ``example:CMS_synthetic`` names the table cms_ae trains on. The whole flow by
shipped name from an empty folder (``fit --config cms_ae`` then ``compress --input example:CMS_synthetic`` ...) is
the README's baler-lit block, run as written by tests/test_readme.py."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from baler_lit import shipped_configs
from baler_lit.cli import main
from baler_lit.errors import BalerInputError

ROOT = Path(__file__).resolve().parents[1]
REPO_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


def test_the_shipped_configs_are_the_repository_s_configs_folder_not_a_copy():
    assert [n + ".yaml" for n in shipped_configs.shipped_names()] == REPO_CONFIGS
    for name in REPO_CONFIGS:
        assert (shipped_configs.CONFIG_DIR / name).samefile(ROOT / "configs" / name)


def test_pyproject_ships_the_config_folder_as_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "configs/*.yaml" in package_data["baler_lit"]


@pytest.mark.slow
def test_a_wheel_built_from_the_project_holds_every_config(tmp_path):
    """The build copies the files behind ``baler_lit/configs`` into the wheel (a copy of the project is built, so
    the working tree gets no build/ or egg-info)."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("lightning_energy", "baler_lit", "configs"):
        shutil.copytree(ROOT / folder, source / folder, symlinks=True, ignore=ignore)
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, source / file)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        folder = "baler_lit/configs/"
        shipped = sorted(n.removeprefix(folder) for n in zf.namelist() if n.startswith(folder))
        assert shipped == REPO_CONFIGS
        assert zf.read("baler_lit/configs/cms_ae.yaml") == (ROOT / "configs" / "cms_ae.yaml").read_bytes()


def test_a_shipped_name_resolves_to_its_file_and_everything_else_passes_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cms = str(shipped_configs.CONFIG_DIR / "cms_ae.yaml")
    resolve = shipped_configs.resolve_config_arguments
    assert resolve(["fit", "--config", "cms_ae", "-c", "energy_simulated.yaml", "--config=baler_parity"]) == [
        "fit", "--config", cms, "-c", str(shipped_configs.CONFIG_DIR / "energy_simulated.yaml"),
        "--config=" + str(shipped_configs.CONFIG_DIR / "baler_parity.yaml")]
    inline, other = "{trainer: {max_epochs: 1}}", "configs/cms_ae.yaml"
    assert resolve(["fit", "--config", inline, "--config", other, "--model.lr", "cms_ae"]) == [
        "fit", "--config", inline, "--config", other, "--model.lr", "cms_ae"]
    (tmp_path / "cms_ae").write_text("seed_everything: 1\n")  # a file of the user's wins over a shipped name
    assert resolve(["--config", "cms_ae"]) == ["--config", "cms_ae"]
    with pytest.raises(BalerInputError, match=r"--config cms_aee: no such file and no shipped config .*cms_ae"):
        resolve(["--config", "cms_aee"])


def test_baler_lit_configs_lists_each_config_with_its_first_comment_line(capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out.splitlines()
    for name in REPO_CONFIGS:
        first_line = (ROOT / "configs" / name).read_text(encoding="utf-8").splitlines()[0]
        assert first_line.startswith("# ") and len(first_line) <= 120, f"{name}: first line is not a description"
        (listed,) = [line for line in out if line.split()[:1] == [name.removesuffix(".yaml")]]
        assert listed.split(None, 1)[1] == first_line.removeprefix("# ")
    assert main(["configs", "cms_ae"]) == 0
    assert Path(capsys.readouterr().out.strip()).samefile(ROOT / "configs" / "cms_ae.yaml")


def test_an_unknown_name_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["configs", "nope"]) == 2
    assert main(["fit", "--config", "nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 2
    assert "no shipped config 'nope'" in captured.err and "--config nope: no such file" in captured.err


def test_example_cms_synthetic_is_the_table_the_cms_config_trains_on():
    from baler_lit.data import BalerDataModule
    from baler_lit.examples import GENERATED
    from baler_lit.row_source import open_rows
    from baler_lit.sources import load_table
    from baler_lit.synthetic import synthetic_cms_jets

    defaults = inspect.signature(BalerDataModule).parameters
    data = yaml.safe_load((ROOT / "configs" / "cms_ae.yaml").read_text())["data"]
    rows, seed = GENERATED["CMS_synthetic"]
    assert (rows, seed) == (defaults["synthetic_rows"].default, defaults["seed"].default)
    assert (rows, seed) == (data["synthetic_rows"], data["seed"]) and data["path"] is None
    table = load_table("example:CMS_synthetic")
    np.testing.assert_array_equal(table.data, synthetic_cms_jets(rows, seed).data)
    np.testing.assert_array_equal(open_rows("example:CMS_synthetic").to_table().data, table.data)


def test_print_config_of_a_shipped_name_from_another_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["baler-lit"])  # as the console script: only main's own argv
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "cms_ae", "--config", "energy_simulated", "--print_config"])
    assert done.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["compression_ratio"] == 1.6
    assert [c["class_path"] for c in config["trainer"]["callbacks"]][-1] == "lightning_energy.EnergyCallback"
