"""Speculative decoding with the checkpoint's MTP layers: configuration, checks, and the K policy.

`speculative_config={"method": "mtp", "num_speculative_tokens": K}` (vLLM's names; the CLI takes
the same as JSON in `--speculative-config`). Optional keys:

- `policy`: "fixed" (default: always propose K drafts) or "auto" (K is the maximum; the engine
  proposes fewer, down to 0, when measured acceptance and the batch size make drafts a net loss,
  and more again when they pay; see `SpecDecodePolicy`).
- `auto_saturation_tokens`, `auto_draft_cost`: the auto policy's cost model (below).

Seeds: with the fixed policy a seeded request at temperature > 0 gives the same text alone or in
any batch (the scheduler never cuts its drafts to fit another request's leftover budget). With
"auto" the number of drafts follows the batch size, and so do the random numbers a seeded request
draws: its text is reproducible for the same traffic, not across batch compositions.

Everything here is checked from config files and safetensors headers, before any weight is read.
The step flow itself lives in the worker (lamina.worker.spec_step); this module is pure CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPEC_METHODS = ("mtp",)
SPEC_POLICIES = ("fixed", "auto")
MTP_LAYER_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    policy: str = "fixed"
    # auto policy: a forward of up to this many tokens costs about the same (memory bound);
    # None: 128 on GPUs, 1 on CPUs (compute bound: cost grows with every token).
    auto_saturation_tokens: int | None = None
    # auto policy: cost of one draft (an MTP pass and the LM head) relative to a target forward;
    # None: 2 / num_hidden_layers (the LM head weighs about a layer).
    auto_draft_cost: float | None = None

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From the user's dict (or its JSON text); None stays None. Raises ValueError naming the problem."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "policy", "auto_saturation_tokens", "auto_draft_cost"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; valid keys: {', '.join(sorted(known))}")
        method = value.get("method")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {list(SPEC_METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
        policy = value.get("policy", "fixed")
        if policy not in SPEC_POLICIES:
            raise ValueError(f"speculative_config policy must be one of {list(SPEC_POLICIES)}, got {policy!r}")
        saturation = value.get("auto_saturation_tokens")
        if saturation is not None and (not isinstance(saturation, int) or isinstance(saturation, bool) or saturation < 1):
            raise ValueError(f"speculative_config auto_saturation_tokens must be an integer >= 1, got {saturation!r}")
        cost = value.get("auto_draft_cost")
        if cost is not None and (not isinstance(cost, (int, float)) or isinstance(cost, bool) or cost < 0):
            raise ValueError(f"speculative_config auto_draft_cost must be a number >= 0, got {cost!r}")
        return cls(method, k, policy, saturation, None if cost is None else float(cost))


def num_mtp_layers(hf_config) -> int:
    """MTP layers a checkpoint declares (`num_nextn_predict_layers` or `mtp_num_hidden_layers`)."""
    for config in (getattr(hf_config, "text_config", None), hf_config):
        if config is None:
            continue
        for name in MTP_LAYER_FIELDS:
            value = getattr(config, name, None)
            if value:
                return int(value)
    return 0


def mtp_prefix(names) -> str | None:
    """Where a checkpoint keeps its MTP tensors ("mtp." on the hub), from its tensor names."""
    for prefix in MTP_PREFIXES:
        if any(n.startswith(prefix) for n in names):
            return prefix
    return None


def check_speculative(spec: SpeculativeConfig, hf_config, model_cls, model_path: Path, load_format: str) -> str:
    """Refuse a checkpoint without MTP weights, or a model family without MTP support, before any
    weight is read. Returns the checkpoint's MTP tensor prefix."""
    from lamina.models.mtp import mtp_class_for

    count = num_mtp_layers(hf_config)
    if count <= 0:
        raise ValueError(
            f"speculative_config method 'mtp' needs a checkpoint with MTP layers, but {model_path}/config.json sets "
            f"neither {MTP_LAYER_FIELDS[0]} nor {MTP_LAYER_FIELDS[1]} to a positive number"
        )
    mtp_class_for(model_cls)  # raises for families without MTP
    if load_format == "dummy":
        return MTP_PREFIXES[0]
    from lamina.models.loader import read_header, resolve_shards

    names = [n for path in resolve_shards(Path(model_path)) for n in read_header(path).tensors]
    prefix = mtp_prefix(names)
    if prefix is None:
        raise ValueError(
            f"speculative_config method 'mtp': {model_path}/config.json declares {count} MTP layer(s) but the "
            f"checkpoint holds no mtp.* tensors (they were dropped, e.g. by a transformers save_pretrained)"
        )
    return prefix


