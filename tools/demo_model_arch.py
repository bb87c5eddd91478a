"""The demo model's architecture for training: transformers' Qwen4-Exp modules, with a vectorised
QSA attention and an MTP head in the layout lamina loads.

transformers' `Qwen4ExpTextQSAIndexer` picks blocks with a Python loop over batch rows and query
positions (fine for a reference, far too slow to train with), and its top-k gives the indexer no
gradient. `dense_experts_forward` runs every expert on every token (weights zero off the top-k), the same
sum without transformers' host sync per expert. `qsa_attention_forward` replaces `Qwen4ExpTextAttention.forward` for training: the same
selection (blocks of `compress_ratio` raw keys, mean-pooled, normed, roped at the block start;
relu(q.k) summed over indexer heads; the top `budget / compress_ratio` complete blocks plus the
incomplete tail), computed for all queries at once, and a distillation loss that trains the
indexer towards the attention mass of the dense attention (detached), as DeepSeek-V3.2 trains its
lightning indexer. `check_against_transformers` compares it with the unpatched forward.

`MTPHead` is lamina's Qwen4-Exp drafter (lamina/models/mtp_qwen4.py): fc_embedding, fc_hidden
shared by the streams, one indexed-attention MoE decoder layer with hyper-connections, a final
mixer; its tensors are saved under `mtp.*`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

AUX_LOSSES: list[torch.Tensor] = []  # indexer distillation losses of the current forward
COLLECT_AUX = [False]


def _causal(num_tokens: int, device) -> torch.Tensor:
    return torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()


def qsa_selection(indexer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """hidden [B, T, H] -> (selected [B, T, T] bool, block scores [B, T, nb] float, valid [T, nb])."""
    batch, num_tokens, _ = hidden.shape
    ratio, dim, heads = indexer.compress_ratio, indexer.index_head_dim, indexer.index_n_heads
    q, raw_keys = indexer.index_qk_proj(hidden).split([heads * dim, dim], dim=-1)
    q = indexer.q_layernorm(q.view(batch, num_tokens, heads, dim))  # [B, T, h, d]
    q = hf.apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)
    positions = torch.arange(num_tokens, device=hidden.device)
    causal = _causal(num_tokens, hidden.device)
    num_blocks = num_tokens // ratio
    if num_blocks == 0:
        return causal.expand(batch, -1, -1), None, None
    pooled = raw_keys[:, : num_blocks * ratio].view(batch, num_blocks, ratio, dim).float().mean(2).to(raw_keys.dtype)
    pooled = indexer.k_layernorm(pooled)  # [B, nb, d]
    starts = positions[:num_blocks] * ratio
    block_keys = hf.apply_rotary_pos_emb(
        pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2
    ).squeeze(2)  # [B, nb, d]
    scores = torch.einsum("bthd,bnd->btnh", q.float(), block_keys.float()).relu().sum(-1) / math.sqrt(dim)  # [B, T, nb]
    complete = (positions + 1) // ratio  # [T] complete blocks visible to each query
    valid = torch.arange(num_blocks, device=hidden.device)[None, :] < complete[:, None]  # [T, nb]
    masked = scores.masked_fill(~valid, float("-inf"))
    top = masked.topk(min(indexer.block_topk, num_blocks), dim=-1)
    chosen = torch.zeros_like(valid).expand(batch, -1, -1).clone()  # [B, T, nb]
    chosen.scatter_(-1, top.indices, top.values > float("-inf"))
    token_block = positions // ratio  # [T]
    in_block = token_block < num_blocks
    selected = chosen[:, :, token_block.clamp(max=num_blocks - 1)] & in_block  # [B, T, T]
    tail = positions[None, :] >= (complete * ratio)[:, None]  # [T, T]
    return (selected | tail) & causal, scores, valid


def _indexer_distillation(scores, valid, q, k, ratio: int) -> torch.Tensor:
    """KL(block attention mass of the dense attention || softmax of the indexer's block scores)."""
    batch, heads, num_tokens, _ = q.shape
    num_blocks = valid.shape[1]
    with torch.no_grad():
        logits = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, h, T, T]
        logits = logits.masked_fill(~_causal(num_tokens, q.device), float("-inf"))
        probs = logits.softmax(-1).mean(1)[..., : num_blocks * ratio]  # [B, T, nb*r]
        target = probs.view(batch, num_tokens, num_blocks, ratio).sum(-1) * valid  # [B, T, nb]
        rows = valid.any(-1)  # [T]
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
    log_q = scores.masked_fill(~valid, float("-inf")).log_softmax(-1).masked_fill(~valid, 0.0)
    kl = (target * (target.clamp_min(1e-9).log() - log_q)).sum(-1)  # [B, T]
    return kl[:, rows].mean()


