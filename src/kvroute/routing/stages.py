"""The pipeline's parts and the policy that strings them together.

A decision runs ``filters -> scorers -> picker -> explainer`` over one ``Candidate`` per worker
(routing/view.py).  Each part is a plain function wrapped with its name and the signals it reads;
a ``Policy`` lists its parts, and the scheduler produces only the signals they declare.  Filters
return the candidates they keep, scorers one number per candidate (lower is better; the picker
compares the scorers' values lexicographically, so a later scorer only breaks ties left by the
earlier ones), the picker an index, the explainer the decision's kind and one log line.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.routing.decision import DecisionKind
from kvroute.routing.view import Candidate, Signal, View

Key = tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Filter:
    """Removes candidates for one reason.  A hard filter (``ready``, ``serves_model``) may leave
    nothing, and then nothing can serve the request; a soft one keeps every candidate when none
    would pass (its function returns ``cands`` then)."""

    name: str
    keep: Callable[[View, list[Candidate]], list[Candidate]]
    needs: frozenset[Signal] = frozenset()


@dataclass(frozen=True, slots=True)
class Scorer:
    """One opinion per candidate, lower is better."""

    name: str
    score: Callable[[View, list[Candidate]], list[float]]
    needs: frozenset[Signal] = frozenset()


@dataclass(slots=True)
class PickerState:
    """What pickers remember between decisions: a turn counter and a seeded random source, so a
    simulation with the same seed makes the same choices."""

    turn: int = 0
    rng: random.Random = field(default_factory=random.Random)


Picker = Callable[[PickerState, Sequence[Key]], int]
# (view, candidates, chosen index) -> (kind, one log line without prompt text)
Explainer = Callable[[View, list[Candidate], int], tuple[DecisionKind, str]]


@dataclass(frozen=True, slots=True)
class Pruning:
    """How a policy's choice over a large fleet can be made from a few workers, exactly.

    Without a bound session, the policy only ever picks among the workers whose ``by`` figure
    (``"busy"`` or ``"engine_load"``) is within ``within(view)`` of the lowest.  ``floor(view,
    busy)`` is a lower bound of the scorers' values (compared as the picker compares them) of any
    worker that holds none of the prompt and carries ``busy`` (None: no bound).  ``kept(view, cands,
    least)`` says which of some priced candidates (each passing the hard and soft filters, ``least``
    the lowest figure among all that do) the policy's filters keep whatever the rest of the fleet
    is, or None when that cannot be told from them.

    With a floor the scheduler prices the bound worker, every worker holding part of the prompt and
    a few of the least busy; the lowest scores among those surely kept are what any other worker
    must beat, and a worker holding nothing whose floor is not below them cannot (nor, without a
    bound session, one beyond ``within``).  Without a floor, a bound session's turn looks at every
    worker and a placement at every worker within ``within``: see docs/design.md, "Large fleets".
    """

    by: str
    within: Callable[[View], int]
    floor: Callable[[View, int], Key | None] | None = None
    kept: Callable[[View, list[Candidate], int], list[bool] | None] | None = None


def index_match(view: View, c: Candidate) -> float:
    """Prompt tokens the index says ``c`` holds (what most policies expect it to serve from cache)."""
    return view.matched_tokens(c)


@dataclass(frozen=True, slots=True)
class Policy:
    """One routing policy: a configuration of the same pipeline, so benchmarks compare policies on
    equal terms.

    ``held`` is how many prompt tokens the chosen worker is expected to serve from its cache (the
    router's backlog estimate adds the rest as prefill); ``settings`` lists the settings blocks the
    policy's own parts read (routing/settings.py), so configuration and help know them;
    ``needs`` adds signals its explainer or ``held`` read beyond those its stages declare.
    ``predict`` is the policy's predicted time to first token on a candidate, in seconds (None: the
    scheduler's generic estimate, see ``Scheduler.predicted_ttft``).  ``one_shot`` says whether a
    request joins no conversation (it sends no later turn): its session is then bound but not
    counted among the sessions active on its worker, which the policy prices as future load (None:
    every request with a session joins one).
    """

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[Scorer, ...]
    picker: Picker
    explain: Explainer
    held: Callable[[View, Candidate], float] = index_match
    settings: tuple[type, ...] = ()
    extra_needs: frozenset[Signal] = frozenset()
    summary: str = ""
    pruning: Pruning | None = None
    predict: Callable[[View, Candidate], float] | None = None
    one_shot: Callable[[View], bool] | None = None
    # Every signal the policy's parts read (computed once).
    needs: frozenset[Signal] = field(init=False)

    def __post_init__(self) -> None:
        out = set(self.extra_needs).union(*(f.needs for f in self.filters), *(s.needs for s in self.scorers))
        object.__setattr__(self, "needs", frozenset(out))
