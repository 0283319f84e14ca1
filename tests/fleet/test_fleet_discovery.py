"""Discovery's pure core: sources, discovery files, the rule for empty answers and failures, and
the plan (register, drain, remove, resume) against the registered workers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.fleet.discovery import (
    DiscoverySource,
    Member,
    Plan,
    Reconciler,
    SourceView,
    address_url,
    observe,
    parse_server,
    parse_source,
    parse_targets,
    target_url,
)

DNS = "dns://replicas.test:8000"
FILE = "file:///etc/kvroute/workers"


def test_sources_parse_as_documented():
    assert parse_source("dns://vllm.default.svc.cluster.local:8000") == DiscoverySource(
        spec="dns://vllm.default.svc.cluster.local:8000", kind="dns", host="vllm.default.svc.cluster.local",
        port=8000)
    assert parse_source("dns://replicas.test:8000?server=127.0.0.1:5353").server == ("127.0.0.1", 5353)
    assert parse_source("dns://Replicas.TEST:8000/").host == "replicas.test"
    assert parse_source(" file:///etc/kvroute/workers ") == DiscoverySource(
        spec="file:///etc/kvroute/workers", kind="file", path="/etc/kvroute/workers")
    assert parse_source("file://workers.txt").path == "workers.txt"


@pytest.mark.parametrize(("spec", "says"), [
    ("http://replicas:8000", "must be dns://NAME:PORT or file://PATH"),
    ("dns://replicas", "needs a name and the replicas' port"),
    ("dns://:8000", "needs a name"),
    ("dns://replicas:0", "port"),
    ("dns://replicas:99999", "port"),
    ("dns://replicas:eighty", "port"),
    ("dns://replicas:8000/v1", "takes no path"),
    ("dns://replicas:8000?srv=1.2.3.4", "unknown option 'srv'"),
    ("dns://replicas:8000?server=dns.google", "must be an IP address"),
    ("dns://replicas:8000?server=1.2.3.4:0", "port must be a number"),
    ("file://", "needs a path"),
])
def test_bad_sources_are_refused_saying_why(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_source(spec)


def test_dns_servers_parse_with_and_without_a_port():
    assert parse_server("10.0.0.10") == ("10.0.0.10", 53)
    assert parse_server("10.0.0.10:5353") == ("10.0.0.10", 5353)
    assert parse_server("[::1]:5353") == ("::1", 5353)
    assert parse_server("[fd00::a]") == ("fd00::a", 53)
    assert parse_server("fd00::a") == ("fd00::a", 53)
    for bad in ("[::1", "[::1]5353", "ns1:53", "10.0.0.10:x", ""):
        with pytest.raises(ValueError):
            parse_server(bad)


def test_addresses_become_worker_urls_ipv6_bracketed():
    assert address_url("10.1.2.3", 8000) == "http://10.1.2.3:8000"
    assert address_url("fd00::1", 8000) == "http://[fd00::1]:8000"


def test_file_entries_are_urls_or_host_port():
    assert target_url("http://gpu0:8000/") == "http://gpu0:8000"
    assert target_url("https://gpu0.example/vllm") == "https://gpu0.example/vllm"
    assert target_url("gpu0:8000") == "http://gpu0:8000"
    assert target_url("[fd00::1]:8000") == "http://[fd00::1]:8000"
    for bad in ("ftp://gpu0:8000", "gpu0:port", "http://:8000", "http://[bad:8000", "http://gpu0:8000?x=1",
                "gpu0:8000 gpu1:8000", "http://gpu0:70000"):
        with pytest.raises(ValueError):
            target_url(bad)


def test_a_file_lists_one_worker_a_line_with_comments_and_blank_lines():
    text = """# the fleet
http://10.0.0.1:8000
  http://10.0.0.2:8000/   # second rack

