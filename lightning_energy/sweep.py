"""Sweeps: a grid over precision x batch size x power limit, repeated, each point a normal Lightning fit.

A YAML config (see ``configs/sweep_tiny.yaml``) names the model (``class_path`` + ``init_args``, and
optionally a LightningDataModule under ``data``), the grid, the repetitions and the Trainer settings.
The grid's order is shuffled anew for every repetition (as in the power-limit study) so slow drifts of
the machine do not line up with one axis. Every run is a fit with ``EnergyCallback``, recorded in the
run catalog, with the CERN study's estimate (energy per batch over 10 batches x batches) beside the
measured energy.

Power limits here are SIMULATED: ``power_limit_W`` caps the draw of a simulated device sensor
(``sensors: {simulated: ...}``); it does not slow the computation and says nothing about real
hardware. Setting real GPU power limits needs the power-limit backend, not part of this module.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

AXES = ("precision", "batch_size", "power_limit_W")
TOP_LEVEL_KEYS = {"name", "output_dir", "seed", "repetitions", "model", "data", "grid", "sensors", "trainer",
                  "energy", "carbon", "cern_batches"}
RESERVED_TRAINER_KEYS = ("callbacks", "logger", "precision", "default_root_dir")
DEFAULT_CERN_BATCHES = 10  # the CERN study averaged the energy of 10 batches


class SweepConfigError(ValueError):
    """A sweep config that cannot run; the message names the key."""


@dataclass
class SweepConfig:
    name: str
    output_dir: Path
    seed: int
    repetitions: int
    model: dict
    data: dict | None
    grid: dict[str, list]
    simulated: dict | None  # {"device_W": .., "host_W": ..} or None for auto-detected sensors
    trainer: dict = field(default_factory=dict)
    energy: dict = field(default_factory=dict)
    carbon: dict | None = None
    cern_batches: int = DEFAULT_CERN_BATCHES

    def points(self) -> list[dict]:
        """Every grid point, in the config's order."""
        return [dict(zip(AXES, values)) for values in itertools.product(*(self.grid[a] for a in AXES))]


