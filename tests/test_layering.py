"""The layers of docs/architecture.md, parsed from source (every module, recursively; every import, at the top of a
module or inside a function alike):

    schemas  <-  streams.folds  <-  agents.scheduler  <-  edges (infra; agents.node; agents.sim; streams.edge;
                                                          agents' own modules; agents.cli; bench)

- each layer imports only the layers its row of LAYERS allows (a module belongs to the layer of the longest package
  prefix that names it; a module in no layer fails, so a new package is placed on purpose);
- the pure layers (schemas, the folds, the scheduler, and three pure modules beside their edges) import only what
  PURE_TOPS allows: no Faust, aiokafka, ClickHouse, asyncio, clock, randomness, files or sockets;
- no import cycle between modules, nor between packages, counting imports made inside functions.

Each check is a function over a tree, so the tests at the end plant each kind of violation in a small tree of their
own and show the check names it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("schemas", "streams", "agents", "infra", "bench")

# layer -> the other layers it may import (its own always). Read top to bottom: each layer sits on those above it.
LAYERS: dict[str, tuple[str, ...]] = {
    "schemas": (),
    "streams": (),  # the namespace package streams/ itself: a docstring
    "streams.folds": ("schemas",),
    "agents.scheduler": ("schemas", "streams.folds"),
    "infra": ("schemas",),
    "agents.node": ("schemas", "streams.folds", "infra"),
    "agents.sim": ("schemas", "streams.folds", "agents.scheduler", "agents.node", "infra"),
    "streams.edge": ("schemas", "streams.folds", "agents.scheduler", "infra"),
    "agents": ("schemas", "streams.folds", "agents.scheduler", "agents.node", "streams.edge", "infra"),
    "agents.cli": ("schemas", "streams.folds", "agents.scheduler", "agents.node", "agents.sim", "streams.edge", "infra",
                   "agents"),
    "bench": ("schemas", "streams.folds", "agents.scheduler", "agents.node", "agents.sim", "streams.edge", "infra",
              "agents"),
}
NAMESPACES = ("streams",)  # a layer of its own module only: what sits below it is in its subpackages' layers
PURE_LAYERS = ("schemas", "streams.folds", "agents.scheduler")
# Pure modules that live beside their edges on purpose: the node agents' fencing rule and share limits/watch, and
# the simulator's baseline packing policies (offline only).
PURE_BESIDE_EDGES = ("agents.node.fencing", "agents.node.shares", "agents.sim.packing")
# What the pure layers may import from outside gpupool, allowed on purpose (a new import fails here until it is
# added): the standard library's pure modules named, pydantic, numpy (FGD's measure), orjson (the codec). hashlib:
# a finished job's request fingerprint (BLAKE2b, deterministic in every process, unlike hash()); zlib: crc32, a pure
# hash (the rendezvous port's starting point).
PURE_TOPS = {"__future__", "array", "dataclasses", "typing", "collections", "enum", "bisect", "functools", "itertools",
             "heapq", "math", "abc", "numpy", "pydantic", "orjson", "hashlib", "zlib"}
# schemas also parse and describe themselves: names, times, ids, their own JSON Schema files
SCHEMA_TOPS = PURE_TOPS | {"re", "json", "os", "pathlib", "sys", "datetime", "uuid", "annotated_types",
                           "typing_extensions"}


def modules(root: Path) -> dict[str, Path]:
    """Every module of gpupool under root, by dotted name, found recursively."""
    out = {}
    for top in ROOTS:
        for p in sorted((root / top).rglob("*.py")):
            out[".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = p
    return out


def imports(path: Path, mods) -> set[str]:
    """Every import of the file, wherever it stands (top level or inside a function): gpupool modules by their name
    (`from pkg import mod` imports pkg.mod; `from mod import name` imports mod), others by their dotted name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(_known(a.name, mods) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.add("<relative import>")
                continue
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(mods)
            out |= subs
            if len(subs) < len(node.names):
                out.add(_known(node.module, mods))
    return out


def _known(name: str, mods) -> str:
    """`import a.b.c` names the gpupool module a.b.c, or the deepest gpupool package above it; others as written."""
    n = name
    while n and n not in mods:
        n = n.rpartition(".")[0]
    return n or name


def layer_of(mod: str) -> str | None:
    best = None
    for layer in LAYERS:
        below = mod.startswith(layer + ".") and layer not in NAMESPACES
        if (mod == layer or below) and (best is None or len(layer) > len(best)):
            best = layer
    return best


def _gpupool(mod: str) -> bool:
    return mod.split(".")[0] in ROOTS


def layer_violations(root: Path) -> list[str]:
    mods = modules(root)
    out = []
    for m, p in mods.items():
        own = layer_of(m)
        if own is None:
            out.append(f"{m}: in no layer (place its package in LAYERS)")
            continue
        for i in sorted(imports(p, mods)):
            if i == "<relative import>":
                out.append(f"{m}: a relative import (gpupool imports name their module)")
            elif _gpupool(i) and (lay := layer_of(i)) != own and lay not in LAYERS[own]:
                out.append(f"{m} ({own}) imports {i} ({lay})")
    return out


def purity_violations(root: Path) -> list[str]:
    mods = modules(root)
    out = []
    for m, p in mods.items():
        lay = layer_of(m)
        if lay not in PURE_LAYERS and m not in PURE_BESIDE_EDGES:
            continue
        allowed = SCHEMA_TOPS if lay == "schemas" else PURE_TOPS
        for i in sorted(imports(p, mods)):
            if _gpupool(i):
                if m in PURE_BESIDE_EDGES and layer_of(i) not in PURE_LAYERS and i not in PURE_BESIDE_EDGES:
                    out.append(f"{m} (pure) imports the edge module {i}")
            elif i.split(".")[0] not in allowed:
                out.append(f"{m} (pure) imports {i}")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_violations(root: Path) -> list[str]:
    mods = modules(root)
    graph = {m: {i for i in imports(p, mods) if i in mods and i != m} for m, p in mods.items()}

    def package(m):
        return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]

    packages: dict[str, set[str]] = {}
    for m, deps in graph.items():
        packages.setdefault(package(m), set()).update(package(d) for d in deps if package(d) != package(m))
    return ([f"module import cycle: {' <-> '.join(c)}" for c in _cycles(graph)]
            + [f"package import cycle: {' <-> '.join(c)}" for c in _cycles(packages)])


