"""Checking draft tokens against the target: greedy acceptance and speculative sampling.

A verification batch holds, for each of B requests, the target's logits at its k_b + 1 scored
positions (the request's last known token and its k_b drafts), flat `[R, V]`. Row j of request b
(j < k_b) predicts the token the drafter proposed as draft j+1; row k_b is the bonus position.

- Greedy requests: draft j+1 is accepted while it equals the target's argmax at row j (after the
  same min_tokens bans plain decoding applies); the token after the accepted prefix is the
  argmax at the first mismatching row, or at the bonus row. The output is the plain greedy one.
  (p, and the greedy argmax, are taken after each row's logit adjustments too: logit_bias and
  allowed_token_ids, and the penalties, bad words and grammar mask of the tokens before the row
  (the request's output and the drafts before it, which it follows only when they are accepted).
  The drafter drafts without them: only its acceptance rate changes.)
- Random requests without a seed (speculative sampling): with p the target's and q the
  drafter's processed distribution at a row, draft d is accepted with probability
  min(1, p(d)/q(d)) (u q(d) <= p(d), u ~ U[0, 1)); at the first rejection the token is drawn
  from the normalised positive part of p - q, after k_b acceptances from p at the bonus row.
  Every emitted token is then distributed exactly as under p, whatever q is.
- Seeded random requests (coupling): each row draws the token plain sampling would draw at its
  output index, `argmax p / E_i` with the seed's noise `E_i` (lamina.kernels.seeded_noise), and
  a draft is accepted when it equals that token. The drafter drew it with the same `E_i`
  (`sample_drafts`), so it matches whenever q's race and p's race agree; the text is the plain
  seeded text whatever K is (fixed, auto, or no speculation), a little fewer acceptances than
  rejection sampling's min(1, p/q) in exchange.

`verify_drafts` runs every row of every request at once (no per-token loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.worker.sampler import (LogprobsTensors, Sampler, SamplerOutput, SamplingBatch, _exponential_race,
                                   apply_bans_and_adjustments, check_logprobs_mode, reported_values, seeded_race)
from lamina.worker.sampling_rng import unseeded_generator


@dataclass
class VerifyOutput:
    num_accepted: torch.Tensor  # [B] long
    tokens: torch.Tensor  # [B, Kmax+1] long: emitted tokens; the first num_accepted+1 are valid
    row_tokens: torch.Tensor  # [R] long: the token emitted at each row (valid up to the accepted prefix)
    logprobs: LogprobsTensors | None  # per row, of `row_tokens`, when any row asked for logprobs
    num_logprobs: list[int | None]

    def row_logprobs_lists(self) -> list[dict[int, float] | None]:
        """Per-row logprob dicts (host sync), in the sampler's format."""
        return SamplerOutput(self.row_tokens, self.logprobs, self.num_logprobs).logprobs_lists()


def _uniforms(num_rows: int, batch: SamplingBatch, device) -> torch.Tensor:
    """U[0, 1) per row, from the engine's stream of unseeded requests (rows without a seed use them)."""
    return torch.rand(num_rows, device=device, generator=unseeded_generator(device))  # [R]


