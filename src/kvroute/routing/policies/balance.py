"""Load-only policies: round robin, power of two choices, least loaded (vLLM's DP balancer score).

They read no cache or session signal; the prefix match in their log line is looked up for the
chosen worker only, after the pick.
"""

from __future__ import annotations

from kvroute.routing import filters, pickers, scorers
from kvroute.routing.decision import DecisionKind
from kvroute.routing.explain import blocks
from kvroute.routing.stages import Explainer, Policy, Pruning
from kvroute.routing.view import Candidate, View


def explain(name: str) -> Explainer:
    """The explainer of the load-only policy ``name``."""

    def balance(view: View, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
        c = cands[i]
        loads = [x.engine_load for x in cands]
        return DecisionKind.BALANCE, (
            f"[{name.upper()}] {c.worker.id} load={c.engine_load} (min={min(loads)} max={max(loads)} "
            f"of {len(cands)}, keeps {blocks(view, c)}, ~{view.est_tokens} tokens)")

    return balance


ROUND_ROBIN = Policy("round-robin", filters.BASE, (), pickers.round_robin, explain("round-robin"),
                     summary="each request to the next worker in turn")
P2C = Policy("p2c", filters.BASE, (scorers.engine_load,), pickers.two_choices, explain("p2c"),
             summary="the less loaded of two workers drawn at random")
LEAST_LOADED = Policy("least-loaded", filters.BASE, (scorers.engine_load,), pickers.lowest,
                      explain("least-loaded"), pruning=Pruning("engine_load", lambda view: 0),
                      summary="the lowest 4 x waiting + running (vLLM's data-parallel balancer)")
