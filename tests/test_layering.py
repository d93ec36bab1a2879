"""The tree's structural rules: no .py file over 300 lines, no import cycle among the project's modules, and the
process split's direction (common imports neither engine_core nor frontend; engine_core does not import frontend)."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 300
# The project's code whose imports form the graph (tests/ may import anything).
GRAPH_ROOTS = ("common", "engine_core", "frontend", "bench", "launch.py")
# Not the project's source: virtual environments, caches, VCS data and git-ignored build outputs (copies of ours).
SKIP_DIRS = {"__pycache__", "build", "dist"}
FORBIDDEN = {"common": {"engine_core", "frontend"}, "engine_core": {"frontend"}}


def python_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS and
                       not d.endswith(".egg-info")]  # fmt: skip
        yield from (Path(dirpath) / f for f in filenames if f.endswith(".py"))


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")  # fmt: skip


def import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import, at module level or in a function or class, except under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        # Of an `if TYPE_CHECKING:` only the else branch runs.
        for stmt in child.orelse if isinstance(child, ast.If) and is_type_checking(child.test) else [child]:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                yield stmt
            else:
                yield from import_nodes(stmt)


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute dotted names an import statement imports (`from a import b`: a.b, a module or a name in a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [f"{base}.{alias.name}" if base else alias.name for alias in node.names]


def import_graph(root: Path, roots: tuple[str, ...] = GRAPH_ROOTS) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a import b` counts as a.b when that is a module)."""
    files = [f for r in roots for f in ([root / r] if r.endswith(".py") else python_files(root / r)) if f.exists()]
    modules = {module_name(f, root): f for f in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in import_nodes(tree):
            for name in imported_names(node, module, path.name == "__init__.py"):
                parts = name.split(".")
                # The longest prefix that is one of ours: `import a.b.c` names a.b.c, or a.b if c is not a module.
                target = next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                               if ".".join(parts[:i]) in modules), None)  # fmt: skip
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{src} imports {dst}" for src, dsts in graph.items() for dst in dsts
                  if dst.split(".")[0] in FORBIDDEN.get(src.split(".")[0], set()))  # fmt: skip


def test_no_file_over_300_lines() -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text(encoding="utf-8").splitlines()) for p in python_files(REPO)}
    assert len(sizes) > 50  # the walk found the tree
    over = {path: n for path, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines (split them into well-named modules): {over}"


def test_no_import_cycles() -> None:
    graph = import_graph(REPO)
    assert {"launch", "common.messages", "engine_core.core", "frontend.api.api_server"} <= set(graph)
    assert "common.messages" in graph["engine_core.core"]  # the graph sees real imports
    assert not (found := cycles(graph)), f"import cycles: {found}"


def test_process_split_direction() -> None:
    assert not (found := forbidden_imports(import_graph(REPO))), f"imports against the layering: {found}"


def test_checker_sees_function_level_and_relative_imports_not_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "common"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from common import c\n"
                              "else:\n    import os\n\ndef f():\n    from . import b\n")  # fmt: skip
    (pkg / "b.py").write_text("import common.a\nimport frontend.x\n")
    (pkg / "c.py").write_text("from .a import f\n")
    graph = import_graph(tmp_path, ("common",))
    assert graph == {"common": set(), "common.a": {"common.b"}, "common.b": {"common.a"}, "common.c": {"common.a"}}
    assert cycles(graph) == [["common.a", "common.b"]]  # a -> c only under TYPE_CHECKING: no a <-> c cycle
    (tmp_path / "frontend").mkdir()
    (tmp_path / "frontend" / "x.py").write_text("")
    assert forbidden_imports(import_graph(tmp_path, ("common", "frontend"))) == ["common.b imports frontend.x"]
