"""Compilation: the step's two jitted programs, their executables per bucket, ahead-of-time
compilation of every bucket a config allows, and JAX's persistent compilation cache.

Invariants:
- A step is two programs: the model's forward, compiled once per token bucket
  (`StepShape.forward`), and the LM head with the sampler, once per sample bucket
  (`StepShape.sampler`). `StepPrograms` keeps each `jax.stages.Compiled` (a `LoadedProgram` when
  it came from the `ExecutableCache`) and the runner calls it directly, so nothing retraces once
  a bucket is compiled.
- The programs are module-level jits keyed on hashable statics (model config, `ModelPlan`,
  shape, mesh): engines with equal statics share compilations.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import serialize_executable
from jax.sharding import Mesh

from minivllm_jax import sharding
from minivllm_jax.sharding import Params
from minivllm_jax.attention import AttentionMetadata
from minivllm_jax.input_batch import StepShape, bucket
from minivllm_jax.models.config import ModelConfig
from minivllm_jax.models.llama import LlamaForCausalLM, runs_feature_major
from minivllm_jax.plan import ModelPlan
from minivllm_jax.sampler import SamplingTensors, sample, token_logprobs

logger = logging.getLogger(__name__)

# the top-level params the LM head reads (the final norm, and the embedding when tied)
HEAD_PARAMS = ("embed_tokens", "norm", "lm_head")
# precompile() compiles on a thread per two cores, at most this many (XLA compiles outside the GIL)
MAX_COMPILE_THREADS = 8
# enable_compilation_cache() keeps programs that took this long to compile (JAX's default: 1 s)
MIN_CACHED_COMPILE_SECONDS = 0.2


def head_params(params: Params) -> Params:
    """The `HEAD_PARAMS` of a model's params: all the sampler program reads."""
    return {k: v for k, v in params.items() if k in HEAD_PARAMS}


@functools.partial(jax.jit, static_argnames=("model_config", "plan", "shape", "mesh"),
                   donate_argnums=(1,))
