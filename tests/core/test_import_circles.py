"""No import circle anywhere in ``src/attnkit``.

The graph counts every import in a file, a function's own included (a lazy import is still a
circle); a circle is a strongly connected component of more than one module. The modules never
import :mod:`attnkit.interop` (it re-exports their torch boundary), and the bench's result
types have a module of their own (:mod:`attnkit.bench.results`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import attnkit
import attnkit.interop
import attnkit.interop.torch_mha
from attnkit.modules.attention import MultiHeadAttention, TorchMultiheadAttention
from attnkit.modules.torch_masks import mask_from_torch

ROOT = Path(attnkit.__file__).resolve().parent
GUARDED = ("attnkit",)  # every module of the package


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its file."""
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import mod` imports the module pkg.mod; `from pkg import name`
                # reads pkg itself
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_circle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [{"a", "b", "c"}]


def test_no_circle_anywhere_in_the_package() -> None:
    graph = _graph()
    assert "attnkit.bench.results" in graph  # the graph reads the package it guards
    assert "attnkit.bench.results" in graph["attnkit.bench.report"]
    assert "attnkit.bench.results" in graph["attnkit.bench.runner"]
    bad = [sorted(c) for c in _circles(graph) if any(m.startswith(GUARDED) for m in c)]
    assert bad == []


def test_the_modules_never_import_interop() -> None:
    graph = _graph()
    for name, imports in graph.items():
        if name.startswith("attnkit.modules"):
            assert not [m for m in imports if m.startswith("attnkit.interop")], name


def test_interop_re_exports_the_modules_torch_boundary() -> None:
    assert attnkit.interop.mask_from_torch is mask_from_torch
    assert attnkit.interop.TorchMultiheadAttention is TorchMultiheadAttention
    assert attnkit.interop.torch_mha.mask_from_torch is mask_from_torch
    assert attnkit.interop.torch_mha.from_torch is MultiHeadAttention.from_torch
    assert attnkit.interop.torch_mha.to_torch is MultiHeadAttention.to_torch
