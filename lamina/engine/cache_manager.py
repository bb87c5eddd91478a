"""Cache bookkeeping (pure integers): paged KV blocks for attention layers, fixed state slots for
recurrent layers. The tensors themselves live on the workers; this only decides who owns what."""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"number of KV cache blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


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
    """Per request: a block table covering its computed tokens, and one recurrent-state slot."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.blocks = BlockAllocator(num_blocks)
        self.slots = SlotAllocator(num_state_slots)
        self._tables: dict[str, list[int]] = {}
        self._slot_of: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def allocate(self, request_id: str, total_tokens: int) -> bool:
        """Grow the request's block table to cover `total_tokens` (taking a state slot on first use).
        Returns False, changing nothing, when blocks or slots are short."""
        table = self._tables.get(request_id, [])
        extra = self.blocks_needed(total_tokens) - len(table)
        new_request = request_id not in self._slot_of
        if extra > self.blocks.num_free or (new_request and self.slots.num_free == 0):
            return False
        if new_request:
            self._slot_of[request_id] = self.slots.allocate()
            self._tables[request_id] = table
        if extra > 0:
            table.extend(self.blocks.allocate(extra))
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

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.blocks.free(table)
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self.slots.free(slot)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def state_slot(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def usage(self) -> float:
        """Fraction of KV blocks in use."""
        return 1.0 - self.blocks.num_free / self.blocks.num_blocks
