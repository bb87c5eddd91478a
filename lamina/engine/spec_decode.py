"""Speculative decoding with the checkpoint's MTP layers: configuration, checks, and the K policy.

`speculative_config={"method": "mtp", "num_speculative_tokens": K}` (vLLM's names; the CLI takes
the same as JSON in `--speculative-config`). Optional keys:

- `policy`: "fixed" (default: always propose K drafts) or "auto" (K is the maximum; the engine
  proposes fewer, down to 0, when measured acceptance and the batch size make drafts a net loss,
  and more again when they pay; see lamina.engine.spec_policy).
- `auto_cost`: "measured" (default: the auto policy times the engine's decode steps at each k
  and batch size and trusts those times over its model) or "model" (the model alone).
- `auto_saturation_tokens`, `auto_draft_cost`: the auto policy's cost model, used before steps
  at a given k and batch size have been timed (lamina.engine.spec_policy).

Seeds: a seeded request at temperature > 0 gives its plain (no speculation) seeded text whatever
K is, fixed or auto, alone or in any batch: its noise is keyed by output index and verification
accepts a draft exactly when it equals the token plain sampling draws there (coupling,
lamina.worker.rejection_sampler). Greedy output never depends on K either. Unseeded random
requests use rejection sampling (distributed as the target, a little more acceptance).

Everything here is checked from config files and safetensors headers, before any weight is read.
The step flow itself lives in the worker (lamina.worker.spec_step); this module is pure CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lamina.models.hybrid_config import MTP_LAYER_FIELDS, num_mtp_layers

SPEC_METHODS = ("mtp",)
# vLLM's model-specific spellings of the same method: the Qwen3-Next / Qwen3.5 / Qwen3.6 model cards'
# launch lines pass "qwen3_next_mtp"; the engine runs them as "mtp"
SPEC_METHOD_ALIASES = {"qwen3_next_mtp": "mtp"}
SPEC_POLICIES = ("fixed", "auto")
SPEC_AUTO_COSTS = ("measured", "model")
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
    # auto policy: "measured" step times refine the model, or the "model" alone (reproducible).
    auto_cost: str = "measured"

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
        known = {"method", "num_speculative_tokens", "policy", "auto_saturation_tokens", "auto_draft_cost", "auto_cost"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; valid keys: {', '.join(sorted(known))}")
        method = value.get("method")
        method = SPEC_METHOD_ALIASES.get(method, method) if isinstance(method, str) else method
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {list(SPEC_METHODS) + list(SPEC_METHOD_ALIASES)}"
                             f", got {value.get('method')!r}")
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
        auto_cost = value.get("auto_cost", "measured")
        if auto_cost not in SPEC_AUTO_COSTS:
            raise ValueError(f"speculative_config auto_cost must be one of {list(SPEC_AUTO_COSTS)}, got {auto_cost!r}")
        return cls(method, k, policy, saturation, None if cost is None else float(cost), auto_cost)


def mtp_prefix(names) -> str | None:
    """Where a checkpoint keeps its MTP tensors ("mtp." on the hub), from its tensor names."""
    for prefix in MTP_PREFIXES:
        if any(n.startswith(prefix) for n in names):
            return prefix
    return None


def check_speculative(spec: SpeculativeConfig, hf_config, model_cls, model_path: Path, load_format: str,
                      tensor_names: list[str] | None = None) -> str:
    """Refuse a checkpoint without MTP weights, or a model family without MTP support, before any
    weight is read. `tensor_names`: the checkpoint's tensors when known already (None: read from the
    shards' headers in `model_path`). Returns the checkpoint's MTP tensor prefix."""
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

    names = tensor_names
    if names is None:
        names = [n for path in resolve_shards(Path(model_path)) for n in read_header(path).tensors]
    prefix = mtp_prefix(names)
    if prefix is None:
        raise ValueError(
            f"speculative_config method 'mtp': {model_path}/config.json declares {count} MTP layer(s) but the "
            f"checkpoint holds no mtp.* tensors (they were dropped, e.g. by a transformers save_pretrained)"
        )
    return prefix
