"""``baler-lit convert-config``: a Baler project's Python config → a YAML that ``baler-lit fit --config`` runs.

A Baler config is a Python file whose ``set_config(c)`` assigns fields (``c.epochs = 100``). It is read as
untrusted input and never executed: the file (at most ``MAX_CONFIG_BYTES``) is parsed with :mod:`ast`, and only
``c.<field> = <literal>`` statements in ``set_config`` are accepted, each value read with
:func:`ast.literal_eval` (numbers, strings, booleans, ``None``, lists and tuples); any other statement there is
refused with its line number. Module-level code is ignored (Baler only calls ``set_config``).

Every field Baler knows is in :data:`BALER_FIELDS` with what it becomes here (``docs/baler_fields.md`` is the
table for people). Fields that belong to later steps (``extra_compression``, ``save_error_bounded_deltas`` /
``error_bounded_requirement``, ``convert_to_blocks``, the hls4ml options) become the commands written at the top
of the YAML. ``error_bounded_requirement`` is a percentage in Baler; ``--max-relative-error`` takes a fraction, so
the converter writes it as ``N%``. Fields whose Baler behaviour differs from their name (configured but never
applied: ``l1``, ``reg_param``, ``RHO``, ``mse_avg``, ``mse_sum``, ``emd``) are converted to what Baler actually does,
and the YAML says so. Unknown fields are listed and left out.

Imports neither torch nor Lightning.
"""

from __future__ import annotations

import ast
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BalerInputError, existing_file

#: Largest config file read (bytes): a Baler config is a few kilobytes.
MAX_CONFIG_BYTES = 2**20
#: Deepest nesting of a literal value accepted (lists in lists ...).
MAX_VALUE_DEPTH = 8

#: Every field of Baler v1.4.0's config (its ``Config`` dataclass, the ``newProject`` template, the example
#: workspaces, ``type_list`` and the hls4ml export) → what it becomes in baler-lit.
BALER_FIELDS: dict[str, str] = {
    "input_path": "data.path",
    "data_dimension": "implied by the data: (rows, columns) tables are 1, (frames, H, W) are 2",
    "compression_ratio": "model.compression_ratio",
    "number_of_columns": "checked against the data by the model (not needed)",
    "latent_space_size": "left out: Baler overwrites it with ceil(n / compression_ratio); model.latent_dim sets it",
    "model_name": "model.model (every Baler name)",
    "model_type": "implied by the model (dense or convolutional)",
    "epochs": "trainer.max_epochs",
    "lr": "model.lr",
    "batch_size": "data.batch_size",
    "early_stopping": "model.early_stopping_patience: null when False",
    "early_stopping_patience": "model.early_stopping_patience",
    "early_stoppin_patience": "model.early_stopping_patience (the Config dataclass's misspelling)",
    "min_delta": "model.early_stopping_min_delta",
    "lr_scheduler": "model.lr_patience: null when False",
    "lr_scheduler_patience": "model.lr_patience",
    "apply_normalization": "data.apply_normalization (False: raw values, stored as an identity normalisation)",
    "custom_norm": "True skips Baler's normalisation: data.apply_normalization false",
    "l1": "model.reg_param 0: Baler configures L1 but never adds it to the loss",
    "reg_param": "model.reg_param 0 (never applied by Baler; set model.reg_param to apply it)",
    "RHO": "model.rho null (never applied by Baler; set model.rho to apply sparse KL)",
    "mse_avg": "model.loss stays sum: Baler never reads mse_avg (model.loss: mean is the element mean)",
    "mse_sum": "model.loss: sum (Baler's loss whatever this says)",
    "emd": "baler-lit evaluate always reports the earth mover's distance per column (Baler never reads emd)",
    "custom_loss_function": "model.loss: swae for loss_function_swae",
    "test_size": "data.val_fraction",
    "type_list": "data.type_list",
    "deterministic_algorithm": "trainer.deterministic and seed_everything 0",
    "intermittent_model_saving": "a ModelCheckpoint keeping every N-th epoch's weights",
    "intermittent_saving_patience": "its every_n_epochs",
    "activation_extraction": "baler-lit diagnose (after training, from the checkpoint)",
    "separate_model_saving": "not needed: the .baler file holds the decoder, the checkpoint the whole model",
    "extra_compression": "baler-lit compress --extra-compression",
    "save_error_bounded_deltas": "baler-lit compress --max-relative-error",
    "error_bounded_requirement": "baler-lit compress --max-relative-error N% (Baler's percent)",
    "convert_to_blocks": "baler-lit blocks before fit and compress, and back after decompress",
    "compress_to_latent_space": "model.model_kwargs.compress_to_latent_space (Conv_AE_3D)",
    "default_reuse_factor": "baler-lit convert-with-hls4ml --reuse-factor",
    "default_precision": "baler-lit convert-with-hls4ml --precision",
    "Strategy": "baler-lit convert-with-hls4ml --strategy",
    "Part": "baler-lit convert-with-hls4ml --fpga-part",
    "ClockPeriod": "baler-lit convert-with-hls4ml --clock-period",
    "IOType": "baler-lit convert-with-hls4ml --io-type",
    "InputShape": "implied by the checkpoint (its input shape)",
    "ProjectName": "baler-lit convert-with-hls4ml --project-name",
    "OutputDir": "baler-lit convert-with-hls4ml --output-dir",
    "InputData": "left out: convert-with-hls4ml --compile checks the firmware against the model itself",
    "OutputPredictions": "left out (see InputData)",
    "csim": "baler-lit convert-with-hls4ml --build csim",
    "synth": "baler-lit convert-with-hls4ml --build synth",
    "cosim": "baler-lit convert-with-hls4ml --build cosim",
    "export": "baler-lit convert-with-hls4ml --build export",
}
#: hls4ml fields → the convert-with-hls4ml option that takes them
HLS4ML_OPTIONS = {
    "default_reuse_factor": "--reuse-factor", "default_precision": "--precision", "Strategy": "--strategy",
    "Part": "--fpga-part", "ClockPeriod": "--clock-period", "IOType": "--io-type", "ProjectName": "--project-name",
    "OutputDir": "--output-dir",
}  # fmt: skip
HLS4ML_BUILD_STEPS = ("csim", "synth", "cosim", "export")


