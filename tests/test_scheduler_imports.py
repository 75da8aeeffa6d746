"""The scheduler's modules depend on one another one way (#34 items 2 and 4): no import cycle among
agents/scheduler/*.py, and none hidden behind an import inside a function (core imports elastic; elastic never
imports core, so `ElasticScheduler` lives in core)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "agents" / "scheduler"


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(sibling module imported, whether the import sits inside a function or class body) for one module."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "agents.scheduler":
                names = [a.name for a in node.names]
            elif node.module.startswith("agents.scheduler."):
                names = [node.module.split(".")[2]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[2] for a in node.names if a.name.startswith("agents.scheduler.")]
        out += [(n, id(node) not in top) for n in names if (PKG / f"{n}.py").exists()]
    return out


def graph(pkg: Path = PKG) -> dict[str, list[tuple[str, bool]]]:
    return {p.stem: _imports(p) for p in sorted(pkg.glob("*.py"))}


def cycle(g: dict[str, list[tuple[str, bool]]]) -> list[str] | None:
    """One import cycle of the graph (module names, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n, _ in g.get(m, ()):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                got = visit(n)
                if got:
                    return got
        stack.pop()
        state[m] = 2
        return None

    for m in g:
        if m not in state:
            got = visit(m)
            if got:
                return got
    return None


def test_no_function_level_import_of_a_sibling_module():
    inner = [(m, n) for m, deps in graph().items() for n, nested in deps if nested and n != m]
    assert inner == [], f"imports of scheduler modules inside functions (a hidden cycle?): {inner}"


def test_the_scheduler_modules_import_one_way():
    assert cycle(graph()) is None


def test_the_cycle_check_finds_a_planted_cycle(tmp_path):
    """The check can fail: elastic importing core back, inside a function (what it did), is found."""
    for p in PKG.glob("*.py"):
        (tmp_path / p.name).write_text(p.read_text())
    el = tmp_path / "elastic.py"
    el.write_text(el.read_text() + "\n\ndef _back():\n    from agents.scheduler.core import Scheduler\n"
                                   "    return Scheduler\n")
    g = graph(tmp_path)
    assert ("core", True) in g["elastic"]
    got = cycle(g)
    assert got is not None and "core" in got and "elastic" in got
