"""Simulated fleets: YAML descriptions, MIG layouts under the real placement rules, the openb CSV, scenario faults."""
from __future__ import annotations

from pathlib import Path

import pytest

from agents.node import fleet
from agents.node.fleet import from_openb_csv, from_yaml, load, load_faults, make_node
from schemas.gpu_models import MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES, mig_profile

REPO = Path(__file__).resolve().parent.parent
OPENB_SAMPLE = REPO / "agents/sim/data/openb_nodes_sample.csv"


def write(tmp_path, text: str) -> str:
    p = tmp_path / "fleet.yaml"
    p.write_text(text)
    return str(p)


def layout(inv, card=0):
    return [(i.profile, i.start, i.size) for i in inv.gpus[card].mig_layout]


def assert_valid_placement(card):
    """No two instances overlap, each starts where its profile may, compute within 7 slices."""
    used = [0] * MIG_MEMORY_SLICES
    compute = 0
    for inst in card.mig_layout:
        p = mig_profile(card.model, inst.profile)
        assert inst.start in p.starts and inst.size == p.memory_slices
        for s in range(inst.start, inst.start + inst.size):
            used[s] += 1
        compute += p.compute_slices
    assert max(used) <= 1 and compute <= MIG_COMPUTE_SLICES


# ---------------------------------------------------------------- YAML

def test_yaml_count_prefix_racks_and_datacenters(tmp_path):
    invs = from_yaml(write(tmp_path, """
nodes:
  - {prefix: a100, count: 5, model: A100-80GB, gpus: 8, rack: r, nodes_per_rack: 2, datacenter: dc-east,
     cpu_milli: 96000, memory_mib: 524288}
  - {name: solo, model: T4, gpus: 2, rack: rack-9, datacenter: dc-west}
  - {name: single, count: 1, model: L4, gpus: 1}
"""))
    assert [n.node for n in invs] == ["a100-0", "a100-1", "a100-2", "a100-3", "a100-4", "solo", "single"]
    assert [n.rack for n in invs] == ["r-0", "r-0", "r-1", "r-1", "r-2", "rack-9", "rack-0"]
    assert [n.datacenter for n in invs] == ["dc-east"] * 5 + ["dc-west", "dc-0"]
    a = invs[0]
    assert (a.cpu_milli, a.memory_mib, len(a.gpus)) == (96000, 524288, 8)
    assert {g.model for g in a.gpus} == {"A100-80GB"} and a.gpus[3].memory_mib == 80 * 1024
    assert invs[5].gpus[0].model == "T4" and invs[5].cpu_milli == 64000


def test_card_uuids_are_stable_and_unique(tmp_path):
    text = "nodes:\n  - {prefix: n, count: 3, model: H100-80GB, gpus: 4}\n"
    one, two = from_yaml(write(tmp_path, text)), from_yaml(write(tmp_path, text))
    assert one == two
    uuids = [g.uuid for n in one for g in n.gpus]
    assert len(set(uuids)) == 12 and uuids[0] == "GPU-n-0-0"


def test_nvlink_peers_are_the_other_cards_of_the_same_node(tmp_path):
    invs = from_yaml(write(tmp_path, """
nodes:
  - {prefix: h, count: 2, model: H100-80GB, gpus: 4}
  - {name: pcie, model: A10, gpus: 2, nvlink: false}
  - {name: one, model: A10, gpus: 1}
"""))
    h0, h1, pcie, one = invs
    for card in h0.gpus:
        assert set(card.nvlink_peers) == {g.uuid for g in h0.gpus} - {card.uuid}
        assert card.nvlink_domain == "h-0-nvl"
    assert not set(h0.gpus[0].nvlink_peers) & {g.uuid for g in h1.gpus}  # never across nodes
    assert h1.gpus[0].nvlink_domain == "h-1-nvl"
    assert all(g.nvlink_peers == () and g.nvlink_domain is None for g in pcie.gpus + one.gpus)
    assert [g.numa_node for g in h0.gpus] == [0, 0, 1, 1]


def test_duplicate_node_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="used twice: x"):
        from_yaml(write(tmp_path, "nodes:\n  - {name: x, model: T4, gpus: 1}\n  - {name: x, model: T4, gpus: 1}\n"))


# ---------------------------------------------------------------- MIG layouts

