"""Facts -> findings: every check the doctor makes, most severe first.

Prefix caching on and able to hit (the three arguments hybrids miss):

1. Hybrid models run with prefix caching off unless asked (``--enable-prefix-caching``).
2. On a hybrid, caching without ``--mamba-cache-mode align`` has nowhere to keep the recurrent
   state, so nothing is reused.
3. A hybrid's stretched block (1600 tokens with fp8, 800 without) means short conversations never
   reach a whole block; ``--prefix-match-unit 32`` lets a hit land where the state checkpoint is.

Then the two memory budgets (Mamba state slots, KV cache tokens), what the engine did rather than
how it is configured (counters, errors, gaps), and the comparison of a fleet's engines.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvroute.doctor.facts import Conflict, EngineFacts, MergedFacts, Observed, TrafficAssumptions, cite
from kvroute.doctor.finding import Finding, Severity

# --- prefix caching on, and able to hit -----------------------------------------------------------

ALIGN_FIX = "--enable-prefix-caching --mamba-cache-mode align"
# Match units at or above this many tokens make ordinary chat turns miss.
COARSE_UNIT = 256
# Below this many blocks per prompt the prefix-hashing design measured no gain at all (1600-token
# blocks, gain from ~6k).
BLOCKS_FOR_GAIN = 4
_REUSING_MODES = ("align", "all")


def check_prefix_caching(facts: EngineFacts) -> list[Finding]:
    """Prefix caching off: the default on hybrids, an explicit ``--no-enable-prefix-caching`` else."""
    epc = facts.enable_prefix_caching
    if epc is None:
        return []
    evidence = cite(epc, "enable_prefix_caching") + cite(facts.hybrid, "hybrid") + cite(
        facts.architecture, "architecture")
    hybrid = facts.hybrid.value if facts.hybrid is not None else None
    if epc.value:
        if not _caching_can_hit(facts):
            return []  # on, but the Mamba mode keeps nothing: check_mamba_mode says so
        return [Finding(Severity.OK, "prefix-caching-on", "Prefix caching is on",
                        "The engine reuses the KV blocks of prompts it has already seen.", None, evidence)]
    if hybrid:
        return [Finding(
            Severity.ERROR, "prefix-caching-off-hybrid",
            "Prefix caching is off (vLLM's default for hybrid models)",
            "On a hybrid (Mamba / linear-attention) model vLLM leaves prefix caching off unless it is "
            "asked for, because the only way to reuse a recurrent state is a mode marked experimental. "
            "Every repeated prefix is recomputed: a repeated prompt costs what a new one does. Asking "
            "takes two arguments: --enable-prefix-caching on its own leaves --mamba-cache-mode at "
            "'none', which has no way to keep the recurrent state.",
            ALIGN_FIX, evidence)]
    unsure = "" if hybrid is False else (
        " If this is a hybrid (Mamba / linear-attention) model, add --mamba-cache-mode align too.")
    return [Finding(
        Severity.ERROR, "prefix-caching-off", "Prefix caching is off",
        "The engine recomputes every prompt from the first token, so a router cannot save any "
        "prefill by sending a conversation back to the replica that served it." + unsure,
        "--enable-prefix-caching (and remove --no-enable-prefix-caching)", evidence)]


def check_mamba_mode(facts: EngineFacts) -> list[Finding]:
    """A hybrid with caching on must keep Mamba state: ``mamba_cache_mode`` align (or all)."""
    if not _hybrid_caching(facts):
        return []
    mode = facts.mamba_cache_mode
    evidence = cite(facts.enable_prefix_caching, "enable_prefix_caching") + cite(mode, "mamba_cache_mode")
    if mode is None:
        return [Finding(
            Severity.WARNING, "mamba-mode-unknown", "Could not read the Mamba cache mode",
            "Prefix caching is on for a hybrid model, but no source says which mamba_cache_mode the "
            "engine runs with. With 'none' (the default) nothing is reused. Pass the startup log "
            "(--log) or run --probe to see whether a repeated prompt hits.",
            "--mamba-cache-mode align", evidence)]
    if mode.value in _REUSING_MODES:
        return [Finding(Severity.OK, "mamba-mode-align", f"Mamba cache mode is {mode.value}",
                        "The recurrent state is checkpointed so a hit can resume from it.", None, evidence)]
    return [Finding(
        Severity.ERROR, "mamba-mode-none",
        f"Prefix caching is on but the Mamba cache mode is '{mode.value}': nothing is reused",
        "A hybrid model can only resume from a cached prefix if the recurrent state at that point "
        "was kept. With mamba_cache_mode 'none' it never is, so --enable-prefix-caching alone has "
        "no effect: the hit rate stays at 0%.",
        "--mamba-cache-mode align", evidence)]


def check_match_unit(facts: EngineFacts, traffic: TrafficAssumptions) -> list[Finding]:
    """Where a hit may land: every ``prefix_match_unit`` tokens (default: every block)."""
    if not _caching_can_hit(facts) or facts.block_size is None:
        return []
    block = facts.block_size
    pmu = facts.prefix_match_unit
    evidence = cite(block, "block_size") + cite(pmu, "prefix_match_unit") + cite(
        facts.cache_dtype, "cache_dtype")
    suggested = suggest_match_unit(block.value)
    if pmu is not None and block.value % pmu.value != 0:
        return [Finding(
            Severity.ERROR, "prefix-match-unit-invalid",
            f"prefix_match_unit {pmu.value} does not divide the block size {block.value}",
            "vLLM requires every KV cache group's block size to be divisible by the match unit.",
            f"--prefix-match-unit {suggested}", evidence)]
    unit = pmu.value if pmu is not None else block.value
    if unit < COARSE_UNIT:
        return [Finding(Severity.OK, "match-unit-fine", f"Hits can land on any multiple of {unit} tokens",
                        f"Physical block {block.value} tokens.", None, evidence)]
    prompt = traffic.prompt_tokens(facts)
    evidence += cite(prompt, "typical_prompt_tokens")
    short = prompt is None or prompt.value < BLOCKS_FOR_GAIN * unit
    typical = "Typical prompt length is unknown. " if prompt is None else (
        f"Typical prompts here are ~{prompt.value:,.0f} tokens. ")
    return [Finding(
        Severity.WARNING if short else Severity.INFO, "match-unit-coarse",
        f"Cache hits can only land on multiples of {unit:,} tokens",
        f"Prefix caching reuses whole blocks and this engine's block is {block.value:,} tokens "
        "(hybrid models stretch the attention block until its page is as large as the Mamba page; "
        "fp8 halves the bytes per token, so it doubles the block). A conversation gains nothing "
        f"until several blocks line up: measured flat from 1.2k to 3.1k tokens with 1600-token "
        f"blocks, with a gain only above ~6k. {typical}--prefix-match-unit sets the finest "
        "boundary a hit may land on, independently of the physical block (every block size must "
        "divide by it); in align mode the state is checkpointed where the previous turn ended, so "
        "the next turn's hit lands there. It costs no memory and no concurrency.",
        f"--prefix-match-unit {suggested}", evidence)]


def suggest_match_unit(block_size: int) -> int:
    """The match unit to suggest: 32, else the largest power of two dividing the block."""
    for unit in (32, 16, 8, 4, 2):
        if block_size % unit == 0:
            return unit
    return 1


def check_kv_dtype(facts: EngineFacts) -> list[Finding]:
    """fp8 KV cache lowers the hit rate upstream; on hybrids it also pays for the Mamba slots."""
    dtype = facts.cache_dtype
    if dtype is None or not dtype.value.startswith("fp8") or not _caching_can_hit(facts):
        return []
    hybrid = facts.hybrid is not None and facts.hybrid.value
    if hybrid:
        detail = (
            "Upstream notes that an fp8 KV cache lowers the prefix-cache hit rate, so the measured "
            "rate is probably a floor. Do not drop fp8 to fix it: on a hybrid it halves the bytes "
            "per token (hence the 1600-token block instead of 800) and frees the memory the Mamba "
            "state blocks need; without it max_num_seqs can exceed the Mamba cache blocks and the "
            "engine refuses to start. For the coarse block use --prefix-match-unit instead.")
        fix = ("keep --kv-cache-dtype fp8; to measure without it, first lower --max-num-seqs below "
               "the Mamba cache block count, then compare the hit rates")
    else:
        detail = ("Upstream notes that an fp8 KV cache lowers the prefix-cache hit rate, so the "
                  "measured rate is probably a floor.")
        fix = "if memory allows, compare the hit rate with --kv-cache-dtype auto"
    return [Finding(Severity.INFO, "fp8-kv-cache", f"KV cache dtype {dtype.value} lowers the hit rate",
                    detail, fix, cite(dtype, "cache_dtype"))]


def check_experimental(facts: EngineFacts) -> list[Finding]:
    """Caching over Mamba layers is experimental; with speculative decoding it has corrupted replies."""
    if not _caching_can_hit(facts) or not (facts.hybrid and facts.hybrid.value):
        return []
    canary = "kvroute canary --target URL (150 requests bound the silent failure rate below ~2%)"
    evidence = cite(facts.mamba_cache_mode, "mamba_cache_mode") + cite(
        facts.experimental_warning, "experimental_warning") + cite(facts.speculative, "speculative")
    if facts.speculative is not None:
        return [Finding(
            Severity.WARNING, "hybrid-cache-with-spec-decode",
            f"Experimental Mamba prefix caching together with speculative decoding "
            f"({facts.speculative.value})",
            "Upstream reports that prefix caching with MTP speculative decoding has silently "
            "corrupted a small fraction of replies on hybrid models: empty content or a run of "
            "exclamation marks, with no error raised anywhere. A silent 1% is worse than a slow 100%.",
            canary, evidence)]
    return [Finding(
        Severity.INFO, "mamba-align-experimental",
        "vLLM marks prefix caching for Mamba layers experimental",
        "The engine said so at startup ('Prefix caching in Mamba cache 'align' mode is currently "
        "enabled'). Check replies are still correct before relying on it, and again when the "
        "configuration changes.", canary, evidence)]


def _hybrid_caching(facts: EngineFacts) -> bool:
    return bool(facts.hybrid and facts.hybrid.value and facts.enable_prefix_caching
                and facts.enable_prefix_caching.value)


def _caching_can_hit(facts: EngineFacts) -> bool:
    """Prefix caching on and, on a hybrid, a mode that keeps state (unknown mode: assume it can)."""
    if not (facts.enable_prefix_caching and facts.enable_prefix_caching.value):
        return False
    if facts.hybrid and facts.hybrid.value and facts.mamba_cache_mode is not None:
        return facts.mamba_cache_mode.value in _REUSING_MODES
    return True


# --- the two memory budgets: Mamba state slots and KV cache tokens --------------------------------

# Round sizes for the capacity note when the typical context is unknown.
_EXAMPLE_CONTEXTS = (4_000, 16_000)


def check_mamba_slots(facts: EngineFacts) -> list[Finding]:
    """``max_num_seqs`` above the Mamba cache blocks: vLLM refuses to start (one block per sequence)."""
    slots, seqs = facts.mamba_cache_blocks, facts.max_num_seqs
    if slots is None or seqs is None or (facts.hybrid is not None and not facts.hybrid.value):
        return []
    evidence = cite(seqs, "max_num_seqs") + cite(slots, "mamba_cache_blocks") + cite(
        facts.cache_dtype, "cache_dtype")
    if seqs.value > slots.value:
        fp8_note = ""
        if facts.cache_dtype is not None and not facts.cache_dtype.value.startswith("fp8"):
            fp8_note = (" This is what removing --kv-cache-dtype fp8 does: fp8 was freeing exactly the "
                        "memory those blocks needed.")
        return [Finding(
            Severity.ERROR, "mamba-blocks-below-max-num-seqs",
            f"max_num_seqs ({seqs.value}) exceeds the available Mamba cache blocks ({slots.value})",
            "Each decode sequence needs one Mamba state block, so the engine refuses to start "
            "(CUDA graph capture cannot proceed). On a hybrid model memory has two consumers, KV "
            "blocks and Mamba state blocks, and the error names only one of them." + fp8_note,
            f"--max-num-seqs {slots.value} (or fewer); or give the Mamba state more memory: "
            "keep --kv-cache-dtype fp8, raise --gpu-memory-utilization, lower --max-model-len",
            evidence)]
    if facts.enable_prefix_caching is None or not facts.enable_prefix_caching.value:
        return []
    return [Finding(
        Severity.INFO, "mamba-slots",
        f"{slots.value} Mamba state slots for max_num_seqs {seqs.value}",
        "Cached recurrent states compete for these few slots: live conversations keep their "
        "cache, dormant ones are evicted (three interleaved conversations were measured evicting "
        "each other's state). It is a ceiling, not an unlimited cache.", None, evidence)]


def check_kv_capacity(facts: EngineFacts, traffic: TrafficAssumptions) -> list[Finding]:
    """Rule of thumb: concurrent sessions × typical context must fit in the KV cache."""
    total = facts.total_kv_tokens()
    if total is None or total.value <= 0:
        return []
    sessions = traffic.sessions(facts)
    context = traffic.prompt_tokens(facts)
    evidence = cite(total, "kv_cache_tokens") + cite(sessions, "sessions") + cite(context, "context_tokens")
    if sessions is None or context is None:
        examples = " or ".join(f"{total.value // c:,} of {c // 1000}k tokens" for c in _EXAMPLE_CONTEXTS)
        return [Finding(
            Severity.INFO, "kv-capacity", f"KV cache holds {total.value:,} tokens",
            f"Enough for about {examples} of live conversations at once. Pass --sessions and "
            "--context-tokens to check it against your traffic.", None, evidence)]
    need = round(sessions.value * context.value)
    if need > total.value:
        # Told how many sessions run at once: a real shortfall. Assumed max_num_seqs: a caution.
        told = traffic.concurrent_sessions is not None
        assumed = "" if told else (
            " This assumes max_num_seqs sessions at once; pass --sessions with your real concurrency.")
        return [Finding(
            Severity.WARNING if told else Severity.INFO, "kv-capacity-short",
            f"{sessions.value} sessions × {context.value:,.0f} tokens = {need:,} > {total.value:,} KV tokens",
            "Concurrent sessions × typical context should fit in the cache; otherwise sessions evict "
            "each other's prefixes before their next turn and the hit rate collapses." + assumed,
            "send fewer concurrent sessions to each replica (more replicas), lower --max-num-seqs, "
            "or give the KV cache more memory (--gpu-memory-utilization)", evidence)]
    return [Finding(
        Severity.OK, "kv-capacity",
        f"{sessions.value} sessions × {context.value:,.0f} tokens fit in {total.value:,} KV tokens "
        f"({need / total.value:.0%})",
        "Concurrent sessions × typical context is below the cache size, so live conversations keep "
        "their prefixes.", None, evidence)]


# --- what the engine did rather than how it is configured: counters, errors, gaps -----------------

# Startup errors another check explains in full.
_EXPLAINED = re.compile(r"exceeds available Mamba cache blocks")
# vLLM's wrapper around a root cause logged above it: noise when the root cause is known.
_WRAPPER = re.compile(r"Engine core initialization failed|See root cause above")


def check_hit_rate(facts: EngineFacts) -> list[Finding]:
    """The prefix-cache hit rate measured by the engine's own counters since it started."""
    queries, hits = facts.prefix_cache_queries, facts.prefix_cache_hits
    epc = facts.enable_prefix_caching
    if queries is None or hits is None or (epc is not None and not epc.value):
        return []
    evidence = cite(queries, "queries") + cite(hits, "hits")
    if queries.value <= 0:
        return [Finding(Severity.INFO, "hit-rate-no-traffic", "No prefix-cache lookups yet",
                        "The engine has not served a prompt since it started, so there is no hit "
                        "rate to read.", "kvroute doctor --probe URL", evidence)]
    rate = hits.value / queries.value
    if hits.value <= 0:
        return [Finding(
            Severity.WARNING, "hit-rate-zero", f"0% of {queries.value:,.0f} prompt tokens hit the cache",
            "Either the traffic never repeats a prefix, or the cache cannot hit (see the other "
            "findings). A repeated prompt tells the two apart.", "kvroute doctor --probe URL", evidence)]
    floor = ""
    if facts.cache_dtype is not None and facts.cache_dtype.value.startswith("fp8"):
        floor = " With an fp8 KV cache this is probably a floor."
    return [Finding(Severity.INFO, "hit-rate",
                    f"{rate:.1%} of {queries.value:,.0f} prompt tokens were served from the cache",
                    "Measured by the engine's own counters since it started." + floor, None, evidence)]


