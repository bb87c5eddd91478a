"""Qwen4-Exp N-gram per-layer embedding (PLE): hashed n-gram table + gated injection + dilated short conv.

A PLE module sits before a linear-attention layer and adds to the hyper-connection streams
`[T, hc*H]`:

    e      = table rows of the token's n-gram hashes, concatenated          [T, E]
    key    = norm_key(key_proj(e)) per stream                               [T, hc, H]
    query  = norm_query(streams) per stream                                 [T, hc, H]
    g      = <key, query> / sqrt(H);  g = sign(g) * sqrt(max(|g|, 1e-6))   [T, hc, 1]
    v      = sigmoid(g) * value_proj(e)                                     [T, hc, H]
    out    = v + silu(dilated_conv(norm_conv(v)))                           [T, hc*H]

The conv is depthwise over hc*H channels, kernel `ple_conv_kernel_size`, dilation `ngram_size`;
its per-request state (the last (K-1)*ngram_size conv inputs) lives in a slot tensor like the
gated delta net's, bound by the runner through `bind_state`.

The table (`[rows, E / heads]`, rows = padded sum of the heads' prime vocabularies) is loaded
from the checkpoint's `ngram_embedding.shard_{i}` parts into one tensor. It lives on the compute
device or in host memory (pinned when CUDA is available); from host memory only the rows a step
needs are gathered there and copied over. Every weight here is replicated over TP.
"""

from __future__ import annotations

import logging

import math

import torch
from torch import nn

from lamina.layers.hyper_connections import GroupedRMSNorm
from lamina.layers.linear import ReplicatedLinear, check_shape
from lamina.layers.metadata import ForwardMetadata
from lamina.layers.ngram_hash import head_vocab_sizes, ngram_multipliers, ngram_row_ids
from lamina.layers.spec_state import conv_with_capture

PLE_TABLE_DEVICES = ("auto", "gpu", "cpu")

logger = logging.getLogger(__name__)


