"""Every command the README shows runs as written from a fresh clone (issue 32 item 12).

Each fenced block names its kind: ``python`` blocks are run as programs and ``bash`` blocks as scripts (``set -e``),
each in an empty folder with the venv's commands on PATH; ``text`` blocks are synopses and outputs, not run. A
``bash`` line that installs (``pip install``) or runs a make target is checked, not run here: the target must exist
in the Makefile and the files it names must exist (CI runs ``make test`` itself; installing needs the registries).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```$", re.M | re.S)
KINDS = {"python", "bash", "text"}
CHECKED_NOT_RUN = ("make ", "pip install ", "python -m pip install ", ".venv/bin/pip install ")


def blocks() -> list[tuple[int, str, str]]:
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def test_every_block_says_what_it_is():
    found = blocks()
    assert len(found) >= 6
    assert [(line, kind) for line, kind, _ in found if kind not in KINDS] == []


def environment() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "README_ROOT": str(ROOT)}


def runnable(kind: str) -> list[tuple[int, str]]:
    return [(line, body) for line, k, body in blocks() if k == kind]


@pytest.mark.parametrize("line, body", runnable("python"), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_a_python_block_runs(line, body, tmp_path, rank_zygote):
    """As ``python -c body`` in an empty folder; forked from the suite's zygote, which has imported Lightning
    (the block's own imports then cost nothing: they are what every block starts with)."""
    run = rank_zygote.run_python(body, tmp_path, environment())
    assert run.returncode == 0, f"README line {line}:\n{run.stderr[-2000:]}"


def split_commands(body: str) -> tuple[str, list[str]]:
    """(the script to run, the lines only checked)."""
    run, checked = [], []
    for raw in body.replace("\\\n", " ").splitlines():
        line = raw.split(" #")[0].strip() if not raw.strip().startswith("#") else ""
        if line.startswith(CHECKED_NOT_RUN):
            checked.append(line)
        elif line:
            run.append(line)
    return "\n".join(run), checked


def check_without_running(line: str) -> None:
    words = shlex.split(line)
    if words[0] == "make":
        targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
        assert all(w in targets for w in words[1:] if not w.startswith("-") and "=" not in w), line
        return
    for word in words:  # pip install: the files it names (a constraints file, the clone) exist
        if word.endswith(".txt") or word.startswith((".", "/")) and not word.startswith(".["):
            assert (ROOT / word.split("[")[0]).exists() or Path(word).exists(), (line, word)


@pytest.mark.parametrize("line, body", runnable("bash"), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_a_bash_block_runs(line, body, tmp_path):
    script, checked = split_commands(body)
    for command in checked:
        check_without_running(command)
    if not script:
        return
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=environment(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"README line {line}:\n{run.stdout[-1500:]}\n{run.stderr[-2000:]}"
