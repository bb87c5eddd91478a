"""CUDA graphs of the MTP drafter's passes after a verification step replayed from its graph.

After the target's verification (lamina.worker.verify_graphs) the drafter runs (see
lamina.worker.proposer): a first pass over all B*Q rows of the step, the LM head at each
request's last accepted row for draft 1, then for K > 1 one-token passes, each followed by the
LM head. Eagerly those are ~40 launches a pass from Python and the LM head, ~1-2 ms of host
time a pass at batch 1; here each is one graph replay:

- `first[(Q, Bc)]`: the drafter's tokens (the step's tokens shifted by one, each request's bonus
  token at its last accepted row), the first pass over the verification graph's rows with its
  metadata (the Q-token kernels, as the eager pass), and the accepted rows' outputs gathered
  into `h_logits` / `h_next` `[Bc, H]`;
- `head[Bc]`: the LM head on `h_logits` into `logits` `[Bc, V]` (float32), for draft 1;
- `step[(j, Bc)]`, j = 1..K-1: pass j on the sampled drafts `tokens` `[Bc]` and `h_next`, at
  position last accepted + j (clamped to the request's blocks), then the LM head.

Sampling the drafts stays eager (seeded generators, per-request parameters) between replays.
Per-request inputs live in one persistent int64 buffer: the accepted row and bonus token (copied
on the device from verification's result), the last accepted position (likewise), the last
position the request's blocks hold, and whether the row is a request (padding rows write no KV:
slot -1). Graphs of a batch size share the verification graphs' metadata views and memory pool.
Off CUDA (tests on the CPU) nothing is captured and `run_*` execute the same static-buffer code
eagerly, so packing and padding are tested without a GPU.
"""

from __future__ import annotations

import os

import torch

from lamina.layers.metadata import ForwardMetadata

_FIELDS = ("bonus_rows", "bonus_tokens", "last_pos", "capacity", "valid", "tokens")
DRAFT_GRAPHS_ENV = "LAMINA_DRAFT_GRAPHS"


def draft_graphs_enabled() -> bool:
    """Whether the drafter's passes are captured beside the verification graphs:
    `LAMINA_DRAFT_GRAPHS=1` (the default) or 0 (eager drafts, for comparison)."""
    import os

    wanted = os.environ.get(DRAFT_GRAPHS_ENV, "1")
    if wanted not in ("0", "1"):
        raise ValueError(f"{DRAFT_GRAPHS_ENV} = {wanted!r} must be 0 or 1")
    return wanted == "1"


