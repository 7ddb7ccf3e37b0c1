"""The core install works without any extra, and each feature that needs one says which, in one line.

An extra's packages are hidden the way a missing install looks to Python: ``sys.modules[name] = None`` for the
package and every submodule already loaded (in-process, restored by monkeypatch, or in a fresh interpreter).
Not timing tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_energy import extras
from lightning_energy.cli.main import main
from workbench_helpers import write_run

ROOT = Path(__file__).resolve().parents[1]
#: every package an extra installs, and the packages those pull in that the core must not need
OPTIONAL = ("codecarbon", "zeus", "matplotlib", "scipy", "uproot", "awkward", "jsonargparse", "fastapi",
            "uvicorn", "sqlalchemy", "aiosqlite", "pandas", "sklearn", "amdsmi")


def hide(monkeypatch, *packages: str) -> None:
    """Make ``packages`` (and their submodules already loaded) look uninstalled for this test."""
    for name in [n for n in list(sys.modules) if n.partition(".")[0] in packages] + list(packages):
        monkeypatch.setitem(sys.modules, name, None)


def one_line_naming(message: str, extra: str) -> bool:
    return "\n" not in message.strip() and f"pip install 'lightning-energy[{extra}]'" in message


def fresh_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**(os.environ if env is None else env),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=240)


BLOCKER = f"""
import importlib.metadata as metadata, sys
for name in {OPTIONAL!r}:  # as Python sees a package that is not installed: import fails, find_spec says None
    sys.modules[name] = None
installed_distribution = metadata.distribution
def distribution(name):  # ... and neither are their distributions (Lightning and torchmetrics ask for them)
    if name.lower().replace("-", "_") in {OPTIONAL!r} + ("scikit_learn",):
        raise metadata.PackageNotFoundError(name)
    return installed_distribution(name)
metadata.distribution = distribution
metadata.version = lambda name: distribution(name).version
"""


# ------------------------------------------------------------------------------ the core alone
def test_the_core_measures_without_any_extra_and_the_cpu_estimate_says_codecarbon_is_missing():
    done = fresh_python(BLOCKER + """
import json, tempfile
import lightning_energy
from lightning_energy import EnergyCallback, EnergyMeter, SimulatedSensor
from lightning_energy.callbacks import CarbonCallback
from lightning_energy.measure.sensors.cpu_model import CpuEstimateSensor

EnergyCallback()
CarbonCallback(intensity_g_per_kWh=300.0)
estimate = CpuEstimateSensor(cpu_model="Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz", threads=4)
with EnergyMeter(log_dir=tempfile.mkdtemp(), sensors=[SimulatedSensor("sim", 10.0)], verbose=False) as meter:
    meter.step()
print(json.dumps({"tdp_W": estimate.tdp_w, "source": estimate.source,
                  "loaded": sorted({m.partition(".")[0] for m, v in sys.modules.items() if v is not None} & set(%r))}))
