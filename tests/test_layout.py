"""The package layout's rules, checked by walking every module's imports (ast; nothing is imported), top-level
imports and those inside functions alike.

The foundation modules (``io``, ``units``, ``fitting``, ...) import nothing of lightning_energy; measure/ is the
bottom layer above them (no Lightning, nothing of lightning_energy above it); core/ (the framework-free measurement
core) reaches no Lightning, no callback and no Trainer glue (``integration``), however deep it imports; optimize/
(decisions in plain Python) imports none of the layers above it; callbacks never import each other (their figures
reach each other through the run's ``Published`` board); analysis/ is offline and never imports a callback; only
the dry runs (the sweep, ``monitor --sensors simulated:``) import the simulators in lightning_energy.simulate;
lightning_energy never imports baler_lit; and the imports of the whole tree (lightning_energy and baler_lit) form
no circle, function-level imports included.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_energy"
PACKAGES = (PACKAGE, ROOT / "baler_lit")
# the lowest layer: plain helpers with no lightning_energy import of their own (any layer may use them)
FOUNDATION = {"lightning_energy.provenance", "lightning_energy.units", "lightning_energy.io",
              "lightning_energy.fitting", "lightning_energy.filenames", "lightning_energy.extras"}
# the product modules allowed to reach the simulators, each a documented dry run: a sweep with `sensors: simulated`,
# `lightning-energy monitor --sensors simulated:...`
SIMULATOR_USERS = {"lightning_energy.sweep.config", "lightning_energy.sweep.runner", "lightning_energy.cli.commands.monitor"}
# the only modules that may reach another package's private names (one function per use, version named)
PRIVATE_USE_MODULES = {"lightning_energy.integration.lightning_internals",
                       "lightning_energy.measure.zeus_codecarbon_internals"}
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")  # torch.distributed is no Lightning
# what the framework-free core must never reach: the Trainer front end
TRAINER_FRONT_END = ("lightning_energy.callbacks", "lightning_energy.integration")
# the layers above optimize/ (decisions in plain Python, tested without a Trainer)
ABOVE_OPTIMIZE = ("lightning_energy.integration", "lightning_energy.analysis", "lightning_energy.outputs",
                  "lightning_energy.callbacks", "lightning_energy.cli", "lightning_energy.sweep")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
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
    """Every module of lightning_energy and baler_lit -> (imported module, at module level)."""
    paths = {module_name(p): p for package in PACKAGES for p in package.rglob("*.py")}
    known = set(paths)
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", known)
            for name, path in paths.items()}


@functools.cache
def graph() -> dict[str, list[tuple[str, bool]]]:
    """The import graph of both packages, built on first use (not at import: every test worker imports this
    module while collecting, and the walk took seconds)."""
    return _graph()


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


@functools.cache
def sources() -> dict[str, str]:
    """The package's sources by module name, read on first use."""
    return {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}


@functools.cache
def own_private() -> set[str]:
    """The package's own private names, found on first use."""
    return own_private_names(sources().values()) | {m.rsplit(".", 1)[-1] for m in sources()
                                                    if _private(m.rsplit(".", 1)[-1])}


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


def simulator_violations(graph) -> list[str]:
    return [f"{m} imports {t}" for m, targets in graph.items()
            if _inside(m, "lightning_energy") and not _inside(m, "lightning_energy.simulate") and m not in SIMULATOR_USERS
            for t, _ in targets if _inside(t, "lightning_energy.simulate")]


def _is_lightning(module: str) -> bool:
    return any(_inside(module, name) for name in LIGHTNING)


