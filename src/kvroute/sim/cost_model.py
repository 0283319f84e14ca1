"""How long one scheduler step takes, from what the step computes.

``step_s = a + b*prefill_tokens + c*attention_work + [d0 + d1*decoding_seqs + d_kv*decode_context]``

* ``prefill_tokens``: prompt (or recomputed) tokens computed in the step, all sequences together;
* ``attention_work``: for each prefill chunk, its tokens times their mean context
  (``n * (computed_before + n/2)``), i.e. the quadratic part of attention;
* the bracket applies only when at least one sequence decodes: ``decoding_seqs`` sequences each
  produce one token, reading ``decode_context`` cached tokens in total.

``request_overhead_s`` is not engine time: it is the fixed per-request cost that a client measures
on top of the engine (API gateway, network, tokenization), which the prefix-hashing design's
end-to-end timings include.  Callers add it before handing a request to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one scheduler step computes, as the cost model sees it."""

    prefill_tokens: int = 0
    attention_work: float = 0.0
    decoding_seqs: int = 0
    decode_context: int = 0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Named parameters of the step-time formula (seconds; see the module docstring)."""

    a: float = 0.005
    b: float = 2.0e-4
    c: float = 1.0e-8
    d0: float = 0.015
    d1: float = 2.0e-4
    d_kv: float = 1.0e-8
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d0", "d1", "d_kv", "request_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost parameter {name} must be >= 0")

    def step_seconds(self, work: StepWork) -> float:
        """Model time of one step that does ``work`` (0 for an empty step)."""
        if work.prefill_tokens == 0 and work.decoding_seqs == 0:
            return 0.0
        t = self.a + self.b * work.prefill_tokens + self.c * work.attention_work
        if work.decoding_seqs:
            t += self.d0 + self.d1 * work.decoding_seqs + self.d_kv * work.decode_context
        return t
