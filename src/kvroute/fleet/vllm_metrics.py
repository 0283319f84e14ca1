"""Reading an engine's Prometheus exposition (vLLM names first) into the few figures routing uses.

The probe scrapes ``/metrics`` every second on the router's own event loop, and a vLLM exposition
is tens of kilobytes of histograms we do not need, so only the samples named in
``fleet.metric_names`` are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.fleet import metric_names as names
from kvroute.prometheus_text import parse_exposition

_WANTED = frozenset(
    (*names.RUNNING, *names.WAITING, *names.KV_USAGE, *names.PREFIX_HITS, *names.PREFIX_QUERIES,
     *names.PROMPT_TOKENS, *names.GENERATION_TOKENS, names.START_TIME, names.CACHE_CONFIG_INFO)
)


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
    def kv_tokens(self) -> int | None:
        """The KV cache in tokens, ``num_gpu_blocks x block_size`` from ``cache_config_info``
        (None when the engine does not say; flow control then admits by sequence slots alone)."""
        try:
            blocks = int(self.cache_config["num_gpu_blocks"])
            size = int(self.cache_config["block_size"])
        except (KeyError, ValueError):
            return None
        return blocks * size if blocks > 0 and size > 0 else None

    @property
    def block_size(self) -> int | None:
        """The tokens per block its prefix-cache hashes cover, from ``cache_config_info``:
        ``hash_block_size`` where set, else ``block_size`` (None when the engine does not say)."""
        for label in ("hash_block_size", "block_size"):
            try:
                size = int(self.cache_config[label])
            except (KeyError, ValueError):  # unset reads "None"
                continue
            return size if size > 0 else None
        return None

    @property
    def has_load(self) -> bool:
        """Whether the engine reports its own queue (otherwise load is the router's in-flight count)."""
        return self.running is not None or self.waiting is not None


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Read the figures routing needs from a Prometheus text exposition (vLLM, SGLang or any)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    cache_config: dict[str, str] = {}
    for sample in parse_exposition(text, _WANTED, skip_unreadable=True):
        name, value = sample.name, sample.value
        if value != value:  # NaN carries no information
            continue
        if name == names.CACHE_CONFIG_INFO:
            cache_config.update(sample.labels)
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1

    def first(figure: tuple[str, ...]) -> float | None:
        for name in figure:
            if name in sums:
                return sums[name]
        return None

    def mean(figure: tuple[str, ...]) -> float | None:
        for name in figure:
            if name in sums:
                return sums[name] / counts[name]
        return None

    running, waiting = first(names.RUNNING), first(names.WAITING)
    return EngineMetrics(
        running=None if running is None else round(running),
        waiting=None if waiting is None else round(waiting),
        kv_usage=mean(names.KV_USAGE),
        prefix_hits=first(names.PREFIX_HITS),
        prefix_queries=first(names.PREFIX_QUERIES),
        prompt_tokens=first(names.PROMPT_TOKENS),
        generation_tokens=first(names.GENERATION_TOKENS),
        process_start_time=mean((names.START_TIME,)),
        cache_config=cache_config,
    )
