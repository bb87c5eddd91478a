"""Token sampler: turns last-position logits into next tokens.

The runner builds a :class:`SamplingBatch` once per step on the host from the
sampling requests' :class:`~lamina.sampling_params.SamplingParams`, then calls
:class:`Sampler` on the model's logits.  The pipeline, per row, is:

1. (optional) raw logprobs: ``log_softmax`` of the unmodified logits in
   float32, top-N and the sampled token's logprob/rank are reported from these
   (or, by the engine's ``logprobs_mode``, from the raw logits, or from the
   processed values of the rows' last stage below: ``LOGPROBS_MODES``);
2. bans: EOS ids (unless ``ignore_eos``) and ``stop_token_ids`` while the
   request has generated fewer than ``min_tokens`` tokens, and the bad words
   whose other tokens the output ends with, are set to ``-inf``;
   then the per-request adjustments of :mod:`lamina.worker.logits_processors`
   (``allowed_token_ids``, ``logit_bias``, presence / frequency / repetition
   penalties);
3. greedy rows take the argmax of the (banned) logits;
4. other rows: divide by temperature, top-k mask, top-p mask, min-p mask, then
   draw a token with the exponential race ``argmax(p / E)`` with
   ``E ~ Exponential(1)`` i.i.d. per token, which samples exactly from ``p``.

A seeded row's noise is a function of its seed, the output index of the token
it samples and the token id (lamina.kernels.seeded_noise): the same draw alone
or in any batch, with or without speculative decoding, before or after a
preemption.  All other rows share one draw from the global RNG.  Nothing in the
common path syncs the device with the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from lamina.config import LOGPROBS_MODES
from lamina.host_to_device import to_device
from lamina.outputs import Logprob
from lamina.sampling_params import SamplingParams
from lamina.worker.logits_processors import LogitAdjustments, bad_word_bans
from lamina.kernels.seeded_noise import fill_seeded_exponential, seed_key
from lamina.worker.sampling_rng import unseeded_generator
from lamina.worker.top_k_top_p import TOP_K_WINDOW, apply_min_p, filter_top_k_top_p

__all__ = [
    "SamplingBatch",
    "Sampler",
    "SamplerOutput",
    "LogprobsTensors",
]


# ---------------------------------------------------------------------- #
# Batch metadata
# ---------------------------------------------------------------------- #
@dataclass
class SamplingBatch:
    """Per-step sampling metadata for a batch of ``B`` requests (rows).

    Build it with :meth:`build`; the fields are documented there.  Host-side
    flags (``all_greedy``, ``need_min_p``, ``window_rows`` ...) let the sampler skip whole
    stages without touching the device.
    """

    temperature: torch.Tensor  # [B] float32, 1.0 on greedy rows
    top_k: torch.Tensor  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor  # [B] float32, 0.0 where disabled
    greedy: torch.Tensor  # [B] bool
    ban_rows: torch.Tensor  # [M] int64, row index of each banned (row, token) pair
    ban_cols: torch.Tensor  # [M] int64, token id of each banned pair
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    num_greedy: int
    need_min_p: bool
    num_logprobs: list[int | None]  # per row, None when not requested
    max_num_logprobs: int | None  # max over rows, None when no row asked
    seeded_rows: list[int] = field(default_factory=list)  # non-greedy rows with a seed (host)
    # [3, S] int64 (S = len(seeded_rows)): each seeded row's index, seed key and the output index
    # of the token it samples (lamina.kernels.seeded_noise); None when S = 0
    seeded: torch.Tensor | None = None
    # the sampler's own kernels, 'torch' or 'triton' (lamina.kernels.selection.sampler_kernels): seeded
    # rows' noise, the top-k window's cut
    sampler_kernels: str = "torch"
    adjustments: LogitAdjustments | None = None  # allowed tokens, logit bias, penalties
    bitmask_rows: torch.Tensor | None = None  # [R] int64, rows with a structured-output token mask
    bitmask: torch.Tensor | None = None  # [R, ceil(V/32)] int32, bit t of a row: token t allowed
    # top-k / top-p, by each sampling row's own options (never by the batch): rows with top_k <=
    # TOP_K_WINDOW take `window_cut` (a top-k of that fixed width), rows with a wider top-k or none
    # (top-p alone) the sort (`sorted_cut`) or the search cut (lamina.worker.top_k_top_p.
    # filter_top_k_top_p); host lists, and their device indices when a group is not the whole batch
    # (None otherwise)
    window_rows: list[int] = field(default_factory=list)
    wide_rows: list[int] = field(default_factory=list)
    window_index: torch.Tensor | None = None  # [len(window_rows)] int64
    wide_index: torch.Tensor | None = None  # [len(wide_rows)] int64

    @property
    def batch_size(self) -> int:
        return len(self.num_logprobs)

    @property
    def has_bans(self) -> bool:
        return self.ban_rows.numel() > 0

    def with_noise_positions(self, positions: torch.Tensor) -> "SamplingBatch":
        """This batch with its seeded rows' output indices replaced by `positions` `[B]` (device,
        one per row; read at the seeded rows): for positions known only on the device."""
        if self.seeded is None:
            return self
        rows, keys, _ = self.seeded
        return replace(self, seeded=torch.stack([rows, keys, positions.index_select(0, rows)]))  # [3, S]

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_lens: Sequence[int],
        eos_token_ids: Sequence[int],
        device: torch.device | str,
        vocab_size: int,
        output_token_ids: Sequence[Sequence[int] | None] | None = None,
        prompt_token_ids: Sequence[Sequence[int] | None] | None = None,
        token_bitmasks: Sequence | None = None,
        sampler_kernels: str = "torch",
    ) -> SamplingBatch:
        """Collect per-request sampling options into batched tensors.

        Args:
            params_list: One :class:`SamplingParams` per row.
            output_lens: Number of tokens each request has generated so far
                (``min_tokens``, and a seeded row's output index; see
                :meth:`with_noise_positions` for indices known on the device).
            eos_token_ids: The model's EOS token ids.
            device: Device of the logits the sampler will receive.
            vocab_size: Number of valid token ids (normally the logits' last
                dimension). Disabled top-k rows get ``top_k = vocab_size``;
                banned ids ``>= vocab_size`` are ignored.
            output_token_ids: Per row, the tokens generated so far (read by rows
                with penalties or bad words; ``None`` elsewhere).
            prompt_token_ids: Per row, the prompt (read by rows with a
                repetition penalty; ``None`` elsewhere).
            token_bitmasks: Per row, the structured-output mask of allowed
                tokens (int32 array of ``ceil(V/32)`` words) or ``None``.
            sampler_kernels: The sampler's kernels (seeded noise, the top-k
                window's cut), ``'torch'`` or
                ``'triton'`` (the engine's choice, made once:
                :func:`lamina.kernels.selection.sampler_kernels`).
        """
        bsz = len(params_list)
        if vocab_size >= 1 << 24:
            raise ValueError(f"vocab_size = {vocab_size}: top-k travels as float32, exact only below 2**24")
        if len(output_lens) != bsz:
            raise ValueError(f"output_lens has {len(output_lens)} entries, expected {bsz}")

        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        greedy: list[bool] = []
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        num_logprobs: list[int | None] = []
        seeded_rows: list[int] = []

        for row, (p, out_len) in enumerate(zip(params_list, output_lens)):
            is_greedy = p.greedy
            greedy.append(is_greedy)
            temps.append(1.0 if is_greedy else float(p.temperature))
            top_ks.append(min(int(p.top_k), vocab_size) if p.top_k > 0 else vocab_size)
            top_ps.append(float(p.top_p))
            min_ps.append(float(p.min_p))
            num_logprobs.append(None if p.logprobs is None else vocab_size if p.logprobs == -1 else int(p.logprobs))
            if p.seed is not None and not is_greedy:
                seeded_rows.append(row)
            banned = set()
            if out_len < p.min_tokens:  # EOS too with ignore_eos, as vLLM bans it
                banned.update(p.stop_token_ids)
                banned.update(int(t) for t in eos_token_ids)
            if p.bad_words_token_ids:
                outputs = output_token_ids[row] if output_token_ids is not None else None
                if outputs is None:
                    raise ValueError(f"row {row} has bad words but no output token ids were given")
                banned.update(bad_word_bans(p.bad_words_token_ids, outputs))
            if banned:
                for tok in sorted(banned):
                    if 0 <= tok < vocab_size:
                        ban_rows.append(row)
                        ban_cols.append(tok)

        # Flags computed only over rows that actually sample.
        sampling_rows = [i for i in range(bsz) if not greedy[i]]
        requested = [n for n in num_logprobs if n is not None]

        adjustments = LogitAdjustments.build(params_list, output_token_ids, prompt_token_ids, device, vocab_size)
        bitmask_rows = bitmask = None
        masked = [(r, m) for r, m in enumerate(token_bitmasks or []) if m is not None]
        if masked:
            import numpy as np

            bitmask_rows = to_device([r for r, _ in masked], device, torch.int64)
            bitmask = to_device(np.stack([np.asarray(m, dtype=np.int32) for _, m in masked]), device, torch.int32)

        # One upload for the per-row numbers (a decode step's host time is mostly copies like
        # these): [5, B] float32 rows temperature, top_p, min_p, top_k (exact below 2^24), greedy.
        packed = to_device([temps, top_ps, min_ps, top_ks, greedy], device, torch.float32).reshape(5, bsz)  # [5, B]
        if ban_rows:
            bans = to_device([ban_rows, ban_cols], device, torch.int64)  # [2, M]
        else:
            bans = torch.empty(2, 0, dtype=torch.int64, device=device)  # [2, 0]: nothing to copy
        filtered = [i for i in sampling_rows if top_ks[i] < vocab_size or top_ps[i] < 1.0]
        window_rows = [i for i in filtered if top_ks[i] <= TOP_K_WINDOW]
        wide_rows = [i for i in filtered if top_ks[i] > TOP_K_WINDOW]  # top-p alone: top_k is the vocabulary
        window_index, wide_index = (to_device(rows, device, torch.int64) if 0 < len(rows) < bsz else None
                                    for rows in (window_rows, wide_rows))
        seeded = None
        if seeded_rows:
            seeded = to_device([seeded_rows, [seed_key(params_list[r].seed) for r in seeded_rows],
                                [output_lens[r] for r in seeded_rows]], device, torch.int64)  # [3, S]
        return cls(
            temperature=packed[0],
            top_k=packed[3].to(torch.int64),
            top_p=packed[1],
            min_p=packed[2],
            greedy=packed[4] != 0,
            ban_rows=bans[0],
            ban_cols=bans[1],
            vocab_size=vocab_size,
            all_greedy=not sampling_rows,
            any_greedy=any(greedy),
            num_greedy=sum(greedy),
            need_min_p=any(min_ps[i] > 0.0 for i in sampling_rows),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
            seeded_rows=seeded_rows,
            seeded=seeded,
            sampler_kernels=sampler_kernels,
            adjustments=None if adjustments.empty else adjustments,
            bitmask_rows=bitmask_rows,
            bitmask=bitmask,
            window_rows=window_rows,
            wide_rows=wide_rows,
            window_index=window_index,
            wide_index=wide_index,
        )


# ---------------------------------------------------------------------- #
# Outputs
# ---------------------------------------------------------------------- #
@dataclass
class LogprobsTensors:
    """Raw logprobs of one step, still on the device.

    ``N`` is the largest number of logprobs any row asked for; rows that asked
    for fewer just ignore the trailing columns.
    """

    sampled_logprobs: torch.Tensor  # [B] float32, logprob of the sampled token
    sampled_ranks: torch.Tensor  # [B] int64, 1-based rank of the sampled token
    top_token_ids: torch.Tensor  # [B, N] int64, most likely tokens, best first
    top_logprobs: torch.Tensor  # [B, N] float32


@dataclass
class SamplerOutput:
    """Result of one sampler call.

    Attributes:
        token_ids: ``[B]`` int64 sampled tokens (on the logits' device).
        logprobs: Raw logprobs when any row asked for them, else ``None``.
        num_logprobs: Per-row requested count (``None`` = not requested).
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None = None
    num_logprobs: list[int | None] = field(default_factory=list)

    def logprobs_lists(self) -> list[dict[int, float] | None]:
        """Per-row ``{token_id: logprob}`` dicts (host sync happens here).

        Each dict holds the sampled token first, followed by the row's top-N
        tokens in decreasing probability (a top-N token equal to the sampled
        one appears once), so it has N or N+1 entries.  Rows that did not ask
        for logprobs get ``None``.
        """
        if self.logprobs is None:
            return [None] * len(self.num_logprobs)
        lp = self.logprobs
        sampled = self.token_ids.tolist()
        sampled_lp = lp.sampled_logprobs.tolist()
        sampled_rank = lp.sampled_ranks.tolist()
        top_ids = lp.top_token_ids.tolist()
        top_lps = lp.top_logprobs.tolist()
        result: list[dict[int, float] | None] = []
        for row, n in enumerate(self.num_logprobs):
            if n is None:
                result.append(None)
                continue
            entry = {sampled[row]: Logprob(sampled_lp[row], sampled_rank[row])}
            for rank, (tok, val) in enumerate(zip(top_ids[row][:n], top_lps[row][:n]), start=1):
                entry.setdefault(tok, Logprob(val, rank))
            result.append(entry)
        return result

    def sampled_ranks_list(self) -> list[int | None]:
        """Per-row 1-based rank of the sampled token (None if not requested)."""
        if self.logprobs is None:
            return [None] * len(self.num_logprobs)
        ranks = self.logprobs.sampled_ranks.tolist()
        return [None if n is None else ranks[i] for i, n in enumerate(self.num_logprobs)]


# ---------------------------------------------------------------------- #
# Sampler
# ---------------------------------------------------------------------- #
def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode = {mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
    return mode


def reported_values(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """float32 `logits` [B, V] as `mode` reports them (log_softmax for the *_logprobs modes)."""
    return torch.log_softmax(logits, dim=-1) if mode.endswith("logprobs") else logits.clone()


class Sampler:
    """Stateless sampler; call it with ``(logits, batch)``. `logprobs_mode`: `LOGPROBS_MODES`."""

    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` logits of the last position, any float dtype.
            batch: Metadata built by :meth:`SamplingBatch.build`.

        Returns:
            :class:`SamplerOutput` with ``token_ids`` ``[B]`` and, if any row
            asked for them, raw logprobs.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        # float32 working copy; the raw logits are left untouched.
        work = logits.to(torch.float32, copy=True)  # [B, V]

        wanted = batch.max_num_logprobs is not None
        processed = self.logprobs_mode.startswith("processed")
        reported = reported_values(work, self.logprobs_mode) if wanted and not processed else None  # [B, V]

        apply_bans_and_adjustments(work, batch)

        if batch.all_greedy:
            token_ids = work.argmax(dim=-1)  # [B]
            if wanted and processed:
                reported = reported_values(work, self.logprobs_mode)  # [B, V]
        else:
            token_ids, final = self._sample(work, batch, keep_processed=wanted and processed)
            if final is not None:
                reported = reported_values(final, self.logprobs_mode)  # [B, V]

        lp = None
        if reported is not None:
            lp = self._gather_logprobs(reported, token_ids, batch.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=lp, num_logprobs=list(batch.num_logprobs))

    # -- stages ----------------------------------------------------------- #
    @staticmethod
    def _sample(work: torch.Tensor, batch: SamplingBatch,
                keep_processed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Random (and mixed greedy) sampling over the banned float32 logits. Returns the tokens [B]
        and, with `keep_processed`, the logits each row chose from [B, V] (random rows: after
        temperature and the filters; greedy rows: the banned logits)."""
        greedy_ids = work.argmax(dim=-1) if batch.any_greedy else None  # [B]
        banned = work.clone() if keep_processed and batch.any_greedy else None  # [B, V]
        filtered = Sampler.filtered_logits(work, batch)  # [B, V]
        final = None
        if keep_processed:
            final = filtered if banned is None else torch.where(batch.greedy[:, None], banned, filtered)
        sampled = _exponential_race(filtered.softmax(dim=-1), batch)  # [B]
        if greedy_ids is not None:
            sampled = torch.where(batch.greedy, greedy_ids, sampled)
        return sampled, final

    @staticmethod
    def probs(work: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution a random row samples from: temperature, min-p, then top-k / top-p
        (vLLM's order: top-p keeps its share of what min-p left), softmax, over the (banned)
        float32 logits `work` [B, V], which it modifies. Returns [B, V]. Speculative sampling
        verifies drafts against it."""
        return Sampler.filtered_logits(work, batch).softmax(dim=-1)  # [B, V]

    @staticmethod
    def filtered_logits(work: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`probs`'s logits before the softmax: temperature, min-p, top-k / top-p (removed tokens
        -inf), over the (banned) float32 logits `work` [B, V], which it modifies. Returns [B, V]."""
        work.div_(batch.temperature.unsqueeze(1))  # [B, V]
        if batch.need_min_p:
            below = apply_min_p(work.softmax(dim=-1), batch.min_p) == 0  # [B, V]
            work = work.masked_fill_(below, float("-inf"))
        if batch.window_rows or batch.wide_rows:
            work = filter_top_k_top_p(work, batch)
        return work  # [B, V]

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor, token_ids: torch.Tensor, max_n: int
    ) -> LogprobsTensors:
        """Top-``max_n`` reported values (raw logprobs by default) plus the sampled token's and its rank."""
        sampled_lp = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
        # Rank = 1 + number of tokens strictly more likely than the sampled one.
        ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1  # [B]
        top_lp, top_ids = raw_logprobs.topk(max_n, dim=-1)  # [B, N], [B, N]
        return LogprobsTensors(
            sampled_logprobs=sampled_lp.squeeze(1),  # [B]
            sampled_ranks=ranks,
            top_token_ids=top_ids,
            top_logprobs=top_lp,
        )


def apply_bans_and_adjustments(work: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set banned (row, token) pairs to -inf, then apply the rows' logit adjustments (in place).

    A structured-output row whose grammar allows only banned tokens (say its one way on is `{`, a
    stop token id still held back by min_tokens) would be left with nothing to sample (argmax of
    all -inf: token 0, outside the grammar): the grammar wins there, and the row takes its logits
    under the grammar's mask alone (decided on the device, no host sync)."""
    grammar_only = None
    if batch.bitmask is not None and (batch.has_bans or batch.adjustments is not None):
        grammar_only = apply_token_bitmask(work[batch.bitmask_rows].clone(), torch.arange(  # [R, V]
            batch.bitmask_rows.numel(), device=work.device), batch.bitmask)
    if batch.has_bans:
        work[batch.ban_rows, batch.ban_cols] = float("-inf")
    if batch.adjustments is not None:
        batch.adjustments.apply(work)
    if batch.bitmask is not None:
        apply_token_bitmask(work, batch.bitmask_rows, batch.bitmask)
    if grammar_only is not None:
        rows = work[batch.bitmask_rows]  # [R, V]
        stuck = torch.isneginf(rows).all(dim=-1, keepdim=True)  # [R, 1]: nothing left to sample
        work[batch.bitmask_rows] = torch.where(stuck, grammar_only, rows)
    return work


def apply_token_bitmask(work: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of tokens whose bit is clear to -inf, for the given rows (in place).

    Args:
        work: ``[B, V]`` float logits.
        rows: ``[R]`` int64 row indices.
        bitmask: ``[R, W]`` int32, ``W >= ceil(V / 32)``; bit ``t % 32`` of word ``t // 32`` set
            means token ``t`` is allowed.
    """
    num_rows, words = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(num_rows, words * 32)[:, : work.shape[1]].bool()  # [R, V]
    work[rows] = work[rows].masked_fill(~allowed, float("-inf"))
    return work


def _exponential_race(probs: torch.Tensor, batch: SamplingBatch, seeded: bool = True) -> torch.Tensor:
    """Draw one token per row from (unnormalised) ``probs`` [B, V].

    ``argmax_j p_j / E_j`` with ``E_j ~ Exponential(1)`` picks ``j`` with
    probability ``p_j / sum(p)``.  Seeded rows take their ``E`` from
    :func:`~lamina.kernels.seeded_noise.fill_seeded_exponential` (unless ``seeded``
    is False: their result is then not used), everything else from the
    engine's stream of unseeded requests (lamina.worker.sampling_rng).
    """
    bsz = probs.shape[0]
    noise = torch.empty_like(probs)  # [B, V]
    if len(batch.seeded_rows) < bsz or not seeded:
        noise.exponential_(generator=unseeded_generator(noise.device))
    if seeded and batch.seeded is not None:
        rows, keys, positions = batch.seeded  # [S] each
        fill_seeded_exponential(noise, rows, keys, positions, batch.sampler_kernels)
    return _race(probs, noise)


def seeded_race(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The exponential race of the batch's S seeded rows, `probs` [S, V] (in the order of
    `batch.seeded`; not modified), with their own noise. Returns [S] token ids."""
    _, keys, positions = batch.seeded  # [S] each
    noise = torch.empty_like(probs)  # [S, V]
    rows = torch.arange(probs.shape[0], device=probs.device)  # [S]
    return _race(probs.clone(), fill_seeded_exponential(noise, rows, keys, positions, batch.sampler_kernels))


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row, both [N, V] (modified in place)."""
    # An exact zero would turn 0/0 into NaN (which argmax would pick).
    noise.clamp_(min=torch.finfo(probs.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)  # [N]
