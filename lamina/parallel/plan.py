"""ParallelPlan: a pure function of (model config, parallel config) that fixes everything.

It is the only place that maps layers to pipeline stages and experts to ranks. It decides each
rank's coordinates, each stage's layer range, which features each layer has, where experts live,
whether sequence parallelism is on (and why), and the boundary tensors between stages. Model
code, loading, validation, `lamina plan` and error messages all read it. It is built, and every
config error raised, before any weight is read.

Rank order: tensor-parallel innermost, then pipeline, then data parallel:
`rank = (dp * pp_size + pp) * tp_size + tp`. The EP group of a stage is its DP x TP ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lamina.parallel.config import ParallelConfig


class ParallelConfigError(ValueError):
    """A parallel layout that cannot run this model; the message names the value and the valid ones."""


def parse_partition(spec: str, pp: int, num_layers: int, source: str) -> list[int]:
    parts = [p.strip() for p in spec.split(",")]
    sizes = []
    for p in parts:
        try:
            sizes.append(int(p))
        except ValueError:
            raise ParallelConfigError(
                f"{source} = {spec!r}: entry {p!r} is not an integer; give {pp} positive integers summing to {num_layers}"
            ) from None
    if len(sizes) != pp:
        raise ParallelConfigError(
            f"{source} = {spec!r} has {len(sizes)} entries but pipeline_parallel_size = {pp}; "
            f"give {pp} positive integers summing to {num_layers}"
        )
    if any(s <= 0 for s in sizes):
        raise ParallelConfigError(f"{source} = {spec!r}: every stage needs at least one layer (entries must be positive)")
    if sum(sizes) != num_layers:
        raise ParallelConfigError(
            f"{source} = {spec!r} sums to {sum(sizes)} but the model has {num_layers} layers"
        )
    return sizes


def default_partition(num_layers: int, pp: int) -> list[int]:
    """`L // P` layers each; the remainder one each to stages P-2, P-3, ... (never the last)."""
    if num_layers < pp:
        raise ParallelConfigError(
            f"pipeline_parallel_size = {pp} exceeds the model's {num_layers} layers; use at most {num_layers}"
        )
    sizes = [num_layers // pp] * pp
    for stage in range(pp - 2, pp - 2 - num_layers % pp, -1):  # remainder < pp: never reaches the last stage
        sizes[stage] += 1
    return sizes


@dataclass(frozen=True)
class RankPlan:
    rank: int
    node: int
    local_rank: int
    dp: int
    pp: int
    tp: int
    ep: int | None  # index in the stage's EP group, None without EP
    layer_range: tuple[int, int]
    experts: tuple[int, int] | None  # [start, end) of the experts this rank holds (MoE models)
    has_embedding: bool
    has_lm_head: bool


@dataclass(frozen=True)
class ParallelPlan:
    tp: int
    pp: int
    dp: int
    ep_enabled: bool
    ep_size: int
    sp: bool
    sp_reason: str
    stage_sizes: tuple[int, ...]
    stage_ranges: tuple[tuple[int, int], ...]
    partition_source: str
    kv_heads_replicated: bool
    ranks: tuple[RankPlan, ...]
    layer_kinds: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def stage_of_layer(self, layer: int) -> int:
        for stage, (start, end) in enumerate(self.stage_ranges):
            if start <= layer < end:
                return stage
        raise IndexError(f"layer {layer} is outside the model's {self.stage_ranges[-1][1]} layers")

    def to_dict(self) -> dict:
        return asdict(self)


def _check_divisible(what: str, total: int, size: int, size_name: str, hint: str = "") -> None:
    if total % size != 0:
        valid = [d for d in range(1, total + 1) if total % d == 0]
        raise ParallelConfigError(
            f"{what} = {total} is not divisible by {size_name} = {size}; valid {size_name} values: {valid}{hint}"
        )


def build_plan(model_cfg, parallel: ParallelConfig, *, num_devices: int | None = None, device_type: str = "cpu") -> ParallelPlan:
    """Validate `parallel` against `model_cfg` and lay the model out. Raises ParallelConfigError."""
    tp, pp, dp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.data_parallel_size
    world = tp * pp * dp
    L = model_cfg.num_hidden_layers

    # --- sizes vs tp -------------------------------------------------------------------------
    for name in ("num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size", "num_hidden_layers"):
        if getattr(model_cfg, name) <= 0:
            raise ParallelConfigError(f"config {name} = {getattr(model_cfg, name)} must be positive")
    _check_divisible("num_attention_heads", model_cfg.num_attention_heads, tp, "tensor_parallel_size")
    kv = model_cfg.num_key_value_heads
    kv_replicated = tp > kv
    if kv_replicated:
        if tp % kv != 0:
            raise ParallelConfigError(
                f"tensor_parallel_size = {tp} exceeds num_key_value_heads = {kv} and is not a multiple of it; "
                f"KV heads can be replicated only when tensor_parallel_size is a multiple of {kv}"
            )
    else:
        _check_divisible("num_key_value_heads", kv, tp, "tensor_parallel_size")
    if getattr(model_cfg, "linear_num_key_heads", 0):
        _check_divisible("linear_num_key_heads", model_cfg.linear_num_key_heads, tp, "tensor_parallel_size")
        _check_divisible("linear_num_value_heads", model_cfg.linear_num_value_heads, tp, "tensor_parallel_size")
    _check_divisible("vocab_size", model_cfg.vocab_size, tp, "tensor_parallel_size")
    if any(not m for m in model_cfg.moe_layers) and getattr(model_cfg, "intermediate_size", 0):
        _check_divisible("intermediate_size", model_cfg.intermediate_size, tp, "tensor_parallel_size")

    # --- expert parallelism and SP -----------------------------------------------------------
    num_experts = getattr(model_cfg, "num_experts", 0) or 0
    has_moe = num_experts > 0 and any(model_cfg.moe_layers)
    ep_enabled = parallel.enable_expert_parallel and has_moe
    ep_size = dp * tp if ep_enabled else 1
    if parallel.enable_expert_parallel and not has_moe:
        raise ParallelConfigError("enable_expert_parallel is set but the model has no MoE layers")
    if ep_enabled:
        _check_divisible("num_experts", num_experts, ep_size, "EP size (data_parallel_size x tensor_parallel_size)")
    elif has_moe:
        _check_divisible("moe_intermediate_size", model_cfg.moe_intermediate_size, tp, "tensor_parallel_size")

    mode = parallel.sequence_parallel_moe
    if mode == "on":
        if tp == 1:
            raise ParallelConfigError("sequence_parallel_moe = on needs tensor_parallel_size > 1 (it shards tokens over TP)")
        sp, sp_reason = True, "forced on (--sequence-parallel-moe on)"
    elif mode == "off":
        sp, sp_reason = False, "forced off (--sequence-parallel-moe off)"
    else:
        sp = ep_enabled and tp > 1 and dp > 1
        if sp:
            sp_reason = f"auto: expert parallel on, TP = {tp} > 1, DP = {dp} > 1"
        else:
            missing = [m for m, ok in (("expert parallel", ep_enabled), ("TP > 1", tp > 1), ("DP > 1", dp > 1)) if not ok]
            sp_reason = "auto: off (needs " + ", ".join(missing) + ")"
    if not sp and not ep_enabled and getattr(model_cfg, "shared_expert_intermediate_size", 0) and has_moe:
        _check_divisible("shared_expert_intermediate_size", model_cfg.shared_expert_intermediate_size, tp, "tensor_parallel_size")

    # --- pipeline stages ---------------------------------------------------------------------
    spec, source = parallel.partition_spec()
    if pp > L:
        raise ParallelConfigError(f"pipeline_parallel_size = {pp} exceeds the model's {L} layers; use at most {L}")
    sizes = parse_partition(spec, pp, L, source) if spec is not None else default_partition(L, pp)
    ranges, start = [], 0
    for s in sizes:
        ranges.append((start, start + s))
        start += s

    # --- devices ------------------------------------------------------------------------------
    if world % parallel.nnodes != 0:
        raise ParallelConfigError(f"world size {world} (tp x pp x dp) is not divisible by nnodes = {parallel.nnodes}")
    per_node = world // parallel.nnodes
    if device_type == "cuda" and num_devices is not None and per_node > num_devices:
        raise ParallelConfigError(
            f"this layout needs {per_node} GPUs per node (tp {tp} x pp {pp} x dp {dp} / nnodes {parallel.nnodes}) "
            f"but {num_devices} are available"
        )

    experts_per_rank = num_experts // ep_size if has_moe else 0
    ranks = []
    for rank in range(world):
        tp_idx = rank % tp
        pp_idx = (rank // tp) % pp
        dp_idx = rank // (tp * pp)
        ep_idx = dp_idx * tp + tp_idx if ep_enabled else None
        if not has_moe:
            experts = None
        elif ep_enabled:
            experts = (ep_idx * experts_per_rank, (ep_idx + 1) * experts_per_rank)
        else:
            experts = (0, num_experts)
        ranks.append(RankPlan(
            rank=rank, node=rank // per_node, local_rank=rank % per_node, dp=dp_idx, pp=pp_idx, tp=tp_idx, ep=ep_idx,
            layer_range=ranges[pp_idx], experts=experts, has_embedding=pp_idx == 0, has_lm_head=pp_idx == pp - 1,
        ))
    return ParallelPlan(
        tp=tp, pp=pp, dp=dp, ep_enabled=ep_enabled, ep_size=ep_size, sp=sp, sp_reason=sp_reason,
        stage_sizes=tuple(sizes), stage_ranges=tuple(ranges), partition_source=source,
        kv_heads_replicated=kv_replicated, ranks=tuple(ranks), layer_kinds=tuple(describe_layers(model_cfg)),
    )


def describe_layers(model_cfg) -> list[str]:
    """One short description per layer: attention kind, MLP kind, extra features."""
    ple = set(getattr(model_cfg, "ple_layers", ()) or ())
    indexed = set(getattr(model_cfg, "indexed_attention_layers", ()) or ())
    kinds = []
    for i, (attn, moe) in enumerate(zip(model_cfg.layer_types, model_cfg.moe_layers)):
        a = "linear" if attn == "linear_attention" else ("indexed" if i in indexed else "full")
        parts = [a, "MoE" if moe else "dense"]
        if i in ple:
            parts.append("PLE")
        kinds.append("/".join(parts))
    return kinds
