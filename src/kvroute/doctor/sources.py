"""What each source says about an engine -> partial ``EngineFacts``: ``/metrics``, ``/v1/models``,
``/server_info`` and a startup log.

The startup log: the ``non-default args`` dict, the ``Initializing a V1 LLM engine (...) with
config: ...`` dump, the hybrid-model lines (Mamba cache mode, the stretched attention block, the
experimental-align warning), the KV cache size, and fatal errors such as ``ValueError: max_num_seqs
(128) exceeds available Mamba cache blocks (127)``.  Only the last start in the file counts: a log
that spans restarts describes the latest one.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from kvroute.doctor.facts import EngineFacts, Observed, merge_facts
from kvroute.doctor.settings import (
    facts_from_settings,
    is_hybrid_architecture,
    parse_int,
    parse_python_dict,
    split_config_dump,
)
from kvroute.fleet import metric_names as names
from kvroute.prometheus_text import Sample, first_total, label_values, total

# --- a startup log (the last start in it) ---------------------------------------------------------

_START = re.compile(r"non-default args: |vLLM API server version ")
_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
_CONFIG_DUMP = re.compile(r"Initializing a \S+ LLM engine \(([^)]*)\) with config: (.*)$")
_SERVER_VERSION = re.compile(r"vLLM API server version (\S+)")
_ARCH = re.compile(r"Resolved architecture: (\w+)")
_MAX_LEN = re.compile(r"Using max model len (\d+)")
_MODE_SET = re.compile(r"Mamba cache mode is set to '(\w+)'")
_EXPERIMENTAL = re.compile(r"Prefix caching in Mamba cache '(\w+)' mode is currently enabled")
_BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")
_KV_DTYPE = re.compile(r"Using (\w+) data type to store kv cache")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_MAMBA_BLOCKS = re.compile(r"max_num_seqs \((\d+)\) exceeds available Mamba cache blocks \((\d+)\)")
# Prefixes vLLM and its launchers put before a message: compose service, timestamp, process,
# then vLLM's own "ERROR 05-14 09:14:04 [core.py:946] ".
_PREFIX = re.compile(
    r"^(?:[\w.-]+\s+\|\s+)?(?:\d{4}-\d\d-\d\d[ T][\d:.,]+\s+\|?\s*)?(?:\([^)]*\)\s*)*"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?"
)
_FATAL = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (.+)$")
_MAX_ERRORS = 5


def facts_from_log(text: str) -> EngineFacts:
    """Facts from the last start recorded in ``text``; sources cite 1-based line numbers."""
    lines = text.splitlines()
    first = _last_start(lines)
    line_facts: list[EngineFacts] = []
    dump_facts: list[EngineFacts] = []
    args_facts: list[EngineFacts] = []
    errors: list[Observed[str]] = []
    saw_args = False
    for index in range(first, len(lines)):
        line = lines[index]
        where = f"log line {index + 1}"
        if m := _NON_DEFAULT.search(line):
            saw_args = True
            args = parse_python_dict(m.group(1))
            if args is not None:
                args_facts.append(facts_from_settings(args, f"{where} non-default args"))
            continue
        if m := _CONFIG_DUMP.search(line):
            dump = facts_from_settings(split_config_dump(m.group(2)), f"{where} config dump")
            dump_facts.append(merge_facts(dump, _one("version", m.group(1), where)).facts)
            continue
        for pattern, build in _LINE_RULES:
            if m := pattern.search(line):
                line_facts.append(build(m, where))
        message = _PREFIX.sub("", line).strip()
        fatal = _FATAL.match(message) and len(errors) < _MAX_ERRORS
        if fatal and all(e.value != message for e in errors):
            errors.append(Observed(message, where))
    merged = merge_facts(*line_facts, *dump_facts, *args_facts, EngineFacts(startup_errors=tuple(errors)))
    return _default_mamba_mode(merged.facts, saw_args)


def _last_start(lines: list[str]) -> int:
    starts = [i for i, line in enumerate(lines) if _START.search(line)]
    if not starts:
        return 0
    # "API server version" and "non-default args" open the same start: step back to the first.
    last = starts[-1]
    while len(starts) > 1 and starts[-2] >= last - 3:
        starts.pop()
        last = starts[-1]
    return last


def _default_mamba_mode(facts: EngineFacts, saw_args: bool) -> EngineFacts:
    """A hybrid started with prefix caching but no mode runs with vLLM's default, ``none``.

    Only inferred when the log shows the start's arguments, so silence really means "not passed".
    """
    if not saw_args or facts.mamba_cache_mode is not None or facts.hybrid is None:
        return facts
    if not facts.hybrid.value:
        return facts
    inferred = Observed("none", "log: no --mamba-cache-mode in the non-default args (vLLM default)")
    return merge_facts(facts, EngineFacts(mamba_cache_mode=inferred)).facts


def _one(name: str, value: object, where: str) -> EngineFacts:
    return EngineFacts(**{name: Observed(value, where)})  # type: ignore[arg-type]


def _hybrid_line(name: str, value: object, where: str) -> EngineFacts:
    return merge_facts(_one(name, value, where), _one("hybrid", True, where)).facts


def _arch(m: re.Match[str], where: str) -> EngineFacts:
    arch = m.group(1)
    return merge_facts(_one("architecture", arch, where),
                       _one("hybrid", is_hybrid_architecture(arch), where)).facts


def _experimental(m: re.Match[str], where: str) -> EngineFacts:
    return merge_facts(
        _hybrid_line("mamba_cache_mode", m.group(1).lower(), where),
        _one("enable_prefix_caching", True, where),
        _one("experimental_warning", True, where),
    ).facts


def _mamba_blocks(m: re.Match[str], where: str) -> EngineFacts:
    return merge_facts(
        _hybrid_line("max_num_seqs", int(m.group(1)), where),
        _one("mamba_cache_blocks", int(m.group(2)), where),
    ).facts


_LINE_RULES: tuple[tuple[re.Pattern[str], Callable[[re.Match[str], str], EngineFacts]], ...] = (
    (_SERVER_VERSION, lambda m, w: _one("version", m.group(1), w)),
    (_ARCH, _arch),
    (_MAX_LEN, lambda m, w: _one("max_model_len", int(m.group(1)), w)),
    (_MODE_SET, lambda m, w: _hybrid_line("mamba_cache_mode", m.group(1).lower(), w)),
    (_EXPERIMENTAL, _experimental),
    (_BLOCK, lambda m, w: _hybrid_line("block_size", int(m.group(1)), w)),
    (_KV_DTYPE, lambda m, w: _one("cache_dtype", m.group(1).lower(), w)),
    (_KV_TOKENS, lambda m, w: _one("kv_cache_tokens", parse_int(m.group(1)), w)),
    (_MAMBA_BLOCKS, _mamba_blocks),
)


# --- /v1/models and /server_info bodies -----------------------------------------------------------

# Nested settings kept whole rather than flattened: their own keys (``method``, ``model``) would
# otherwise shadow the engine's.
_KEEP_WHOLE = frozenset({"speculative_config"})


def facts_from_models(body: object) -> EngineFacts:
    """The first served model's id and ``max_model_len`` from an OpenAI ``/v1/models`` body."""
    data = body.get("data") if isinstance(body, Mapping) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], Mapping):
        return EngineFacts()
    card = data[0]
    found: dict[str, Observed[object]] = {}
    if isinstance(card.get("id"), str):
        found["model"] = Observed(card["id"], "/v1/models id")
    max_len = parse_int(card.get("max_model_len"))
    if max_len is not None:
        found["max_model_len"] = Observed(max_len, "/v1/models max_model_len")
    return EngineFacts(**found)  # type: ignore[arg-type]


