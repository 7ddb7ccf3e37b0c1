"""``baler-lit --help``, ``configs`` and ``info`` (and every file tool's ``--help``) start without Lightning or
torch.

Not timing tests: what is asserted is which modules a fresh interpreter loaded (the timings before and after
are in the issue-32 report: ``baler-lit --help`` went from ~50x ``import numpy`` to about 1x).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "torch", "matplotlib", "scipy", "zeus", "codecarbon", "uproot", "baler_lit.models")
NON_TRAINING = ("compress", "decompress", "evaluate", "diagnose", "info", "compress-many", "configs")


def loaded_after(argv: list[str], cwd: Path = ROOT) -> dict:
    """Run ``baler-lit argv`` in a fresh interpreter: its exit code, stdout, stderr and the heavy modules it loaded."""
    code = f"""
import contextlib, io, json, sys
from baler_lit.cli import main
out, err = io.StringIO(), io.StringIO()
try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main({argv!r})
except SystemExit as exit:  # --help
    rc = exit.code
print(json.dumps({{"rc": rc, "out": out.getvalue(), "err": err.getvalue(),
                  "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_top_level_help_lists_every_command_without_lightning_or_torch():
    result = loaded_after(["--help"])
    assert result["heavy"] == [] and result["rc"] == 0
    for command in ("fit", "validate", "test", "predict", *NON_TRAINING):
        assert f"\n    {command} " in result["out"] or f"\n    {command}\n" in result["out"], command


@pytest.mark.parametrize("command", NON_TRAINING)
def test_the_help_of_a_command_that_does_not_train_imports_neither(command):
    result = loaded_after([command, "--help"])
    assert result["heavy"] == [], f"{command} --help loaded {result['heavy']}"
    assert result["rc"] == 0 and f"usage: baler-lit {command}" in result["out"]


@pytest.mark.parametrize("argv", [["configs"], ["configs", "cms_ae"], [], ["configs", "nope"],
                                  ["fit", "--config", "no_such_config"]], ids=lambda argv: " ".join(argv) or "(none)")
def test_configs_no_command_and_an_unknown_config_name_import_neither(argv, tmp_path):
    result = loaded_after(argv, cwd=tmp_path)
    assert result["heavy"] == [], f"{argv} loaded {result['heavy']}"
    if argv[:1] == ["configs"] and argv[1:] != ["nope"]:
        assert result["rc"] == 0 and result["out"]
    else:  # a missing command or an unknown name: one line, exit code 2, nothing on stdout
        assert result["rc"] == 2 and result["out"] == "" and len(result["err"].splitlines()) == 1, result


@pytest.fixture(scope="module")
def small_baler(tmp_path_factory) -> Path:
    """A .baler file of an untrained AE over 200 synthetic CMS rows (its contents do not matter here)."""
    import torch

    from baler_lit.compression import compress
    from baler_lit.models import build_model
    from baler_lit.normalization import MinMaxNormalizer
    from baler_lit.synthetic import synthetic_cms_jets

    torch.manual_seed(0)
    table = synthetic_cms_jets(200, 0)
    path = tmp_path_factory.mktemp("info") / "small.baler"
    compress(build_model("AE", (24,)), MinMaxNormalizer.fit(table.data), table, path, "float16", {"model": "AE"})
    return path


@pytest.mark.parametrize("json_output", [False, True], ids=["text", "json"])
def test_info_reads_and_verifies_a_file_without_torch(small_baler, json_output):
    result = loaded_after(["info", str(small_baler), *(["--json"] if json_output else [])])
    assert result["heavy"] == [], f"info loaded {result['heavy']}"
    assert result["rc"] == 0 and ("200" in result["out"])


def test_the_file_format_s_model_names_are_the_model_registry():
    """file_format.MODEL_NAMES is written out so a header is checked without torch: it must be the registry."""
    from baler_lit.file_format import MODEL_NAMES
    from baler_lit.models import MODELS

    assert MODEL_NAMES == tuple(MODELS)
