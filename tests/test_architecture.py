"""Data flows one way: the package's import graph (every import, also those inside functions)
has no cycles between modules and no layer imports one above it."""

from __future__ import annotations

import ast
from pathlib import Path

import tape_train

PACKAGE = Path(tape_train.__file__).parent
# A layer may import only layers to its left (and itself). Top-level helper modules
# (hints, config, host_memory, loading) sit below the layers that use them.
LAYERS = ["kernels", "model", "parallel", "data", "train", "eval", "inference", "cluster"]
MAY_NOT_IMPORT = {
    "model": {"parallel", "train", "eval", "inference", "cluster", "data"},
    "kernels": {"model", "parallel", "train", "eval", "inference", "cluster", "data"},
    "parallel": {"train", "eval", "inference", "cluster"},
    "data": {"model", "parallel", "train", "eval", "inference"},
    "eval": {"train", "inference"},
    "inference": {"train", "eval"},
    "loading": {"train", "eval", "inference", "parallel"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycles_between_modules():
    # A package's __init__ importing its own submodules is not a cycle of the design.
    graph = {m: {d for d in deps if not (m.endswith(tuple(LAYERS)) and d.startswith(m + "."))
                 and not d == m.rsplit(".", 1)[0]}
             for m, deps in import_graph().items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_layer_reaches_back():
    bad = []
    for module, deps in import_graph().items():
        forbidden = MAY_NOT_IMPORT.get(layer_of(module), set())
        bad += [f"{module} imports {d}" for d in sorted(deps) if layer_of(d) in forbidden]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_reach_back():
    """Negative control: the graph does contain the edges the rules are about."""
    graph = import_graph()
    assert "tape_train.loading" in graph["tape_train.train.checkpoint"]
    assert "tape_train.model.cache" in graph["tape_train.model.generate"]
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
