"""schemas <- pure core <- edges: the core imports only schemas, the core itself and the standard library (plus
numpy for FGD's measure); no Faust, aiokafka, ClickHouse, asyncio, clock or randomness. The simulator's packing
policies (agents/sim/packing.py) are as pure, and the core never imports them. Parsed from source, so it fails on
the first violating import."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = sorted((REPO / "schemas").glob("*.py"))
CORE = [REPO / p for p in ("streams/node_view.py", "agents/scheduler/preemption.py", "streams/cluster_metrics.py", "streams/job_view.py", "streams/rows.py", "streams/telemetry_history.py",
                           "agents/scheduler/core.py", "agents/scheduler/placement.py", "agents/scheduler/quota.py",
                           "agents/scheduler/fgd_measure.py", "agents/scheduler/victims.py", "agents/scheduler/admission.py", "agents/scheduler/claims.py", "agents/scheduler/holdings.py", "agents/scheduler/defrag.py",
                           "agents/node/fencing.py")]
SIM_PURE = [REPO / "agents/sim/packing.py"]  # offline only: pure like the core, but no core module imports it
CORE_MODULES = {"streams.node_view", "agents.scheduler.preemption", "streams.cluster_metrics", "streams.job_view", "streams.rows", "streams.telemetry_history", "agents.scheduler.core",
                "agents.scheduler.placement", "agents.scheduler.quota", "agents.scheduler.fgd_measure",
                "agents.scheduler.node_index", "agents.scheduler.scoring", "agents.scheduler.topology",
                "agents.scheduler.reservations", "agents.scheduler.autoscaler", "agents.scheduler.elastic",
                "agents.scheduler.victims", "agents.scheduler.admission", "agents.scheduler.holdings", "agents.scheduler.claims", "agents.scheduler.defrag"}
CORE_MODULES |= {"agents.scheduler.fgd_measure"}
PACKAGES = {"streams", "agents", "agents.scheduler", "agents.node", "schemas", "infra"}
FORBIDDEN = {"faust", "aiokafka", "clickhouse_connect", "chdb", "asyncio", "time", "random", "datetime", "socket",
             "subprocess", "os", "infra", "pynvml", "requests", "urllib"}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in PACKAGES:  # `from streams import node_view` imports the module streams.node_view
                out.update(f"{node.module}.{a.name}" for a in node.names)
            else:
                out.add(node.module)
    return out


def test_schemas_import_nothing_of_gpupool_but_schemas():
    for path in SCHEMAS:
        for mod in imports(path):
            top = mod.split(".")[0]
            assert top not in {"streams", "agents", "infra"}, f"{path.name} imports {mod}"
            assert top not in FORBIDDEN - {"os"}, f"{path.name} imports {mod}"


def test_core_imports_only_schemas_core_and_stdlib():
    for path in CORE + SIM_PURE:
        assert path.exists(), path
        for mod in imports(path):
            top = mod.split(".")[0]
            assert top not in FORBIDDEN, f"{path.relative_to(REPO)} imports {mod}"
            if top in {"streams", "agents"}:
                assert mod in CORE_MODULES, f"{path.relative_to(REPO)} imports edge module {mod}"


def test_scheduler_and_streams_never_import_the_simulator():
    """The live scheduler and the stream processors use FGD's measure (agents/scheduler/fgd_measure.py) at most; the
    offline packing policies and the trace replay stay in agents/sim."""
    for path in sorted((REPO / "agents/scheduler").glob("*.py")) + sorted((REPO / "streams").glob("*.py")):
        for mod in imports(path):
            assert not mod.startswith("agents.sim"), f"{path.relative_to(REPO)} imports {mod}"


# Every module of the scheduler's package is core but the live agent and its snapshots (the Kafka edges: they read
# and write topics, pickle the state); the core may import only what
# is allowed here -- the standard library's pure modules named, pydantic, numpy, orjson (the codec), the schemas and
# other core modules -- so a new import must be allowed on purpose.
SCHEDULER_EDGES = {"agent.py", "snapshot.py"}
ALLOWED_TOPS = {"__future__", "array", "dataclasses", "typing", "collections", "enum", "bisect", "functools", "itertools",
                "heapq", "math", "abc", "numpy", "pydantic", "orjson", "schemas"}


def core_files() -> list[Path]:
    sched = [p for p in sorted((REPO / "agents/scheduler").glob("*.py")) if p.name not in SCHEDULER_EDGES]
    return sorted(set(sched) | set(CORE) | set(SIM_PURE))


def test_every_scheduler_module_is_core_and_imports_only_what_is_allowed():
    for path in core_files():
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if path.parent == REPO / "agents/scheduler" and path.name != "__init__.py":
            assert name in CORE_MODULES, f"{name} is in the core package but not listed as core"
        for mod in imports(path):
            top = mod.split(".")[0]
            if top in {"streams", "agents"}:
                assert mod in CORE_MODULES, f"{path.relative_to(REPO)} imports edge module {mod}"
            else:
                assert top in ALLOWED_TOPS, f"{path.relative_to(REPO)} imports {mod}, which the core does not allow"


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
