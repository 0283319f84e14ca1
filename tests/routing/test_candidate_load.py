"""Load as the scheduler reads it: fresh router counts plus only the engine load it cannot see."""

from kvroute.routing.view import Candidate
from kvroute.routing.worker import WorkerState


def test_finished_request_no_longer_counts_after_a_stale_scrape() -> None:
    # Scraped while our previous turn was running: running=1 with 1 of ours in flight.
    w = WorkerState(id="a", url="http://a", running=1, waiting=0, inflight=1, scraped_inflight=1)
    assert Candidate.of(w).busy == 1
    w.inflight = 0  # the turn finished; the scrape is not refreshed yet
    c = Candidate.of(w)
    assert (c.load, c.busy, c.engine_load) == (0, 0, 0)


def test_load_from_elsewhere_is_added_to_fresh_inflight() -> None:
    # The engine ran 3 + 2 waiting while this router had 1 there: 4 requests came from elsewhere.
    w = WorkerState(id="a", url="http://a", running=3, waiting=2, inflight=2, scraped_inflight=1)
    c = Candidate.of(w)
    assert c.load == 2
    assert c.busy == 2 + 4
    assert c.engine_load == 2 + 4 * 2 + 3 - 1


def test_engines_without_metrics_use_router_counts() -> None:
    w = WorkerState(id="a", url="http://a", inflight=3, peer_inflight=2)
    c = Candidate.of(w)
    assert (c.load, c.busy, c.engine_load) == (5, 5, 5)
