"""CUDA graphs of the one-token decode step (model forward and LM head), by padded batch size.

A decode step of B requests runs as the graph captured for the smallest capture size Bc >= B.
Its inputs live in one persistent device buffer of int64 fields (token ids, positions, KV slots,
context lengths, state slots, whether the state carries over, block tables, token history), each
field holding `max_batch` rows; a step writes its rows into a pinned host copy of that buffer
and uploads it with one copy, then replays. Rows B..Bc-1 are padding: no KV write (slot -1),
context length 1, a spare state slot that no request owns, fresh state.

Capturable because the decode forward on the Triton kernel set (lamina.kernels.selection) reads
metadata only from device tensors and host ints that are fixed per capture size (`num_tokens`,
`num_reqs`, `max_query_len` = 1, `max_seq_len` = the block tables' capacity): the kernels loop to
each request's `seq_len` on the device. Qwen4-Exp's QSA indexed attention scores the blocks of
that capacity and attends to its selection (lamina.kernels.qsa_decode); its N-gram PLE hashes
the windows of the token-history field on the device. Models whose decode needs host work (a PLE
table in host memory) are not captured and run eagerly (`why_not_capturable` says why).
"""

from __future__ import annotations

import torch

from lamina.kernels.graph_forward import graph_forward
from lamina.layers.metadata import ForwardMetadata

# `pending_row`: asynchronous scheduling, the row of the last step's sampled ids that holds this
# row's token (-1: the token id is in `token_ids`); used before the replay, not by the graph.
_FIELDS = ("token_ids", "positions", "slot_mapping", "seq_lens", "state_slots", "keep", "pending_row")


MULTIRANK_GRAPHS_ENV = "LAMINA_MULTIRANK_GRAPHS"


def multirank_graphs_reason(plan, *, speculative: bool) -> str | None:
    """Why the ranks of a multi-rank layout (`lamina.parallel.plan.ParallelPlan`) do not capture
    decode graphs, or None when each rank captures its own (its TP collectives inside the graph).
    Captured: TP and PP (each stage its graphs; the stream crosses stages between replays through
    the next stage's static input buffer), data-parallel replicas of them (each replica replays its
    own plan's batch size: without EP no collective crosses replicas), and expert parallelism (its
    MoE gathers the replicas' rows padded to the largest and reduce-scatters them back: fixed shapes,
    so captured, with every replica replaying one common size in lockstep, `replay_size`), and
    sequence-parallel MoE in one stage (each TP rank's shard of the padded batch); not SP across
    pipeline stages. With MTP (`speculative`) every rank of one stage captures the verification
    graphs (lamina.worker.verify_graphs; TP and DP, without EP): not across stages, with SP or with
    EP. Opt-in while no run on several GPUs has checked it:
    `LAMINA_MULTIRANK_GRAPHS=1` (read when the engine starts)."""
    import os

    wanted = os.environ.get(MULTIRANK_GRAPHS_ENV, "0")
    if wanted not in ("0", "1"):
        raise ValueError(f"{MULTIRANK_GRAPHS_ENV} = {wanted!r} must be 0 or 1")
    if wanted == "0":
        return f"multi-rank decode graphs are opt-in ({MULTIRANK_GRAPHS_ENV}=1) until checked on several GPUs"
    if plan.sp and plan.pp > 1:
        # a stage's output stream is its token shard of the padded batch, not of the real rows
        return "sequence-parallel MoE across pipeline stages: decode runs eagerly"
    if speculative and plan.pp > 1:
        return "speculative decoding across pipeline stages: verification runs eagerly"
    if speculative and plan.sp:
        return "speculative decoding with sequence-parallel MoE: verification runs eagerly"
    if speculative and plan.ep_enabled:
        return "speculative decoding with expert parallelism: verification runs eagerly"
    return None


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM-style sizes: 1, 2, 4, then multiples of 8 up to 64, of 16 up to 256, of 32 beyond; and
    `max_batch` itself."""
    sizes = [1, 2, 4]
    size = 8
    while size < max_batch:
        sizes.append(size)
        size += 8 if size < 64 else 16 if size < 256 else 32
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def graph_sizes(max_batch: int, tokens_per_request: int = 1, sizes: tuple[int, ...] | None = None,
                max_size: int | None = None) -> list[int]:
    """Request counts to capture for steps of `tokens_per_request` (Q) tokens a request, none above
    `max_batch`. vLLM's compilation_config counts tokens: each of `sizes` (cudagraph_capture_sizes)
    holds size // Q requests (max_batch where that is more: vLLM pads such a batch into its larger
    graph); with only `max_size` (max_cudagraph_capture_size) the default sizes up to max_size // Q
    requests; with neither, `capture_sizes(max_batch)`."""
    if sizes is not None:  # a size holding more than max_batch requests serves max_batch (its buffers hold no more)
        return sorted({min(s // tokens_per_request, max_batch) for s in sizes if s // tokens_per_request >= 1 and max_batch >= 1})
    top = max_batch if max_size is None else min(max_batch, max_size // tokens_per_request)
    return capture_sizes(top) if top > 0 else []


def graph_token_limit(sizes: tuple[int, ...] | None, max_size: int | None) -> int | None:
    """The most tokens a graph may hold under vLLM's capture sizes (None: no limit asked)."""
    return max(sizes) if sizes else max_size