def normalised_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The processed distribution (temperature, top-k/p, min-p) of every row, summing to 1 [N, V]."""
    probs = Sampler.probs(logits.float().clone(), batch)  # [N, V]
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)


def verify_drafts(
    logits: torch.Tensor,
    rows: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    row_draft: torch.Tensor,
    num_drafts: torch.Tensor,
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> VerifyOutput:
    """Args:
        logits: `[R, V]` target logits of the scored rows;
        rows: `[B, W]` long (W = Kmax + 1): flat row of (request b, position j), any valid row
            where j > k_b; row_req / row_pos: `[R]` long, the (b, j) of each row;
        row_draft: `[R]` long: the draft checked at the row (-1 at bonus rows);
        num_drafts: `[B]` long, k_b; batch: sampling metadata built per row (R rows, min_tokens
            counted per position);
        draft_probs: `[R, V]` q of the draft at each draft row (needed when any row is random
            and has no seed);
        logprobs_mode: what the rows' logprobs report (`lamina.worker.sampler.LOGPROBS_MODES`; the
            processed values are the target's distribution each row's token is checked against).
    """
    num_rows = logits.shape[0]
    width = rows.shape[1]
    work = logits.float().clone()  # [R, V]
    wanted = batch.max_num_logprobs is not None
    processed = check_logprobs_mode(logprobs_mode).startswith("processed")
    reported = reported_values(work, logprobs_mode) if wanted and not processed else None  # [R, V]
    apply_bans_and_adjustments(work, batch)  # min_tokens bans, logit_bias, allowed_token_ids (per row)
    if wanted and processed:  # greedy rows: the banned logits; random rows: after temperature and filters
        final = work if batch.all_greedy else torch.where(
            batch.greedy[:, None], work, Sampler.filtered_logits(work.clone(), batch))  # [R, V]
        reported = reported_values(final, logprobs_mode)  # [R, V]
    greedy_tokens = work.argmax(dim=-1)  # [R]
    has_draft = row_draft >= 0  # [R]
    draft = row_draft.clamp(min=0)  # [R]
    greedy_accept = (greedy_tokens == draft) & has_draft  # [R]

    if batch.all_greedy:
        accept, final = greedy_accept, greedy_tokens
    else:
        p = normalised_probs(work, batch)  # [R, V]
        if batch.num_greedy + len(batch.seeded_rows) < num_rows:  # random rows without a seed
            if draft_probs is None:
                raise ValueError("random rows without a seed need the drafter's probabilities (draft_probs)")
            q = draft_probs.float()  # [R, V]
            p_d = p.gather(1, draft[:, None])[:, 0]  # [R]
            q_d = q.gather(1, draft[:, None])[:, 0]  # [R]
            u = _uniforms(num_rows, batch, logits.device)  # [R]
            random_accept = has_draft & (q_d > 0) & (p_d > 0) & (u * q_d <= p_d)  # [R]: never a token p rules out (u = 0)
            residual = torch.where(has_draft[:, None], (p - q).clamp_min(0.0), p)  # [R, V]
            residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)  # p == q: never used
            sampled = _exponential_race(residual, batch, seeded=False)  # [R]
        else:
            random_accept, sampled = torch.zeros_like(has_draft), greedy_tokens  # every random row is seeded
        if batch.seeded is not None:
            seeded_rows = batch.seeded[0]  # [S]
            coupled = seeded_race(p.index_select(0, seeded_rows), batch)  # [S]
            sampled = sampled.index_copy(0, seeded_rows, coupled)  # [R]
            random_accept = random_accept.index_copy(
                0, seeded_rows, has_draft.index_select(0, seeded_rows) & (draft.index_select(0, seeded_rows) == coupled))
        accept = torch.where(batch.greedy, greedy_accept, random_accept)
        final = torch.where(batch.greedy, greedy_tokens, sampled)

    cols = torch.arange(width, device=logits.device)  # [W]
    is_draft_col = cols[None, :] < num_drafts[:, None]  # [B, W]
    accepted = accept[rows] & is_draft_col  # [B, W]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    draft_cols = torch.where(has_draft, row_draft, 0)[rows]  # [B, W]: draft checked at (b, j)
    tokens = torch.where(cols[None, :] < num_accepted[:, None], draft_cols, final[rows])  # [B, W]
    row_tokens = tokens[row_req, row_pos]  # [R]
    lp = None
    if reported is not None:
        lp = Sampler._gather_logprobs(reported, row_tokens, batch.max_num_logprobs)
    return VerifyOutput(num_accepted, tokens, row_tokens, lp, list(batch.num_logprobs))


def sample_drafts(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens from the drafter's logits [B, V]: argmax for greedy rows, a draw from the
    processed distribution q otherwise. Returns (tokens [B], q [B, V] or None when all greedy)."""
    greedy_tokens = logits.float().argmax(dim=-1)  # [B]
    if batch.all_greedy:
        return greedy_tokens, None
    q = normalised_probs(logits, batch)  # [B, V]
    sampled = _exponential_race(q.clone(), batch)  # [B]
    return torch.where(batch.greedy, greedy_tokens, sampled), q
