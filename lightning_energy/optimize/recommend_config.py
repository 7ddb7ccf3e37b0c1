"""The configs of ``lightning-energy recommend``: each run's LightningCLI YAML, the run in its own process,
and the recommended YAML.

A run is ``python -m CLI fit --config <run dir>/recommend_run.yaml`` in a fresh process (clean
measurements: no warm caches, compiled kernels or allocator state carried from one configuration to the
next; a crash or a hang ends one run, not the search). ``CLI`` is the user's LightningCLI module
(``baler_lit.cli`` for Baler's configs), or by default this module's plain LightningCLI for configs that
name their model with ``class_path``. lightning_energy never imports the user's classes: the config names
them and the CLI builds them.

The run's YAML is the user's config (several ``--config`` files merged as LightningCLI does: mappings
merged key by key, lists replaced, ``key+:`` appended) with the levers' values set, the run's own
``trainer.default_root_dir``, and callbacks: the user's, an ``EnergyCallback`` when they have none (theirs
is kept, with its sensors), ``EnergyToAccuracy`` (stop at the target, give up past the energy budget),
``CatalogCallback`` (the run in the recommendation's catalog, with its lever settings as attributes) and
``CompileModel`` when that lever is on. The outcome is read back from the catalog record.

The held-out check (:func:`~lightning_energy.optimize.recommend.heldout_check`) runs through
:class:`HeldOutConfigRunner`: a ``fit`` with a fresh ``seed_everything`` (:func:`heldout_fit_config`: the run's
config plus :class:`~lightning_energy.callbacks.fit_probe.FitProbe`, which keeps the training process's CPU
time and the final weights), then ``CLI test`` of those weights on the test split (:func:`heldout_test_config`:
the config with the caller's test overlay, e.g. ``data.path`` of the file :func:`write_holdout_npz` wrote, and
:class:`~lightning_energy.callbacks.test_metrics.TestMetrics`, which keeps the test metrics). The search's runs
never get that overlay.

Run as a module, this file is that plain LightningCLI: ``python -m lightning_energy.optimize.recommend_config fit
--config cfg.yaml``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_energy.filenames import REPORT_FILE
from lightning_energy.optimize.recommend import HeldOutRun, Lever, RunOutcome, Target, co2_g, eval_batch_path

DEFAULT_CLI = "lightning_energy.optimize.recommend_config"
RUN_CONFIG_FILE = "recommend_run.yaml"
RUN_LOG_FILE = "output.log"
RUN_ATTRIBUTE = "recommend_run"  # run attribute naming the run in the catalog
# the recommender sets these itself
OWNED_CALLBACKS = ("EnergyToAccuracy", "CatalogCallback", "CompileModel", "FitProbe", "TestMetrics")
ENERGY_CALLBACK = "lightning_energy.EnergyCallback"


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the problem."""


def load_configs(paths: list[Path]) -> dict:
    """The config files merged in order (later ones override; ``key+:`` appends to a list)."""
    from lightning_energy.io import read_yaml_config

    merged: dict = {}
    for path in paths:
        raw = read_yaml_config(path, "config", ConfigError)
        if raw is None:
            continue
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a LightningCLI config is a mapping (trainer:, model:, data:)")
        merge(merged, raw)
    return merged


def merge(into: dict, overlay: dict) -> dict:
    """Merge ``overlay`` into ``into`` as LightningCLI merges config files."""
    for key, value in overlay.items():
        if isinstance(key, str) and key.endswith("+"):
            name = key[:-1]
            before = into.get(name)
            before = [] if before is None else before if isinstance(before, list) else [before]
            into[name] = before + copy.deepcopy(value if isinstance(value, list) else [value])
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


def set_path(config: dict, dotted: str, value: Any) -> None:
    node = config
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _class_name(callback: Any) -> str:
    path = callback.get("class_path", "") if isinstance(callback, dict) else ""
    return path.rpartition(".")[2]


def _callbacks(trainer: dict) -> list:
    callbacks = trainer.get("callbacks") or []
    return list(callbacks) if isinstance(callbacks, list) else [callbacks]


