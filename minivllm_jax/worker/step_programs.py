"""The step's programs: the model's forward (`forward`), the LM head with the sampler
(`sample_tokens`), prompt logprobs (`prompt_logprobs`) and the penalty state's row set-up
(`init_penalty_row`), and their executables per bucket (`StepPrograms`).

Invariants:
- A step is two programs: the model's forward, compiled once per token bucket and attention kind
  (`StepShape.forward`), and the LM head with the sampler, once per sample bucket and sampling
  kind (`StepShape.sampler`). Neither holds a conditional: every choice the host can make is a
  static of its shape, and the only loop is the layer loop (plus the CPU attention's work-list
  loops).
- A plain step moves one buffer to the device: the forward takes the packed main part and
  returns its sampler tail, which the sampler takes; only the optional groups (logit bias,
  penalties, drafts) and a structured step's bitmask travel on their own. `StepPrograms` keeps each `jax.stages.Compiled` (a `LoadedProgram` when
  it came from the `ExecutableCache`) and the runner calls it directly, so nothing retraces once
  a bucket is compiled.
- The programs are module-level jits keyed on hashable statics (model config, `ModelPlan`,
  shape, mesh): engines with equal statics share compilations.
- The sampler's `SamplingTensors` are the buffer's `sampling_fields.SAMPLING_FIELDS` rows
  (`StepShape.sampling_fields`) plus its special per-row fields.
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from minivllm_jax.parallel import sharding
from minivllm_jax.models.attention import AttentionMetadata, with_kernel_metadata
from minivllm_jax.worker.executable_cache import ExecutableCache, LoadedProgram, jax_cache_on
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.models.llama import DecoderLayer, LlamaForCausalLM, runs_feature_major
from minivllm_jax.plan import ModelPlan
from minivllm_jax.sampling.rejection_sampler import verify_step
from minivllm_jax.sampling.sampler import GREEDY, SamplingTensors, sample, token_logprobs
from minivllm_jax.parallel.sharding import Params
from minivllm_jax.step_layout import StepShape

# the top-level params the LM head reads (the final norm, and the embedding when tied)
HEAD_PARAMS = ("embed_tokens", "norm", "lm_head")
# precompile() compiles on a thread per two cores, at most this many (XLA compiles outside the GIL)
MAX_COMPILE_THREADS = 8


def head_params(params: Params) -> Params:
    """The `HEAD_PARAMS` of a model's params: all the sampler program reads."""
    return {k: v for k, v in params.items() if k in HEAD_PARAMS}


@functools.partial(jax.jit, static_argnames=("model_config", "plan", "shape", "mesh"),
                   donate_argnums=(1,))
def forward(params: Params, kv_cache: jax.Array, buf: jax.Array, prev_tokens: jax.Array,
            rope: jax.Array, *, model_config: ModelConfig, plan: ModelPlan, shape: StepShape,
            mesh: Mesh | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array]:
    """The model over the step's token rows (``buf``: the main part of the packed buffer, its
    attention kind ``shape.kind``); returns the hidden states of the rows in logits_indices,
    ``[max_num_seqs, hidden]`` (replicated under a `mesh`), the cache, with
    ``shape.all_hidden`` every token row's hidden state ``[num_tokens, hidden]`` (None
    otherwise), and the buffer's "sampler" part for the sampler program. Rows with
    ``prev_index >= 0`` take their input id from ``prev_tokens`` (the previous step's sampled
    ids); ``rope`` is ``rope.rope_table``."""
    a = shape.unpack(buf, "forward")
    prev = a["prev_index"]
    input_ids = jnp.where(prev >= 0, prev_tokens[jnp.maximum(prev, 0)], a["input_ids"])
    md = _attention_metadata(a, shape)
    model = LlamaForCausalLM(model_config, plan, mesh)
    hidden, kv_cache = model.apply({"params": params}, input_ids, a["positions"], kv_cache, md, rope)
    every = sharding.replicate(hidden, mesh) if shape.all_hidden else None
    sampler_buf = sharding.replicate(buf[shape.sampler_offset:], mesh)
    return sharding.replicate(hidden[a["logits_indices"]], mesh), kv_cache, every, sampler_buf


def _attention_metadata(a: dict[str, jax.Array], shape: StepShape) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=a["slot_mapping"], block_tables=a["block_tables"],
                             kv_lens=a["kv_lens"], cu_q_lens=a["cu_q_lens"],
                             num_seqs=a["num_seqs"], kind=shape.kind)


