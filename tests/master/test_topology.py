"""Topology (kvstore.topology, kvstore.master.locality): the distance between two sites, the
scores and orders built on it, and placement, read order and re-replication through the
master's verbs with a fake clock."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.master.locality import Locality, NearPlacer, closeness, order_replicas, spread_cost
from kvstore.master.membership import Membership, Node
from kvstore.master.rpc_verbs import HANDLERS
from kvstore.master.service import MasterConfig, MasterService
from kvstore.master.table import Replica
from kvstore.master.tiering import TierConfig
from kvstore.topology import FAR, NOWHERE, SAME_HOST, SAME_RACK, SAME_ZONE, Site, distance
from kvstore.types import ObjectInfo, PutTicket, SegmentSpec
from tests.master.fakes import FakeClock

KIB = 1024
H1 = Site("h1", "r1", "z1")


# ================================================================ sites and distances
@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        (H1, Site("h1", "r1", "z1"), SAME_HOST),
        (H1, Site("h2", "r1", "z1"), SAME_RACK),
        (H1, Site("h2", "r2", "z1"), SAME_ZONE),
        (H1, Site("h2", "r1", "z2"), FAR),  # a rack's name means nothing in another zone
        (Site("h1"), Site("h2"), SAME_RACK),  # nothing declared: one default rack
        (NOWHERE, NOWHERE, SAME_RACK),  # a host that said nothing is nobody's host
        (Site("h1"), Site("h1", "r1"), SAME_ZONE),
    ],
)
def test_distance(a: Site, b: Site, want: int) -> None:
    assert distance(a, b) == distance(b, a) == want
    assert closeness(a, b) == FAR - want


def test_a_site_is_declared_by_argument_then_environment_then_hostname() -> None:
    env = {"KVSTORE_HOST_ID": "eh", "KVSTORE_RACK": "er", "KVSTORE_ZONE": "ez"}
    assert Site.declared(environ=env) == Site("eh", "er", "ez")
    assert Site.declared("h", "r", None, environ=env) == Site("h", "r", "ez")
    bare = Site.declared(environ={})
    assert bare.host_id and (bare.rack, bare.zone) == ("", "")


@pytest.mark.parametrize(
    "wire", [None, "h1", ["h1", "r1"], ["h1", "r1", 3], ["h" * 129, "", ""], {"host_id": "h"}]
)
def test_a_bad_site_is_refused(wire: object) -> None:
    with pytest.raises(InvalidRequestError):
        Site.from_wire(wire)


def test_a_site_round_trips_its_wire_form() -> None:
    assert Site.from_wire(H1.to_wire()) == H1


# ================================================================ scores and orders
def _node(node_id: str, site: Site) -> Node:
    return Node(node_id, "127.0.0.1", 9000, b"s" * 32, {}, 0.0, site=site)


def test_spread_cost_is_the_closeness_of_the_nearest_chosen_node() -> None:
    n = _node("a", H1)
    assert spread_cost(n, []) == 0
    assert spread_cost(n, [_node("b", Site("h9", "r9", "z9"))]) == 0
    assert spread_cost(n, [_node("b", Site("h2", "r2", "z1"))]) == 1
    assert spread_cost(n, [_node("b", Site("h2", "r2", "z1")), _node("c", H1)]) == 3


def test_replicas_are_ordered_nearest_first_and_ties_keep_their_order() -> None:
    replicas = [Replica(n, "dram", 0, 1, 0, "dram") for n in ("far", "rack", "far2", "host")]
    near = {"far": FAR, "rack": SAME_RACK, "far2": FAR, "host": SAME_HOST}
    assert [r.node_id for r in order_replicas(replicas, near)] == ["host", "rack", "far", "far2"]


def _membership(*sites: Site) -> Membership:
    m = Membership(MasterConfig(), FakeClock())
    for i, site in enumerate(sites):
        node = m.admit(
            f"n{i}", "127.0.0.1", 9000 + i, b"s" * 32, [SegmentSpec("dram", "dram", KIB)], site=site
        )
        m.add(node)
    return m


def test_a_cluster_on_one_site_gives_no_view_and_nothing_to_spread() -> None:
    locality = Locality(_membership(H1, H1, H1))
    assert locality.view(H1) is None and locality.view(Site("elsewhere")) is None
    assert not locality.spread
    assert locality.placer(H1, lambda tier: 0.9) is None


def test_a_view_is_none_where_every_node_is_as_far_and_follows_membership() -> None:
    m = _membership(Site("h1", "r1"), Site("h2", "r1"))
    locality = Locality(m)
    assert locality.spread
    assert locality.view(Site("h9", "r1")) is None  # both in its rack, neither its host
    assert locality.view(Site("h1", "r1")) == {"n0": SAME_HOST, "n1": SAME_RACK}
    m.remove("n0", set())
    assert locality.view(Site("h1", "r1")) is None  # one node left: nothing to prefer
    assert isinstance(locality.placer(None, lambda tier: 0.9), type(None))


def test_near_placer_scores_spread_then_tier_then_nearness_within_the_mark() -> None:
    m = _membership(Site("h1", "r1"), Site("h2", "r1"), Site("h3", "r2"))
    n0, n1, n2 = (m.nodes[f"n{i}"] for i in range(3))
    seg = n0.segments["dram"]
    placer = NearPlacer({"n0": SAME_HOST, "n1": SAME_RACK, "n2": SAME_ZONE}, lambda t: 0.5)
    assert placer.score(n0, seg, 256, [])[:3] == (0, 1, SAME_HOST)
    # Over its high watermark (half of 1 KiB) nearness no longer counts.
    assert placer.score(n0, seg, 768, [])[2] == FAR + 1
    # A second replica: another rack beats the writer's rack.
    assert placer.score(n1, n1.segments["dram"], 64, [n0])[0] == 2
    assert placer.score(n2, n2.segments["dram"], 64, [n0])[0] == 1
    segments = [[n.segments["dram"]] for n in (n0, n1, n2)]
    assert placer.best(64, [n0, n1, n2], segments, [])[1] is n0
    assert placer.best(64, [n0, n1, n2], segments, [n0])[1] is n2
    assert [n.node_id for n in placer.ordered([n2, n1, n0], [])] == ["n0", "n1", "n2"]


# ================================================================ through the master's verbs
SITES = {
    "a1": Site("ha1", "ra", "z"),
    "a2": Site("ha2", "ra", "z"),
    "b1": Site("hb1", "rb", "z"),
    "c1": Site("hc1", "rc", "z"),
}


def make(clock: FakeClock, sites: dict[str, Site | None], dram: int = 64 * KIB) -> MasterService:
    svc = MasterService(
        MasterConfig(put_timeout_s=10, node_ttl_s=3, heartbeat_interval_s=1),
        clock,
        clock.wall_ms,
        tiers=TierConfig(high_watermark=0.5, low_watermark=0.4),
    )
    for i, (node_id, site) in enumerate(sites.items()):
        svc.register(
            node_id,
            "127.0.0.1",
            9000 + i,
            bytes([65 + i]) * 32,
            [SegmentSpec("dram", "dram", dram)],
            site=site,
        )
    return svc


def put(svc: MasterService, keys: list[bytes], size: int, at: Site | None, replicas: int = 1):
    tickets = svc.put_start(keys, [size] * len(keys), replicas=replicas, at=at)
    assert all(isinstance(t, PutTicket) for t in tickets), tickets
    assert svc.put_end([t.put_id for t in tickets], [1] * len(keys)) == [None] * len(keys)


def holders(svc: MasterService, key: bytes) -> list[str]:
    return [r.node_id for r in svc.objects[key].replicas]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_put_lands_on_the_writer_s_host_under_its_mark_then_in_its_rack(clock) -> None:
    svc = make(clock, SITES)
    # 4 KiB objects, 64 KiB nodes, high watermark 0.5: 8 objects fill a node to its mark.
    put(svc, [b"k%d" % i for i in range(8)], 4 * KIB, at=SITES["a1"])
    assert {h for i in range(8) for h in holders(svc, b"k%d" % i)} == {"a1"}
    put(svc, [b"m%d" % i for i in range(8)], 4 * KIB, at=SITES["a1"])
    assert {h for i in range(8) for h in holders(svc, b"m%d" % i)} == {"a2"}
    # One at a time (no batch run) goes the same way: both under-mark nodes of the rack are full.
    put(svc, [b"x"], 4 * KIB, at=SITES["a1"])
    assert holders(svc, b"x")[0] in ("b1", "c1")


def test_a_writer_off_every_node_s_host_gets_its_rack(clock) -> None:
    svc = make(clock, SITES)
    put(svc, [b"k%d" % i for i in range(6)], 1 * KIB, at=Site("client", "rb", "z"))
    assert {holders(svc, b"k%d" % i)[0] for i in range(6)} == {"b1"}


def test_replicas_go_to_distinct_racks(clock) -> None:
    svc = make(clock, SITES)
    put(svc, [b"k%d" % i for i in range(12)], 1 * KIB, at=SITES["a1"], replicas=2)
    for i in range(12):
        first, second = holders(svc, b"k%d" % i)
        assert first == "a1"
        assert second in ("b1", "c1"), "the second copy leaves the writer's rack"


def test_replicas_go_to_distinct_zones_before_distinct_racks_of_one_zone(clock) -> None:
    sites = {"a": Site("ha", "r1", "z1"), "b": Site("hb", "r2", "z1"), "c": Site("hc", "r1", "z2")}
    svc = make(clock, sites)
    put(svc, [b"k"], KIB, at=sites["a"], replicas=2)
    assert holders(svc, b"k") == ["a", "c"]


def test_reads_get_the_nearest_replica_first(clock) -> None:
    svc = make(clock, SITES)
    put(svc, [b"k"], KIB, at=SITES["b1"], replicas=3)
    # b1 (the writer's host), then a1 (another rack: first in node order), then c1 (a third
    # rack rather than a1's).
    assert holders(svc, b"k") == ["b1", "a1", "c1"]
    readers = {
        SITES["a1"]: "a1",  # same host
        SITES["a2"]: "a1",  # same rack
        SITES["b1"]: "b1",
        SITES["c1"]: "c1",
        Site("client", "rc", "z"): "c1",  # on no node's host: its rack's copy
    }
    for reader, first in readers.items():
        (info,) = svc.get_locations([b"k"], at=reader)
        assert isinstance(info, ObjectInfo)
        assert info.locations[0].node_id == first, reader
        assert sorted(loc.node_id for loc in info.locations) == ["a1", "b1", "c1"]
    # The wire answer is ordered the same way.
    (wire,) = svc.get_locations_wire([b"k"], at=SITES["c1"])
    assert [loc[0] for loc in wire[1][2]] == ["c1", "b1", "a1"]


def test_without_topology_placement_and_order_are_as_before(clock) -> None:
    plain = make(clock, {"a1": None, "a2": None, "b1": None})
    sited = make(clock, {"a1": Site("h"), "a2": Site("h"), "b1": Site("h")})
    for svc in (plain, sited):
        put(svc, [b"k%d" % i for i in range(20)], KIB, at=Site("h"), replicas=2)
    for i in range(20):
        key = b"k%d" % i
        assert holders(plain, key) == holders(sited, key)
        (a,) = plain.get_locations([key], at=Site("h"))
        (b,) = sited.get_locations([key])
        assert [loc.node_id for loc in a.locations] == [loc.node_id for loc in b.locations]


def test_re_replication_after_a_rack_loss_goes_to_another_rack(clock) -> None:
    svc = make(clock, SITES)
    put(svc, [b"k"], KIB, at=SITES["a1"], replicas=2)
    first, second = holders(svc, b"k")
    assert first == "a1" and second in ("b1", "c1")
    survivor = second
    # Rack a dies (both nodes); the copy left must not be re-made next to the survivor's
    # rack only by chance: it goes to the third rack.
    for _ in range(2):
        clock.now += 2
        for other in svc.nodes:
            if other not in ("a1", "a2"):
                svc.heartbeat(other)
    assert sorted(svc.expire_nodes()) == ["a1", "a2"]
    svc.tick()
    (target,) = [n for n in svc.nodes if svc.tasks.outbox.get(n)]
    assert target != survivor and target in ("b1", "c1")


def test_the_verbs_take_the_site_and_refuse_a_bad_one(clock) -> None:
    svc = make(clock, SITES)
    (ticket,) = HANDLERS["put_start"](
        svc, {"keys": [b"k"], "sizes": [10], "replicas": 2, "at": SITES["c1"].to_wire()}
    )
    assert ticket[0] == 0
    HANDLERS["put_end"](svc, {"put_ids": [ticket[1][0]], "checksums": [1]})
    assert holders(svc, b"k")[0] == "c1"
    (answer,) = HANDLERS["get_locations"](svc, {"keys": [b"k"], "at": SITES["a2"].to_wire()})
    assert answer[1][2][0][0] != "c1"  # the other copy, in another rack, is nearer a2 than c1
    for verb, args in [
        ("put_start", {"keys": [b"j"], "sizes": [1]}),
        ("get_locations", {"keys": [b"k"]}),
        ("register", {}),
    ]:
        with pytest.raises(InvalidRequestError):
            HANDLERS[verb](svc, {**args, "at": ["h", "r"], "site": "nowhere"})
