"""Checks of the two memory budgets: Mamba state slots and KV cache tokens."""

from __future__ import annotations

from kvroute.doctor.facts import EngineFacts, cite
from kvroute.doctor.finding import Finding, Severity
from kvroute.doctor.workload import Workload

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


def check_kv_capacity(facts: EngineFacts, workload: Workload) -> list[Finding]:
    """Rule of thumb: concurrent sessions × typical context must fit in the KV cache."""
    total = facts.total_kv_tokens()
    if total is None or total.value <= 0:
        return []
    sessions = workload.sessions(facts)
    context = workload.prompt_tokens(facts)
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
        told = workload.concurrent_sessions is not None
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
