"""Host-side scheduler and KV-cache block manager (vLLM V1 semantics; pure Python, no jax)."""
from scheduler.block_pool import (BlockHasher, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock,
                                  hash_block_tokens)
from scheduler.config import SchedulerConfig
from scheduler.errors import InvalidFieldError, InvalidFieldTypeError
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput, SchedulerStats
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.request_queue import POLICIES, FCFSRequestQueue, PriorityRequestQueue
from scheduler.scheduler import Scheduler
from scheduler.structured import StructuredOutputsParams

__all__ = [
    "SamplingParams", "StructuredOutputsParams", "Request", "RequestStatus",
    "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "KVCacheManager",
    "SchedulerConfig", "Scheduler", "SchedulerOutput", "NewRequestData", "CachedRequestData",
    # extras
    "BlockHasher", "hash_block_tokens", "SchedulerStats", "FCFSRequestQueue", "PriorityRequestQueue",
    "POLICIES", "InvalidFieldError", "InvalidFieldTypeError",
]