class DraftGraphs:
    def __init__(self, verify, mtp, num_speculative_tokens: int):
        self.verify = verify  # lamina.worker.verify_graphs.VerifyGraphs, already captured
        self.mtp = mtp
        self.device = verify.device
        self.num_passes = num_speculative_tokens
        self.max_batch = verify.verify_batch if verify.max_queries > 1 else verify.max_batch
        self.host = torch.zeros(len(_FIELDS) * self.max_batch, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.host_np = self.host.numpy()
        self.inputs = torch.zeros_like(self.host, device=self.device)
        hidden = verify.hidden_out.shape[-1]
        self.h_logits = torch.zeros((self.max_batch, hidden), dtype=verify.hidden_out.dtype, device=self.device)
        self.h_next = torch.zeros_like(self.h_logits)
        self.logits = torch.zeros((self.max_batch, verify.logits_out.shape[-1]), dtype=torch.float32, device=self.device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}

    def _field(self, buffer, name: str, count: int):
        start = _FIELDS.index(name) * self.max_batch
        return buffer[start : start + count]

    # ---- the captured bodies ------------------------------------------------------------------
    def _first(self, queries: int, size: int) -> None:
        verify = self.verify
        rows = size * queries
        token_ids, meta = verify._meta(queries, size, verify._capture_for(queries, size))  # the verify step's views
        next_ids = torch.zeros_like(token_ids)  # [Bc*Q]
        next_ids[:-1] = token_ids[1:]
        bonus_rows = self._field(self.inputs, "bonus_rows", size)  # [Bc]
        next_ids.index_copy_(0, bonus_rows, self._field(self.inputs, "bonus_tokens", size))
        target = self.mtp.target_hidden(verify.hidden_out[:rows], meta)  # [Bc*Q, H]
        h_logits, h_next = self.mtp(next_ids, target, meta, 0)  # [Bc*Q, H] each
        self.h_logits[:size].copy_(h_logits.index_select(0, bonus_rows))
        self.h_next[:size].copy_(h_next.index_select(0, bonus_rows))

    def _head(self, size: int) -> None:
        self.mtp.compute_logits(self.h_logits[:size], out=self.logits[:size])

    def _step(self, step: int, size: int) -> None:
        meta = self._draft_meta(step, size)
        h_logits, h_next = self.mtp(self._field(self.inputs, "tokens", size), self.h_next[:size], meta, step)
        self.h_next[:size].copy_(h_next)
        self.mtp.compute_logits(h_logits, out=self.logits[:size])

    def _draft_meta(self, step: int, size: int) -> ForwardMetadata:
        """One token per request at its last accepted position + `step`, clamped to its blocks
        (lamina.worker.proposer.MTPProposer.draft_meta, from the persistent buffers)."""
        verify = self.verify
        buf = self.inputs
        positions = torch.minimum(self._field(buf, "last_pos", size) + step, self._field(buf, "capacity", size))  # [Bc]
        tables = verify._tables(verify.inputs, size)  # [Bc, max_blocks]
        block_size = verify.block_size
        blocks = tables.gather(1, (positions // block_size)[:, None])[:, 0]  # [Bc]
        slots = torch.where(self._field(buf, "valid", size) != 0, blocks * block_size + positions % block_size, -1)
        rows = torch.arange(size + 1, device=self.device)  # [Bc + 1]
        return ForwardMetadata(
            num_tokens=size, num_reqs=size, max_query_len=1, max_seq_len=verify.max_blocks * block_size,
            positions=positions, query_start_loc=rows, seq_lens=positions + 1, slot_mapping=slots,
            block_tables=tables, state_slots=verify._request_field(verify.inputs, "state_slots", size),
            has_initial_state=torch.ones(size, dtype=torch.bool, device=self.device),
            token_request_index=rows[:-1], allow_groups=False,
        )

    # ---- capture -------------------------------------------------------------------------------
    def _keys(self) -> list[tuple]:
        verify = self.verify
        keys = [("first", q, s) for q in range(1, verify.max_queries + 1) for s in verify.sizes(q)]
        sizes = sorted({s for q in range(1, verify.max_queries + 1) for s in verify.sizes(q)})
        keys += [("head", 0, s) for s in sizes]
        keys += [("step", j, s) for j in range(1, self.num_passes) for s in sizes]
        return sorted(keys, key=lambda k: (k[2] * max(k[1], 1), k[0]), reverse=True)

    def _body(self, key: tuple) -> None:
        kind, index, size = key
        if kind == "first":
            self._first(index, size)
        elif kind == "head":
            self._head(size)
        else:
            self._step(index, size)

    def _padding_inputs(self, queries: int, start: int, stop: int) -> None:
        """Requests start..stop-1 of the host buffer become padding rows (no KV write)."""
        host = self.host_np
        self._field(host, "bonus_rows", stop)[start:] = [b * queries + queries - 1 for b in range(start, stop)]
        for name in ("bonus_tokens", "last_pos", "capacity", "valid", "tokens"):
            self._field(host, name, stop)[start:] = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Every graph, largest first, in the verification graphs' memory pool (their inputs left
        as padding by the capture). Off CUDA nothing is captured (see the module docstring)."""
        keys = self._keys()
        verify = self.verify
        if self.device.type != "cuda":
            self.graphs = {key: None for key in keys}
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for key in keys:
                queries = key[1] if key[0] == "first" else 1
                verify._fill_padding(queries, 0, key[2])
                verify.inputs.copy_(verify.host)
                self._padding_inputs(queries, 0, key[2])
                self.inputs.copy_(self.host)
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    self._body(key)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=verify.pool, stream=stream):
                    self._body(key)
                verify.pool = graph.pool()
                self.graphs[key] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    # ---- replay --------------------------------------------------------------------------------
    def _replay(self, key: tuple) -> None:
        graph = self.graphs[key]
        if graph is None:
            self._body(key)
        else:
            graph.replay()

    def first_pass(
        self, queries: int, num_reqs: int, bonus_rows: torch.Tensor, bonus_tokens: torch.Tensor,
        last_pos: torch.Tensor, capacity: list[int],
    ) -> None:
        """After the verification graph of (queries, size for `num_reqs`) replayed: the first pass.
        `bonus_rows`, `bonus_tokens`, `last_pos` [B] on the device; `capacity` [B] on the host."""
        size = self.verify.size_for(queries, num_reqs)
        self._padding_inputs(queries, num_reqs, size)
        self._field(self.host_np, "capacity", size)[:num_reqs] = capacity
        self._field(self.host_np, "valid", size)[:num_reqs] = 1
        self.inputs.copy_(self.host, non_blocking=True)
        self._field(self.inputs, "bonus_rows", num_reqs).copy_(bonus_rows)
        self._field(self.inputs, "bonus_tokens", num_reqs).copy_(bonus_tokens)
        self._field(self.inputs, "last_pos", num_reqs).copy_(last_pos)
        self._size = size
        self._replay(("first", queries, size))

    def draft_logits(self, step: int, num_reqs: int, tokens: torch.Tensor | None) -> torch.Tensor:
        """Logits [B, V] of draft `step` + 1: step 0 the LM head on the first pass's output; step
        j > 0 pass j on the drafts `tokens` [B] just sampled, then the LM head."""
        size = self._size
        if step == 0:
            self._replay(("head", 0, size))
        else:
            self._field(self.inputs, "tokens", num_reqs).copy_(tokens)
            self._replay(("step", step, size))
        return self.logits[:num_reqs]