def core_violations(graph) -> list[str]:
    """Each Lightning or Trainer-front-end module the core reaches, with the chain of imports that reaches it:
    every lightning_energy module the core imports (at module level or in a function), and every one those
    import in turn, must import no Lightning and be no callback or ``integration`` module."""
    reached_by: dict[str, str | None] = {m: None for m in graph if _inside(m, "lightning_energy.core")}
    queue = sorted(reached_by)
    found = []
    while queue:
        module = queue.pop(0)
        chain = [module]
        while reached_by[chain[-1]] is not None:
            chain.append(reached_by[chain[-1]])
        path = " <- ".join(chain)
        if any(_inside(module, front) for front in TRAINER_FRONT_END):
            found.append(f"{path} (a Trainer front-end module)")
            continue
        for target, _ in graph[module]:
            if _is_lightning(target):
                found.append(f"{path} imports {target}")
            elif target in graph and target not in reached_by:
                reached_by[target] = module
                queue.append(target)
    return found


def cycles(graph, function_level: bool = True) -> list[list[str]]:
    """Every circle of imports among the graph's modules (one per strongly connected set): through imports at
    module level and inside functions alike, or (``function_level=False``) at module level only."""
    edges = {m: sorted({t for t, top in targets if (top or function_level) and t in graph and t != m})
             for m, targets in graph.items()}
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


def callback_violations(graph) -> list[str]:
    """A callback module importing another callback module (or the callbacks package, which serves them all)."""
    return [f"{m} imports {t}" for m, targets in graph.items()
            if _inside(m, "lightning_energy.callbacks") and m != "lightning_energy.callbacks"
            for t, _ in targets if _inside(t, "lightning_energy.callbacks") and t != m]


def foundation_violations(graph) -> list[str]:
    return [f"{m} imports {t}" for m in sorted(FOUNDATION) if m in graph for t, _ in graph[m]
            if _inside(t, "lightning_energy") and t not in FOUNDATION]


def optimize_violations(graph) -> list[str]:
    return [f"{m} imports {t}" for m, targets in graph.items() if _inside(m, "lightning_energy.optimize")
            for t, _ in targets if any(_inside(t, layer) for layer in ABOVE_OPTIMIZE)]


def baler_violations(graph) -> list[str]:
    """lightning_energy knows nothing of Baler: baler_lit may use lightning_energy, never the reverse."""
    return [f"{m} imports {t}" for m, targets in graph.items() if _inside(m, "lightning_energy")
            for t, _ in targets if _inside(t, "baler_lit")]


def test_the_walk_sees_the_imports():
    """Guards the checks below against passing on an empty graph."""
    assert len(graph()) > 60
    energy = {t for t, _ in graph()["lightning_energy.callbacks.energy"]}
    assert {"lightning_energy.core.recorder", "lightning_energy.integration.base"} <= energy
    assert ("lightning_energy.measure.ranks", True) in graph()["lightning_energy.core.recorder"]  # from a import b


def test_measure_imports_nothing_above_it_and_no_lightning():
    assert measure_violations(graph()) == []


def test_analysis_imports_no_callback():
    assert analysis_violations(graph()) == []


def test_only_the_sweep_imports_the_simulators():
    assert simulator_violations(graph()) == []


def test_no_import_circle_in_the_whole_tree_function_level_imports_included():
    assert any(_inside(m, "baler_lit") for m in graph())  # the walk sees both packages
    assert cycles(graph()) == []


def test_the_core_reaches_no_lightning_and_no_trainer_front_end():
    assert any(_inside(m, "lightning_energy.core") for m in graph())  # the walk sees the core
    assert core_violations(graph()) == []


