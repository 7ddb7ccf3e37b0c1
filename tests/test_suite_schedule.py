"""The suite's schedule (tests/suite_schedule.py): a module's tests on one worker, heaviest modules first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from suite_schedule import heaviest_first, recorded_costs, work_unit

HERE = Path(__file__).resolve().parent
MAKEFILE = HERE.parent / "Makefile"


def item(nodeid):
    return SimpleNamespace(nodeid=nodeid)


def test_modules_go_heaviest_first_and_keep_their_tests_order():
    items = [item(n) for n in ("a.py::1", "a.py::2", "b.py::1", "c.py::1", "d.py::1")]
    costs = {"a.py::1": 1.0, "a.py::2": 2.5, "b.py::1": 4.0, "c.py::1": 0.2}  # d unrecorded: free, stays last
    order = [i.nodeid for i in heaviest_first(items, costs)]
    assert order == ["b.py::1", "a.py::1", "a.py::2", "c.py::1", "d.py::1"]
    assert work_unit("tests/test_x.py::test_y[1::2]") == "tests/test_x.py"


def test_a_missing_or_unreadable_record_leaves_the_order(tmp_path):
    assert recorded_costs(tmp_path / "none.json") == {}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert recorded_costs(bad) == {}
    bad.write_text(json.dumps({"x::1": "slow", "x::2": 3}))
    assert recorded_costs(bad) == {"x::2": 3.0}


def test_the_checked_in_record_names_tests_that_exist(request):
    """A stale record only orders less well; a record of another suite would order nothing."""
    recorded = set(recorded_costs())
    collected = {i.nodeid for i in request.session.items}
    if len(collected) < 500:
        pytest.skip("only part of the suite is collected in this run")
    assert len(recorded & collected) >= 0.8 * len(recorded)


def make_schedule() -> list[str]:
    """The pytest-xdist options ``make test`` passes (the Makefile's SCHEDULE)."""
    (line,) = re.findall(r"^SCHEDULE :=(.*)$", MAKEFILE.read_text(), flags=re.MULTILINE)
    return line.split()


def test_make_tests_schedule_builds_a_module_fixture_once(tmp_path):
    """Two workers and ``make test``'s schedule on a small suite: the module whose eight tests share a
    module-scoped fixture builds it once (with ``--dist loadgroup`` under pytest 9 it was built on both)."""
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
        "from suite_schedule import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_shared.py").write_text(
        "import os, pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def built(tmp_path_factory):\n"
        f"    with open({str(tmp_path / 'built.txt')!r}, 'a') as fh:\n"
        "        fh.write(os.environ.get('PYTEST_XDIST_WORKER', '-') + '\\n')\n"
        + "".join(f"def test_{i}(built):\n    pass\n" for i in range(8)))
    (tmp_path / "test_alone.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(8)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LIGHTNING_ENERGY_RECORD"))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          *make_schedule(), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len((tmp_path / "built.txt").read_text().split()) == 1
