"""Which kernel set a layer uses, chosen once when the model is built, never per tensor value.

- `reference`: the plain torch kernels of this package (CPU, CI, the oracle).
- `triton`: lamina's Triton kernels (`triton_decode`, `triton_gdn_decode`, `triton_verify`,
  `triton_moe`) for decode steps of a uniform Q tokens per request (`decode_query_len`: plain
  decode, MTP verification) and the routed experts with their routing (`triton_router`, one
  launch up to 4 tokens: `fused_router_max_tokens`); everything else stays on the reference
  kernels. The gated delta net's one-token decode is one fused launch unless
  `LAMINA_FUSED_GDN_DECODE=0` (`fused_gdn_decode_enabled`).

The decode GEMVs' kernel forms on that set (`gemv_fma`, `moe_gemv_fma_max_tokens`: with or without `tl.dot`,
`LAMINA_GEMV_FMA` / `LAMINA_MOE_GEMV_FMA`, read once per process) are read by the kernels
themselves, which take them when no tiles are given.

`LAMINA_KERNELS=auto|reference|triton` (read at model build time): `auto` (the default) takes
`triton` on CUDA when Triton imports, `reference` elsewhere. `triton` on the CPU runs the kernels
under Triton's interpreter (`TRITON_INTERPRET=1` must be set before Triton is imported): slow, but
it lets CI run the engine end to end on the fast kernels at tiny shapes.

Prefill and mixed steps of the gated delta net (`gdn_prefill_kernels`): `LAMINA_GDN_PREFILL=
auto|fla|reference` (read at model build time). `fla` runs the delta rule on fla-core's chunked
kernel (`lamina.kernels.fla_prefill`) and the causal conv on lamina's Triton prefill conv
(`lamina.kernels.triton_conv`); `auto` (the default) takes fla on CUDA when the Triton kernel set is
on and fla imports, else the delta-rule reference (the conv then still takes the Triton kernel under
the Triton set); `reference` keeps both on the torch references.

Attention of prefill and mixed steps (`triton_prefill_attention_enabled`), per request group
(`lamina.kernels.paged_attention`): decodes on the paged decode kernel, prompt chunks (fresh, or
continuing cached context) on lamina's varlen paged kernel (`lamina.kernels.triton_prefill_attention`);
`LAMINA_FRESH_PROMPT_ATTENTION=sdpa` (`fresh_prompt_varlen_enabled`) puts fresh prompts on SDPA's
causal rule, `LAMINA_PREFILL_ATTENTION=sdpa` all prompt chunks on SDPA (continued ones on its
masked call). Both read at model build time.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

KERNEL_SETS = ("auto", "reference", "triton")
GDN_PREFILL_CHOICES = ("auto", "fla", "reference")


@functools.cache
def triton_interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (`TRITON_INTERPRET=1`, read by Triton when it is
    imported, so fixed per process): the kernels then take tiles and grids cheaper to interpret."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_set(device: torch.device | str | None) -> str:
    """'triton' or 'reference' for layers built on `device`."""
    wanted = os.environ.get("LAMINA_KERNELS", "auto")
    if wanted not in KERNEL_SETS:
        raise ValueError(f"LAMINA_KERNELS = {wanted!r} is not one of {', '.join(KERNEL_SETS)}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    has_triton = importlib.util.find_spec("triton") is not None
    if wanted == "reference":
        return "reference"
    if wanted == "triton":
        if not has_triton:
            raise ValueError("LAMINA_KERNELS = 'triton' but Triton is not installed (pip install triton)")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"LAMINA_KERNELS = 'triton' on device {device.type!r} needs TRITON_INTERPRET=1 (Triton's CPU interpreter)"
            )
        return "triton"
    return "triton" if device.type == "cuda" and has_triton else "reference"


def _switch(name: str, default: str) -> bool:
    """An on/off environment switch: `name` = 0 or 1 (`default` when unset), anything else refused."""
    wanted = os.environ.get(name, default)
    if wanted not in ("0", "1"):
        raise ValueError(f"{name} = {wanted!r} must be 0 or 1")
    return wanted == "1"


def fp8_experts_enabled() -> bool:
    """Whether a block FP8 checkpoint's MoE experts may stay FP8 on the Triton kernels
    (lamina.layers.moe.fp8_experts_for): on unless `LAMINA_FP8_EXPERTS=0`, which dequantizes them
    as they load (bf16 experts: twice their memory, the bf16 prefill tiles)."""
    return _switch("LAMINA_FP8_EXPERTS", "1")


def decode_gemv_enabled(kernels: str) -> bool:
    """Whether the Triton kernel set's small-batch linears (the delta-net in_proj, attention qkv,
    out_proj / o_proj, the router) run lamina's split-K GEMV (`lamina.kernels.triton_gemv`) for
    inputs of up to 4 rows instead of cuBLAS. On unless `LAMINA_TRITON_GEMV=0` (L2-cold on an H200,
    benchmarks/results/tune_gemv_linear_h200.json: 14.3 / 8.2 / 3.5 us against cuBLAS's 16.1 / 10.0 /
    4.9 at the in_proj, out_proj and router shapes); read at model build time."""
    on = _switch("LAMINA_TRITON_GEMV", "1")
    return kernels == "triton" and on


def gemv_route_enabled(kernels: str) -> bool:
    """Whether an MoE layer on the Triton kernel set routes a few-row decode input in its router
    GEMV's last program (`lamina.kernels.triton_gemv.gemv_route`: one launch) rather than the GEMV
    then `route_softmax_topk`. Needs the decode GEMV (`decode_gemv_enabled`); off unless
    `LAMINA_GEMV_ROUTE=1`: on an H200 with programmatic dependent launch the batch-1 step took
    3.03 ms with it against 2.69 ms with the two launches, the same run
    (benchmarks/results/latency_gemv_route_{on,off}_h200.json): the routing serialised behind the
    last tile costs more than a second launch that PDL starts early. Read at model build time."""
    on = _switch("LAMINA_GEMV_ROUTE", "0")
    return decode_gemv_enabled(kernels) and on


def qsa_fixed_shape_decode(kernels: str) -> bool:
    """Whether Qwen4-Exp's QSA indexed attention decodes one token per request with fixed shapes
    (`lamina.kernels.qsa_decode`, the Triton block scores of `lamina.kernels.triton_qsa`), which
    is what lets its decode steps be captured in CUDA graphs. On by default on the Triton kernel
    set (its graphs matched eager decode on an H200, tests/test_qwen4_graphs.py);
    `LAMINA_QSA_DECODE=0` keeps the variable-shape decode (eager). Read at model build time."""
    on = _switch("LAMINA_QSA_DECODE", "1")
    return kernels == "triton" and on


def triton_prefill_attention_enabled(kernels: str) -> bool:
    """Whether attention of prefill and mixed steps on the Triton kernel set runs queries that
    continue cached context (prompt chunks after the first; verification chunks riding a prefill
    step) on lamina's varlen paged kernel (`lamina.kernels.triton_prefill_attention`: reads the
    paged cache, no per-shape plan) rather than SDPA's masked call per request group (fresh prompts:
    see `fresh_prompt_varlen_enabled`); decode groups take the paged decode kernel either way. On
    an H200 (benchmarks/results/bench_varlen_attention_h200.json) a 4k chunk over 4k of context
    took 4.2 against 20.9 ms, and SDPA's masked call (cuDNN with GQA) builds a plan for every new
    shape (70-195 ms). On by default; `LAMINA_PREFILL_ATTENTION=sdpa`
    keeps the masked SDPA call. Sparse (indexed) attention keeps SDPA. Read at model build time."""
    wanted = os.environ.get("LAMINA_PREFILL_ATTENTION", "triton")
    if wanted not in ("sdpa", "triton"):
        raise ValueError(f"LAMINA_PREFILL_ATTENTION = {wanted!r} must be 'sdpa' or 'triton'")
    return kernels == "triton" and wanted == "triton"


def fresh_prompt_varlen_enabled(kernels: str) -> bool:
    """Whether fresh prompts (queries from position 0, no cached context) also run on lamina's
    varlen paged kernel where `triton_prefill_attention_enabled` holds, rather than on SDPA's
    causal rule (flash or cuDNN). `LAMINA_FRESH_PROMPT_ATTENTION=varlen|sdpa`, default `varlen`:
    on an H100 (benchmarks/results/bench_varlen_attention_h100_s28.json, one layer's attention) a
    fresh 8k prompt took 2.07 against 2.45 ms on the causal rule, eight fresh 1k prompts 0.43 against
    0.85; and a prompt's rows are then computed by one kernel whether or not it was chunked. Read
    at model build time."""
    wanted = os.environ.get("LAMINA_FRESH_PROMPT_ATTENTION", "varlen")
    if wanted not in ("sdpa", "varlen"):
        raise ValueError(f"LAMINA_FRESH_PROMPT_ATTENTION = {wanted!r} must be 'sdpa' or 'varlen'")
    return triton_prefill_attention_enabled(kernels) and wanted == "varlen"


def fused_gdn_decode_enabled(kernels: str) -> bool:
    """Whether the gated delta net's one-token decode on the Triton kernel set runs as one launch
    (`lamina.kernels.triton_gdn_decode`: conv, delta rule and gated norm fused) rather than the
    three of `triton_decode` / `triton_norm`. Off unless `LAMINA_FUSED_GDN_DECODE=1`: on an H200
    (benchmarks/results/bench_gdn_decode_h200.json, graphs of 30 layers) the fused kernel, one
    program per (request, value head) holding a whole 128 x 128 state, took 12.9 / 51 / 189 us per
    layer at batch 1 / 16 / 64 against 9.5 / 31 / 97 for the three launches, whose delta rule
    spreads each head over several programs. MTP verification steps (Q > 1) take the Q-token
    kernels of `triton_verify` either way. Read at model build time."""
    on = _switch("LAMINA_FUSED_GDN_DECODE", "0")
    return kernels == "triton" and on


def gdn_short_prefill_max_tokens(kernels: str) -> int:
    """Up to how many tokens a request's chunk may have (the step's `max_query_len`) for the gated
    delta net's prefill / mixed steps on the Triton kernel set to run the delta rule token by token in
    one launch (`lamina.kernels.triton_gdn_varlen`) instead of fla-core's chunked kernel (~10
    launches and ~1 ms of host work a layer). `LAMINA_GDN_SHORT_PREFILL` = that many tokens (0: off);
    default 256. On an H100 (40-layer Qwen3.5-35B-A3B preset, one prompt, session 42,
    benchmarks/results/short_prefill*_h100_s42.json) the TTFT was 32 / 32 / 37 / 51 / 75 ms at 16 / 128 /
    256 / 512 / 1,024 tokens against fla's 66 / 66 / 67 / 65 / 68: the sequential recurrence's GPU
    time grows with the chunk and overtakes the host time it saves between 512 and 1,024 tokens.
    Read at model build time."""
    tokens = env_token_count("LAMINA_GDN_SHORT_PREFILL", 256)
    return tokens if kernels == "triton" else 0


def gdn_short_prefill_alone_tokens(kernels: str) -> int:
    """The short-chunk delta rule's longer limit for small steps: a step of at most twice this many
    tokens (one prompt chunk with some decodes, or two) takes its chunks of up to this many tokens
    token by token too; larger steps keep `gdn_short_prefill_max_tokens`. `LAMINA_GDN_SHORT_PREFILL_ALONE`
    = that many tokens (0: off; off with LAMINA_GDN_SHORT_PREFILL=0); default 512. On an H100 (session
    44, benchmarks/results/short_prefill_long_h100_s44.json, throughput_short_limit_512_ab_h100_s44.json):
    one 512-token prompt's TTFT was 51-55 ms token by token against fla-core's 84-101, while a limit of
    512 for every step cost offline throughput of 512-token prompts 12% (steps of sixteen such chunks).
    Read at model build time."""
    if gdn_short_prefill_max_tokens(kernels) == 0:
        return 0
    return env_token_count("LAMINA_GDN_SHORT_PREFILL_ALONE", 512)


def env_token_count(name: str, default: int) -> int:
    """A token count >= 0 from the environment variable `name` (0: off), `default` when unset; a
    clear error naming the variable otherwise."""
    wanted = os.environ.get(name, str(default))
    try:
        tokens = int(wanted)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(f"{name} = {wanted!r} must be a token count >= 0 (0: off)")
    return tokens


def moe_gemv_max_tokens() -> int:
    """Up to how many tokens the Triton fused MoE runs its decode GEMV kernels
    (`lamina.kernels.triton_moe_gemv`) rather than the grouped GEMM: `LAMINA_MOE_GEMV=1` (the
    default) allows the GEMV path, `0` keeps every step on the grouped GEMM (for A/B runs); read
    at model build time."""
    from lamina.kernels.triton_moe_gemv import GEMV_MAX_TOKENS

    on = _switch("LAMINA_MOE_GEMV", "1")
    return GEMV_MAX_TOKENS if on else 0


def fused_router_max_tokens(kernels: str) -> int:
    """Up to how many tokens an MoE layer on the Triton kernel set routes in one launch (router
    GEMV, softmax, top-k: `lamina.kernels.triton_router`) rather than the GEMV and
    `route_softmax_topk`: `LAMINA_FUSED_ROUTER=1` allows it, `0` (the default) keeps the two
    launches; 0 on the reference kernels. Read at model build time. Off by default: on the H200 it
    was slower at one token (9.6 us against 6.6 for cuBLAS GEMV + route, bench_router_h200.json;
    3.36 against 3.25 ms a batch-1 step) and its GPU test failed (see tests/test_triton_router.py)."""
    on = _switch("LAMINA_FUSED_ROUTER", "0")
    if kernels != "triton" or not on:
        return 0
    from lamina.kernels.triton_router import ROUTER_MAX_TOKENS

    return ROUTER_MAX_TOKENS


@functools.cache
def moe_align_blocked() -> bool:
    """Whether the fused MoE aligns more than 4,096 (token, expert) pairs (prefill chunks) with the
    three-launch Triton alignment (`lamina.kernels.triton_align`) rather than its torch form (~50
    launches per layer). `LAMINA_MOE_ALIGN=triton` (the default) or `torch`; read once per process."""
    wanted = os.environ.get("LAMINA_MOE_ALIGN", "triton")
    if wanted not in ("triton", "torch"):
        raise ValueError(f"LAMINA_MOE_ALIGN = {wanted!r} must be 'triton' or 'torch'")
    return wanted == "triton"


@functools.cache
def moe_prefill_grouped_mm() -> bool:
    """Whether the Triton set's fused MoE runs prefill-sized calls (more than
    `triton_moe.DECODE_MAX_PAIRS` pairs, outside CUDA-graph capture) on `torch._grouped_mm` (`lamina.kernels.grouped_mm_moe`,
    CUTLASS's grouped GEMM) rather than its own grouped kernels, where the GPU and dtype allow:
    `LAMINA_MOE_PREFILL=grouped_mm`, or `triton` (the default); read once per process."""
    wanted = os.environ.get("LAMINA_MOE_PREFILL", "triton")
    if wanted not in ("triton", "grouped_mm"):
        raise ValueError(f"LAMINA_MOE_PREFILL = {wanted!r} must be 'triton' or 'grouped_mm'")
    return wanted == "grouped_mm"


def pending_fill_kernels(kernels: str) -> str:
    """How a planned-ahead MTP step is filled in on the device: 'triton' (one launch,
    `lamina.kernels.triton_pending_fill`) on the Triton kernel set, or 'torch' (~15 launches,
    `lamina.kernels.pending_fill`, the reference). `LAMINA_PENDING_FILL=triton` (the default) or
    `torch`, which keeps the torch form on a GPU (for A/B runs, or should the kernel misbehave on a
    Triton version); read at engine build time."""
    wanted = os.environ.get("LAMINA_PENDING_FILL", "triton")
    if wanted not in ("triton", "torch"):
        raise ValueError(f"LAMINA_PENDING_FILL = {wanted!r} must be 'triton' or 'torch'")
    return "triton" if kernels == "triton" and wanted == "triton" else "torch"


def sampler_kernels(kernels: str) -> str:
    """The sampler's own kernels: 'triton' on the Triton kernel set, or 'torch' (the references).
    'triton' computes a seeded request's noise in one launch (`lamina.kernels.triton_seeded_noise`,
    against ~70 elementwise launches per 16 seeded rows: 1.24 -> 0.016 ms for one row on an H100)
    and the top-k window's cut of rows with a small top-k in one launch after the `topk`
    (`lamina.kernels.triton_window_cut`, against ~30). `LAMINA_SAMPLER_KERNELS=triton` (the default)
    or `torch` keeps the references on a GPU (A/B runs); read at engine build time. Both compute
    the same function up to float32 rounding (the seeded noise's logarithm is float32 in the
    kernel, float64 in the reference), so a sampled token may differ between the two only at such
    near-ties."""
    wanted = os.environ.get("LAMINA_SAMPLER_KERNELS", "triton")
    if wanted not in ("triton", "torch"):
        raise ValueError(f"LAMINA_SAMPLER_KERNELS = {wanted!r} must be 'triton' or 'torch'")
    return "triton" if kernels == "triton" and wanted == "triton" else "torch"


@functools.cache
def nucleus_cut_enabled() -> bool:
    """Whether the Triton sampler cuts rows with a top-k wider than its window or none (top-p alone)
    without sorting the vocabulary (`lamina.kernels.triton_window_cut.nucleus_cut_triton`: the
    128-wide `topk`, a search for the k-th largest logit by count, one read of the row for the kept
    set's normaliser, a search by mass when the 128 hold less than top-p) rather than the sort
    (`sorted_cut`). Off unless `LAMINA_NUCLEUS_CUT=1`: on an H100 (session 39, docs/PERFORMANCE.md)
    it is 1.5-8x faster than the sort on peaked top-p rows but 4-10x slower at batch 1-16 on rows
    that search, and on flat rows at the 248k vocabulary it may keep one boundary token more or
    fewer than the sort (whose float32 softmax rounds there); read once per process."""
    return _switch("LAMINA_NUCLEUS_CUT", "0")


@functools.cache
def gemv_fma() -> bool:
    """Whether the decode GEMV (`lamina.kernels.triton_gemv`) takes its kernel without `tl.dot`
    (`_gemv_fma_kernel`) rather than the split-K one for one and two rows: `LAMINA_GEMV_FMA=1`
    (the default) or `0`; read once per process. On an H200 batch-1 / 2 steps took 2.450 / 3.252
    ms with it against 2.648 / 3.304 (benchmarks/results/latency_gemv_by_rows_session15_h200.json)."""
    return _switch("LAMINA_GEMV_FMA", "1")


@functools.cache
def moe_gemv_fma_max_tokens() -> int:
    """Up to how many tokens the MoE decode GEMVs (`lamina.kernels.triton_moe_gemv`) take their
    kernels without `tl.dot`: every decode token count by default and with `LAMINA_MOE_GEMV_FMA=1`,
    none with `0`; read once per process. On an H200, since their down kernel sums every slot in
    one accumulator, batch 1 / 2 / 3 / 4 took 2.35 / 3.07 / 3.54 / 4.09 ms a step with them against
    2.43 (the FMA kernels before that change) / 3.22 / 3.65 / 4.23 with the `tl.dot` kernels from
    two tokens on (benchmarks/results/latency_moe_fma_rows_session17_h200.json)."""
    return 1 << 30 if _switch("LAMINA_MOE_GEMV_FMA", "1") else 0


MAX_DECODE_QUERY_LEN = 8  # verification of up to 7 drafts (lamina.kernels.triton_verify.MAX_QUERIES)


def decode_query_len(meta) -> int | None:
    """Q when every request of the step has the same number Q <= 8 of new tokens and none is a
    prefill chunk: Q = 1 (plain decode, no per-position states kept) or Q = K + 1 (speculative
    verification: each request's last token and K drafts, keeping the states after tokens
    0..K-1 in the request-major layout of `StateCapture.per_request`). None otherwise. What the
    Triton decode kernels (`triton_decode`, `triton_verify`) handle; decided from host ints of
    the plan only, never from tensor values."""
    num_reqs, q = meta.num_reqs, meta.max_query_len
    if num_reqs <= 0 or not 1 <= q <= MAX_DECODE_QUERY_LEN or meta.num_tokens != num_reqs * q:
        return None
    capture = meta.state_capture
    if q == 1:
        return 1 if capture is None else None
    # Q > 1 tokens per request are decode tokens only when each request verifies Q - 1 drafts.
    return q if capture is not None and capture.per_request(num_reqs) == q - 1 else None


def is_one_token_decode(meta) -> bool:
    """A step whose every request has exactly one new token and keeps no per-position states
    (host ints of the plan only): what the one-token Triton decode kernels handle."""
    return decode_query_len(meta) == 1


@dataclass(frozen=True)
class GdnPrefillKernels:
    """The gated delta net's kernels for steps that are not a one-token decode."""

    delta_rule: str  # "fla" (fla-core's chunk_gated_delta_rule) or "reference"
    conv: str  # "triton" (lamina.kernels.triton_conv) or "reference"


# fla-core runs for 16-bit activations. Float32 models are the precision baseline (parallel layouts
# are compared with one GPU in float32) and keep the torch reference: fla's float32 path passed the
# kernel test on an H200 but has not run in the engine there.
FLA_DTYPES = (torch.bfloat16, torch.float16)


def gdn_prefill_kernels(device: torch.device | str | None, kernels: str, dtype: torch.dtype) -> GdnPrefillKernels:
    """Prefill kernels of a gated delta net built on `device` with the kernel set `kernels`
    (`kernel_set`'s answer) and activations of `dtype`, from `LAMINA_GDN_PREFILL`; read once,
    when the layer is built."""
    wanted = os.environ.get("LAMINA_GDN_PREFILL", "auto")
    if wanted not in GDN_PREFILL_CHOICES:
        raise ValueError(f"LAMINA_GDN_PREFILL = {wanted!r} is not one of {', '.join(GDN_PREFILL_CHOICES)}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    if wanted == "reference":
        return GdnPrefillKernels("reference", "reference")
    if wanted == "fla" and dtype not in FLA_DTYPES:
        raise ValueError(
            f"LAMINA_GDN_PREFILL = 'fla' needs bfloat16 or float16 activations, not {dtype} (float32 models "
            f"keep the reference delta rule, their precision baseline); use one of auto, reference"
        )
    if wanted == "fla":
        if device.type != "cuda":
            raise ValueError(
                f"LAMINA_GDN_PREFILL = 'fla' needs a CUDA device, not {device.type!r} (fla-core's kernels run "
                f"on GPUs only); use one of auto, reference there"
            )
        from lamina.kernels.fla_prefill import fla_import_error

        error = fla_import_error()
        if error is not None:
            raise ValueError(
                f"LAMINA_GDN_PREFILL = 'fla' but fla-core does not import ({error}); install it with "
                f"pip install 'fla-core>=0.6' (or pip install -e '.[gpu]'), or use one of auto, reference"
            )
        return GdnPrefillKernels("fla", "triton")
    conv = "triton" if kernels == "triton" else "reference"
    if device.type == "cuda" and kernels == "triton" and dtype in FLA_DTYPES:
        from lamina.kernels.fla_prefill import fla_import_error

        error = fla_import_error()
        if error is None:
            return GdnPrefillKernels("fla", conv)
        _warn_once(f"fla-core does not import ({error}): the gated delta rule of prefill steps runs the torch "
                   f"reference (slower); pip install 'fla-core>=0.6' for its chunked kernel")
    return GdnPrefillKernels("reference", conv)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)
