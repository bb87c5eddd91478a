"""CUDA graphs of short prefill and mixed steps (prompt chunks, alone or beside decodes), by padded
(tokens, requests).

A step of R requests and T tokens whose chunks each hold at most the gated delta net's short-chunk
limit (`GatedDeltaNet.short_prefill_tokens`, the token-by-token delta rule that reads its bounds on
the device) runs as the graph of the smallest token bucket Tc >= T and request bucket Rc > R in
which the padding fits (`MixedGraphs.shape_for`). Its inputs live in one persistent device buffer
of int64 fields, written into a pinned host copy and uploaded with one copy, as the decode graphs'
(lamina.worker.cuda_graphs): per token (ids, positions, KV slots, request of each token, the row
of a pending token), per request (context lengths, state slots, whether the state carries over,
block tables) and the query boundaries. Requests R..Rc-1 are padding: they hold the Tc - T padding
tokens, spread evenly (no padding request longer than the step's query bound, so the sequential
delta rule is not held up by one long padding request), write no KV (slot -1), read block 0, start
from a fresh state in the spare slot no request owns. The graph computes the logits of every
request's last row; the caller keeps the sampling chunks'.

Capturable because on the Triton kernel set a prefill forward reads its metadata from device
tensors and from host ints fixed per shape (`num_tokens` = Tc, `num_reqs` = Rc, `max_query_len` =
the smaller of Tc and the short-chunk limit, no host query lengths, so no request groups): the
varlen attention kernel, the prefill conv and the short-chunk delta rule loop to each request's
bounds on the device, and the grouped MoE sizes its grid from the pair count. What changes against
the eager step is rounding only (docs/ARCHITECTURE.md, "Batch invariance"): a decode riding a
prompt chunk takes the varlen attention kernel rather than the decode kernel, and the MoE's tiles
follow Tc rather than T.

Graphs are captured (a warm-up and the capture on a side stream, with an all-padding layout so no
request's cache or state is touched) into the decode graphs' memory pool: the engine captures every
shape a step can take at start-up, largest first (`capture_all`, `reachable_shapes`: 43 at 256
requests; `LAMINA_MIXED_GRAPHS_AT_START=0` leaves each to the first step that needs it, which then
stalls every running request while it is captured). A shape whose capture fails (out of memory,
say) runs eagerly from then on. `LAMINA_MIXED_GRAPHS` = the largest token bucket (default 512; 0: off), read
when the engine captures its graphs. Single-rank engines; models whose prefill needs host work
(N-gram PLE history, QSA's block selection) run these steps eagerly (`why_not_capturable`). Under
MTP (`keep_hidden`) a graph ends at the final hidden states, kept in a persistent buffer: the
verification and the drafter's passes run eagerly over the padded step (`run_hidden`), for steps
without drafts (prompts alone, or beside requests that draft nothing); a step with drafts needs
their states' capture rows and runs on the verification graphs or eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from lamina.host_to_device import to_device
from lamina.kernels.graph_forward import graph_forward
from lamina.layers.metadata import ForwardMetadata
from lamina.worker.cuda_graphs import why_not_capturable as why_decode_not_capturable

logger = logging.getLogger(__name__)

MIXED_GRAPHS_ENV = "LAMINA_MIXED_GRAPHS"
AT_START_ENV = "LAMINA_MIXED_GRAPHS_AT_START"
DEFAULT_MAX_TOKENS = 512
MIN_TOKENS = 16  # the smallest token bucket: above MAX_DECODE_QUERY_LEN, so no decode kernel is taken

# per token: ids, positions, KV slots, request of each token, the row of a pending token (-1: none)
_TOKEN_FIELDS = ("token_ids", "positions", "slot_mapping", "request_index", "pending_row")
# per request: context length after the step, state slot, whether the state carries over
_REQUEST_FIELDS = ("seq_lens", "state_slots", "keep")


def mixed_graph_max_tokens(token_limit: int | None = None) -> int:
    """`LAMINA_MIXED_GRAPHS`: the largest token bucket of captured prefill / mixed steps (0: off;
    default 512; rounded up to a power of two >= 16), within `token_limit` (vLLM's largest capture
    size, `cuda_graphs.graph_token_limit`; None: none)."""
    from lamina.kernels.selection import env_token_count

    tokens = env_token_count(MIXED_GRAPHS_ENV, DEFAULT_MAX_TOKENS)
    return capped_tokens(0 if tokens == 0 else max(MIN_TOKENS, 1 << (tokens - 1).bit_length()), token_limit)


def mixed_graphs_at_start() -> bool:
    """`LAMINA_MIXED_GRAPHS_AT_START`: capture every reachable shape when the engine starts (1, the
    default) or each when first needed (0)."""
    import os

    value = os.environ.get(AT_START_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{AT_START_ENV} = {value!r} must be 0 or 1")
    return value == "1"


def capped_tokens(max_tokens: int, token_limit: int | None) -> int:
    """The largest token bucket of `max_tokens` that holds at most `token_limit` tokens (0: none)."""
    if token_limit is None or max_tokens <= token_limit:
        return max_tokens
    return 1 << (token_limit.bit_length() - 1) if token_limit >= MIN_TOKENS else 0


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from MIN_TOKENS to `max_tokens`."""
    buckets, size = [], MIN_TOKENS
    while size <= max_tokens:
        buckets.append(size)
        size *= 2
    return buckets


