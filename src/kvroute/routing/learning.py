"""What the router learns about each worker from its own decisions and the engines' reports.

Three figures per worker, from exponentially weighted averages:

* **prefill seconds per token** (``rate``): the mean time to first token divided by the mean
  prefill work the router predicted for the same requests (backlog ahead of them plus their own
  uncached tokens).  Requests and completions are not paired one to one (``on_finished`` does not
  name the request); both averages move once per request, so their ratio converges all the same.
* **cache realisation** (``realised``): the engine's reported hit share (cached / prompt tokens)
  divided by the share the index predicted.  Below 1 the engine evicted what the index still
  believes cached (a full KV cache under load), so affinity is worth less there.
* **backlog**: prefill work the router sent and believes not yet done, drained at ``rate``.

``rate`` and ``realised`` are recomputed when a sample arrives, so reading them costs nothing on
the decision path.
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
    """Learned figures for one worker.

    ``alpha`` is the EWMA weight of a new sample; ``min_samples`` how many of each kind are needed
    before a learned figure replaces its default (``rate`` None, ``realised`` 1.0).
    """

    alpha: float = 0.05
    min_samples: int = 8
    rate: float | None = None
    realised: float = 1.0
    backlog_tokens: float = 0.0
    backlog_at: float = 0.0
    _ttft_s: _Ewma = field(default_factory=_Ewma)
    _work_tokens: _Ewma = field(default_factory=_Ewma)
    _hit_reported: _Ewma = field(default_factory=_Ewma)
    _hit_predicted: _Ewma = field(default_factory=_Ewma)

    def backlog(self, now: float, s_per_token: float) -> float:
        """Prefill tokens still believed queued on the worker at ``now``."""
        left = self.backlog_tokens - (now - self.backlog_at) / s_per_token
        return left if left > 0.0 else 0.0

    def add_backlog(self, now: float, s_per_token: float, tokens: float) -> float:
        """Queue ``tokens`` of prefill; returns the backlog that was ahead of them."""
        ahead = self.backlog(now, s_per_token)
        self.backlog_tokens = ahead + tokens
        self.backlog_at = now
        return ahead

    def on_sent(self, now: float, s_per_token: float, prefill_tokens: float,
                predicted_hit: float | None) -> None:
        """A request was sent: add its prefill to the backlog and note the prediction made."""
        ahead = self.add_backlog(now, s_per_token, prefill_tokens)
        self._work_tokens.add(ahead + prefill_tokens, self.alpha)
        if predicted_hit is not None:
            self._hit_predicted.add(predicted_hit, self.alpha)
        self._update()

    def on_finished(self, prompt_tokens: int | None, cached_tokens: int | None, ttft_s: float | None) -> None:
        """A request finished; learn from whatever the engine reported."""
        if ttft_s is not None and ttft_s >= 0:
            self._ttft_s.add(ttft_s, self.alpha)
        if prompt_tokens and cached_tokens is not None and 0 <= cached_tokens <= prompt_tokens:
            self._hit_reported.add(cached_tokens / prompt_tokens, self.alpha)
        self._update()

    def _update(self) -> None:
        need = max(1, self.min_samples)
        t, w = self._ttft_s, self._work_tokens
        if min(t.samples, w.samples) >= need and w.value > 0 and t.value > 0:
            self.rate = t.value / w.value
        r, p = self._hit_reported, self._hit_predicted
        if min(r.samples, p.samples) >= need and p.value > 0:
            self.realised = min(1.0, r.value / p.value)
