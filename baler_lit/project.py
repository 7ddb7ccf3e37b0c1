"""``baler-lit new-project WORKSPACE PROJECT``: Baler's ``--mode newProject``, the same folders and template.

Creates, below ``--root`` (default ``workspaces``, as Baler)::

    WORKSPACE/data/                               your data: WORKSPACE/data/PROJECT_data.npz
    WORKSPACE/PROJECT/config/PROJECT_config.py    Baler's config template (the fields and defaults of Baler's
                                                  newProject), which Baler itself also runs
    WORKSPACE/PROJECT/config/PROJECT_config.yaml  the same config converted (baler-lit convert-config)
    WORKSPACE/PROJECT/output/{training,compressed_output,decompressed_output,plotting}/

and prints the workflow: ``fit --config .../PROJECT_config.yaml`` → ``compress`` → ``decompress`` → ``evaluate``
(Baler's train, compress, decompress and plot). After editing the ``.py`` template, ``baler-lit convert-config``
writes the YAML again. As Baler, an existing project is left alone (a line says so, exit code 0).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import BalerInputError

#: Baler v1.4.0 newProject template's fields and defaults, in its order (``{W}``/``{P}``: workspace, project).
TEMPLATE_FIELDS: tuple[tuple[str, object], ...] = (
    ("input_path", "workspaces/{W}/data/{P}_data.npz"),
    ("data_dimension", 1),
    ("compression_ratio", 2.0),
    ("apply_normalization", True),
    ("model_name", "AE"),
    ("model_type", "dense"),
    ("epochs", 5),
    ("lr", 0.001),
    ("batch_size", 512),
    ("early_stopping", True),
    ("lr_scheduler", True),
    ("early_stopping_patience", 100),
    ("min_delta", 0),
    ("lr_scheduler_patience", 50),
    ("custom_norm", False),
    ("reg_param", 0.001),
    ("RHO", 0.05),
    ("test_size", 0),
    ("extra_compression", False),
    ("intermittent_model_saving", False),
    ("intermittent_saving_patience", 100),
    ("mse_avg", False),
    ("mse_sum", True),
    ("emd", False),
    ("l1", True),
    ("activation_extraction", False),
    ("deterministic_algorithm", True),
    ("separate_model_saving", False),
)
OUTPUT_FOLDERS = ("training", "compressed_output", "decompressed_output", "plotting")
#: A workspace or project name: one folder name (Baler builds a Python module path from it, so no dots).
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass
class Project:
    """Where a project's files are."""

    root: Path
    workspace: str
    name: str

    @property
    def folder(self) -> Path:
        return self.root / self.workspace / self.name

    @property
    def data(self) -> Path:
        return self.root / self.workspace / "data" / f"{self.name}_data.npz"

    @property
    def baler_config(self) -> Path:
        return self.folder / "config" / f"{self.name}_config.py"

    @property
    def config(self) -> Path:
        return self.folder / "config" / f"{self.name}_config.yaml"

    @property
    def output(self) -> Path:
        return self.folder / "output"


def template(workspace: str, project: str, root: str = "workspaces") -> str:
    """Baler's config template for a project (a Python file defining ``set_config(c)``)."""
    width = max(len(name) for name, _ in TEMPLATE_FIELDS)
    lines = ["# === Configuration options (Baler's newProject template; baler-lit convert-config reads it) ===", "",
             "def set_config(c):"]  # fmt: skip
    for name, value in TEMPLATE_FIELDS:
        if name == "input_path":
            value = str(Path(root) / workspace / "data" / f"{project}_data.npz")
        lines.append(f"    c.{name:<{width}} = {value!r}")
    return "\n".join(lines) + "\n"


def new_project(workspace: str, project: str, root: str | os.PathLike = "workspaces") -> tuple[Project, bool]:
    """Create the project (see the module docstring); ``(project, created)``, ``created`` False when it existed."""
    for what, name in (("workspace", workspace), ("project", project)):
        if not NAME.fullmatch(name):
            raise BalerInputError(f"{what} name {name!r} must be a folder name of letters, digits, _ and -")
    p = Project(Path(root), workspace, project)
    if p.folder.exists():
        return p, False
    for folder in (p.data.parent, p.baler_config.parent, *(p.output / f for f in OUTPUT_FOLDERS)):
        folder.mkdir(parents=True, exist_ok=True)
    from .convert_config import convert_to_file
    from .table import atomic_output

    with atomic_output(p.baler_config, False) as fh:
        fh.write(template(workspace, project, str(root)).encode())
    convert_to_file(p.baler_config, p.config, root=".")  # the template's input_path is relative to this folder
    return p, True


def describe(p: Project, created: bool) -> str:
    if not created:
        return f"the workspace and project ({p.folder}) already exist: nothing changed"
    out = p.output
    return "\n".join([
        f"created project {p.name} in workspace {p.workspace}: {p.folder}",
        f"put your data at {p.data} (Baler's .npz: data, names), then:",
        f"  baler-lit fit --config {p.config}",
        f"  baler-lit compress --ckpt {out / 'training' / 'model.ckpt'} --input {p.data} --output"
        f" {out / 'compressed_output' / 'compressed.baler'}",
        f"  baler-lit decompress --input {out / 'compressed_output' / 'compressed.baler'} --output"
        f" {out / 'decompressed_output' / 'decompressed.npz'}",
        f"  baler-lit evaluate --original {p.data} --restored {out / 'decompressed_output' / 'decompressed.npz'}"
        f" --out {out / 'plotting'} --overwrite",
        f"edit {p.baler_config} and run `baler-lit convert-config {p.baler_config} --output {p.config} --overwrite`,"
        f" or edit {p.config} directly",
    ])  # fmt: skip