def ple_table_rows(vocab_base: int, ple_index: int, num_heads: int, divisible_by: int) -> int:
    total = sum(head_vocab_sizes(vocab_base, ple_index, num_heads))
    return -(-total // divisible_by) * divisible_by


def resolve_ple_table_device(option: str, device: torch.device, table_bytes: int) -> torch.device:
    """Where the PLE tables live. `auto`: the compute device when all tables take under half of its
    free memory, else the host; on a CPU compute device everything is the CPU."""
    if option not in PLE_TABLE_DEVICES:
        raise ValueError(f"ple_table_device must be one of {', '.join(PLE_TABLE_DEVICES)}; got {option!r}")
    device = torch.device(device)
    if device.type == "cpu" or option == "cpu":
        return torch.device("cpu")
    if option == "gpu" or device.type != "cuda":  # e.g. "meta" while estimating memory
        return device
    free, _ = torch.cuda.mem_get_info(device)
    return device if table_bytes < 0.5 * free else torch.device("cpu")


def _as_reported(device) -> torch.device:
    """`device` as a tensor allocated there reports it: the index filled in on CUDA ("cuda" ->
    "cuda:N", the current device), dropped on the CPU ("cpu:0" -> "cpu"). Device objects compare
    their spelling, not the memory they name: torch.device("cuda") != torch.device("cuda:0")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


def _allocate_table(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """The table's storage. Host tables are pinned when the compute device is a GPU and the driver
    can pin that much; a table too large to pin (a full-size one is ~95 GiB) stays pageable, and
    only the rows a step needs go through the pinned staging buffer."""
    if pin:
        try:
            return torch.empty(shape, dtype=dtype, device=device, pin_memory=True)
        except (RuntimeError, torch.AcceleratorError if hasattr(torch, "AcceleratorError") else RuntimeError) as e:
            logger.warning("could not pin a %.1f GiB PLE table (%s); keeping it in pageable host memory",
                           shape[0] * shape[1] * dtype.itemsize / 2**30, str(e).splitlines()[0])
    return torch.empty(shape, dtype=dtype, device=device)


class NGramHashEmbedding(nn.Module):
    """Hash ids and the table of one PLE module (`ple_embedding` in the checkpoint)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        ngram_size: int,
        heads_per_ngram: int,
        embed_dim: int,
        ple_index: int,
        seed: int,
        vocab_base: int,
        divisible_by: int,
        split_parts: int,
        dtype: torch.dtype,
        device,
        table_device,
        tp_size: int = 1,
        tp_rank: int = 0,
    ):
        super().__init__()
        self.ngram_size = ngram_size
        self.heads_per_ngram = heads_per_ngram
        self.num_heads = (ngram_size - 1) * heads_per_ngram
        self.total_head_dim = embed_dim // self.num_heads
        # Under TP each rank holds a slice of every row's features (the table's embedding dim):
        # 1/tp of the table's memory; the projections that read it become row-parallel.
        self.sharded = tp_size > 1 and self.total_head_dim % tp_size == 0
        self.head_dim = self.total_head_dim // tp_size if self.sharded else self.total_head_dim
        self.col_start = tp_rank * self.head_dim if self.sharded else 0
        # As tensors report it: torch.device("cuda") != torch.device("cuda:0"), the device of a tensor
        # allocated on "cuda" (and torch.device("cpu:0") != torch.device("cpu")).
        self.device = _as_reported(device)
        sizes = head_vocab_sizes(vocab_base, ple_index, self.num_heads)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        multipliers = ngram_multipliers(vocab_size, ngram_size, ple_index, seed)
        self.register_buffer("multipliers", torch.tensor(multipliers, device=device), persistent=False)
        self.register_buffer("head_sizes", torch.tensor(sizes, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("head_offsets", torch.tensor(offsets, dtype=torch.long, device=device), persistent=False)
        self.num_rows = -(-sum(sizes) // divisible_by) * divisible_by
        # Checkpoint parts follow torch.chunk: ceil(rows / parts) each, the last one shorter.
        self.part_rows = -(-self.num_rows // split_parts)
        self.num_parts = -(-self.num_rows // self.part_rows)
        table_device = torch.device(table_device)
        pin = table_device.type == "cpu" and self.device.type == "cuda"
        # [rows, D]; may stay in host memory while the rest of the model is on a GPU.
        self.ngram_embedding = nn.Parameter(
            _allocate_table((self.num_rows, self.head_dim), dtype, table_device, pin), requires_grad=False
        )
        self._staging: torch.Tensor | None = None  # pinned host rows on their way to the device

    # ---- loading -------------------------------------------------------------------------
    def load_part(self, name: str, loaded: torch.Tensor, part: int) -> None:
        """`ngram_embedding.shard_{part}.weight`: rows [part*part_rows, ...) of the table."""
        start = part * self.part_rows
        rows = min(self.part_rows, self.num_rows - start)
        check_shape(name, loaded, (rows, self.total_head_dim))
        self.ngram_embedding.data[start : start + rows].copy_(loaded.narrow(1, self.col_start, self.head_dim))

    def check_buffer(self, name: str, loaded: torch.Tensor) -> None:
        """The checkpoint's copies of the hash constants must equal the ones derived from the config."""
        ours = {
            "layer_multipliers": self.multipliers,
            "ngram_heads_vocab_sizes": self.head_sizes,
            "ngram_heads_offsets": self.head_offsets,
        }[name.rsplit(".", 1)[-1]]
        if not torch.equal(loaded.to(torch.long).cpu(), ours.cpu()):
            raise ValueError(
                f"checkpoint tensor {name!r} = {loaded.tolist()} differs from the value derived from the config "
                f"({ours.tolist()}): check seed, ngram_size, heads_per_ngram, ngram_vocab_size_base and ple_layer_ids"
            )

    @property
    def host_table(self) -> bool:
        """The table lives off the compute device (its rows are gathered on the host: not graph-safe).
        Both devices as tensors report them (`self.device` is normalised when built), so a model
        built on "cuda" whose table is on "cuda:0" is not a host table."""
        return _as_reported(self.ngram_embedding.device) != _as_reported(self.device)

    # ---- forward -------------------------------------------------------------------------
    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N] (compute device) -> table rows [N, D] on the compute device."""
        table = self.ngram_embedding.data  # [rows, D]
        if table.device == rows.device:
            return table.index_select(0, rows)
        host_rows = rows.cpu()  # syncs the stream, so the previous step's copy out of staging is done
        if not table.is_pinned():
            return table.index_select(0, host_rows).to(self.device)
        count = host_rows.shape[0]
        if self._staging is None or self._staging.shape[0] < count:
            capacity = 1 << max(count - 1, 1).bit_length()
            self._staging = torch.empty(capacity, self.head_dim, dtype=table.dtype, pin_memory=True)  # [cap, D]
        staged = self._staging[:count]  # [N, D]
        torch.index_select(table, 0, host_rows, out=staged)
        return staged.to(self.device, non_blocking=True)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """window [T, ngram_size] (see `ngram_windows`) -> embeddings [T, heads * head_dim]
        (this rank's feature slice of every head when the table is TP-sharded)."""
        rows = ngram_row_ids(
            window, self.multipliers, self.head_sizes, self.head_offsets, self.heads_per_ngram
        )  # [T, heads]
        emb = self._gather(rows.reshape(-1))  # [T*heads, D]
        return emb.view(window.shape[0], self.num_heads * self.head_dim)  # [T, heads*D]


class HeadSlicedLinear(ReplicatedLinear):
    """A projection reading the PLE embedding [T, heads*D]; when the table is TP-sharded it keeps
    only the input columns of this rank's feature slice of every head (its output is then Partial)."""

    def __init__(self, embed_dim: int, output_size: int, embedding: "NGramHashEmbedding", *, dtype, device=None):
        super().__init__(embedding.num_heads * embedding.head_dim, output_size, dtype=dtype, device=device)
        self.embedding = embedding
        self.total_embed_dim = embed_dim

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        e = self.embedding
        check_shape(name, loaded, (self.weight.shape[0], self.total_embed_dim))
        per_head = loaded.view(loaded.shape[0], e.num_heads, e.total_head_dim)  # [out, heads, D]
        local = per_head.narrow(2, e.col_start, e.head_dim).reshape(loaded.shape[0], -1)  # [out, heads*D_local]
        self.weight.data.copy_(local)


class PLELayer(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        hc_count: int,
        embedding: NGramHashEmbedding,
        embed_dim: int,
        conv_kernel_size: int,
        dilation: int,
        rms_norm_eps: float,
        dtype: torch.dtype,
        device=None,
        tp=None,
    ):
        super().__init__()
        self.tp = tp  # TP collectives; used when the table is sharded
        self.hidden_size = hidden_size
        self.hc_count = hc_count
        self.width = hc_count * hidden_size
        self.conv_kernel_size = conv_kernel_size
        self.dilation = dilation
        self.state_len = (conv_kernel_size - 1) * dilation
        self.ple_embedding = embedding
        local_embed = embedding.num_heads * embedding.head_dim
        self.key_proj = HeadSlicedLinear(embed_dim, self.width, embedding, dtype=dtype, device=device)
        self.value_proj = HeadSlicedLinear(embed_dim, hidden_size, embedding, dtype=dtype, device=device)
        assert self.key_proj.weight.shape[1] == local_embed
        self.norm_key = GroupedRMSNorm(self.width, hidden_size, rms_norm_eps, dtype=dtype, device=device)
        self.norm_query = GroupedRMSNorm(self.width, hidden_size, rms_norm_eps, dtype=dtype, device=device)
        self.norm_conv = GroupedRMSNorm(self.width, hidden_size, rms_norm_eps, dtype=dtype, device=device)
        self.conv_weight = nn.Parameter(
            torch.empty(self.width, conv_kernel_size, dtype=dtype, device=device), requires_grad=False
        )
        self.conv_state: torch.Tensor | None = None  # [num_slots, hc*H, (K-1)*dilation], bound by the runner

    def load_conv_weight(self, name: str, loaded: torch.Tensor) -> None:
        check_shape(name, loaded, (self.width, 1, self.conv_kernel_size))
        self.conv_weight.data.copy_(loaded[:, 0, :])

    def bind_state(self, num_slots: int, dtype: torch.dtype, device, ssm_dtype: torch.dtype | None = None) -> int:
        """Allocate the per-slot short-conv state; returns its bytes. (`ssm_dtype`, the recurrent
        pools' dtype, does not apply: this state holds activations, kept in `dtype`.)"""
        self.conv_state = torch.zeros((num_slots, self.width, self.state_len), dtype=dtype, device=device)
        return self.conv_state.numel() * dtype.itemsize

    def state_tensors(self) -> list[torch.Tensor]:
        """Every per-slot state tensor (slot-major), for slot-to-slot copies."""
        return [self.conv_state]

    def forward(self, streams: torch.Tensor, window: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """streams [T, hc*H], window [T, ngram_size] -> streams + PLE output [T, hc*H]."""
        assert self.conv_state is not None, "PLE conv state not bound"
        emb = self.ple_embedding(window)  # [T, E_local]
        key, value = self.key_proj(emb), self.value_proj(emb)  # [T, hc*H], [T, H]
        if self.ple_embedding.sharded:  # each rank projected its feature slice: sum the partials
            key, value = self.tp.all_reduce(key), self.tp.all_reduce(value)
        key = self.norm_key(key).unflatten(-1, (self.hc_count, self.hidden_size))  # [T, hc, H]
        query = self.norm_query(streams).unflatten(-1, (self.hc_count, self.hidden_size))  # [T, hc, H]
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)  # [T, hc, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value[:, None, :]).flatten(-2)  # [T, hc*H]
        conv_in = self.norm_conv(gated)  # [T, hc*H]

        slots = meta.state_slots
        state_in = torch.where(meta.has_initial_state[:, None, None], self.conv_state[slots], 0.0)  # [B, hc*H, S]
        conv_out, state_out = conv_with_capture(
            self.conv_state, conv_in, self.conv_weight, state_in, meta, activation="silu", dilation=self.dilation,
        )  # [T, hc*H], [B, hc*H, S]; keeps per-position states under speculative verification
        self.conv_state.index_copy_(0, slots, state_out.to(self.conv_state.dtype))
        return streams + (gated + conv_out)
