"""What the operator tells the doctor about the traffic, for the checks that depend on it."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.doctor.facts import EngineFacts, Observed


@dataclass(frozen=True, slots=True)
class Workload:
    """Traffic assumptions; None means "use what the engine measured, if anything".

    ``typical_prompt_tokens``: the prompt length a cache hit matters for (default: the mean
    prompt length from ``/metrics``).  ``concurrent_sessions``: conversations live at once on one
    replica (default: ``max_num_seqs``).
    """

    typical_prompt_tokens: int | None = None
    concurrent_sessions: int | None = None

    def prompt_tokens(self, facts: EngineFacts) -> Observed[float] | None:
        """The typical prompt length: given, else measured by the engine, else unknown."""
        if self.typical_prompt_tokens is not None:
            return Observed(float(self.typical_prompt_tokens), "--context-tokens")
        return facts.mean_prompt_tokens

    def sessions(self, facts: EngineFacts) -> Observed[int] | None:
        """Concurrent sessions per replica: given, else ``max_num_seqs``."""
        if self.concurrent_sessions is not None:
            return Observed(self.concurrent_sessions, "--sessions")
        return facts.max_num_seqs
