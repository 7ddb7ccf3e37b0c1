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
# the product modules allowed to reach the simulator: a sweep with `sensors: simulated` is a documented dry run
SIMULATOR_USERS = {"lightning_energy.sweep.config", "lightning_energy.sweep.runner"}
# the only modules that may reach another package's private names (one function per use, version named)
PRIVATE_USE_MODULES = {"lightning_energy.integration.lightning_internals",
                       "lightning_energy.measure.zeus_codecarbon_internals"}


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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_private_names(sources) -> set[str]:
    """The private names lightning_energy defines itself: functions, classes, variables, ``self._x``
    attributes, import aliases, and attributes it sets on its own functions and classes."""
    trees = [ast.parse(source) for source in sources]
    defined = {node.name for tree in trees for node in ast.walk(tree)
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own = set(defined)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", *defined}):
                own.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
    return {name for name in own if _private(name)}


def private_uses(source: str, own: set[str]) -> list[str]:
    """Another package's private names reached in ``source``: ``x._name`` (not on self or cls), ``getattr(x,
    "_name")`` and its kin, ``from pkg import _name``, ``import pkg._module``; names in ``own`` excepted."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if _private(node.attr) and node.attr not in own and not on_self:
                found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            if _private(node.args[1].value) and node.args[1].value not in own:
                found.append(f"line {node.lineno}: {node.func.id} {node.args[1].value}")
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("lightning_energy"):
            names = [*(node.module or "").split("."), *(alias.name for alias in node.names)]
            found.extend(f"line {node.lineno}: import {name}" for name in names if _private(name))
        elif isinstance(node, ast.Import):
            found.extend(f"line {node.lineno}: import {alias.name}" for alias in node.names
                         if not alias.name.startswith("lightning_energy") and any(map(_private, alias.name.split("."))))
    return found


SOURCES = {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
OWN_PRIVATE = own_private_names(SOURCES.values()) | {m.rsplit(".", 1)[-1] for m in SOURCES if _private(m.rsplit(".", 1)[-1])}


def private_use_violations(sources: dict[str, str], own: set[str]) -> list[str]:
    return [f"{m} {use}" for m, source in sources.items() if m not in PRIVATE_USE_MODULES
            for use in private_uses(source, own)]


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


def test_private_names_of_other_packages_only_in_the_internals_modules():
    assert private_use_violations(SOURCES, OWN_PRIVATE) == []
    # the walk sees them where they are allowed (guards against passing on a blind walk)
    allowed = private_uses(SOURCES["lightning_energy.integration.lightning_internals"], OWN_PRIVATE)
    assert any("_batches_that_stepped" in use for use in allowed) and any("_should_accumulate" in use for use in allowed)


@pytest.mark.parametrize("source", [
    "def f(trainer):\n    return trainer.fit_loop.epoch_loop._batches_that_stepped",
    "def f(trainer):\n    return getattr(trainer._logger_connector, 'x', None)",
    "def f(trainer):\n    return getattr(trainer, '_logger_connector', None)",
    "from lightning.fabric.plugins.precision.utils import _convert_fp_tensor",
    "import zeus.device.gpu._private_module",
])
def test_the_private_use_rule_catches_a_breach(source):
    breaches = private_use_violations({"lightning_energy.callbacks.energy": source}, OWN_PRIVATE)
    assert len(breaches) == 1
    # ... and allows our own private names: self._x, our functions, attributes set on our functions
    own = "def f(self, timeline):\n    self._x = 1\n    return timeline._deliver, _report(self)"
    assert private_use_violations({"lightning_energy.callbacks.energy": own}, OWN_PRIVATE) == []


def prints(source: str) -> list[tuple[str | None, int]]:
    """(enclosing function, line) of every ``print(...)`` call in ``source``."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "print":
                found.append((function, child.lineno))
            visit(child, inner)

    visit(ast.parse(source), None)
    return found


# print() is for the CLI's output, a callback's end-of-fit report (on_fit_end, `verbose=True`), the terminal
# question of the forecast's budget check and the BSO server launcher (a command); library messages use logging
PRINT_ALLOWED = {("lightning_energy.callbacks.forecast", "ask_yes_no"), ("lightning_energy.optimize.bso_server", "serve"),
                 ("lightning_energy.optimize.bso_server", "main")}


def print_violations(sources: dict[str, str]) -> list[str]:
    return [f"{m} line {line}: print in {function}" for m, source in sources.items()
            if not _inside(m, "lightning_energy.cli") for function, line in prints(source)
            if (m, function) not in PRINT_ALLOWED and not (_inside(m, "lightning_energy.callbacks") and function == "on_fit_end")]


def test_library_messages_are_logged_not_printed():
    assert print_violations(SOURCES) == []
    assert len(prints(SOURCES["lightning_energy.callbacks.energy"])) == 1  # the walk sees the report's print


@pytest.mark.parametrize(("module", "source"), [
    ("lightning_energy.callbacks.energy", "def on_train_epoch_end(self):\n    print('epoch done')"),
    ("lightning_energy.measure.sampler", "print('sampler started')"),
])
def test_the_print_rule_catches_a_breach(module, source):
    assert len(print_violations({module: source})) == 1
    assert print_violations({"lightning_energy.cli.commands.fit": source}) == []


def test_lightning_hooks_are_marked_override():
    """Every Lightning hook a class of ours defines carries ``@override`` (a renamed hook then fails loudly in
    type checkers instead of never being called). This check imports the modules it looks at."""
    import importlib
    import inspect
    import pkgutil

    import lightning.pytorch as pl

    unmarked, seen = [], 0
    for package in ("lightning_energy.callbacks", "lightning_energy.integration", "lightning_energy.testing"):
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            module = importlib.import_module(f"{package}.{info.name}")
            for cls in vars(module).values():
                if not (inspect.isclass(cls) and cls.__module__ == module.__name__):
                    continue
                for base in (pl.Callback, pl.LightningModule):
                    if issubclass(cls, base):
                        hooks = [n for n, f in vars(cls).items() if callable(f) and not n.startswith("_") and hasattr(base, n)]
                        seen += len(hooks)
                        unmarked += [f"{cls.__qualname__}.{n}" for n in hooks if not getattr(vars(cls)[n], "__override__", False)]
    assert seen > 50 and unmarked == []


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


def test_the_former_sweep_modules_names_import_from_the_sweep_package():
    """``lightning_energy.sweep`` was one module; its public API now lives in ``sweep.config`` and
    ``sweep.runner`` and stays importable from the package (without importing Lightning until used)."""
    import subprocess
    import sys

    import lightning_energy.sweep as sweep
    from lightning_energy.sweep import config, runner

    names = ("AXES", "SweepConfig", "SweepConfigError", "load_config", "parse_config", "SweepError",
             "per_step_figures", "run_one", "run_sweep", "summarise", "sweep_order")
    homes = {name: config if hasattr(config, name) else runner for name in names}
    assert all(getattr(sweep, name) is getattr(homes[name], name) for name in names)
    with pytest.raises(AttributeError):
        sweep.no_such_name  # noqa: B018
    probe = "import sys, lightning_energy.sweep as s; s.parse_config; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
