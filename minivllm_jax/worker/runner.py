"""Step execution: the weights, the KV cache and the persistent batch, and the two calls that run
a scheduled step, `dispatch` (start it on the device) and `collect` (wait for its tokens).

Invariants:
- The runner learns about requests only from SchedulerOutput diffs, through its `InputBatch`, plus
  the tokens it samples itself.
- The KV cache is donated to each step's forward and replaced by its output.
- Token forwarding (async scheduling): a step may be dispatched before the previous one's tokens
  are collected. A token row at a position the batch does not know yet reads its id on the device
  from the previous step's sampled ids (`prev_index`, -1 elsewhere): each step returns its ids
  padded to max_num_seqs, and the runner feeds them to the next step.
- A step is its forward, then its sampler. `dispatch` launches both, but for a step with a
  structured-output row (`StepShape.structured`), whose sampler waits for the token bitmask the
  host fills while the forward runs (`dispatch_sampler`); no other step is dispatched between.
- A plain step makes one host-to-device transfer: its packed main buffer, passed straight into
  the compiled forward (put on the mesh first under tensor parallelism), which hands the
  sampler its part on the device. Only optional sampler groups, a structured step's bitmask and
  prompt-logprob rows add one each. On an accelerator the sampled ids' copy to the host starts
  as soon as the sampler is launched (`ExecutionPlan.early_host_copy`).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from minivllm_jax import kv_cache_sizing
from minivllm_jax.parallel import sharding
from minivllm_jax.buckets import bucket
from minivllm_jax.worker.executable_cache import ExecutableCache, default_compile_cache_dir
from minivllm_jax.engine_spec import EngineSpec
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.worker.input_batch import InputBatch, build_step_arrays
from minivllm_jax.models.llama import pad_embedding, unstack_layers
from minivllm_jax.models.quantization import quantization_of, quantize_params
from minivllm_jax.models.rope import rope_table
from minivllm_jax.parallel.multihost import StepChannel
from minivllm_jax.parallel.sharding import Params
from minivllm_jax.step_layout import StepShape
from minivllm_jax.structured_output.manager import bitmask_words
from minivllm_jax.worker.penalties import PenaltyCounts
from minivllm_jax.worker.step_programs import (Logprobs, SpecTokens, StepPrograms, forward_args,
                                        head_params, prompt_logprobs, sampler_args)
from scheduler import SchedulerOutput
from scheduler.request import MAX_LOGPROBS

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A dispatched step: its sampled ids still on the device, the requests they belong to, and
    what it computes (scheduled tokens and requests, and the KV tokens its attention reads).
    With logprobs asked for, `logprobs` is on the device too, as is `prompt_logprobs` with the
    requests and positions of its rows. `tokens` is None while `needs_bitmask`."""

    tokens: jax.Array | None
    req_ids: list[str]
    num_tokens: int
    num_reqs: int
    kv_tokens: int
    logprobs: Logprobs | None = None
    logprob_ks: np.ndarray | None = None  # per sampled request: top logprobs asked for, or -1
    prompt_logprobs: Logprobs | None = None
    prompt_req_ids: list[str] | None = None  # per prompt row: its request, position and k
    prompt_positions: np.ndarray | None = None
    prompt_ks: np.ndarray | None = None
    # the sampler's shape, its rows and its buffer part from the forward, and the buffer's extra
    # part (None: the shape has none), until launched
    sampler: tuple[StepShape, jax.Array, jax.Array, np.ndarray | None] | None = None
    # a speculative step's verified tokens per sampled request (`SpecTokens`), on the device
    spec: SpecTokens | None = None

    @property
    def needs_bitmask(self) -> bool:
        """Whether its sampler waits for `ModelRunner.dispatch_sampler`."""
        return self.sampler is not None

    @property
    def bitmask_rows(self) -> int:
        """The rows of the bitmask its sampler takes (its sample bucket)."""
        return self.sampler[0].num_sampled


@dataclass
class TokenLogprobs:
    """Logprobs of one chosen token (sampled, or the next prompt token): its logprob and rank,
    and the top ids and their logprobs (as many as the request asked for)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class StepResult:
    """A collected step: per request, its sampled tokens (partial prefills get none), their
    logprobs when asked for, and new prompt logprobs as (position, TokenLogprobs) pairs."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]]


