"""A sweep's YAML config, read and checked: the model and data (``class_path`` + ``init_args``, as
LightningCLI takes them), the grid (precision x batch size x power limit), the sensors (auto, or a simulated
device or GPU), the repetitions, the Trainer settings and the callbacks' arguments.

:func:`load_config` gives a :class:`SweepConfig` or a :class:`SweepConfigError` naming the key; nothing runs
here (the classes named are imported and their signatures checked; the ``trainer`` keys against
Lightning's Trainer's). See ``configs/sweep_tiny.yaml``;
:mod:`lightning_energy.sweep.runner` runs a checked config.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

AXES = ("precision", "batch_size", "power_limit_W")
TOP_LEVEL_KEYS = {"name", "output_dir", "seed", "repetitions", "model", "data", "grid", "sensors", "trainer",
                  "energy", "carbon", "cern_batches"}
RESERVED_TRAINER_KEYS = ("callbacks", "logger", "precision", "default_root_dir")
# Trainer arguments that count steps or epochs -> the lowest integer Lightning takes (-1: no limit)
TRAINER_COUNTS = {"max_epochs": -1, "min_epochs": 0, "max_steps": -1, "min_steps": 0, "log_every_n_steps": 0,
                  "accumulate_grad_batches": 1, "check_val_every_n_epoch": 1}
DEFAULT_CERN_BATCHES = 10  # the CERN study averaged the energy of 10 batches
WORKLOADS = ("compute_bound", "memory_bound", "small_net")  # gpu_sim's StepModel presets
GPU_KEYS = ("workload", "step", "min_limit_W", "max_limit_W", "default_limit_W", "idle_W", "static_W")
REAL_GPU_ACCELERATORS = ("gpu", "cuda", "auto")


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
    simulated: dict | None  # {"device_W", "host_W", "gpu"} or None for auto-detected sensors
    trainer: dict = field(default_factory=dict)
    energy: dict = field(default_factory=dict)
    carbon: dict | None = None
    cern_batches: int = DEFAULT_CERN_BATCHES

    def points(self) -> list[dict]:
        """Every grid point, in the config's order."""
        return [dict(zip(AXES, values)) for values in itertools.product(*(self.grid[a] for a in AXES))]

    @property
    def power_limits(self) -> str | None:
        """``"simulated"`` (simulated GPU), ``"real"`` (NVIDIA GPUs through Zeus) or None (no limit in the grid)."""
        if all(limit is None for limit in self.grid["power_limit_W"]):
            return None
        return "simulated" if self.simulated is not None else "real"


