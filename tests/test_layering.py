"""schemas <- pure core <- edges: the core imports only schemas, the core itself and the standard library (plus
numpy for FGD's measure); no Faust, aiokafka, ClickHouse, asyncio, clock or randomness. The simulator's packing
policies (agents/sim/packing.py) are as pure, and the core never imports them. Parsed from source, so it fails on
the first violating import."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = sorted((REPO / "schemas").glob("*.py"))
# The pure core lives in packages that hold nothing else; every module of them is core, found from the tree (a new
# module is core by where it is put, not by being listed). Three pure modules live with their edges on purpose: the
# node agents' fencing rule and share limits/watch, and the simulator's packing policies (offline only: no core
# module imports them).
CORE_PACKAGES = ("agents/scheduler", "streams/core")
CORE_BESIDE_EDGES = ("agents/node/fencing.py", "agents/node/shares.py", "agents/sim/packing.py")
PACKAGES = {"streams", "streams.core", "agents", "agents.scheduler", "agents.node", "agents.sim", "schemas", "infra"}
# What the core may import, allowed on purpose (a new import fails here until it is added): the standard library's
# pure modules named, pydantic, numpy (FGD's measure), orjson (the codec), the schemas and other core modules. No
# Faust, aiokafka, ClickHouse, asyncio, clock, randomness, files or sockets. hashlib: a finished job's request
# fingerprint (holdings.fingerprint, BLAKE2b: deterministic in every process, unlike hash()).
ALLOWED_TOPS = {"__future__", "array", "dataclasses", "typing", "collections", "enum", "bisect", "functools", "itertools",
                "heapq", "math", "abc", "numpy", "pydantic", "orjson", "schemas", "hashlib",
                "zlib"}  # zlib: crc32, a pure hash (the rendezvous port's starting point)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def core_files() -> list[Path]:
    files = [p for pkg in CORE_PACKAGES for p in sorted((REPO / pkg).glob("*.py"))]
    return files + [REPO / p for p in CORE_BESIDE_EDGES]


CORE_MODULES = {_module(p) for p in core_files()} - {"agents.sim.packing"}  # the core never imports the simulator


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in PACKAGES:  # `from streams.core import node_view` imports the module streams.core.node_view
                out.update(f"{node.module}.{a.name}" for a in node.names)
            else:
                out.add(node.module)
    return out


def test_schemas_import_nothing_of_gpupool_but_schemas():
    for path in SCHEMAS:
        for mod in imports(path):
            top = mod.split(".")[0]
            assert top not in {"streams", "agents", "infra"}, f"{path.name} imports {mod}"
            assert top in ALLOWED_TOPS | {"re", "hashlib", "json", "os", "pathlib", "sys", "datetime", "uuid",
                                          "annotated_types", "typing_extensions"}, f"{path.name} imports {mod}"


def test_the_core_packages_hold_only_core_modules_and_import_only_what_is_allowed():
    files = core_files()
    assert {p.parent.relative_to(REPO).as_posix() for p in files} >= set(CORE_PACKAGES)
    assert len(files) >= 25, "the core is found from the tree"
    for path in files:
        assert path.exists(), path
        for mod in imports(path):
            top = mod.split(".")[0]
            if top in {"streams", "agents"}:
                assert mod in CORE_MODULES, f"{path.relative_to(REPO)} imports edge module {mod}"
            else:
                assert top in ALLOWED_TOPS, f"{path.relative_to(REPO)} imports {mod}, which the core does not allow"


def test_the_rule_catches_an_edge_import(tmp_path, monkeypatch):
    """The check above can fail: a core module importing Faust, the clock or an edge module of gpupool is named."""
    bad = tmp_path / "bad.py"
    for line, why in (("import faust", "faust"), ("import time", "time"), ("from streams import app", "streams.app"),
                      ("from streams.scheduler_agent import TP", "streams.scheduler_agent")):
        bad.write_text(line + "\n")
        mods = imports(bad)
        assert why in mods
        top = why.split(".")[0]
        assert (why not in CORE_MODULES) if top in {"streams", "agents"} else (top not in ALLOWED_TOPS)


def test_scheduler_and_streams_never_import_the_simulator():
    """The live scheduler and the stream processors use FGD's measure (agents/scheduler/fgd_measure.py) at most; the
    offline packing policies and the trace replay stay in agents/sim."""
    for path in sorted((REPO / "agents/scheduler").glob("*.py")) + sorted((REPO / "streams").rglob("*.py")):
        for mod in imports(path):
            assert not mod.startswith("agents.sim"), f"{path.relative_to(REPO)} imports {mod}"


def test_edges_live_beside_the_core_not_inside_it():
    """The Faust app, the scheduler's live agent and its snapshots, the sink and the HTTP API import Kafka or
    asyncio: they are edges, and none of them sits in a core package."""
    for path in sorted((REPO / "streams").glob("*.py")) + sorted((REPO / "agents").glob("*.py")):
        if path.name == "__init__.py":
            continue
        assert path.parent.relative_to(REPO).as_posix() not in CORE_PACKAGES
    for edge in ("streams/app.py", "streams/scheduler_agent.py", "streams/scheduler_snapshot.py", "streams/sink.py"):
        assert {"asyncio", "faust", "aiokafka"} & {m.split(".")[0] for m in imports(REPO / edge)}, edge


def _top_level_imports(path: Path, mods) -> set[str]:
    """Imports executed when the module loads (not those inside functions, which run later): `from pkg import mod`
    is an import of the module pkg.mod (the package is then being initialised), `from mod import name` of mod."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(mods)
            out |= subs if subs and len(subs) == len(node.names) else subs | {node.module}
    return out


def test_no_import_cycles():
    mods = {}
    for pkg in ("agents", "streams", "schemas", "infra", "bench"):
        for p in sorted((REPO / pkg).rglob("*.py")):
            mods[".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")] = p
    graph = {m: {i for i in _top_level_imports(p, mods) if i in mods and i != m} for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
