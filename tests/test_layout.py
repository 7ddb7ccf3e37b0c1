"""The package layout's rules, checked by walking every module's imports (ast; nothing is imported).

measure/ is the bottom layer (no Lightning, nothing of lightning_energy above it); analysis/ is offline and
never imports a callback; product code never imports the test doubles in lightning_energy.testing; and
module-level imports form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_energy"
# below or beside measure/: plain helpers with no lightning_energy import of their own
FOUNDATION = {"lightning_energy.provenance", "lightning_energy.units"}
# the one product module allowed to reach the simulator: a sweep with `sensors: simulated` is a documented dry run
SIMULATOR_USERS = {"lightning_energy.sweep.runner"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import in ``source``; ``from a import b`` counts as
    ``a.b`` where that is a module of ``known``. Imports under ``if TYPE_CHECKING:`` are left out."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, top)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.append((full if full in known else base, top))
            inner_top = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner_top)

    visit(ast.parse(source), True)
    return found


def _graph() -> dict[str, list[tuple[str, bool]]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", known)
            for name, path in paths.items()}


GRAPH = _graph()


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def measure_violations(graph) -> list[str]:
    return [f"{m} imports {t}" for m, targets in graph.items() if _inside(m, "lightning_energy.measure")
            for t, _ in targets
            if (_inside(t, "lightning_energy") and not _inside(t, "lightning_energy.measure") and t not in FOUNDATION)
            or _inside(t, "lightning") or _inside(t, "pytorch_lightning")]


def analysis_violations(graph) -> list[str]:
    return [f"{m} imports {t}" for m, targets in graph.items() if _inside(m, "lightning_energy.analysis")
            for t, _ in targets if _inside(t, "lightning_energy.callbacks")]


def doubles_violations(graph) -> list[str]:
    return [f"{m} imports {t}" for m, targets in graph.items()
            if not _inside(m, "lightning_energy.testing") and m not in SIMULATOR_USERS
            for t, _ in targets if _inside(t, "lightning_energy.testing")]


def cycles(graph) -> list[list[str]]:
    """Every cycle of module-level imports among lightning_energy modules (one per strongly connected set)."""
    edges = {m: sorted({t for t, top in targets if top and t in graph and t != m}) for m, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_the_walk_sees_the_imports():
    """Guards the checks below against passing on an empty graph."""
    assert len(GRAPH) > 60
    energy = {t for t, _ in GRAPH["lightning_energy.callbacks.energy"]}
    assert {"lightning_energy.measure.meter", "lightning_energy.integration.base"} <= energy
    assert ("lightning_energy.measure.ranks", True) in GRAPH["lightning_energy.callbacks.energy"]  # from a import b


def test_measure_imports_nothing_above_it_and_no_lightning():
    assert measure_violations(GRAPH) == []


def test_analysis_imports_no_callback():
    assert analysis_violations(GRAPH) == []


def test_product_code_never_imports_the_test_doubles():
    assert doubles_violations(GRAPH) == []


def test_no_import_cycles():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(("check", "module", "source"), [
    (measure_violations, "lightning_energy.measure.meter", "from lightning_energy.integration import timeline"),
    (measure_violations, "lightning_energy.measure.meter", "def f():\n    import lightning.pytorch"),
    (analysis_violations, "lightning_energy.analysis.runs", "from lightning_energy.callbacks.energy import X"),
    (doubles_violations, "lightning_energy.callbacks.power_limit",
     "def f():\n    from lightning_energy.testing import gpu_sim"),
])
def test_each_rule_catches_a_breach(check, module, source):
    known = {"lightning_energy.integration.timeline", "lightning_energy.testing.gpu_sim"}
    graph = {module: imports_of(source, module, False, known)}
    assert len(check(graph)) == 1


def test_a_cycle_is_found():
    graph = {"a": [("b", True)], "b": [("c", True)], "c": [("a", True)], "d": [("a", False)]}
    assert cycles(graph) == [["a", "b", "c"]]
    graph["c"] = [("a", False)]  # an import inside a function breaks no import-time cycle
    assert cycles(graph) == []


@pytest.mark.parametrize("old", sorted(__import__("lightning_energy._moved", fromlist=["MOVED"]).MOVED))
def test_old_module_paths_still_import_with_a_deprecation_warning(old, monkeypatch):
    import importlib
    import sys

    from lightning_energy._moved import MOVED

    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=old.replace(".", r"\.")):
        alias = importlib.import_module(old)
    new = importlib.import_module(MOVED[old][0])
    public = [name for name in vars(new) if not name.startswith("_")]
    assert public and all(getattr(alias, name) is getattr(new, name) for name in public)
    with pytest.raises(AttributeError):
        alias.no_such_name  # noqa: B018


def test_old_sensors_package_keeps_the_simulated_sensor(monkeypatch):
    import importlib
    import sys

    from lightning_energy import SimulatedSensor
    from lightning_energy.measure.sensors import Sensor

    monkeypatch.delitem(sys.modules, "lightning_energy.sensors", raising=False)
    with pytest.warns(DeprecationWarning):
        old = importlib.import_module("lightning_energy.sensors")
    assert old.SimulatedSensor is SimulatedSensor and old.Sensor is Sensor
