"""KV cache manager: request -> blocks. Prefix-cache lookups, slot allocation, freeing.

Sliding windows: when every layer attends over the same window, a block whose keys no later
query can see goes back to the pool while its request runs (its table entry then points at
the null block), so a sequence holds about a window's worth of blocks however long it grows.
"""

from __future__ import annotations

from kvfleet_runtime.engine.block_pool import BlockPool, KVCacheBlock
from kvfleet_runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained block hash: equal only when the whole prefix up to this block is equal."""
    return hash((parent_hash, token_ids))


# The attention kernels read a window's keys from the start of the tile holding its first key
# (tiles of at most 128 keys): blocks are given back only below a multiple of this many tokens,
# so no kernel ever reads a block that left its window.
WINDOW_FREE_ALIGN = 256


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_window: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # every layer's sliding window (0: full attention somewhere: no block leaves early)
        self.sliding_window = sliding_window
        self.num_freed_blocks: dict[str, int] = {}    # leading blocks given back (the window)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}   # the same, as ids (kept in step)
        self.num_cached_blocks: dict[str, int] = {}   # leading blocks already hashed into the cache
        self.prefix_cache_queries = 0   # tokens looked up
        self.prefix_cache_hits = 0      # tokens found

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def _update_block_hashes(self, request: Request) -> list[int]:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else request.cache_salt
            hashes.append(hash_block(parent, tuple(tokens[start:start + bs])))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks; at least one token is always left to compute."""
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return [], 0
        hashes = self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       reserve: int = 0) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens; None (and no change) when the pool is too
        full, or when fewer than `reserve` blocks would stay free after it."""
        computed = new_computed_blocks or []
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(computed) * bs
        num_tokens = num_computed + num_new_tokens
        if blocks is not None and self.sliding_window:
            self._free_outside_window(rid, blocks, num_computed)
        if blocks is not None and not computed and -(-num_tokens // bs) <= len(blocks):
            # the common decode step: the last block still has room (and, mostly, no block
            # filled up since the last call: checked here, before a call, for every request)
            if self.enable_caching and num_tokens // bs > self.num_cached_blocks.get(rid, 0):
                self._cache_full_blocks(request, blocks, num_tokens)
            return []
        num_required = cdiv(num_tokens, bs)
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
        num_new_blocks = num_required - len(blocks) - len(computed)
        # hits sitting in the free queue are not free for new allocations once touched
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits - reserve:
            if not blocks:
                del self.req_to_blocks[rid]
                del self.req_to_block_ids[rid]
            return None
        self.block_pool.touch(computed)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        ids = self.req_to_block_ids[rid]
        for added in (computed, new_blocks):
            blocks.extend(added)
            ids.extend(b.block_id for b in added)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        if computed and self.sliding_window:      # hits may lie below the window already
            self._free_outside_window(rid, blocks, num_computed)
        return new_blocks

    def _free_outside_window(self, rid: str, blocks: list[KVCacheBlock], num_computed: int) -> None:
        # the next query is at position num_computed (a rejected draft's rollback never goes
        # below it): it and every later one see keys from num_computed - window + 1 on
        first_seen = num_computed - self.sliding_window + 1
        end = max(first_seen, 0) // WINDOW_FREE_ALIGN * WINDOW_FREE_ALIGN // self.block_size
        if self.enable_caching:     # a block leaves once hashed: its prefix stays findable
            end = min(end, self.num_cached_blocks.get(rid, 0))
        start = self.num_freed_blocks.get(rid, 0)
        if end <= start:
            return
        gone = blocks[start:end]
        null = self.block_pool.null_block
        blocks[start:end] = [null] * (end - start)
        self.req_to_block_ids[rid][start:end] = [null.block_id] * (end - start)
        self.num_freed_blocks[rid] = end
        # the later blocks first into the eviction order: a prefix chain's head outlives it
        self.block_pool.free_blocks(reversed(gone))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # tokens are known before their KV is computed; the KV is written in this very step,
        # before any attention of that layer reads it, so a same-step hit is safe
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_tokens // self.block_size <= start:
            return                  # no block filled since the last call: nothing to hash
        hashes = self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(hashes))
        for i in range(start, num_full):
            self.block_pool.cache_full_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        freed = self.num_freed_blocks.pop(request.request_id, 0)   # (null entries now)
        self.block_pool.free_blocks(reversed(blocks[freed:]))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, in order (the manager's own list: read, don't keep)."""
        return self.req_to_block_ids.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once, computed in steps of at
        most `max_step_tokens` new tokens: all of them, or under a sliding window the window's
        (from its aligned start) and one step's."""
        full = cdiv(num_tokens, self.block_size)
        if not self.sliding_window:
            return full
        held = self.sliding_window + WINDOW_FREE_ALIGN + max_step_tokens
        return min(full, cdiv(held, self.block_size) + 2)   # (+ a block not yet hashed)
