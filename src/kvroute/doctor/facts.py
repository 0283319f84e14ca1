"""What one engine says about itself, each fact with the place it was read from.

Facts come in partial sets from independent sources (``/metrics``, ``/v1/models``,
``/server_info``, a startup log) and are merged; where two sources disagree the first wins and the
disagreement is kept, because a log from an earlier start is a classic way to misdiagnose.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Observed(Generic[T]):
    """A value and where it came from (e.g. ``/metrics vllm:cache_config_info``, ``log line 12``)."""

    value: T
    source: str

    def cite(self, name: str) -> str:
        """``name=value (source)``, the form used in a finding's evidence."""
        return f"{name}={self.value} ({self.source})"


def cite(observed: Observed[Any] | None, name: str) -> tuple[str, ...]:
    """Evidence for a finding: ``(name=value (source),)``, or nothing when unknown."""
    return () if observed is None else (observed.cite(name),)


@dataclass(frozen=True, slots=True)
class Conflict:
    """Two sources that disagree about one setting."""

    name: str
    kept: Observed[object]
    other: Observed[object]


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """Everything the checks may use about one engine; every field is optional.

    Counters are cumulative since the engine started, in tokens, as vLLM counts them.
    ``mamba_cache_blocks`` is the number of recurrent-state slots (one per running sequence).
    ``startup_errors`` are fatal lines from a log; ``experimental_warning`` is vLLM's
    "Prefix caching in Mamba cache 'align' mode is currently enabled" line.
    """

    model: Observed[str] | None = None
    architecture: Observed[str] | None = None
    hybrid: Observed[bool] | None = None
    version: Observed[str] | None = None
    enable_prefix_caching: Observed[bool] | None = None
    mamba_cache_mode: Observed[str] | None = None
    block_size: Observed[int] | None = None
    prefix_match_unit: Observed[int] | None = None
    cache_dtype: Observed[str] | None = None
    num_gpu_blocks: Observed[int] | None = None
    kv_cache_tokens: Observed[int] | None = None
    max_num_seqs: Observed[int] | None = None
    max_model_len: Observed[int] | None = None
    mamba_cache_blocks: Observed[int] | None = None
    speculative: Observed[str] | None = None
    prefix_cache_queries: Observed[float] | None = None
    prefix_cache_hits: Observed[float] | None = None
    mean_prompt_tokens: Observed[float] | None = None
    start_time: Observed[float] | None = None
    experimental_warning: Observed[bool] | None = None
    startup_errors: tuple[Observed[str], ...] = ()

    def total_kv_tokens(self) -> Observed[int] | None:
        """KV cache capacity in tokens: reported directly, else blocks × block size."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        if self.num_gpu_blocks is not None and self.block_size is not None:
            return Observed(
                self.num_gpu_blocks.value * self.block_size.value,
                f"num_gpu_blocks × block_size ({self.num_gpu_blocks.source})",
            )
        return None

    def match_unit(self) -> Observed[int] | None:
        """The finest boundary a hit may land on: ``prefix_match_unit``, else the block size."""
        return self.prefix_match_unit if self.prefix_match_unit is not None else self.block_size

    def as_dict(self) -> dict[str, object]:
        """Plain values with their sources, for ``--json``."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Observed):
                out[f.name] = {"value": value.value, "source": value.source}
            elif isinstance(value, tuple) and value:
                out[f.name] = [{"value": v.value, "source": v.source} for v in value]
        return out


# Figures that describe the current state rather than a setting: sources legitimately differ.
_NOT_SETTINGS = frozenset({
    "prefix_cache_queries", "prefix_cache_hits", "mean_prompt_tokens", "start_time",
    "experimental_warning", "startup_errors", "version",
})


@dataclass(slots=True)
class MergedFacts:
    """The merged facts plus the disagreements found on the way."""

    facts: EngineFacts = field(default_factory=EngineFacts)
    conflicts: list[Conflict] = field(default_factory=list)


def merge_facts(*partials: EngineFacts) -> MergedFacts:
    """Merge partial facts, earlier sources first; startup errors from all sources are kept."""
    merged = MergedFacts()
    for part in partials:
        updates: dict[str, Any] = {}
        for f in fields(EngineFacts):
            new = getattr(part, f.name)
            old = getattr(merged.facts, f.name)
            if f.name == "startup_errors":
                if new:
                    updates[f.name] = old + new
                continue
            if new is None:
                continue
            if old is None:
                updates[f.name] = new
            elif f.name not in _NOT_SETTINGS and _normal(old.value) != _normal(new.value):
                merged.conflicts.append(Conflict(f.name, old, new))
        merged.facts = replace(merged.facts, **updates)
    return merged


def _normal(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


@dataclass(frozen=True, slots=True)
class TrafficAssumptions:
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
