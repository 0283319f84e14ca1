"""How much of a cached prefix a worker will still hold when the request is admitted.

The index knows what each worker *served*; the engine keeps it only while its KV cache has room.
Past the fleet's cache (seed 2's rule of thumb: sessions x context above the fleet's KV), a
session's blocks are freed when its turn ends and re-used by the prefills queued behind it, so by
the time its next turn is admitted the index's match is mostly gone.  The engines say so
themselves: the hit share they report (``cached_tokens`` / ``prompt_tokens``) falls below what the
index predicted.  ``WorkerLearning.realised`` is that ratio; this module turns it into the number
of tokens the cost can count on.
"""

from __future__ import annotations

from kvroute.routing.candidates import Candidate, Context


def expected_held_tokens(ctx: Context, c: Candidate) -> float:
    """Prompt tokens ``c`` is expected to serve from cache: the index's match, scaled by the
    worker's cache realisation as far as ``realisation_weight`` trusts it (0: the index alone)."""
    trust = ctx.policy.realisation_weight
    return ctx.matched_tokens(c) * (1.0 - trust * (1.0 - c.realisation))
