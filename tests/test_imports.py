"""The import rules docs/architecture.md states beyond the layers (tests/test_layering.py holds those):

1. No import cycle at any level: between modules (function-level imports included) and between folders.
2. ``analysis/`` works on the neutral view only: no module there imports ``torch.fx`` or names an ONNX graph type
   (``ModelProto``, ``GraphProto``, ``NodeProto``, ...; reading op schemas with ``onnx.defs`` is not a graph).
3. No module reads a private attribute (``x._name``) of a module or class it imported from another folder: make
   the attribute public where it lives, or move the code that needs it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict

from tests.helpers.package_imports import PACKAGE, all_imports, folder, imports, module_name


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _module_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for importer, target, _, _ in all_imports():
        if target != importer:
            edges[importer].add(target)
    return edges


def test_no_import_cycle_between_modules():
    assert not _cycles(_module_edges()), "break each cycle: move what both need below them"


def test_no_import_cycle_between_folders():
    edges: dict[str, set[str]] = defaultdict(set)
    for importer, targets in _module_edges().items():
        for target in targets:
            a, b = folder(importer), folder(target)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):
                edges[a].add(b)
    assert not _cycles(edges)


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


GRAPH_TYPE = re.compile(r"(Model|Graph|Node|Tensor|ValueInfo|Function)Proto$")


def _graph_types(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.fx") or \
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.fx"):
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if node.module != "torch" or a.name == "fx"]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("torch.fx")]
        elif isinstance(node, ast.ImportFrom) and node.module == "onnx":
            found += [(node.lineno, f"onnx.{a.name}") for a in node.names if GRAPH_TYPE.search(a.name)]
        elif isinstance(node, ast.Attribute) and GRAPH_TYPE.search(node.attr):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" \
                and node.attr == "fx":
            found.append((node.lineno, "torch.fx"))
    return found


def test_analysis_holds_no_graph_types():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {what}"
        for path in sorted((PACKAGE / "analysis").rglob("*.py"))
        for line, what in _graph_types(ast.parse(path.read_text()))
    ]
    assert not found, "\n".join(found) + "\nanalysis/ works on the GraphView; move graph code to fx/ or onnx/"


def test_the_graph_type_rule_catches_fx_and_onnx_protos():
    code = "from torch import fx\nimport torch.fx\nfrom onnx import ModelProto\ndef f(m: 'x'): return m.graph.node\n" \
           "def g(n): return isinstance(n, onnx.NodeProto)\n"
    assert [what for _, what in _graph_types(ast.parse(code))] == ["torch.fx", "torch.fx", "onnx.ModelProto",
                                                                   "NodeProto"]


def _private_reads(tree: ast.AST, foreign: set[str]) -> list[tuple[int, str]]:
    """``name._attr`` in ``tree`` where ``name`` is one of the ``foreign`` names (imported from another folder)."""
    return [(node.lineno, f"{node.value.id}.{node.attr}") for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in foreign
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def _foreign(path) -> set[str]:
    """The names a module binds by importing from another folder of the package."""
    home = folder(module_name(path))
    return {name or target.rsplit(".", 1)[1] for _, target, name, _ in imports(path) if folder(target) != home}


def test_no_private_attribute_of_another_folder_is_read():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} reads {what}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, what in _private_reads(ast.parse(path.read_text()), _foreign(path))]
    assert not found, "\n".join(found)


def test_the_private_attribute_rule_catches_a_read():
    tree = ast.parse("def f(scaler):\n    return LossScaler._bounds, scaler._min, guards.__doc__, own._x\n")
    assert [what for _, what in _private_reads(tree, {"LossScaler", "guards"})] == ["LossScaler._bounds"]
