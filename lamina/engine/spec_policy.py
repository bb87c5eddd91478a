"""How many MTP drafts to propose each step: the fixed and the auto policy (pure CPU, no tensors).

`fixed` always proposes K. `auto` picks the k in 0..K that maximises expected tokens per unit of
step time for the current batch of B decoding requests:

    E(k)    = 1 + sum_{j<=k} prod_{i<=j} c_i      (c_i: measured acceptance of draft i, given
                                                  drafts 1..i-1 were accepted)
    cost(k) = rho(B, k) * model(B, k)    (seconds, once steps of B's size class are timed)
    model(B, k) = (1 + r1) f(B (k+1)) + k r f(B),    f(n) = max(1, n / n_sat)

The model: the target scores B(k+1) tokens and the drafter's first pass runs over the same
tokens (r1 = MTP layers / target layers; it runs at k = 0 too, keeping the drafter's KV history
complete); each further draft costs r (an MTP pass and the LM head over B rows); a forward of up
to n_sat tokens costs about the same (memory bound).

rho corrects the model with time: with `auto_cost="measured"` the engine reports the wall time of
every step in which each request decoded with k drafts verified and k proposed (no prompt tokens),
and rho(B, k) is a decaying average of measured / modelled cost for B's size class (powers of
two) at that k. A k not timed in the class is assumed to cost what the nearest cheaper timed k
costs, plus 10 %: optimistic, so it gets tried (and timed) once it promises clearly more. Timings go stale (each one's
weight, +1 per own step up to 8, decays by 0.995 per timed step; below 0.5 it is stale: about
550 steps after a k was last used), so the policy re-tries a k it stopped using now and then.
On an H200 without CUDA graphs a verification step costs far more than the model says (launch
bound; docs/PERFORMANCE.md), and the extra cost barely grows with k: only timing reveals that.

While k = 0 nothing is measured, so after `probe_interval` steps (doubling after each probe that
leaves speculation off, up to 8x) the policy proposes drafts for `probe_steps` steps, at the most promising k >= 1 (the steps after the first verify and propose
that many: timed steps; a k's first timing is only trusted once a second one confirms it).
Conversely, before speculating in a size class whose k = 0 step is not timed (or went stale), it
runs `probe_steps` steps without drafts to time that baseline (at most once per
`probe_interval` steps, so steps that can never be timed do not stop speculation).
Acceptance counts decay by `decay` per verified request (a window of about 100 verifications,
so one step at batch 64, many at batch 1), so the policy follows the text.
"""

from __future__ import annotations

from lamina.engine.spec_decode import SPEC_POLICIES, SpeculativeConfig


def size_class(batch: int) -> int:
    """Batch sizes timed together: 1, 2-3, 4-7, 8-15, ..."""
    return max(1, batch).bit_length()


