"""Prometheus text exposition of one simulated replica, with vLLM's metric names, labels and layout.

It follows what vLLM 0.32.0 writes (tests/vllm/fixtures/metrics_after_chat.prom, diffed against
this output by tests/vllm/test_sim_matches_vllm.py): counters declared under their ``_total``
name, a ``_created`` gauge beside every counter and histogram, ``model_name`` and ``engine="0"``
on every ``vllm:`` sample except ``vllm:cache_config_info``, which carries the cache config only.
A replica of several data-parallel ranks writes each family once, with one series per rank
(``engine="0"``, ``engine="1"``, ...), as vLLM's one API server does for its engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvroute.sim.cache_config import cache_config_labels
from kvroute.sim.engine import EngineConfig, EngineSnapshot
from kvroute.sim.stats import Histogram

# vLLM's label values, in its order; the simulator has no external KV transfer and no host, disk
# or peer cache tiers, so those series stay at zero.
_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
_PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items())) + "}"


def _num(value: float) -> str:
    return repr(float(value))


class _Writer:
    """One engine's families, each a block: its two header lines, then its samples."""

    __slots__ = ("base", "blocks", "created", "shared")

    def __init__(self, base: dict[str, str], created: float) -> None:
        self.base = base
        self.created = created
        self.blocks: list[list[str]] = []
        self.shared: set[int] = set()   # blocks of families without the engine label

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.blocks.append([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])

    def sample(self, name: str, value: float, extra: dict[str, str] | None = None) -> None:
        labels = {**self.base, **extra} if extra else self.base
        self.blocks[-1].append(f"{name}{_labels(labels)} {_num(value)}")

    def plain(self, line: str) -> None:
        """A sample of a family the engines share (written once whatever the ranks)."""
        self.shared.add(len(self.blocks) - 1)
        self.blocks[-1].append(line)

    def gauge(self, name: str, value: float, help_text: str) -> None:
        self.family(name, "gauge", help_text)
        self.sample(name, value)

    def counter(self, name: str, help_text: str, values: dict[str, float] | float,
                label: str = "") -> None:
        """A counter family ``name`` (without ``_total``): one series, or one per ``label`` value."""
        series = values if isinstance(values, dict) else {"": values}
        self.family(name + "_total", "counter", help_text)
        for key, value in series.items():
            self.sample(name + "_total", value, {label: key} if label else None)
        self.family(name + "_created", "gauge", help_text)
        for key in series:
            self.sample(name + "_created", self.created, {label: key} if label else None)

    def histogram(self, name: str, hist: Histogram, help_text: str) -> None:
        self.family(name, "histogram", help_text)
        for bound, cum in zip((*hist.bounds, float("inf")), hist.cumulative(), strict=True):
            self.sample(name + "_bucket", cum, {"le": "+Inf" if bound == float("inf") else repr(bound)})
        self.sample(name + "_count", hist.count)
        self.sample(name + "_sum", hist.total)
        self.family(name + "_created", "gauge", help_text)
        self.sample(name + "_created", self.created)


def render_metrics(config: EngineConfig, snaps: Sequence[EngineSnapshot], served_model: str,
                   process_start_time: float,
                   http_requests: Mapping[tuple[str, str, str], int] | None = None) -> bytes:
    """The ``/metrics`` body: gauges, counters (tokens), histograms, cache config info, of each
    data-parallel rank's engine (``snaps`` in rank order; one for a one-rank replica), then the
    server's ``http_requests_total`` by (handler, method, status class), as vLLM's API server
    writes them.

    ``process_start_time`` (wall clock) is also the ``_created`` time of every counter and
    histogram: the engine's counters start with the process, and restart with it.
    """
    writers = [_engine_families(config, snap, served_model, process_start_time, str(i))
               for i, snap in enumerate(snaps)]
    first = writers[0]
    lines: list[str] = []
    for k, block in enumerate(first.blocks):
        lines += block
        if k not in first.shared:
            for w in writers[1:]:
                lines += w.blocks[k][2:]
    lines += ["# HELP http_requests_total Total number of requests by method, status and handler.",
              "# TYPE http_requests_total counter"]
    lines += [f"http_requests_total{_labels({'handler': h, 'method': m, 'status': st})} {_num(n)}"
              for (h, m, st), n in (http_requests or {}).items()]
    return ("\n".join(lines) + "\n").encode()


def _engine_families(config: EngineConfig, snap: EngineSnapshot, served_model: str,
                     process_start_time: float, engine: str) -> _Writer:
    w = _Writer({"model_name": served_model, "engine": engine}, process_start_time)
    w.family("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.")
    w.plain(f"process_start_time_seconds {_num(process_start_time)}")
    w.gauge("vllm:num_requests_running", snap.num_running, "Number of requests in model execution batches.")
    w.gauge("vllm:num_requests_waiting", snap.num_waiting, "Number of requests waiting to be processed.")
    w.family("vllm:num_requests_waiting_by_reason", "gauge",
             "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
             "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
             "status). Sum of all reasons equals vllm:num_requests_waiting.")
    w.sample("vllm:num_requests_waiting_by_reason", snap.num_waiting, {"reason": "capacity"})
    w.sample("vllm:num_requests_waiting_by_reason", 0, {"reason": "deferred"})
    w.gauge("vllm:kv_cache_usage_perc", snap.kv_cache_usage, "KV-cache usage. 1 means 100 percent usage.")
    st = snap.stats
    w.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
              st.prefix_cache_queries)
    w.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
              st.prefix_cache_hits)
    w.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.num_preemptions)
    w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
    by_source = dict.fromkeys(_PROMPT_SOURCES, 0.0)
    by_source["local_compute"] = st.prompt_tokens - st.prompt_tokens_cached
    by_source["local_cache_hit"] = st.prompt_tokens_cached
    w.counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", by_source, "source")
    w.counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
              st.prompt_tokens_cached)
    w.counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
    w.counter("vllm:request_success", "Count of successfully processed requests.",
              {reason: st.finished.get(reason, 0) for reason in _FINISHED_REASONS}, "finished_reason")
    w.histogram("vllm:request_prompt_tokens", st.prompt_len, "Number of prefill tokens processed.")
    w.histogram("vllm:request_generation_tokens", st.generation_len, "Number of generation tokens processed.")
    w.histogram("vllm:time_to_first_token_seconds", st.ttft, "Histogram of time to first token in seconds.")
    w.histogram("vllm:e2e_request_latency_seconds", st.e2e, "Histogram of e2e request latency in seconds.")
    w.histogram("vllm:request_queue_time_seconds", st.queue_time,
                "Histogram of time spent in WAITING phase for request.")
    w.histogram("vllm:request_prefill_kv_computed_tokens", st.prefill_kv_computed,
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).")
    w.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    w.plain(f"vllm:cache_config_info{_labels(cache_config_labels(config))} 1.0")
    return w
