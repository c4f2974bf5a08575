"""Per-request block tables on top of the BlockPool, with prefix caching.

Invariants:
- `req_to_blocks[r]` only grows while `r` runs (blocks are appended, never reordered) and covers
  at least the tokens scheduled so far;
- the first `num_cached_block[r]` blocks of `r` carry hashes, and only blocks whose every token
  is computed (or scheduled in the step being built) are ever hashed.
"""
from __future__ import annotations

from scheduler.block_pool import BlockHasher, BlockPool, KVCacheBlock
from scheduler.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 hash_algo: str = "sha256", max_model_len: int | None = None) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_hasher = BlockHasher(block_size, hash_algo)  # validates hash_algo
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # request id -> the most tokens its held blocks cover with no block to allocate or to
        # cache: up to there allocate_slots(request, n) without hits/lookahead is a no-op that
        # returns [] (the scheduler checks this before calling, on the decode hot path)
        self.no_alloc_limit: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request, *, record_stats: bool = True
                            ) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks from the start of the request, and its length in
        tokens. Capped at `num_tokens - 1` tokens so the last token is always computed (it
        yields the logits): a fully cached prompt recomputes its last block. Takes no references.
        A request with `skip_prefix_cache` (prompt logprobs) gets no hits.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        self._ensure_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            entry = get(h)
            if not entry:
                break
            hits.append(next(iter(entry.values())))
        num_hit_tokens = len(hits) * self.block_size
        if record_stats:
            self.record_prefix_cache_stats(request.num_tokens, num_hit_tokens)
        return hits, num_hit_tokens

    def get_sibling_blocks(self, request: Request, lead: Request) -> tuple[list[KVCacheBlock], int]:
        """The full blocks of `lead` (a sibling sample with the same prompt) that `request` can
        share, and their length in tokens: every full block of the lead's computed (or scheduled)
        prompt, capped at `request.num_tokens - 1` tokens like a prefix hit. Works with prefix
        caching off too; takes no references (`allocate_slots` does)."""
        blocks = self.req_to_blocks.get(lead.request_id, ())
        num_tokens = min(lead.num_computed_tokens, lead.num_prompt_tokens, request.num_tokens - 1)
        count = min(num_tokens // self.block_size, len(blocks))
        return list(blocks[:count]), count * self.block_size

    def record_prefix_cache_stats(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` (+ lookahead) after the computed tokens and the new
        prefix hits. Returns the newly allocated blocks, or None with nothing changed when the
        free queue is short (hit blocks sitting in the free queue count against it). Blocks that
        become full with this step's tokens are cached.

        Layout: | computed | new hits | new tokens | lookahead |; the hits are appended to the
        request's blocks (taking references), then fresh blocks for the rest.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        if (not new_computed_blocks and not num_lookahead_tokens
                and request.num_computed_tokens + num_new_tokens <= self.no_alloc_limit.get(rid, -1)):
            return []
        req_blocks = self.req_to_blocks.get(rid)
        bs = self.block_size
        num_held = 0 if req_blocks is None else len(req_blocks)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_needed = num_computed + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None and num_needed > self.max_model_len:
            num_needed = self.max_model_len
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        num_new_blocks = -(-num_needed // bs) - num_held - num_hits
        pool = self.block_pool
        if num_hits:
            num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
            if max(num_new_blocks, 0) + num_evictable > pool.free_block_queue.num_free_blocks:
                return None
        elif num_new_blocks > pool.free_block_queue.num_free_blocks:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.num_cached_block[rid] = 0
        if num_hits:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []

        if self.enable_caching:
            num_full = (num_computed + num_new_tokens) // bs
            num_cached = self.num_cached_block[rid]
            if num_full > num_cached:
                self._cache_full_blocks(request, req_blocks, num_cached, num_full)
        self._update_no_alloc_limit(rid, req_blocks)
        return new_blocks

    def _update_no_alloc_limit(self, rid: str, req_blocks: list[KVCacheBlock]) -> None:
        limit = len(req_blocks) * self.block_size
        if self.enable_caching:  # stop before the next block to cache fills up
            limit = min(limit, (self.num_cached_block[rid] + 1) * self.block_size - 1)
        self.no_alloc_limit[rid] = limit

    def _ensure_block_hashes(self, request: Request) -> None:
        """Requests added through the Scheduler come with a hasher; attach ours otherwise."""
        if not request.has_block_hasher:
            request.set_block_hasher(self.block_hasher, self.block_size)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], start: int, end: int) -> None:
        self._ensure_block_hashes(request)
        hashes = request.block_hashes
        end = min(end, len(hashes))
        pool = self.block_pool
        for i in range(start, end):
            b = blocks[i]
            if b.block_hash is None:  # prefix hits already carry theirs
                pool.cache_block(b, hashes[i])
        if end > start:
            self.num_cached_block[request.request_id] = end

    def free(self, request: Request, uncache: bool = False) -> None:
        """Release the request's blocks, tail first, so that its ends are evicted first. Cached
        blocks keep their hashes (they can still be hit until popped for reuse), unless
        `uncache`: then those that no other request holds lose them."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        self.no_alloc_limit.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
            for b in blocks if uncache else ():
                if b.ref_cnt == 0:
                    self.block_pool.uncache_block(b)

    def uncache_blocks_beyond(self, request: Request, num_computed_tokens: int) -> None:
        """Drop the hashes of the request's blocks past its first `num_computed_tokens` tokens:
        used when a request scheduled in the step being built is preempted, so that nobody can
        hit KV that will never be written. Blocks shared with other requests are left alone
        (someone else computed them)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        num_cached = self.num_cached_block.get(rid, 0)
        first = num_computed_tokens // self.block_size
        if not blocks or first >= num_cached:
            return
        for b in blocks[first:num_cached]:
            if b.ref_cnt == 1:
                self.block_pool.uncache_block(b)
        self.num_cached_block[rid] = first
        self._update_no_alloc_limit(rid, blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