def forward(params: Params, kv_cache: jax.Array, buf: jax.Array, prev_tokens: jax.Array,
            rope: jax.Array, *, model_config: ModelConfig, plan: ModelPlan, shape: StepShape,
            mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The model over the step's token rows (``buf``: the forward's part of the packed buffer);
    returns the hidden states of the rows in logits_indices, ``[max_num_seqs, hidden]``
    (replicated under a `mesh`), the cache, and with ``shape.all_hidden`` every token row's
    hidden state ``[num_tokens, hidden]`` (None otherwise). Rows with ``prev_index >= 0`` take
    their input id from ``prev_tokens`` (the previous step's sampled ids); ``rope`` is
    ``rope.rope_table``."""
    a = shape.unpack(buf, "forward")
    prev = a["prev_index"]
    input_ids = jnp.where(prev >= 0, prev_tokens[jnp.maximum(prev, 0)], a["input_ids"])
    md = AttentionMetadata(slot_mapping=a["slot_mapping"], block_tables=a["block_tables"],
                           kv_lens=a["kv_lens"], cu_q_lens=a["cu_q_lens"], num_seqs=a["num_seqs"])
    model = LlamaForCausalLM(model_config, plan, mesh)
    hidden, kv_cache = model.apply({"params": params}, input_ids, a["positions"], kv_cache, md, rope)
    every = sharding.replicate(hidden, mesh) if shape.all_hidden else None
    return sharding.replicate(hidden[a["logits_indices"]], mesh), kv_cache, every


# the sampled tokens' logprobs and ranks, and the top ids and logprobs (`sampler.token_logprobs`)
Logprobs = tuple[jax.Array, jax.Array, jax.Array, jax.Array]
# per batch row: output token counts [max_num_seqs, V] i32 and prompt tokens [max_num_seqs, V] bool
PenaltyState = tuple[jax.Array, jax.Array]


@functools.partial(jax.jit, static_argnames=("model_config", "plan", "shape", "mesh"),
                   donate_argnums=(4,))
def sample_tokens(head: Params, rows: jax.Array, buf: jax.Array, prev_tokens: jax.Array,
                  penalty_state: PenaltyState | None, *, model_config: ModelConfig,
                  plan: ModelPlan, shape: StepShape, mesh: Mesh | None = None
                  ) -> tuple[jax.Array, Logprobs | None, PenaltyState | None]:
    """The LM head and the sampler over the first ``shape.num_sampled`` of the forward's rows
    (``buf``: the sampler's part of the packed buffer; ``head``: `head_params` only). Returns the
    sampled ids padded to ``[max_num_seqs]``, or ``prev_tokens`` when no sequence is live, so a
    warm-up step never breaks the chain of forwarded tokens; with ``shape.num_logprobs >= 0``
    their logprobs (`Logprobs`, of the first num_sampled rows); with ``shape.penalties`` the
    penalty state (donated) with each sampled token counted in its batch row. Under a `mesh`,
    logits and tokens are replicated so every device samples alike."""
    a = shape.unpack(buf, "sampler")
    rows = rows[:shape.num_sampled]
    model = LlamaForCausalLM(model_config, plan, mesh)
    # a feature-major LM head's logits reach the sampler as its dot wrote them, [V, N]
    vocab_major = mesh is None and runs_feature_major(rows, plan.feature_major_rows)
    logits = model.apply({"params": head}, rows, vocab_major, method=LlamaForCausalLM.compute_logits)
    logits = sharding.gather_logits(logits, mesh)
    params = SamplingTensors(temperature=a["temperature"], top_k=a["top_k"], top_p=a["top_p"],
                             min_p=a["min_p"], seed=a["seed"], step=a["step"], stream=a["stream"],
                             bias_ids=a.get("bias_ids"), bias_values=a.get("bias_values"))
    if shape.penalties:
        counts, seen = penalty_state
        batch_row = a["batch_row"]
        params = params.replace(repetition_penalty=a["repetition_penalty"],
                                presence_penalty=a["presence_penalty"],
                                frequency_penalty=a["frequency_penalty"],
                                output_counts=counts[batch_row], prompt_mask=seen[batch_row])
    sampled = sample(logits, params, vocab_major)
    logprobs = None
    if shape.num_logprobs >= 0:
        logprobs = token_logprobs(logits.T if vocab_major else logits, sampled, shape.num_logprobs)
        logprobs = sharding.replicate(logprobs, mesh)
    if shape.penalties:  # padding rows have batch_row max_num_seqs: dropped
        penalty_state = sharding.replicate((counts.at[batch_row, sampled].add(1, mode="drop"), seen),
                                           mesh)
    tokens = jnp.zeros_like(prev_tokens).at[:shape.num_sampled].set(sampled)
    tokens = jnp.where(a["num_seqs"][0] > 0, tokens, prev_tokens)
    return sharding.replicate(tokens, mesh), logprobs, penalty_state


@functools.partial(jax.jit, static_argnames=("model_config", "plan", "k", "mesh"))
def prompt_logprobs(head: Params, hidden: jax.Array, rows: jax.Array, targets: jax.Array, *,
                    model_config: ModelConfig, plan: ModelPlan, k: int,
                    mesh: Mesh | None = None) -> Logprobs:
    """`Logprobs` of ``targets`` [P] (each row's next prompt token) under the logits of the token
    rows ``rows`` [P] of a forward's every-row ``hidden``, with the k most likely tokens. Without
    a mesh the logits are made in chunks of at most 256 rows."""
    model = LlamaForCausalLM(model_config, plan, mesh)

    def chunk(h: jax.Array, t: jax.Array) -> Logprobs:
        logits = model.apply({"params": head}, h, False, method=LlamaForCausalLM.compute_logits)
        return token_logprobs(sharding.gather_logits(logits, mesh), t, k)

    h = hidden[rows]
    size = rows.shape[0]
    step = min(256, size & -size)
    if mesh is not None or step == size:
        return sharding.replicate(chunk(h, targets), mesh)
    out = jax.lax.map(lambda x: chunk(*x), (h.reshape(size // step, step, -1),
                                            targets.reshape(size // step, step)))
    return tuple(o.reshape(size, *o.shape[2:]) for o in out)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0,))
def init_penalty_row(state: PenaltyState, row: jax.Array, token_ids: jax.Array,
                     num_prompt: jax.Array, *, mesh: Mesh | None = None) -> PenaltyState:
    """Set batch row ``row`` of the penalty state from a request's tokens ``token_ids`` (prompt
    then output, padded with -1; the first ``num_prompt`` are the prompt); replicated under a
    `mesh`, as the sampler program takes it."""
    counts, seen = state
    vocab = counts.shape[1]
    at = jnp.arange(token_ids.shape[0])
    valid = token_ids >= 0
    out_ids = jnp.where(valid & (at >= num_prompt), token_ids, vocab)
    prompt_ids = jnp.where(valid & (at < num_prompt), token_ids, vocab)
    counts_row = jnp.zeros(vocab, counts.dtype).at[out_ids].add(1, mode="drop")
    seen_row = jnp.zeros(vocab, seen.dtype).at[prompt_ids].set(True, mode="drop")
    return sharding.replicate((counts.at[row].set(counts_row), seen.at[row].set(seen_row)), mesh)


def step_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                min_buckets: tuple[int, int]) -> list[StepShape]:
    """Every StepShape a step can meet: token buckets from the minimum to max_num_batched_tokens,
    each with the sample buckets its rows allow (a step samples at most min(its tokens,
    max_num_seqs) rows)."""
    min_tokens, min_sampled = min_buckets

    def buckets(minimum: int, maximum: int) -> list[int]:
        return sorted({bucket(n, minimum, maximum) for n in range(0, maximum + 1, minimum)}
                      | {bucket(maximum, minimum, maximum)})

    shapes = []
    for t in buckets(min_tokens, max_num_batched_tokens):
        most = min(t, max_num_seqs)
        for s in buckets(min_sampled, max_num_seqs):
            if s == bucket(0, min_sampled, max_num_seqs) or s // 2 < most:
                shapes.append(StepShape(t, s, max_num_seqs, max_blocks_per_seq))
    return shapes


def default_compile_cache_dir() -> Path:
    """``$MINIVLLM_JAX_COMPILE_CACHE``, else ``~/.cache/minivllm_jax/xla``."""
    env = os.environ.get("MINIVLLM_JAX_COMPILE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "minivllm_jax" / "xla"


class ExecutableCache:
    """Compiled programs on disk (``step-<key>.bin``), so a later process loads a step instead of
    tracing, lowering and compiling it. A key hashes a program's statics, argument signature and
    device assignment (`StepPrograms.cache_key`) with `code_fingerprint()`: the jax and jaxlib
    versions, the devices, XLA_FLAGS and this library's own source, so any change to them
    recompiles. Process-local: no JAX config changes. Files are written to a temporary name and
    renamed complete; an unreadable file is a miss.

    Devices: a file records the ids of the devices its program was compiled for (its device
    assignment, in order), and `load` makes the executable run on exactly those devices. A
    serialized executable names no devices of its own: loaded without them, jax spreads it over
    every device of the backend, and a one-device program on a host with several devices then
    fails its first call ("Expected args to execute_sharded_on_local_devices to have N shards").
    A file made for other devices, or whose loaded executable does not run on them, is a miss.

    Stored: only programs XLA compiled in this process, without host callbacks (those hold
    pointers into the process). While JAX's own persistent cache is on (`jax_cache_on`), a
    `compile()` may return one of its entries, which XLA:CPU serializes again without its code
    (another process then fails with "Function ... not found"), so nothing is stored then."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()

    def _file(self, key: str) -> Path:
        digest = hashlib.sha256(f"{code_fingerprint()}\n{key}".encode()).hexdigest()[:40]
        return self.path / f"step-{digest}.bin"

    def load(self, key: str, devices: Sequence[jax.Device]) -> jax.stages.Compiled | None:
        """The program stored under ``key``, loaded to run on ``devices`` (the device assignment
        it was compiled for, in order: a mesh's devices, or the one device of its arguments);
        None (a miss) when there is none, it is unreadable, or it was made for other devices."""
        file = self._file(key)
        if not file.is_file():
            return None
        ids = [d.id for d in devices]
        try:
            stored_ids, payload, in_tree, out_tree = pickle.loads(file.read_bytes())
            if stored_ids != ids:
                logger.warning("ignoring compiled program %s: made for devices %s, not %s",
                               file, stored_ids, ids)
                return None
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=devices[0].client,
                execution_devices=list(devices))
            runs_on = [d.id for d in compiled.runtime_executable().local_devices()]
        except Exception as e:  # a foreign, truncated or older-format file: compile afresh
            logger.warning("ignoring unreadable compiled program %s: %s", file, e)
            return None
        local = [d.id for d in devices if d.process_index == jax.process_index()]
        if runs_on != local:
            logger.warning("ignoring compiled program %s: it loads onto devices %s, not %s",
                           file, runs_on, local)
            return None
        return compiled

    def store(self, key: str, compiled: jax.stages.Compiled, devices: Sequence[jax.Device]) -> None:
        """Keep ``compiled``, compiled for ``devices`` (its device assignment, in order)."""
        file = self._file(key)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}")
            record = ([d.id for d in devices], *serialize_executable.serialize(compiled))
            tmp.write_bytes(pickle.dumps(record))
            tmp.replace(file)
        except Exception as e:  # an unwritable cache or a program XLA cannot serialize
            logger.warning("could not store a compiled program under %s: %s", self.path, e)