def check_startup_errors(facts: EngineFacts) -> list[Finding]:
    """Fatal errors in the startup log that no other check explains.

    vLLM's "Engine core initialization failed" wrapper is only reported when it is all there is.
    """
    causes = [e for e in facts.startup_errors if not _WRAPPER.search(e.value)]
    shown = causes or list(facts.startup_errors)
    return [
        Finding(Severity.ERROR, "startup-error", "The engine failed to start",
                err.value, "read the log lines before this one for the root cause", (err.source,))
        for err in shown
        if not _EXPLAINED.search(err.value)
    ]


def check_conflicts(conflicts: list[Conflict]) -> list[Finding]:
    """Sources that disagree: usually a log from another start, or a proxy in between."""
    return [
        Finding(Severity.WARNING, "sources-disagree", f"Sources disagree about {c.name}",
                f"{c.kept.value} according to {c.kept.source}, {c.other.value} according to "
                f"{c.other.source}. The first is used. Is the log from another start of the engine?",
                None, (c.kept.cite(c.name), c.other.cite(c.name)))
        for c in conflicts
    ]


def check_readable(facts: EngineFacts) -> list[Finding]:
    """Say so when the caching configuration could not be read at all."""
    if facts.enable_prefix_caching is not None or facts.startup_errors:
        return []
    return [Finding(
        Severity.WARNING, "config-unknown", "Could not read the engine's caching configuration",
        "None of /metrics (vllm:cache_config_info), /server_info or a startup log said whether "
        "prefix caching is on. The engine may not be vLLM, or its metrics may be disabled.",
        "pass the startup log with --log FILE, or run --probe for evidence from requests",
        cite(facts.model, "model"))]