def load_config(path: str | Path) -> SweepConfig:
    """Read and check a sweep YAML file (SweepConfigError names the problem)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise SweepConfigError(f"sweep config {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SweepConfigError(f"{path} is not valid YAML: {err}") from None
    return parse_config(raw, base=path.parent, default_name=path.stem)


def parse_config(raw: object, base: Path = Path("."), default_name: str = "sweep") -> SweepConfig:
    if not isinstance(raw, dict):
        raise SweepConfigError("a sweep config must be a mapping with `model` and `grid`")
    unknown = sorted(set(raw) - TOP_LEVEL_KEYS)
    if unknown:
        raise SweepConfigError(f"unknown key(s) {unknown}; known: {sorted(TOP_LEVEL_KEYS)}")
    model = _class_spec(raw.get("model"), "model")
    data = _class_spec(raw["data"], "data") if raw.get("data") is not None else None
    grid = _grid(raw.get("grid"))
    simulated = _sensors(raw.get("sensors", "auto"))
    if simulated is None and any(limit is not None for limit in grid["power_limit_W"]):
        raise SweepConfigError("grid.power_limit_W is simulated here: it needs `sensors: {simulated: {device_W: ...}}`")
    trainer = raw.get("trainer") or {}
    if not isinstance(trainer, dict):
        raise SweepConfigError("`trainer` must be a mapping of Trainer arguments")
    reserved = [k for k in RESERVED_TRAINER_KEYS if k in trainer]
    if reserved:
        raise SweepConfigError(f"trainer.{reserved[0]} is set by the sweep; remove it from `trainer`")
    _check_batch_size_target(data or model, "data" if data else "model")
    repetitions = _int(raw.get("repetitions", 1), "repetitions", 1)
    seed = _int(raw.get("seed", 0), "seed", 0)
    cern = _int(raw.get("cern_batches", DEFAULT_CERN_BATCHES), "cern_batches", 1)
    energy = raw.get("energy") or {}
    carbon = raw.get("carbon")
    if not isinstance(energy, dict) or (carbon is not None and not isinstance(carbon, dict)):
        raise SweepConfigError("`energy` and `carbon` must be mappings of callback arguments")
    _check_callback_args(energy, "energy", "lightning_energy.callbacks.energy.EnergyCallback", {"sensors", "verbose"})
    _check_callback_args(carbon or {}, "carbon", "lightning_energy.callbacks.carbon.CarbonCallback",
                         {"sensors", "verbose"})
    output = Path(raw.get("output_dir", f"runs/{default_name}"))
    return SweepConfig(str(raw.get("name", default_name)), output, seed, repetitions, model, data, grid, simulated,
                       dict(trainer), dict(energy), None if carbon is None else dict(carbon), cern)


def _int(value, key: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SweepConfigError(f"`{key}` must be an integer >= {low}, got {value!r}")
    return value


def _class_spec(spec, key: str) -> dict:
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise SweepConfigError(f"`{key}` needs `class_path` (e.g. lightning_energy.examples.TinyAutoencoder) "
                               "and optional `init_args`")
    extra = sorted(set(spec) - {"class_path", "init_args"})
    if extra:
        raise SweepConfigError(f"`{key}` has unknown key(s) {extra}; use class_path and init_args")
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise SweepConfigError(f"`{key}.init_args` must be a mapping")
    if "batch_size" in init_args:
        raise SweepConfigError(f"`{key}.init_args.batch_size` is set by the grid; put the sizes in grid.batch_size")
    cls = import_class(spec["class_path"], key)
    return {"class_path": spec["class_path"], "init_args": dict(init_args), "cls": cls}


def import_class(class_path: str, key: str = "model"):
    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        raise SweepConfigError(f"`{key}.class_path` must be a dotted path like package.module.Class, "
                               f"got {class_path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SweepConfigError(f"cannot import {module_name!r} for `{key}.class_path`: {err}") from None
    cls = getattr(module, name, None)
    if not inspect.isclass(cls):
        raise SweepConfigError(f"`{key}.class_path`: {module_name!r} has no class {name!r}")
    return cls


def _check_callback_args(args: dict, key: str, class_path: str, reserved: set[str]) -> None:
    """Arguments for a callback the sweep builds: known to its signature and not set by the sweep itself."""
    params = set(inspect.signature(import_class(class_path, key)).parameters) - reserved
    unknown = sorted(set(args) - params)
    if unknown:
        raise SweepConfigError(f"`{key}` has argument(s) {unknown} that the sweep does not pass on; "
                               f"allowed: {sorted(params)}")


def _check_batch_size_target(spec: dict, key: str) -> None:
    params = inspect.signature(spec["cls"]).parameters
    if "batch_size" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise SweepConfigError(f"`{key}.class_path` {spec['class_path']} takes no `batch_size` argument, which the "
                               "grid's batch_size axis sets")


def _grid(grid) -> dict[str, list]:
    if not isinstance(grid, dict):
        raise SweepConfigError(f"`grid` must be a mapping of axes {AXES} to lists of values")
    unknown = sorted(set(grid) - set(AXES))
    if unknown:
        raise SweepConfigError(f"unknown grid axis/axes {unknown}; axes: {list(AXES)}")
    out = {}
    for axis, default in (("precision", ["32-true"]), ("batch_size", None), ("power_limit_W", [None])):
        values = grid.get(axis, default)
        if values is None:
            raise SweepConfigError(f"grid.{axis} is required (a list of values)")
        if not isinstance(values, list) or not values:
            raise SweepConfigError(f"grid.{axis} must be a non-empty list, got {values!r}")
        if len(set(map(str, values))) != len(values):
            raise SweepConfigError(f"grid.{axis} repeats a value: {values}")
        for v in values:
            if axis == "precision" and not isinstance(v, (str, int)):
                raise SweepConfigError(f"grid.precision values are Lightning precisions like '32-true', got {v!r}")
            if axis == "batch_size" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SweepConfigError(f"grid.batch_size values must be positive integers, got {v!r}")
            if axis == "power_limit_W" and v is not None and (
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise SweepConfigError(f"grid.power_limit_W values must be watts > 0 (or null: no limit), got {v!r}")
        out[axis] = [str(v) if axis == "precision" else v for v in values]
    return out


def _sensors(spec) -> dict | None:
    if spec == "auto":
        return None
    if not isinstance(spec, dict) or set(spec) != {"simulated"} or not isinstance(spec["simulated"], dict):
        raise SweepConfigError("`sensors` must be 'auto' or {simulated: {device_W: W, host_W: W}}")
    sim = spec["simulated"]
    unknown = sorted(set(sim) - {"device_W", "host_W"})
    if unknown:
        raise SweepConfigError(f"sensors.simulated has unknown key(s) {unknown}; use device_W and host_W")
    out = {}
    for key in ("device_W", "host_W"):
        value = sim.get(key, 0.0 if key == "host_W" else None)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or value < 0 or (key == "device_W" and not value > 0):
            raise SweepConfigError(f"sensors.simulated.{key} must be a number of watts (device_W > 0), got {value!r}")
        out[key] = float(value)
    return out


def sweep_order(points: list[dict], repetitions: int, seed: int) -> list[tuple[int, dict]]:
    """(repetition, point) in run order: every repetition runs the whole grid in its own random order."""
    rng = random.Random(seed)
    order = []
    for repetition in range(repetitions):
        shuffled = list(points)
        rng.shuffle(shuffled)
        order += [(repetition, point) for point in shuffled]
    return order


def run_name(repetition: int, point: dict) -> str:
    limit = "none" if point["power_limit_W"] is None else f"{point['power_limit_W']:g}W"
    return f"rep{repetition}_prec{point['precision']}_bs{point['batch_size']}_pl{limit}"


def simulated_sensors(simulated: dict, power_limit_W: float | None):
    """The simulated device (its draw capped at the simulated limit) and host sensors of one run."""
    from lightning_energy.sensors.simulated import SimulatedSensor

    device_W = simulated["device_W"] if power_limit_W is None else min(simulated["device_W"], power_limit_W)
    sensors = [SimulatedSensor("sim_device", device_W, scope="device")]
    if simulated["host_W"] > 0:
        sensors.append(SimulatedSensor("sim_host", simulated["host_W"], scope="host"))
    return sensors


def run_one(config: SweepConfig, repetition: int, point: dict, order_index: int) -> dict:
    """One grid point as a normal Lightning fit; returns its results row."""
    import lightning as L
    from lightning.fabric.utilities.seed import seed_everything
    from lightning.pytorch.loggers import CSVLogger

    from lightning_energy.callbacks.batch_sample import BatchSampleEstimate
    from lightning_energy.callbacks.carbon import CarbonCallback
    from lightning_energy.callbacks.catalog import CatalogCallback
    from lightning_energy.callbacks.energy import EnergyCallback
    from lightning_energy.catalog import CATALOG_FILE

    name = run_name(repetition, point)
    seed_everything(config.seed, verbose=False)
    model_args = dict(config.model["init_args"])
    data = None
    if config.data is not None:
        data = config.data["cls"](**config.data["init_args"], batch_size=point["batch_size"])
    else:
        model_args["batch_size"] = point["batch_size"]
    model = config.model["cls"](**model_args)
    sensors = simulated_sensors(config.simulated, point["power_limit_W"]) if config.simulated else None
    attributes = {"sweep": config.name, "repetition": repetition, "order": order_index, **point,
                  "power_limit": "simulated" if point["power_limit_W"] is not None else None}
    energy = EnergyCallback(sensors=sensors, verbose=False, **config.energy)
    sample = BatchSampleEstimate(n_batches=config.cern_batches)
    catalog = CatalogCallback(config.output_dir / CATALOG_FILE, config=attributes)
    callbacks = [energy, sample, catalog]
    if config.carbon is not None:
        callbacks.append(CarbonCallback(verbose=False, **config.carbon))
    trainer_args = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False,
                    **config.trainer}
    trainer = L.Trainer(callbacks=callbacks, precision=point["precision"], default_root_dir=str(config.output_dir),
                        logger=CSVLogger(str(config.output_dir), name="runs", version=name), **trainer_args)
    trainer.fit(model, datamodule=data)
    report = energy.report
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train/loss", "val/loss")}
    return {
        "run": name, "run_dir": str(trainer.log_dir), "order": order_index, "repetition": repetition, **point,
        "epochs": len(report["epochs"]), "batches": sample.batches, "duration_s": report["duration_s"],
        "energy_J": report["total_J"], "train_J": report["train_J"], "edp_Js": report["edp_Js"],
        "estimated": report["estimated"], "gCO2e": catalog.record["gCO2e"], "catalog_id": catalog.record_id,
        "cern_batch_J": sample.batch_J_mean, "cern_sampled": sample.sampled,
        "cern_estimate_J": sample.estimate_J,
        "cern_vs_train": sample.estimate_J / report["train_J"] if sample.estimate_J and report["train_J"] else None,
        **metrics,
    }


def summarise(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over the repetitions of each grid point (in grid order of first run)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[a] for a in AXES), []).append(row)
    out = []
    for key, members in groups.items():
        entry = dict(zip(AXES, key))
        entry["runs"] = len(members)
        for name in ("duration_s", "energy_J", "edp_Js", "cern_estimate_J"):
            values = [m[name] for m in members if m[name] is not None]
            mean = sum(values) / len(values) if values else math.nan
            entry[f"{name}_mean"] = mean
            entry[f"{name}_std"] = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else math.nan
        out.append(entry)
    return out


@contextlib.contextmanager
def quiet_lightning():
    """Lightning's informational lines (GPU available, tips) held back during the sweep's fits."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning_fabric",
                                               "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
