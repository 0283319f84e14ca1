"""Routing settings as plain, validated data: one ``ModelPolicy`` per model plus index-wide limits.

Every tunable of the ``auto`` policy is a field here so the virtual-time cluster can sweep it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

POLICY_NAMES: tuple[str, ...] = ("round-robin", "p2c", "least-loaded", "prefix", "session", "auto")

# vLLM's default --max-num-seqs; used when neither the engine nor the configuration says.
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """How requests for one model are routed.

    ``overflow`` is seed 2's threshold: a session leaves its worker once that worker has more than
    this many requests in flight; ``"auto"`` means a quarter of ``max_num_seqs`` for ``session``,
    and "whatever the predicted time to first token says" for ``auto`` (a number there is a hard cap).

    ``slack_steps`` is seed 1's slack rule: the cached worker may carry one more in-flight request
    than the freest candidate per step the prompt's estimated token count reaches.

    The ``auto`` policy predicts each candidate's time to first token, in seconds, as
    ``s_per_token * (backlog + uncached + inflight_tokens * busy + waiting_tokens * waiting)``,
    where ``uncached`` discounts the index's match by the engine-reported hit share and the backlog
    weighs more where the engine evicts (``eviction_weight``),
    adds ``prefill_penalty`` times the uncached tokens' prefill for the delay they cause to others
    and ``active_session_tokens`` per other session living there, and takes the lowest; see
    docs/routing.md.
    """

    policy: str = "auto"
    sticky: bool = True
    overflow: int | Literal["auto"] = "auto"
    max_num_seqs: int | None = None
    slack_steps: tuple[int, ...] = (1024, 4096, 8192, 32768)
    # --- auto ---
    # Prefill seconds per uncached token before anything is learned (and for workers that never
    # report TTFT).  Only matters in absolute terms for the backlog; relative costs cancel it out.
    prefill_s_per_token: float = 1.5e-4
    # Token-equivalents of delay per request in flight on a worker (decode interference, and a
    # generic load signal when the engine reports nothing).
    inflight_tokens: float = 256.0
    # Token-equivalents per request the engine reports as waiting (it is out of slots or KV blocks).
    waiting_tokens: float = 8192.0
    # Weight of the router's own estimate of prefill work still queued on a worker (0 disables).
    backlog_weight: float = 1.0
    # Extra weight on that backlog as the worker's cache fails to keep what the index predicts
    # (times 1 - realisation): past the KV cache, prefill queued ahead also takes the blocks that
    # held other prefixes (see cache_survival.py).
    eviction_weight: float = 1.0
    # A session stays on its worker unless another is predicted faster by more than this many tokens.
    stay_tokens: float = 512.0
    # Extra weight on uncached tokens beyond this request's own wait: prefill sent anywhere delays
    # every request queued behind it, so a cache miss costs the fleet more than its own TTFT.
    prefill_penalty: float = 1.0
    # How far the engine-reported hit share discounts the index's matches (0: trust the index,
    # 1: scale matches by the reported/predicted hit ratio; see cache_survival.py).
    realisation_weight: float = 1.0
    # New sessions go to workers with at most this many more active sessions than the least
    # (None: off, the default; active sessions weigh in the cost instead, see session_load.py).
    session_spread: int | None = 2
    # Token-equivalents of future load per other session active on a worker, for requests with a
    # session: each of them keeps sending turns there (0 disables).
    active_session_tokens: float = 8192.0
    # A session counts as active on its worker while its last request is younger than this.
    session_active_s: float = 60.0
    # Use the prefill rate learned from reported TTFTs instead of prefill_s_per_token.  Off by
    # default: TTFT includes queueing and misses the index did not foresee, so the learned rate runs
    # high and the backlog then drains too slowly (measured in docs/routing.md).
    learn_rate: bool = False
    # Drain the backlog at the engine's own prefill speed, learned from the fastest prefills it
    # reports (TTFT per computed token; queueing only slows them), once learn_min_samples requests
    # of at least learn_floor_min_tokens computed tokens have finished; prefill_s_per_token until
    # then.  The default rate is an A4000's: faster hardware, or replicas simulated faster than real
    # time, would otherwise drain it several times too slowly (see learning.py).
    learn_prefill_speed: bool = True
    learn_floor_min_tokens: int = 1024
    # How far a faster sample pulls the learned speed (0-1], and how much a slower one lets it rise.
    learn_floor_pull: float = 0.5
    learn_floor_relax: float = 0.001
    # Learning from finished requests: EWMA weight, and samples needed before a figure is used.
    learn_alpha: float = 0.05
    learn_min_samples: int = 8

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; expected one of {', '.join(POLICY_NAMES)}")
        if self.overflow != "auto" and (
            isinstance(self.overflow, bool) or not isinstance(self.overflow, int) or self.overflow < 0
        ):
            raise ValueError("overflow must be 'auto' or a non-negative integer")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if list(self.slack_steps) != sorted(self.slack_steps) or any(s < 0 for s in self.slack_steps):
            raise ValueError("slack_steps must be non-negative and ascending")
        for name in ("prefill_s_per_token", "inflight_tokens", "waiting_tokens", "backlog_weight",
                     "stay_tokens", "prefill_penalty", "realisation_weight", "session_active_s",
                     "active_session_tokens", "eviction_weight"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite non-negative number")
        if self.prefill_s_per_token <= 0:
            raise ValueError("prefill_s_per_token must be positive")
        if self.realisation_weight > 1:
            raise ValueError("realisation_weight must be between 0 and 1")
        if self.session_spread is not None and self.session_spread < 0:
            raise ValueError("session_spread must be non-negative or None")
        if not 0 < self.learn_alpha <= 1:
            raise ValueError("learn_alpha must be in (0, 1]")
        if self.learn_min_samples < 0:
            raise ValueError("learn_min_samples must be non-negative")
        if self.learn_floor_min_tokens < 1:
            raise ValueError("learn_floor_min_tokens must be positive")
        if not 0 < self.learn_floor_pull <= 1:
            raise ValueError("learn_floor_pull must be in (0, 1]")
        if not math.isfinite(self.learn_floor_relax) or self.learn_floor_relax < 0:
            raise ValueError("learn_floor_relax must be a finite non-negative number")

    def overflow_threshold(self, worker_max_num_seqs: int | None) -> int:
        """Seed 2's threshold for one worker: the configured number, or a quarter of max_num_seqs."""
        if self.overflow != "auto":
            return self.overflow
        seqs = worker_max_num_seqs or self.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        return max(1, seqs // 4)

    def slack_for(self, est_tokens: int) -> int:
        """Seed 1's slack: how many more in-flight requests a cached worker may carry."""
        return sum(1 for step in self.slack_steps if est_tokens >= step)


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Index, session-table and hashing limits shared by every model, plus per-model policies.

    ``window_bytes`` is seed 1's window: every block in it is indexed.  With ``hash_beyond_window``
    the rest of the prompt (up to ``max_hash_bytes``) is hashed too, and a bounded sample of its
    blocks is stored: ``anchors_per_octave`` positions per doubling of the prompt length plus the
    last ``tail_blocks``; that is what tells apart conversations whose first 32 KB are identical.
    """

    default: ModelPolicy = field(default_factory=ModelPolicy)
    models: dict[str, ModelPolicy] = field(default_factory=dict)
    index_max_blocks: int = 200_000
    index_max_age_s: float = 5400.0
    block_bytes: int = 512
    window_bytes: int = 32768
    hash_beyond_window: bool = True
    max_hash_bytes: int = 4 * 1024 * 1024
    anchors_per_octave: int = 8
    tail_blocks: int = 16
    session_ttl_s: float = 3600.0
    session_max: int = 100_000
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("index_max_blocks", "block_bytes", "window_bytes", "max_hash_bytes", "session_max")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer")
        for name in ("index_max_age_s", "session_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.anchors_per_octave < 1 or self.tail_blocks < 1:
            raise ValueError("anchors_per_octave and tail_blocks must be at least 1")
        if not isinstance(self.default, ModelPolicy):
            raise ValueError("default must be a ModelPolicy")
        for model, pol in self.models.items():
            if not isinstance(pol, ModelPolicy):
                raise ValueError(f"models[{model!r}] must be a ModelPolicy")

    def policy_for(self, model: str) -> ModelPolicy:
        """The policy for ``model``, falling back to the default."""
        return self.models.get(model, self.default)

    @property
    def window_blocks(self) -> int:
        """How many leading blocks are always indexed (seed 1's 32 KB window)."""
        return self.window_bytes // self.block_bytes
