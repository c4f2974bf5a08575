"""Model runner: the weights, the KV cache and the one jitted step, fed by the host-side batch of
`input_batch` (the bucketing rule and the step's packed metadata live there).

Invariants:
- The runner learns about requests only from SchedulerOutput diffs, through its `InputBatch`, plus
  the tokens it samples itself.
- A step is two jitted programs: the model's forward, compiled once per token bucket, and the LM
  head with the sampler, once per sample bucket (`StepShape.forward` / `.sampler`): all of them
  ahead of time in `precompile()`, else each on first use. The runner calls the compiled
  executables directly (`_executables`), so nothing retraces; the KV cache is donated to the
  forward and replaced by its output.
- Token forwarding (async scheduling): a step may be dispatched before the previous one's tokens
  are collected. A token row at a position the batch does not know yet reads its id on the device
  from the previous step's sampled ids (`prev_index`, -1 elsewhere): each step returns its ids
  padded to max_num_seqs, and the runner feeds them to the next step. A step with no live
  sequence (warm-up, profiling) passes the previous ids through, so it never breaks the chain.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minivllm_jax import sharding
from minivllm_jax.attention import AttentionMetadata
from minivllm_jax.config import EngineConfig
from minivllm_jax.host_malloc import tune_glibc_malloc
from minivllm_jax.input_batch import MIN_BUCKETS, InputBatch, StepShape, bucket, build_step_arrays
from minivllm_jax.models.llama import (LlamaForCausalLM, init_kv_cache, kv_cache_bytes_per_block,
                                       runs_feature_major, unstack_layers)
from minivllm_jax.models.rope import rope_table
from minivllm_jax.sampler import SamplingTensors, sample

logger = logging.getLogger(__name__)

# On the CPU platform, float32 projections of at most this many rows run feature-major
# (models/llama.py ``project``): decode-sized buckets, where XLA:CPU streams weights faster so.
FEATURE_MAJOR_ROWS = 256

# precompile() compiles step shapes on a thread per two cores, at most this many (XLA compiles
# outside the GIL, and one XLA:CPU compile of a SmolLM2 step keeps ~1.6 cores busy)
MAX_COMPILE_THREADS = 8

# enable_compilation_cache() stores programs that took this long to compile (JAX's default: 1 s)
MIN_CACHED_COMPILE_SECONDS = 0.2

# the top-level params the LM head reads (the final norm, and the embedding when tied)
HEAD_PARAMS = ("embed_tokens", "norm", "lm_head")


def head_params(params: Any) -> dict[str, Any]:
    """The `HEAD_PARAMS` of a model's params: all the sampler program takes."""
    return {k: v for k, v in params.items() if k in HEAD_PARAMS}


@functools.partial(jax.jit, static_argnames=("model_config", "backend", "shape", "mesh", "layer_layout",
                                             "feature_major_rows"), donate_argnums=(1,))
def _forward(params: Any, kv_cache: jax.Array, buf: jax.Array, prev_tokens: jax.Array,
             rope: jax.Array, *,
             model_config: Any, backend: str, shape: StepShape, mesh: Any = None,
             layer_layout: str = "stacked", feature_major_rows: int = 0) -> tuple[jax.Array, jax.Array]:
    """The model over the step's token rows (``buf``: the forward's part of the packed buffer);
    returns the hidden states of the rows in logits_indices, ``[max_num_seqs, hidden]``
    (replicated under a tensor-parallel `mesh`), and the cache. Rows with ``prev_index >= 0``
    take their input id from ``prev_tokens``. ``rope`` is the model's cos/sin table
    (``rope.rope_table``). Module-level jits keyed on hashable statics: engines with equal
    configs share compilations."""
    a = shape.unpack(buf, "forward")
    prev = a["prev_index"]
    input_ids = jnp.where(prev >= 0, prev_tokens[jnp.maximum(prev, 0)], a["input_ids"])
    md = AttentionMetadata(slot_mapping=a["slot_mapping"], block_tables=a["block_tables"],
                           kv_lens=a["kv_lens"], cu_q_lens=a["cu_q_lens"], num_seqs=a["num_seqs"])
    model = LlamaForCausalLM(model_config, attn_backend=backend, mesh=mesh, layer_layout=layer_layout,
                             feature_major_rows=feature_major_rows)
    hidden, kv_cache = model.apply({"params": params}, input_ids, a["positions"], kv_cache, md,
                                   rope)
    return sharding.replicate(hidden[a["logits_indices"]], mesh), kv_cache


