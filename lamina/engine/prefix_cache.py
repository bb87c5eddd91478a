"""Prefix caching for hybrid models (pure integers): what a prompt's first P tokens left behind, kept
after the request that computed them, so that a later prompt starting with the same P tokens
starts at position P.

A hybrid layer stack leaves two kinds of cache behind a prefix: KV rows of the attention layers
(paged, one row per position) and the recurrent state of the delta-net layers (one state per
request, overwritten in place as the request advances). So an entry holds both:
- the KV blocks covering positions [0, P): the full ones shared (reference-counted) with the request
  that wrote them and with every request that starts from the entry (nobody writes into a full
  block again); where P is not a multiple of the block size, the last, partial one copied into a
  block of the entry's own (its request goes on writing into it), and copied again into a block of
  each request that starts from the entry;
- a state slot of its own holding a copy of the request's recurrent state right after position
  P - 1 (a whole-slot copy of every state layer, `StepPlan.state_copies`).

A state can only be copied between steps, so P is where one of the request's chunks ended: the
scheduler ends prompt chunks cut short by the budget on block boundaries, and stops a prompt's last
chunk one token short of its end, where no entry exists yet: the last token then runs by itself in
the next step (a one-token step: a decode graph's on CUDA) and samples the first token, and the
same prompt again starts from the entry with that one token. The copies are planned by the step
after the chunk's (before that step's forward, when the slot and the partial block hold what the
chunk left) and the entry serves prompts from the step after that.

Shared-prefix checkpoints (`junctions`): prompts that share only their start (a system prompt, a
few-shot preamble) and then differ never end a chunk where they part, so without more they would
share nothing. The cache therefore remembers the chained block hashes of recent prompts (`seen`, a
bounded LRU set); a new prompt whose first J blocks were seen in an earlier prompt, J blocks past
where it starts, cuts its chunk at that junction (J blocks) once, and the entry kept there serves
every later prompt with the same start (vLLM's shared-prefix checkpoint of hybrid models).

Entries live in whatever blocks and slots running requests leave free; the least recently used one
goes first when a request needs them. Entries are found by chained hashes of their full token blocks
(with an optional salt, vLLM's `cache_salt`), several entries (different tails) under one hash; a
hit compares the tokens themselves too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_SEEN_BLOCKS = 1 << 16  # block hashes of recent prompts remembered for junctions (~8 MB of ints)


def _chain_seed(salt: str | None) -> int:
    return hash(("lamina-prefix", salt))


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int, salt: str | None,
                 known: list[int] | None = None) -> list[int]:
    """Hashes of token_ids[:k * block_size] for k = 1..num_blocks, each over its predecessor and
    its block; `known` holds the first ones already computed (extended, not recomputed)."""
    hashes = list(known) if known else []
    previous = hashes[-1] if hashes else _chain_seed(salt)
    for k in range(len(hashes), num_blocks):
        previous = hash((previous, tuple(token_ids[k * block_size : (k + 1) * block_size])))
        hashes.append(previous)
    return hashes


@dataclass(eq=False)
class PrefixEntry:
    key: int  # chained hash of the entry's full blocks (PrefixCache.entries' key)
    num_tokens: int  # P
    token_ids: tuple[int, ...]  # the P tokens (a hit compares them: hashes alone could be forged)
    salt: str | None
    blocks: list[int]  # KV blocks covering positions [0, P): full ones shared, a partial last one its own
    slot: int  # the state after position P - 1, once copied
    usable_from_step: int  # plans before this one may still be copying into `slot` / its partial block
    last_used: int = 0
    hits: int = 0


@dataclass
class PrefixCache:
    block_size: int
    min_tokens: int  # no entries shorter than this (a short prefix costs more to cut than to recompute)
    entries: dict[int, list[PrefixEntry]] = field(default_factory=dict)  # full blocks' chained hash -> entries
    # copies the next plan runs before its step's forward: (request slot, entry slot) and
    # (request block, entry block) of a partial last block
    pending_state_copies: list[tuple[int, int]] = field(default_factory=list)
    pending_block_copies: list[tuple[int, int]] = field(default_factory=list)
    junctions: bool = True  # cut prompts where they part from an earlier prompt (see the module docstring)
    # chained full-block hashes of recent prompts, least recently seen first
    seen: OrderedDict = field(default_factory=OrderedDict)
    max_seen: int = MAX_SEEN_BLOCKS
    _clock: int = 0

    @staticmethod
    def key_of(hashes: list[int], num_tokens: int, block_size: int, salt: str | None) -> int:
        """The entries' key for the first `num_tokens` tokens: the chained hash of their full blocks."""
        full = num_tokens // block_size
        return hashes[full - 1] if full else _chain_seed(salt)

    def all_entries(self) -> list[PrefixEntry]:
        return [e for bucket in self.entries.values() for e in bucket]

    def touch(self, entry: PrefixEntry) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def add(self, entry: PrefixEntry) -> None:
        self.touch(entry)
        self.entries.setdefault(entry.key, []).append(entry)

    def find(self, hashes: list[int], token_ids: list[int], salt: str | None, max_tokens: int,
             step: int) -> PrefixEntry | None:
        """The longest usable entry that `token_ids` starts with, of at most `max_tokens` tokens."""
        for full in range(min(len(hashes), max_tokens // self.block_size), 0, -1):
            best = None
            for entry in self.entries.get(hashes[full - 1], ()):
                if (entry.usable_from_step <= step and entry.salt == salt and entry.num_tokens <= max_tokens
                        and entry.num_tokens // self.block_size == full
                        and (best is None or entry.num_tokens > best.num_tokens)
                        and entry.token_ids == tuple(token_ids[: entry.num_tokens])):
                    best = entry
            if best is not None:
                return best
        return None

    def holds(self, key: int, token_ids: list[int], salt: str | None) -> bool:
        """Whether an entry of exactly these tokens exists (usable or not)."""
        tokens = tuple(token_ids)
        return any(e.token_ids == tokens and e.salt == salt for e in self.entries.get(key, ()))

    def evictable(self, step: int, pinned: PrefixEntry | None = None) -> PrefixEntry | None:
        """The least recently used entry no copy is pending for (None when there is none)."""
        candidates = [e for e in self.all_entries() if e.usable_from_step <= step and e is not pinned]
        return min(candidates, key=lambda e: e.last_used) if candidates else None

    def remove(self, entry: PrefixEntry) -> None:
        bucket = self.entries[entry.key]
        bucket.remove(entry)
        if not bucket:
            del self.entries[entry.key]

    def junction(self, hashes: list[int], max_blocks: int) -> int:
        """Blocks of the longest start of a prompt (`hashes`: its chained full-block hashes, at most
        `max_blocks` of them) that an earlier prompt had too (0: none), then the prompt's own blocks
        remembered. Chained hashes: a block's hash is seen only if every block before it matched."""
        found = 0
        if self.junctions:
            for full in range(min(len(hashes), max_blocks), 0, -1):
                if hashes[full - 1] in self.seen:
                    found = full
                    break
            for h in hashes:
                self.seen[h] = None
                self.seen.move_to_end(h)
            while len(self.seen) > self.max_seen:
                self.seen.popitem(last=False)
        return found

    def take_pending_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(state copies, block copies) for the plan being made."""
        copies = self.pending_state_copies, self.pending_block_copies
        self.pending_state_copies, self.pending_block_copies = [], []
        return copies