def test_the_core_imports_without_lightning():
    """The same at run time: importing every module of the core loads no Lightning module."""
    import subprocess
    import sys

    core = sorted(m for m in graph() if _inside(m, "lightning_energy.core"))
    probe = (f"import importlib, sys\nfor m in {core!r}:\n    importlib.import_module(m)\n"
             f"print(sorted(n for n in sys.modules if n.split('.')[0] in {LIGHTNING!r}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_callbacks_never_import_another_callback():
    assert callback_violations(graph()) == []


def test_no_import_runs_back_up_the_layers():
    """io and the other foundation modules import nothing above them (io once took ``describe_error`` from
    outputs.worker); optimize/ imports no Trainer glue, no offline analysis and no outputs (it once took a
    Lightning helper through integration, the quadratic fit from analysis and the report's file name from
    outputs)."""
    assert foundation_violations(graph()) == []
    assert optimize_violations(graph()) == []


def test_lightning_energy_never_imports_baler_lit():
    assert baler_violations(graph()) == []


KNOWN = {"lightning_energy.integration.timeline", "lightning_energy.simulate.gpu_sim",
         "lightning_energy.callbacks.carbon", "lightning_energy.outputs.worker", "lightning_energy.analysis.fit"}


@pytest.mark.parametrize(("check", "module", "source"), [
    (measure_violations, "lightning_energy.measure.meter", "from lightning_energy.integration import timeline"),
    (measure_violations, "lightning_energy.measure.meter", "def f():\n    import lightning.pytorch"),
    (analysis_violations, "lightning_energy.analysis.runs", "from lightning_energy.callbacks.energy import X"),
    (simulator_violations, "lightning_energy.callbacks.power_limit",
     "def f():\n    from lightning_energy.simulate import gpu_sim"),
    (callback_violations, "lightning_energy.callbacks.catalog",
     "def f():\n    from lightning_energy.callbacks.carbon import CarbonCallback"),
    (callback_violations, "lightning_energy.callbacks.forecast", "from lightning_energy.callbacks import CarbonCallback"),
    (foundation_violations, "lightning_energy.io", "from lightning_energy.outputs.worker import describe_error"),
    (optimize_violations, "lightning_energy.optimize.power_limit.profile_file",
     "def f():\n    from lightning_energy.analysis.fit import quadratic_fit"),
    (optimize_violations, "lightning_energy.optimize.recommend_config",
     "def f():\n    from lightning_energy.outputs.report import REPORT_FILE"),
    (optimize_violations, "lightning_energy.optimize.recommend",
     "from lightning_energy.integration.lightning_internals import first_batch_size"),
    (baler_violations, "lightning_energy.cli.main", "def f():\n    import baler_lit.cli"),
])
def test_each_rule_catches_a_breach(check, module, source):
    graph = {module: imports_of(source, module, False, KNOWN)}
    assert len(check(graph)) == 1


@pytest.mark.parametrize("source", [
    "import lightning.pytorch as pl",
    "def f():\n    from lightning.fabric import Fabric",
    "import pytorch_lightning",
    "def f():\n    import lightning_fabric.utilities",
    "from lightning_energy.callbacks.energy import EnergyCallback",
    "def f():\n    from lightning_energy.integration.session import attach",
    "from lightning_energy.measure import helper",  # reaches Lightning one module further down
])
def test_the_core_rule_catches_a_breach_at_any_depth(source):
    known = {"lightning_energy.measure.helper", "lightning_energy.callbacks.energy",
             "lightning_energy.integration.session"}
    graph = {"lightning_energy.core.run": imports_of(source, "lightning_energy.core.run", False, known),
             "lightning_energy.measure.helper": [("lightning.fabric.utilities", False)],
             "lightning_energy.callbacks.energy": [], "lightning_energy.integration.session": []}
    assert len(core_violations(graph)) == 1
    allowed = imports_of("import torch.distributed as dist\nimport math", "lightning_energy.core.run", False, set())
    assert core_violations({"lightning_energy.core.run": allowed}) == []


def test_private_names_of_other_packages_only_in_the_internals_modules():
    assert private_use_violations(sources(), own_private()) == []
    # the walk sees them where they are allowed (guards against passing on a blind walk)
    allowed = private_uses(sources()["lightning_energy.integration.lightning_internals"], own_private())
    assert any("_batches_that_stepped" in use for use in allowed) and any("_should_accumulate" in use for use in allowed)


@pytest.mark.parametrize("source", [
    "def f(trainer):\n    return trainer.fit_loop.epoch_loop._batches_that_stepped",
    "def f(trainer):\n    return getattr(trainer._logger_connector, 'x', None)",
    "def f(trainer):\n    return getattr(trainer, '_logger_connector', None)",
    "from lightning.fabric.plugins.precision.utils import _convert_fp_tensor",
    "import zeus.device.gpu._private_module",
])
def test_the_private_use_rule_catches_a_breach(source):
    breaches = private_use_violations({"lightning_energy.callbacks.energy": source}, own_private())
    assert len(breaches) == 1
    # ... and allows our own private names: self._x, our functions, attributes set on our functions
    own = "def f(self, timeline):\n    self._x = 1\n    return timeline._deliver, _report(self)"
    assert private_use_violations({"lightning_energy.callbacks.energy": own}, own_private()) == []


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


# print() is for the CLI's output, a callback's end-of-fit report (on_fit_end, `verbose=True`), any front end's
# end-of-run report table (the core recorder's write_report, `verbose=True`), the terminal question of the
# forecast's budget check and the BSO server launcher (a command); library messages use logging
PRINT_ALLOWED = {("lightning_energy.core.recorder", "write_report"), ("lightning_energy.callbacks.forecast", "ask_yes_no"), ("lightning_energy.optimize.bso_server", "serve"),
                 ("lightning_energy.optimize.bso_server", "main")}


def print_violations(sources: dict[str, str]) -> list[str]:
    return [f"{m} line {line}: print in {function}" for m, source in sources.items()
            if not _inside(m, "lightning_energy.cli") for function, line in prints(source)
            if (m, function) not in PRINT_ALLOWED and not (_inside(m, "lightning_energy.callbacks") and function == "on_fit_end")]


def test_library_messages_are_logged_not_printed():
    assert print_violations(sources()) == []
    assert len(prints(sources()["lightning_energy.core.recorder"])) == 1  # the walk sees the report's print


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
    for package in ("lightning_energy.callbacks", "lightning_energy.integration", "lightning_energy.simulate"):
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
    assert cycles(graph) == cycles(graph, function_level=False) == [["a", "b", "c"]]
    graph["c"] = [("a", False)]  # through an import inside a function: a circle all the same
    assert cycles(graph) == [["a", "b", "c"]] and cycles(graph, function_level=False) == []


def test_a_cycle_through_relative_and_function_level_imports_is_found():
    """baler_lit's circles ran through ``from .cli import ...`` inside a function."""
    known = {"baler_lit.cli", "baler_lit.compress_many"}
    graph = {"baler_lit.cli": imports_of("def f():\n    from .compress_many import compress_many", "baler_lit.cli",
                                         False, known),
             "baler_lit.compress_many": imports_of("def g():\n    from .cli import load_checkpoint",
                                                   "baler_lit.compress_many", False, known)}
    assert cycles(graph) == [["baler_lit.cli", "baler_lit.compress_many"]]


def test_no_alias_serves_a_module_path_from_before_the_layout():
    """The deprecated aliases of a never-released 0.1.0 are gone (no meta-path finder), and so is the old name
    of the simulators' folder; the public names stay at ``lightning_energy.<Name>``."""
    import importlib.util
    import sys

    import lightning_energy
    from lightning_energy.simulate.simulated_sensor import SimulatedSensor

    assert not any(type(finder).__module__.startswith("lightning_energy") for finder in sys.meta_path)
    for old in ("lightning_energy.meter", "lightning_energy.sensors", "lightning_energy.gpu_sim",
                "lightning_energy.callbacks.eta"):
        assert importlib.util.find_spec(old) is None, old
    assert not (PACKAGE / "testing").exists()  # the simulators' folder is named for what it holds
    assert lightning_energy.SimulatedSensor is SimulatedSensor


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
