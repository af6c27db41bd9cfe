"""The package's own import graph has no cycle (issue 29, "one-way seams").

Every module under ``dask_lm/`` is parsed with :mod:`ast` (nothing is imported). An edge A -> B is drawn for each
import of a dask_lm module B in A: at module level and inside functions alike, relative imports resolved, and
``from pkg import name`` drawn to ``pkg.name`` when that is a module (else to ``pkg``). Two kinds of import draw no
edge, because neither runs when the importer runs:

- imports under ``if TYPE_CHECKING:`` (for annotations only);
- a function-local import marked on its own line with ``# lazy: <why>``: kept inside the function on purpose, for
  start-up speed (the driver must not import torch when it imports ``dask_lm``; see tests/test_boundary.py).
  Only that marker is honoured: an unmarked function-local import is an edge like any other.

A cycle fails the test with its modules in order.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import dask_lm

PACKAGE = Path(dask_lm.__file__).resolve().parent

LAZY_MARK = "# lazy:"

# no cycle is allowed (the last one, config <-> config_keys, went with the config package, issue 29 part 5); a
# cycle kept on purpose would be named here, with why
ALLOWED_CYCLES: frozenset[frozenset[str]] = frozenset()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that runs, with whether it sits inside a function (``if TYPE_CHECKING:`` bodies
    left out)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit(other, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    def nearest_known(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    out: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "dask_lm" and (hit := nearest_known(alias.name)):
                out.add(hit)
        return out
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != "dask_lm":
        return out
    for alias in node.names:
        if f"{source}.{alias.name}" in known:
            out.add(f"{source}.{alias.name}")  # `from pkg import submodule`
        elif hit := nearest_known(source):
            out.add(hit)
    return out


def import_graph(*, lazy: bool = False) -> dict[str, set[str]]:
    """The module graph; ``lazy``: with the ``# lazy:`` marked imports drawn too (they run when their function
    does). Each test gets its own copy of the graph, parsed once per session."""
    return {name: set(edges) for name, edges in _parsed_graph(lazy).items()}


@functools.cache
def _parsed_graph(lazy: bool) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        edges: set[str] = set()
        for node, in_function in _runtime_imports(ast.parse(source, str(path))):
            if in_function and not lazy and LAZY_MARK in lines[node.lineno - 1]:
                continue
            edges |= _targets(name, path.name == "__init__.py", node, known)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of two or more modules (Tarjan), each as one cycle through
    them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_one_cycle(graph, c) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A path through ``component`` from its first module back to it (breadth first, so a short one)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "dask_lm.engine.policy" in graph
    assert "dask_lm.engine.worker_group" in graph["dask_lm.engine.policy"]


def test_find_cycles_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_submodule_imports_resolve() -> None:
    known = {"dask_lm", "dask_lm.model", "dask_lm.model.device", "dask_lm.comm.progress", "dask_lm.comm"}
    (rel,) = ast.parse("from ..comm import progress").body
    (sub,) = ast.parse("from dask_lm.model import device, nothing").body
    assert isinstance(rel, ast.ImportFrom) and isinstance(sub, ast.ImportFrom)
    assert _targets("dask_lm.model.fused", False, rel, known) == {"dask_lm.comm.progress"}
    device_import = ast.parse("from . import device").body[0]
    assert _targets("dask_lm.model", True, device_import, known) == {  # type: ignore[arg-type]
        "dask_lm.model.device"
    }
    assert _targets("x", False, sub, known) == {"dask_lm.model.device", "dask_lm.model"}


def test_no_import_cycles() -> None:
    cycles = [c for c in find_cycles(import_graph()) if frozenset(c) not in ALLOWED_CYCLES]
    assert not cycles, "import cycles in dask_lm (mark a start-up-speed local import `# lazy: <why>`):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_no_import_cycles_through_lazy_imports() -> None:
    """A ``# lazy:`` import is kept in its function for start-up speed, never to hide a cycle: with those imports
    drawn too, the graph still has none (the batch's Arrow methods call ``data/arrow.py``, which knows columns, not
    the batch type)."""
    cycles = find_cycles(import_graph(lazy=True))
    assert not cycles, "import cycles through `# lazy:` imports:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_modules() -> None:
    """``from dask_lm.x import _name`` is a seam that the importer should not lean on: make the name public in its
    home instead."""
    modules = _modules()
    known = set(modules)
    bad = []
    for name, path in modules.items():
        for node, _ in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                if (
                    alias.name.startswith("_")
                    and not alias.name.startswith("__")
                    and _targets(name, path.name == "__init__.py", node, known)
                ):
                    bad.append(f"{name}:{node.lineno} imports {alias.name}")
    assert not bad, "\n".join(bad)


# The rank side, by package prefix, and the rank halves of the subsystems that keep both halves in one package
# (issue 29, "one home per subsystem"): scoring's and lm-eval's modules that run inside the Dask workers.
RANK_SIDE = ("dask_lm.workers.", "dask_lm.model.", "dask_lm.comm.", "dask_lm.refit.")
SUBSYSTEM_RANK_HALVES = frozenset(
    {"dask_lm.scoring.scorer", "dask_lm.scoring.replicas", "dask_lm.scoring.partitions", "dask_lm.evaluation.requests"}
)
# What the driver submits: each module calls into its rank side on the worker, never the other way
TASK_MODULES = ("dask_lm.workers.tasks", "dask_lm.scoring.tasks", "dask_lm.evaluation.tasks")
# The subsystem packages, above the shared ones
SUBSYSTEMS = ("dask_lm.scoring", "dask_lm.evaluation", "dask_lm.sft")
# The shared packages (and top-level modules) the subsystems are built on: none of them imports a subsystem
SHARED = (
    "dask_lm.engine",
    "dask_lm.jobs",
    "dask_lm.workers",
    "dask_lm.model",
    "dask_lm.comm",
    "dask_lm.refit",
    "dask_lm.data",
    "dask_lm.io",
    "dask_lm.config",
    "dask_lm.losses",
    "dask_lm.compat",
    "dask_lm.errors",
    "dask_lm.interface",
)


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _is_rank_module(module: str) -> bool:
    return module.startswith(RANK_SIDE) or module in SUBSYSTEM_RANK_HALVES


def test_no_rank_module_imports_the_task_entry_points() -> None:
    """``workers/tasks.py`` is what the driver submits: it calls into the rank side, never the other way, so that a
    rank module can be read (and imported) without the task layer above it. Only driver modules import it."""
    graph = import_graph()
    drivers = {"dask_lm.refit.driver"}
    bad = sorted(
        m
        for m, edges in graph.items()
        if "dask_lm.workers.tasks" in edges and m.startswith(RANK_SIDE) and m not in drivers
    )
    assert not bad, bad


def test_no_rank_module_imports_a_subsystem_task_module() -> None:
    """The same for scoring's and lm-eval's task modules (``scoring/tasks.py``, ``evaluation/tasks.py``): no rank
    module, the subsystems' own rank halves included, imports any of the task modules."""
    graph = import_graph()
    assert set(graph) >= SUBSYSTEM_RANK_HALVES, SUBSYSTEM_RANK_HALVES - set(graph)
    drivers = {"dask_lm.refit.driver"}
    bad = sorted(
        f"{m} imports {t}"
        for m, edges in graph.items()
        for t in TASK_MODULES
        if t in edges and _is_rank_module(m) and m not in drivers
    )
    assert not bad, bad