def read_baler_config(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, int]]:
    """The fields ``set_config`` assigns (name → value) and the line of each, read without executing anything."""
    p = existing_file(path, "Baler config")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise BalerInputError(f"{p} is {size} bytes; a Baler config is at most {MAX_CONFIG_BYTES}")
    try:
        tree = ast.parse(p.read_bytes(), filename=str(p))
    except SyntaxError as exc:
        raise BalerInputError(f"{p} is not valid Python (line {exc.lineno}: {exc.msg})") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise BalerInputError(f"{p} cannot be parsed ({type(exc).__name__})") from None
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "set_config"]
    if not functions:
        raise BalerInputError(f"{p} defines no set_config(c): not a Baler config")
    func = functions[-1]  # Python keeps the last definition
    if len(func.args.args) != 1:
        raise BalerInputError(f"{p}: set_config must take one argument (the config), line {func.lineno}")
    var = func.args.args[0].arg
    fields: dict[str, Any] = {}
    lines: dict[str, int] = {}
    for stmt in func.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        if isinstance(stmt, ast.Pass):
            continue
        target = value = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            target, value = stmt.target, stmt.value
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == var):
            raise BalerInputError(
                f"{p} line {stmt.lineno}: only `{var}.field = value` assignments are read (the config is parsed,"
                " never run); write the value out"
            )
        fields[target.attr] = _literal(value, p, stmt.lineno, target.attr)
        lines[target.attr] = stmt.lineno
    return fields, lines


def _literal(node: ast.AST, path: Path, line: int, name: str) -> Any:
    if _depth(node) > MAX_VALUE_DEPTH:
        raise BalerInputError(f"{path} line {line}: {name} is nested deeper than {MAX_VALUE_DEPTH} levels")
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise BalerInputError(
            f"{path} line {line}: {name} is not a literal (a number, string, boolean, None, list or tuple); the"
            " config is parsed, never run: write the value out"
        ) from None
    if isinstance(value, (dict, set, bytes, complex)):
        raise BalerInputError(f"{path} line {line}: {name} is a {type(value).__name__}; Baler's fields never are")
    return list(value) if isinstance(value, tuple) else value


def _depth(node: ast.AST) -> int:
    children = [c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.List, ast.Tuple, ast.UnaryOp))]
    return 1 + max((_depth(c) for c in children), default=0)


