"""Host cost of the scheduler's hot path.

Times schedule() + update_from_output() per decode step with N requests already prefilled
(prefix caching on, prompts of a few hundred tokens), a prefix-cache lookup
(get_computed_blocks) for a fully cached 4k-token prompt, and the n-gram draft proposer
(NgramProposer.propose_padded over an input-batch-like buffer, speculative decoding) per step for
--ngram-batch requests of each --ngram-len. Prints a small table of medians.

    python scripts/bench_scheduler.py [--steps 200] [--prompt-len 300] [--batch 256 1024]
        [--ngram 5] [--ngram-len 512 2048 8192] [--ngram-batch 256]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from scheduler import KVCacheManager, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.spec_decode import NgramProposer, SpeculativeConfig


def bench_decode(num_reqs: int, prompt_len: int, steps: int, block_size: int
                 ) -> tuple[float, float, float, float, float, float]:
    """Microseconds per step of schedule()+update_from_output() with `num_reqs` requests in
    steady decode: median, p90, mean and min wall time (p90 and mean include the steps where
    every request fills a block, hashing it and taking a new one, and any time the OS gave the
    core to another process), median of schedule() alone and median CPU time of the process."""
    budget = max(8192, num_reqs)
    # long enough that nobody finishes while the others prefill or during the timed steps
    max_model_len = prompt_len + steps + num_reqs * prompt_len // budget + 64
    blocks_per_req = -(-max_model_len // block_size)
    cfg = SchedulerConfig(max_num_seqs=num_reqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, block_size=block_size,
                          num_blocks=num_reqs * blocks_per_req + 1, enable_prefix_caching=True)
    sched = Scheduler(cfg)
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=max_model_len, ignore_eos=True)
    for i in range(num_reqs):
        sched.add_request(Request(f"r{i}", [rng.randrange(32000) for _ in range(prompt_len)], sp))
    # prefill everything (untimed)
    while len(sched.running) < num_reqs or not all(r.output_token_ids for r in sched.running):
        out = sched.schedule()
        sched.update_from_output(out, {rid: [rng.randrange(32000)] for rid in out.num_scheduled_tokens})
    sampled_per_step = [{f"r{i}": [rng.randrange(32000)] for i in range(num_reqs)} for _ in range(steps)]
    times, sched_times, cpu_times = [], [], []
    for sampled in sampled_per_step:
        c0, t0 = time.process_time(), time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        sched.update_from_output(out, sampled)
        t2, c1 = time.perf_counter(), time.process_time()
        assert len(out.num_scheduled_tokens) == num_reqs and out.total_num_scheduled_tokens == num_reqs
        times.append((t2 - t0) * 1e6)
        sched_times.append((t1 - t0) * 1e6)
        cpu_times.append((c1 - c0) * 1e6)
    mean, times = statistics.fmean(times), sorted(times)
    return (statistics.median(times), times[int(0.9 * len(times))], mean, times[0],
            statistics.median(sched_times), statistics.median(cpu_times))


def bench_lookup(prompt_len: int, block_size: int, reps: int) -> float:
    """Median microseconds of get_computed_blocks for a fully cached prompt."""
    from scheduler import BlockHasher

    num_blocks = 2 * (prompt_len // block_size) + 2
    kvm = KVCacheManager(num_blocks, block_size, enable_caching=True)
    hasher = BlockHasher(block_size)
    rng = random.Random(1)
    prompt = [rng.randrange(32000) for _ in range(prompt_len)]
    first, probe = Request("a", prompt, SamplingParams()), Request("b", prompt, SamplingParams())
    for req in (first, probe):
        req.set_block_hasher(hasher, block_size)
    assert kvm.allocate_slots(first, prompt_len) is not None
    kvm.free(first)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _, n = kvm.get_computed_blocks(probe)
        times.append((time.perf_counter() - t0) * 1e6)
    assert n == (prompt_len - 1) // block_size * block_size
    return statistics.median(times)


def bench_ngram(num_reqs: int, length: int, k: int, steps: int
                ) -> tuple[float, float, float, float, float]:
    """Microseconds per step of the n-gram proposer (k drafts, n-grams of 2..4 tokens) for
    `num_reqs` requests held as rows of one token buffer (as a runner's input batch holds them),
    whose lengths start uniform in [length/2, length] and grow by one token a step, through
    propose_padded on the buffer.
    Token ids are Zipf-distributed (exponent 1.1, over 32000 ids) so that common ids recur as in
    text. Returns median, p90, mean and min wall time and the mean draft length."""
    rng = np.random.default_rng(length)
    buf = (rng.zipf(1.1, (num_reqs, length + steps)) % 32000).astype(np.int32)
    lens = rng.integers(length // 2, length + 1, num_reqs)
    proposer = NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_max=4, prompt_lookup_min=2))
    limits = [k] * num_reqs
    times, drafted = [], 0
    for step in range(steps):
        t0 = time.perf_counter()
        drafts = proposer.propose_padded(buf, lens + step, limits)
        times.append((time.perf_counter() - t0) * 1e6)
        drafted += sum(d.shape[0] for d in drafts)
    mean, times = statistics.fmean(times), sorted(times)
    return (statistics.median(times), times[int(0.9 * len(times))], mean, times[0],
            drafted / (steps * num_reqs))


def main() -> None:
    """Print the table: a decode-step row for each --batch, the lookup row, then an n-gram
    proposer row for each --ngram-len."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--lookup-len", type=int, default=4096)
    ap.add_argument("--ngram", type=int, default=5, metavar="K",
                    help="num_speculative_tokens of the n-gram proposer rows (0: no such rows)")
    ap.add_argument("--ngram-len", type=int, nargs="+", default=[512, 2048, 8192],
                    help="tokens per request of the n-gram rows (each uniform in [L/2, L])")
    ap.add_argument("--ngram-batch", type=int, default=256)
    args = ap.parse_args()
    print(f"{'case':<46} {'median us':>10} {'p90 us':>9} {'mean us':>9} {'min us':>8} {'cpu us':>8}"
          f" {'schedule() us':>14}")
    for n in args.batch:
        med, p90, mean, lo, med_sched, med_cpu = bench_decode(n, args.prompt_len, args.steps, args.block_size)
        print(f"{f'decode step, {n} reqs (schedule+update)':<46} {med:>10.1f} {p90:>9.1f} {mean:>9.1f}"
              f" {lo:>8.1f} {med_cpu:>8.1f} {med_sched:>14.1f}")
    med = bench_lookup(args.lookup_len, args.block_size, 200)
    print(f"{f'get_computed_blocks, {args.lookup_len}-token cached prompt':<46} {med:>10.1f}")
    for length in args.ngram_len if args.ngram > 0 else []:
        med, p90, mean, lo, per_req = bench_ngram(args.ngram_batch, length, args.ngram, args.steps)
        case = f"ngram propose_padded, {args.ngram_batch} x <={length}"
        print(f"{case:<46} {med:>10.1f} {p90:>9.1f} {mean:>9.1f} {lo:>8.1f}"
              f"   (k={args.ngram}, {per_req:.2f} drafts/req)")


if __name__ == "__main__":
    main()
