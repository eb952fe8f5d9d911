"""Package layout: no import cycles between the package's modules (counting imports inside functions too), and
no import of TRL's experimental PPO outside the oracle's tools."""

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "src" / "rlhf_trl"


def _imports(path: Path) -> set[str]:
    """Package modules that ``path`` imports anywhere in its body (``from .x import``, ``from rlhf_trl.x import``);
    a module of a subpackage (``data/``) imports ``from ..x``, and its own siblings are left out."""
    out = set()
    level = 1 if path.parent == PACKAGE else 2
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level != level and node.level:
                continue
            if node.level == level and module:
                out.add(module.split(".")[0])
            elif node.level == level:  # from . import x, y
                out.update(a.name for a in node.names)
            elif module.startswith("rlhf_trl."):
                out.add(module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("rlhf_trl."))
    return out


def test_no_import_cycles():
    names = {q.stem for q in PACKAGE.glob("*.py")} | {q.name for q in PACKAGE.iterdir() if (q / "__init__.py").exists()}
    graph: dict[str, set[str]] = {}
    for p in PACKAGE.rglob("*.py"):  # a subpackage is one node
        node = p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0]
        graph.setdefault(node, set()).update(_imports(p) & names - {node})
    graph.pop("__main__", None)
    cycles = []

    def visit(node, stack):
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack + [nxt])
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert not cycles, f"import cycles: {[' -> '.join(c) for c in cycles]}"


def test_no_trl_experimental_in_the_package():
    hits = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if "trl.experimental" in p.read_text()]
    assert not hits, f"trl.experimental is imported in {hits}"
