"""The persistent batch and padded step metadata (minivllm_jax.worker.input_batch) vs a brute-force
construction from the real scheduler's own request state, over random workloads (chunked prefill,
preemption, prefix hits, finishing requests); plus the bucketing rule and the one-buffer
pack/unpack round trip."""
from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax.config import EngineConfig
from minivllm_jax.buckets import bucket
from minivllm_jax.worker.input_batch import MAX_BIAS_COLUMNS, InputBatch, build_step_arrays, derive_seed
from minivllm_jax.step_layout import StepShape
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def test_bucket_rule() -> None:
    assert [bucket(n, 16, 128) for n in (0, 1, 16, 17, 33, 64, 65, 128)] == [16, 16, 16, 32, 64, 64, 128, 128]
    assert bucket(100, 16, 100) == 100  # the cap is itself a bucket
    assert bucket(5, 16, 8) == 8
    for n in range(0, 300):
        b = bucket(n, 16, 300)
        assert b >= n and (b == 300 or (b >= 16 and b & (b - 1) == 0 and (b == 16 or b // 2 < n)))
    with pytest.raises(ValueError):
        bucket(301, 16, 300)


def test_big_buckets_step_by_quarters() -> None:
    """Past FINE_FROM the buckets are the quarter points of each power of two's upper half: a
    brute force over every size from 0 to 4096 picks the smallest allowed size >= n."""
    from minivllm_jax.buckets import FINE_FROM

    allowed = {16 << k for k in range(9)}
    allowed |= {p // 2 + j * p // 8 for p in allowed if p > FINE_FROM for j in range(1, 5)}
    assert sorted(b for b in allowed if b > FINE_FROM) == [1280, 1536, 1792, 2048, 2560, 3072, 3584,
                                                           4096]
    for n in range(0, 4097):
        assert bucket(n, 16, 4096) == min(b for b in allowed if b >= n), n
    assert bucket(1694, 4, 2048) == 1792 and bucket(1694, 4, 1700) == 1700


def _brute_force(sched: Scheduler, so, block_size: int, pending: dict[str, int],
                 prev_sampled: list[str]) -> dict:
    """Rows in the runner's order (new then cached), from the scheduler's Request objects.
    `pending`: each request's placeholders before this schedule (tokens of the step in flight,
    whose sampled requests were `prev_sampled`): a position past the known tokens must read the
    previous step's output at its request's index there."""
    order = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    ids, pos, slots, kv_lens, cu, logits, sampled, steps, seeds = [], [], [], [], [0], [], [], [], []
    tables, prev_index, prompt_rows = [], [], []
    for rid in order:
        req = sched.requests[rid]
        q = so.num_scheduled_tokens[rid]
        before = req.num_computed_tokens - q  # schedule() already advanced it
        blocks = sched.kv_cache_manager.get_block_ids(rid)
        tables.append(blocks)
        for j in range(q):
            p = before + j
            known = p < req.num_tokens
            ids.append(req.all_token_ids[p] if known else None)
            prev_index.append(-1 if known else prev_sampled.index(rid))
            if req.sampling_params.prompt_logprobs is not None and p + 1 < req.num_prompt_tokens:
                prompt_rows.append((len(pos), req.prompt_token_ids[p + 1], p + 1))
            pos.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        kv_lens.append(before + q)
        cu.append(cu[-1] + q)
        if before + q == req.num_tokens + pending.get(rid, 0):
            logits.append(cu[-1] - 1)
            sampled.append(rid)
            steps.append(req.num_output_tokens + pending.get(rid, 0))
            sp = req.sampling_params
            seeds.append(sp.seed if sp.seed is not None else derive_seed(7, rid))
    return dict(order=order, ids=ids, pos=pos, slots=slots, kv_lens=kv_lens, cu=cu, logits=logits,
                sampled=sampled, steps=steps, seeds=seeds, tables=tables, prev_index=prev_index,
                prompt_rows=prompt_rows)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metadata_matches_brute_force(seed: int, async_scheduling: bool) -> None:
    """With async scheduling each step is built before the previous one's tokens are appended,
    as the engine does: decodes then run on placeholders read from the previous step's output."""
    rng = random.Random(seed)
    cfg = EngineConfig(max_num_seqs=6, max_num_batched_tokens=48, max_model_len=96, block_size=4,
                       num_kv_blocks=40, seed=7).resolve(1024)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48, max_model_len=96,
                                      block_size=4, num_blocks=40, async_scheduling=async_scheduling))
    batch = InputBatch(cfg.max_num_seqs, cfg.max_model_len, cfg.max_blocks_per_seq)
    shared = [rng.randrange(100) for _ in range(12)]
    for i in range(14):
        prompt = (shared if i % 2 else []) + [rng.randrange(100) for _ in range(rng.randrange(1, 40))]
        sp = SamplingParams(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([0, 5]),
                            top_p=rng.choice([1.0, 0.9]), max_tokens=rng.randrange(4, 30),
                            min_tokens=rng.choice([0, 0, 3]), stop_token_ids=rng.choice([(), (7, 3)]),
                            ignore_eos=rng.choice([False, False, True]),
                            seed=rng.choice([None, 1234 + i]),
                            logit_bias={rng.randrange(100): rng.uniform(-5, 5)
                                        for _ in range(rng.choice([0, 0, 3, 11]))},
                            repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
                            frequency_penalty=rng.choice([0.0, 0.0, -0.5]),
                            logprobs=rng.choice([None, None, 0, 3]),
                            prompt_logprobs=rng.choice([None, None, None, 2]))
        sched.add_request(Request(str(i), prompt, sp, eos_token_id=99))
    steps = preempted = forwarded = masked = 0
    in_flight: tuple | None = None  # (scheduler output, sampled ids, their tokens)
    prev_sampled: list[str] = []
    while sched.has_unfinished_requests() or in_flight:
        pending = {rid: r.num_output_placeholders for rid, r in sched.requests.items()}
        so = sched.schedule()
        preempted += len(so.preempted_req_ids)
        batch.apply_diffs(so, engine_seed=7)
        ref = _brute_force(sched, so, cfg.block_size, pending, prev_sampled)
        this: tuple | None = None
        if so.total_num_scheduled_tokens == 0:
            sched.update_from_output(so, {})
        else:
            *this, num_masked = _check_step(batch, cfg, so, ref, sched, rng)
            masked += num_masked
            prev_sampled = this[1]
            forwarded += sum(i >= 0 for i in ref["prev_index"])
            steps += 1
        ran, in_flight = (in_flight, this) if async_scheduling else (this, None)
        if ran is not None:
            so_ran, ids, toks = ran
            batch.append_tokens(ids, toks)
            sched.update_from_output(so_ran, {r: [int(t)] for r, t in zip(ids, toks)})
    assert steps > 10 and preempted > 0, "the workload should exercise preemption"
    assert masked > 0, "the workload should exercise the min_tokens mask"
    assert (forwarded > steps) == async_scheduling


def _check_step(batch: InputBatch, cfg: EngineConfig, so, ref: dict, sched: Scheduler,
                rng: random.Random) -> tuple:
    """build_step_arrays against the brute force; marks the sampled rows as the runner does and
    returns (so, sampled ids, random tokens standing for the device's, rows under the min_tokens
    mask)."""
    shape, a, sampled_ids, sampled_rows = build_step_arrays(batch, ref["order"],
                                              [so.num_scheduled_tokens[r] for r in ref["order"]], cfg,
                                              (16, 8))
    t, n = len(ref["ids"]), len(ref["order"])
    assert shape.num_tokens == bucket(t, 16, 48) and shape.num_sampled == bucket(len(ref["sampled"]), 8, 6)
    known = [i for i, x in enumerate(ref["ids"]) if x is not None]
    np.testing.assert_array_equal(a["input_ids"][known], [ref["ids"][i] for i in known])
    np.testing.assert_array_equal(a["prev_index"][:t], ref["prev_index"])
    assert (a["prev_index"][t:] == -1).all()
    np.testing.assert_array_equal(a["positions"][:t], ref["pos"])
    np.testing.assert_array_equal(a["slot_mapping"][:t], ref["slots"])
    assert (a["slot_mapping"][t:] == -1).all()
    np.testing.assert_array_equal(a["kv_lens"][:n], ref["kv_lens"])
    assert (a["kv_lens"][n:] == 0).all()
    np.testing.assert_array_equal(a["cu_q_lens"][:n + 1], ref["cu"])
    assert (a["cu_q_lens"][n:] == t).all() and a["num_seqs"][0] == n
    for s, blocks in enumerate(ref["tables"]):
        np.testing.assert_array_equal(a["block_tables"][s, :len(blocks)], blocks)
    assert sampled_ids == ref["sampled"]
    k = len(sampled_ids)
    np.testing.assert_array_equal(a["logits_indices"][:k], ref["logits"])
    np.testing.assert_array_equal(a["step"][:k], ref["steps"])
    np.testing.assert_array_equal(a["seed"][:k], np.array(ref["seeds"]) & 0x7FFFFFFF)
    temps = [sched.requests[r].sampling_params.temperature for r in sampled_ids]
    np.testing.assert_allclose(a["temperature"][:k], temps)
    assert (a["temperature"][k:] == 0).all()
    # logit_bias: each sampled row's entries in order, then while fewer than min_tokens were
    # generated its stop ids (EOS unless ignore_eos, stop_token_ids) at -inf, then id 0 / value 0
    columns = []
    for r, step in zip(sampled_ids, ref["steps"]):
        sp = sched.requests[r].sampling_params
        col = list((sp.logit_bias or {}).items())
        if step < sp.min_tokens:
            col += [(t, -np.inf) for t in sorted({*sp.stop_token_ids, *(() if sp.ignore_eos else (99,))})]
        columns.append(col)
    most = max(map(len, columns), default=0)
    assert shape.num_bias == (bucket(most, 8, MAX_BIAS_COLUMNS) if most else 0)
    if most:
        want_ids = np.zeros((cfg.max_num_seqs, shape.num_bias), np.int32)
        want_values = np.zeros((cfg.max_num_seqs, shape.num_bias), np.float32)
        for i, col in enumerate(columns):
            want_ids[i, :len(col)] = [t for t, _ in col]
            want_values[i, :len(col)] = [v for _, v in col]
        np.testing.assert_array_equal(a["bias_ids"], want_ids)
        np.testing.assert_array_equal(a["bias_values"], want_values)
    # penalties: with any sampled row asking, every sampled row's values and batch row
    params = [sched.requests[r].sampling_params for r in sampled_ids]
    assert shape.penalties == any(sp.has_penalties for sp in params)
    if shape.penalties:
        np.testing.assert_allclose(a["repetition_penalty"][:k], [sp.repetition_penalty for sp in params])
        np.testing.assert_allclose(a["frequency_penalty"][:k], [sp.frequency_penalty for sp in params])
        assert (a["repetition_penalty"][k:] == 1).all() and (a["frequency_penalty"][k:] == 0).all()
        np.testing.assert_array_equal(a["batch_row"][:k], sampled_rows)
        assert (a["batch_row"][k:] == cfg.max_num_seqs).all()
    most = max((sp.logprobs for sp in params if sp.logprobs is not None), default=-1)
    assert shape.num_logprobs == (bucket(most, 1, 20) if most > 0 else most)
    # prompt logprobs: the rows whose next token is a prompt token of a request asking
    assert shape.all_hidden == bool(ref["prompt_rows"])
    if shape.all_hidden:
        assert list(zip(a["prompt_rows"].tolist(), a["prompt_targets"].tolist(),
                        a["prompt_positions"].tolist())) == ref["prompt_rows"]
    batch.mark_sampled(sampled_rows)
    tokens = np.array([rng.randrange(100) for _ in sampled_ids], np.int32)
    return so, sampled_ids, tokens, sum(-np.inf in [v for _, v in col] for col in columns)


def test_pack_unpack_round_trip() -> None:
    shape = StepShape(num_tokens=16, num_sampled=2, max_num_seqs=4, max_blocks_per_seq=3)
    rng = np.random.default_rng(0)
    arrays = {name: rng.integers(-5, 1000, size, dtype=np.int32) for name, size in shape.fields()}
    arrays["temperature"] = rng.random(4, dtype=np.float32)
    arrays["top_p"] = rng.random(4, dtype=np.float32)
    arrays["min_p"] = rng.random(4, dtype=np.float32)
    buf = shape.pack(arrays)
    assert buf.dtype == np.int32 and buf.ndim == 1
    out = shape.unpack(jnp.asarray(buf))
    for name, value in arrays.items():
        got = np.asarray(out[name]).reshape(-1)
        np.testing.assert_array_equal(got, value.reshape(-1))
    assert out["block_tables"].shape == (4, 3)
    # a plain step is all main part (one transfer): the forward reads every field up to
    # num_seqs, the sampler every field from num_seqs on (the tail the forward hands it), its
    # per-row ones cut to num_sampled; that tail has one size whatever the token bucket
    main, extra = shape.split(buf)
    assert extra is None and len(main) == len(buf)
    sampler_only = ("temperature", "top_k", "top_p", "min_p", "seed", "stream", "step")
    fwd = shape.forward.unpack(jnp.asarray(main), "forward")
    assert set(fwd) == set(arrays) - set(sampler_only)
    for name, value in fwd.items():
        np.testing.assert_array_equal(np.asarray(value).reshape(-1), arrays[name].reshape(-1))
    tail = main[shape.sampler_offset:]
    other = StepShape(num_tokens=64, num_sampled=2, max_num_seqs=4, max_blocks_per_seq=3)
    assert len(other.split(other.empty_step())[0]) - other.sampler_offset == len(tail)
    smp = shape.sampler.unpack(jnp.asarray(tail), "sampler")
    assert set(smp) == {"num_seqs", *sampler_only}
    for name, value in smp.items():
        want = arrays[name] if name == "num_seqs" else arrays[name][:2]
        np.testing.assert_array_equal(np.asarray(value).reshape(-1), want.reshape(-1))


def test_pack_unpack_with_logit_bias() -> None:
    """num_bias adds per-row id and value blocks to the extra part only (the sampler's); they
    come back as [num_sampled, num_bias], the values as float32."""
    shape = StepShape(num_tokens=8, num_sampled=2, max_num_seqs=4, max_blocks_per_seq=3, num_bias=8)
    rng = np.random.default_rng(1)
    arrays = {name: rng.integers(0, 50, size, dtype=np.int32) for name, size in shape.fields()}
    for name in ("temperature", "top_p", "min_p"):
        arrays[name] = rng.random(4, dtype=np.float32)
    arrays["bias_values"] = rng.normal(size=(4, 8)).astype(np.float32)
    main, extra = shape.split(shape.pack(arrays))
    assert main.shape == StepShape(8, 2, 4, 3).split(StepShape(8, 2, 4, 3).empty_step())[0].shape
    assert "bias_ids" not in shape.forward.unpack(jnp.asarray(main), "forward")
    smp = shape.sampler.unpack(jnp.asarray(extra), "extra")
    np.testing.assert_array_equal(np.asarray(smp["bias_ids"]), arrays["bias_ids"].reshape(4, 8)[:2])
    np.testing.assert_array_equal(np.asarray(smp["bias_values"]), arrays["bias_values"][:2])
    assert shape.forward == StepShape(8, 0, 4, 3)
