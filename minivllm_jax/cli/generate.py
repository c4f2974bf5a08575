"""Generate completions with minivllm-jax (default model: the embedded SmolLM2-135M-Instruct).

    minivllm-jax generate --prompt "What is the capital of France?"
    minivllm-jax generate --prompts-file prompts.txt --temperature 0.8 --top-p 0.95 --seed 1

(`python scripts/generate.py` takes the same options.)

A model whose tokenizer has a chat template gets each prompt as a user turn (--no-chat: the raw
prompt). One prompt streams its answer as it is generated; several print each answer when it
finishes, with a progress bar on stderr. Ctrl-C stops at once, prints what was generated and
exits with status 130. Bad input exits with status 2 and one `error: ...` line on stderr.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from minivllm_jax.cli.args import (ArgumentParser, add_compile_cache_options, add_engine_options,
                                  compile_cache_arg, engine_kwargs, named_by_flags, run_cli)

DEFAULT_PROMPT = "What is the capital of France?"
INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_engine_options(p, max_num_seqs=16)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="a file with one prompt per line")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="send each prompt as a user turn of the chat template (default: when the "
                        "tokenizer has one); --no-chat sends the raw prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1: off")
    p.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    p.add_argument("--min-p", type=float, default=0.0, help="0: off")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (>= 0), the same for every prompt (default: one derived "
                        "from the engine's seed and each request's id)")
    add_compile_cache_options(p)
    p.add_argument("--no-tqdm", action="store_true", help="hide the progress bar")
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt's, then --prompts-file's non-blank lines (UTF-8: a line that is not is refused by
    file and line number); the default prompt when neither is given."""
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        with open(args.prompts_file, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as e:
                    raise ValueError(f"--prompts-file {args.prompts_file}: line {number} is not "
                                     f"UTF-8 (byte {e.start}: {e.reason})") from None
                if line.strip():
                    prompts.append(line)
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt")
    if any(not p.strip() for p in prompts):
        raise ValueError("--prompt must not be empty")
    return prompts or [DEFAULT_PROMPT]


def prompt_ids(llm: Any, prompts: list[str], chat: bool, max_model_len: int) -> list[list[int]]:
    """Each prompt's token ids (a chat user turn or raw); a prompt that leaves no room for output
    is refused by its index and the flag to change."""
    from minivllm_jax.llm import render_chat
    from scheduler.scheduler import prompt_length_error

    out = []
    for i, p in enumerate(prompts):
        ids = (list(render_chat(llm.tokenizer, [{"role": "user", "content": p}])) if chat
               else list(llm.tokenizer.encode(p)))
        too_long = prompt_length_error(len(ids), max_model_len, f"prompt {i}", "--max-model-len")
        if too_long:
            raise ValueError(too_long)
        out.append(ids)
    return out


def shown(prompt: str, limit: int = 200) -> str:
    """A prompt as its answer's header quotes it: its repr, the first `limit` characters of a
    longer one and its length."""
    if len(prompt) <= limit:
        return repr(prompt)
    return f"{prompt[:limit]!r}... ({len(prompt)} characters)"


def report(i: int, prompt: str, text: str, tokens: int, reason: str | None, max_tokens: int,
           max_model_len: int, streamed: bool) -> None:
    """Print one answer (its text unless streamed) and its summary line; warn on stderr when the
    context length, not --max-tokens, cut it."""
    if not streamed:
        print(f"### prompt: {shown(prompt)}")
        print(text)
    else:
        print()
    print(f"### ({tokens} tokens, finish_reason={reason})", flush=True)
    if reason == "length" and tokens < max_tokens:
        print(f"warning: prompt {i}'s answer was cut at {tokens} tokens by the context length "
              f"(max_model_len {max_model_len}); raise --max-model-len", file=sys.stderr)


def run(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    prompts = read_prompts(args)
    from minivllm_jax.config import EngineConfig
    from scheduler import SamplingParams

    with named_by_flags(parser):  # every flag checked before jax is imported and the model loads
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed)
        config = EngineConfig.from_kwargs("generate", {**engine_kwargs(args),
                                                       "compile_cache": compile_cache_arg(args)})
    from minivllm_jax import LLM

    llm = LLM.from_config(args.model, config)
    if llm.tokenizer is None:
        raise ValueError(f"{args.model}: the model has no tokenizer; generate.py needs one")
    has_template = getattr(llm.tokenizer, "chat_template", None) is not None
    if args.chat and not has_template:
        raise ValueError("--chat: this model's tokenizer has no chat template")
    chat = has_template if args.chat is None else args.chat
    max_model_len = llm.engine.config.max_model_len
    ids = prompt_ids(llm, prompts, chat, max_model_len)
    return serve_prompts(llm, prompts, ids, params, max_model_len, progress=not args.no_tqdm)


def serve_prompts(llm: Any, prompts: list[str], ids: list[list[int]], params: Any,
                  max_model_len: int, progress: bool) -> int:
    """Run the requests through the step API: one prompt streams; several print as they finish.
    Returns 0, or INTERRUPTED after Ctrl-C (what was generated is printed first)."""
    from tqdm.auto import tqdm

    engine = llm.engine
    for i, token_ids in enumerate(ids):
        engine.add_request(token_ids, params, request_id=str(i), prompt=prompts[i])
    stream = len(prompts) == 1
    texts, counts = [""] * len(prompts), [0] * len(prompts)
    done: set[int] = set()
    bar = tqdm(total=len(prompts), desc="Processed prompts", disable=stream or not progress,
               file=sys.stderr, dynamic_ncols=True)
    if stream:
        print(f"### prompt: {shown(prompts[0])}", flush=True)
    try:
        while engine.has_unfinished_requests():
            for d in engine.step():
                i = int(d.request_id)
                texts[i] += d.new_text
                counts[i] += len(d.new_token_ids)
                if stream:
                    print(d.new_text, end="", flush=True)
                if d.finished:
                    done.add(i)
                    bar.update(1)
                    report(i, prompts[i], texts[i], counts[i], d.finish_reason, params.max_tokens,
                           max_model_len, stream)
    except KeyboardInterrupt:
        bar.close()
        for i in range(len(prompts)):
            if i not in done:
                report(i, prompts[i], texts[i], counts[i], "interrupted", params.max_tokens,
                       max_model_len, stream)
        return INTERRUPTED
    bar.close()
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """The exit status: 0, 2 (bad input, one line on stderr) or INTERRUPTED."""
    try:
        return run_cli(lambda: run(argv, prog))
    except KeyboardInterrupt:  # while loading or compiling: nothing generated yet
        print("interrupted", file=sys.stderr)
        return INTERRUPTED

