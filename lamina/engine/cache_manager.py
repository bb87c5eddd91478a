"""Cache bookkeeping (pure integers): paged KV blocks for attention layers, fixed state slots for
recurrent layers, and with prefix caching the entries that outlive their requests
(lamina/engine/prefix_cache.py). The tensors themselves live on the workers; this only decides
who owns what."""

from __future__ import annotations

from collections import deque

from lamina.engine.prefix_cache import PrefixCache, PrefixEntry, chain_hashes


class BlockAllocator:
    """KV blocks with reference counts: a block goes back to the free list when its last holder
    (a request's table or a prefix-cache entry) lets it go."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"number of KV cache blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} is free: nothing to share"
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} freed twice"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"number of recurrent state slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free recurrent state slot")
        return self._free.popleft()

    def free(self, slot: int) -> None:
        self._free.append(slot)


class CacheManager:
    """Per request: a block table covering its computed tokens, and one recurrent-state slot. With
    `prefix_caching`, prompt prefixes are kept for later prompts in the blocks and slots requests
    leave free (`prefix_cache_min_tokens`: the shortest prefix kept; `prefix_cache_junctions`: cut
    prompts where they part from an earlier prompt, lamina.engine.prefix_cache)."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, *, prefix_caching: bool = False,
                 prefix_cache_min_tokens: int = 256, prefix_cache_junctions: bool = True):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.blocks = BlockAllocator(num_blocks)
        self.slots = SlotAllocator(num_state_slots)
        self._tables: dict[str, list[int]] = {}
        self._slot_of: dict[str, int] = {}
        self.prefix = (PrefixCache(block_size, max(block_size, prefix_cache_min_tokens), junctions=prefix_cache_junctions)
                       if prefix_caching else None)
        # How many request tables hold each block, and how many blocks some table holds (usage())
        self._table_refs = [0] * num_blocks
        self._blocks_in_tables = 0
        self.step = 0  # the plan being made (Scheduler.schedule sets it through begin_step)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def _reclaim(self, num_blocks: int, num_slots: int, pinned: PrefixEntry | None = None) -> bool:
        """Evict prefix-cache entries, least recently used first, until `num_blocks` blocks and
        `num_slots` slots are free; whether they are."""
        def short() -> bool:
            return num_blocks > self.blocks.num_free or num_slots > self.slots.num_free

        while short() and self.prefix is not None:
            entry = self.prefix.evictable(self.step, pinned)
            if entry is None:
                break
            self._evict(entry)
        return not short()

    def _evict(self, entry: PrefixEntry) -> None:
        self.prefix.remove(entry)
        self.blocks.free(entry.blocks)
        self.slots.free(entry.slot)

    def allocate(self, request_id: str, total_tokens: int) -> bool:
        """Grow the request's block table to cover `total_tokens` (taking a state slot on first use),
        evicting prefix-cache entries where needed. Returns False, changing no request's cache, when
        blocks or slots are short."""
        table = self._tables.get(request_id, [])
        extra = self.blocks_needed(total_tokens) - len(table)
        new_request = request_id not in self._slot_of
        if not self._reclaim(extra, int(new_request)):
            return False
        if new_request:
            self._slot_of[request_id] = self.slots.allocate()
            self._tables[request_id] = table
        if extra > 0:
            blocks = self.blocks.allocate(extra)
            self._enter_tables(blocks)
            table.extend(blocks)
        return True

    def fork(self, src_id: str, dst_id: str, shared_tokens: int, total_tokens: int):
        """Give `dst_id` (no cache yet) a state slot and blocks for `total_tokens`, whose first
        blocks are to hold copies of `src_id`'s blocks covering its first `shared_tokens` tokens.
        Returns (block copies [(src block, dst block)], (src slot, dst slot)), or None, changing
        nothing, when blocks or slots are short. The copies themselves are the workers' job."""
        assert dst_id not in self._slot_of, f"{dst_id} already has a cache"
        src_table = self._tables[src_id]
        num_shared = self.blocks_needed(shared_tokens)
        assert num_shared <= len(src_table), "the source's blocks do not cover the shared tokens"
        if not self.allocate(dst_id, max(total_tokens, shared_tokens)):
            return None
        dst_table = self._tables[dst_id]
        copies = list(zip(src_table[:num_shared], dst_table[:num_shared]))
        return copies, (self._slot_of[src_id], self._slot_of[dst_id])

    # ---- prefix caching ------------------------------------------------------------------
    def begin_step(self, step: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """A new plan: the copies into the entries the last plan made, (state copies (request slot
        -> entry slot), block copies (request block -> entry block)), to run before this step's
        forward (the chunks that ended at them have run by then, nothing has written past them)."""
        self.step = step
        return self.prefix.take_pending_copies() if self.prefix is not None else ([], [])

    def prefix_hashes(self, token_ids: list[int], salt: str | None, known: list[int] | None) -> list[int]:
        """Chained hashes of every full block of `token_ids` (`known`: a prefix of them, reused)."""
        return chain_hashes(token_ids, self.block_size, len(token_ids) // self.block_size, salt, known)

    def find_prefix(self, hashes: list[int], token_ids: list[int], salt: str | None, max_tokens: int) -> PrefixEntry | None:
        if self.prefix is None:
            return None
        return self.prefix.find(hashes, token_ids, salt, max_tokens, self.step)

    def allocate_from_prefix(self, request_id: str, entry: PrefixEntry, total_tokens: int):
        """Give `request_id` (no cache yet) the entry's full blocks, shared, then blocks of its own up
        to `total_tokens` (the first holding a copy of the entry's partial last block, if it has one),
        and a state slot. Where that does not fit, the request takes the entry itself over (its slot
        and blocks, nothing to copy). Returns (the state copy (entry slot, request slot) or None, the
        block copies) to run before the step's forward, or None, changing no request's cache (other
        entries may have been evicted), when blocks or slots are short even so."""
        assert request_id not in self._slot_of, f"{request_id} already has a cache"
        full = entry.num_tokens // self.block_size
        extra = self.blocks_needed(total_tokens) - full
        if not self._reclaim(max(0, extra), 1, pinned=entry):
            return self._take_over(request_id, entry, total_tokens)
        shared = entry.blocks[:full]
        self.blocks.share(shared)
        self._tables[request_id] = table = shared + self.blocks.allocate(max(0, extra))
        self._enter_tables(table)
        self._slot_of[request_id] = self.slots.allocate()
        self.prefix.touch(entry)
        entry.hits += 1
        block_copies = [(entry.blocks[full], table[full])] if len(entry.blocks) > full else []
        return (entry.slot, self._slot_of[request_id]), block_copies

    def _take_over(self, request_id: str, entry: PrefixEntry, total_tokens: int):
        """The entry leaves the cache and becomes the request's cache: its slot holds the state, its
        blocks (its own partial one too) the KV; blocks up to `total_tokens` added. None, the entry
        kept, when even so blocks are short."""
        self.prefix.remove(entry)
        extra = self.blocks_needed(total_tokens) - len(entry.blocks)
        if not self._reclaim(max(0, extra), 0):
            self.prefix.add(entry)
            return None
        self._tables[request_id] = table = entry.blocks + self.blocks.allocate(max(0, extra))
        self._enter_tables(table)  # the entry's references become the table's
        self._slot_of[request_id] = entry.slot
        return None, []

    def can_keep_prefix(self, num_tokens: int, reserve_slots: int, reserve_blocks: int) -> bool:
        """Whether `keep_prefix` of `num_tokens` tokens may find a slot (and a block for a partial last
        one) without taking what `reserve_slots` / `reserve_blocks` stand for (see keep_prefix)."""
        if self.prefix is None or num_tokens < self.prefix.min_tokens:
            return False
        evictable = sum(1 for e in self.prefix.all_entries() if e.usable_from_step <= self.step)
        if self.slots.num_free + evictable <= reserve_slots:
            return False
        return num_tokens % self.block_size == 0 or self.blocks.num_free > reserve_blocks

    def holds_prefix(self, key: int, token_ids: list[int], salt: str | None) -> bool:
        return self.prefix is not None and self.prefix.holds(key, token_ids, salt)

    def keep_prefix(self, request_id: str, key: int, token_ids: list[int], salt: str | None,
                    reserve_slots: int = 0, reserve_blocks: int = 0) -> bool:
        """Keep the request's first P = `len(token_ids)` tokens (all computed once this plan's step
        has run) as an entry: its full blocks shared; a partial last block and the state copied by
        the next plan into a block and a slot of the entry's own (a free slot or the least recently
        used entry's; a free block), as long as `reserve_slots` slots stay free or held by entries
        that can be evicted (requests waiting for one come first: an entry cannot be evicted before
        its copies have run) and more than `reserve_blocks` blocks are free (one for each running
        request to grow into). Returns whether an entry was made."""
        num_tokens = len(token_ids)
        full, partial = divmod(num_tokens, self.block_size)
        if not self.can_keep_prefix(num_tokens, reserve_slots, reserve_blocks) or self.prefix.holds(key, token_ids, salt):
            return False
        if not self._reclaim(0, 1):
            return False
        table = self._tables[request_id]
        blocks = table[:full]
        self.blocks.share(blocks)
        if partial:
            own = self.blocks.allocate(1)
            self.prefix.pending_block_copies.append((table[full], own[0]))
            blocks = blocks + own
        entry = PrefixEntry(key=key, num_tokens=num_tokens, token_ids=tuple(token_ids), salt=salt, blocks=blocks,
                            slot=self.slots.allocate(), usable_from_step=self.step + 2)
        self.prefix.add(entry)
        self.prefix.pending_state_copies.append((self._slot_of[request_id], entry.slot))
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every entry and the prompts remembered for junctions (vLLM's reset_prefix_cache),
        between plans: copies into entries not yet
        planned are dropped with them; those planned already have run before any later plan's."""
        if self.prefix is not None:
            self.prefix.take_pending_copies()
            self.prefix.seen.clear()
            for entry in self.prefix.all_entries():
                self._evict(entry)
        return True

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.blocks.free(table)
            for b in table:
                self._table_refs[b] -= 1
                self._blocks_in_tables -= self._table_refs[b] == 0
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self.slots.free(slot)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def state_slot(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def _enter_tables(self, blocks: list[int]) -> None:
        for b in blocks:
            self._blocks_in_tables += self._table_refs[b] == 0
            self._table_refs[b] += 1

    def usage(self) -> float:
        """Fraction of KV blocks in use by requests (blocks only prefix-cache entries hold can be
        taken back at any time, so they count as free, as in vLLM)."""
        return self._blocks_in_tables / self.blocks.num_blocks