def load_config(path: str | Path) -> SweepConfig:
    """Read and check a sweep YAML file (SweepConfigError names the problem)."""
    from lightning_energy.io import read_yaml_config

    path = Path(path)
    raw = read_yaml_config(path, "sweep config", SweepConfigError)
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
    limits = [limit for limit in grid["power_limit_W"] if limit is not None]
    simulated = _sensors(raw.get("sensors", "auto"), limits)
    trainer = raw.get("trainer") or {}
    if not isinstance(trainer, dict):
        raise SweepConfigError("`trainer` must be a mapping of Trainer arguments")
    if simulated is None and limits and str(trainer.get("accelerator", "auto")) not in REAL_GPU_ACCELERATORS:
        raise SweepConfigError(
            "grid.power_limit_W with `sensors: auto` sets the power limit of real NVIDIA GPUs, but "
            f"trainer.accelerator is {trainer['accelerator']!r}; train on `gpu`, or simulate the limits with "
            "`sensors: {simulated: ...}`")
    reserved = [k for k in RESERVED_TRAINER_KEYS if k in trainer]
    if reserved:
        raise SweepConfigError(f"trainer.{reserved[0]} is set by the sweep; remove it from `trainer`")
    _check_trainer_args(trainer)
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
        raise SweepConfigError(f"`{key}` needs `class_path` (e.g. lightning_energy.simulate.example_model.TinyAutoencoder) "
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


def _check_trainer_args(trainer: dict) -> None:
    """``trainer``'s keys are arguments of Lightning's Trainer (its own signature), its step and epoch counts
    integers Lightning takes (``TRAINER_COUNTS``; None where that is the Trainer's default), and the fits end:
    ``max_epochs: -1`` (train forever) needs a ``max_steps`` or ``max_time``."""
    from lightning.pytorch import Trainer

    params = inspect.signature(Trainer).parameters
    unknown = sorted(set(trainer) - set(params), key=str)
    if unknown:
        allowed = sorted(set(params) - set(RESERVED_TRAINER_KEYS))
        raise SweepConfigError(f"trainer has key(s) {unknown} that Lightning's Trainer does not take; it takes: "
                               f"{', '.join(allowed)}")
    for key, lowest in TRAINER_COUNTS.items():
        if key not in trainer or (trainer[key] is None and params[key].default is None):
            continue
        value = trainer[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise SweepConfigError(f"trainer.{key} must be an integer >= {lowest}, got {value!r}")
    if trainer.get("max_epochs") == -1 and trainer.get("max_steps", -1) in (-1, None) and not trainer.get("max_time"):
        raise SweepConfigError("trainer.max_epochs is -1 (no end) without trainer.max_steps or trainer.max_time: "
                               "every fit of the sweep would train forever")


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
            if axis == "power_limit_W" and v is not None and not _watts(v):
                raise SweepConfigError(f"grid.power_limit_W values must be finite watts > 0 (or null: no limit), "
                                       f"got {v!r}")
        out[axis] = [str(v) if axis == "precision" else v for v in values]
    return out


def _sensors(spec, limits: list) -> dict | None:
    """The simulated hardware: a constant device draw, or (with power limits or ``gpu``) a simulated GPU."""
    if spec == "auto":
        return None
    if not isinstance(spec, dict) or set(spec) != {"simulated"} or not isinstance(spec["simulated"], dict):
        raise SweepConfigError("`sensors` must be 'auto' or {simulated: {device_W: W, host_W: W}} or "
                               "{simulated: {gpu: {...}, host_W: W}}")
    sim = spec["simulated"]
    unknown = sorted(set(sim) - {"device_W", "host_W", "gpu"})
    if unknown:
        raise SweepConfigError(f"sensors.simulated has unknown key(s) {unknown}; use device_W or gpu, and host_W")
    host_W = sim.get("host_W", 0.0)
    if not _watts(host_W, zero=True):
        raise SweepConfigError(f"sensors.simulated.host_W must be a number of watts >= 0 (finite), got {host_W!r}")
    if "gpu" in sim or limits:
        if "device_W" in sim:
            raise SweepConfigError(
                "sensors.simulated.device_W is a constant draw, but this sweep runs on the simulated GPU (it has "
                "grid.power_limit_W or sensors.simulated.gpu), whose model sets the draw: remove device_W")
        gpu = _gpu_spec(sim.get("gpu") or {})
        low, high = gpu["min_limit_W"], gpu["max_limit_W"]
        for limit in limits:
            if limit != int(limit) or not low <= limit <= high:
                raise SweepConfigError(f"grid.power_limit_W {limit} W: the simulated GPU takes whole watts in "
                                       f"[{low}, {high}] W (sensors.simulated.gpu min_limit_W / max_limit_W)")
        return {"device_W": None, "host_W": float(host_W), "gpu": gpu}
    device_W = sim.get("device_W")
    if not _watts(device_W):
        raise SweepConfigError(f"sensors.simulated.device_W must be a number of watts > 0 (finite), got {device_W!r}")
    return {"device_W": float(device_W), "host_W": float(host_W), "gpu": None}


def _watts(value, zero: bool = False) -> bool:
    """A real number of watts: not a bool, finite (YAML's ``.inf``/``.nan`` are floats), > 0 (>= 0 with ``zero``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if zero else value > 0


def _gpu_spec(raw) -> dict:
    """``sensors.simulated.gpu`` checked: a workload preset, StepModel overrides and SimulatedGPU arguments."""
    from lightning_energy.simulate import gpu_sim

    if not isinstance(raw, dict):
        raise SweepConfigError("sensors.simulated.gpu must be a mapping (workload, step, min_limit_W, ...)")
    unknown = sorted(set(raw) - set(GPU_KEYS))
    if unknown:
        raise SweepConfigError(f"sensors.simulated.gpu has unknown key(s) {unknown}; known: {list(GPU_KEYS)}")
    workload = raw.get("workload", "compute_bound")
    if workload not in WORKLOADS:
        raise SweepConfigError(f"sensors.simulated.gpu.workload must be one of {list(WORKLOADS)}, got {workload!r}")
    step = raw.get("step") or {}
    names = [f.name for f in fields(gpu_sim.StepModel)]
    if not isinstance(step, dict) or set(step) - set(names):
        raise SweepConfigError(f"sensors.simulated.gpu.step must map StepModel fields {names} to values, got {step!r}")
    spec = {"workload": workload, "step": dict(step), **{k: raw[k] for k in GPU_KEYS[2:] if k in raw}}
    for key in GPU_KEYS[2:]:
        if key in raw and not _watts(raw[key], zero=True):
            raise SweepConfigError(f"sensors.simulated.gpu.{key} must be a number of watts >= 0 (finite), "
                                   f"got {raw[key]!r}")
    try:
        make_simulated_gpu(spec, gpu_index=-1)  # a throwaway card: the simulator checks its own arguments
    except (TypeError, ValueError, OverflowError) as err:
        raise SweepConfigError(f"sensors.simulated.gpu: {err}") from None
    defaults = {"min_limit_W": gpu_sim.V100_MIN_LIMIT_W, "max_limit_W": gpu_sim.V100_MAX_LIMIT_W,
                "default_limit_W": gpu_sim.V100_DEFAULT_LIMIT_W}
    return {**defaults, **spec}


def make_simulated_gpu(spec: dict, clock=None, gpu_index: int = 0):
    """A :class:`~lightning_energy.simulate.gpu_sim.SimulatedGPU` from a checked ``sensors.simulated.gpu`` spec."""
    import dataclasses

    from lightning_energy.simulate import gpu_sim

    step = dataclasses.replace(getattr(gpu_sim, spec["workload"].upper()), **spec["step"])
    kwargs = {k: spec[k] for k in GPU_KEYS[2:] if k in spec}
    return gpu_sim.SimulatedGPU(gpu_index=gpu_index, step=step, clock=clock, **kwargs)