@pytest.mark.parametrize("model,profiles,want", [
    ("A100-40GB", ["3g.20gb", "1g.5gb", "1g.5gb", "1g.5gb"], [("3g.20gb", 0, 4), ("1g.5gb", 4, 1), ("1g.5gb", 5, 1),
                                                            ("1g.5gb", 6, 1)]),
    ("A100-40GB", ["1g.5gb"] * 7, [("1g.5gb", s, 1) for s in range(7)]),
    ("A100-80GB", ["4g.40gb", "3g.40gb"], [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]),
    ("A100-80GB", ["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"], [("2g.20gb", 0, 2), ("2g.20gb", 2, 2),
                                                                ("2g.20gb", 4, 2), ("1g.10gb", 6, 1)]),
    ("H100-80GB", ["3g.40gb", "3g.40gb"], [("3g.40gb", 0, 4), ("3g.40gb", 4, 4)]),
    ("H100-80GB", ["7g.80gb"], [("7g.80gb", 0, 8)]),
    ("H200", ["3g.71gb", "2g.35gb", "1g.18gb"], [("3g.71gb", 0, 4), ("2g.35gb", 4, 2), ("1g.18gb", 6, 1)]),
    ("H200", ["1g.35gb"] * 4, [("1g.35gb", s, 2) for s in (0, 2, 4, 6)]),
    # first-fit would put the 1g at 0 and leave the 4g nowhere: the search finds the real placement
    ("A100-80GB", ["1g.10gb", "4g.40gb"], [("1g.10gb", 4, 1), ("4g.40gb", 0, 4)]),
])
def test_valid_mig_layouts_follow_the_placement_table(tmp_path, model, profiles, want):
    (inv,) = from_yaml(write(tmp_path, f"nodes:\n  - {{name: m, model: {model}, gpus: 2, mig: {profiles}}}\n"))
    for card in inv.gpus:
        assert card.mig_capable and card.mig_enabled
        assert_valid_placement(card)
    assert layout(inv, 0) == layout(inv, 1) == want
    assert [i.uuid for i in inv.gpus[1].mig_layout] == [f"MIG-m-1-{n}" for n in range(len(profiles))]


@pytest.mark.parametrize("model,profiles,why", [
    ("A100-80GB", ["4g.40gb", "4g.40gb"], "needs 8 compute slices, the card has 7"),
    ("A100-40GB", ["1g.5gb"] * 8, "needs 8 compute slices"),
    ("A100-80GB", ["3g.40gb", "3g.40gb", "1g.10gb"], "needs 9 memory slices, the card has 8"),
    ("H200", ["7g.141gb", "1g.18gb"], "needs 8 compute slices"),
    ("H100-80GB", ["4g.40gb", "4g.40gb"], "needs 8 compute slices"),  # two 4g would both need slice 0
    ("A100-40GB", ["1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.5gb"], "needs 9 memory slices"),
    ("A100-40GB", ["3g.40gb"], "no profile '3g.40gb'"),  # an A100-80GB profile on a 40 GB card
    ("H200", ["banana"], "no profile 'banana'"),
    ("T4", ["1g.5gb"], "T4.*has no MIG"),
])
def test_impossible_mig_layouts_are_refused_clearly(tmp_path, model, profiles, why):
    with pytest.raises(ValueError, match=why):
        from_yaml(write(tmp_path, f"nodes:\n  - {{name: bad, model: {model}, gpus: 1, mig: {profiles}}}\n"))


def test_search_moves_earlier_instances_out_of_the_way():
    # 2g.20gb may start at 0, 2 or 4, a 4g.40gb only at 0: listed first, the 2g must not keep slice 0
    inv = make_node("m", "H100-80GB", 1, mig=["2g.20gb", "4g.40gb", "1g.10gb"])
    assert layout(inv) == [("2g.20gb", 4, 2), ("4g.40gb", 0, 4), ("1g.10gb", 6, 1)]
    assert_valid_placement(inv.gpus[0])


# ---------------------------------------------------------------- openb CSV, demo, faults

def test_openb_csv_sample():
    invs = from_openb_csv(OPENB_SAMPLE)
    rows = [r for r in OPENB_SAMPLE.read_text().splitlines()[1:] if r.split(",")[3] != "0"]
    assert len(invs) == len(rows) == 60
    first = invs[0]
    assert (first.node, first.cpu_milli, first.memory_mib, len(first.gpus)) == ("openb-node-0003", 64000, 262144, 2)
    assert first.gpus[0].model == "P100" and first.gpus[0].memory_mib == 16 * 1024
    assert {n.gpus[0].model for n in invs} == {"A10", "G2", "G3", "P100", "T4", "V100M16", "V100M32"}
    assert [n.rack for n in invs[:17:8]] == ["rack-0", "rack-0", "rack-1"]
    assert invs[16].rack == "rack-1" and invs[15].rack == "rack-0"
    assert len(from_openb_csv(OPENB_SAMPLE, limit=5)) == 5
    assert load(str(OPENB_SAMPLE)) == invs and load_faults(str(OPENB_SAMPLE)) == []


def test_demo_fleet():
    invs = load("demo:6")
    assert [n.node for n in invs] == [f"node-{i:03d}" for i in range(6)]
    assert [n.gpus[0].model for n in invs] == ["A100-80GB", "H100-80GB", "A10", "T4", "A100-80GB", "H100-80GB"]
    assert load_faults("demo:6") == []