def qsa_attention_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
    """Training replacement of `Qwen4ExpTextAttention.forward` (no cache, no padding mask)."""
    batch, num_tokens, _ = hidden_states.shape
    cos, sin = position_embeddings
    selected, scores, valid = qsa_selection(self.indexer, hidden_states, cos, sin)
    query, gate = torch.chunk(self.q_proj(hidden_states).view(batch, num_tokens, -1, self.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(batch, num_tokens, -1)  # [B, T, heads*hd]
    query = self.q_norm(query).transpose(1, 2)  # [B, heads, T, hd]
    key = self.k_norm(self.k_proj(hidden_states).view(batch, num_tokens, -1, self.head_dim)).transpose(1, 2)
    value = self.v_proj(hidden_states).view(batch, num_tokens, -1, self.head_dim).transpose(1, 2)
    query, key = hf.apply_rotary_pos_emb(query, key, cos, sin)
    key_rep = hf.repeat_kv(key, self.num_key_value_groups)
    value_rep = hf.repeat_kv(value, self.num_key_value_groups)
    if COLLECT_AUX[0] and scores is not None:
        AUX_LOSSES.append(_indexer_distillation(scores, valid, query.detach(), key_rep.detach(), self.indexer.compress_ratio))
    out = F.scaled_dot_product_attention(query, key_rep, value_rep, attn_mask=selected[:, None], scale=self.scaling)
    out = out.transpose(1, 2).reshape(batch, num_tokens, -1) * torch.sigmoid(gate)  # [B, T, heads*hd]
    return self.o_proj(out), None


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Training replacement of `Qwen4ExpTextExperts.forward`: every expert on every token, weighted
    by the routing weights (zero off the top-k): the same sum without a host sync per expert."""
    weights = torch.zeros(hidden_states.shape[0], self.num_experts, dtype=top_k_weights.dtype, device=hidden_states.device)
    weights.scatter_(1, top_k_index, top_k_weights)  # [N, E]
    gate, up = torch.einsum("nh,eih->nei", hidden_states, self.gate_up_proj).chunk(2, dim=-1)  # [N, E, I] each
    out = torch.einsum("nei,ehi->neh", self.act_fn(gate) * up, self.down_proj)  # [N, E, H]
    return (out * weights[:, :, None].to(out.dtype)).sum(1).to(hidden_states.dtype)


def install_training_modules() -> None:
    hf.Qwen4ExpTextAttention.forward = qsa_attention_forward
    hf.Qwen4ExpTextExperts.forward = dense_experts_forward


class MTPHead(nn.Module):
    """lamina's Qwen4-Exp MTP drafter, one pass: (target streams at p, token p+1) -> hidden for token p+2."""

    def __init__(self, text_config_kwargs: dict):
        super().__init__()
        layer_cfg = hf.Qwen4ExpTextConfig(**{
            **text_config_kwargs, "num_hidden_layers": 1, "layer_types": ["full_attention"], "ple_layer_ids": [],
        })
        hidden, hc, eps = layer_cfg.hidden_size, layer_cfg.hc_count, layer_cfg.rms_norm_eps
        self.hidden, self.hc = hidden, hc
        self.pre_fc_norm_embedding = hf.Qwen4ExpTextRMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = hf.Qwen4ExpTextRMSNorm(hc * hidden, eps=eps)
        self.fc_embedding = nn.Linear(hidden, hidden, bias=False)
        self.fc_hidden = nn.Linear(hidden, hidden, bias=False)
        self.layers = nn.ModuleList([hf.Qwen4ExpTextDecoderLayer(layer_cfg, 0)])
        self.hyper_connection_mixer = hf.Qwen4ExpTextGatedResidual(layer_cfg, use_combine=False)

    def forward(self, streams, next_tokens, embed_weight, position_embeddings):
        """streams [B, T, hc*H] (target, pre-mixer), next_tokens [B, T] -> mixed [B, T, H]."""
        embedded = self.fc_embedding(self.pre_fc_norm_embedding(F.embedding(next_tokens, embed_weight)))  # [B, T, H]
        normed = self.pre_fc_norm_hidden(streams).unflatten(-1, (self.hc, self.hidden))  # [B, T, hc, H]
        x = (self.fc_hidden(normed) + embedded[:, :, None, :]).flatten(-2)  # [B, T, hc*H]
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        return self.hyper_connection_mixer(x)


def rotary(model, batch: int, num_tokens: int, device, like: torch.Tensor):
    """(cos, sin) [B, T, rot] of positions 0..T-1, as Qwen4ExpTextModel computes them for text."""
    positions = torch.arange(num_tokens, device=device).view(1, 1, -1).expand(3, batch, -1)
    return model.model.rotary_emb(like, positions)


@torch.no_grad()
def check_against_transformers(model, input_ids: torch.Tensor, atol: float = 1e-4) -> dict:
    """Compare the training attention with transformers' own on `input_ids` (float32): at every
    attention layer, the same selection except at exact score ties on the cut (transformers' loop
    and a batched top-k may order tied blocks differently), and the same output where none tie."""
    model.eval()
    inputs: dict[int, tuple] = {}
    def keep(i):
        def hook(module, args, kwargs) -> None:
            inputs.setdefault(i, (args[0], args[1] if len(args) > 1 else kwargs["position_embeddings"]))
        return hook

    hooks = [
        layer.self_attn.register_forward_pre_hook(keep(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers) if hasattr(layer, "self_attn")
    ]
    try:
        model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    report = {}
    for i, (hidden, (cos, sin)) in inputs.items():
        attn = model.model.layers[i].self_attn
        num_tokens = hidden.shape[1]
        causal = _causal(num_tokens, hidden.device)[None, None].expand(hidden.shape[0], 1, -1, -1)
        theirs = attn.indexer(hidden, (cos, sin), causal, None)[:, 0]
        ours, scores, valid = qsa_selection(attn.indexer, hidden, cos, sin)
        differing = (theirs != ours).any(-1)  # [B, T]
        for b, t in differing.nonzero().tolist():
            row = scores[b, t][valid[t]].sort(descending=True).values
            k = attn.indexer.block_topk
            if not (len(row) > k and row[k - 1] == row[k]):
                raise AssertionError(f"layer {i}: query {t} selects other blocks than transformers without a tie")
        out_ours, _ = qsa_attention_forward(attn, hidden, (cos, sin))
        out_theirs, _ = _ORIGINAL_FORWARD(attn, hidden, (cos, sin), causal)
        rows = ~differing
        diff = (out_ours - out_theirs).abs()[rows].max().item()
        if diff > atol:
            raise AssertionError(f"layer {i}: the training attention differs from transformers' by {diff:.3g}")
        report[i] = dict(max_abs_diff=diff, tied_rows=int(differing.sum()))
    moe = model.model.layers[0].mlp
    x = torch.randn(64, model.config.hidden_size)
    _, weights, index = moe.gate(x)
    diff = (dense_experts_forward(moe.experts, x, index, weights) - _ORIGINAL_EXPERTS_FORWARD(moe.experts, x, index, weights)).abs().max().item()
    if diff > atol:
        raise AssertionError(f"the dense training experts differ from transformers' by {diff:.3g}")
    report["experts"] = dict(max_abs_diff=diff)
    return report


_ORIGINAL_FORWARD = hf.Qwen4ExpTextAttention.forward
_ORIGINAL_EXPERTS_FORWARD = hf.Qwen4ExpTextExperts.forward
