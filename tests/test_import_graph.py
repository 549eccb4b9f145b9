"""No import cycles in ``tiered_ckpt``: the imports of every module, read with ``ast`` (nothing is imported).

What counts (decided here):

* **Module-level imports form a DAG**, over the whole package. These run when a module is first imported: a
  cycle among them makes the import order matter (a half-initialised module, an ImportError that depends on
  which module a user imports first). Imports under ``if TYPE_CHECKING:`` never run and do not count.
* **Imports inside functions count too.** They defer optional or heavy parts (Megatron's format, tqdm, the CLI's
  subcommands), but a deferred import that closes a loop only hides a dependency that goes both ways (the
  pipeline and the worker used to import each other that way; so did the CLI and ``convert``, ``legacy`` and
  ``source``, ``torch_zip`` and ``lazy_torch``): no cycle may remain, at any level. :data:`REMAINING` names the
  few that are still there, each with the reason and what removes it; the test fails on any other cycle, and on
  an entry of :data:`REMAINING` that no longer is one (so the list only shrinks).

Both ``from tiered_ckpt.x import y`` and relative imports count; ``from . import x`` is an import of the
submodule ``x``. Importing a package's submodule is not counted as importing the package itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tiered_ckpt

ROOT = Path(tiered_ckpt.__file__).parent
PACKAGE = "tiered_ckpt"
CORE = {f"{PACKAGE}.{m}" for m in ("engine", "pipeline", "store", "memory_store", "file_store", "step_read", "drain",
                                   "drain_protocol", "worker")}


# Cycles (through function-level imports) not removed yet: the modules involved -> why, and what removes it.
REMAINING: dict[frozenset[str], str] = {}  # none left; an entry needs the reason and what removes it


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # "from pkg import name": the submodule pkg.name when there is one, else pkg itself
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:  # "tiered_ckpt.x.attr" -> the module that defines it
            name = name.rpartition(".")[0]
        if name and name != module and name.split(".")[0] == PACKAGE:
            out.append(name)
    return out


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def import_graph(*, in_functions: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"

        def visit(body: list[ast.stmt], top: bool, module: str = module, is_package: bool = is_package) -> None:
            for node in body:
                if isinstance(node, ast.If) and _is_type_checking(node):
                    continue
                if isinstance(node, ast.Import | ast.ImportFrom) and (top or in_functions):
                    graph[module].update(_targets(module, is_package, node))
                inner = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
                for handler in getattr(node, "handlers", []):  # try/except bodies
                    inner += handler.body
                nested = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                visit(inner, nested)

        visit(ast.parse(path.read_text(), str(path)).body, True)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path ``a -> ... -> a``) per strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
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
                found.append(_path_in(graph, component, v))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def _path_in(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest cycle through ``start`` inside ``component`` (breadth first)."""
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
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _show(found: list[list[str]]) -> str:
    return "; ".join(" -> ".join(c) for c in found)


def test_the_graph_sees_the_package():
    graph = import_graph(in_functions=False)
    assert f"{PACKAGE}.engine" in graph and CORE <= set(graph)
    assert f"{PACKAGE}.store" in graph[f"{PACKAGE}.drain"]  # relative imports are resolved


def test_module_level_imports_form_a_dag():
    found = cycles(import_graph(in_functions=False))
    assert not found, f"module-level import cycle(s): {_show(found)}"


def _components(graph: dict[str, set[str]]) -> dict[frozenset[str], list[str]]:
    """Each cycle found, keyed by the modules it passes through."""
    return {frozenset(c): c for c in cycles(graph)}


def test_no_import_cycle_even_through_function_level_imports():
    found = _components(import_graph(in_functions=True))
    new = [c for key, c in found.items() if not any(key <= known or known <= key for known in REMAINING)]
    assert not new, f"import cycle(s), function-level imports included: {_show(new)}"
    core = [c for c in found.values() if CORE & set(c)]
    assert not core, f"import cycle(s) through the save/load core: {_show(core)}"


def test_every_remaining_cycle_is_still_one():
    found = set(_components(import_graph(in_functions=True)))
    gone = [" <-> ".join(sorted(known)) for known in REMAINING if not any(known <= key for key in found)]
    assert not gone, f"no longer a cycle, remove it from REMAINING: {'; '.join(gone)}"


def test_function_level_imports_are_in_the_graph():
    # megatron.cli_convert imports the CLI's shared parts only inside its functions
    graph = import_graph(in_functions=True)
    assert f"{PACKAGE}.cli_common" in graph[f"{PACKAGE}.megatron.cli_convert"]
    assert f"{PACKAGE}.cli_common" not in import_graph(in_functions=False)[f"{PACKAGE}.megatron.cli_convert"]


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
