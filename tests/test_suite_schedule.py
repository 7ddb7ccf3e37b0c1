"""The suite's schedule (tests/suite_schedule.py): heaviest work first, a module's fixture built on one worker."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import suite_schedule
from suite_schedule import heaviest_first, recorded_costs


def item(nodeid):
    return SimpleNamespace(nodeid=nodeid)


def test_units_go_heaviest_first_and_a_group_keeps_its_order():
    items = [item(n) for n in ("a::1", "a::2", "b::1", "c::1", "d::1")]
    groups = {"a::1": "a", "a::2": "a"}
    costs = {"a::1": 1.0, "a::2": 2.5, "b::1": 4.0, "c::1": 0.2}  # d unrecorded: free, keeps its place last
    assert [i.nodeid for i in heaviest_first(items, groups, costs)] == ["b::1", "a::1", "a::2", "c::1", "d::1"]


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
    collected = {i.nodeid.split("@")[0] for i in request.session.items}
    if len(collected) < 500:
        pytest.skip("only part of the suite is collected in this run")
    assert len(recorded & collected) >= 0.8 * len(recorded)


def test_a_test_without_a_module_fixture_is_its_own_unit(request):
    assert suite_schedule.module_fixture_group(request.node) is None


@pytest.fixture(scope="module")
def built_once():
    return object()


def test_uses_a_module_fixture(built_once, request):
    assert suite_schedule.module_fixture_group(request.node) == request.node.module.__name__
    assert any(m.name == "xdist_group" for m in request.node.iter_markers())