# --- the engines of one fleet: which differ from the rest, and in what ----------------------------

# Settings that should agree across replicas of one model; a router sends a conversation to any of
# them, so one odd replica silently loses the cache for every conversation it receives.
COMPARED = ("model", "enable_prefix_caching", "mamba_cache_mode", "block_size", "prefix_match_unit",
            "cache_dtype", "max_num_seqs", "max_model_len", "speculative")


def _setting(facts: EngineFacts, name: str) -> Observed[Any] | None:
    # An unset prefix_match_unit (vLLM reports "None") means the block size: compare what applies,
    # so a replica started without --prefix-match-unit stands out from those started with it.
    if name == "prefix_match_unit":
        return facts.match_unit()
    value: Observed[Any] | None = getattr(facts, name)
    return value


def compare_fleet(engines: Sequence[tuple[str, EngineFacts]]) -> list[Finding]:
    """One finding per setting on which the named engines disagree (majority value first)."""
    if len(engines) < 2:
        return []
    findings: list[Finding] = []
    for name in COMPARED:
        values = {label: _setting(facts, name) for label, facts in engines}
        known = {label: obs.value for label, obs in values.items() if obs is not None}
        distinct = Counter(known.values())
        if len(distinct) < 2:
            continue
        majority, _ = distinct.most_common(1)[0]
        odd = {label: value for label, value in known.items() if value != majority}
        same = [label for label, value in known.items() if value == majority]
        detail = "; ".join(f"{label}: {value}" for label, value in odd.items())
        findings.append(Finding(
            Severity.WARNING, "fleet-differs",
            f"{name} differs on {', '.join(odd)} (the rest: {majority})",
            f"{detail}; {majority} on {', '.join(same)}. Replicas behind one router should be "
            "configured alike, or conversations placed on the odd ones lose their cache.",
            f"start {', '.join(odd)} with the same flags as {same[0]}",
            tuple(obs.cite(f"{label} {name}") for label, obs in values.items() if obs is not None)))
    unknown = [label for label, facts in engines if all(_setting(facts, n) is None for n in COMPARED)]
    if not findings:
        findings.append(Finding(
            Severity.OK, "fleet-consistent",
            f"All {len(engines) - len(unknown)} readable engines report the same settings",
            "Compared: " + ", ".join(COMPARED) + "." + (
                f" Not readable on {', '.join(unknown)}." if unknown else ""), None))
    return findings


# --- one engine's facts -> every check's findings -------------------------------------------------

def diagnose(merged: MergedFacts, traffic: TrafficAssumptions | None = None) -> list[Finding]:
    """Every check's findings for one engine, sorted most severe first (stable within a severity)."""
    facts = merged.facts
    assumed = traffic or TrafficAssumptions()
    findings = [
        *check_startup_errors(facts),
        *check_mamba_slots(facts),
        *check_prefix_caching(facts),
        *check_mamba_mode(facts),
        *check_match_unit(facts, assumed),
        *check_kv_dtype(facts),
        *check_experimental(facts),
        *check_hit_rate(facts),
        *check_kv_capacity(facts, assumed),
        *check_conflicts(merged.conflicts),
        *check_readable(facts),
    ]
    return sorted(findings, key=lambda f: -f.severity.rank)
