from schemas.events import Assignment, PlaceJob
from streams.folds.cluster_metrics import metrics, typical_from_requests
from streams.folds.node_view import evolve
from tests.builders import Clock, inventory, job


def place(c, node, job_id, slices, duration=None):
    return c.env(PlaceJob(command_id=f"c-{job_id}", job_id=job_id, tenant="t", node=node, assignments=slices,
                          duration_s=duration), "scheduler")


def test_allocation_free_by_model_and_busy_card_release_time():
    c = Clock()
    a = inventory("a", model="A100-80GB", gpus=2, rack="r1")
    t = inventory("t", model="T4", gpus=1, rack="r2")
    va = evolve(evolve(None, c.env(a, "a/inventory")),
                place(c, "a", "j1", (Assignment(gpu_uuid=a.gpus[0].uuid, milli=700, memory_mib=1024),), duration=30))
    vt = evolve(None, c.env(t, "t/inventory"))
    m = metrics([va, vt])
    assert m["capacity_milli"] == 3000 and m["allocated_milli"] == 700 and m["allocation_permille"] == 233
    assert m["free_milli_by_model"] == {"A100-80GB": 1300, "T4": 1000}
    assert m["free_milli_by_rack"] == {"r1": 1300, "r2": 1000}
    assert m["whole_free_cards_by_model"] == {"A100-80GB": 1, "T4": 1}
    busy = [card for card in va.card_free() if card.milli < 1000]
    assert busy[0].release_ms == c.now + 30_000


def test_fgd_fragmentation_counts_free_slivers_no_typical_job_can_use():
    c = Clock()
    a = inventory("a", model="A100-80GB", gpus=2)
    v = evolve(None, c.env(a, "a/inventory"))
    for i, card in enumerate(a.gpus):
        v = evolve(v, place(c, "a", f"j{i}", (Assignment(gpu_uuid=card.uuid, milli=700, memory_mib=1024),)))
    # every typical job wants half a card: the two 300-milli slivers are fragmented
    typical = typical_from_requests([job(f"x{i}", compute=500, mem_gib=4) for i in range(10)])
    m = metrics([v], typical)
    assert m["free_milli"] == 600 and m["fragmentation_milli"] == 600 and m["fragmentation_permille"] == 1000
    # jobs of a fifth of a card can use them: no fragmentation
    small = typical_from_requests([job(f"y{i}", compute=200, mem_gib=4) for i in range(10)])
    assert metrics([v], small)["fragmentation_milli"] == 0


def test_mig_card_cut_in_seven_is_not_a_free_card():
    c = Clock()
    inv = inventory("m", model="A100-40GB", gpus=1, mig=["1g.5gb"] * 7)
    m = metrics([evolve(None, c.env(inv, "m/inventory"))])
    assert m["whole_free_cards_by_model"] == {} and m["free_milli"] == 7 * 142


def test_a_removed_node_is_listed_as_removed_and_leaves_the_pools_capacity():
    """`node remove` decommissions a node for good: the scheduler stops placing there, and `gpupool node list`, the
    node gauges and the cluster figures must say so too (found on the live stack: the node was listed "ready" with
    its cards free after its removal, its agent still reporting)."""
    from schemas.events import NodeRemoved
    from streams.edge.api import node_doc, node_state
    from streams.edge.metrics import fleet_families

    c = Clock()
    a = inventory("a", model="A100-80GB", gpus=2, rack="r1")
    b = inventory("b", model="A100-80GB", gpus=2, rack="r1")
    va = evolve(evolve(None, c.env(a, "a/inventory")), c.env(NodeRemoved(node="a"), "operator"))
    va = evolve(va, c.env(a, "a/inventory"))  # its agent still reports: no way back but a re-add
    vb = evolve(None, c.env(b, "b/inventory"))
    assert va.removed and node_state(va) == "removed" and node_doc(va)["state"] == "removed"
    assert node_state(vb) == "ready"
    m = metrics([va, vb])
    assert m["nodes"] == 1 and m["capacity_milli"] == 2000 and m["free_milli_by_model"] == {"A100-80GB": 2000}
    states = {s.labels["state"]: s.value for f in fleet_families([va, vb]) if f.name.endswith("nodes")
              for s in f.samples}
    assert states["removed"] == 1 and states["ready"] == 1, states
    capacity = {s.labels["gpu_model"]: s.value for f in fleet_families([va, vb]) if f.name.endswith("gpu_capacity")
                for s in f.samples}
    assert capacity == {"A100-80GB": 2.0}, capacity


def test_the_node_and_card_series_an_alert_names_are_per_node_and_per_card():
    """The alerting rules (infra/prometheus/alerts.yml) name the node that is down and the card out of service:
    `gpupool_node_state{node,state}` is 1 for each node in its state, `gpupool_card_healthy{node,gpu,gpu_model}` 1
    or 0 per card; the fleet counts by state include `not-admitted` (a state `node_state` gives)."""
    from schemas.events import GpuHealth, NodeAdmitted, NodeLiveness
    from streams.edge.metrics import NODE_STATES, fleet_families

    c = Clock()
    a = inventory("a", model="A100-80GB", gpus=2)
    b = inventory("b", model="T4", gpus=1)
    n = inventory("n", model="T4", gpus=1)
    va = evolve(evolve(None, c.env(a, "a/inventory")), c.env(NodeLiveness(node="a", alive=True,
                                                                          last_heartbeat_ms=c.now), "liveness"))
    va = evolve(va, c.env(GpuHealth(node="a", gpu_uuid=a.gpus[1].uuid, healthy=False, reason="Xid 79"), "a/health"))
    vb = evolve(evolve(None, c.env(b, "b/inventory")), c.env(NodeLiveness(node="b", alive=True,
                                                                          last_heartbeat_ms=c.now), "liveness"))
    vb = evolve(vb, c.env(NodeLiveness(node="b", alive=False, last_heartbeat_ms=c.now + 1), "liveness", dt=10))
    vn = evolve(evolve(None, c.env(n, "n/inventory")), c.env(NodeLiveness(node="n", alive=True,
                                                                          last_heartbeat_ms=c.now), "liveness"))
    vn = evolve(vn, c.env(NodeAdmitted(node="n", admitted=False), "operator"))
    fams = {f.name: f for f in fleet_families([va, vb, vn])}
    state = {(s.labels["node"], s.labels["state"]): s.value for s in fams["gpupool_node_state"].samples}
    assert state == {("a", "ready"): 1, ("b", "down"): 1, ("n", "not-admitted"): 1}, state
    health = {(s.labels["node"], s.labels["gpu"], s.labels["gpu_model"]): s.value
              for s in fams["gpupool_card_healthy"].samples}
    assert health == {("a", a.gpus[0].uuid, "A100-80GB"): 1, ("a", a.gpus[1].uuid, "A100-80GB"): 0,
                      ("b", b.gpus[0].uuid, "T4"): 1, ("n", n.gpus[0].uuid, "T4"): 1}, health
    counts = {s.labels["state"]: s.value for s in fams["gpupool_nodes"].samples}
    assert set(counts) == set(NODE_STATES)
    assert (counts["ready"], counts["down"], counts["not-admitted"], counts["cordoned"]) == (1, 1, 1, 0), counts
    cards = {s.labels["health"]: s.value for s in fams["gpupool_cards"].samples}
    assert cards == {"healthy": 3, "unhealthy": 1}, cards
