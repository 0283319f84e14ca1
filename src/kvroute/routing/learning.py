"""What the router learns about each worker from its own decisions and the engines' reports.

Three figures per worker, all plain exponentially weighted averages:

* **prefill seconds per token**: the mean time to first token divided by the mean prefill work the
  router predicted for the same requests (backlog ahead of them plus their own uncached tokens).
  Requests and completions are not paired one to one (``on_finished`` does not name the request);
  both averages move once per request, so their ratio converges all the same.
* **cache realisation**: the engine's reported hit share (cached / prompt tokens) divided by the
  share the index predicted.  Below 1 the engine evicted what the index still believes cached
  (a full KV cache under load), so affinity is worth less there.
* **backlog**: prefill work the router sent and believes not yet done, drained at the learned rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Ewma:
    value: float = 0.0
    samples: int = 0

    def add(self, x: float, alpha: float) -> None:
        # The first samples are weighted 1/n so the average is not biased towards zero.
        self.samples += 1
        self.value += (x - self.value) * max(alpha, 1.0 / self.samples)


@dataclass(slots=True)
class WorkerLearning:
    """Learned figures for one worker; ``alpha`` is the EWMA weight of a new sample."""

    alpha: float = 0.05
    ttft_s: _Ewma = field(default_factory=_Ewma)
    work_tokens: _Ewma = field(default_factory=_Ewma)
    hit_reported: _Ewma = field(default_factory=_Ewma)
    hit_predicted: _Ewma = field(default_factory=_Ewma)
    backlog_tokens: float = 0.0
    backlog_at: float = 0.0

    def s_per_token(self, default: float, min_samples: int) -> float:
        """Learned prefill seconds per token, or ``default`` until enough samples arrived."""
        t, w = self.ttft_s, self.work_tokens
        if min(t.samples, w.samples) < max(1, min_samples) or w.value <= 0 or t.value <= 0:
            return default
        return t.value / w.value

    def realisation(self, min_samples: int) -> float:
        """Share of the predicted cache hits the engine actually reported, in [0, 1]."""
        r, p = self.hit_reported, self.hit_predicted
        if min(r.samples, p.samples) < max(1, min_samples) or p.value <= 0:
            return 1.0
        return min(1.0, r.value / p.value)

    def backlog(self, now: float, s_per_token: float) -> float:
        """Prefill tokens still believed queued on the worker at ``now``."""
        elapsed = max(0.0, now - self.backlog_at)
        return max(0.0, self.backlog_tokens - elapsed / s_per_token)

    def on_sent(self, now: float, s_per_token: float, prefill_tokens: float,
                predicted_hit: float | None) -> None:
        """A request was sent: add its prefill to the backlog and note the prediction made."""
        ahead = self.backlog(now, s_per_token)
        self.backlog_tokens = ahead + prefill_tokens
        self.backlog_at = now
        self.work_tokens.add(ahead + prefill_tokens, self.alpha)
        if predicted_hit is not None:
            self.hit_predicted.add(predicted_hit, self.alpha)

    def on_finished(self, prompt_tokens: int | None, cached_tokens: int | None, ttft_s: float | None) -> None:
        """A request finished; learn from whatever the engine reported."""
        if ttft_s is not None and ttft_s >= 0:
            self.ttft_s.add(ttft_s, self.alpha)
        if prompt_tokens and cached_tokens is not None and 0 <= cached_tokens <= prompt_tokens:
            self.hit_reported.add(cached_tokens / prompt_tokens, self.alpha)
