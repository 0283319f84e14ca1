"""Reading an engine's Prometheus exposition (vLLM names first) into the few figures routing uses.

The probe scrapes ``/metrics`` every second on the router's own event loop, and a vLLM exposition
is tens of kilobytes of histograms we do not need, so this is a single pass over the lines that
looks only at the names below instead of a full Prometheus parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Each figure lists the names that carry it, preferred first: vLLM v1, older vLLM, then SGLang.
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_PROMPT_TOKENS = ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total")
_GENERATION_TOKENS = ("vllm:generation_tokens_total", "sglang:generation_tokens_total")
_START_TIME = ("process_start_time_seconds",)
_CACHE_CONFIG = "vllm:cache_config_info"

_WANTED = frozenset(
    (*_RUNNING, *_WAITING, *_KV_USAGE, *_PREFIX_HITS, *_PREFIX_QUERIES, *_PROMPT_TOKENS,
     *_GENERATION_TOKENS, *_START_TIME, _CACHE_CONFIG)
)
_PREFIXES = tuple(sorted({name.split(":", 1)[0] for name in _WANTED}))
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one scrape of an engine said; ``None`` where the engine does not expose the figure.

    Counts are summed over every series (data-parallel engines expose one per ``engine`` label);
    ``kv_usage`` is the mean over series, as a fraction in [0, 1].  Prefix-cache hits and queries
    are in tokens, as vLLM v1 counts them.
    """

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    process_start_time: float | None = None
    cache_config: dict[str, str] = field(default_factory=dict)

    @property
    def has_load(self) -> bool:
        """Whether the engine reports its own queue (otherwise load is the router's in-flight count)."""
        return self.running is not None or self.waiting is not None


def _sample(line: str) -> tuple[str, str, float] | None:
    """Split ``name{labels} value [timestamp]`` into its parts; None for a line we cannot read."""
    space = line.find(" ")
    brace = line.find("{")
    if brace != -1 and (space == -1 or brace < space):
        close = line.rfind("}")
        if close < brace:
            return None
        name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
    elif space != -1:
        name, labels, rest = line[:space], "", line[space:]
    else:
        return None
    parts = rest.split()
    if not parts:
        return None
    try:
        return name, labels, float(parts[0])
    except ValueError:
        return None


def parse_labels(labels: str) -> dict[str, str]:
    """Parse the inside of ``{a="1",b="x"}`` into a dict, undoing Prometheus escapes."""
    return {
        k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        for k, v in _LABEL.findall(labels)
    }


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Read the figures routing needs from a Prometheus text exposition (vLLM, SGLang or any)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    cache_config: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        sample = _sample(line)
        if sample is None:
            continue
        name, labels, value = sample
        if name not in _WANTED or value != value:  # value != value: NaN carries no information
            continue
        if name == _CACHE_CONFIG:
            cache_config.update(parse_labels(labels))
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1

    def first(names: tuple[str, ...]) -> float | None:
        for name in names:
            if name in sums:
                return sums[name]
        return None

    def mean(names: tuple[str, ...]) -> float | None:
        for name in names:
            if name in sums:
                return sums[name] / counts[name]
        return None

    running, waiting = first(_RUNNING), first(_WAITING)
    start = _START_TIME[0]
    return EngineMetrics(
        running=None if running is None else round(running),
        waiting=None if waiting is None else round(waiting),
        kv_usage=mean(_KV_USAGE),
        prefix_hits=first(_PREFIX_HITS),
        prefix_queries=first(_PREFIX_QUERIES),
        prompt_tokens=first(_PROMPT_TOKENS),
        generation_tokens=first(_GENERATION_TOKENS),
        process_start_time=sums[start] / counts[start] if start in sums else None,
        cache_config=cache_config,
    )
