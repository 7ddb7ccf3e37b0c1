"""Issue 32 item 2: the demo's TensorBoard hint runs as printed, with or without the venv activated."""

from __future__ import annotations

import sys
from pathlib import Path

from baler_lit.demo import tensorboard_command


def test_without_the_venv_on_path_the_hint_names_the_venvs_tensorboard(monkeypatch):
    venv_bin = Path(sys.executable).parent
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(venv_bin.parent.parent)  # the folder holding the venv, as after `make demo`
    command = tensorboard_command()
    assert command != "tensorboard" and (Path.cwd() / command).resolve() == (venv_bin / "tensorboard").resolve()
    assert (Path.cwd() / command).exists()


def test_with_the_venv_on_path_the_hint_is_the_plain_name(monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    assert tensorboard_command() == "tensorboard"