def request_buckets(max_reqs: int) -> list[int]:
    """Request counts of the captured shapes: powers of two from 2, and `max_reqs + 1` (every real
    request plus one padding request)."""
    top = max_reqs + 1
    buckets, size = [], 2
    while size < top:
        buckets.append(size)
        size *= 2
    return buckets + [top]


def short_chunk_limit(model) -> int:
    """The longest chunk every gated delta-net layer runs on its short-chunk kernel (0: one is off)."""
    limits = [m.short_prefill_tokens for m in model.modules() if hasattr(m, "short_prefill_tokens")]
    return min(limits) if limits else 1 << 30


def prefill_needs_host(model) -> str | None:
    """What in the model's prefill forward needs host work every step whatever the kernel set (the
    N-gram PLE's per-request token history, QSA's prefill block selection), or None."""
    from lamina.layers.indexed_attention import IndexedGatedAttention

    if getattr(model, "token_history_len", 0) > 0:
        return "the N-gram PLE's token history is built per request on the host"
    for name, module in model.named_modules():
        if isinstance(module, IndexedGatedAttention):
            return f"attention {name}: QSA's prefill block selection has no fixed-shape path"
    return None


def drafter_needs_more(drafter) -> str | None:
    """Why an MTP engine's `drafter` cannot follow a graph that keeps only the target's final
    hidden states (Qwen4-Exp's reads the hyper-connection streams its forward sets aside), or None
    (None too without a drafter)."""
    if drafter is None or getattr(drafter, "reads_final_hidden", False):
        return None
    return f"the MTP drafter {type(drafter).__name__} reads more of the target's step than its final hidden states"


def why_not_capturable(model, drafter=None) -> str | None:
    """Why the model's short prefill / mixed steps cannot be captured, or None: the decode step's
    conditions (lamina.worker.cuda_graphs.why_not_capturable), plus no token history (the N-gram PLE's
    windows are per request, built on the host), no QSA attention (its prefill selection is not
    fixed-shape), the varlen attention kernel for prompt chunks, the Triton prefill conv and the
    short-chunk delta rule for chunks of at least MIN_TOKENS tokens. `drafter`: an MTP engine's
    drafter, which must read the target's final hidden states (what the graph keeps), not streams
    its forward sets aside on the host side (Qwen4-Exp's hyper-connection streams)."""
    from lamina.layers.attention import GatedAttention

    reason = why_decode_not_capturable(model) or prefill_needs_host(model) or drafter_needs_more(drafter)
    if reason is not None:
        return reason
    for name, module in model.named_modules():
        if isinstance(module, GatedAttention) and not module.triton_prefill_attention:
            return f"attention {name}: prompt chunks on SDPA (LAMINA_PREFILL_ATTENTION=sdpa), not the varlen kernel"
        prefill = getattr(module, "prefill_kernels", None)
        if prefill is not None and prefill.conv != "triton":
            return f"{name}: the prefill conv is not on the Triton kernel (LAMINA_GDN_PREFILL=reference)"
    limit = short_chunk_limit(model)
    if limit < MIN_TOKENS:
        return f"the short-chunk delta rule takes chunks of at most {limit} tokens (LAMINA_GDN_SHORT_PREFILL), below {MIN_TOKENS}"
    return None