@functools.partial(jax.jit, static_argnames=("model_config", "shape", "mesh", "feature_major_rows"))
def _sample(head_params: Any, rows: jax.Array, buf: jax.Array, prev_tokens: jax.Array, *,
            model_config: Any, shape: StepShape, mesh: Any = None,
            feature_major_rows: int = 0) -> jax.Array:
    """The LM head and the sampler over the first ``shape.num_sampled`` of the forward's rows
    (``buf``: the sampler's part of the packed buffer; ``head_params``: `HEAD_PARAMS` only);
    returns the sampled ids padded to ``[max_num_seqs]``, or ``prev_tokens`` (the previous
    step's) when no sequence is live. With a tensor-parallel `mesh`, logits and tokens are
    replicated so every device samples alike."""
    a = shape.unpack(buf, "sampler")
    rows = rows[:shape.num_sampled]
    model = LlamaForCausalLM(model_config, mesh=mesh, feature_major_rows=feature_major_rows)
    # a feature-major LM head's logits reach the sampler as written, [V, N] (see sample);
    # tensor parallelism gathers them as [N, V]
    vocab_major = mesh is None and runs_feature_major(rows, feature_major_rows)
    logits = model.apply({"params": head_params}, rows, vocab_major,
                         method=LlamaForCausalLM.compute_logits)
    logits = sharding.gather_logits(logits, mesh)
    tokens = sample(logits, SamplingTensors(temperature=a["temperature"], top_k=a["top_k"],
                                            top_p=a["top_p"], seed=a["seed"], step=a["step"]),
                    vocab_major)
    tokens = jnp.zeros_like(prev_tokens).at[:shape.num_sampled].set(tokens)
    tokens = jnp.where(a["num_seqs"][0] > 0, tokens, prev_tokens)
    return sharding.replicate(tokens, mesh)


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Point JAX's persistent compilation cache at ``path`` (default: the directory JAX already
    has, e.g. from ``$JAX_COMPILATION_CACHE_DIR``, else ``$MINIVLLM_JAX_COMPILE_CACHE``, else
    ``~/.cache/minivllm_jax/xla``), so a program compiled by one process is loaded, not
    recompiled, by the next (SmolLM2 on CPU: a forward 1.5-3 s stacked, 8-17 s unrolled; a
    sampler ~0.5 s, so the threshold for caching drops to ``MIN_CACHED_COMPILE_SECONDS``). This
    sets JAX's process-wide config and only takes effect before the process's first compilation:
    the CLI calls it first thing; a notebook can too. XLA keys entries by program, options,
    versions and backend, and refuses an executable built for other CPU features (JAX warns and
    compiles afresh)."""
    if path is None and jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    if path is None:
        env = os.environ.get("MINIVLLM_JAX_COMPILE_CACHE")
        path = Path(env) if env else Path.home() / ".cache" / "minivllm_jax" / "xla"
    path = Path(path).expanduser()
    jax.config.update("jax_compilation_cache_dir", str(path))
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min(threshold, MIN_CACHED_COMPILE_SECONDS))
    return path


def kv_cache_dtype(dtype: Any, platform: str) -> Any:
    """The KV cache's dtype: the model's, but float32 for 16-bit models on the CPU platform. XLA:CPU
    has no 16-bit float scatter or gather: it wraps every layer's cache write and page gather in a
    conversion of the whole cache to float32 and back (a SmolLM2 bfloat16 decode step took 3.2 s
    instead of ~0.1 s). Attention accumulates in float32 either way."""
    if platform == "cpu" and jnp.dtype(dtype).itemsize < 4:
        return jnp.float32
    return dtype


def resolve_layer_layout(layer_layout: str | None, platform: str, tp: int) -> str:
    """The layer layout (models/llama.py) for ``EngineConfig.layer_layout``; None picks switched
    layers on one CPU device, else stacked. XLA:CPU copies a stacked layer's weight slices before
    its dots, and converts a 16-bit stack whole to float32 first, every step; switched layers read
    per-layer arrays in place. SmolLM2, 32-row steps without attention (scripts/bench_step.py,
    p25): float32 79.7 ms stacked, 68.0 switched, compiled in 2.5 and 2.6 s (small buckets up
    to 1.5x as long); bfloat16 55.4 ms switched, 55.7 unrolled, compiled in 3.4 and 8.4 s (2048
    rows: 4.5 and 19.4 s). Accelerators keep stacked layers (one compiled body, no switch)."""
    if layer_layout is not None:
        return layer_layout
    return "switched" if platform == "cpu" and tp == 1 else "stacked"


@dataclass
class InFlight:
    """A dispatched step: its sampled ids still on the device, and the requests they belong to."""

    tokens: jax.Array
    req_ids: list[str]


class ModelRunner:
    """Owns the weights, the KV cache and the persistent batch; `dispatch` starts one scheduled
    step on the device and `collect` waits for its sampled tokens."""

    def __init__(self, model_config: Any, params: Any, dtype: Any, config: EngineConfig,
                 backend: str) -> None:
        tp = config.tensor_parallel_size
        # tensor parallelism: kv heads expanded as needed, weights and KV cache split over a mesh
        self.mesh = sharding.make_mesh(tp, model_config.num_attention_heads) if tp > 1 else None
        if self.mesh is not None:
            model_config, params = sharding.shard_model(model_config, params, self.mesh)
        # multi-host: process 0 schedules and broadcasts each step; the others run `follow()`
        self.channel = sharding.StepChannel(header_len=2) if jax.process_count() > 1 else None
        platform = self._device().platform
        if config.tune_cpu_malloc and platform == "cpu":
            tune_glibc_malloc()
        self.layer_layout = resolve_layer_layout(config.layer_layout, platform, tp)
        self.feature_major_rows = FEATURE_MAJOR_ROWS if platform == "cpu" else 0
        if self.layer_layout != "stacked":
            params = unstack_layers(params, model_config.num_hidden_layers)
        self.model_config = model_config
        self.params = params
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype(dtype, platform)
        self.config = config
        self.backend = backend
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, config.max_blocks_per_seq)
        self.shapes_used: set[StepShape] = set()
        # the compiled forward of each token bucket and sampler of each sample bucket met or
        # precompiled (jax.stages.Compiled), keyed by StepShape.forward / .sampler
        self._executables: dict[StepShape, Any] = {}
        self._compile_lock = threading.Lock()  # one compile of a program, however many threads
        # the last dispatched step's sampled ids, [max_num_seqs] on the device (see _sample)
        self.last_tokens = sharding.put_replicated(np.zeros(config.max_num_seqs, np.int32), self.mesh)
        self.rope = sharding.put_replicated(rope_table(model_config, config.max_model_len),
                                            self.mesh)
        self.num_blocks = self._choose_num_blocks()
        if self.channel is not None:  # every process must build the same cache
            self.num_blocks = int(sharding.broadcast_from_leader(np.array([self.num_blocks]), (1,))[0])
        self.kv_cache = self._init_kv_cache(self.num_blocks)
        logger.info("KV cache: %d blocks of %d tokens; maximum concurrency %.2fx for %d-token requests",
                    self.num_blocks, config.block_size,
                    (self.num_blocks - 1) / config.max_blocks_per_seq, config.max_model_len)

    # ---- KV cache sizing -------------------------------------------------------------------
    def _init_kv_cache(self, num_blocks: int) -> jax.Array:
        if self.mesh is None:
            return init_kv_cache(self.model_config, num_blocks, self.config.block_size, self.kv_dtype)
        return sharding.init_sharded_kv_cache(self.model_config, num_blocks, self.config.block_size,
                                              self.kv_dtype, self.mesh)

    def _device(self) -> Any:
        return jax.devices()[0] if self.mesh is None else self.mesh.local_devices[0]

    def _choose_num_blocks(self) -> int:
        """Sizes are per device: each of the tensor_parallel_size devices holds 1/N of a block."""
        cfg = self.config
        per_block = (kv_cache_bytes_per_block(self.model_config, cfg.block_size, self.kv_dtype)
                     // cfg.tensor_parallel_size)
        if cfg.num_kv_blocks is not None:
            if cfg.num_kv_blocks > self._max_blocks(per_block):
                raise ValueError(f"num_kv_blocks={cfg.num_kv_blocks} is too large for the pallas "
                                 f"attention backend (int32 cache offsets): at most "
                                 f"{self._max_blocks(per_block)} for this model and block_size")
            return cfg.num_kv_blocks
        device = self._device()
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            return self._profile_num_blocks(per_block)
        wanted = cfg.max_num_seqs * cfg.max_blocks_per_seq
        cap = max(cfg.cpu_kv_cache_bytes // per_block, cfg.max_blocks_per_seq)
        return min(wanted, cap) + 1  # + the null block

    def _max_blocks(self, per_block: int) -> int:
        """The Pallas kernels address the flat all-layer cache with int32 offsets, so its element
        count stays below 2**31; the reference backend has no such bound."""
        if self.backend != "pallas":
            return np.iinfo(np.int64).max
        return (2**31 - 1) // (per_block // np.dtype(self.kv_dtype).itemsize)

    def _profile_num_blocks(self, per_block: int) -> int:
        """Run a max-size dummy step on a minimal cache; what the device has left after its peak
        (and the weights), times gpu_memory_utilization, becomes KV blocks."""
        cfg = self.config
        probe_blocks = cfg.max_blocks_per_seq + 1
        self.kv_cache = self._init_kv_cache(probe_blocks)
        shape = StepShape(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_num_seqs,
                          cfg.max_blocks_per_seq)
        self._run(shape, shape.empty_step(temperature=1.0))
        self._executables.clear()  # compiled for the probe cache's shape
        stats = self._device().memory_stats()
        peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
        free = int(stats["bytes_limit"] * cfg.gpu_memory_utilization) - peak
        num_blocks = free // per_block + probe_blocks
        num_blocks = min(num_blocks, self._max_blocks(per_block))
        self.kv_cache = None
        if num_blocks - 1 < cfg.max_blocks_per_seq:
            raise ValueError(f"not enough device memory for one {cfg.max_model_len}-token request: "
                             f"raise gpu_memory_utilization or lower max_model_len")
        return int(num_blocks)

    # ---- ahead-of-time compilation ---------------------------------------------------------
    def step_shapes(self) -> list[StepShape]:
        """Every StepShape a step can meet under this config: token buckets from the backend's
        minimum to max_num_batched_tokens, each with the sample buckets its rows allow (a step
        samples at most min(its tokens, max_num_seqs) rows)."""
        cfg = self.config
        min_tokens, min_sampled = MIN_BUCKETS[self.backend]

        def buckets(minimum: int, maximum: int) -> list[int]:
            return sorted({bucket(n, minimum, maximum) for n in range(0, maximum + 1, minimum)}
                          | {bucket(maximum, minimum, maximum)})

        shapes = []
        for t in buckets(min_tokens, cfg.max_num_batched_tokens):
            most = min(t, cfg.max_num_seqs)  # rows a step of this bucket can sample
            for s in buckets(min_sampled, cfg.max_num_seqs):
                if s == bucket(0, min_sampled, cfg.max_num_seqs) or s // 2 < most:
                    shapes.append(StepShape(t, s, cfg.max_num_seqs, cfg.max_blocks_per_seq))
        return shapes

    def precompile(self) -> int:
        """Compile the forward of every token bucket and the sampler of every sample bucket in
        `step_shapes()`, and run each once on an empty batch (no live sequence, every slot -1:
        the KV cache keeps its contents), so that serving never stops to compile or to set up;
        returns the number of step shapes covered. Programs are lowered here one after another
        and compiled on a thread pool, biggest first. The runs are not optional: XLA:CPU sets up
        each YNNPACK dot on its first run (0.2-0.6 s a SmolLM2 forward with switched layers). A
        multi-host leader broadcasts each step it runs, so its followers compile and run it too."""
        shapes = self.step_shapes()
        if self.channel is None:
            keys = (sorted({s.forward for s in shapes}, key=lambda k: -k.num_tokens)
                    + sorted({s.sampler for s in shapes}, key=lambda k: -k.num_sampled))
            threads = max(1, min(MAX_COMPILE_THREADS, (os.cpu_count() or 2) // 2, len(keys)))
            with ThreadPoolExecutor(threads) as pool:  # lowering here overlaps the compiles
                pending = [(key, pool.submit(self.lower(key).compile)) for key in keys
                           if key not in self._executables]
                for key, compiled in pending:
                    self._executables[key] = compiled.result()
        # each program run once: small token buckets first, so each sample bucket rides along
        # with the smallest forward that can sample it
        ran: set[StepShape] = set()
        for shape in sorted(shapes, key=lambda s: (s.num_tokens, -s.num_sampled)):
            if not {shape.forward, shape.sampler} <= ran:
                buf = shape.empty_step()
                if self.channel is not None:
                    self.channel.send((shape.num_tokens, shape.num_sampled), buf)
                self._run(shape, buf)
                ran |= {shape.forward, shape.sampler}
        return len(shapes)

    def share_programs(self, other: "ModelRunner") -> None:
        """Use `other`'s compiled programs, present and future (data-parallel replicas). Equal
        statics, params and KV cache shapes make equal programs, so only those are shared."""
        def statics(r: ModelRunner) -> tuple[Any, ...]:
            return (r.model_config, r.backend, r.mesh, r.layer_layout, r.feature_major_rows,
                    r.kv_cache.shape, r.kv_cache.dtype, jax.tree.structure(r.params))

        if statics(self) != statics(other):
            raise ValueError("share_programs: the runners' programs differ (config or KV cache shape)")
        self._executables, self._compile_lock = other._executables, other._compile_lock

    @property
    def compiled_shapes(self) -> frozenset[StepShape]:
        """The programs this runner holds compiled: forwards (``StepShape.forward``: num_sampled
        0) and samplers (``StepShape.sampler``: num_tokens 0)."""
        return frozenset(self._executables)

    @property
    def head_params(self) -> dict[str, Any]:
        """The sampler program's params, read from `params` at each call (never a stale copy)."""
        return head_params(self.params)

    # ---- one step --------------------------------------------------------------------------
    def dispatch(self, so: Any) -> InFlight | None:
        """Enqueue the step scheduled in `so` on the device and return without waiting for it
        (JAX dispatches asynchronously); None when nothing was scheduled. Steps are collected in
        dispatch order, each at most one dispatch late: a step may use the one pending token per
        request of the step before (forwarded on the device), never an older uncollected one."""
        self.batch.apply_diffs(so, self.config.seed)
        if so.total_num_scheduled_tokens == 0:
            return None
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        q_lens = [so.num_scheduled_tokens[r] for r in req_ids]
        shape, arrays, sampled_ids, sampled_rows = build_step_arrays(
            self.batch, req_ids, q_lens, self.config, MIN_BUCKETS[self.backend])
        self.shapes_used.add(shape)
        buf = shape.pack(arrays)
        if self.channel is not None:
            self.channel.send((shape.num_tokens, shape.num_sampled), buf)
        tokens = self._launch(shape, buf)
        self.batch.mark_sampled(sampled_rows)
        return InFlight(tokens, sampled_ids)

    def collect(self, in_flight: InFlight | None) -> dict[str, list[int]]:
        """Wait for a dispatched step; returns {req_id: [sampled token]} for the requests whose
        scheduled tokens reach the end of their known tokens (partial prefills get no entry)."""
        if in_flight is None:
            return {}
        tokens = sharding.to_host(in_flight.tokens)[:len(in_flight.req_ids)]
        self.batch.append_tokens(in_flight.req_ids, tokens)
        return {req_id: [tok] for req_id, tok in zip(in_flight.req_ids, tokens.tolist())}

    def lower(self, key: StepShape) -> Any:
        """The forward (``key = shape.forward``) or the sampler (``key = shape.sampler``) lowered
        on an empty batch (``jax.stages.Lowered``: its ``compile().as_text()`` is the program XLA
        runs), for tests and profiling."""
        if key.num_sampled == 0:
            return _forward.lower(*self.empty_step_args(key), model_config=self.model_config,
                                  backend=self.backend, shape=key, mesh=self.mesh,
                                  layer_layout=self.layer_layout,
                                  feature_major_rows=self.feature_major_rows)
        if key.num_tokens == 0:
            return _sample.lower(*self.empty_step_args(key), model_config=self.model_config,
                                 shape=key, mesh=self.mesh, feature_major_rows=self.feature_major_rows)
        raise ValueError(f"lower() takes a StepShape's .forward or .sampler, not {key}")

    def empty_step_args(self, key: StepShape) -> tuple[Any, ...]:
        """The positional arguments of ``lower(key).compile()`` for a step with no live sequence,
        for benchmarks of one program. A forward's: the current params, KV cache, buffer, last
        tokens and RoPE table (the compiled forward donates the cache: set ``kv_cache`` to its
        second output before the next call); a sampler's: the head params, zero rows, buffer and
        last tokens."""
        forward_buf, sampler_buf = key.split(key.empty_step())
        if key.num_sampled == 0:
            return (self.params, self.kv_cache, sharding.put_replicated(forward_buf, self.mesh),
                    self.last_tokens, self.rope)
        rows = np.zeros((key.max_num_seqs, self.model_config.hidden_size),
                        self.params["embed_tokens"].dtype)
        return (self.head_params, sharding.put_replicated(rows, self.mesh),
                sharding.put_replicated(sampler_buf, self.mesh), self.last_tokens)

    def _executable(self, key: StepShape) -> Any:
        """The compiled program of ``key`` (``jax.stages.Compiled``), compiled on first use."""
        compiled = self._executables.get(key)
        if compiled is None:
            with self._compile_lock:  # replicas sharing programs may meet a new one together
                compiled = self._executables.get(key)
                if compiled is None:
                    compiled = self._executables[key] = self.lower(key).compile()
        return compiled

    def _launch(self, shape: StepShape, buf: np.ndarray) -> jax.Array:
        """The step's forward, then its sampler, on one packed metadata buffer, not waited for:
        the sampled ids on the device, which the next step reads pending tokens from. The KV
        cache is donated to the forward and replaced by its output."""
        forward_buf, sampler_buf = shape.split(buf)
        rows, self.kv_cache = self._executable(shape.forward)(
            self.params, self.kv_cache, sharding.put_replicated(forward_buf, self.mesh),
            self.last_tokens, self.rope)
        self.last_tokens = self._executable(shape.sampler)(
            self.head_params, rows, sharding.put_replicated(sampler_buf, self.mesh), self.last_tokens)
        return self.last_tokens

    def _run(self, shape: StepShape, buf: np.ndarray) -> np.ndarray:
        """The step, waited for; returns the sampled ids on the host."""
        return sharding.to_host(self._launch(shape, buf))

    # ---- multi-host ------------------------------------------------------------------------
    def follow(self) -> None:
        """Processes other than 0: run every step process 0 broadcasts, until it calls
        `stop_followers()`. Their sampled tokens are dropped (process 0's are the same)."""
        if self.channel is None or jax.process_index() == 0:
            raise RuntimeError("follow() runs only on processes other than 0 of a multi-host run")
        cfg = self.config
        while (message := self.channel.receive()) is not None:
            (num_tokens, num_sampled), buf = message
            self._run(StepShape(num_tokens, num_sampled, cfg.max_num_seqs, cfg.max_blocks_per_seq), buf)

    def stop_followers(self) -> None:
        """Process 0 of a multi-host run: end the other processes' `follow()` loops."""
        if self.channel is not None and jax.process_index() == 0:
            self.channel.stop()