class SpecDecodePolicy:
    def __init__(
        self, config: SpeculativeConfig, *, num_hidden_layers: int, num_mtp_layers: int, device_type: str,
        decay: float = 0.99, probe_interval: int = 32, probe_steps: int = 3, prior: float = 0.5,
        prior_weight: float = 1.0, time_alpha: float = 0.3, time_decay: float = 0.995,
        max_time_weight: float = 8.0, stale_weight: float = 0.5, explore_margin: float = 0.1,
        max_probe_gap: int = 8,
    ):
        self.max_k = self.configured_k = config.num_speculative_tokens
        self.auto = config.policy == "auto"
        self.measure = config.auto_cost == "measured"
        self.saturation = config.auto_saturation_tokens or (128 if device_type == "cuda" else 1)
        self.first_pass_cost = num_mtp_layers / max(1, num_hidden_layers)
        self.draft_cost = (
            config.auto_draft_cost if config.auto_draft_cost is not None else 2.0 / max(1, num_hidden_layers)
        )
        self.decay, self.probe_interval, self.probe_steps = decay, probe_interval, probe_steps
        self.prior, self.prior_weight = prior, prior_weight
        self.time_alpha, self.time_decay = time_alpha, time_decay
        self.max_time_weight, self.stale_weight = max_time_weight, stale_weight
        self.explore_margin, self.max_probe_gap = explore_margin, max_probe_gap
        self._reset()

    def _reset(self) -> None:
        self.reached = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k
        self.current = self.max_k
        self._idle_steps = 0
        self._probe_left = 0
        self._baseline_left = 0
        self._baseline_tried: dict[int, int] = {}  # size class -> step of the last baseline attempt
        self._step = 0
        self._probe_k = 1
        self._probe_gap = self.probe_interval  # grows while probes keep finding drafts not worth it
        # (size class, k) -> [measured/model ratio (decaying average), freshness weight, samples]
        self._ratio: dict[tuple[int, int], list[float]] = {}

    def set_policy(self, policy: str, num_speculative_tokens: int) -> None:
        """Switch a running engine between "fixed" and "auto" and lower (or restore) K, up to the
        K the engine was built with (its buffers are sized for that). Benchmarks use this to time
        several K on one loaded model. Forgets acceptance and timings."""
        if policy not in SPEC_POLICIES:
            raise ValueError(f"speculative policy must be one of {SPEC_POLICIES}, got {policy!r}")
        if not isinstance(num_speculative_tokens, int) or not 0 <= num_speculative_tokens <= self.configured_k:
            raise ValueError(
                f"num_speculative_tokens must be an integer in 0..{self.configured_k} (the K this engine was "
                f"built with), got {num_speculative_tokens!r}"
            )
        self.auto = policy == "auto"
        self.max_k = num_speculative_tokens
        self._reset()

    # ---- acceptance ----------------------------------------------------------------------
    def observe(self, verifications: list[tuple[int, int]]) -> None:
        """One step's verifications: (drafts checked, drafts accepted) per request."""
        if not verifications:
            return
        fade = self.decay ** len(verifications)
        self.reached = [r * fade for r in self.reached]
        self.accepted = [a * fade for a in self.accepted]
        for num_drafts, num_accepted in verifications:
            for j in range(min(num_accepted + 1, num_drafts, self.max_k)):
                self.reached[j] += 1.0
                self.accepted[j] += float(j < num_accepted)

    def acceptance(self) -> list[float]:
        """Estimated acceptance of each draft position given the earlier ones were accepted."""
        w = self.prior_weight
        return [(a + self.prior * w) / (r + w) for a, r in zip(self.accepted, self.reached)]

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for c in self.acceptance()[:k]:
            run *= c
            total += run
        return total

    # ---- cost ----------------------------------------------------------------------------
    def model_cost(self, batch: int, k: int) -> float:
        def f(n: int) -> float:
            return max(1.0, n / self.saturation)

        return (1.0 + self.first_pass_cost) * f(batch * (k + 1)) + k * self.draft_cost * f(batch)

    def observe_step_time(self, batch: int, k: int, seconds: float) -> None:
        """Wall time of a step in which every request decoded with k drafts verified and k
        proposed. Ignored with `auto_cost="model"`."""
        if not self.measure or not 0 <= k <= self.max_k or seconds <= 0:
            return
        for entry in self._ratio.values():
            entry[1] *= self.time_decay
        ratio = seconds / self.model_cost(max(1, batch), k)
        entry = self._ratio.get((size_class(batch), k))
        if entry is None:
            # The first step at a new shape may carry one-off costs (allocations, kernel choice):
            # alone it is not trusted (below the stale weight), and the second sample replaces it
            # when smaller.
            self._ratio[(size_class(batch), k)] = [ratio, self.stale_weight / 2, 1]
        elif entry[2] == 1:
            entry[0] = min(entry[0], ratio)
            entry[1], entry[2] = 1.0, 2
        else:
            entry[0] += self.time_alpha * (ratio - entry[0])
            entry[1] = min(entry[1] + 1.0, self.max_time_weight)
            entry[2] += 1

    def is_timed(self, batch: int, k: int) -> bool:
        entry = self._ratio.get((size_class(batch), k))
        return entry is not None and entry[1] >= self.stale_weight

    def step_cost(self, batch: int, k: int) -> float:
        """Estimated cost of a step at k drafts: measured seconds where this size class is timed
        (a timed k: its decaying measured / modelled ratio times the model at this batch; an
        untimed or stale k: optimistically, the cost of the nearest cheaper timed k plus
        `explore_margin`, so it gets tried and timed when it promises clearly more tokens), model
        units where nothing of the class is timed."""
        cls = size_class(batch)
        fresh = {kk: e[0] for (c, kk), e in self._ratio.items() if c == cls and e[1] >= self.stale_weight}
        if not fresh:
            return self.model_cost(batch, k)
        if k in fresh:
            return fresh[k] * self.model_cost(batch, k)
        lower = [kk for kk in fresh if kk < k]
        near = max(lower) if lower else min(fresh)
        return fresh[near] * self.model_cost(batch, near) * (1.0 + self.explore_margin)

    # ---- decision ------------------------------------------------------------------------
    def scores(self, batch: int) -> list[float]:
        """Expected tokens per unit of step time for k = 0..K."""
        batch = max(1, batch)
        return [self.expected_tokens(k) / self.step_cost(batch, k) for k in range(self.max_k + 1)]

    def best_k(self, batch: int) -> int:
        scores = self.scores(batch)
        best = max(range(self.max_k + 1), key=lambda k: (scores[k], -k))
        # A little hysteresis: stay unless the best is clearly better.
        if self.current <= self.max_k and scores[self.current] >= 0.98 * scores[best]:
            return self.current
        return best

    def decide(self, batch: int) -> int:
        """Drafts to propose in this step for a batch of about `batch` decoding requests."""
        if not self.auto:
            return self.max_k
        if self._baseline_left > 0:  # timing k = 0 (below)
            self._baseline_left -= 1
            return 0
        if self._probe_left > 0:
            self._probe_left -= 1
            return self._probe_k
        self._step += 1
        self.current = self.best_k(batch)
        cls = size_class(batch)
        if (
            self.current > 0 and self.measure and not self.is_timed(batch, 0)
            and self._step - self._baseline_tried.get(cls, -self.probe_interval) >= self.probe_interval
        ):
            # Speculating without a timed k = 0 step of this size class would compare against a
            # borrowed guess of the baseline: a few steps without drafts time it (all but the
            # first verify none and propose none). When they could not be timed (prompt chunks in
            # every step), speculation goes on and the baseline is tried again later.
            self._baseline_tried[cls] = self._step
            self._baseline_left = self.probe_steps - 1
            return 0
        if self.current > 0:
            self._idle_steps = 0
            self._probe_gap = self.probe_interval
            return self.current
        self._idle_steps += 1
        if self._idle_steps >= self._probe_gap and self.max_k > 0:
            # A probe: the most promising k >= 1 for `probe_steps` steps keeps acceptance and
            # that k's timing fresh while speculation is off. Each probe that leaves speculation
            # off doubles the gap to the next (up to max_probe_gap x probe_interval).
            self._idle_steps = 0
            self._probe_gap = min(2 * self._probe_gap, self.max_probe_gap * self.probe_interval)
            scores = self.scores(batch)
            self._probe_k = max(range(1, self.max_k + 1), key=lambda k: (scores[k], -k))
            self._probe_left = self.probe_steps - 1
            return self._probe_k
        return 0