def facts_from_server_info(body: object) -> EngineFacts:
    """Settings from ``/server_info``: vLLM's ``vllm_config`` (text or JSON) or a flat config."""
    if not isinstance(body, Mapping):
        return EngineFacts()
    return facts_from_settings(flatten_settings(body), "/server_info")


def flatten_settings(body: Mapping[str, object]) -> dict[str, object]:
    """Every leaf setting of a nested config, shallowest first; ``str(VllmConfig)`` text expanded."""
    flat: dict[str, object] = {}
    queue: deque[Mapping[str, object]] = deque([body])
    while queue:
        node = queue.popleft()
        for key, value in node.items():
            if isinstance(value, Mapping) and key not in _KEEP_WHOLE:
                queue.append(value)
            elif isinstance(value, str) and "enable_prefix_caching=" in value:
                queue.append(split_config_dump(value))
            else:
                flat.setdefault(key, value)
    return flat


# --- /metrics (vLLM names, fleet.metric_names) ----------------------------------------------------

_SOURCE = "/metrics"


def facts_from_metrics(samples: list[Sample]) -> EngineFacts:
    """Settings from the ``*_config_info`` labels, counters, and the model and start time."""
    parts = [
        facts_from_settings(s.labels, f"{_SOURCE} {s.name}")
        for s in sorted(_info_samples(samples), key=lambda s: s.name != names.CACHE_CONFIG_INFO)
    ]
    found: dict[str, Observed[Any]] = {}
    models = label_values([s for s in samples if s.name.startswith(names.VLLM_PREFIX)], "model_name")
    if models:
        found["model"] = Observed(models[0], f"{_SOURCE} model_name label")
    queries = first_total(samples, names.PREFIX_QUERIES)
    hits = first_total(samples, names.PREFIX_HITS)
    if queries is not None and hits is not None:
        found["prefix_cache_queries"] = Observed(queries[1], f"{_SOURCE} {queries[0]}")
        found["prefix_cache_hits"] = Observed(hits[1], f"{_SOURCE} {hits[0]}")
    mean = _mean_prompt_tokens(samples)
    if mean is not None:
        found["mean_prompt_tokens"] = mean
    start = total(samples, names.START_TIME)
    if start is not None:
        found["start_time"] = Observed(start, f"{_SOURCE} {names.START_TIME}")
    parts.append(EngineFacts(**found))  # type: ignore[arg-type]
    return merge_facts(*parts).facts


def _info_samples(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples
            if s.name.startswith(names.VLLM_PREFIX) and s.name.endswith(names.CONFIG_INFO_SUFFIX)]


def _mean_prompt_tokens(samples: list[Sample]) -> Observed[float] | None:
    """Mean prompt length per finished request, from the histogram, else from the counters."""
    for numerator, denominator in (
        (names.REQUEST_PROMPT_TOKENS_SUM, names.REQUEST_PROMPT_TOKENS_COUNT),
        (names.PROMPT_TOKENS[0], names.REQUEST_SUCCESS),
    ):
        num, den = total(samples, numerator), total(samples, denominator)
        if num is not None and den:
            return Observed(num / den, f"{_SOURCE} {numerator} / {denominator}")
    return None
