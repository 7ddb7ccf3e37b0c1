"""How the suite's tests are spread over pytest-xdist's workers (``make test``: ``--dist loadfile
--no-loadscope-reorder``), so that two cores finish it soon. Nothing here changes what any test checks.

- **A module's tests run on one worker** (``--dist loadfile``): a module-scoped fixture (a DDP fit, a trained
  checkpoint, a fuzz corpus) is built once, not once on each worker that draws one of its tests. (The suite
  used ``--dist loadgroup`` with an ``xdist_group`` per module before: with pytest 9 the group that
  pytest-xdist 3.8 appends to a test's id no longer reaches the id, so every test was its own unit and a module
  fixture was built on both workers; ``test_suite_schedule.py`` runs the schedule to show it holds.)
- **The heaviest work goes first** (longest processing time first). Modules are ordered by their recorded cost
  in ``tests/durations.json`` (the sum of their tests'), heaviest first; a test with no record counts as free,
  and a module with none keeps its place after the recorded ones. The short modules then fill in beside the long
  ones instead of one long module running alone at the end. A stale record only makes the order less good,
  never a test wrong.

``make test-durations`` records the costs: with ``LIGHTNING_ENERGY_RECORD_DURATIONS=FILE`` set, the
controller sums each test's setup, call and teardown seconds and writes those of at least
:data:`RECORDED_MIN_S` to ``FILE``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS_FILE = Path(__file__).with_name("durations.json")
RECORD_ENV = "LIGHTNING_ENERGY_RECORD_DURATIONS"
RECORDED_MIN_S = 0.5  # shorter tests are left out of the record: they only fill in


def work_unit(nodeid: str) -> str:
    """What ``--dist loadfile`` keeps on one worker: the test's file."""
    return nodeid.split("::", 1)[0]


def recorded_costs(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """Seconds per test node id from ``path``; empty where there is no readable record."""
    try:
        costs = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(costs, dict):
        return {}
    return {str(k): float(v) for k, v in costs.items() if isinstance(v, (int, float))}


def heaviest_first(items: list[pytest.Item], costs: dict[str, float]) -> list[pytest.Item]:
    """``items`` ordered by the cost of their module (:func:`work_unit`), heaviest first; ties (unrecorded
    modules among them) keep their order, and a module's tests keep theirs."""
    unit_cost: dict[str, float] = defaultdict(float)
    for item in items:
        unit_cost[work_unit(item.nodeid)] += costs.get(item.nodeid, 0.0)
    return sorted(items, key=lambda item: -unit_cost[work_unit(item.nodeid)])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = heaviest_first(items, recorded_costs())


_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get(RECORD_ENV):
        _seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get(RECORD_ENV)
    if not target or hasattr(session.config, "workerinput"):  # a worker: the controller holds every report
        return
    record = {nodeid: round(s, 1) for nodeid, s in sorted(_seconds.items()) if s >= RECORDED_MIN_S}
    path = Path(target)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n")
    temporary.replace(path)