def forward_layer_inputs(buf: jax.Array, kv_cache: jax.Array, rope: jax.Array, model_dtype: Any,
                         *, model_config: ModelConfig, plan: ModelPlan, shape: StepShape,
                         mesh: Mesh | None = None
                         ) -> tuple[AttentionMetadata, jax.Array, jax.Array]:
    """What `forward`'s layer loop reads besides the weights, the residual stream and the cache,
    as the loop sees it: the step's attention metadata (the kernel's included) and the RoPE
    rows' cos and sin."""
    a = shape.unpack(buf, "forward")
    md = with_kernel_metadata(_attention_metadata(a, shape), shape.num_tokens, kv_cache,
                              model_dtype, config=model_config, plan=plan, mesh=mesh)
    rows = jnp.take(rope, a["positions"], axis=0, mode="clip")
    return md, rows[:, 0], rows[:, 1]


@functools.partial(jax.jit, static_argnames=("model_config", "plan", "mesh"), donate_argnums=(1,))
def forward_layer(layer_params: Params, kv_cache: jax.Array, x: jax.Array, cos: jax.Array,
                  sin: jax.Array, md: AttentionMetadata, *, model_config: ModelConfig,
                  plan: ModelPlan, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """One iteration of `forward`'s layer loop on its own (layer 0's weights, ``layer_params``:
    one slice of the stacked ``params["layers"]``): XLA's cost analysis counts a loop's body
    once, so the ahead-of-time report adds this program's cost for every other layer."""
    layer = DecoderLayer(model_config, plan, mesh)
    (x, kv_cache), _ = layer.apply({"params": layer_params}, (x, kv_cache), jnp.int32(0), cos,
                                   sin, md)
    return x, kv_cache


# the sampled tokens' logprobs and ranks, and the top ids and logprobs (`sampler.token_logprobs`)
Logprobs = tuple[jax.Array, jax.Array, jax.Array, jax.Array]
# per batch row: output token counts [max_num_seqs, V] i32 and prompt tokens [max_num_seqs, V] bool
PenaltyState = tuple[jax.Array, jax.Array]
# a speculative step's verification: tokens [num_sampled, K+1] (-1 after the emitted ones) and
# the number emitted per row (`rejection_sampler.verify`)
SpecTokens = tuple[jax.Array, jax.Array]


@functools.partial(jax.jit, static_argnames=("model_config", "plan", "shape", "mesh"),
                   donate_argnums=(5,))
def sample_tokens(head: Params, rows: jax.Array, buf: jax.Array, extra: jax.Array | None,
                  prev_tokens: jax.Array, penalty_state: PenaltyState | None,
                  bitmask: jax.Array | None = None, *, model_config: ModelConfig,
                  plan: ModelPlan, shape: StepShape, mesh: Mesh | None = None
                  ) -> tuple[jax.Array, Logprobs | None, PenaltyState | None, SpecTokens | None]:
    """The LM head and the sampler (sampling kind ``shape.sampling``) over the first
    ``shape.num_sampled`` of the forward's rows (``buf``: the packed buffer's "sampler" part, as
    the forward returns it; ``extra``: its "extra" part, None when the shape has none; ``head``:
    `head_params` only). Returns the
    sampled ids padded to ``[max_num_seqs]``, or ``prev_tokens`` when no sequence is live, so a
    warm-up step never breaks the chain of forwarded tokens; with ``shape.num_logprobs >= 0``
    their logprobs (`Logprobs`, of the first num_sampled rows); with ``shape.penalties`` the
    penalty state (donated) with each sampled token counted in its batch row; with
    ``shape.structured`` the rows' token ``bitmask`` [num_sampled, ceil(V/32)]. Under a `mesh`,
    logits and tokens are replicated so every device samples alike. A speculative step
    (``shape.num_spec``) verifies each row's drafts (`rejection_sampler.verify_step`): its sampled
    id is the last token emitted, `SpecTokens` all of them, logprobs are per position and the
    penalty counts take every emitted token."""
    a = shape.unpack(buf, "sampler")
    if extra is not None:
        a.update(shape.unpack(extra, "extra"))
    positions = shape.positions_per_row
    rows = rows[:shape.num_sampled * positions]
    model = LlamaForCausalLM(model_config, plan, mesh)
    # a feature-major LM head's logits reach the sampler as its dot wrote them, [V, N]
    vocab_major = mesh is None and runs_feature_major(rows, plan.feature_major_rows)
    logits = model.apply({"params": head}, rows, vocab_major, method=LlamaForCausalLM.compute_logits)
    logits = (sharding.vocab_split_logits if _reduces_in_place(shape) else sharding.gather_logits)(
        logits, mesh)
    params = SamplingTensors(**{f.name: a[f.name] for f in shape.sampling_fields},
                             seed=a["seed"], step=a["step"], stream=a["stream"],
                             bias_ids=a.get("bias_ids"), bias_values=a.get("bias_values"),
                             token_bitmask=bitmask if shape.structured else None)
    if shape.penalties:
        counts, seen = penalty_state
        batch_row = a["batch_row"]
        params = params.replace(output_counts=counts[batch_row], prompt_mask=seen[batch_row])
    spec = None
    if shape.num_spec:
        spec = verify_step(logits, a["draft_tokens"], a["num_drafts"], params, vocab_major,
                           shape.sampling)
        emitted = spec[0].reshape(-1)  # every position's token, -1 after the emitted ones
        sampled = jnp.take_along_axis(spec[0], (spec[1] - 1)[:, None], axis=1)[:, 0]
        spec = sharding.replicate(spec, mesh)
    else:
        sampled = emitted = sample(logits, params, vocab_major, shape.sampling)
    logprobs = None
    if shape.num_logprobs >= 0:
        logprobs = token_logprobs(logits.T if vocab_major else logits, jnp.maximum(emitted, 0),
                                  shape.num_logprobs)
        logprobs = sharding.replicate(logprobs, mesh)
    if shape.penalties:  # padding rows have batch_row max_num_seqs, unemitted tokens -1: dropped
        vocab = counts.shape[-1]
        at = (jnp.repeat(batch_row, positions), jnp.where(emitted >= 0, emitted, vocab))
        penalty_state = sharding.replicate((counts.at[at].add(1, mode="drop"), seen), mesh)
    tokens = jnp.zeros_like(prev_tokens).at[:shape.num_sampled].set(sampled)
    tokens = jnp.where(a["num_seqs"][0] > 0, tokens, prev_tokens)
    return sharding.replicate(tokens, mesh), logprobs, penalty_state, spec


def _reduces_in_place(shape: StepShape) -> bool:
    """Whether the sampler only takes each row's first argmax of the raw logits (greedy, nothing
    that reads or changes a logit by its id), which tensor parallelism then reduces on the
    vocab-split logits (a max and a min, exact, each an all-reduce of ``[S]``) instead of
    all-gathering ``[S, V]`` float32 onto every device."""
    return (shape.sampling == GREEDY and not shape.num_spec and not shape.penalties
            and not shape.structured and not shape.num_bias and shape.num_logprobs < 0)


def forward_args(params: Params, kv_cache: Any, main: Any, last_tokens: Any, rope: Any
                 ) -> tuple[Any, ...]:
    """`forward`'s arguments in its order (the runner's arrays, or `aot`'s abstract ones)."""
    return (params, kv_cache, main, last_tokens, rope)


def sampler_args(key: StepShape, params: Params, rows: Any, buf: Any, extra: Any,
                 last_tokens: Any, penalty_state: Any, bitmask: Any) -> tuple[Any, ...]:
    """`sample_tokens`' arguments for program ``key`` in its order (the runner's arrays, or
    `aot`'s abstract ones): the head of `params`; the penalty state and the token bitmask only
    where ``key`` has penalties and a structured row."""
    return (head_params(params), rows, buf, extra, last_tokens,
            penalty_state if key.penalties else None, bitmask if key.structured else None)


@functools.partial(jax.jit, static_argnames=("model_config", "plan", "k", "mesh"))
def prompt_logprobs(head: Params, hidden: jax.Array, rows_targets: jax.Array, *,
                    model_config: ModelConfig, plan: ModelPlan, k: int,
                    mesh: Mesh | None = None) -> Logprobs:
    """`Logprobs` of the targets ``rows_targets[1]`` [P] (each row's next prompt token) under the
    logits of the token rows ``rows_targets[0]`` [P] of a forward's every-row ``hidden``, with
    the k most likely tokens. Without a mesh the logits are made in chunks of at most 256 rows
    (a loop of static trip count)."""
    rows, targets = rows_targets[0], rows_targets[1]
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

    def lower(self, key: StepShape, args: tuple[Any, ...],
              platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The forward (``key = shape.forward``) or the sampler (``key = shape.sampler``) lowered
        for ``args`` (for ``platforms``, e.g. ``("cuda",)``, when given: no device needed);
        ``.compile().as_text()`` is the program XLA runs."""
        statics = dict(model_config=self.model_config, shape=key, mesh=self.mesh)
        if key.num_sampled == 0:
            program, plan = forward, self.plan
        elif key.num_tokens == 0:  # the LM head reads only these three: samplers are shared
            program, plan = sample_tokens, ModelPlan(feature_major_rows=self.plan.feature_major_rows,
                                                     quantization=self.plan.quantization,
                                                     embed_lanes=self.plan.embed_lanes)
        else:
            raise ValueError(f"a program key is a StepShape's .forward or .sampler, not {key}")
        if platforms is None:
            return program.lower(*args, plan=plan, **statics)
        return program.trace(*args, plan=plan, **statics).lower(lowering_platforms=platforms)

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

        def recompile(call_args: tuple[Any, ...]) -> jax.stages.Compiled:
            fresh = self._compile(key, self.lower(key, call_args), call_args)
            self._compiled[key] = fresh
            return fresh

        return self.cache.load_program(self.cache_key(key, args), args, devices, recompile)

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
