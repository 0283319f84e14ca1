"""Checks that prefix caching is on and able to hit: the seed's three missing arguments.

1. Hybrid models run with prefix caching off unless asked (``--enable-prefix-caching``).
2. On a hybrid, caching without ``--mamba-cache-mode align`` has nowhere to keep the recurrent
   state, so nothing is reused.
3. A hybrid's stretched block (1600 tokens with fp8, 800 without) means short conversations never
   reach a whole block; ``--prefix-match-unit 32`` lets a hit land where the state checkpoint is.
"""

from __future__ import annotations

from kvroute.doctor.facts import EngineFacts, cite
from kvroute.doctor.finding import Finding, Severity
from kvroute.doctor.workload import Workload

ALIGN_FIX = "--enable-prefix-caching --mamba-cache-mode align"
# Match units at or above this many tokens make ordinary chat turns miss.
COARSE_UNIT = 256
# Below this many blocks per prompt the seed measured no gain at all (1600-token blocks, gain from ~6k).
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


def check_match_unit(facts: EngineFacts, workload: Workload) -> list[Finding]:
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
    prompt = workload.prompt_tokens(facts)
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
    """The match unit to suggest: 32 (the seed's), else the largest power of two dividing the block."""
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
