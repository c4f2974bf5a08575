"""THE bucketing rule: the padded size of a batch of n items (token rows, sampled rows, logit-bias
columns, top logprobs), so the programs compile once per bucket met, not once per size.

Invariants:
- `bucket(n, minimum, maximum)` is the smallest power-of-two multiple of `minimum` that is >= n,
  except past FINE_FROM, where each power of two's upper half is cut in quarters; it is capped at
  `maximum`, which is always a bucket itself. A step's minimums are its attention backend's
  (`backends.AttentionBackend.min_buckets`).
- `all_buckets(minimum, maximum)` is every size `bucket` returns for 0 <= n <= maximum.
- This module imports nothing of the project's.
"""
from __future__ import annotations

FINE_FROM = 1024  # token buckets past this size step by quarters (see bucket)


def bucket(n: int, minimum: int, maximum: int) -> int:
    """The padded size for n items: the smallest power-of-two multiple of `minimum` that is >= n,
    except that past FINE_FROM the upper half of each power of two is cut in quarters (..., 1024,
    1280, 1536, 1792, 2048, 2560, ...), so big buckets, whose rows cost compute, pad by under 25 %.
    Capped at `maximum` (so the largest bucket is exactly `maximum`).
    Requires 0 <= n <= maximum."""
    if not 0 <= n <= maximum:
        raise ValueError(f"cannot bucket {n} items with a maximum of {maximum}")
    size = minimum
    while size < n:
        size *= 2
    if size > FINE_FROM and size >= 8 * minimum:
        step = size // 8
        size = size // 2 + -(-(n - size // 2) // step) * step
    return min(size, maximum)


def all_buckets(minimum: int, maximum: int) -> list[int]:
    """Every bucket of 0..maximum items, ascending."""
    return sorted({bucket(n, minimum, maximum) for n in range(0, maximum + 1, minimum)}
                  | {bucket(maximum, minimum, maximum)})