def get_path(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _apply(base: dict, levers: dict[str, Lever], settings: dict[str, Any]) -> dict:
    """A copy of ``base`` with the settings' config keys set, and the evaluation batch size (where the config has
    the key and leaves it null) kept at the baseline's batch size whatever the batch lever sets."""
    config = copy.deepcopy(base)
    for name, value in settings.items():
        if levers[name].path is not None:
            set_path(config, levers[name].path, value)
    batch = levers.get("batch_size")
    if batch is not None and batch.path is not None:
        eval_path = eval_batch_path(base, batch.path)
        if eval_path is not None and get_path(base, eval_path) is None:
            set_path(config, eval_path, batch.baseline)
    return config


def has_compile(config: dict) -> bool:
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    return any(_class_name(c) == "CompileModel" for c in _callbacks(trainer))


def with_levers(base: dict, levers: dict[str, Lever], settings: dict[str, Any], target: Target,
                budget_J: float | None = None) -> dict:
    """The config with ``settings`` applied and the target's callbacks in place (user callbacks kept)."""
    config = _apply(base, levers, settings)
    trainer = config.setdefault("trainer", {})
    callbacks = [c for c in _callbacks(trainer) if _class_name(c) not in OWNED_CALLBACKS]
    if not any(_class_name(c) == "EnergyCallback" for c in callbacks):
        callbacks.insert(0, {"class_path": ENERGY_CALLBACK})
    eta_args = {"monitor": target.monitor, "target": target.value, "mode": target.mode, "stop": True}
    if budget_J is not None:
        eta_args["budget_J"] = float(budget_J)
    callbacks.append({"class_path": "lightning_energy.EnergyToAccuracy", "init_args": eta_args})
    if settings.get("compile") or (has_compile(base) and "compile" not in levers):
        callbacks.append({"class_path": "lightning_energy.CompileModel"})
    trainer["callbacks"] = callbacks
    return config


def run_config(base: dict, levers: dict[str, Lever], settings: dict[str, Any], target: Target,
               budget_J: float | None, run_dir: Path, catalog_path: Path, name: str) -> dict:
    """One search run's config: :func:`with_levers`, its own root dir, recorded in the catalog as ``name``."""
    config = with_levers(base, levers, settings, target, budget_J)
    trainer = config["trainer"]
    trainer["default_root_dir"] = str(run_dir)
    attributes = {RUN_ATTRIBUTE: name, "recommend_config": _describe(settings), **{
        lever: settings.get(lever, levers[lever].baseline) for lever in levers}}
    trainer["callbacks"].append({"class_path": "lightning_energy.CatalogCallback",
                                 "init_args": {"catalog_path": str(catalog_path), "config": attributes}})
    return config


def _describe(settings: dict[str, Any]) -> str:
    from lightning_energy.optimize.recommend import describe

    return describe(settings)


def recommended_yaml(base: dict, levers: dict[str, Lever], settings: dict[str, Any], target: Target,
                     header: list[str]) -> str:
    """The recommended config as YAML the user runs as it is (``CLI fit --config recommended.yaml``)."""
    import yaml

    config = with_levers(base, levers, settings, target)
    comments = "".join(f"# {line}\n" for line in header)
    return comments + yaml.safe_dump(_plain(config), sort_keys=False, default_flow_style=False)


def _plain(value: Any) -> Any:
    """YAML-safe values (tuples as lists)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class ConfigRunner:
    """Runs one configuration of the search as ``python -m CLI fit`` in its own process.

    Args:
        base: the merged user config.
        levers: the search's levers by name.
        target: what the runs must reach.
        out_dir: the recommendation's folder: ``runs/<name>/`` per run, ``energy_catalog.sqlite``.
        cli: the module run with ``python -m`` (its ``fit`` sub-command takes ``--config``).
        timeout_s: a run still going after this long is killed and counted as failed.
        power_limits: applies ``power_limit_W`` settings (``lightning_energy.sweep.runner.GpuPowerLimits``), or None.
    """

    def __init__(self, base: dict, levers: dict[str, Lever], target: Target, out_dir: Path,
                 cli: str = DEFAULT_CLI, timeout_s: float | None = None, power_limits=None) -> None:
        from lightning_energy.catalog import CATALOG_FILE

        self.base, self.levers, self.target, self.out_dir = base, levers, target, Path(out_dir)
        self.cli, self.timeout_s, self.power_limits = cli, timeout_s, power_limits
        self.catalog_path = self.out_dir / CATALOG_FILE

    def __call__(self, settings: dict[str, Any], name: str, budget_J: float | None) -> RunOutcome:
        import yaml

        from lightning_energy.io import atomic_write_text

        run_dir = self.out_dir / "runs" / name
        run_dir.mkdir(parents=True, exist_ok=False)
        config = run_config(self.base, self.levers, settings, self.target, budget_J, run_dir, self.catalog_path,
                            name)
        path = atomic_write_text(run_dir / RUN_CONFIG_FILE, yaml.safe_dump(_plain(config), sort_keys=False))
        command = [sys.executable, "-m", self.cli, "fit", "--config", str(path)]
        limit = settings.get("power_limit_W")
        applied = self.power_limits.applied(limit) if self.power_limits is not None else contextlib.nullcontext()
        with open(run_dir / RUN_LOG_FILE, "wb") as log, applied:
            try:
                code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                      timeout=self.timeout_s).returncode
            except subprocess.TimeoutExpired:
                return RunOutcome.failed(f"still running after {self.timeout_s:g} s, killed", str(run_dir))
        record = self._record(name)
        if record is None:
            return RunOutcome.failed(f"exit code {code}, no catalog record: {_last_line(run_dir / RUN_LOG_FILE)}",
                                     str(run_dir))
        failed = sensor_failures(Path(record.get("run_dir") or run_dir))
        if failed:  # a sensor that stopped answering leaves energy out: no figure to rank the run by
            return RunOutcome.failed(f"sensor {failed}", str(run_dir))
        return outcome_of(record, str(run_dir))

    def _record(self, name: str) -> dict | None:
        from lightning_energy.catalog import Catalog, CatalogError

        if not self.catalog_path.is_file():
            return None
        try:
            fits = Catalog(self.catalog_path).list()
        except CatalogError:
            return None
        matches = [f for f in fits if (f.get("config") or {}).get("run", {}).get(RUN_ATTRIBUTE) == name]
        return matches[-1] if matches else None


# ---------------------------------------------------------------- the held-out check
PROBE_FILE = "fit_probe.json"
WEIGHTS_FILE = "final.ckpt"
TEST_CONFIG_FILE = "heldout_test.yaml"
TEST_METRICS_FILE = "test_metrics.json"
MAX_METRICS_BYTES = 1 << 20  # a test-metrics file larger than this is not ours


def heldout_fit_config(base: dict, levers: dict[str, Lever], settings: dict[str, Any], target: Target,
                       run_dir: Path, catalog_path: Path, name: str, seed: int, stop_at_target: bool) -> dict:
    """A held-out run's fit: :func:`run_config` (no budget) with ``seed_everything: seed``, EnergyToAccuracy
    stopping at the target only when ``stop_at_target``, and
    :class:`~lightning_energy.callbacks.fit_probe.FitProbe` last."""
    config = run_config(base, levers, settings, target, None, run_dir, catalog_path, name)
    config["seed_everything"] = int(seed)
    for callback in config["trainer"]["callbacks"]:
        if _class_name(callback) == "EnergyToAccuracy":
            callback["init_args"]["stop"] = bool(stop_at_target)
    config["trainer"]["callbacks"].append({
        "class_path": "lightning_energy.callbacks.fit_probe.FitProbe",
        "init_args": {"probe_path": str(run_dir / PROBE_FILE), "weights_path": str(run_dir / WEIGHTS_FILE)}})
    return config


def heldout_test_config(base: dict, levers: dict[str, Lever], settings: dict[str, Any], test_overlay: dict,
                        run_dir: Path) -> dict:
    """``CLI test`` of a held-out run's weights on the test split: the configuration's keys, then
    ``test_overlay`` merged (where the test rows are, e.g. ``{"data": {"path": "test.npz"}}``), no logger and
    :class:`~lightning_energy.callbacks.test_metrics.TestMetrics` as the only callback."""
    config = merge(_apply(base, levers, settings), copy.deepcopy(test_overlay))
    trainer = config.setdefault("trainer", {})
    trainer.update({"logger": False, "default_root_dir": str(run_dir / "test"), "enable_progress_bar": False,
                    "callbacks": [{"class_path": "lightning_energy.callbacks.test_metrics.TestMetrics",
                                   "init_args": {"path": str(run_dir / "test" / TEST_METRICS_FILE)}}]})
    return config


DATA_PATH_KEYS = ("path", "data_path", "file", "data_file")  # where a datamodule's config names its data file


def heldout_overlay(config: dict, test_file: Path) -> dict:
    """The test runs' overlay that points the config's data file (``data.path``, or ``data_path``, ``file``,
    ``data_file``, under ``data`` or ``data.init_args``) at ``test_file``.

    ConfigError when the config names no data file, or names ``test_file`` itself (the search would then
    read the test rows: no held-out check)."""
    from lightning_energy.optimize.recommend import config_key

    found = config_key(config, "data", DATA_PATH_KEYS)
    if found is None:
        raise ConfigError(f"--test-data: the config names no data file ({' / '.join(DATA_PATH_KEYS)} under data) "
                          "to point the test runs at")
    dotted, search_file = found
    if search_file is not None and _same_file(Path(str(search_file)), test_file):
        raise ConfigError(f"--test-data {test_file} is the file the search trains on ({dotted}): give rows the "
                          "search never reads")
    overlay: dict = {}
    node = overlay
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = str(test_file)
    return overlay


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _read_json(path: Path) -> dict | None:
    try:
        if path.stat().st_size > MAX_METRICS_BYTES:
            return None
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class HeldOutConfigRunner(ConfigRunner):
    """Runs a held-out check's run: ``CLI fit`` (:func:`heldout_fit_config`), then ``CLI test`` of its final
    weights on the test split (:func:`heldout_test_config`), each in its own process.

    Args:
        test_overlay: merged into the config of the test runs only (where the test rows are).
        test_metric: the test run's metric compared (Baler: ``test/loss``).
        defaults_max_epochs: ``trainer.max_epochs`` of the runs that do not stop at the target (the defaults: the
            user's own, where the search's runs were given more with ``--max-epochs``); None: ``base``'s.
        (the others: :class:`ConfigRunner`'s)
    """

    def __init__(self, base: dict, levers: dict[str, Lever], target: Target, out_dir: Path, test_overlay: dict,
                 cli: str = DEFAULT_CLI, test_metric: str = "test/loss", timeout_s: float | None = None,
                 defaults_max_epochs: int | None = None) -> None:
        super().__init__(base, levers, target, out_dir, cli, timeout_s)
        self.test_overlay, self.test_metric = test_overlay, test_metric
        self.defaults_max_epochs = defaults_max_epochs

    def _process(self, command: str, config: dict, run_dir: Path, config_file: str, log_file: str,
                 extra: list[str]) -> tuple[int | None, str]:
        import yaml

        from lightning_energy.io import atomic_write_text

        path = atomic_write_text(run_dir / config_file, yaml.safe_dump(_plain(config), sort_keys=False))
        with open(run_dir / log_file, "wb") as log:
            try:
                code = subprocess.run([sys.executable, "-m", self.cli, command, "--config", str(path), *extra],
                                      stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                      timeout=self.timeout_s).returncode
            except subprocess.TimeoutExpired:
                return None, f"{command} still running after {self.timeout_s:g} s, killed"
        return code, _last_line(run_dir / log_file)

    def __call__(self, settings: dict[str, Any], name: str, seed: int, stop_at_target: bool) -> HeldOutRun:
        run_dir = self.out_dir / "runs" / name
        run_dir.mkdir(parents=True, exist_ok=False)
        config = heldout_fit_config(self.base, self.levers, settings, self.target, run_dir, self.catalog_path,
                                    name, seed, stop_at_target)
        if not stop_at_target and self.defaults_max_epochs is not None:
            config["trainer"]["max_epochs"] = int(self.defaults_max_epochs)
        code, last = self._process("fit", config, run_dir, RUN_CONFIG_FILE, RUN_LOG_FILE, [])
        load = os.getloadavg()[0]
        record, probe = self._record(name), _read_json(run_dir / PROBE_FILE)
        failed = HeldOutRun("", seed, math.nan, math.nan, math.nan, math.nan, load_average=load)
        if record is None or probe is None or not (run_dir / WEIGHTS_FILE).is_file():
            failed.stopped = f"fit failed (exit code {code}): {last}"
            return failed
        metrics = record.get("metrics") or {}
        reached = "energy_to_target_J" in metrics
        run = HeldOutRun("", seed, float(record.get("energy_J", math.nan)), float(probe["cpu_s"]),
                         float(record.get("duration_s", math.nan)), math.nan, record.get("epochs"),
                         float(metrics["energy_to_target_J"]) if reached else None, reached,
                         record.get("provenance") or "unknown", load,
                         "target" if reached and stop_at_target else "max epochs")
        test = heldout_test_config(self.base, self.levers, settings, self.test_overlay, run_dir)
        (run_dir / "test").mkdir()
        code, last = self._process("test", test, run_dir / "test", TEST_CONFIG_FILE, "test_output.log",
                                   ["--ckpt_path", str(run_dir / WEIGHTS_FILE)])
        found = _read_json(run_dir / "test" / TEST_METRICS_FILE) or {}
        if self.test_metric not in found:
            run.stopped = f"test failed (exit code {code}, no {self.test_metric}): {last}"
            return run
        run.test_loss = float(found[self.test_metric])
        return run


def write_holdout_npz(data, out_dir: Path, test_fraction: float, seed: int, names: list[str] | None = None,
                      dtypes: list[str] | None = None) -> tuple[Path, Path, Any, Any]:
    """Split the rows (first axis) of ``data`` at random (``seed``) into a search file and a test file in Baler's
    npz layout (``data``, ``names``, ``dtypes``); returns their paths and the row indices of each (sorted).

    The search is given only the search file (its train/validation split is the config's); the test file is
    for the held-out check's test runs. ``test_fraction`` in (0, 1) and both parts non-empty, else ValueError.
    """
    import numpy as np

    data = np.asarray(data)
    n = len(data)
    n_test = int(round(n * test_fraction))
    if not 0 < test_fraction < 1 or not 0 < n_test < n:
        raise ValueError(f"test_fraction {test_fraction} of {n} rows leaves no test or no search rows")
    order = np.random.default_rng(seed).permutation(n)
    test_idx, search_idx = np.sort(order[:n_test]), np.sort(order[n_test:])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for part, idx in (("search", search_idx), ("test", test_idx)):
        arrays = {"data": data[idx], "names": np.asarray(names or [], dtype=str)}
        if dtypes:
            arrays["dtypes"] = np.asarray(dtypes, dtype=str)
        tmp = out_dir / f".{part}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, out_dir / f"{part}.npz")
        paths.append(out_dir / f"{part}.npz")
    return paths[0], paths[1], search_idx, test_idx


def sensor_failures(log_dir: Path) -> str | None:
    """The first sensor failure the run's ``energy_report.json`` names (``"cpu_estimate failed: ..."``), or None."""
    try:
        report = json.loads((log_dir / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sensors = report.get("sensors") if isinstance(report, dict) else None
    for sensor in sensors if isinstance(sensors, list) else []:
        if isinstance(sensor, dict) and sensor.get("failure"):
            return f"{sensor.get('name')} failed: {sensor['failure']}"
    return None


def outcome_of(record: dict, run_dir: str | None = None) -> RunOutcome:
    """A run's outcome from its catalog record (its metrics hold EnergyToAccuracy's figures); a target
    reached for no energy at all is a failed measurement, not a winner."""
    metrics = record.get("metrics") or {}
    g_per_kWh, pue = record.get("intensity_g_per_kWh"), record.get("pue") or 1.0
    common = {"provenance": record.get("provenance") or "unknown", "catalog_id": record.get("id"),
              "run_dir": run_dir}
    if "energy_to_target_J" in metrics:
        energy_J = metrics["energy_to_target_J"]
        if not (math.isfinite(energy_J) and energy_J > 0):
            return RunOutcome.failed(f"{energy_J:g} J to the target: nothing measured", run_dir)
        return RunOutcome(True, energy_J, metrics["time_to_target_s"], "target",
                          int(metrics["epochs_to_target"]),
                          co2_g(energy_J, g_per_kWh, pue) if g_per_kWh is not None else None, **common)
    if metrics.get("target_budget_exceeded"):
        return RunOutcome(False, metrics["energy_at_give_up_J"], metrics["time_at_give_up_s"], "energy budget",
                          **common)
    return RunOutcome(False, record.get("energy_J", math.nan), record.get("duration_s", math.nan), "max epochs",
                      **common)


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    return lines[-1][:300] if lines else "no output"


def main() -> None:
    """A plain LightningCLI: the model (and data) named by ``class_path`` in the config."""
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
