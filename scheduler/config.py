"""Scheduler configuration, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.block_pool import get_hash_fn
from scheduler.request_queue import POLICIES


@dataclass
class SchedulerConfig:
    """Knobs of the scheduler and its KV-cache manager.

    `num_blocks` counts the null block 0; None picks room for four `max_model_len` requests. The
    engine always passes the number its KV cache actually holds. `async_scheduling`: `schedule()`
    may be called again before the previous step's `update_from_output`, and then schedules
    decodes on the tokens still in flight (see scheduler.py); off, it schedules only known tokens.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    hash_algo: str = "sha256"
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            _positive_int(name, getattr(self, name))
        if self.num_blocks is None:
            self.num_blocks = -(-self.max_model_len * 4 // self.block_size) + 1
        _positive_int("num_blocks", self.num_blocks)
        if type(self.long_prefill_token_threshold) is not int or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be an int >= 0 (0 = off), "
                             f"got {self.long_prefill_token_threshold!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "async_scheduling"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        get_hash_fn(self.hash_algo)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}): every running request needs a token")
        if not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(f"with enable_chunked_prefill=False, max_num_batched_tokens "
                                 f"({self.max_num_batched_tokens}) must be >= max_model_len "
                                 f"({self.max_model_len}) so any prompt fits in one step")
            if self.long_prefill_token_threshold:
                raise ValueError("long_prefill_token_threshold > 0 chunks prefills; it needs "
                                 "enable_chunked_prefill=True")
        need = -(-self.max_model_len // self.block_size)
        if self.num_blocks - 1 < need:
            raise ValueError(f"num_blocks ({self.num_blocks}) too small: one request of max_model_len "
                             f"({self.max_model_len}) tokens needs {need} blocks plus the null block")


def _positive_int(name: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
