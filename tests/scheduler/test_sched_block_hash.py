"""The block hash: chaining, canonical encoding, extra keys, algorithms, incremental hashing."""
from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from scheduler import BlockHasher, Request, SamplingParams, hash_block_tokens
from scheduler.block_pool import get_hash_fn


def test_chaining_parent_changes_hash_same_inputs_same_hash() -> None:
    toks = [1, 2, 3, 4]
    h0 = hash_block_tokens(None, toks)
    assert h0 == hash_block_tokens(None, list(toks)) == hash_block_tokens(None, tuple(toks))
    p1, p2 = hash_block_tokens(None, [9, 9, 9, 9]), hash_block_tokens(None, [8, 9, 9, 9])
    assert hash_block_tokens(p1, toks) != hash_block_tokens(p2, toks) != h0
    assert hash_block_tokens(p1, toks) == hash_block_tokens(p1, toks)
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h0
    assert len(h0) == 32 and isinstance(h0, bytes)


def test_encoding_is_unambiguous() -> None:
    # splitting the same digits differently, or moving a token into a key, must not collide
    assert hash_block_tokens(None, [12, 3]) != hash_block_tokens(None, [1, 23])
    assert hash_block_tokens(None, [1], (("a", "bc"),)) != hash_block_tokens(None, [1], (("ab", "c"),))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2], (("k", ""),))
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [2**40 + 1])


def test_sha256_is_over_a_documented_canonical_encoding() -> None:
    """Recompute SHA-256 over the encoding written out independently here."""
    parent = bytes(range(32))
    toks = [5, 0, 70000]
    keys = (("cache_salt", "s"),)
    enc = (b"minivllm-jax/block-hash/v1" + struct.pack("<I", 32) + parent + struct.pack("<I", 3)
           + b"".join(struct.pack("<q", t) for t in toks) + struct.pack("<I", 1)
           + struct.pack("<II", 10, 1) + b"cache_salt" + b"s")
    assert hash_block_tokens(parent, toks, keys) == hashlib.sha256(enc).digest()


def test_hash_does_not_depend_on_python_hash_seed() -> None:
    code = ("from scheduler import hash_block_tokens as h; "
            "print(h(h(None, [1, 2], (('cache_salt', 'x'),)), [3, 4], (('lora', 'a'),)).hex())")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout.strip())
    assert len(outs) == 1


def _req(prompt, **kw) -> Request:
    return Request("r", prompt, SamplingParams(), **kw)


def _hashes(req: Request, block_size: int, algo: str = "sha256") -> list[bytes]:
    req.set_block_hasher(BlockHasher(block_size, algo), block_size)
    return req.block_hashes


def test_request_hashes_are_the_chain_of_full_blocks() -> None:
    prompt = list(range(10))
    hs = _hashes(_req(prompt), 4)
    h0 = hash_block_tokens(None, prompt[0:4])
    assert hs == [h0, hash_block_tokens(h0, prompt[4:8])]  # the partial block 8..9 is not hashed


def test_cache_salt_changes_first_block_and_so_the_chain() -> None:
    prompt = list(range(12))
    plain, salted, other = (_hashes(_req(prompt), 4), _hashes(_req(prompt, cache_salt="a"), 4),
                            _hashes(_req(prompt, cache_salt="b"), 4))
    assert all(p != s for p, s in zip(plain, salted)) and all(s != o for s, o in zip(salted, other))
    assert salted[0] == hash_block_tokens(None, prompt[:4], (("cache_salt", "a"),))
    assert salted[1] == hash_block_tokens(salted[0], prompt[4:8])  # salt keys the first block only
    assert _hashes(_req(prompt, cache_salt="a"), 4) == salted


def test_extra_keys_on_a_later_block_key_it_and_the_rest_of_the_chain() -> None:
    prompt = list(range(12))
    h0 = hash_block_tokens(None, prompt[:4])
    plain1, keyed1 = hash_block_tokens(h0, prompt[4:8]), hash_block_tokens(h0, prompt[4:8], (("k", "v"),))
    assert keyed1 != plain1
    assert hash_block_tokens(keyed1, prompt[8:]) != hash_block_tokens(plain1, prompt[8:])
    assert _hashes(_req(prompt), 4)[1:] == [plain1, hash_block_tokens(plain1, prompt[8:])]  # no keys by default


def test_incremental_hashing_matches_from_scratch_and_hashes_each_block_once() -> None:
    hasher = BlockHasher(2)
    calls = []
    fn = hasher._fn
    hasher._fn = lambda data: calls.append(1) or fn(data)
    req = _req([7, 8, 9])
    req.set_block_hasher(hasher, 2)
    for t in range(20):
        req.append_output_token_ids(t if t % 3 else [t, t + 1])
        assert req.block_hashes == _hashes(_req(req.all_token_ids), 2)
    assert len(calls) == len(req.block_hashes) == req.num_tokens // 2


@pytest.mark.parametrize("algo", ["xxhash"])
def test_xxhash_option(algo: str) -> None:
    pytest.importorskip("xxhash")
    import xxhash

    h = hash_block_tokens(None, [1, 2, 3], (), algo)
    assert h != hash_block_tokens(None, [1, 2, 3]) and len(h) == 16
    assert h == xxhash.xxh3_128_digest(
        b"minivllm-jax/block-hash/v1" + struct.pack("<II3qI", 0, 3, 1, 2, 3, 0))
    hs = _hashes(_req(list(range(8))), 4, algo)
    assert hs[1] == hash_block_tokens(hs[0], [4, 5, 6, 7], (), algo)


def test_unknown_algo_and_missing_xxhash_raise_valueerror(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="hash_algo"):
        get_hash_fn("md5")
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import fails
    with pytest.raises(ValueError, match="xxhash"):
        get_hash_fn("xxhash")
