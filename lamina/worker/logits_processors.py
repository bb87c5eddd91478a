"""Per-request logit adjustments applied before sampling: allowed tokens, logit bias, and the
presence / frequency / repetition penalties (vLLM semantics).

`LogitAdjustments.build` turns the rows' `SamplingParams` and token histories into a few flat
index tensors on the host (one pass over each request's own tokens, never over the vocabulary);
`apply` then runs batched tensor ops on the `[B, V]` float32 logits. Every operation reads only
its own row, so a request's result does not depend on the batch.

Penalties, as vLLM defines them:
- repetition_penalty r (prompt + output tokens): a seen token's logit l becomes l / r if l > 0,
  else l * r;
- frequency_penalty f and presence_penalty p (output tokens only): l -= f * count + p * (count > 0).

Bad words are host-side bans (`bad_word_bans`): a bad word's last token is banned at a step when
the output so far ends with the rest of the word's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lamina.host_to_device import to_device
from lamina.sampling_params import SamplingParams

__all__ = ["LogitAdjustments", "bad_word_bans"]


def bad_word_bans(bad_words_token_ids: Sequence[Sequence[int]] | None, output_token_ids: Sequence[int]) -> list[int]:
    """Token ids to ban at the next position: the last token of every bad word whose other tokens
    are the last tokens of the output (a one-token bad word is always banned)."""
    banned = []
    for word in bad_words_token_ids or ():
        prefix_len = len(word) - 1
        if prefix_len > len(output_token_ids):
            continue
        if prefix_len == 0 or list(output_token_ids[-prefix_len:]) == list(word[:-1]):
            banned.append(int(word[-1]))
    return banned


def _flat(rows_and_ids: list[tuple[int, Sequence[int]]]) -> tuple[list[int], list[int]]:
    rows: list[int] = []
    ids: list[int] = []
    for row, tokens in rows_and_ids:
        rows.extend([row] * len(tokens))
        ids.extend(tokens)
    return rows, ids


@dataclass
class LogitAdjustments:
    """Flat per-step tensors of the rows' adjustments (all on the logits' device)."""

    bias_rows: torch.Tensor | None  # [M] int64
    bias_cols: torch.Tensor | None  # [M] int64
    bias_values: torch.Tensor | None  # [M] float32
    allowed_rows: torch.Tensor | None  # [A] int64, row of each allowed (row, token) pair
    allowed_cols: torch.Tensor | None  # [A] int64
    restricted: torch.Tensor | None  # [B] bool, rows limited to their allowed tokens
    output_rows: torch.Tensor | None  # [O] int64, row of each output token occurrence
    output_ids: torch.Tensor | None  # [O] int64
    prompt_rows: torch.Tensor | None  # [P] int64, row of each prompt token (repetition rows only)
    prompt_ids: torch.Tensor | None  # [P] int64
    presence: torch.Tensor | None  # [B] float32
    frequency: torch.Tensor | None  # [B] float32
    repetition: torch.Tensor | None  # [B] float32

    @property
    def empty(self) -> bool:
        return self.bias_rows is None and self.restricted is None and self.presence is None

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int] | None] | None,
        prompt_token_ids: Sequence[Sequence[int] | None] | None,
        device: torch.device | str,
        vocab_size: int,
    ) -> LogitAdjustments:
        """Args: one `SamplingParams` per row; each row's generated tokens (needed by rows with
        penalties) and prompt tokens (needed by rows with a repetition penalty), or None."""
        bsz = len(params_list)

        bias = [(r, p.logit_bias) for r, p in enumerate(params_list) if p.logit_bias]
        bias_rows = bias_cols = bias_values = None
        if bias:
            pairs = [(r, t, v) for r, b in bias for t, v in b.items() if t < vocab_size]
            bias_rows = to_device([r for r, _, _ in pairs], device, torch.int64)
            bias_cols = to_device([t for _, t, _ in pairs], device, torch.int64)
            bias_values = to_device([v for _, _, v in pairs], device, torch.float32)

        allowed_rows = allowed_cols = restricted = None
        allowed = [(r, [t for t in p.allowed_token_ids if t < vocab_size])
                   for r, p in enumerate(params_list) if p.allowed_token_ids is not None]
        if allowed:
            rows, ids = _flat(allowed)
            allowed_rows, allowed_cols = to_device(rows, device, torch.int64), to_device(ids, device, torch.int64)
            mask = [False] * bsz
            for r, _ in allowed:
                mask[r] = True
            restricted = to_device(mask, device, torch.bool)

        presence = frequency = repetition = None
        output_rows = output_ids = prompt_rows = prompt_ids = None
        if any(p.has_penalties for p in params_list):
            outputs, prompts = [], []
            for r, p in enumerate(params_list):
                if not p.has_penalties:
                    continue
                out = output_token_ids[r] if output_token_ids is not None else None
                if out is None:
                    raise ValueError(f"row {r} has penalties but no output token ids were given")
                outputs.append((r, [t for t in out if t < vocab_size]))
                if p.repetition_penalty != 1.0:
                    prompt = prompt_token_ids[r] if prompt_token_ids is not None else None
                    if prompt is None:
                        raise ValueError(f"row {r} has a repetition penalty but no prompt token ids were given")
                    prompts.append((r, [t for t in prompt if t < vocab_size]))
            rows, ids = _flat(outputs)
            output_rows, output_ids = to_device(rows, device, torch.int64), to_device(ids, device, torch.int64)
            rows, ids = _flat(prompts)
            prompt_rows, prompt_ids = to_device(rows, device, torch.int64), to_device(ids, device, torch.int64)
            presence = to_device([float(p.presence_penalty) for p in params_list], device, torch.float32)
            frequency = to_device([float(p.frequency_penalty) for p in params_list], device, torch.float32)
            repetition = to_device([float(p.repetition_penalty) for p in params_list], device, torch.float32)

        return cls(bias_rows, bias_cols, bias_values, allowed_rows, allowed_cols, restricted, output_rows,
                   output_ids, prompt_rows, prompt_ids, presence, frequency, repetition)

    def apply(self, work: torch.Tensor) -> torch.Tensor:
        """Adjust float32 logits `work` [B, V] in place (allowed tokens, logit bias, penalties)."""
        if self.restricted is not None:
            keep = torch.zeros_like(work, dtype=torch.bool)  # [B, V]
            keep[self.allowed_rows, self.allowed_cols] = True
            keep |= ~self.restricted.unsqueeze(1)
            work.masked_fill_(~keep, float("-inf"))
        if self.bias_rows is not None:
            work.index_put_((self.bias_rows, self.bias_cols), self.bias_values, accumulate=True)
        if self.presence is not None:
            counts = torch.zeros_like(work)  # [B, V] occurrences in the output
            counts.index_put_((self.output_rows, self.output_ids), torch.ones_like(self.output_ids, dtype=work.dtype),
                              accumulate=True)
            seen = counts > 0  # [B, V]
            seen_rep = seen.clone()
            if self.prompt_rows.numel():
                seen_rep[self.prompt_rows, self.prompt_ids] = True
            rep = self.repetition.unsqueeze(1)  # [B, 1]
            penalised = torch.where(work > 0, work / rep, work * rep)
            work.copy_(torch.where(seen_rep, penalised, work))
            work.sub_(self.frequency.unsqueeze(1) * counts + self.presence.unsqueeze(1) * seen.to(work.dtype))
        return work