def baler_root(config_path: Path) -> Path | None:
    """The folder Baler runs from for a config at ``ROOT/workspaces/W/P/config/P_config.py`` (Baler's paths are
    relative to it), else ``None``."""
    parts = config_path.resolve().parts
    if len(parts) >= 6 and parts[-2] == "config" and parts[-5] == "workspaces":
        return Path(*parts[:-5])
    return None


@dataclass
class Converted:
    """A converted config: the YAML's content, the notes (one per field), the commands of the later steps."""

    source: Path
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def to_yaml(self, yaml_path: str = "THIS_FILE.yaml") -> str:
        import yaml

        from . import __version__

        head = [f"Converted from the Baler config {self.source} by baler-lit {__version__} convert-config.",
                f"Train: baler-lit fit --config {yaml_path}"]  # fmt: skip
        head += [f"Then:  {c}" for c in self.commands]
        head += ["", "What each Baler field became:"] + [f"  {n}" for n in self.notes]
        if self.unknown:
            head += ["", "Fields baler-lit does not know (left out): " + ", ".join(self.unknown)]
        comment = "\n".join(f"# {line}".rstrip() for line in head)
        body = yaml.safe_dump(self.config, sort_keys=False, default_flow_style=False, width=120)
        return comment + "\n" + body


def _path(value: Any, root: Path | None, field_name: str) -> str:
    if not isinstance(value, str) or not value:
        raise BalerInputError(f"{field_name} must be a path (a string), got {value!r}")
    p = Path(value)
    return _display(p if p.is_absolute() or root is None else root / p)


