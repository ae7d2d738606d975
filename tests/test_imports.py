"""No import circles among the project's modules: nanorl/*.py, the top-level scripts (train.py, bench.py,
bench_steps.py, gpu_check.py) and examples/*.py. The graph is built from every `import` / `from ... import`
statement in each file's source, including imports inside functions (a lazy import still ties two modules
together: a reader of either must read both). Run: python3 -m pytest -q tests/test_imports.py"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def project_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Module name -> file for every module the graph covers."""
    files = sorted(root.glob("nanorl/*.py")) + sorted(root.glob("examples/*.py"))
    files += [root / name for name in ("train.py", "bench.py", "bench_steps.py", "gpu_check.py")]
    mods = {}
    for f in files:
        if not f.exists():
            continue
        rel = f.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = f
    return mods


def imported_names(tree: ast.AST, module: str) -> set[str]:
    """Every dotted name a module imports, anywhere in its source. `from a import b` yields both `a` and
    `a.b` (b may be a submodule); relative imports are resolved against the module's package."""
    package = module.rsplit(".", 1)[0] if "." in module else ""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*pkg, base] if base else pkg)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (edges to anything outside the project are dropped)."""
    mods = project_modules(root)
    graph = {}
    for name, path in mods.items():
        targets = imported_names(ast.parse(path.read_text(), str(path)), name)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted: every import
    circle lies inside one of them."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_covers_the_project():
    """The graph sees the modules and a known edge (a scan that found nothing would pass vacuously)."""
    graph = import_graph()
    assert {"train", "bench", "gpu_check", "nanorl.policy", "nanorl.batching"} <= set(graph)
    assert "nanorl.policy" in graph["nanorl.batching"]
    assert "nanorl.trajectory" in graph["nanorl.policy"]


def test_find_cycles_sees_a_circle():
    """The cycle finder itself: a planted three-module circle is found, a chain is not."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles():
    """No two project modules import each other, directly or through others."""
    cycles = find_cycles(import_graph())
    assert cycles == [], f"import circles among the project's modules: {cycles}"