def why_not_capturable(model, *, verify: bool = False) -> str | None:
    """Why the model's one-token decode step cannot be captured, or None when every part of it is
    graph-safe: all layers on the Triton kernel set; attention plain gated or QSA indexed (whose
    one-token decode on the Triton set has fixed shapes, lamina.kernels.qsa_decode); PLE tables
    (Qwen4-Exp) on the compute device (the n-gram windows and hashes are tensor ops on the
    static buffer's history field, the table gather an index_select; a host table needs its
    row ids on the host every step, so those models decode eagerly). Hyper-connections are plain
    per-token torch ops. `verify`: for MTP verification graphs (Q = K + 1 tokens per request,
    lamina.worker.verify_graphs), whose buffers carry no token history and whose steps have no
    graph-safe QSA path: only models without either."""
    from lamina.layers.attention import GatedAttention
    from lamina.layers.indexed_attention import IndexedGatedAttention
    from lamina.layers.ple import NGramHashEmbedding

    kernels = {m.kernels for m in model.modules() if hasattr(m, "kernels")}
    if kernels != {"triton"}:
        return f"decode graphs need every layer on the Triton kernel set, not {sorted(kernels)}"
    graph_safe_attention = (GatedAttention,) if verify else (GatedAttention, IndexedGatedAttention)
    if verify and getattr(model, "token_history_len", 0) > 0:
        return "verification graphs carry no token history (N-gram PLE): verification steps run eagerly"
    for name, module in model.named_modules():
        if isinstance(module, GatedAttention) and type(module) not in graph_safe_attention:
            return f"attention {name} ({type(module).__name__}) has no graph-safe decode"
        if isinstance(module, IndexedGatedAttention) and not module.fixed_shape_decode:
            return f"attention {name}: QSA's fixed-shape decode is off (LAMINA_QSA_DECODE=0; unset it to capture)"
        if isinstance(module, NGramHashEmbedding) and module.host_table:
            return (f"the PLE table of {name} lives in host memory (ple_table_device=cpu, or auto with too little "
                    f"GPU memory): its rows are gathered on the host every step; use ple_table_device=gpu")
    return None


def model_is_capturable(model, *, verify: bool = False) -> bool:
    """Every kernel of the model's decode (or `verify`: MTP verification) step is graph-safe
    (see `why_not_capturable`)."""
    return why_not_capturable(model, verify=verify) is None


