"""The scheduler's modules (#34 items 2 and 4): none imports a sibling inside a function (core imports elastic;
elastic never imports core, so `ElasticScheduler` lives in core) -- import cycles of the whole tree, these modules'
included, are tests/test_layering.py's -- and a JobRecord changes in Holdings only."""
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


def test_no_function_level_import_of_a_sibling_module():
    inner = [(m, n) for m, deps in graph().items() for n, nested in deps if nested and n != m]
    assert inner == [], f"imports of scheduler modules inside functions (a hidden cycle?): {inner}"


def _record_writes(path: Path) -> list[tuple[int, str]]:
    """(line, field) of every assignment to a JobRecord field of something other than `self` in one module, and
    of every dataclasses.replace call (a record rebuilt with changes)."""
    from dataclasses import fields

    from agents.scheduler.holdings import JobRecord

    names = {f.name for f in fields(JobRecord)}
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(e, ast.Attribute) and e.attr in names and \
                        not (isinstance(e.value, ast.Name) and e.value.id == "self"):
                    out.append((e.lineno, e.attr))
                if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Attribute) and e.value.attr == "commands":
                    out.append((e.lineno, "commands[]"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "replace" and \
                node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in ("rec", "record", "o"):
            out.append((node.lineno, "replace"))
    return out


def test_job_records_change_only_in_holdings():
    """#34 item 2: a JobRecord changes in one place -- Holdings (`apply`, `set_phase`, `note`, `commanded`,
    `checkpointed`, the `Nominate` change); the policy and its helpers never assign a record's field."""
    found = {p.name: w for p in sorted(PKG.glob("*.py")) if p.name != "holdings.py" for w in [_record_writes(p)] if w}
    assert found == {}


def test_the_record_write_check_finds_a_planted_write(tmp_path):
    p = tmp_path / "policy.py"
    p.write_text("def f(rec, s):\n    rec.failures += 1\n    s.jobs['j'].phase = 'done'\n"
                 "    rec.commands['c1'] = 1\n    a, rec.node = 1, 'n'\n")
    assert sorted(_record_writes(p)) == [(2, "failures"), (3, "phase"), (4, "commands[]"), (5, "node")]