""" % (OPTIONAL,))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["loaded"] == []
    assert result["tdp_W"] == 16.0  # 4 W per logical CPU: CodeCarbon's table would know this model (150 W)
    assert "4 logical CPUs x 4 W (CodeCarbon not installed" in result["source"]
    assert "pip install 'lightning-energy[carbon]'" in result["source"]


def test_the_cpu_estimate_falls_back_to_4_W_per_thread_and_says_why_in_its_report_entry(monkeypatch):
    from lightning_energy.measure.sensors import cpu_model

    hide(monkeypatch, "codecarbon")
    cpu_model._codecarbon_cpu.cache_clear()
    cpu_model._lookup_tdp_w.cache_clear()
    try:
        sensor = cpu_model.CpuEstimateSensor(cpu_model="Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz", threads=2)
        entry = sensor.describe()
    finally:
        cpu_model._codecarbon_cpu.cache_clear()
        cpu_model._lookup_tdp_w.cache_clear()
    assert sensor.tdp_w == 8.0 and sensor.estimated
    assert entry["tdp_source"].startswith("2 logical CPUs x 4 W (CodeCarbon not installed")
    assert "CodeCarbon not installed" in sensor.source and "ESTIMATE" in sensor.source


# ------------------------------------------------------------------------------ each extra's one line
def test_carbon_by_country_and_codecarbons_cross_check_name_the_carbon_extra(monkeypatch):
    from lightning_energy.callbacks import CarbonCallback

    hide(monkeypatch, "codecarbon")
    for kwargs in ({"country_iso_code": "FRA"}, {"country_iso_code": "USA", "region": "california"},
                   {"country_iso_code": "FRA", "codecarbon_crosscheck": True}):
        with pytest.raises(extras.MissingExtra) as caught:
            CarbonCallback(**kwargs)
        assert one_line_naming(str(caught.value), "carbon"), caught.value
        assert isinstance(caught.value, ImportError)
    assert CarbonCallback().intensity.kind == "world_average"  # what needs no data still works
    assert CarbonCallback(energy_mix={"hydro": 1.0}).intensity.kind == "mix"


def test_the_zeus_backend_and_power_limit_control_name_the_zeus_extra(monkeypatch):
    from lightning_energy.measure.sensors.zeus import ZeusBackend
    from lightning_energy.optimize.power_limit import gpu_control

    hide(monkeypatch, "zeus")
    for attempt in (lambda: ZeusBackend(None, with_cpu=True), lambda: gpu_control.open_nvml_gpu(0)):
        with pytest.raises(extras.MissingExtra) as caught:
            attempt()
        assert one_line_naming(str(caught.value), "zeus"), caught.value


def test_plots_name_the_analysis_extra(monkeypatch):
    from lightning_energy.analysis import plots

    hide(monkeypatch, "matplotlib")
    with pytest.raises(extras.MissingExtra) as caught:
        plots.fit_plot("batch_size", {"all": {"points": {"energy": ([32], [1.0], "J")}, "fits": {}}})
    assert one_line_naming(str(caught.value), "analysis"), caught.value


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    folder = write_run(tmp_path_factory.mktemp("run") / "run", {"gpu": 100.0}, duration_s=4.0, dt_s=0.5,
                       epochs=[(0.5, 2.0), (2.0, 3.5)], attributes={"batch_size": 32})
    return folder


@pytest.mark.parametrize("argv", [["report", "RUN"], ["compare", "RUN", "--out", "OUT"],
                                  ["fit", "RUN", "RUN", "RUN", "--by", "batch_size", "--out", "OUT"]],
                         ids=lambda argv: argv[0])
def test_a_command_whose_plots_need_matplotlib_refuses_in_one_line_before_printing(argv, run_dir, tmp_path,
                                                                                  monkeypatch, capsys):
    argv = [a.replace("RUN", str(run_dir)).replace("OUT", str(tmp_path / "out")) for a in argv]
    hide(monkeypatch, "matplotlib")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "out").exists()
    assert captured.err.startswith(f"lightning-energy {argv[0]}: error: ") and one_line_naming(captured.err, "analysis")
    assert "--no-plots" in captured.err
    if argv[0] == "report":
        assert main([*argv, "--no-plots"]) == 0  # the tables need no extra


def test_the_bso_server_names_its_extra(monkeypatch, capsys):
    hide(monkeypatch, "fastapi")
    assert main(["bso-server", "--check"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and one_line_naming(captured.err, "bso-server"), captured.err


def test_restoring_a_power_limit_names_the_zeus_extra_and_listing_needs_none(tmp_path, monkeypatch, capsys):
    from lightning_energy.optimize.power_limit import gpu_control

    marker = {"format": gpu_control.MARKER_FORMAT, "nvml_index": 0, "uuid": "GPU-x", "limit_mW": 250000,
              "persistence_mode": False, "pid": 1, "host": "elsewhere", "owner": "a killed run", "gpu_name": "g"}
    tmp_path.joinpath("power-limit-0.json").write_text(json.dumps(marker))
    hide(monkeypatch, "zeus")
    assert main(["restore-power-limit", "--state-dir", str(tmp_path), "--list"]) == 0
    capsys.readouterr()
    assert main(["restore-power-limit", "--state-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and one_line_naming(captured.err, "zeus"), captured


def test_a_sweep_on_a_simulated_gpu_names_the_zeus_extra(tmp_path):
    """In a fresh interpreter: modules imported by earlier tests (the sweep's, the simulator's) would otherwise
    keep the zeus they found."""
    config = tmp_path / "sweep.yaml"
    config.write_text((ROOT / "configs" / "sweep_tiny.yaml").read_text())
    code = ("import sys; sys.modules['zeus'] = None\n"
            "from lightning_energy.cli.main import main\n"
            f"sys.exit(main(['sweep', '--config', {str(config)!r}, '--dry-run']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 2 and run.stdout == "" and one_line_naming(run.stderr, "zeus"), run.stderr


def test_require_imports_what_is_there_and_names_the_extra_of_what_is_not(monkeypatch):
    assert extras.require("json", "a test", extra="carbon") is json
    hide(monkeypatch, "scipy")
    with pytest.raises(extras.MissingExtra, match=r"^PrecisionSwitch needs scipy, which is not installed: "
                                                  r"pip install 'lightning-energy\[analysis\]'$"):
        extras.require("scipy.stats", "PrecisionSwitch")
    assert extras.missing_extra_of(ModuleNotFoundError("x", name="uproot.reading"), "f").extra == "baler"
    assert extras.missing_extra_of(ModuleNotFoundError("x", name="mymodel"), "f") is None
    with pytest.raises(ValueError, match="not an optional package"):
        extras.check_installed("not_a_package_anywhere", "f")


# ------------------------------------------------------------------------------ item 4: no false AMD warning
AMDSMI_WITHOUT_ROCM = """
import importlib.abc, importlib.machinery, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)  # any logger's record reaches stderr
class AmdsmiWithoutRocm(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # amdsmi installed, ROCm absent: the import prints and fails as the real one does
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "amdsmi" else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        print("Unable to find libamd_smi.so library try installing amd-smi-lib from your package manager")
        raise KeyError("libamd_smi.so")
sys.meta_path.insert(0, AmdsmiWithoutRocm())
"""


def test_no_warning_about_an_amd_gpu_on_a_machine_without_one():
    pytest.importorskip("codecarbon")
    pytest.importorskip("zeus")
    env = {k: v for k, v in os.environ.items() if k.upper() != "CODECARBON_LOG_LEVEL"}
    done = fresh_python(AMDSMI_WITHOUT_ROCM + """
from lightning_energy.measure.sensors.cpu_model import CpuEstimateSensor, logical_cpus
from lightning_energy.measure.sensors.zeus import _import_zeus_monitor

sensor = CpuEstimateSensor()
logical_cpus()
_import_zeus_monitor()
import logging
print("codecarbon logger level", logging.getLevelName(logging.getLogger("codecarbon").level))
print("ok", sensor.tdp_w > 0)
""", env=env)
    assert done.returncode == 0, done.stderr
    about_amd = [line for line in (done.stdout + done.stderr).splitlines()
                 if "AMD GPU" in line or "amdsmi" in line.lower() or "libamd_smi" in line]
    assert about_amd == []
    assert "ok True" in done.stdout
    assert "codecarbon logger level INFO" in done.stdout  # CodeCarbon's own level left as it set it


def test_recommend_names_the_cli_extra_before_printing_and_its_dry_run_needs_none(tmp_path, monkeypatch, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  max_epochs: 1\n  accelerator: cpu\nmodel:\n  class_path: lightning_energy.simulate."
                      "example_model.TinyAutoencoder\n")
    argv = ["recommend", "--config", str(config), "--target", "val_loss=0.1", "--out", str(tmp_path / "out")]
    hide(monkeypatch, "jsonargparse")
    assert main([*argv, "--dry-run"]) == 0
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and one_line_naming(captured.err, "cli"), captured
