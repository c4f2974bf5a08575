#!/usr/bin/env python
"""Generate completions with minivllm-jax (default model: the embedded SmolLM2-135M-Instruct).

    python scripts/generate.py --chat --prompt "What is the capital of France?"
    python scripts/generate.py --prompts-file prompts.txt --temperature 0.8 --top-p 0.95 --seed 1

Bad input exits with status 2 and one `error: ...` line on stderr.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from cli import ArgumentParser, add_engine_options, engine_kwargs, run_cli

DEFAULT_PROMPT = "What is the capital of France?"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_options(p, max_num_seqs=16, max_model_len=1024)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    p.add_argument("--min-p", type=float, default=0.0, help="0: off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (per request)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache, so a later run loads the compiled "
                        "steps (default: $JAX_COMPILATION_CACHE_DIR if set, else "
                        "$MINIVLLM_JAX_COMPILE_CACHE or ~/.cache/minivllm_jax/xla)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile every step afresh")
    p.add_argument("--no-tqdm", action="store_true", help="hide the progress bar")
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt")
    if any(not p.strip() for p in prompts):
        raise ValueError("--prompt must not be empty")
    return prompts or [DEFAULT_PROMPT]


def run(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    prompts = read_prompts(args)
    from minivllm_jax import LLM, SamplingParams
    from minivllm_jax.compilation import enable_compilation_cache

    if not args.no_compile_cache:
        enable_compilation_cache(args.compile_cache)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(args.model, **engine_kwargs(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=not args.no_tqdm)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        print(f"### prompt: {prompt!r}")
        print(completion.text)
        print(f"### ({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})")


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
