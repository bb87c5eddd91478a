"""How a CUDA engine divides the GPU memory left after the weights (`plan_gpu_memory`), and the
activation headroom it keeps for steps (`activation_headroom_bytes`).

Of each rank's free memory, `gpu_memory_utilization` (vLLM's flag) says how much of the device
lamina may fill: what the weights left, less the (1 - utilization) share of the device, is usable.
From the usable bytes come, in order:
- the recurrent-state pool: (max_num_seqs + 1) request slots (the spare one takes graph padding
  rows) of every delta-net layer's conv and recurrent state. At the Qwen3.5-35B-A3B shape a slot is
  ~61.4 MiB, so 257 slots are 15.4 GiB: more than an 80 GB GPU has left after the model's 64.6 GiB of
  bf16 weights. Counting them here turns what was an out-of-memory error at start-up (session 30,
  H100) into a plan, or a clear error;
- speculative decoding's per-request states and draft distributions (`speculation_bytes`);
- the activation headroom of the largest step (below);
- the KV cache: the rest, at most max_num_seqs sequences of max_model_len tokens.
It must leave the KV cache at least one max_model_len sequence. (With max_model_len "auto", vLLM's
spelling, the model's whole length is kept if that holds for an explicit max_num_seqs, or for at
least one request with a default one; otherwise max_model_len is shortened to what the KV cache
beside the states of max_num_seqs requests holds, a default max_num_seqs first lowered to as many
requests as take at most half of what the headroom leaves.) If it cannot and max_num_seqs was
left to its default, the plan lowers max_num_seqs (the engine logs it) so that the states take at
most half of what the headroom leaves, the KV cache the rest, or (if more) to as many requests as
fit with KV for all of them at max_model_len; if the user set max_num_seqs, or not even one request
fits, it raises a ValueError naming every figure.

Off CUDA, or with `kv_cache_memory_bytes` / `num_gpu_blocks_override` set, the KV cache's size is
given and this plan is not used (lamina.engine.kv_sizing, `_num_kv_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["MemoryPlan", "activation_headroom_bytes", "plan_gpu_memory", "speculation_bytes", "state_dtype_hint",
           "usable_gpu_bytes"]

GIB = 1 << 30
MIB = 1 << 20
# Activation headroom (session 30, H100, benchmarks/memory_peak.py, memory_peak_h100_s30.json):
# - a prefill step's peak over what stays allocated grew by 121 KiB a token at the Qwen3.5-35B-A3B
#   shape (0.24 / 0.95 / 1.89 GiB at 2k / 8k / 16k tokens): ~62k bf16 elements, which is what the
#   fused MoE's (top_k + 1) slots of parts and activations (both live at the slot sum) and ~8
#   hidden-sized rows (residual, norm, projections, fla-core's chunk states) add up to;
# - decode steps at max_num_seqs (graphs, top-k / top-p sampling): 0.18 / 0.36 / 0.51 GiB at 16 / 32 /
#   64 sequences (8-11 MiB a sequence, 8-12 float32 rows of the 248k vocabulary), besides graph pools
#   and static buffers held from start-up of ~4 MiB a sequence (~4 rows);
# - 0.1-0.2 GiB allocated besides, whatever the sizes.
# The estimates below keep a margin over each (1.2-1.3x), since the caching allocator's reserve
# runs above the allocated peak, and a fixed part besides.
PREFILL_HIDDEN_ROWS = 8  # hidden-sized rows per prefill token besides the MoE's slots
PREFILL_MARGIN = 1.3
DECODE_VOCAB_ROWS = 12  # float32 vocabulary rows per decode row at a decode step's peak (logits, sampler temporaries)
GRAPH_POOL_VOCAB_ROWS = 4  # ... and held throughout by the decode graphs' pools and static buffers
# The prefill / mixed steps' graphs (lamina.worker.mixed_graphs) hold their largest shape's activations
# (a prefill step's per-token bytes at their largest token bucket; the shapes share one pool and one
# capture stream) and, per request row (max_num_seqs + 1), the shared float32 logits buffer's row and
# the LM head's bf16 row before it: 1.5 float32 rows, counted as 2; under MTP no logits but the final
# hidden states of the largest bucket (`keep_hidden`). From the tensors' sizes, not measured.
MIXED_GRAPH_VOCAB_ROWS = 2
FIXED_HEADROOM_BYTES = 512 * MIB


def state_dtype_hint(ssm_state_dtype, kv_cache_dtype=None) -> str:
    """What else would make room, said with a lowered or refused max_num_seqs: a float32 recurrent
    pool can be kept in bfloat16 (`mamba_ssm_cache_dtype`), and a 16-bit KV cache in FP8
    (`kv_cache_dtype`, where given: a device that has FP8); '' when neither applies."""
    hints = []
    if getattr(ssm_state_dtype, "itemsize", 2) >= 4:
        hints.append("keep the recurrent states in bfloat16 (mamba_ssm_cache_dtype='bfloat16': about half their bytes)")
    if kv_cache_dtype is not None and kv_cache_dtype.itemsize >= 2:
        hints.append("keep the KV cache in FP8 (kv_cache_dtype='fp8': half its bytes or less)")
    return ", or ".join(hints)


def usable_gpu_bytes(free_bytes: int, total_bytes: int, gpu_memory_utilization: float) -> int:
    """What a rank may fill: its free memory after the weights, less the (1 - utilization) share of
    the device that stays free."""
    return int(max(0, free_bytes - total_bytes * (1.0 - gpu_memory_utilization)))


def activation_headroom_bytes(model_config, dtype_bytes: int, max_num_batched_tokens: int, max_num_seqs: int,
                              num_speculative_tokens: int = 0, mixed_graph_tokens: int = 0) -> int:
    """Bytes allocated above the weights and caches: the decode graphs' pools (held from capture on),
    plus the larger peak of a whole-budget prefill step and a decode step of max_num_seqs requests
    (each (K + 1) rows under MTP), plus a fixed part; with `mixed_graph_tokens` (the largest token
    bucket of the prefill / mixed steps' graphs) their pool and their output buffer (under MTP the
    final hidden states, else a logits row a request). Unsharded sizes: under tensor or pipeline
    parallelism this overestimates a rank's share (every rank counts the whole vocabulary's rows)."""
    hidden = model_config.hidden_size
    slots = model_config.num_experts_per_tok + (model_config.shared_expert_intermediate_size > 0)
    moe_inter = model_config.moe_intermediate_size or model_config.intermediate_size
    streams = getattr(model_config, "hc_count", 1) or 1  # Qwen4-Exp's hyper-connections widen the residual
    per_token = dtype_bytes * (2 * max(1, slots) * (hidden + moe_inter) + PREFILL_HIDDEN_ROWS * streams * hidden)
    prefill = int(PREFILL_MARGIN * per_token * max_num_batched_tokens)
    vocab_row = 4 * model_config.vocab_size * max_num_seqs * (num_speculative_tokens + 1)  # one float32 row a decode row
    mixed = 0
    if mixed_graph_tokens:
        mixed = int(PREFILL_MARGIN * per_token * mixed_graph_tokens)
        if num_speculative_tokens:  # MTP: the graphs keep the final hidden states [Tc, H], no logits buffer
            mixed += dtype_bytes * hidden * mixed_graph_tokens
        else:
            mixed += MIXED_GRAPH_VOCAB_ROWS * 4 * model_config.vocab_size * (max_num_seqs + 1)
    return FIXED_HEADROOM_BYTES + GRAPH_POOL_VOCAB_ROWS * vocab_row + mixed + max(prefill, DECODE_VOCAB_ROWS * vocab_row)


def speculation_bytes(num_requests: int, num_speculative_tokens: int, state_bytes_per_slot: int, vocab_size: int,
                      graph_rows: int = 0) -> int:
    """What MTP holds besides the caches: per request, the recurrent states after each of K draft
    positions (for rollback) and K float32 draft distributions; and the states that CUDA graphs of
    verification steps keep in persistent buffers (lamina.worker.verify_graphs), `graph_rows` more."""
    k = num_speculative_tokens
    return num_requests * k * (state_bytes_per_slot + 4 * vocab_size) + graph_rows * state_bytes_per_slot


@dataclass(frozen=True)
class MemoryPlan:
    max_num_seqs: int
    num_kv_blocks: int
    usable_bytes: int
    state_bytes: int  # the (max_num_seqs + 1) state slots
    speculation_bytes: int
    activation_bytes: int
    kv_cache_bytes: int  # num_kv_blocks' bytes
    lowered_from: int | None = None  # the default max_num_seqs, when the plan lowered it
    max_model_len: int | None = None  # the length planned for (fitted when max_model_len is "auto")

    def describe(self, block_size: int, max_model_len: int) -> str:
        tokens = self.num_kv_blocks * block_size
        return (f"{self.usable_bytes / GIB:.2f} GiB usable: recurrent states {self.state_bytes / GIB:.2f} GiB "
                f"({self.max_num_seqs} requests + 1 spare slot), speculation {self.speculation_bytes / GIB:.2f} GiB, "
                f"activation headroom {self.activation_bytes / GIB:.2f} GiB, KV cache {self.kv_cache_bytes / GIB:.2f} GiB "
                f"({self.num_kv_blocks} blocks, {tokens} tokens: {tokens / max_model_len:.2f} requests of "
                f"max_model_len = {max_model_len} at once)")


def plan_gpu_memory(
    *,
    usable_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_seqs_is_default: bool,
    state_bytes_per_slot: int,
    speculation_bytes: Callable[[int], int],
    activation_bytes: Callable[[int], int],
    state_hint: str = "",
    fit_max_model_len: bool = False,
) -> MemoryPlan:
    """The plan for `max_num_seqs` requests, or (a default only) for fewer; see the module docstring.
    `speculation_bytes(n)` and `activation_bytes(n)` are the reserves for n requests; `state_hint`
    (`state_dtype_hint`) ends a refusal's list of remedies. With `fit_max_model_len` (max_model_len
    "auto"), `max_model_len` is the model's own and is kept if it fits (a default max_num_seqs lowered as
    usual, as long as one request fits at that length); otherwise it is shortened to the KV cache left
    beside the states of max_num_seqs requests (a default one: of as many as take at most half of what
    the headroom leaves)."""
    blocks_per_seq = -(-max_model_len // block_size)
    min_kv = blocks_per_seq * bytes_per_block

    def fixed_bytes(n: int) -> int:  # everything but the KV cache, for n requests
        return (n + 1) * state_bytes_per_slot + speculation_bytes(n) + activation_bytes(n)

    def kv_blocks_left(n: int) -> int:  # the KV blocks the usable memory holds beside n requests' reserves
        return (usable_bytes - fixed_bytes(n)) // max(1, bytes_per_block)

    def plan(n: int, lowered_from: int | None = None, model_len: int = max_model_len) -> MemoryPlan:
        num_blocks = min(-(-model_len // block_size) * n, kv_blocks_left(n))
        return MemoryPlan(n, num_blocks, usable_bytes, (n + 1) * state_bytes_per_slot, speculation_bytes(n),
                          activation_bytes(n), num_blocks * bytes_per_block, lowered_from, model_len)

    def states_take_half(n: int) -> bool:  # the states take at most half of what the steps' headroom leaves
        states = (n + 1) * state_bytes_per_slot + speculation_bytes(n)
        return 2 * states <= usable_bytes - activation_bytes(n)

    if fixed_bytes(max_num_seqs) + min_kv <= usable_bytes:
        return plan(max_num_seqs)
    fits = _most_requests_that_fit(max_num_seqs, lambda n: fixed_bytes(n) + min_kv <= usable_bytes)
    # max_model_len "auto": a default max_num_seqs with at least one request fitting at the model's whole
    # length is lowered below, keeping the length; else the length is shortened (an explicit max_num_seqs
    # kept, a default one first lowered to the count whose states take at most half of what the headroom leaves)
    if fit_max_model_len and not (max_num_seqs_is_default and fits > 0):
        n = max(1, _most_requests_that_fit(max_num_seqs + 1, states_take_half)) if max_num_seqs_is_default \
            else max_num_seqs
        budget_blocks = kv_blocks_left(n)
        if budget_blocks >= 1:
            model_len = min(max_model_len, budget_blocks * block_size)
            return plan(n, lowered_from=max_num_seqs if n < max_num_seqs else None, model_len=model_len)
    if max_num_seqs_is_default and fits > 0:
        # not the most that fit, which would leave the KV cache one sequence: the larger of the states
        # taking at most half of what the steps' headroom leaves, and every request fitting at full length
        def balanced(n: int) -> bool:
            return states_take_half(n) and fixed_bytes(n) + min_kv <= usable_bytes

        def whole_lengths(n: int) -> bool:  # n requests and the KV cache for all of them at max_model_len
            return fixed_bytes(n) + n * min_kv <= usable_bytes

        chosen = max(_most_requests_that_fit(fits + 1, balanced), _most_requests_that_fit(fits + 1, whole_lengths))
        return plan(chosen, lowered_from=max_num_seqs)  # >= 1: whole_lengths(1) is fits' own test at 1
    need = plan(max_num_seqs)
    if fit_max_model_len:
        room = _most_requests_that_fit(max_num_seqs, lambda n: kv_blocks_left(n) >= 1)
        raise ValueError(
            f"max_model_len auto: max_num_seqs = {max_num_seqs} leaves no room for even one KV block: its recurrent "
            f"states take {need.state_bytes / GIB:.2f} GiB, speculation {need.speculation_bytes / GIB:.2f} GiB and the "
            f"activation headroom {need.activation_bytes / GIB:.2f} GiB of the {usable_bytes / GIB:.2f} GiB usable. "
            + (f"At most max_num_seqs = {room} fit: lower max_num_seqs" if room else "Not even one request fits: lower "
               "max_num_batched_tokens") + f", or raise gpu_memory_utilization{_or(state_hint)}")
    what = (f"max_num_seqs = {max_num_seqs} needs {state_bytes_per_slot / MIB:.1f} MiB of recurrent state per request "
            f"({need.state_bytes / GIB:.2f} GiB for {max_num_seqs} + 1 slots), speculation {need.speculation_bytes / GIB:.2f} "
            f"GiB and an activation headroom of {need.activation_bytes / GIB:.2f} GiB, and the KV cache must hold one "
            f"sequence of max_model_len = {max_model_len} tokens ({min_kv / GIB:.2f} GiB); the GPU has "
            f"{usable_bytes / GIB:.2f} GiB usable after the weights at this gpu_memory_utilization")

    def longest(n: int) -> str:  # the max_model_len that n requests leave room for, said as a remedy
        blocks = kv_blocks_left(n)
        return (f" (max_model_len = {blocks * block_size} fits beside {n} request{'s' if n > 1 else ''}; "
                "max_model_len='auto' takes the longest that fits)") if blocks >= 1 else ""

    beside_asked = longest(max_num_seqs)
    if fits > 0:
        raise ValueError(f"{what}. At most max_num_seqs = {fits} fit (the KV cache then holds about one sequence of "
                         f"max_model_len): lower max_num_seqs to {fits} or less, lower max_model_len"
                         f"{beside_asked} or max_num_batched_tokens, or raise "
                         f"gpu_memory_utilization{_or(state_hint)}")
    beside_one = longest(1)
    lengths = beside_asked or (f"{beside_one}, and max_num_seqs" if beside_one else "")
    raise ValueError(f"{what}. Not even one request fits: lower max_model_len{lengths} or "
                     "max_num_batched_tokens, "
                     f"raise gpu_memory_utilization, {state_hint + ', ' if state_hint else ''}or spread the model over "
                     "more GPUs (tensor / pipeline parallelism)")


def _or(hint: str) -> str:
    return f", or {hint}" if hint else ""


def _most_requests_that_fit(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [0, limit) with fits(n), 0 if none. `fits` must be monotone (true up to some
    n, false after): every reserve here grows with n (states and speculation linearly, up to the
    verification graphs' capped rows; the headroom as the larger of a constant and a linear term)."""
    low, high = 0, limit  # fits(low) holds (n = 0 by convention); fits(high) does not
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low
