"""Prefix caching for hybrid models (pure integers): what a prompt's first P tokens left behind, kept
after the request that computed them, so that a later prompt starting with the same P tokens
starts at position P.

A hybrid layer stack leaves two kinds of cache behind a prefix: KV rows of the attention layers
(paged, one row per position) and the recurrent state of the delta-net layers (one state per
request, overwritten in place as the request advances). So an entry holds both:
- the KV blocks covering positions [0, P), shared (reference-counted) with the request that wrote
  them and with every request that starts from the entry: P is a multiple of the block size, so
  these blocks are full and nobody writes into them again;
- a state slot of its own holding a copy of the request's recurrent state right after position
  P - 1 (a whole-slot copy of every state layer, `StepPlan.state_copies`).

A state can only be copied between steps, so P is where one of the request's prompt chunks ended:
the scheduler ends prompt chunks on block boundaries, and stops a prompt's last chunk at its last
block boundary (the rest, at most one block, runs in the next step) where no entry exists there yet.
The copy is planned by the step after the chunk's (before that step's forward, when the slot holds
the state after the chunk) and the entry serves prompts from the step after that.

Entries live in whatever blocks and slots running requests leave free; the least recently used one
goes first when a request needs them. Keys are chained hashes of the token blocks (with an optional
salt, vLLM's `cache_salt`); a hit compares the tokens themselves too.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int, salt: str | None,
                 known: list[int] | None = None) -> list[int]:
    """Hashes of token_ids[:k * block_size] for k = 1..num_blocks, each over its predecessor and
    its block; `known` holds the first ones already computed (extended, not recomputed)."""
    hashes = list(known) if known else []
    previous = hashes[-1] if hashes else hash(("lamina-prefix", salt))
    for k in range(len(hashes), num_blocks):
        previous = hash((previous, tuple(token_ids[k * block_size : (k + 1) * block_size])))
        hashes.append(previous)
    return hashes


@dataclass(eq=False)
class PrefixEntry:
    key: int  # chained hash of the P tokens (PrefixCache.entries' key)
    num_tokens: int  # P, a multiple of the block size
    token_ids: tuple[int, ...]  # the P tokens (a hit compares them: hashes alone could be forged)
    salt: str | None
    blocks: list[int]  # KV blocks covering positions [0, P), one reference held by the entry
    slot: int  # the state after position P - 1, once copied
    usable_from_step: int  # plans before this one may still be copying into `slot`
    last_used: int = 0
    hits: int = 0


@dataclass
class PrefixCache:
    block_size: int
    min_tokens: int  # no entries shorter than this (a short prefix costs more to cut than to recompute)
    entries: dict[int, PrefixEntry] = field(default_factory=dict)  # chained hash of tokens[:P] -> entry
    pending_copies: list[tuple[int, int]] = field(default_factory=list)  # (request slot, entry slot), next plan
    _clock: int = 0

    def touch(self, entry: PrefixEntry) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def find(self, hashes: list[int], token_ids: list[int], salt: str | None, max_tokens: int,
             step: int) -> PrefixEntry | None:
        """The longest usable entry that `token_ids` starts with, of at most `max_tokens` tokens."""
        for k in range(min(len(hashes), max_tokens // self.block_size), 0, -1):
            entry = self.entries.get(hashes[k - 1])
            if (entry is not None and entry.usable_from_step <= step and entry.salt == salt
                    and entry.num_tokens == k * self.block_size
                    and entry.token_ids == tuple(token_ids[: entry.num_tokens])):
                return entry
        return None

    def holds(self, key: int) -> bool:
        return key in self.entries

    def evictable(self, step: int, pinned: PrefixEntry | None = None) -> PrefixEntry | None:
        """The least recently used entry no copy is pending for (None when there is none)."""
        candidates = [e for e in self.entries.values() if e.usable_from_step <= step and e is not pinned]
        return min(candidates, key=lambda e: e.last_used) if candidates else None

    def remove(self, entry: PrefixEntry) -> None:
        del self.entries[entry.key]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
