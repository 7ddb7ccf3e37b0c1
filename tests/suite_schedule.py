"""How the suite's tests are spread over pytest-xdist's workers (``make test``: ``--dist loadgroup
--no-loadscope-reorder``), so that two cores finish it soon. Nothing here changes what any test checks.

- **Module fixtures are built once.** A test that uses a module-scoped fixture of its own module (a DDP fit,
  a trained checkpoint, a fuzz corpus) is put in its module's ``xdist_group``: every such test runs on one
  worker, so the fixture is built once rather than once on each worker that draws one of its tests.
- **The heaviest work goes first** (longest processing time first). Work units (a group, or a test on its
  own) are ordered by their recorded cost in ``tests/durations.json``, heaviest first; a unit with no record
  counts as free and keeps its place among those after the recorded ones. The short tests then fill in
  beside the long ones instead of one long test running alone at the end. A stale record only makes the
  order less good, never a test wrong.

``make test-durations`` records the costs: with ``LIGHTNING_ENERGY_RECORD_DURATIONS=FILE`` set, the
controller sums each test's setup, call and teardown seconds and writes those of at least
:data:`RECORDED_MIN_S` to ``FILE``.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS_FILE = Path(__file__).with_name("durations.json")
RECORD_ENV = "LIGHTNING_ENERGY_RECORD_DURATIONS"
GROUP_SUFFIX = re.compile(r"@[\w.]+$")  # what xdist appends to a grouped test's node id
RECORDED_MIN_S = 0.5  # shorter tests are left out of the record: they only fill in


def module_fixture_group(item: pytest.Item) -> str | None:
    """The xdist group of ``item``: its module's name where it uses a module-scoped fixture defined there."""
    module = getattr(item, "module", None)
    info = getattr(item, "_fixtureinfo", None)
    if module is None or info is None:
        return None
    for definitions in info.name2fixturedefs.values():
        definition = definitions[-1]
        if definition.scope == "module" and getattr(definition.func, "__module__", None) == module.__name__:
            return module.__name__
    return None


def recorded_costs(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """Seconds per test node id from ``path``; empty where there is no readable record."""
    try:
        costs = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(costs, dict):
        return {}
    return {str(k): float(v) for k, v in costs.items() if isinstance(v, (int, float))}


def heaviest_first(items: list[pytest.Item], groups: dict[str, str], costs: dict[str, float]) -> list[pytest.Item]:
    """``items`` ordered by the cost of their work unit (the group, or the test alone), heaviest first; ties
    (unrecorded units among them) keep their order, and a group's tests keep theirs."""
    unit_cost: dict[str, float] = defaultdict(float)
    for item in items:
        unit_cost[groups.get(item.nodeid, item.nodeid)] += costs.get(item.nodeid, 0.0)
    return sorted(items, key=lambda item: -unit_cost[groups.get(item.nodeid, item.nodeid)])


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (and suffixes the node ids)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {}
    for item in items:
        group = module_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            groups[item.nodeid] = group
    items[:] = heaviest_first(items, groups, recorded_costs())


_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get(RECORD_ENV):
        _seconds[GROUP_SUFFIX.sub("", report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get(RECORD_ENV)
    if not target or hasattr(session.config, "workerinput"):  # a worker: the controller holds every report
        return
    record = {nodeid: round(s, 1) for nodeid, s in sorted(_seconds.items()) if s >= RECORDED_MIN_S}
    path = Path(target)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n")
    temporary.replace(path)