# ---------------------------------------------------------------- the tree as it is


def test_every_module_sits_in_a_layer_and_imports_only_the_layers_below():
    assert len(modules(REPO)) > 100, "the tree is found, recursively"
    assert layer_violations(REPO) == []


def test_the_pure_layers_import_no_io_clock_or_randomness():
    pure = [m for m in modules(REPO) if layer_of(m) in PURE_LAYERS or m in PURE_BESIDE_EDGES]
    assert {layer_of(m) for m in pure} >= set(PURE_LAYERS) and len(pure) >= 40
    assert purity_violations(REPO) == []


def test_no_import_cycles_between_modules_or_packages():
    assert cycle_violations(REPO) == []


def test_the_edges_that_do_io_are_outside_the_pure_layers():
    """The Faust worker, the scheduler's live agent and snapshots, the sink: they import Kafka or asyncio, and they
    sit in streams.edge, not in a pure layer."""
    mods = modules(REPO)
    for edge in ("streams.edge.app", "streams.edge.scheduler_agent", "streams.edge.scheduler_snapshot",
                 "streams.edge.sink"):
        assert layer_of(edge) == "streams.edge"
        assert {"asyncio", "faust", "aiokafka"} & {i.split(".")[0] for i in imports(mods[edge], mods)}, edge