def test_load_faults_from_the_fleet_file(tmp_path):
    spec = write(tmp_path, """
nodes:
  - {prefix: node, count: 2, model: A100-80GB, gpus: 2}
faults:
  - {at: 10, fault: "ecc:node-1:0"}
  - {at: 2.5, fault: "slow:node-0:2"}
  - {fault: "lose:node-0"}
""")
    assert load_faults(spec) == ["ecc:node-1:0@10", "slow:node-0:2@2.5", "lose:node-0@0"]
    assert [n.node for n in load(spec)] == ["node-0", "node-1"]
    assert load_faults(write(tmp_path, "nodes:\n  - {name: x, model: T4, gpus: 1}\n")) == []
    with pytest.raises(ValueError, match=r"faults\[0\] needs a `fault`"):
        load_faults(write(tmp_path, "nodes: []\nfaults:\n  - {at: 1}\n"))


def test_scenario_fleets_still_load():
    """Every scenario's node list goes through the same builder and meets the placement rules."""
    import yaml

    for path in sorted((REPO / "tests/scenarios").glob("*.yaml")):
        for spec in yaml.safe_load(path.read_text()).get("nodes", []):
            inv = fleet.make_node(spec.get("name", "n"), spec["model"], int(spec["gpus"]), mig=spec.get("mig"))
            for card in inv.gpus:
                assert_valid_placement(card)


@pytest.mark.parametrize("text,message", [
    ("nodes:\n  - {name: a, model: A100X, gpus: 4}\n",
     "nodes[0].model: unknown card model 'A100X' (known: A10, A100-40GB"),
    ("nodes:\n  - {name: a, model: T4, gpus: 4}\n  - {name: b, modle: T4, gpus: 2}\n",
     "nodes[1].modle: unknown field (known: "),
    ("nodes:\n  - {name: a, gpus: 4}\n", "nodes[0].model: required"),
    ("nodes:\n  - {name: a, model: T4, gpus: four}\n", "nodes[0].gpus: 'four' is not an integer"),
    ("nodes:\n  - {name: a, model: T4, gpus: 0}\n", "nodes[0].gpus: 0 is below 1"),
    ("nodes:\n  - {name: a, model: T4, gpus: 2, nvlink: 3}\n", "nodes[0].nvlink: 3 is not bool"),
    ("nodes:\n  - {model: T4, gpus: 2}\n", "nodes[0].name: required (or `prefix` with `count`)"),
    ("nodes:\n  - [T4, 2]\n", "nodes[0]: a mapping of node fields is required"),
    ("nodes: {name: a}\n", "nodes: a list of node entries is required"),
    ("node:\n  - {name: a, model: T4, gpus: 2}\n", "node: unknown field (known: faults, nodes)"),
    ("nodes:\n  - {name: a, model: T4, gpus: 2\n", "not valid YAML"),
    ("nodes:\n  - {name: a, model: T4, gpus: 2, mig: [1g.5gb]}\n", "nodes[0]: MIG layout on a card 0 (T4)"),
])
def test_bad_fleet_input_is_one_line_naming_the_field(tmp_path, text, message):
    spec = tmp_path / "f.yaml"
    spec.write_text(text)
    with pytest.raises(ValueError) as err:
        fleet.load(str(spec))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"fleet {spec}")


def test_names_and_versions_may_be_numbers_and_a_missing_file_is_one_line(tmp_path):
    spec = tmp_path / "f.yaml"
    spec.write_text("nodes:\n  - {prefix: n, count: 2, model: T4, gpus: 1, rack: 3, cuda: 12.4}\n")
    invs = fleet.load(str(spec))
    assert [(i.node, i.rack, i.gpus[0].cuda_version) for i in invs] == [("n-0", "3", "12.4"), ("n-1", "3", "12.4")]
    with pytest.raises(ValueError, match=r"^fleet .*nope.yaml: cannot read it: No such file"):
        fleet.load(str(tmp_path / "nope.yaml"))
    with pytest.raises(ValueError, match="demo:N wants a positive number"):
        fleet.load("demo:x")
    bad = tmp_path / "b.csv"
    bad.write_text("sn,cpu_milli,memory_mib,gpu,model\nx,64000,1024,2,K80\n")
    with pytest.raises(ValueError, match=r"line 2: model: unknown card model 'K80'"):
        fleet.load(str(bad))


def test_the_default_fleet_has_every_kind_of_isolation():
    """`gpupool up`'s default fleet: demo:4 and a node whose A100s are in MIG mode, so a request for a MIG slice can
    be placed on a fresh stack (README)."""
    from agents.node.fleet import default_fleet, demo_fleet, load

    nodes = load("default")
    assert [n.node for n in nodes[:4]] == [n.node for n in demo_fleet(4)]
    mig = [g for n in nodes for g in n.gpus if g.mig_enabled]
    assert {g.model for g in mig} == {"A100-80GB"} and len(mig) == 2
    assert nodes == default_fleet()
