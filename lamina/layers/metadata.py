"""Per-step tensor metadata every layer reads: the flat batch's description, and under
speculative verification the step's `StateCapture` (how it is used: lamina.layers.spec_state).

Built by the worker from a step plan; never inferred from activation shapes. Host ints
(`num_tokens`, `max_query_len`, `max_seq_len`) come from the plan, not from tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lamina.host_to_device import to_device_many


@dataclass
class StateCapture:
    """One verification step's captured tokens and the states the layers kept after them."""

    # the request (row of the step's batch) of each captured token, and the token's offset inside
    # its request's chunk, on the host [R]; request groups split the capture list by group
    req_host: tuple[int, ...]
    offset_host: tuple[int, ...]
    device: torch.device
    # (state pool [num_slots, ...], its states after the captured tokens [R, ...]) per layer state
    kept: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Where the layers put the captured rows: persistent rows per state pool (the verification
    # CUDA graphs' buffers, lamina.layers.spec_state.CaptureBuffers), or None: fresh tensors.
    buffers: object | None = None
    max_offset: int = 0  # host bound on `offset_host`: keeps the kernels' buffers small
    _on_device: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def from_host(
        cls, req: list[int], offset: list[int], device: torch.device, buffers: object | None = None,
        *, upload: bool = True,
    ) -> StateCapture:
        """`upload`: copy `req` and `offset` to the device now (one copy); False leaves it to
        the first read of `tokens`: a step replayed from a verification graph never reads them
        (the graph's own capture holds its rows), so its host prologue skips the copy. Never
        read `tokens` of an un-uploaded capture inside a CUDA graph capture."""
        capture = cls(tuple(req), tuple(offset), device, buffers=buffers, max_offset=max(offset))
        if upload:
            capture.tokens
        return capture

    @property
    def tokens(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The kernels' `capture` argument: (req [R] long, offset [R] long, max offset)."""
        if self._on_device is None:
            self._on_device = tuple(to_device_many(self.device, self.req_host, self.offset_host))  # one upload
        req, offset = self._on_device
        return req, offset, self.max_offset

    @property
    def req(self) -> torch.Tensor:
        return self.tokens[0]

    @property
    def offset(self) -> torch.Tensor:
        return self.tokens[1]

    def per_request(self, num_reqs: int) -> int | None:
        """n when every one of the step's `num_reqs` requests captures its tokens 0..n-1 and the
        list is request-major (row b*n + i is token i of request b): the layout the Q-token
        kernels write (lamina.kernels.triton_verify); None otherwise. Host ints only."""
        if num_reqs <= 0 or len(self.req_host) % num_reqs:
            return None
        n = len(self.req_host) // num_reqs
        uniform = self.req_host == tuple(b for b in range(num_reqs) for _ in range(n)) and self.offset_host == tuple(
            range(n)
        ) * num_reqs
        return n if uniform and n > 0 else None

    def rows(self, pool: torch.Tensor, count: int) -> torch.Tensor:
        """`count` capture rows `[count, ...]` for the state pool `pool` (not yet kept)."""
        if self.buffers is not None:
            return self.buffers.rows(pool, count)
        return torch.empty((count, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)

    @property
    def host(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.req_host, self.offset_host

    def keep(self, pool: torch.Tensor, captured: torch.Tensor) -> None:
        """Remember the states after the captured tokens `[R, ...]` for the state pool `pool`."""
        self.kept.append((pool, captured))

    def commit(self, rows: torch.Tensor, slots: torch.Tensor, copy_rows=None, *, skip_negative: bool = False) -> None:
        """`pool[slots[i]] = captured[rows[i]]` for every state kept in this step (with
        `skip_negative`, nothing where rows[i] < 0). `copy_rows` (pairs, dst_rows, src_rows):
        how (lamina.kernels.triton_state_rows: one launch per group of like pools); default the
        torch reference (lamina.kernels.state_rows), an `index_copy_` per pool."""
        if copy_rows is None:
            from lamina.kernels.state_rows import copy_state_rows_reference as copy_rows
        copy_rows(self.kept, slots, rows, skip_negative=skip_negative)


@dataclass
class ForwardMetadata:
    num_tokens: int  # T: scheduled tokens of all requests, concatenated
    num_reqs: int  # B
    max_query_len: int
    max_seq_len: int
    positions: torch.Tensor  # [T] long: position of each token in its request
    query_start_loc: torch.Tensor  # [B+1] long: cumulative query lengths
    seq_lens: torch.Tensor  # [B] long: context length after this step
    slot_mapping: torch.Tensor  # [T] long: paged KV slot of each token
    block_tables: torch.Tensor  # [B, max_blocks] long
    state_slots: torch.Tensor  # [B] long: recurrent-state slot of each request
    has_initial_state: torch.Tensor  # [B] bool: False for a request whose first chunk this is
    # [B, H] long: the H token ids before each request's chunk, oldest first, -1 where the request
    # has fewer (its start). Present when the model declares `token_history_len` H > 0.
    history_token_ids: torch.Tensor | None = None
    token_request_index: torch.Tensor | None = None  # [T] long: which request each token belongs to
    # Token counts of every data-parallel replica in this (lockstep) step, this one included:
    # expert-parallel MoE pads its cross-replica collectives to their maximum.
    dp_num_tokens: tuple[int, ...] | None = None
    # Speculative verification: the tokens after which recurrent layers also keep their state, so
    # that rejected drafts can be undone, and where the layers put those states
    # (lamina.layers.spec_state; the capture list is on the device and the host).
    state_capture: StateCapture | None = None
    # Host copies from the plan: each request's query length and context length after this step
    # (an upper bound is enough). They let the padded kernels split a step into groups of similar
    # requests (lamina.kernels.request_groups); None: never split.
    query_lens_host: tuple[int, ...] | None = None
    seq_lens_host: tuple[int, ...] | None = None
    # Whether the padded kernels may split this step into request groups (the runner reads
    # LAMINA_REQUEST_GROUPS once, when it is built; nothing in the forward reads the environment).
    allow_groups: bool = True
    _groups: dict = field(default_factory=dict, repr=False)
    _chunk_indices: dict = field(default_factory=dict, repr=False)

    @property
    def prompts_from_start(self) -> bool:
        """Whether every request's queries start at position 0 (no cached context), from the host
        copies: a context length equal to the query length (an upper bound never makes it so)."""
        return (self.query_lens_host is not None and self.seq_lens_host is not None
                and tuple(self.query_lens_host) == tuple(self.seq_lens_host))

    def chunk_indices(self, chunk_size: int) -> torch.Tensor | None:
        """`[NT, 2]` long on the step's device: (request, chunk within the request) of every chunk of
        `chunk_size` query tokens (`varlen.chunk_indices_host`), from the host query lengths and
        uploaded once per step and chunk size, for the chunked kernels' grid (fla-core's
        `chunk_indices`); None without host lengths."""
        if self.query_lens_host is None:
            return None
        if chunk_size not in self._chunk_indices:
            from lamina.host_to_device import to_device
            from lamina.kernels.varlen import chunk_indices_host

            if len(self.query_lens_host) != self.num_reqs or sum(self.query_lens_host) != self.num_tokens:
                raise ValueError(
                    f"query_lens_host {self.query_lens_host} does not describe this step's {self.num_reqs} "
                    f"requests and {self.num_tokens} tokens"
                )
            indices = chunk_indices_host(self.query_lens_host, chunk_size)  # [NT, 2]
            self._chunk_indices[chunk_size] = to_device(indices, self.query_start_loc.device)
        return self._chunk_indices[chunk_size]

    def request_groups(self, by_context: bool = False, by_kind: bool = False, fresh_with_continued: bool = False):
        """Groups of similar requests for the padded kernels (by query length, or for attention by
        context length too; `by_kind`: decodes, continued chunks and fresh prompts apart, or with
        `fresh_with_continued` fresh prompts with the continued chunks, see
        `request_groups.plan_groups`), or None when one call over the whole step will do."""
        key = (by_context, by_kind and by_context, fresh_with_continued and by_kind and by_context)
        if key in self._groups:
            return self._groups[key]
        from lamina.kernels import request_groups as rg

        groups = None
        if self.allow_groups and self.query_lens_host is not None and self.seq_lens_host is not None:
            plan = rg.plan_groups(self.query_lens_host, self.seq_lens_host if by_context else None, by_kind=key[1],
                                  fresh_with_continued=key[2])
            if plan is not None:
                capture = None if by_context or self.state_capture is None else self.state_capture.host
                groups = rg.build_groups(
                    plan, self.query_lens_host, self.seq_lens_host, self.query_start_loc.device, capture,
                )
        self._groups[key] = groups
        return groups
