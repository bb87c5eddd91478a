"""Vocab-parallel token embedding and LM head: each TP rank holds a contiguous slice of vocab rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina.layers.linear import check_shape
from lamina.parallel.context import ParallelContext, divide_exact


class VocabShardedWeight(nn.Module):
    """A [vocab, hidden] weight split by vocab rows over TP."""

    def __init__(self, total_vocab_size: int, hidden_size: int, ctx: ParallelContext, *, dtype=torch.float32, device=None):
        super().__init__()
        self.total_vocab_size = total_vocab_size
        self.hidden_size = hidden_size
        self.tp_size = ctx.tp_size
        self.vocab_size_per_rank = divide_exact(total_vocab_size, ctx.tp_size, "vocab_size")
        self.vocab_start = ctx.tp_rank * self.vocab_size_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.vocab_size_per_rank, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def load_shard(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, (self.total_vocab_size, self.hidden_size))
        self.weight.data.copy_(loaded.narrow(0, self.vocab_start, self.vocab_size_per_rank))


class VocabParallelEmbedding(VocabShardedWeight):
    """Token embedding; the output is Partial over TP until reduced."""

    def forward_partial(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> [T, hidden], Partial over TP (rows of other ranks' vocab are zero)."""
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        in_range = (local >= 0) & (local < self.vocab_size_per_rank)
        out = F.embedding(local.clamp(0, self.vocab_size_per_rank - 1), self.weight)  # [T, hidden]
        return out * in_range[:, None].to(out.dtype)


class ParallelLMHead(VocabShardedWeight):
    """LM head; the caller all-gathers the local logits along the vocab dim."""

    def forward_local(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> local logits [N, vocab_per_rank]."""
        return F.linear(hidden, self.weight)