def jax_cache_on() -> bool:
    """Whether JAX's persistent compilation cache may serve this process's compilations."""
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """What a compiled program depends on besides its statics: jax and jaxlib versions, the
    devices, XLA_FLAGS, and the source of this library's jax packages."""
    import jaxlib

    import pallas_kernels

    h = hashlib.sha256()
    for package in (Path(__file__).parent, Path(pallas_kernels.__file__).parent):
        for file in sorted(package.rglob("*.py")):
            h.update(file.read_bytes())
    devices = sorted({(d.platform, d.device_kind) for d in jax.devices()})
    return "\n".join([jax.__version__, jaxlib.__version__, repr(devices), str(jax.device_count()),
                      os.environ.get("XLA_FLAGS", ""), h.hexdigest()])


class LoadedProgram:
    """A step program loaded from the `ExecutableCache`, called like the `jax.stages.Compiled`
    it holds. Until its first call succeeds, a call the loaded executable refuses (it raises
    while every argument buffer is still alive, so nothing was donated or consumed) recompiles
    the program from those arguments (``recompile``) and runs that instead: the programs are
    pure functions of their arguments, so the retry computes what an uncached run would. A
    failure after an argument was donated (the forward's KV cache, the penalty state) cannot
    be retried and re-raises, as does any failure after a first successful call."""

    def __init__(self, compiled: jax.stages.Compiled,
                 recompile: Callable[[tuple[Any, ...]], jax.stages.Compiled]) -> None:
        self.compiled = compiled
        self._recompile = recompile
        self._proven = False

    def __call__(self, *args: Any) -> Any:
        if self._proven:
            return self.compiled(*args)
        try:
            out = self.compiled(*args)
        except Exception as e:
            if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(args)):
                raise
            logger.warning("a compiled program from the cache failed to run (%s); compiling it", e)
            self.compiled = self._recompile(args)
            out = self.compiled(*args)
        self._proven = True
        return out