# ---------------------------------------------------------------- each check fails on a planted violation


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A small tree shaped like gpupool's, clean, with `files` (path -> source) written over it."""
    base = {
        "schemas/__init__.py": "", "schemas/events.py": "import pydantic\n",
        "streams/__init__.py": "", "streams/folds/__init__.py": "",
        "streams/folds/view.py": "from schemas import events\n",
        "streams/edge/__init__.py": "", "streams/edge/app.py": "import asyncio\nfrom streams.folds import view\n",
        "agents/__init__.py": "", "agents/scheduler/__init__.py": "",
        "agents/scheduler/core.py": "from streams.folds.view import x\nfrom agents.scheduler import policy\n",
        "agents/scheduler/policy.py": "import math\n",
        "agents/cli/__init__.py": "from agents.scheduler import core\nfrom streams.edge import app\n",
        "infra/__init__.py": "import os\n", "bench/__init__.py": "",
    }
    for path, src in {**base, **files}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(src)
    return root


def test_the_planted_tree_is_clean(tmp_path):
    root = _tree(tmp_path, {})
    assert (layer_violations(root), purity_violations(root), cycle_violations(root)) == ([], [], [])


@pytest.mark.parametrize("path, src, named", [
    ("streams/folds/view.py", "from streams.edge import app\n", "streams.folds.view (streams.folds) imports "
                                                                 "streams.edge.app (streams.edge)"),
    ("streams/folds/view.py", "def f():\n    from agents.scheduler import core\n",
     "streams.folds.view (streams.folds) imports agents.scheduler.core"),  # upward, inside a function
    ("schemas/events.py", "import infra\n", "schemas.events (schemas) imports infra (infra)"),
    ("agents/scheduler/deep/nested/x.py", "from agents.cli import y\n", "agents.scheduler.deep.nested.x"),  # found
    ("newpkg_is_not_scanned.py", "import faust\n", None),  # outside the roots: not gpupool
    ("bench/tool.py", "from agents.cli import main\n", "bench.tool (bench) imports agents.cli"),
    ("agents/node/agent.py", "from . import fencing\n", "a relative import"),
    ("streams/lost/x.py", "", "streams.lost.x: in no layer"),
])
def test_the_layer_check_names_a_planted_violation(tmp_path, path, src, named):
    found = layer_violations(_tree(tmp_path, {path: src}))
    if named is None:
        assert found == []
    else:
        assert any(named in v for v in found), found


@pytest.mark.parametrize("path, src, named", [
    ("streams/folds/view.py", "import time\n", "streams.folds.view (pure) imports time"),
    ("agents/scheduler/policy.py", "def f():\n    import random\n", "agents.scheduler.policy (pure) imports random"),
    ("agents/scheduler/policy.py", "import faust.tables\n", "imports faust.tables"),
    ("schemas/events.py", "import socket\n", "schemas.events (pure) imports socket"),
    ("streams/folds/sub/deep.py", "from aiokafka import AIOKafkaProducer\n", "streams.folds.sub.deep (pure)"),
    ("agents/node/fencing.py", "import asyncio\n", "agents.node.fencing (pure) imports asyncio"),
    ("agents/node/fencing.py", "from agents.node import runner\n", "fencing (pure) imports the edge module"),
])
def test_the_purity_check_names_a_planted_violation(tmp_path, path, src, named):
    root = _tree(tmp_path, {"agents/node/__init__.py": "", "agents/node/runner.py": "import subprocess\n",
                            path: src})
    found = purity_violations(root)
    assert any(named in v for v in found), found


@pytest.mark.parametrize("files, named", [
    ({"agents/scheduler/policy.py": "from agents.scheduler import core\n"},
     "module import cycle: agents.scheduler.core <-> agents.scheduler.policy"),
    ({"agents/scheduler/policy.py": "def late():\n    from agents.scheduler.core import replay\n"},
     "module import cycle: agents.scheduler.core <-> agents.scheduler.policy"),  # hidden in a function
    ({"streams/folds/view.py": "from schemas import events\n\ndef f():\n    import agents.scheduler.policy\n"},
     "package import cycle: agents.scheduler <-> streams.folds"),
])
def test_the_cycle_check_names_a_planted_cycle(tmp_path, files, named):
    found = cycle_violations(_tree(tmp_path, files))
    assert named in found, found
