"""KV-cache blocks, the free-block queue, the block hash, and the pool that ties them together.

Pool invariants (checked by tests/scheduler after every scheduler step):
- block 0 is the null block: never in the free queue, never handed out, ref_cnt not tracked;
- a non-null block is in the free queue iff its ref_cnt is 0;
- a block has a hash iff it is in `cached_block_hash_to_block` under that hash; a cached block
  that is freed keeps its hash (it can still be hit) until it is popped for reuse.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    from scheduler.request import Request

BlockHash = bytes
ExtraKeys = tuple[tuple[str, str], ...]


class KVCacheBlock:
    """One block of KV-cache slots. The free-queue links live on the block itself."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks between two sentinels.

    Head = next to be handed out (least recently freed); tail = most recently freed.
    Every operation but the `*_n` ones is O(1). A block is in the queue iff both its links are set.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        b = self._head.next_free_block
        for _ in range(n):
            out.append(b)
            nxt = b.next_free_block
            b.prev_free_block = b.next_free_block = None
            b = nxt
        self._head.next_free_block = b
        b.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for b in blocks:
            self.append(b)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free_block
        while b is not self._tail:
            yield b
            b = b.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail."""
        return list(self)


# ---------------------------------------------------------------------------------------------
# The block hash: chained over a canonical byte encoding, never Python's hash().

_HASH_DOMAIN = b"minivllm-jax/block-hash/v1"


_u32 = struct.Struct("<I").pack
_u32x2 = struct.Struct("<II").pack


@functools.lru_cache(maxsize=64)
def _token_packer(n: int) -> Callable[..., bytes]:
    return struct.Struct(f"<I{n}q").pack


def _encode_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys) -> bytes:
    """Length-prefixed, fixed-width little-endian encoding, so distinct inputs give distinct
    bytes: domain tag | u32 len + parent | u32 count + int64 token ids | u32 count + for each
    extra key: u32 len(key), u32 len(value), key, value (UTF-8)."""
    parent = parent or b""
    parts = [_HASH_DOMAIN, _u32(len(parent)), parent, _token_packer(len(token_ids))(len(token_ids), *token_ids),
             _u32(len(extra_keys))]
    for key, value in extra_keys:
        k, v = key.encode(), value.encode()
        parts += (_u32x2(len(k), len(v)), k, v)
    return b"".join(parts)


def _xxhash_digest(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_fn(hash_algo: str) -> Callable[[bytes], bytes]:
    """"sha256" (default) or "xxhash" (xxh3-128; needs the xxhash package)."""
    if hash_algo == "sha256":
        return _sha256_digest
    if hash_algo == "xxhash":
        try:
            import xxhash  # noqa: F401
        except ImportError as e:
            raise ValueError("hash_algo='xxhash' needs the xxhash package (pip install xxhash)") from e
        return _xxhash_digest
    raise ValueError(f"hash_algo must be 'sha256' or 'xxhash', got {hash_algo!r}")


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: ExtraKeys = (), hash_algo: str = "sha256") -> BlockHash:
    """Hash of one full block, chained on its parent's hash (None for the first block)."""
    return get_hash_fn(hash_algo)(_encode_block(parent_block_hash, token_ids, extra_keys))


def block_extra_keys(request: "Request", block_index: int) -> ExtraKeys:
    """cache_salt keys the first block, and so the whole chain."""
    if block_index == 0 and request.cache_salt is not None:
        return (("cache_salt", request.cache_salt),)
    return ()


class BlockHasher:
    """Callable that returns the hashes of a request's full blocks not yet in `block_hashes`."""

    def __init__(self, block_size: int, hash_algo: str = "sha256") -> None:
        self.block_size = block_size
        self._fn = get_hash_fn(hash_algo)

    def __call__(self, request: "Request") -> list[BlockHash]:
        bs = self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else None
        start = len(hashes) * bs
        tokens = request.all_token_ids
        out = []
        while start + bs <= len(tokens):
            i = start // bs
            parent = self._fn(_encode_block(parent, tokens[start:start + bs], block_extra_keys(request, i)))
            out.append(parent)
            start += bs
        return out


# ---------------------------------------------------------------------------------------------


class BlockPool:
    """All KV blocks, the free queue and the prefix-cache map (hash -> blocks with that hash)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if type(num_blocks) is not int or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Several blocks may carry the same hash (two requests computed the same prefix at once).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the non-null blocks in use."""
        total = self.num_blocks - 1
        return (total - self.free_block_queue.num_free_blocks) / total

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop from the head of the free queue, evicting any hash the popped blocks carried."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for b in blocks:
            if b.block_hash is not None:
                self.uncache_block(b)
            b.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the tail of the free queue, in order."""
        for b in ordered_blocks:
            if b.is_null:
                continue
            if b.ref_cnt <= 0:
                raise ValueError(f"block {b.block_id} freed more often than it was taken")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_block_queue.append(b)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget the block's hash so nobody can hit it."""
        h = block.block_hash
        if h is None:
            return
        entry = self.cached_block_hash_to_block.get(h)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached_block_hash_to_block[h]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block = {}
        for b in self.blocks:
            b.block_hash = None
        return True
