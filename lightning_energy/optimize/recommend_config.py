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
from lightning_energy.optimize.recommend import Lever, RunOutcome, Target, co2_g

DEFAULT_CLI = "lightning_energy.optimize.recommend_config"
RUN_CONFIG_FILE = "recommend_run.yaml"
RUN_LOG_FILE = "output.log"
RUN_ATTRIBUTE = "recommend_run"  # run attribute naming the run in the catalog
OWNED_CALLBACKS = ("EnergyToAccuracy", "CatalogCallback", "CompileModel")  # the recommender sets these itself
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


def has_compile(config: dict) -> bool:
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    return any(_class_name(c) == "CompileModel" for c in _callbacks(trainer))


def with_levers(base: dict, levers: dict[str, Lever], settings: dict[str, Any], target: Target,
                budget_J: float | None = None) -> dict:
    """The config with ``settings`` applied and the target's callbacks in place (user callbacks kept)."""
    config = copy.deepcopy(base)
    for name, value in settings.items():
        if levers[name].path is not None:
            set_path(config, levers[name].path, value)
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
