"""CUDA graphs of speculative decoding's target step, by (Q tokens per request, padded batch size).

Under MTP every decode step runs the target over Q = k + 1 tokens per request (the last accepted
token and k drafts; k = 0 while no drafts are proposed) and then verifies and drafts eagerly
(lamina.worker.spec_step). This captures the target's forward and its LM head over all B*Q rows
for each Q in 1..K+1 and each capture size; a step of B requests replays the graph of the
smallest size >= B. What the eager verification and the drafter read afterwards lives in
persistent buffers: the final hidden states `[rows, H]` and the logits of every position
`[rows, V]` (one pair of buffers shared by all graphs: only the graph just replayed is read),
and for Q > 1 the states after tokens 0..Q-2 of every request for the rollback
(`CaptureBuffers`, one per state pool; row b*(Q-1) + i, the layout StateCapture commits from).

Inputs live in one persistent int64 device buffer (per token: ids, positions, KV slots; per
request: context length, state slot, whether the state carries over, and for a step planned ahead
its row in the previous step's results; block tables), filled from a pinned host copy with one
upload per step. Padding rows B..Bc-1: no KV write (slot -1), context
length Q, and no state: for Q = 1 the one-token kernels write a spare state slot that no request
owns (as the plain decode graphs do), for Q > 1 the Q-token kernels skip rows with state slot -1,
so padding writes no state and no capture row.

Memory: the capture buffers hold max_verify_batch * K states of every recurrent layer, so verify
graphs (Q > 1) are captured only up to `max_verify_batch` requests (`LAMINA_VERIFY_GRAPH_MAX_BATCH`,
default 64); larger verification steps run eagerly. vLLM's capture sizes shrink them to what the
largest graphs hold (`verify_state_rows`; the engine's memory plan reserves the same).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from lamina.kernels.graph_forward import graph_forward
from lamina.kernels.pending_fill import fill_pending_reference
from lamina.layers.metadata import ForwardMetadata, StateCapture
from lamina.layers.spec_state import CaptureBuffers
from lamina.worker.cuda_graphs import graph_sizes
from lamina.worker.pending_step import PreviousVerify

logger = logging.getLogger(__name__)

_TOKEN_FIELDS = ("token_ids", "positions", "slot_mapping")
_REQUEST_FIELDS = ("seq_lens", "state_slots", "keep", "source_rows")
DEFAULT_MAX_VERIFY_BATCH = 64


def max_verify_batch(max_batch: int) -> int:
    """Largest batch of the verify graphs (Q > 1): `LAMINA_VERIFY_GRAPH_MAX_BATCH` (default 64)."""
    wanted = os.environ.get("LAMINA_VERIFY_GRAPH_MAX_BATCH", str(DEFAULT_MAX_VERIFY_BATCH))
    if not wanted.isdigit():
        raise ValueError(f"LAMINA_VERIFY_GRAPH_MAX_BATCH = {wanted!r} must be a non-negative integer")
    return min(max_batch, int(wanted))


def verify_state_rows(max_batch: int, num_speculative_tokens: int, capture_sizes: tuple[int, ...] | None = None,
                      max_capture_size: int | None = None) -> int:
    """Rows of the verify graphs' state capture buffers (per state pool): the most any graph of
    Q = 2..K+1 tokens a request writes, (Q - 1) for each of its requests. Without vLLM's capture
    sizes that is max_verify_batch * K; under them (`graph_sizes`), what their largest graphs hold
    (max_cudagraph_capture_size 8 at K = 3: two requests of 4 tokens, 6 rows instead of 192)."""
    from lamina.kernels.selection import MAX_DECODE_QUERY_LEN

    batch = max_verify_batch(max_batch)
    most = min(num_speculative_tokens + 1, MAX_DECODE_QUERY_LEN)
    if batch <= 0:
        return 0
    return max((max(graph_sizes(batch, q, capture_sizes, max_capture_size), default=0) * (q - 1)
                for q in range(2, most + 1)), default=0)


class VerifyGraphs:
    def __init__(
        self, model, *, device: torch.device, max_batch: int, num_speculative_tokens: int, block_size: int,
        max_blocks_per_seq: int, spare_state_slot: int, capture_sizes: tuple[int, ...] | None = None,
        max_capture_size: int | None = None,
    ):
        from lamina.kernels.selection import MAX_DECODE_QUERY_LEN, kernel_set, pending_fill_kernels

        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_queries = min(num_speculative_tokens + 1, MAX_DECODE_QUERY_LEN)
        self.verify_batch = max_verify_batch(max_batch)
        if self.max_queries > 1 and self.verify_batch < max_batch:
            logger.warning(
                "MTP verify graphs (K+1 = %d tokens per request) are captured up to batch %d of max_num_seqs = %d "
                "(LAMINA_VERIFY_GRAPH_MAX_BATCH; their state capture buffers grow with it): larger verification "
                "steps run eagerly", self.max_queries, self.verify_batch, max_batch,
            )
        self.max_blocks = max_blocks_per_seq
        # A step planned ahead is filled in on the device: one launch on the Triton kernel set
        # (LAMINA_PENDING_FILL=torch keeps the torch form)
        self.fill_kernels = pending_fill_kernels(kernel_set(device))
        if self.fill_kernels == "triton":
            from lamina.kernels.triton_pending_fill import fill_pending_triton as fill
        else:
            fill = fill_pending_reference
        self._fill = fill
        self.spare_state_slot = spare_state_slot
        self.capture_sizes, self.max_capture_size = capture_sizes, max_capture_size  # vLLM's, in tokens (graph_sizes)
        self.max_tokens = max(max_batch, self.verify_batch * self.max_queries)
        # Flat layout: per-token fields (max_tokens each), per-request fields (max_batch each), tables.
        self._requests_at = len(_TOKEN_FIELDS) * self.max_tokens
        self._tables_at = self._requests_at + len(_REQUEST_FIELDS) * max_batch
        total = self._tables_at + max_batch * max_blocks_per_seq
        self.host = torch.zeros(total, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        # The last upload from `host`: a step planned ahead stages its inputs while the step before
        # may not have read them yet (the copy waits in the stream), so staging waits for it.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.inputs = torch.zeros(total, dtype=torch.long, device=device)
        rows = torch.arange(max_batch + 1, device=device)  # [max_batch + 1]
        self._qsl = {q: rows * q for q in range(1, self.max_queries + 1)}  # query_start_loc per Q
        self._token_req = {q: rows[:-1].repeat_interleave(q) for q in range(1, self.max_queries + 1)}  # [max_batch*Q]
        pools = [t for m in model.state_modules() for t in m.state_tensors()]
        self.buffers = None
        rows = verify_state_rows(max_batch, num_speculative_tokens, capture_sizes, max_capture_size)
        if pools and rows > 0:  # as many rows as the largest graph of Q > 1 writes
            self.buffers = CaptureBuffers(pools, rows)
        self.hidden_out: torch.Tensor | None = None  # [max_tokens, H], allocated at the first warm-up
        self.logits_out: torch.Tensor | None = None  # [max_tokens, V] float32
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self._captures: dict[tuple[int, int], StateCapture] = {}
        self.pool = None
        self.stream: torch.cuda.Stream | None = None  # the capture stream (CUDA)

    # ---- buffers ---------------------------------------------------------------------------
    def _token_field(self, buffer, name: str, count: int):
        start = _TOKEN_FIELDS.index(name) * self.max_tokens
        return buffer[start : start + count]

    def _request_field(self, buffer, name: str, count: int):
        start = self._requests_at + _REQUEST_FIELDS.index(name) * self.max_batch
        return buffer[start : start + count]

    def _tables(self, buffer, count: int):
        return buffer[self._tables_at : self._tables_at + count * self.max_blocks].reshape(count, self.max_blocks)

    def _capture_for(self, queries: int, size: int) -> StateCapture | None:
        """The StateCapture a graph of (queries, size) is built with: every request keeps tokens
        0..Q-2, written into the persistent buffers."""
        if queries == 1:
            return None
        if (queries, size) not in self._captures:
            req = [b for b in range(size) for _ in range(queries - 1)]
            offset = list(range(queries - 1)) * size
            self._captures[(queries, size)] = StateCapture.from_host(req, offset, self.device, buffers=self.buffers)
        return self._captures[(queries, size)]

    def _meta(self, queries: int, size: int, capture: StateCapture | None, max_seq_len: int | None = None):
        """Views of the device buffer for `size` requests of `queries` tokens (built inside the
        captured region, so the `keep` -> bool conversion is part of the graph)."""
        buf, tokens = self.inputs, size * queries
        meta = ForwardMetadata(
            num_tokens=tokens, num_reqs=size, max_query_len=queries,
            max_seq_len=max_seq_len if max_seq_len is not None else self.max_blocks * self.block_size,
            positions=self._token_field(buf, "positions", tokens), query_start_loc=self._qsl[queries][: size + 1],
            seq_lens=self._request_field(buf, "seq_lens", size), slot_mapping=self._token_field(buf, "slot_mapping", tokens),
            block_tables=self._tables(buf, size), state_slots=self._request_field(buf, "state_slots", size),
            has_initial_state=self._request_field(buf, "keep", size) != 0,
            token_request_index=self._token_req[queries][:tokens], state_capture=capture, allow_groups=False,
        )
        return self._token_field(buf, "token_ids", tokens), meta

    def _fill_padding(self, queries: int, start: int, stop: int) -> None:
        """Requests start..stop-1 of the host buffer become padding rows."""
        host = self.host_np
        tokens = self._token_field(host, "token_ids", stop * queries)
        tokens[start * queries :] = 0
        positions = self._token_field(host, "positions", stop * queries)
        positions[start * queries :] = np.tile(np.arange(queries), stop - start)
        self._token_field(host, "slot_mapping", stop * queries)[start * queries :] = -1
        self._request_field(host, "seq_lens", stop)[start:] = queries
        self._request_field(host, "state_slots", stop)[start:] = self.spare_state_slot if queries == 1 else -1
        self._request_field(host, "keep", stop)[start:] = 0
        self._tables(host, stop)[start:] = 0

    # ---- capture -----------------------------------------------------------------------------
    def sizes(self, queries: int) -> list[int]:
        batch = self.max_batch if queries == 1 else self.verify_batch
        return graph_sizes(batch, queries, self.capture_sizes, self.max_capture_size) if batch > 0 else []

    @torch.inference_mode()
    def capture(self) -> None:
        """Every (Q, size), largest first so that smaller graphs reuse the memory pool. Off CUDA
        (tests on the CPU) nothing is captured: `run` executes the same static-buffer forward
        eagerly, so packing, padding and the persistent outputs are tested without a GPU."""
        keys = sorted(((q, s) for q in range(1, self.max_queries + 1) for s in self.sizes(q)),
                      key=lambda qs: (qs[0] * qs[1], qs[0]), reverse=True)
        if not keys:  # no capture size holds a request (vLLM's cudagraph_capture_sizes): every step runs eagerly
            logger.info("MTP graphs: none captured (no capture size holds a step of Q = 1..%d tokens a request)",
                        self.max_queries)
            return
        if self.device.type != "cuda":
            self._fill_padding(keys[0][0], 0, keys[0][1])
            self.inputs.copy_(self.host)
            self._forward(*keys[0])  # allocates the output buffers
            self.graphs = {key: None for key in keys}
            self._warm_fill()
            return
        stream = self.stream = torch.cuda.Stream(self.device)  # the MTP engine's prefill graphs capture on it too
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for queries, size in keys:
                self._fill_padding(queries, 0, size)
                self.inputs.copy_(self.host)
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    self._forward(queries, size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self._forward(queries, size)
                self.pool = graph.pool()
                self.graphs[(queries, size)] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._warm_fill()
        torch.cuda.synchronize(self.device)
        logger.info(
            "MTP graphs: %d captured (Q = 1..%d; verify graphs up to batch %d), state capture buffers %.2f GiB, "
            "output buffers %.2f GiB", len(self.graphs), self.max_queries, self.verify_batch,
            (self.buffers.nbytes if self.buffers is not None else 0) / 2**30,
            (self.hidden_out.numel() * self.hidden_out.element_size() + self.logits_out.numel() * 4) / 2**30,
        )

    @graph_forward()  # warm-up, capture and static stand-in take the captured kernels' paths
    def _forward(self, queries: int, size: int) -> None:
        token_ids, meta = self._meta(queries, size, self._capture_for(queries, size))
        hidden = self.model(token_ids, meta, None)  # [size*Q, H]
        rows = size * queries
        if self.hidden_out is None:  # first warm-up, outside any graph
            self.hidden_out = torch.empty((self.max_tokens, hidden.shape[-1]), dtype=hidden.dtype, device=self.device)
            vocab = self.model.compute_logits(hidden[:1]).shape[-1]
            self.logits_out = torch.empty((self.max_tokens, vocab), dtype=torch.float32, device=self.device)
        self.hidden_out[:rows].copy_(hidden)
        self.model.compute_logits(hidden, out=self.logits_out[:rows])

    # ---- replay ------------------------------------------------------------------------------
    def queries_for(self, chunks) -> int | None:
        """Q when the step can replay a graph: every chunk samples, verifies Q - 1 drafts (Q
        tokens), scores no prompt position, and the batch fits a captured size."""
        if not chunks:
            return None
        queries = chunks[0].num_tokens
        if not 1 <= queries <= self.max_queries or self.size_for(queries, len(chunks)) is None:
            return None
        if all(c.num_tokens == queries and c.num_draft_tokens == queries - 1 and c.sample and not c.num_prompt_tokens
               for c in chunks):
            return queries
        return None

    def size_for(self, queries: int, num_reqs: int) -> int | None:
        fitting = [s for (q, s) in self.graphs if q == queries and s >= num_reqs]
        return min(fitting) if fitting else None

    def stage(self, chunks, queries: int, size: int) -> None:
        """Write a step of `len(chunks)` requests of `queries` tokens into the pinned host buffer,
        padded to `size` rows. Unless the step is planned ahead (asynchronous scheduling) this is
        host time the device waits for: each field is built as one Python list and written with
        one numpy assignment (the block tables row by row), with no numpy work per request."""
        num_reqs = len(chunks)
        host = self.host_np
        bs = self.block_size
        ragged = next((c for c in chunks if c.num_tokens != queries), None)
        if ragged is not None:
            raise ValueError(f"request {ragged.request_id!r}: {ragged.num_tokens} tokens in a step of {queries} a request")
        try:
            slots = [table[p // bs] * bs + p % bs for c in chunks for table in (c.block_table,)
                     for p in range(c.start_position, c.start_position + queries)]  # [B*Q]
        except IndexError:
            late = next(c for c in chunks if (c.start_position + queries - 1) // bs >= len(c.block_table))
            raise RuntimeError(
                f"request {late.request_id!r}: position {late.start_position + queries - 1} lies past its "
                f"{len(late.block_table)} KV blocks of {bs} (the scheduler allocates them first)"
            ) from None
        flat = num_reqs * queries
        self._token_field(host, "token_ids", flat)[:] = [t for c in chunks for t in c.token_ids]
        self._token_field(host, "positions", flat)[:] = [
            p for c in chunks for p in range(c.start_position, c.start_position + queries)]
        self._token_field(host, "slot_mapping", flat)[:] = slots
        self._request_field(host, "seq_lens", num_reqs)[:] = [c.start_position + queries for c in chunks]
        self._request_field(host, "state_slots", num_reqs)[:] = [c.state_slot for c in chunks]
        self._request_field(host, "keep", num_reqs)[:] = [c.start_position > 0 for c in chunks]
        tables = self._tables(host, size)
        for row, chunk in enumerate(chunks):
            tables[row, : len(chunk.block_table)] = chunk.block_table
        self._fill_padding(queries, num_reqs, size)

    def run(self, chunks, queries: int, capture: StateCapture | None, previous: PreviousVerify | None = None):
        """Replay (queries, padded size) for a step of `len(chunks)` requests of `queries` tokens.
        `capture`: the step's StateCapture (spec_step.capture_for, built on `self.buffers`): its
        kept states become the capture buffers. `previous`: the last launched step's results on
        the device, for chunks whose tokens are pending (asynchronous scheduling). Returns
        (hidden [B*Q, H], logits [B*Q, V], token ids [B*Q], the step's metadata for B requests,
        views of persistent buffers, and the position shift [B] of the pending chunks or None)."""
        num_reqs = len(chunks)
        size = self.size_for(queries, num_reqs)
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self.stage(chunks, queries, size)
        source_rows = previous.source_rows(chunks) if previous is not None else None
        if source_rows is not None:  # travels with the step's inputs
            self._request_field(self.host_np, "source_rows", num_reqs)[:] = source_rows
        used = self._tables_at + size * self.max_blocks  # the fields and `size` table rows, not all max_batch
        self.inputs[:used].copy_(self.host[:used], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        shift = None
        if source_rows is not None:
            shift = self._fill_pending(num_reqs, queries, previous)
        graph = self.graphs[(queries, size)]
        if graph is None:
            self._forward(queries, size)
        else:
            graph.replay()
        if capture is not None:  # what the layers wrote into the persistent rows (none without state pools)
            capture.kept = self.buffers.kept() if self.buffers is not None else []
        max_seq_len = max(c.end_position for c in chunks)
        token_ids, meta = self._meta(queries, num_reqs, capture, max_seq_len)
        rows = num_reqs * queries
        return self.hidden_out[:rows], self.logits_out[:rows], token_ids, meta, shift

    def _warm_fill(self) -> None:
        """Run the fill once per Q with nothing pending (source row -1: it writes nothing but a
        zero shift), on the real input buffers and a previous step of K drafts, so that the first
        step planned ahead finds its kernel compiled (Triton specialises on Q and the strides)."""
        if self.max_queries < 2:
            return
        drafts = self.max_queries - 1
        previous = PreviousVerify({}, torch.zeros(1, dtype=torch.long, device=self.device),
                                  torch.zeros((1, drafts), dtype=torch.long, device=self.device),
                                  torch.zeros(1, dtype=torch.long, device=self.device))
        for queries in range(1, self.max_queries + 1):
            self._request_field(self.inputs, "source_rows", 1).fill_(-1)
            self._fill_pending(1, queries, previous)

    def _fill_pending(self, num_reqs: int, queries: int, previous: PreviousVerify):
        """On the device, after the upload: the tokens of pending chunks (the staged `source_rows`
        field: the chunk's row in `previous`, -1 where nothing is pending) become the previous
        step's target token and drafts, and their positions, context lengths and KV slots move
        back by the drafts it rejected (the plan assumed every draft accepted; its block tables
        cover that). Returns the shift [B] (0 where nothing is pending)."""
        buf, tokens = self.inputs, num_reqs * queries
        return self._fill(
            self._token_field(buf, "token_ids", tokens).view(num_reqs, queries),  # [B, Q]
            self._token_field(buf, "positions", tokens).view(num_reqs, queries),  # [B, Q]
            self._request_field(buf, "seq_lens", num_reqs),  # [B]
            self._token_field(buf, "slot_mapping", tokens).view(num_reqs, queries),  # [B, Q]
            self._tables(buf, num_reqs),  # [B, M]
            self._request_field(buf, "source_rows", num_reqs),  # [B]
            previous.bonus, previous.drafts, previous.rejected, self.block_size,
        )