def test_the_shared_packages_import_no_subsystem() -> None:
    """Scoring, lm-eval and SFT sit above the shared packages (the jobs' scaffold, the engine's cluster, the workers'
    plugin state, the model code, ...): a module of ``SHARED`` imports none of ``dask_lm.scoring``,
    ``dask_lm.evaluation`` and ``dask_lm.sft``. (The workers' lease check finds scoring's replicas by name in
    ``sys.modules``, never importing them; ``dask_lm``'s public names and the CLI reach the jobs by name, on first
    use.)"""
    graph = import_graph()
    bad = sorted(
        f"{m} imports {e}" for m, edges in graph.items() if _in(m, SHARED) for e in edges if _in(e, SUBSYSTEMS)
    )
    assert not bad, bad


def test_scoring_does_not_import_evaluation() -> None:
    """lm-eval is built on scoring (its ranks score on scoring's replicas, its engine frees them with scoring's
    task): scoring never imports it back."""
    graph = import_graph()
    bad = sorted(
        f"{m} imports {e}"
        for m, edges in graph.items()
        if _in(m, ("dask_lm.scoring",))
        for e in edges
        if _in(e, ("dask_lm.evaluation",))
    )
    assert not bad, bad


def test_sft_imports_no_other_subsystem() -> None:
    """SFT is built on the shared packages alone (the jobs' scaffold, the Policy): it imports neither scoring nor
    lm-eval."""
    graph = import_graph()
    bad = sorted(
        f"{m} imports {e}"
        for m, edges in graph.items()
        if _in(m, ("dask_lm.sft",))
        for e in edges
        if _in(e, ("dask_lm.scoring", "dask_lm.evaluation"))
    )
    assert not bad, bad


# Refit's driver half: imported by the driver only, so it may import the Policy's driver (docs/internals/layout.md)
REFIT_DRIVER_HALF = {
    "dask_lm.refit.driver": "the refit methods of Policy, a PolicyBase mixin",
    "dask_lm.refit.weight_sync": "NeMo RL's WeightSynchronizer, called on the driver beside refit.driver",
}


def test_no_rank_module_imports_the_driver() -> None:
    """The inverse of the engine's seam: no module of the rank side (``workers/``, ``model/``, ``comm/``, ``refit/``
    but its driver half) imports ``dask_lm.engine``, not even lazily (a ``# lazy:`` import loads the driver on the
    rank all the same). What rank code needs of a check or a figure lives below both sides (``data/``, ``model/``)."""
    graph = import_graph(lazy=True)
    assert set(REFIT_DRIVER_HALF) <= set(graph), set(REFIT_DRIVER_HALF) - set(graph)
    bad = sorted(
        f"{m} imports {e}"
        for m, edges in graph.items()
        if m.startswith(RANK_SIDE) and m not in REFIT_DRIVER_HALF
        for e in edges
        if _in(e, ("dask_lm.engine",))
    )
    assert not bad, "rank code imports the Policy's driver:\n" + "\n".join(bad)
