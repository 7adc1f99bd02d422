"""Block pool: KV-cache blocks with ref counts, a free queue in LRU order, and the prefix index.

A block whose ref_cnt drops to 0 goes to the tail of the free queue but keeps
its block hash, so a later request with the same prefix can take it back
(`touch`). New blocks are taken from the head: the least recently freed, which
makes the free queue the eviction order too. Block 0 is the null block: never
handed out; padded block-table entries point at it.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) popleft, append and remove."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free KV-cache block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free_blocks += 1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks; got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1            # pinned forever
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; pass blocks in eviction order (a request's tail first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # first writer wins: a duplicate computed concurrently stays uncached
        self.cached_block_hash_to_block.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks[1:]:
            self._evict(block)