class SpecDecodePolicy:
    """How many drafts to propose this step (0..K).

    `fixed`: always K. `auto`: pick the k that maximises expected tokens per unit of step time,

        E(k)    = 1 + sum_{j<=k} prod_{i<=j} c_i      (c_i: measured acceptance of draft i,
                                                      given drafts 1..i-1 were accepted)
        cost(k) = (1 + r1) f(B (k+1)) + k r f(B),    f(n) = max(1, n / n_sat)

    for a batch of B decoding requests: the target scores B(k+1) tokens and the drafter's first
    pass runs over the same tokens (r1 = MTP layers / target layers; it runs at k = 0 too,
    keeping the drafter's KV history complete); each draft then costs r (an MTP pass and the LM
    head over B rows). n_sat is the token count up to which a forward costs about the same
    (memory bound). While k = 0 nothing is measured, so every `probe_interval` steps one step
    proposes a single draft to refresh the estimate. Acceptance counts decay by `decay` per
    verifying step, so the policy follows the text being generated.
    """

    def __init__(
        self, config: SpeculativeConfig, *, num_hidden_layers: int, num_mtp_layers: int, device_type: str,
        decay: float = 0.9, probe_interval: int = 32, prior: float = 0.5, prior_weight: float = 1.0,
    ):
        self.max_k = config.num_speculative_tokens
        self.auto = config.policy == "auto"
        self.saturation = config.auto_saturation_tokens or (128 if device_type == "cuda" else 1)
        self.first_pass_cost = num_mtp_layers / max(1, num_hidden_layers)
        self.draft_cost = (
            config.auto_draft_cost if config.auto_draft_cost is not None else 2.0 / max(1, num_hidden_layers)
        )
        self.decay, self.probe_interval = decay, probe_interval
        self.prior, self.prior_weight = prior, prior_weight
        self.reached = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k
        self.current = self.max_k
        self._idle_steps = 0

    def observe(self, verifications: list[tuple[int, int]]) -> None:
        """One step's verifications: (drafts checked, drafts accepted) per request."""
        if not verifications:
            return
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
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

    def step_cost(self, batch: int, k: int) -> float:
        def f(n: int) -> float:
            return max(1.0, n / self.saturation)

        return (1.0 + self.first_pass_cost) * f(batch * (k + 1)) + k * self.draft_cost * f(batch)

    def best_k(self, batch: int) -> int:
        batch = max(1, batch)
        scores = [self.expected_tokens(k) / self.step_cost(batch, k) for k in range(self.max_k + 1)]
        best = max(range(self.max_k + 1), key=lambda k: (scores[k], -k))
        # A little hysteresis: stay unless the best is clearly better.
        if scores[self.current] >= 0.98 * scores[best]:
            return self.current
        return best

    def decide(self, batch: int) -> int:
        """Drafts to propose in this step for a batch of about `batch` decoding requests."""
        if not self.auto:
            return self.max_k
        self.current = self.best_k(batch)
        if self.current > 0:
            self._idle_steps = 0
            return self.current
        self._idle_steps += 1
        if self._idle_steps >= self.probe_interval:
            self._idle_steps = 0
            return 1  # a probe: keeps the acceptance estimate fresh while speculation is off
        return 0