def place_params(spec: EngineSpec, loaded: ModelConfig, params: Params) -> Params:
    """The params of the `loaded` model as `spec` runs them: quantized as the plan asks
    (`plan.model.quantization`; float params are quantized here, one weight at a time, where
    the loader did not); the embedding table padded to the plan's `llama.embed_width`; under a
    mesh, kv heads expanded and every leaf split over the devices;
    in the switched layout, one tree per layer. ValueError for quantized params the plan does
    not ask for."""
    want, have = spec.plan.model.quantization, quantization_of(params)
    if have is not None and have != want:
        raise ValueError(f"the params are quantized ({have}) but the engine's quantization is "
                         f"{want!r}: load them with the engine's quantization")
    if want is not None and have is None:
        params = quantize_params(params, want)
    params = pad_embedding(params, loaded, spec.plan.model)
    if spec.mesh is not None:
        placed, params = sharding.shard_model(loaded, params, spec.mesh)
        if placed != spec.model_config:
            raise RuntimeError("the params were placed for another model than the spec's")
    if spec.plan.model.layer_layout == "switched":
        params = unstack_layers(params, spec.model_config.num_hidden_layers,
                                host_views=spec.plan.host_views)
    return params


class ModelRunner:
    """Owns the weights, the KV cache and the persistent batch of one engine, built from a
    spec (`engine_spec.EngineSpec`) it only reads."""

    def __init__(self, spec: EngineSpec, params: Params) -> None:
        """`params` as `place_params` placed them for this spec."""
        self.spec = spec
        self.model_config, self.config, self.plan, self.mesh = (
            spec.model_config, spec.config, spec.plan, spec.mesh)
        self.num_blocks = spec.num_blocks
        self.params = params
        # multi-host: process 0 schedules and broadcasts each step; the others run `follow()`
        self.channel = StepChannel(header_len=len(StepShape(0, 0, 0, 0).header)) \
            if self.plan.multi_host else None
        cache = self.config.compile_cache
        self.executable_cache = None if cache is False else ExecutableCache(
            default_compile_cache_dir() if cache is True else cache)
        self.programs = StepPrograms(self.model_config, self.plan.model, self.mesh,
                                     self.executable_cache)
        self.shapes_used: set[StepShape] = set()
        # the last dispatched step's sampled ids, [max_num_seqs] on the device
        self.last_tokens = sharding.put_replicated(np.zeros(self.config.max_num_seqs, np.int32),
                                                   self.mesh)
        self.rope = sharding.put_replicated(rope_table(self.model_config, self.config.max_model_len),
                                            self.mesh)
        self.penalties = PenaltyCounts(self.config.max_num_seqs, self.model_config.vocab_size,
                                       self.config.max_model_len, self.mesh)
        self.batch = InputBatch(self.config.max_num_seqs, self.config.max_model_len,
                                self.config.max_blocks_per_seq)
        self.kv_cache = self._init_kv_cache(self.num_blocks)

    def _init_kv_cache(self, num_blocks: int) -> jax.Array:
        return kv_cache_sizing.init_kv_cache(self.model_config, num_blocks, self.config.block_size,
                                             self.plan.kv_cache_storage, self.mesh,
                                             self.plan.backend.cache_layout)

    def max_step_peak_bytes(self) -> int:
        """Run a max-size step (every row sampled, none live) and return the device's peak bytes
        in use: this runner's cache and weights included. (The engine profiles on a runner of
        `kv_cache_sizing.probe_blocks` blocks, then drops it.)"""
        shape = self.spec.max_step()
        self._run(shape, shape.empty_step(temperature=1.0))
        device = jax.local_devices()[0] if self.mesh is None else self.mesh.local_devices[0]
        stats = device.memory_stats() or {}
        return int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))

    # ---- compilation -----------------------------------------------------------------------
    def precompile(self, structured: bool = False) -> int:
        """Compile the forward of every token bucket and the sampler of every sample bucket in
        `spec.step_shapes()` (with `structured`, each sampler also as a structured step's, which takes
        a token bitmask), then run each once on an empty batch (every slot -1: the cache keeps
        its contents; XLA:CPU sets up its dots on a program's first run), so that serving never
        stops to compile; returns the number of step shapes covered. A multi-host leader
        broadcasts each step it runs, so its followers compile and run it too."""
        shapes = self.spec.step_shapes()
        if structured:
            shapes += [dataclasses.replace(s, structured=True) for s in shapes]
        if self.channel is None:
            keys = [k for s in shapes for k in (s.forward, s.sampler)]
            self.programs.compile_all(keys, self.empty_args)
        ran: set[StepShape] = set()  # small buckets first: each sampler rides the smallest forward
        for shape in sorted(shapes, key=lambda s: (s.num_tokens, -s.num_sampled, s.kind, s.sampling)):
            if not {shape.forward, shape.sampler} <= ran:
                buf = shape.empty_step()
                if self.channel is not None:
                    self.channel.send(shape.header, buf)
                self._run(shape, buf)
                ran |= {shape.forward, shape.sampler}
        return len(shapes)

    def empty_args(self, key: StepShape) -> tuple[Any, ...]:
        """The arguments of program ``key`` (a StepShape's .forward or .sampler) for a step with
        no live sequence."""
        main, extra = key.split(key.empty_step())
        if key.num_sampled == 0:
            return self._forward_args(main)
        rows = np.zeros((key.max_num_seqs * key.positions_per_row, self.model_config.hidden_size),
                        self.params["embed_tokens"].dtype)
        put = lambda x: sharding.put_replicated(x, self.mesh)  # device arrays, as the forward's
        return self._sampler_args(put(rows), put(main[key.sampler_offset:]), extra, key)

    def _to_device(self, host: np.ndarray) -> np.ndarray | jax.Array:
        """A host array as a program argument: as it is without a mesh (the compiled call moves
        it, one transfer and no program of its own), else put whole on every device."""
        return host if self.mesh is None else sharding.put_replicated(host, self.mesh)

    def _forward_args(self, main: np.ndarray) -> tuple[Any, ...]:
        return forward_args(self.params, self.kv_cache, self._to_device(main), self.last_tokens,
                            self.rope)

    def _sampler_args(self, rows: jax.Array, buf: jax.Array, extra: np.ndarray | None,
                      key: StepShape, bitmask: np.ndarray | None = None) -> tuple[Any, ...]:
        """``buf``: the forward's "sampler" part; ``extra``: the step's extra part (host). `bitmask`:
        a structured step's [num_sampled, words] token bitmask (None: every row allows every
        token)."""
        if key.penalties and self.penalties.state is None:
            raise RuntimeError("a step with penalties ran before their state was set up")
        if key.structured and bitmask is None:
            bitmask = np.full((key.num_sampled, bitmask_words(self.model_config.vocab_size)), -1, np.int32)
        put = lambda a: None if a is None else self._to_device(a)  # noqa: E731
        return sampler_args(key, self.params, rows, buf, put(extra), self.last_tokens,
                            self.penalties.state, put(bitmask))

    # ---- one step --------------------------------------------------------------------------
    def dispatch(self, so: SchedulerOutput) -> InFlight | None:
        """Enqueue the step scheduled in `so` on the device and return without waiting for it
        (JAX dispatches asynchronously); None when nothing was scheduled. Steps are collected in
        dispatch order, each at most one dispatch late: a step may use the one pending token per
        request of the step before (forwarded on the device), never an older uncollected one."""
        self.batch.apply_diffs(so, self.config.seed)
        self.penalties.init_rows(self.batch)
        if so.total_num_scheduled_tokens == 0:
            return None
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        q_lens = [so.num_scheduled_tokens[r] for r in req_ids]
        spec = self.config.speculative_config
        num_drafts = self.batch.write_drafts(req_ids, so.scheduled_spec_decode_tokens)
        shape, arrays, sampled_ids, sampled_rows = build_step_arrays(
            self.batch, req_ids, q_lens, self.config, self.plan.min_buckets, num_drafts,
            spec.num_speculative_tokens if spec else 0, self.plan.backend.name)
        self.shapes_used.add(shape)
        buf = shape.pack(arrays)
        if self.channel is not None:
            self.channel.send(shape.header, buf)
        main, extra = shape.split(buf)
        rows, hidden, sampler_buf = self._launch_forward(shape, main)
        self.batch.mark_sampled(sampled_rows)
        in_flight = InFlight(None, sampled_ids, so.total_num_scheduled_tokens, len(req_ids),
                             int(arrays["kv_lens"].sum()), logprob_ks=(
                                 self.batch.num_logprobs[sampled_rows] if shape.num_logprobs >= 0 else None),
                             sampler=(shape, rows, sampler_buf, extra))
        if hidden is not None:
            self._launch_prompt_logprobs(in_flight, hidden, arrays, req_ids)
        if not shape.structured:
            self.dispatch_sampler(in_flight)
        return in_flight

    def dispatch_sampler(self, in_flight: InFlight, bitmask: np.ndarray | None = None) -> None:
        """Launch a dispatched step's sampler (`dispatch` does, unless the step is structured):
        `bitmask` [`bitmask_rows`, words] i32, the allowed tokens of each sampled row, padding
        rows after them."""
        shape, rows, buf, extra = in_flight.sampler
        in_flight.sampler = None
        in_flight.tokens, in_flight.logprobs, in_flight.spec = self._launch_sampler(
            shape, rows, buf, extra, bitmask)
        if self.plan.early_host_copy:  # collect's reads then find them on the host
            for x in jax.tree.leaves((in_flight.tokens, in_flight.logprobs, in_flight.spec)):
                x.copy_to_host_async()

    def collect(self, in_flight: InFlight) -> StepResult:
        """Wait for a dispatched step: the sampled token of each request whose scheduled tokens
        reach the end of its known tokens (partial prefills get none), and the logprobs asked for."""
        req_ids = in_flight.req_ids
        if in_flight.spec is None:
            tokens = sharding.to_host(in_flight.tokens)[:len(req_ids)]
            self.batch.append_tokens(req_ids, tokens)
            result = StepResult({r: [t] for r, t in zip(req_ids, tokens.tolist())}, {}, {})
        else:  # a verified step: each request's accepted drafts, then one more token
            verified = sharding.to_host(in_flight.spec[0])[:len(req_ids)].tolist()
            emitted = sharding.to_host(in_flight.spec[1])[:len(req_ids)].tolist()
            result = StepResult({r: t[:e] for r, t, e in zip(req_ids, verified, emitted)}, {}, {})
            self.batch.append_token_lists(result.tokens)
        if in_flight.logprobs is not None:  # a verified step's: one row per position
            per = 1 if in_flight.spec is None else in_flight.spec[0].shape[1]
            lps = _host_logprobs(in_flight.logprobs, len(req_ids) * per)
            for i, (r, k) in enumerate(zip(req_ids, in_flight.logprob_ks.tolist())):
                if k >= 0:
                    result.logprobs[r] = [_trim(lp, k) for lp in
                                          lps[i * per:i * per + len(result.tokens[r])]]
        if in_flight.prompt_logprobs is not None:
            positions, ks = in_flight.prompt_positions.tolist(), in_flight.prompt_ks.tolist()
            lps = _host_logprobs(in_flight.prompt_logprobs, len(positions))
            for r, pos, k, lp in zip(in_flight.prompt_req_ids, positions, ks, lps):
                result.prompt_logprobs.setdefault(r, []).append((pos, _trim(lp, k)))
        return result

    def _launch_forward(self, shape: StepShape, main: np.ndarray
                        ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """The step's forward, not waited for: the sampled rows' hidden states, with
        `shape.all_hidden` every token row's, and the buffer's sampler part on the device."""
        args = self._forward_args(main)
        rows, self.kv_cache, hidden, sampler_buf = self.programs.get(shape.forward, args)(*args)
        return rows, hidden, sampler_buf

    def _launch_sampler(self, shape: StepShape, rows: jax.Array, buf: jax.Array,
                        extra: np.ndarray | None, bitmask: np.ndarray | None = None
                        ) -> tuple[jax.Array, Logprobs | None, SpecTokens | None]:
        """The step's sampler, not waited for: the sampled ids on the device (which the next
        step reads pending tokens from), their logprobs when the shape asks, and a speculative
        step's verified tokens."""
        args = self._sampler_args(rows, buf, extra, shape.sampler, bitmask)
        self.last_tokens, logprobs, state, spec = self.programs.get(shape.sampler, args)(*args)
        if shape.penalties:
            self.penalties.state = state
        return self.last_tokens, logprobs, spec

    def _run(self, shape: StepShape, buf: np.ndarray) -> np.ndarray:
        """The step, waited for; its sampled ids on the host."""
        main, extra = shape.split(buf)
        rows, _, sampler_buf = self._launch_forward(shape, main)
        return sharding.to_host(self._launch_sampler(shape, rows, sampler_buf, extra)[0])

    def recover(self) -> bool:
        """After a failed step: make the device state usable again. An array that the failure
        consumed (donated) or poisoned is rebuilt: the KV cache empty (returns False: every
        cached token is lost), the last sampled ids as zeros, the penalty counts from the
        batch's tokens. Returns True when the KV cache came through intact."""
        if not _usable(self.last_tokens):
            self.last_tokens = sharding.put_replicated(
                np.zeros(self.config.max_num_seqs, np.int32), self.mesh)
        if self.penalties.state is not None and not _usable(self.penalties.state):
            self.penalties.rebuild_later(self.batch)
        if _usable(self.kv_cache):
            return True
        self.kv_cache = self._init_kv_cache(self.num_blocks)
        return False

    # ---- prompt logprobs ------------------------------------------------------------
    def _launch_prompt_logprobs(self, in_flight: InFlight, hidden: jax.Array,
                                arrays: dict[str, np.ndarray], req_ids: list[str]) -> None:
        """Start the prompt-logprobs program over this step's prompt rows (`build_step_arrays`'
        ``prompt_*`` arrays), padded to a bucket, with the largest k they ask for."""
        rows = arrays["prompt_rows"]
        size = bucket(len(rows), 16, self.config.max_num_batched_tokens)
        rows_targets = np.zeros((2, size), np.int32)
        rows_targets[0, :len(rows)], rows_targets[1, :len(rows)] = rows, arrays["prompt_targets"]
        k = int(arrays["prompt_k"].max())
        k = bucket(k, 1, MAX_LOGPROBS) if k else 0
        in_flight.prompt_logprobs = prompt_logprobs(
            head_params(self.params), hidden, self._to_device(rows_targets),
            model_config=self.model_config, plan=self.plan.model, k=k, mesh=self.mesh)
        in_flight.prompt_req_ids = [req_ids[s] for s in arrays["prompt_seqs"]]
        in_flight.prompt_positions = arrays["prompt_positions"]
        in_flight.prompt_ks = arrays["prompt_k"]

    # ---- multi-host ------------------------------------------------------------------------
    def follow(self) -> None:
        """Processes other than 0: run every step process 0 broadcasts, until it calls
        `stop_followers()`. Their sampled tokens are dropped (process 0's are the same)."""
        if self.channel is None or jax.process_index() == 0:
            raise RuntimeError("follow() runs only on processes other than 0 of a multi-host run")
        cfg = self.config
        while (message := self.channel.receive()) is not None:
            header, buf = message
            self._run(StepShape.from_header(header, cfg.max_num_seqs, cfg.max_blocks_per_seq), buf)

    def stop_followers(self) -> None:
        """Process 0 of a multi-host run: end the other processes' `follow()` loops."""
        if self.channel is not None and jax.process_index() == 0:
            self.channel.stop()


def _usable(tree: Any) -> bool:
    """Whether every array of `tree` still exists and computed without error."""
    try:
        leaves = jax.tree.leaves(tree)
        return not any(x.is_deleted() for x in leaves) and jax.block_until_ready(leaves) is not None
    except Exception:  # noqa: BLE001 - an array poisoned by a failed computation raises here
        return False


def _host_logprobs(logprobs: Logprobs, count: int) -> list[TokenLogprobs]:
    """The first `count` rows of device `Logprobs` as host `TokenLogprobs`."""
    chosen, rank, top_ids, top_lp = (sharding.to_host(x)[:count].tolist() for x in logprobs)
    return [TokenLogprobs(*row) for row in zip(chosen, rank, top_ids, top_lp)]


def _trim(lp: TokenLogprobs, k: int) -> TokenLogprobs:
    """`lp` with only the k most likely tokens a request asked for (the bucket may hold more)."""
    return TokenLogprobs(lp.logprob, lp.rank, lp.top_ids[:k], lp.top_logprobs[:k])