class DecodeGraphs:
    def __init__(
        self, model, *, device: torch.device, max_batch: int, block_size: int, max_blocks_per_seq: int,
        spare_state_slot: int,
    ):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_seq
        self.spare_state_slot = spare_state_slot
        self.history_len = getattr(model, "token_history_len", 0)
        # Flat layout: the per-request fields, then block tables [max_batch, max_blocks], then history.
        self._field_size = max_batch
        self._tables_at = len(_FIELDS) * max_batch
        self._history_at = self._tables_at + max_batch * max_blocks_per_seq
        total = self._history_at + max_batch * self.history_len
        self.host = torch.empty(total, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.inputs = torch.empty(total, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.long, device=device)
        # Pipeline stages after the first take the previous stage's stream in a static buffer;
        # stages before the last return their output stream instead of logits.
        self.first_stage = getattr(model, "is_first_stage", True)
        self.last_stage = getattr(model, "is_last_stage", True)
        self.stream_in = None
        if not self.first_stage:
            self.stream_in = torch.zeros(max_batch, model.stream_width(), dtype=model.dtype, device=device)  # [B, W]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.stream = None  # the stream the graphs were captured on (later captures into the pool reuse it)
        # Asynchronous scheduling writes the next step's rows while this one may still be queued:
        # the host buffer is rewritten only once its last upload has run.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    # ---- buffers ---------------------------------------------------------------------------
    def _field(self, buffer, name: str, rows: int):
        start = _FIELDS.index(name) * self._field_size
        return buffer[start : start + rows]

    def _tables(self, buffer, rows: int):
        return buffer[self._tables_at : self._tables_at + rows * self.max_blocks].reshape(rows, self.max_blocks)

    def _history(self, buffer, rows: int):
        return buffer[self._history_at : self._history_at + rows * self.history_len].reshape(rows, self.history_len)

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows start..stop-1 of the host buffer become padding rows."""
        host = self.host_np
        for name, value in (("token_ids", 0), ("positions", 0), ("slot_mapping", -1), ("seq_lens", 1),
                            ("state_slots", self.spare_state_slot), ("keep", 0), ("pending_row", -1)):
            self._field(host, name, stop)[start:] = value
        self._tables(host, stop)[start:] = 0
        if self.history_len:
            self._history(host, stop)[start:] = -1

    def _upload(self, size: int) -> None:
        """The rows a graph of `size` reads (the fields, `size` block-table rows, `size` history rows),
        not the whole buffer: a table row is ceil(max_model_len / block_size) entries wide, so at
        max_num_seqs 256 and a 262k-token max_model_len the tables alone are 33.5 MB."""
        used = self._tables_at + size * self.max_blocks
        self.inputs[:used].copy_(self.host[:used], non_blocking=True)
        if self.history_len:
            start, stop = self._history_at, self._history_at + size * self.history_len
            self.inputs[start:stop].copy_(self.host[start:stop], non_blocking=True)

    def _meta(self, size: int) -> tuple[torch.Tensor, ForwardMetadata]:
        """Views of the device buffer for capture size `size` (built inside the captured region, so
        the `keep` -> bool conversion is part of the graph)."""
        buf = self.inputs
        meta = ForwardMetadata(
            num_tokens=size, num_reqs=size, max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            positions=self._field(buf, "positions", size), query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self._field(buf, "seq_lens", size), slot_mapping=self._field(buf, "slot_mapping", size),
            block_tables=self._tables(buf, size), state_slots=self._field(buf, "state_slots", size),
            has_initial_state=self._field(buf, "keep", size) != 0,
            history_token_ids=self._history(buf, size) if self.history_len else None,
            token_request_index=self.query_start_loc[:size],
        )
        return self._field(buf, "token_ids", size), meta

    # ---- capture -----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """Capture the largest size first so the smaller graphs reuse its memory pool. Off CUDA
        (tests on the CPU) nothing is captured: `run` then executes the same static-buffer forward
        eagerly, so the packing and padding are tested where there is no GPU."""
        self._fill_padding(0, self.max_batch)
        self.inputs.copy_(self.host)
        if self.device.type != "cuda":
            self.graphs = {size: (None, None) for size in sizes}
            return
        stream = self.stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in sorted(sizes, reverse=True):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    logits = self._forward(size)
                self.pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    @graph_forward()  # warm-up, capture and static stand-in take the captured kernels' paths
    def _forward(self, size: int) -> torch.Tensor:
        token_ids, meta = self._meta(size)
        hidden = self.model(token_ids, meta, None if self.first_stage else self.stream_in[:size])
        if not self.last_stage:
            return hidden  # [size, W]: the next stage's input
        return self.model.compute_logits(hidden)  # [size, vocab] float32

    # ---- replay ------------------------------------------------------------------------------
    def size_for(self, num_reqs: int) -> int | None:
        fitting = [s for s in self.graphs if s >= num_reqs]
        return min(fitting) if fitting else None

    def run(self, chunks, previous=None, stream_in: torch.Tensor | None = None, size: int | None = None) -> torch.Tensor:
        """Logits `[B, vocab]` of a decode step whose chunks each hold one token (a stage before
        the last: its output stream `[B, W]`; a stage after the first reads the previous stage's
        `stream_in [B, W]`). A pending token (asynchronous scheduling) is taken from `previous`
        (`PreviousTokens`) on the device. `size`: the captured size to replay (default: the
        smallest that fits; expert parallelism replays every replica's at one size, `replay_size`),
        B of them padding rows when there are no chunks."""
        num_reqs = len(chunks)
        size = size if size is not None else self.size_for(num_reqs)
        if size not in self.graphs or size < num_reqs:
            raise ValueError(f"no captured decode graph of size {size} for {num_reqs} requests (captured: {sorted(self.graphs)})")
        pending_rows = previous.source_rows(chunks, positions_per_chunk=True) if previous is not None and chunks else None
        if self._uploaded is not None:
            self._uploaded.synchronize()
        host = self.host_np
        fields = {name: self._field(host, name, size) for name in _FIELDS}
        tables = self._tables(host, size)
        for row, chunk in enumerate(chunks):
            position = chunk.start_position
            table = chunk.block_table
            fields["token_ids"][row] = chunk.token_ids[0]
            fields["positions"][row] = position
            fields["slot_mapping"][row] = table[position // self.block_size] * self.block_size + position % self.block_size
            fields["seq_lens"][row] = position + 1
            fields["state_slots"][row] = chunk.state_slot
            fields["keep"][row] = position > 0
            tables[row, : len(table)] = table
            if self.history_len:
                history = chunk.history_token_ids[-self.history_len :]
                self._history(host, size)[row] = [-1] * (self.history_len - len(history)) + list(history)
        self._fill_padding(num_reqs, size)
        if pending_rows is not None:
            fields["pending_row"][:num_reqs] = pending_rows
        self._upload(size)
        if self._uploaded is not None:
            self._uploaded.record()
        if pending_rows is not None:
            previous.fill(self._field(self.inputs, "token_ids", num_reqs), self._field(self.inputs, "pending_row", num_reqs))
        if self.stream_in is not None and num_reqs:
            self.stream_in[:num_reqs].copy_(stream_in)  # padding rows keep what they held: their own rows only
        graph, logits = self.graphs[size]
        if graph is None:
            logits = self._forward(size)
        else:
            graph.replay()
        return logits[:num_reqs]


def replay_size(graphs: DecodeGraphs | None, plans, replica: int, lockstep: bool) -> int | None:
    """The graph size a rank of data-parallel `replica` replays this step (`plans`: every
    replica's), or None when the step runs eagerly. Without `lockstep` a replica's own plan decides.
    With it (expert parallelism across replicas: the MoE gathers every replica's rows, so their
    collectives must have one shape) every rank decides the same from all plans: each a plain decode
    or empty, not all empty, and one size that fits the largest; an empty replica replays padding."""
    if graphs is None:
        return None
    if not lockstep:
        chunks = plans[replica].chunks
        return graphs.size_for(len(chunks)) if can_replay(graphs, chunks) else None
    if all(p.is_empty for p in plans) or not all(p.is_empty or can_replay(graphs, p.chunks) for p in plans):
        return None
    return graphs.size_for(max(len(p.chunks) for p in plans))


def can_replay(graphs: DecodeGraphs | None, chunks) -> bool:
    """A plain decode step that fits a captured size: one sampled token per request, and no
    prompt positions to score (prompt logprobs need the hidden states, which the graph keeps)."""
    return (
        graphs is not None and bool(chunks) and graphs.size_for(len(chunks)) is not None
        and all(c.num_tokens == 1 and c.sample and not c.num_prompt_tokens for c in chunks)
    )