class StepPrograms:
    """The compiled forward of each token bucket and sampler of each sample bucket, keyed by
    ``StepShape.forward`` / ``.sampler``; each compiled from its first call's arguments, or loaded
    from the `ExecutableCache` (when given) without tracing. A loaded program runs on the devices
    its arguments live on (`devices`), takes their shardings, else it is a miss and compiles;
    it is kept as a `LoadedProgram`, which compiles afresh should its first call still fail
    before running."""

    def __init__(self, model_config: ModelConfig, plan: ModelPlan, mesh: Mesh | None,
                 cache: ExecutableCache | None = None) -> None:
        self.model_config = model_config
        self.plan = plan
        self.mesh = mesh
        self.cache = cache
        self._compiled: dict[StepShape, jax.stages.Compiled | LoadedProgram] = {}

    @property
    def compiled_shapes(self) -> frozenset[StepShape]:
        """Forwards (num_sampled 0) and samplers (num_tokens 0) compiled so far."""
        return frozenset(self._compiled)

    def lower(self, key: StepShape, args: tuple[Any, ...]) -> jax.stages.Lowered:
        """The forward (``key = shape.forward``) or the sampler (``key = shape.sampler``) lowered
        for ``args``; ``.compile().as_text()`` is the program XLA runs."""
        statics = dict(model_config=self.model_config, shape=key, mesh=self.mesh)
        if key.num_sampled == 0:
            return forward.lower(*args, plan=self.plan, **statics)
        if key.num_tokens == 0:  # the LM head reads only feature_major_rows: samplers are shared
            head_plan = ModelPlan(feature_major_rows=self.plan.feature_major_rows)
            return sample_tokens.lower(*args, plan=head_plan, **statics)
        raise ValueError(f"a program key is a StepShape's .forward or .sampler, not {key}")

    def get(self, key: StepShape, args: tuple[Any, ...]) -> jax.stages.Compiled | LoadedProgram:
        """The compiled program of ``key``, compiled for ``args`` (or loaded) on first use."""
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._load(key, args) or self._compile(key, self.lower(key, args), args)
            self._compiled[key] = compiled
        return compiled

    def devices(self, args: tuple[Any, ...]) -> tuple[jax.Device, ...] | None:
        """The device assignment a program for ``args`` compiles to, in order: the mesh's
        devices, else the one device every argument lives on; None when the arguments span
        several devices without a mesh (such programs are neither loaded nor stored)."""
        if self.mesh is not None:
            return tuple(self.mesh.devices.flat)
        on = {d for x in jax.tree.leaves(args) if isinstance(x, jax.Array)
              for d in x.sharding.device_set}
        return (on.pop(),) if len(on) == 1 else None

    def cache_key(self, key: StepShape, args: tuple[Any, ...]) -> str:
        """The program's statics, its arguments' structure, shapes, dtypes and shardings, and the
        platform and ids of the devices it runs on (`devices`)."""
        def leaf(x: Any) -> str:
            return f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{getattr(x, 'sharding', '')}"

        mesh = None if self.mesh is None else (self.mesh.axis_names, self.mesh.devices.shape)
        devices = [(d.platform, d.id) for d in self.devices(args) or ()]
        leaves, tree = jax.tree.flatten(args)
        return repr((self.model_config, self.plan, key, mesh, devices, str(tree),
                     [leaf(x) for x in leaves]))

    def _load(self, key: StepShape, args: tuple[Any, ...]) -> LoadedProgram | None:
        devices = self.devices(args)
        if self.cache is None or devices is None:
            return None
        compiled = self.cache.load(self.cache_key(key, args), devices)
        if compiled is None:
            return None
        leaves, tree = jax.tree.flatten(args)
        try:  # None: an argument the program does not read
            expected = tree.flatten_up_to(compiled.input_shardings[0])
        except (ValueError, TypeError):
            expected = None
        if expected is None or not all(
                s is None or not isinstance(x, jax.Array) or s.is_equivalent_to(x.sharding, x.ndim)
                for s, x in zip(expected, leaves)):
            logger.warning("ignoring the cached compiled program of %s: its input shardings differ "
                           "from its arguments'", key)
            return None

        def recompile(call_args: tuple[Any, ...]) -> jax.stages.Compiled:
            fresh = self._compile(key, self.lower(key, call_args), call_args)
            self._compiled[key] = fresh
            return fresh

        return LoadedProgram(compiled, recompile)

    def _compile(self, key: StepShape, lowered: jax.stages.Lowered,
                 args: tuple[Any, ...]) -> jax.stages.Compiled:
        compiled = lowered.compile()
        devices = self.devices(args)
        if (self.cache is not None and devices is not None and not jax_cache_on()
                and "callback" not in lowered.as_text()):
            self.cache.store(self.cache_key(key, args), compiled, devices)
        return compiled

    def compile_all(self, keys: list[StepShape], args_of: Callable[[StepShape], tuple[Any, ...]]) -> None:
        """Compile every key not compiled yet: lowered here one after another, compiled on a
        thread pool, biggest first (lowering overlaps the compiles)."""
        keys = sorted({k for k in keys if k not in self._compiled},
                      key=lambda k: (-k.num_tokens, -k.num_sampled))
        todo = []
        for key in keys:
            loaded = self._load(key, args_of(key))
            if loaded is None:
                todo.append(key)
            else:
                self._compiled[key] = loaded
        threads = max(1, min(MAX_COMPILE_THREADS, (os.cpu_count() or 2) // 2, len(todo)))
        with ThreadPoolExecutor(threads) as pool:
            pending = []
            for key in todo:
                args = args_of(key)
                pending.append((key, pool.submit(self._compile, key, self.lower(key, args), args)))
            for key, compiled in pending:
                self._compiled[key] = compiled.result()


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Point JAX's persistent compilation cache at ``path`` (default: the directory JAX already
    has, e.g. from ``$JAX_COMPILATION_CACHE_DIR``, else ``$MINIVLLM_JAX_COMPILE_CACHE``, else
    ``~/.cache/minivllm_jax/xla``), so a later process loads compiled steps instead of compiling
    them; programs that compiled in ``MIN_CACHED_COMPILE_SECONDS`` or more are kept. This changes
    JAX's process-wide config, so the library never calls it: scripts and notebooks do, before
    their first compilation."""
    if path is None and jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    path = default_compile_cache_dir() if path is None else Path(path).expanduser()
    jax.config.update("jax_compilation_cache_dir", str(path))
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min(threshold, MIN_CACHED_COMPILE_SECONDS))
    return path
