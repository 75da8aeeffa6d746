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
                           "agents/scheduler/fgd_measure.py", "agents/scheduler/victims.py", "agents/scheduler/admission.py",
                           "agents/node/fencing.py")]
SIM_PURE = [REPO / "agents/sim/packing.py"]  # offline only: pure like the core, but no core module imports it
CORE_MODULES = {"streams.node_view", "agents.scheduler.preemption", "streams.cluster_metrics", "streams.job_view", "streams.rows", "streams.telemetry_history", "agents.scheduler.core",
                "agents.scheduler.placement", "agents.scheduler.quota", "agents.scheduler.fgd_measure",
                "agents.scheduler.node_index", "agents.scheduler.scoring", "agents.scheduler.topology",
                "agents.scheduler.reservations", "agents.scheduler.autoscaler", "agents.scheduler.elastic",
                "agents.scheduler.victims", "agents.scheduler.admission"}
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
