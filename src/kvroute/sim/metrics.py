"""Prometheus text exposition of one simulated replica, with vLLM's metric names and labels."""

from __future__ import annotations

from kvroute.sim.engine import EngineConfig, EngineSnapshot
from kvroute.sim.stats import Histogram


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs.items()) + "}"


def _num(value: float) -> str:
    return repr(float(value))


class _Writer:
    __slots__ = ("base", "lines")

    def __init__(self, base: dict[str, str]) -> None:
        self.base = base
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, extra: dict[str, str] | None = None) -> None:
        labels = {**self.base, **extra} if extra else self.base
        self.lines.append(f"{name}{_labels(labels)} {_num(value)}")

    def gauge(self, name: str, value: float, help_text: str) -> None:
        self.family(name, "gauge", help_text)
        self.sample(name, value)

    def counter(self, name: str, value: float, help_text: str) -> None:
        self.family(name, "counter", help_text)
        self.sample(name + "_total", value)

    def histogram(self, name: str, hist: Histogram, help_text: str) -> None:
        self.family(name, "histogram", help_text)
        for bound, cum in zip((*hist.bounds, float("inf")), hist.cumulative(), strict=True):
            self.sample(name + "_bucket", cum, {"le": "+Inf" if bound == float("inf") else repr(bound)})
        self.sample(name + "_count", hist.count)
        self.sample(name + "_sum", hist.total)


def render_metrics(config: EngineConfig, snap: EngineSnapshot, served_model: str,
                   process_start_time: float) -> bytes:
    """The ``/metrics`` body: gauges, counters (tokens), latency histograms, cache config info."""
    w = _Writer({"model_name": served_model, "engine": "0"})
    w.gauge("vllm:num_requests_running", snap.num_running, "Number of requests in model execution batches.")
    w.gauge("vllm:num_requests_waiting", snap.num_waiting, "Number of requests waiting to be processed.")
    w.gauge("vllm:kv_cache_usage_perc", snap.kv_cache_usage, "KV-cache usage. 1 means 100 percent usage.")
    st = snap.stats
    w.counter("vllm:prefix_cache_queries", st.prefix_cache_queries,
              "Prefix cache queries, in terms of number of queried tokens.")
    w.counter("vllm:prefix_cache_hits", st.prefix_cache_hits,
              "Prefix cache hits, in terms of number of cached tokens.")
    w.counter("vllm:prompt_tokens", st.prompt_tokens, "Number of prefill tokens processed.")
    w.counter("vllm:generation_tokens", st.generation_tokens, "Number of generation tokens processed.")
    w.counter("vllm:num_preemptions", st.num_preemptions, "Cumulative number of preemption from the engine.")
    w.family("vllm:request_success", "counter", "Count of successfully processed requests.")
    for reason in ("stop", "length", "abort"):
        w.sample("vllm:request_success_total", st.finished.get(reason, 0), {"finished_reason": reason})
    w.histogram("vllm:time_to_first_token_seconds", st.ttft, "Histogram of time to first token in seconds.")
    w.histogram("vllm:e2e_request_latency_seconds", st.e2e,
                "Histogram of e2e request latency in seconds.")
    w.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    w.sample("vllm:cache_config_info", 1.0, {
        "block_size": str(config.block_size),
        "cache_dtype": config.kv_cache_dtype,
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "mamba_cache_mode": config.mamba_cache_mode,
        "prefix_match_unit": str(config.match_unit),
        "num_mamba_cache_blocks": str(config.mamba_cache_blocks),
    })
    w.family("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.")
    w.lines.append(f"process_start_time_seconds {_num(process_start_time)}")
    return ("\n".join(w.lines) + "\n").encode()
