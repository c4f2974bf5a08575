"""Speculative decoding (n-gram prompt lookup) against plain decoding, on the same prompts.

    python scripts/bench_spec.py                         # the embedded SmolLM2, both workloads
    python scripts/bench_spec.py --concurrency 1 --rounds 3 --max-tokens 96 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Two workloads of chat prompts, greedy, EOS honoured: "grounded" asks to repeat, edit or
continue a given text or code (prompt lookup finds what the answer copies) and "open-ended" asks
for new text. For each concurrency C the prompts run in batches of C requests (C = 1: one request
at a time). Two engines (plain, speculative) of the same model and sizes are built and warmed
once; each round runs every workload on both, in alternating order, and a round's ratio is its
speculative output throughput over its plain one. Reported per (workload, C): the median ratio
over rounds, every round's ratio, the acceptance rate, and whether both engines emitted the same
tokens (they must: greedy speculation is token-identical).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

from minivllm_jax.cli.args import ArgumentParser, add_engine_options, engine_kwargs, run_cli

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long "
        "discussion, the members agreed to move the opening date to March, to hire two more "
        "librarians, and to keep the reading room open until nine in the evening.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
        "    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
        "    return total / len(values)\n")
GROUNDED = [f"Repeat this text exactly:\n{TEXT}",
            f"Rewrite this text, replacing 'library' with 'museum':\n{TEXT}",
            f"Add type hints to this Python code and print it in full:\n{CODE}",
            f"Rename the function mean to average everywhere in this code:\n{CODE}"]
OPEN = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
        "Give advice to someone starting to learn the piano.", "Describe a busy market in the morning."]
WORKLOADS = {"grounded": GROUNDED, "open-ended": OPEN}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p, dtype_help="auto: float32 on CPU, else bfloat16")
    # k = 7: with the token row a step verifies 8 rows, the CPU's smallest decode bucket above 4
    p.set_defaults(speculative_config='{"method": "ngram", "num_speculative_tokens": 7, '
                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 1 or min(args.concurrency) < 1:
        raise ValueError("--rounds, --max-tokens and --concurrency must be >= 1")
    engine_kwargs(args)  # the --speculative-config JSON is checked here
    return args


def timed(llm: Any, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds and token ids of the prompts, `concurrency` requests at a time."""
    from minivllm_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    t0, ids = time.perf_counter(), []
    for i in range(0, len(chats), concurrency):
        ids += [o.outputs[0].token_ids for o in llm.chat(chats[i:i + concurrency], params, use_tqdm=False)]
    return time.perf_counter() - t0, ids


def main() -> None:
    args = parse_args()
    from minivllm_jax import LLM
    from minivllm_jax.loader import load_model

    kw = engine_kwargs(args)
    spec_config = kw.pop("speculative_config")
    kw.setdefault("max_num_seqs", max(args.concurrency))
    kw.setdefault("max_model_len", 512)
    loaded = load_model(args.model, dtype=kw.get("dtype", "auto"))  # one copy of the weights
    plain = LLM(loaded, **kw)
    spec = LLM(loaded, **kw, speculative_config=spec_config)
    prompts = {name: WORKLOADS[name] * (max(args.concurrency) // len(WORKLOADS[name]) or 1)
               for name in args.workloads}
    for llm in (plain, spec):  # warm: every bucket these runs meet compiles here
        for name, ps in prompts.items():
            for c in args.concurrency:
                timed(llm, ps[:c], c, args.max_tokens)
    rows = []
    for name, ps in prompts.items():
        for c in args.concurrency:
            ratios, same, before = [], True, spec.get_stats()
            for r in range(args.rounds):
                order = (plain, spec) if r % 2 == 0 else (spec, plain)
                res = {id(llm): timed(llm, ps, c, args.max_tokens) for llm in order}
                (tp, ip), (ts, is_) = res[id(plain)], res[id(spec)]
                same &= ip == is_
                tokens = sum(map(len, ip))
                ratios.append((tokens / ts) / (tokens / tp))
            after = spec.get_stats()
            drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
            accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
            row = {"workload": name, "concurrency": c, "requests": len(ps), "output_tokens": tokens,
                   "ratio_median": statistics.median(ratios), "ratios": ratios,
                   "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "draft_tokens_per_round": drafted / args.rounds, "identical": same}
            rows.append(row)
            print(f"{name:<10} C={c:<3} {len(ps)} requests, {tokens} output tokens: speculative / plain "
                  f"throughput median {row['ratio_median']:.2f}x (rounds "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}), acceptance {row['acceptance_rate']:.2f}, "
                  f"identical {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(run_cli(main))
