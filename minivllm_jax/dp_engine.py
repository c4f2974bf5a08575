"""DataParallelEngine: several LLMEngine replicas over one set of weights, stepped side by side.

What it is for: on the CPU backend one engine leaves a core idle whenever its step runs an op
that XLA:CPU executes on one core (the attention's token-row gathers), and a program runs its ops
one after another. Programs dispatched from different host threads do run concurrently, so two
replicas, each with half the requests and stepped from its own thread, fill that gap
(docs/benchmarks-log.md, "Two engine replicas"). vLLM's `data_parallel_size` means replicas on
separate devices; here they share the device, which is why it is limited to the CPU platform.

Invariants:
- A request lives in exactly one replica, chosen when it is added (the one with the fewest
  unfinished requests, the lowest index on ties), and never moves. Request ids are unique over
  all replicas: automatic ids come from one counter here.
- The replicas share the weights (the same device arrays) and the compiled programs (replica 0
  compiles, the others reuse its executables: equal configs give equal programs); each owns its
  scheduler, KV cache and batch, so each keeps every invariant of `LLMEngine`, the
  no-leaked-block rule included.
- `step()` steps every replica that has work, each on its own pool thread, and returns their
  deltas concatenated in replica order. If a replica's step raises, the others' deltas wait
  for the next `step()`. Greedy tokens equal a single engine's (CONTRACT: greedy
  output does not depend on batch composition beyond floating-point ties).
"""
from __future__ import annotations

import dataclasses
import itertools
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Iterable, Sequence

import jax

from minivllm_jax.config import EngineConfig
from minivllm_jax.engine import LLMEngine
from minivllm_jax.outputs import StepDelta
from scheduler import SamplingParams

# get_stats() fields that add up over replicas (the rest are recomputed from the sums)
_SUMMED = ("num_running_reqs", "num_waiting_reqs", "prefix_cache_queries", "prefix_cache_hits",
           "num_preemptions", "num_kv_blocks", "num_free_kv_blocks")


class DataParallelEngine:
    """`data_parallel_size` LLMEngines behind LLMEngine's request and step API."""

    def __init__(self, loaded: Any, config: EngineConfig) -> None:
        n = config.data_parallel_size
        if jax.default_backend() != "cpu":
            raise ValueError(f"data_parallel_size={n} needs the CPU backend (its replicas share one "
                             f"device), not {jax.default_backend()!r}; use 1")
        one = dataclasses.replace(config, data_parallel_size=1)
        self.replicas = [LLMEngine(loaded, one) for _ in range(n)]
        for replica in self.replicas[1:]:
            replica.runner.share_programs(self.replicas[0].runner)
        first = self.replicas[0]
        self.model_config, self.tokenizer = first.model_config, first.tokenizer
        self.config = dataclasses.replace(first.config, data_parallel_size=n)  # resolved, as LLMEngine's
        self._owner: dict[str, LLMEngine] = {}  # request id -> its replica, until reported finished
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="minivllm-dp")

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None,
                    priority: int = 0) -> str:
        """Queue a tokenized prompt on the least-loaded replica; returns its request id.
        `priority` orders it among that replica's requests only."""
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self._owner:
                request_id = str(next(self._ids))
        elif isinstance(request_id, str) and request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        replica = min(self.replicas, key=LLMEngine.num_unfinished_requests)
        self._owner[replica.add_request(prompt_token_ids, sampling_params, request_id, prompt,
                                        priority)] = replica
        return request_id

    def check_request(self, prompt_token_ids: Sequence[int], sampling_params: Any,
                      priority: Any = 0) -> None:
        self.replicas[0].check_request(prompt_token_ids, sampling_params, priority)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort unfinished requests in their replicas; their outputs come from the next step()."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for replica in self.replicas:
            replica.abort_request([i for i in ids if self._owner.get(i) is replica])

    def requeue(self, deltas: Iterable[StepDelta]) -> None:
        self.replicas[0].requeue(deltas)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[StepDelta]:
        """One step of every replica with work, run side by side; their deltas in replica order."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        futures = [self._pool.submit(r.step) for r in busy]
        wait(futures)
        errors = [f.exception() for f in futures]
        if any(errors):  # the others' deltas are kept for the next step(), never dropped
            for replica, f, error in zip(busy, futures, errors):
                if error is None:
                    replica.requeue(f.result())
            raise next(e for e in errors if e is not None)
        deltas = [d for f in futures for d in f.result()]
        for d in deltas:
            if d.finished:
                self._owner.pop(d.request_id, None)
        return deltas

    def precompile(self) -> int:
        """Compile (in replica 0, shared by all) and run every step shape once in each replica."""
        count = self.replicas[0].precompile()
        for replica in self.replicas[1:]:
            replica.precompile()  # nothing left to compile: each program's first run only
        return count

    # ---- stats -----------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """LLMEngine.get_stats summed over replicas; KV usage and hit rate over all of them."""
        parts = [r.get_stats() for r in self.replicas]
        stats = {k: sum(p[k] for p in parts) for k in _SUMMED}
        usable = stats["num_kv_blocks"] - len(parts)  # each replica's null block is never handed out
        stats["kv_cache_usage"] = 1.0 - stats["num_free_kv_blocks"] / usable if usable else 0.0
        queries = stats["prefix_cache_queries"]
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hits"] / queries if queries else 0.0
        stats["data_parallel_size"] = len(parts)
        return stats
