"""What the router learns about each worker from its own decisions and the engines' reports.

Four figures per worker (the first and third are exponentially weighted averages):

* **prefill seconds per token** (``rate``): the mean time to first token divided by the mean
  prefill work the router predicted for the same requests (backlog ahead of them plus their own
  uncached tokens).  Requests and completions are not paired one to one (``on_finished`` does not
  name the request); both averages move once per request, so their ratio converges all the same.
* **fastest prefill** (``fastest``): seconds per token of the quickest prefills the engine reports,
  ``ttft / (prompt - cached tokens)`` over requests with at least ``floor_min_tokens`` to compute.
  Queueing only ever makes that figure larger, so the low envelope of the samples is the engine's
  own speed, on the router's clock: it moves down quickly (``floor_pull`` of the way to a faster
  sample) and up slowly (``floor_relax`` per slower sample, so a long overload does not pass for
  slow hardware).  It sets the backlog's drain; unlike ``rate`` it does not absorb queueing.
* **cache realisation** (``realised``): the engine's reported hit share (cached / prompt tokens)
  divided by the share the index predicted.  Below 1 the engine evicted what the index still
  believes cached (a full KV cache under load), so affinity is worth less there.
  The hit shares are the current engine's: a new epoch (a restart, a re-registration) forgets
  them, since the engine that earned them is gone and its successor may be configured otherwise.
  ``predicted_cached_tokens`` counts the tokens the index predicted cached, so that a reader of
  ``realised`` (the fleet guard's drift alarm) can tell a figure earned under traffic from noise.
  The evidence ages (``realisation_fade_s``, a time constant): routing reads ``realisation(now)``,
  whose deficit 1 - ``realised`` fades back to 0 with the time since the engine's last report, and a
  report after a gap counts for what faded meanwhile (both hit shares weigh a sample
  ``max(alpha, 1 - exp(-gap / realisation_fade_s))``).  A deficit is evidence of a cache under
  pressure, and pressure passes; a worker that a low figure keeps requests from gets few reports,
  and with per-sample weights alone that figure outlived the pressure.  A report that confirms the
  deficit restores it, so one renewed often enough keeps its figure, however sparse.  ``realised``
  itself does not fade: the drift alarm reads it, and must not clear because a worker got no traffic.
* **backlog**: prefill work the router sent and believes not yet done, drained at the rate the
  scheduler passes (the configured one, or ``fastest`` where the engine is quicker) and never more
  than the prefill of the requests still in flight there (``drain(..., inflight=n)``): a request
  that has finished has no prefill left, whatever the clock says.  Without that bound a drain
  slower than the engine (faster hardware than the default rate assumes, or replicas simulated
  faster than real time) lets the backlog grow for as long as the load lasts.

``rate``, ``fastest`` and ``realised`` are recomputed when a sample arrives, so reading them costs
nothing on the decision path (``realisation(now)`` one exponential); the in-flight bound costs O(1)
amortised.  Every time passed in is the scheduler's injected clock, so both clocks learn alike.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvroute.routing.settings import check_non_negative, setting

# Sent requests remembered for the in-flight bound (more than any engine's max_num_seqs).
_MAX_SENT = 1024


@dataclass(frozen=True, slots=True)
class LearningSettings:
    """How the router learns each worker's figures (used by ``auto``'s signals)."""

    prefill_s_per_token: float = setting(
        1.5e-4, "prefill seconds per uncached token before anything is learned (an A4000's); only "
                "matters in absolute terms for the backlog, relative costs cancel it out")
    learn_rate: bool = setting(
        False, "use the prefill rate learned from reported TTFTs instead of prefill_s_per_token (off: "
               "TTFT includes queueing, so the learned rate runs high; docs/routing.md)")
    learn_prefill_speed: bool = setting(
        True, "drain the backlog at the engine's own prefill speed, learned from its fastest "
              "prefills, once learn_min_samples of them have finished")
    learn_floor_min_tokens: int = setting(
        1024, "computed tokens a finished request needs to count as a prefill-speed sample")
    learn_floor_pull: float = setting(0.5, "how far a faster sample pulls the learned speed (0-1]")
    learn_floor_relax: float = setting(0.001, "how much a slower sample lets the learned speed rise")
    learn_alpha: float = setting(0.05, "EWMA weight of a new sample (0-1]")
    learn_min_samples: int = setting(8, "samples needed before a learned figure is used")
    learn_realisation_fade_s: float = setting(
        120.0, "time constant (s) of the learned cache realisation's evidence: its deficit fades back "
              "to 0 while no engine report renews it, and a report after a gap counts for what faded, "
              "so a low figure learnt under pressure does not outlive it on a worker it keeps "
              "requests from (0: no fade, per-sample weights alone; the drift alarm reads the reports "
              "without the fade)")

    def __post_init__(self) -> None:
        check_non_negative(self, "prefill_s_per_token", "learn_floor_relax", "learn_realisation_fade_s")
        if self.prefill_s_per_token <= 0:
            raise ValueError("prefill_s_per_token must be positive")
        if not 0 < self.learn_alpha <= 1:
            raise ValueError("learn_alpha must be in (0, 1]")
        if self.learn_min_samples < 0:
            raise ValueError("learn_min_samples must be non-negative")
        if self.learn_floor_min_tokens < 1:
            raise ValueError("learn_floor_min_tokens must be positive")
        if not 0 < self.learn_floor_pull <= 1:
            raise ValueError("learn_floor_pull must be in (0, 1]")
        if not math.isfinite(self.learn_floor_relax):
            raise ValueError("learn_floor_relax must be finite")
        if not math.isfinite(self.learn_realisation_fade_s):
            raise ValueError("learn_realisation_fade_s must be finite (0 turns the fade off)")


@dataclass(slots=True)
class _Ewma:
    value: float = 0.0
    samples: int = 0
    at: float | None = None  # when the last sample came (``add_aged`` only)

    def add(self, x: float, alpha: float) -> None:
        # The first samples are weighted 1/n so the average is not biased towards zero.
        self.samples += 1
        self.value += (x - self.value) * max(alpha, 1.0 / self.samples)

    def add_aged(self, x: float, alpha: float, now: float, fade_s: float) -> None:
        """``add``, the sample weighing at least what the average's evidence lost to age since the
        previous one (1 - exp(-gap / fade_s); nothing with ``fade_s`` 0 or a clock that stepped
        back)."""
        at, self.at = self.at, now if self.at is None else max(self.at, now)
        self.samples += 1
        weight = max(alpha, 1.0 / self.samples)
        if fade_s > 0 and at is not None and now > at:
            weight = max(weight, -math.expm1((at - now) / fade_s))
        self.value += (x - self.value) * weight


@dataclass(slots=True)
class WorkerLearning:
    """Learned figures for one worker.

    ``alpha`` is the EWMA weight of a new sample; ``min_samples`` how many of each kind are needed
    before a learned figure replaces its default (``rate`` None, ``realised`` 1.0);
    ``realisation_fade_s`` the time constant with which the realisation's evidence ages (0: never).
    """

    alpha: float = 0.05
    min_samples: int = 8
    floor_min_tokens: int = 1024
    floor_pull: float = 0.5
    floor_relax: float = 0.001
    realisation_fade_s: float = 0.0
    rate: float | None = None
    fastest: float | None = None
    realised: float = 1.0
    backlog_tokens: float = 0.0
    backlog_at: float = 0.0
    predicted_cached_tokens: float = 0.0
    _ttft_s: _Ewma = field(default_factory=_Ewma)
    _work_tokens: _Ewma = field(default_factory=_Ewma)
    _hit_reported: _Ewma = field(default_factory=_Ewma)
    _hit_predicted: _Ewma = field(default_factory=_Ewma)
    # Prefill tokens of the latest requests sent, newest last, and their sum: the ones still in
    # flight are the newest (responses end roughly in the order they were sent).
    _sent: deque[float] = field(default_factory=deque)
    _sent_sum: float = 0.0
    _floor: float = 0.0
    _floor_samples: int = 0

    @classmethod
    def from_settings(cls, s: LearningSettings) -> WorkerLearning:
        """Empty figures learned as ``s`` says."""
        return cls(s.learn_alpha, s.learn_min_samples, s.learn_floor_min_tokens, s.learn_floor_pull,
                   s.learn_floor_relax, s.learn_realisation_fade_s)

    def drain_rate(self, s: LearningSettings) -> float:
        """Seconds per token at which this worker's backlog drains: the TTFT-based rate when
        enabled, else the configured one, but never slower than the engine's fastest prefills
        (``learn_prefill_speed``).  Only the backlog drains at it: costs keep one scale for every
        worker, since a per-worker figure would tilt every comparison."""
        rate = (self.rate if s.learn_rate else None) or s.prefill_s_per_token
        fastest = self.fastest if s.learn_prefill_speed else None
        return fastest if fastest is not None and fastest < rate else rate

    def cost_rate(self, s: LearningSettings) -> float:
        """Seconds per token the cost prices prefill at (the learned rate only with ``learn_rate``)."""
        return (self.rate if s.learn_rate else None) or s.prefill_s_per_token

    def drain(self, now: float, s_per_token: float, inflight: int | None = None) -> float:
        """Drain the backlog to ``now`` and return the prefill tokens still believed queued on the
        worker.  With ``inflight`` (the requests in flight there now) the backlog is also cut to the
        prefill of the newest ``inflight`` requests sent, and the cut is kept: a finished request
        has no prefill left, whatever the clock says."""
        left = self.backlog_tokens - (now - self.backlog_at) / s_per_token
        if left <= 0.0:
            return 0.0
        if inflight is not None:
            sent = self._sent
            while len(sent) > inflight:
                self._sent_sum -= sent.popleft()
            if len(sent) == inflight and left > self._sent_sum:
                # Requests not seen sent (another path, not cacheable) leave the bound unknown.
                left = self._sent_sum if self._sent_sum > 0.0 else 0.0
                self.backlog_tokens, self.backlog_at = left, now
        return left

    def add_backlog(self, now: float, s_per_token: float, tokens: float) -> float:
        """Queue ``tokens`` of prefill; returns the backlog that was ahead of them."""
        ahead = self.drain(now, s_per_token)
        self.backlog_tokens = ahead + tokens
        self.backlog_at = now
        self._sent.append(tokens)
        self._sent_sum += tokens
        if len(self._sent) > _MAX_SENT:
            self._sent_sum -= self._sent.popleft()
        return ahead

    def on_sent(self, now: float, s_per_token: float, prefill_tokens: float,
                predicted_hit: float | None, predicted_tokens: float = 0.0) -> None:
        """A request was sent: add its prefill to the backlog and note the prediction made (the
        share of the prompt the index expects cached, and those tokens)."""
        ahead = self.add_backlog(now, s_per_token, prefill_tokens)
        self._work_tokens.add(ahead + prefill_tokens, self.alpha)
        if predicted_hit is not None:
            self._hit_predicted.add_aged(predicted_hit, self.alpha, now, self.realisation_fade_s)
            self.predicted_cached_tokens += predicted_tokens
        self._update()

    def new_epoch(self) -> None:
        """The worker restarted or re-registered: its queue is empty and the realisation learned
        from the engine before is forgotten (back to 1.0 until ``min_samples`` new ones)."""
        self.backlog_tokens = 0.0
        self._hit_reported = _Ewma()
        self._hit_predicted = _Ewma()
        self.realised = 1.0

    def on_finished(self, now: float, prompt_tokens: int | None, cached_tokens: int | None,
                    ttft_s: float | None) -> None:
        """A request finished at ``now``; learn from whatever the engine reported."""
        if ttft_s is not None and ttft_s >= 0:
            self._ttft_s.add(ttft_s, self.alpha)
        if prompt_tokens and cached_tokens is not None and 0 <= cached_tokens <= prompt_tokens:
            hit = cached_tokens / prompt_tokens
            self._hit_reported.add_aged(hit, self.alpha, now, self.realisation_fade_s)
            computed = prompt_tokens - cached_tokens
            if ttft_s is not None and ttft_s > 0 and computed >= max(1, self.floor_min_tokens):
                self._add_floor(ttft_s / computed)
        self._update()

    def _add_floor(self, s_per_token: float) -> None:
        """One prefill's seconds per computed token: pull the envelope down, or let it rise slowly."""
        floor = self._floor
        self._floor_samples += 1
        if self._floor_samples == 1 or s_per_token <= floor:
            floor += (s_per_token - floor) * (1.0 if self._floor_samples == 1 else self.floor_pull)
        else:
            floor = min(s_per_token, floor * (1.0 + self.floor_relax))
        self._floor = floor
        if self._floor_samples >= max(1, self.min_samples):
            self.fastest = floor

    def realisation(self, now: float) -> float:
        """The cache realisation routing counts on at ``now``: ``realised``, its deficit faded with
        the time since the engine's last report (module docstring)."""
        at, fade_s = self._hit_reported.at, self.realisation_fade_s
        if fade_s <= 0 or at is None or now <= at or self.realised >= 1.0:
            return self.realised
        return 1.0 - (1.0 - self.realised) * math.exp((at - now) / fade_s)

    def _update(self) -> None:
        need = max(1, self.min_samples)
        t, w = self._ttft_s, self._work_tokens
        if min(t.samples, w.samples) >= need and w.value > 0 and t.value > 0:
            self.rate = t.value / w.value
        r, p = self._hit_reported, self._hit_predicted
        if min(r.samples, p.samples) >= need and p.value > 0:
            self.realised = min(1.0, r.value / p.value)