def _display(path: Path) -> str:
    """``path`` relative to the current folder when it lies below it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def _number(fields: dict[str, Any], name: str, kind: type = float, minimum: float | None = None) -> Any:
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BalerInputError(f"{name} must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise BalerInputError(f"{name} must be a whole number, got {value!r}")
    if minimum is not None and value < minimum:
        raise BalerInputError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value) if kind is int else float(value)


def _flag(fields: dict[str, Any], name: str, default: bool = False) -> bool:
    value = fields.get(name, default)
    if not isinstance(value, bool):
        raise BalerInputError(f"{name} must be True or False, got {value!r}")
    return value


def convert(path: str | os.PathLike, root: str | os.PathLike | None = None) -> Converted:
    """Convert the Baler config at ``path``; Baler's relative paths are taken from ``root`` (default: the folder
    above ``workspaces/`` when the config sits in Baler's layout, else the current folder)."""
    source = Path(path)
    fields, _ = read_baler_config(source)
    base = Path(root) if root is not None else baler_root(source)
    out = Converted(source=source, config={})
    note = out.notes.append
    project = source.resolve().parent.parent if source.resolve().parent.name == "config" else None
    output = Path(_display(project / "output")) if project is not None else Path("baler_output")

    trainer: dict[str, Any] = {"accelerator": "auto", "devices": 1}
    model: dict[str, Any] = {}
    data: dict[str, Any] = {}
    callbacks: list[dict[str, Any]] = [{"class_path": "lightning_energy.EnergyCallback"}]
    seed = 0

    if "input_path" not in fields:
        raise BalerInputError(f"{source} sets no input_path (Baler's data file)")
    data["path"] = _path(fields["input_path"], base, "input_path")
    note(f"input_path → data.path {data['path']}")
    if "model_name" in fields:
        from .file_format import MODEL_NAMES

        name = fields["model_name"]
        if name not in MODEL_NAMES:
            raise BalerInputError(f"model_name {name!r} is not a Baler model; baler-lit has {', '.join(MODEL_NAMES)}")
        model["model"] = name
        note(f"model_name → model.model {name}")
    if "compression_ratio" in fields:
        model["compression_ratio"] = _number(fields, "compression_ratio", minimum=1e-9)
        note(f"compression_ratio → model.compression_ratio {model['compression_ratio']:g}")
    model["dtype"] = "float64" if model.get("model", "AE") in ("AE", "AE_Dropout_BN", "FPGA_prototype_model") \
        else "float32"  # fmt: skip
    note(f"(Baler's {model.get('model', 'AE')} computes in {model['dtype']}) → model.dtype {model['dtype']}")
    if "latent_space_size" in fields:
        note("latent_space_size → left out: Baler overwrites it with ceil(n / compression_ratio); set model.latent_dim"
             " to fix the size")  # fmt: skip
    if "epochs" in fields:
        trainer["max_epochs"] = _number(fields, "epochs", int, 1)
        note(f"epochs → trainer.max_epochs {trainer['max_epochs']}")
    if "lr" in fields:
        model["lr"] = _number(fields, "lr", minimum=1e-300)
        note(f"lr → model.lr {model['lr']:g}")
    if "batch_size" in fields:
        data["batch_size"] = _number(fields, "batch_size", int, 1)
        note(f"batch_size → data.batch_size {data['batch_size']}")
    data["shuffle"] = False
    note("(Baler never shuffles) → data.shuffle false")

    patience = fields.get("early_stopping_patience", fields.get("early_stoppin_patience", 100))
    if _flag(fields, "early_stopping", True):
        model["early_stopping_patience"] = _number({"early_stopping_patience": patience}, "early_stopping_patience",
                                                   int, 1)  # fmt: skip
        note(f"early_stopping True, early_stopping_patience → model.early_stopping_patience {patience}")
    else:
        model["early_stopping_patience"] = None
        note("early_stopping False → model.early_stopping_patience null")
    if "min_delta" in fields:
        model["early_stopping_min_delta"] = _number(fields, "min_delta", minimum=0)
        note(f"min_delta → model.early_stopping_min_delta {model['early_stopping_min_delta']:g}")
    if _flag(fields, "lr_scheduler", True):
        model["lr_patience"] = _number({"p": fields.get("lr_scheduler_patience", 50)}, "p", int, 1)
        note(f"lr_scheduler True, lr_scheduler_patience → model.lr_patience {model['lr_patience']}")
    else:
        model["lr_patience"] = None
        note("lr_scheduler False → model.lr_patience null")

    normalise = _flag(fields, "apply_normalization", True)
    custom = _flag(fields, "custom_norm", False)
    if normalise and not custom:  # data.apply_normalization's default: left out
        data["per_column"] = True
        note("apply_normalization True → min-max normalisation (the default), data.per_column true (Baler's min-max"
             " is per column of a table, per pixel of frames)")  # fmt: skip
    else:
        data["apply_normalization"] = False
        why = "apply_normalization False" if not normalise else "custom_norm True (Baler then skips min-max)"
        note(f"{why} → data.apply_normalization false: the model sees raw values (an identity normalisation is"
             " stored, so decompress restores them)")  # fmt: skip

    loss = "sum"
    if fields.get("custom_loss_function") is not None:
        if fields["custom_loss_function"] != "loss_function_swae":
            raise BalerInputError(f"custom_loss_function {fields['custom_loss_function']!r}: Baler has only"
                                  " loss_function_swae")  # fmt: skip
        loss = "swae"
        note("custom_loss_function loss_function_swae → model.loss swae")
    model["loss"] = loss
    note(f"mse_sum / mse_avg / l1 / reg_param / RHO (Baler never applies them) → model.loss {loss}, model.reg_param 0,"
         " model.rho null")  # fmt: skip
    model["reg_param"] = 0.0
    model["rho"] = None
    if _flag(fields, "emd"):
        note("emd True → nothing to set: baler-lit evaluate reports the earth mover's distance of every column")

    if "test_size" in fields:
        test_size = _number(fields, "test_size", minimum=0)
        if test_size >= 1:
            raise BalerInputError(f"test_size must be a fraction below 1, got {test_size}")
        data["val_fraction"] = test_size
        note(f"test_size → data.val_fraction {test_size:g}")
    else:
        data["val_fraction"] = 0.0
    if fields.get("type_list") is not None:
        if not isinstance(fields["type_list"], list) or not all(isinstance(t, str) for t in fields["type_list"]):
            raise BalerInputError("type_list must be a list of dtype names")
        data["type_list"] = fields["type_list"]
        note("type_list → data.type_list")
    if fields.get("compress_to_latent_space") is not None and model.get("model") == "Conv_AE_3D":
        model["model_kwargs"] = {"compress_to_latent_space": _flag(fields, "compress_to_latent_space")}
        note("compress_to_latent_space → model.model_kwargs.compress_to_latent_space")
    if _flag(fields, "deterministic_algorithm"):
        trainer["deterministic"] = True
        note("deterministic_algorithm True → trainer.deterministic true, seed_everything 0")

    checkpoint_dir = output / "training"
    trainer["default_root_dir"] = str(output)  # logs in output/lightning_logs; the weights alone in output/training
    callbacks.append({"class_path": "baler_lit.module.BalerCheckpoint",
                      "init_args": {"dirpath": str(checkpoint_dir), "filename": "model"}})  # fmt: skip
    if _flag(fields, "intermittent_model_saving"):
        every = _number({"intermittent_saving_patience": fields.get("intermittent_saving_patience", 100)},
                        "intermittent_saving_patience", int, 1)  # fmt: skip
        callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                          "init_args": {"dirpath": str(checkpoint_dir), "filename": "model_{epoch}",
                                        "every_n_epochs": every, "save_top_k": -1}})  # fmt: skip
        note(f"intermittent_model_saving → a ModelCheckpoint every {every} epochs")
    trainer["callbacks"] = callbacks

    ckpt = checkpoint_dir / "model.ckpt"
    blocks = fields.get("convert_to_blocks")
    data_file = data["path"]
    if blocks:
        if not (isinstance(blocks, list) and len(blocks) == 3 and all(isinstance(b, int) and b > 0 for b in blocks)):
            raise BalerInputError(f"convert_to_blocks must be three positive whole numbers, got {blocks!r}")
        stem = Path(data_file)
        data_file = str(stem.with_name(f"{stem.stem}_blocks_{blocks[1]}x{blocks[2]}.npz"))
        out.commands.insert(0, f"(first) baler-lit blocks --input {data['path']} --shape {blocks[1]} {blocks[2]}"
                               f" --output {data_file}")  # fmt: skip
        data["path"] = data_file
        note(f"convert_to_blocks {blocks} → data.path {data_file}, made by `baler-lit blocks` (the first command"
             " above); decompress gives blocks, `baler-lit blocks` reshapes them back")  # fmt: skip
    compress = (f"baler-lit compress --ckpt {ckpt} --input {data_file} --output"
                f" {output / 'compressed_output' / 'compressed.baler'}")  # fmt: skip
    if _flag(fields, "save_error_bounded_deltas") and fields.get("error_bounded_requirement") is not None:
        percent = _number(fields, "error_bounded_requirement", minimum=0)
        compress += f" --max-relative-error {percent:g}%"
        note(f"error_bounded_requirement {percent:g} (percent) → compress --max-relative-error {percent:g}% ="
             f" {percent / 100:g} of each value (Baler measures it on normalised values, baler-lit on the physical"
             " ones, and guarantees it)")  # fmt: skip
    if _flag(fields, "extra_compression"):
        compress += " --extra-compression"
        note("extra_compression True → compress --extra-compression (a deflated .baler file)")
    restored = output / "decompressed_output" / "decompressed.npz"
    out.commands += [compress,
                     f"baler-lit decompress --input {output / 'compressed_output' / 'compressed.baler'} --output"
                     f" {restored}",
                     f"baler-lit evaluate --original {data_file} --restored {restored} --out {output / 'plotting'}"
                     " --overwrite"]
    if any(k in fields for k in HLS4ML_OPTIONS):
        options = [f"{HLS4ML_OPTIONS[k]} {_shell(fields[k])}" for k in HLS4ML_OPTIONS if fields.get(k) is not None]
        steps = [s for s in HLS4ML_BUILD_STEPS if fields.get(s) is True]
        build = f" --build {' '.join(steps)}" if steps else ""
        out.commands.append(f"baler-lit convert-with-hls4ml --ckpt {ckpt} {' '.join(options)}{build}")
        note("hls4ml fields → baler-lit convert-with-hls4ml options (the last command above)")
    for name in ("activation_extraction",):
        if _flag(fields, name):
            out.commands.append(f"baler-lit diagnose --ckpt {ckpt} --input {data_file} --out {output / 'plotting'}")
            note("activation_extraction True → baler-lit diagnose (the command above)")

    out.unknown = sorted(set(fields) - set(BALER_FIELDS))
    out.config = {"seed_everything": seed, "trainer": trainer, "model": model, "data": data}
    return out


def _shell(value: Any) -> str:
    import shlex

    return shlex.quote(str(value))


def convert_to_file(path: str | os.PathLike, output: str | os.PathLike, overwrite: bool = False,
                    root: str | os.PathLike | None = None) -> Converted:  # fmt: skip
    """:func:`convert` and write the YAML to ``output`` (atomically; an existing file only with ``overwrite``)."""
    from .table import atomic_output, prepare_output

    converted = convert(path, root)
    prepare_output(output, overwrite)
    text = converted.to_yaml(str(output))
    with atomic_output(output, overwrite) as fh:
        fh.write(text.encode())
    return converted