10.0.0.3:8000
http://10.0.0.1:8000
"""
    assert parse_targets(text) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"}
    assert parse_targets("") == frozenset()
    assert parse_targets("# nobody yet\n\n") == frozenset()
    with pytest.raises(ValueError, match="line 2: 'ftp://x:1'"):
        parse_targets("http://10.0.0.1:8000\nftp://x:1\n")


def test_a_file_may_be_prometheus_file_sd_json():
    text = """[
  {"targets": ["10.0.0.1:8000", "10.0.0.2:8000"], "labels": {"pool": "a"}},
  {"targets": ["https://gpu3.example:8443"]}
]"""
    assert parse_targets(text) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000", "https://gpu3.example:8443"}
    assert parse_targets("[]") == frozenset()
    for bad, says in (('[{"targets": ["x:1"]', "not valid JSON"), ('{"targets": []}', "must be a list"),
                      ('[{"hosts": ["x:1"]}]', "group 1"), ('[{"targets": [1]}]', "group 1"),
                      ('[{"targets": ["x:1"]}, {"targets": ["ftp://y"]}]', "group 2")):
        with pytest.raises(ValueError, match=says):
            parse_targets(bad)


A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def test_a_failed_round_keeps_the_set_and_counts():
    view = observe(SourceView(), frozenset({A, B}), empty_rounds_needed=2)
    failed = observe(view, None, empty_rounds_needed=2)
    assert failed.urls == {A, B} and failed.failures == 1
    assert observe(failed, None, empty_rounds_needed=2).failures == 2
    assert observe(SourceView(), None, empty_rounds_needed=2) == SourceView(failures=1)


def test_a_non_empty_answer_replaces_the_set_at_once():
    view = observe(SourceView(urls=frozenset({A, B}), answered=True, failures=3), frozenset({C}),
                   empty_rounds_needed=2)
    assert view == SourceView(urls=frozenset({C}), answered=True)


def test_an_empty_answer_needs_to_be_repeated_before_it_empties_the_set():
    view = observe(SourceView(), frozenset({A, B}), empty_rounds_needed=2)
    once = observe(view, frozenset(), empty_rounds_needed=2)
    assert once.urls == {A, B} and once.empty_rounds == 1
    # A failure between two empty answers neither counts nor breaks the run.
    failed = observe(once, None, empty_rounds_needed=2)
    assert failed.urls == {A, B}
    twice = observe(failed, frozenset(), empty_rounds_needed=2)
    assert twice.urls == frozenset() and twice.answered
    # A non-empty answer in between starts the count again.
    back = observe(observe(once, frozenset({A}), empty_rounds_needed=2), frozenset(), empty_rounds_needed=2)
    assert back.urls == {A} and back.empty_rounds == 1
    assert observe(view, frozenset(), empty_rounds_needed=1).urls == frozenset()
    assert observe(SourceView(), frozenset(), empty_rounds_needed=3) == SourceView(answered=True)


def member(url: str, source: str = DNS, *, draining: bool = False, inflight: int = 0) -> Member:
    return Member(url.removeprefix("http://"), url, source, draining, inflight)


def test_listed_workers_are_registered_once_and_vanished_ones_drained_then_removed():
    r = Reconciler((DNS,))
    r.observe(DNS, frozenset({A, B}))
    assert r.plan([]) == Plan(register=((A, DNS), (B, DNS)))
    members = [member(A), member(B)]
    assert not r.plan(members)
    r.observe(DNS, frozenset({B, C}))
    plan = r.plan(members)
    assert plan == Plan(register=((C, DNS),), drain=("10.0.0.1:8000",))
    members = [member(A, draining=True, inflight=2), member(B), member(C)]
    r.applied(plan, members)
    assert not r.plan(members)  # still two requests in flight there
    members[0] = member(A, draining=True, inflight=0)
    plan = r.plan(members)
    assert plan == Plan(remove=("10.0.0.1:8000",))
    r.applied(plan, members[1:])
    assert r.drained == set()


def test_a_drained_worker_listed_again_is_resumed():
    r = Reconciler((DNS,))
    r.observe(DNS, frozenset({A}))
    members = [member(A), member(B)]
    plan = r.plan(members)
    assert plan.drain == ("10.0.0.2:8000",)
    r.applied(plan, members)
    r.observe(DNS, frozenset({A, B}))
    plan = r.plan([member(A), member(B, draining=True, inflight=1)])
    assert plan == Plan(resume=("10.0.0.2:8000",))
    r.applied(plan, members)
    assert r.drained == set()


def test_configured_and_admin_workers_are_never_touched():
    r = Reconciler((DNS,))
    r.observe(DNS, frozenset({A}))
    members = [member(A, "config"), member(B, "admin"), member(C, "admin", draining=True)]
    assert not r.plan(members)  # A is already registered (by the config): not registered twice
    r.observe(DNS, frozenset({C}))
    # C was drained by an operator: discovery listing it does not undo that, and A, B stay.
    assert not r.plan(members)


def test_an_operator_drain_of_a_listed_worker_is_not_undone():
    r = Reconciler((DNS,))
    r.observe(DNS, frozenset({A}))
    assert not r.plan([member(A, draining=True)])


def test_a_worker_registered_again_by_the_admin_api_leaves_discovery():
    r = Reconciler((DNS,))
    r.observe(DNS, frozenset({A}))
    plan = r.plan([member(A), member(B)])
    r.applied(plan, [member(A), member(B, draining=True)])
    assert r.drained == {"10.0.0.2:8000"}
    readded = [member(A), member(B, "admin")]
    assert not r.plan(readded)
    r.applied(Plan(), readded)
    assert r.drained == set()


def test_a_discovered_worker_removed_through_the_admin_api_is_registered_again():
    r = Reconciler((DNS,))
    r.observe(DNS, frozenset({A}))
    assert r.plan([]) == Plan(register=((A, DNS),))


def test_several_sources_make_one_fleet():
    r = Reconciler((DNS, FILE))
    r.observe(DNS, frozenset({A, B}))
    r.observe(FILE, frozenset({B, C}))
    assert r.plan([]) == Plan(register=((A, DNS), (B, DNS), (C, FILE)))
    members = [member(A), member(B), member(C, FILE)]
    # B leaves the DNS answer but the file still lists it: it stays, whoever registered it.
    r.observe(DNS, frozenset({A}))
    assert not r.plan(members)
    r.observe(FILE, frozenset({A}))
    assert r.plan(members) == Plan(drain=("10.0.0.2:8000", "10.0.0.3:8000"))
    assert (r.listed(DNS), r.listed(FILE), r.listed("file://other")) == (1, 1, 0)


def test_a_source_that_fails_from_the_start_lists_nothing_and_drains_nothing():
    r = Reconciler((DNS, FILE))
    r.observe(DNS, None)
    r.observe(FILE, frozenset({A}))
    assert r.plan([]) == Plan(register=((A, FILE),))
    r.observe(DNS, None)
    assert not r.plan([member(A, FILE)])
    assert r.views[DNS] == SourceView(failures=2)


urls = st.sampled_from([f"http://10.0.0.{i}:8000" for i in range(1, 7)])
answers = st.one_of(st.none(), st.frozensets(urls, max_size=5))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([DNS, FILE]), answers, st.frozensets(urls, max_size=3)),
                min_size=1, max_size=30),
       st.frozensets(urls, max_size=2))
def test_carrying_out_the_plans_converges_on_what_the_sources_list(rounds, static):
    """A registry that carries out every plan (with requests in flight on some workers) holds,
    after each round, the configured workers untouched plus every listed worker; a worker no
    source lists is draining, and removed once idle."""
    r = Reconciler((DNS, FILE))
    registry: dict[str, Member] = {u.removeprefix("http://"): member(u, "config") for u in static}
    for source, answer, busy in rounds:
        r.observe(source, answer)
        for _ in range(2):  # the drain, then the removal of the idle ones
            plan = r.plan(registry.values())
            for wid in plan.drain:
                m = registry[wid]
                registry[wid] = Member(m.id, m.url, m.source, True, 1 if m.url in busy else 0)
            for wid in plan.resume:
                m = registry[wid]
                registry[wid] = Member(m.id, m.url, m.source, False, m.inflight)
            for wid in plan.remove:
                assert registry[wid].inflight == 0 and registry[wid].draining
                del registry[wid]
            for url, src in plan.register:
                registry[url.removeprefix("http://")] = member(url, src)
            r.applied(plan, registry.values())
        listed = set().union(*(r.views[s].urls for s in r.views))
        for u in static:
            assert registry[u.removeprefix("http://")] == member(u, "config")
        for u in listed:
            m = registry[u.removeprefix("http://")]
            assert m.source == "config" or not m.draining
        for m in registry.values():
            if m.source != "config" and m.url not in listed:
                assert m.draining and m.inflight > 0