class MixedGraphs:
    def __init__(
        self, model, *, device: torch.device, max_tokens: int, max_reqs: int, block_size: int,
        max_blocks_per_seq: int, spare_state_slot: int, vocab_size: int, pool=None, stream=None,
        keep_hidden: bool = False,
    ):
        self.model = model
        # MTP engines (`keep_hidden`): the graph ends at the final hidden states, copied into a
        # persistent buffer that the drafter's eager passes and the verification read (`run_hidden`);
        # no LM head in the graph (finish_step computes the sampling rows' logits itself)
        self.keep_hidden = keep_hidden
        self.hidden: torch.Tensor | None = None  # [max_tokens, H], allocated by the first forward
        self.device = device
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.spare_state_slot = spare_state_slot
        # no chunk, real or padding, is longer than the short-chunk limit or than a block table holds
        self.max_query_len = min(short_chunk_limit(model), max_blocks_per_seq * block_size)
        self.token_sizes = token_buckets(max_tokens)
        self.request_sizes = request_buckets(max_reqs)
        if not self.token_sizes:
            raise ValueError(f"max_tokens = {max_tokens}: the smallest token bucket is {MIN_TOKENS}")
        self.max_tokens = self.token_sizes[-1]
        self.max_reqs = self.request_sizes[-1]
        t, r = self.max_tokens, self.max_reqs
        # Flat layout: token fields [t] each, request fields [r] each, query boundaries [r + 1],
        # block tables [r, max_blocks].
        self._request_at = len(_TOKEN_FIELDS) * t
        self._qsl_at = self._request_at + len(_REQUEST_FIELDS) * r
        self._tables_at = self._qsl_at + r + 1
        total = self._tables_at + r * max_blocks_per_seq
        self.host = torch.zeros(total, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.inputs = torch.zeros(total, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        # One float32 logits buffer for every shape (rows: requests), outside the graphs' pool; the
        # graphs capture on one stream (the decode graphs', when given) so that each capture reuses
        # the blocks the previous ones freed in the shared pool.
        self.logits = None if keep_hidden else torch.empty(r, vocab_size, dtype=torch.float32, device=device)  # [Rc_max, vocab]
        self.pool = pool
        self.stream = (stream or torch.cuda.Stream(device)) if device.type == "cuda" else None
        self.captures = 0  # shapes captured (tests, logs)
        self.capture_seconds = 0.0  # host time spent capturing them (warm-ups included)
        self.capture_ms: dict[tuple[int, int], float] = {}  # each shape's, in capture order (a stall of every request)
        self.failed: set[tuple[int, int]] = set()  # shapes whose capture failed: their steps run eagerly
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    # ---- shapes ------------------------------------------------------------------------------
    def fits(self, chunks) -> bool:
        """A step these graphs take: prompt chunks (some chunk has more than one token, or does not
        sample), each of at most the short-chunk limit, no prompt logprobs to score, and a shape."""
        if not chunks or any(c.num_prompt_tokens for c in chunks):
            return False
        lens = [c.num_tokens for c in chunks]
        if min(lens) < 1 or max(lens) > self.max_query_len:
            return False
        if all(n == 1 and c.sample for n, c in zip(lens, chunks)):  # a plain decode step: the decode graphs'
            return False
        shape = self.shape_for(sum(lens), len(chunks))
        return shape is not None and shape not in self.failed

    def query_bound(self, tokens: int) -> int:
        """The graph's `max_query_len` at `tokens`: no chunk (real or padding) is longer."""
        return min(tokens, self.max_query_len)

    def shape_for(self, num_tokens: int, num_reqs: int) -> tuple[int, int] | None:
        """The smallest (Tc, Rc) with Tc >= T, Rc > R, and the Tc - T padding tokens spread over the
        Rc - R padding requests at most the query bound each; None when none fits."""
        for tokens in self.token_sizes:
            if tokens < num_tokens:
                continue
            bound = self.query_bound(tokens)
            for reqs in self.request_sizes:
                if reqs > num_reqs and (tokens - num_tokens) <= (reqs - num_reqs) * bound:
                    return tokens, reqs
            return None
        return None

    def reachable_shapes(self, max_step_tokens: int) -> list[tuple[int, int]]:
        """Every (Tc, Rc) that `shape_for` gives a step of at most `max_step_tokens` tokens (the
        scheduler's budget) in at most max_reqs - 1 requests, each chunk at most the query bound,
        largest first. For a token bucket Tc and R requests, a step of T tokens needs
        n(T) = max(R + 1, R + ceil((Tc - T) / bound)) requests, which takes every integer between
        n(T_hi) and n(T_lo) as T falls one token at a time, so its buckets are a contiguous run."""
        shapes: set[tuple[int, int]] = set()
        top = self.request_sizes[-1]
        for index, tokens in enumerate(self.token_sizes):
            bound = self.query_bound(tokens)
            low = self.token_sizes[index - 1] + 1 if index else 1
            for reqs in range(1, min(tokens, top - 1) + 1):
                t_lo, t_hi = max(low, reqs), min(tokens, reqs * self.max_query_len, max_step_tokens)
                if t_lo > t_hi:
                    continue
                n_lo = max(reqs + 1, reqs - (-(tokens - t_hi) // bound))  # the fewest requests: T = T_hi
                n_hi = min(max(reqs + 1, reqs - (-(tokens - t_lo) // bound)), top)
                # the smallest bucket >= n for each n in [n_lo, n_hi]: those >= n_lo whose predecessor is < n_hi
                shapes.update((tokens, r) for r, below in zip(self.request_sizes, [0] + self.request_sizes[:-1])
                              if r >= n_lo and below < n_hi)
        return sorted(shapes, reverse=True)

    @torch.inference_mode()
    def capture_all(self, max_step_tokens: int) -> int:
        """Capture every shape a step of at most `max_step_tokens` tokens can take that is not yet
        captured, largest first (each later one reuses the pool's blocks), so that no shape is first
        met mid-serving, where its capture stalls every running request (77-137 ms a shape on an
        H100, session 44). Returns how many shapes were added (off CUDA: their static-buffer entries)."""
        before = len(self.graphs)
        for shape in self.reachable_shapes(max_step_tokens):
            if shape not in self.graphs and shape not in self.failed:
                self._try_capture(shape)
        return len(self.graphs) - before

    # ---- buffers -----------------------------------------------------------------------------
    def _token(self, buffer, name: str, tokens: int):
        start = _TOKEN_FIELDS.index(name) * self.max_tokens
        return buffer[start : start + tokens]

    def _request(self, buffer, name: str, reqs: int):
        start = self._request_at + _REQUEST_FIELDS.index(name) * self.max_reqs
        return buffer[start : start + reqs]

    def _qsl(self, buffer, reqs: int):
        return buffer[self._qsl_at : self._qsl_at + reqs + 1]

    def _tables(self, buffer, reqs: int):
        return buffer[self._tables_at : self._tables_at + reqs * self.max_blocks].reshape(reqs, self.max_blocks)

    def _pack(self, chunks, shape: tuple[int, int], pending_rows: list[int] | None) -> None:
        """The step's rows into the host buffer for `shape`, then requests len(chunks)..Rc-1 as
        padding holding tokens T..Tc-1."""
        tokens, reqs = shape
        host, bs = self.host_np, self.block_size
        num_reqs = len(chunks)
        lens = np.array([c.num_tokens for c in chunks], dtype=np.int64)  # [R]
        starts = np.array([c.start_position for c in chunks], dtype=np.int64)  # [R]
        pad = tokens - int(lens.sum())
        pad_reqs = reqs - num_reqs
        pad_lens = np.full(pad_reqs, pad // pad_reqs, dtype=np.int64)  # [Rc - R]: spread evenly
        pad_lens[: pad % pad_reqs] += 1
        all_lens = np.concatenate([lens, pad_lens])  # [Rc]
        qsl = self._qsl(host, reqs)
        qsl[0] = 0
        np.cumsum(all_lens, out=qsl[1:])
        request_index = np.repeat(np.arange(reqs), all_lens)  # [Tc]
        offsets = np.arange(tokens) - qsl[:-1][request_index]  # [Tc] position within the chunk
        all_starts = np.concatenate([starts, np.zeros(pad_reqs, dtype=np.int64)])  # [Rc]
        positions = all_starts[request_index] + offsets  # [Tc]
        tables = self._tables(host, reqs)  # entries past what a row's context needs are never read
        for row, chunk in enumerate(chunks):
            tables[row, : len(chunk.block_table)] = chunk.block_table
        tables[num_reqs:, : max(1, -(-int(pad_lens.max(initial=0)) // bs))] = 0  # padding requests read block 0
        real = qsl[num_reqs]
        slots = np.full(tokens, -1, dtype=np.int64)  # [Tc]: padding tokens write no KV
        ri, pos = request_index[:real], positions[:real]
        slots[:real] = tables[ri, pos // bs] * bs + pos % bs
        self._token(host, "token_ids", tokens)[:real] = [t for c in chunks for t in c.token_ids]
        self._token(host, "token_ids", tokens)[real:] = 0
        self._token(host, "positions", tokens)[:] = positions
        self._token(host, "slot_mapping", tokens)[:] = slots
        self._token(host, "request_index", tokens)[:] = request_index
        self._token(host, "pending_row", tokens)[:] = -1
        if pending_rows is not None:
            self._token(host, "pending_row", tokens)[:real] = pending_rows
        self._request(host, "seq_lens", reqs)[:] = all_starts + all_lens
        state_slots = self._request(host, "state_slots", reqs)
        state_slots[:num_reqs] = [c.state_slot for c in chunks]
        state_slots[num_reqs:] = self.spare_state_slot
        self._request(host, "keep", reqs)[:] = all_starts > 0

    def _upload(self, shape: tuple[int, int], non_blocking: bool) -> None:
        """The host buffer's fields and the shape's block-table rows to the device (not the other
        rows: a table row is ceil(max_model_len / block_size) entries wide)."""
        used = self._tables_at + shape[1] * self.max_blocks
        self.inputs[:used].copy_(self.host[:used], non_blocking=non_blocking)

    def _meta(self, shape: tuple[int, int]) -> tuple[torch.Tensor, ForwardMetadata]:
        """Views of the device buffer for `shape` (no host query lengths: one call per kernel over
        the whole padded step, never request groups)."""
        tokens, reqs = shape
        buf = self.inputs
        meta = ForwardMetadata(
            num_tokens=tokens, num_reqs=reqs, max_query_len=self.query_bound(tokens),
            max_seq_len=self.max_blocks * self.block_size,
            positions=self._token(buf, "positions", tokens), query_start_loc=self._qsl(buf, reqs),
            seq_lens=self._request(buf, "seq_lens", reqs), slot_mapping=self._token(buf, "slot_mapping", tokens),
            block_tables=self._tables(buf, reqs), state_slots=self._request(buf, "state_slots", reqs),
            has_initial_state=self._request(buf, "keep", reqs) != 0,
            token_request_index=self._token(buf, "request_index", tokens), allow_groups=False,
        )
        return self._token(buf, "token_ids", tokens), meta

    @graph_forward()  # warm-up, capture and static stand-in take the captured kernels' paths
    def _forward(self, shape: tuple[int, int]) -> torch.Tensor:
        """Logits `[Rc, vocab]` of every request's last row (padding requests' included), written
        into the shared buffer; with `keep_hidden`, the final hidden states `[Tc, H]` written into
        theirs instead."""
        tokens, reqs = shape
        token_ids, meta = self._meta(shape)
        hidden = self.model(token_ids, meta)  # [Tc, H]
        if self.keep_hidden:
            if self.hidden is None:  # the first forward is a warm-up, outside any graph (or the CPU's)
                self.hidden = torch.empty((self.max_tokens, hidden.shape[-1]), dtype=hidden.dtype, device=self.device)
            return self.hidden[:tokens].copy_(hidden)  # [Tc, H]
        last_rows = (meta.query_start_loc[1:] - 1).clamp(min=0)  # [Rc]
        return self.model.compute_logits(hidden.index_select(0, last_rows), out=self.logits[:reqs])  # [Rc, vocab]

    # ---- capture -----------------------------------------------------------------------------
    @torch.inference_mode()  # as every replay: the buffers a warm-up allocates are written by later captures
    def _capture(self, shape: tuple[int, int]) -> None:
        """Warm up and capture `shape` on an all-padding layout (no request's cache or state is
        touched). Off CUDA (CPU tests) the warm-up runs and nothing is captured: `run` executes the
        static-buffer forward eagerly."""
        start = time.perf_counter()
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._pack([], shape, None)
        self._upload(shape, non_blocking=False)
        if self.device.type != "cuda":
            self._forward(shape)
            self.graphs[shape] = None
            return
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                self._forward(shape)  # warm-up: Triton compiles, cuBLAS picks its kernels
                graph = torch.cuda.CUDAGraph()
                # thread_local: captured mid-serving, while other threads may call CUDA (not captured)
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                    self._forward(shape)
        finally:  # even when the capture fails: no later upload may overtake the warm-up's reads
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.pool = graph.pool()
        self.graphs[shape] = graph
        self.captures += 1
        took = time.perf_counter() - start
        self.capture_seconds += took
        self.capture_ms[shape] = took * 1e3
        logger.info("captured the prefill / mixed step graph of %d tokens and %d requests in %.0f ms", *shape, took * 1e3)

    def _try_capture(self, shape: tuple[int, int]) -> bool:
        """`_capture`, or on failure (out of memory, a capture error) mark the shape to run eagerly."""
        try:
            self._capture(shape)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            self.failed.add(shape)
            logger.warning("capturing the prefill / mixed step graph of %d tokens and %d requests failed (%s: %s); "
                           "steps of that shape run eagerly", *shape, type(error).__name__, error)
            return False
        return True

    # ---- replay ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, chunks, previous=None) -> torch.Tensor | None:
        """Logits `[B_sample, vocab]` of the step's sampling chunks, in chunk order (`fits` must
        hold); None when the step's shape could not be captured (out of memory, or a capture error:
        the caller runs the step eagerly, as it will every later step of that shape). Pending
        tokens (asynchronous scheduling) are taken from `previous` (`PreviousTokens`) on the device."""
        shape = self._replay(chunks, previous)
        if shape is None:
            return None
        logits = self.logits
        rows = [row for row, c in enumerate(chunks) if c.sample]
        if len(rows) == len(chunks):
            return logits[: len(chunks)]
        return logits.index_select(0, to_device(rows, self.device))  # [B_sample, vocab]

    @torch.inference_mode()
    def run_hidden(self, chunks) -> tuple[torch.Tensor, torch.Tensor, ForwardMetadata] | None:
        """MTP engines (`keep_hidden`): the step replayed, then (final hidden states `[Tc, H]`, token
        ids `[Tc]`, the padded step's metadata) for the drafter and the verification, which run
        eagerly over the padded step (its requests first, in chunk order; padding rows write no KV);
        None when the shape could not be captured. Chunks carry no pending tokens here."""
        shape = self._replay(chunks, None)
        if shape is None:
            return None
        token_ids, meta = self._meta(shape)  # views of the device buffer the replay read
        return self.hidden[: shape[0]], token_ids, meta

    def _replay(self, chunks, previous) -> tuple[int, int] | None:
        """Pack, upload and replay the step's shape (captured first when new); its shape, or None."""
        num_tokens = sum(c.num_tokens for c in chunks)
        shape = self.shape_for(num_tokens, len(chunks))
        if shape is None or shape in self.failed:
            raise ValueError(f"no prefill / mixed graph fits {num_tokens} tokens of {len(chunks)} requests")
        if shape not in self.graphs and not self._try_capture(shape):
            return None
        pending_rows = previous.source_rows(chunks) if previous is not None else None
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._pack(chunks, shape, pending_rows)
        self._upload(shape, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        if pending_rows is not None:
            previous.fill(self._token(self.inputs, "token_ids", num_tokens),
                          self._token(self.inputs, "pending_row", num_tokens))
        graph = self.graphs[shape]
        if graph is None:
            self._forward(shape)
        else:
            graph.replay()
        return shape
