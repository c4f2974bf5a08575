"""scripts/generate.py and the `minivllm-jax` console script as a user runs them: a real
completion, compiled steps reused by the next run, and one-line errors for bad input.

The embedded model runs once (`smollm2_run`: its default path, chat template and a real answer,
in the engine shape of the README's `LLM()`, so test_readme.py loads the programs it compiled);
the other runs take the tiny random Llama in one engine shape (TINY), whose few step programs
the first run compiles and the later ones load. A fresh process is started where it is the point
(the script and the installed console script, a second process loading the compile cache, JAX's
persistent cache switched on by the environment, Ctrl-C, an import that must not start jax);
elsewhere scripts/generate.py runs as a script in this process (`_in_process`: its `__main__`
block, its output and exit status), sparing seconds of imports."""
from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "generate.py"
CONSOLE = Path(sys.executable).parent / "minivllm-jax"  # pip's entry point (pyproject.toml)

# the tiny random Llama's runs, one engine shape (so they share compiled step programs): a
# context long enough for the streaming test's answer, 16-token steps (prefills chunked: the
# 16-token forward; decodes the 4-token one)
TINY = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
        "--num-kv-blocks", "34", "--no-tqdm")
# tiny_runs' prompts: one 6 tokens short of the context (one token per word; asked for 20, cut
# at 6), and a short one
CUT_PROMPT = " ".join(f"t{3 + i % 7}" for i in range(512 - 6))
TINY_PROMPTS = (CUT_PROMPT, "t5 t6 t7 t8 t9 t10")
TINY_MAX_TOKENS = 20
# the embedded model's run: the README's `LLM()` engine shape (generate.py's default
# --max-num-seqs is 16, LLM's 128; every other option the default)
SMOLLM2 = ("--max-num-seqs", "128", "--no-tqdm")
PARIS = "What is the capital of France?"


def _run(*args: str, env: dict[str, str] | None = None,
         command: tuple[str, ...] = (sys.executable, str(SCRIPT))) -> subprocess.CompletedProcess:
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=env)


def _in_process(*args: str) -> subprocess.CompletedProcess:
    """scripts/generate.py run as a script in this process (runpy: its `__main__` block as
    written, under ``sys.argv``): its exit status, stdout and stderr (what it prints, and any
    warning it logs: a process of its own would show those on stderr too)."""
    import runpy

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    argv = sys.argv
    sys.argv = [str(SCRIPT), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(SCRIPT), run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        logging.getLogger().removeHandler(handler)
    return subprocess.CompletedProcess([str(SCRIPT), *args], status, out.getvalue(), err.getvalue())


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single `error: ...` line of a bad command line (status 2, no traceback)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def _answers(stdout: str) -> dict[str, tuple[str, int, str]]:
    """The printed answers: prompt (its first 200 characters, as a long one's header quotes
    it) -> (text, tokens, finish_reason)."""
    found = re.findall(r"^### prompt: ([^\n]*)\n(.*?)\n### \((\d+) tokens, finish_reason=(\w+)\)$",
                       stdout, flags=re.S | re.M)
    return {ast.literal_eval(re.sub(r"\.\.\. \(\d+ characters\)$", "", prompt)): (text, int(n), reason)
            for prompt, text, n, reason in found}


def _files(cache: Path) -> dict[str, int]:
    """The step programs stored in ``cache``: file name -> modification time (ns)."""
    return {f.name: f.stat().st_mtime_ns for f in cache.glob("step-*.bin")}


def _share(cache: Path) -> None:
    """Copy the step programs of ``cache`` into the session's compile cache (the tests'
    $MINIVLLM_JAX_COMPILE_CACHE), each under a temporary name then renamed, as the engine writes
    them: later engines of the same shape, in any of the session's processes, load them."""
    session = Path(os.environ["MINIVLLM_JAX_COMPILE_CACHE"])
    session.mkdir(parents=True, exist_ok=True)
    for f in cache.glob("step-*.bin"):
        if not (session / f.name).exists():
            tmp = session / f".{f.name}.{os.getpid()}.tmp"
            shutil.copyfile(f, tmp)
            os.replace(tmp, session / f.name)


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[dict[str, str], subprocess.CompletedProcess]:
    """The module's run of the embedded model: PARIS (a chat turn, the tokenizer's template: no
    --chat given), greedy, 8 tokens, with $MINIVLLM_JAX_COMPILE_CACHE (the default compile cache)
    a fresh directory, which the run fills; its programs then go to the session's compile cache
    (`_share`), for test_readme.py. (The environment and the run.)"""
    tmp = tmp_path_factory.mktemp("smollm2_cli")
    env = {**os.environ, "MINIVLLM_JAX_COMPILE_CACHE": str(tmp / "xla")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = _run("--prompt", PARIS, *SMOLLM2, "--max-tokens", "8", env=env)
    _share(tmp / "xla")
    return env, r


def test_generate_prints_completion(smollm2_run: tuple[dict[str, str], subprocess.CompletedProcess],
                                    tokenizer) -> None:
    env, r = smollm2_run
    assert r.returncode == 0, r.stderr
    # the default compile cache, by env: the directory was empty before this run
    assert any(Path(env["MINIVLLM_JAX_COMPILE_CACHE"]).glob("step-*.bin"))
    assert "Traceback" not in r.stderr
    assert r.stdout.startswith(f"### prompt: {PARIS!r}\n")
    ((prompt, (text, tokens, reason)),) = _answers(r.stdout).items()
    assert prompt == PARIS and 2 <= tokens <= 8 and reason in ("stop", "length")
    assert len(tokenizer.encode(text)) >= 2  # some real generated text


def test_chat_template_by_default_answers_paris(
        smollm2_run: tuple[dict[str, str], subprocess.CompletedProcess]) -> None:
    """The embedded instruct model's tokenizer has a chat template: without --chat the prompt is
    sent as a user turn, and the greedy answer names Paris."""
    r = smollm2_run[1]
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "Paris" in _answers(r.stdout)[PARIS][0]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory, tiny_llama: str) -> dict[str, Any]:
    """Four processes of scripts/generate.py (one of them the console script) on the tiny random
    Llama: TINY_PROMPTS from a file (several prompts: each printed when it finishes), greedy,
    TINY_MAX_TOKENS, JAX's compile log on. "first" stores its step programs in a fresh
    --compile-cache ("cache"); "second", `minivllm-jax generate` with the same --compile-cache,
    loads them; with JAX's own persistent cache on ($JAX_COMPILATION_CACHE_DIR, "jax_dir",
    keeping every program however fast it compiled, as enable_compilation_cache does) and "cache"
    as the default compile cache ($MINIVLLM_JAX_COMPILE_CACHE), "off" (--no-compile-cache)
    compiles and fills JAX's cache, and "from_jax" (--compile-cache "under_jax", a fresh
    directory) takes its programs from JAX's cache. ("stored" and "stored_after": `_files` of
    "cache" after "first" and after the four.)"""
    tmp = tmp_path_factory.mktemp("tiny_cli")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n\n".join(TINY_PROMPTS) + "\n")  # blank lines are skipped
    runs: dict[str, Any] = {"cache": tmp / "xla", "jax_dir": tmp / "jax", "under_jax": tmp / "xla_under_jax"}
    args = ("--model", tiny_llama, "--prompts-file", str(prompts), *TINY,
            "--max-tokens", str(TINY_MAX_TOKENS), "--no-chat")
    env = {**os.environ, "JAX_LOG_COMPILES": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs["first"] = _run(*args, "--compile-cache", str(runs["cache"]), env=env)
    runs["stored"] = _files(runs["cache"])
    runs["second"] = _run("generate", *args, "--compile-cache", str(runs["cache"]), env=env,
                          command=(str(CONSOLE),))
    jax_env = {**env, "JAX_COMPILATION_CACHE_DIR": str(runs["jax_dir"]),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "MINIVLLM_JAX_COMPILE_CACHE": str(runs["cache"])}
    runs["off"] = _run(*args, "--no-compile-cache", env=jax_env)
    runs["from_jax"] = _run(*args, "--compile-cache", str(runs["under_jax"]), env=jax_env)
    runs["stored_after"] = _files(runs["cache"])
    return runs


def test_generate_loads_compiled_steps_from_the_cache(tiny_runs: dict[str, Any],
                                                      tiny_llama: str) -> None:
    """A run with --compile-cache compiles its step programs and stores them; a second process
    with the same --compile-cache (the console script, `minivllm-jax generate`, which prints the
    same as scripts/generate.py) compiles no step program (it loads those the first stored) and
    prints the same completions. --no-compile-cache compiles them again, though its default
    directory ($MINIVLLM_JAX_COMPILE_CACHE) holds them, and stores nothing. While JAX's own
    persistent cache is on, a run stores no step program: there, programs come from JAX's cache
    (filled here by the --no-compile-cache run), which XLA:CPU serializes again without their
    code (a later process failed to run them: "Function ... not found"); so that run leaves its
    --compile-cache empty. Every run prints transformers' greedy tokens. (`tiny_runs`: the
    prompts' chunked prefills meet the 16-token forward, decodes the 4-token one.)"""
    first, second, off, from_jax = (tiny_runs[k] for k in ("first", "second", "off", "from_jax"))
    stored = tiny_runs["stored"]
    for r in (first, second, off, from_jax):
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert any(tiny_runs["jax_dir"].iterdir()) and list(tiny_runs["under_jax"].glob("step-*.bin")) == []
    for program, least in (("forward", 2), ("sample_tokens", 1)):  # a prefill and a decode forward
        assert first.stderr.count(f"Compiling jit({program})") >= least, program
        assert second.stderr.count(f"Compiling jit({program})") == 0, program
        assert off.stderr.count(f"Compiling jit({program})") >= least, program
    assert len(stored) >= 3 and tiny_runs["stored_after"] == stored  # none added or rewritten
    assert second.stdout == first.stdout == off.stdout == from_jax.stdout
    answers = _answers(first.stdout)
    assert sorted(answers) == sorted(p[:200] for p in TINY_PROMPTS) and first.stdout.count("### prompt:") == 2
    want = _hf_greedy_texts(tiny_llama, TINY_PROMPTS, TINY_MAX_TOKENS)
    assert [answers[p[:200]][0] for p in TINY_PROMPTS] == want
    both = _in_process("--model", tiny_llama, "--prompt", CUT_PROMPT, *TINY,
                       "--compile-cache", str(tiny_runs["cache"]), "--no-compile-cache")
    assert "--no-compile-cache" in _one_error_line(both)


def _hf_greedy_texts(checkpoint: str, prompts: tuple[str, ...], max_new_tokens: int) -> list[str]:
    """transformers' greedy continuation of each prompt (no chat template; within the context of
    TINY: cut at 512 tokens in all), decoded."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).float().eval()
    texts = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=min(max_new_tokens, 512 - ids.shape[1]),
                                 eos_token_id=2, pad_token_id=2)
        texts.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True,
                                clean_up_tokenization_spaces=False))
    return texts


def test_context_cut_warns_naming_the_flag(tiny_runs: dict[str, Any]) -> None:
    """A prompt 6 tokens short of --max-model-len with --max-tokens 20 (CUT_PROMPT, prompt 0 of
    every run of `tiny_runs`): the answer stops at the context (finish_reason=length after 6
    tokens) and stderr says, once, to raise --max-model-len for prompt 0."""
    for name in ("first", "second", "off", "from_jax"):
        r = tiny_runs[name]
        assert r.returncode == 0, r.stderr
        assert _answers(r.stdout)[CUT_PROMPT[:200]][1:] == (6, "length")
        warning = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
        assert len(warning) == 1 and "--max-model-len" in warning[0] and "prompt 0" in warning[0]


PRECEDENCE = [("/tmp/jax-set", "/tmp/ours", "/tmp/jax-set"), (None, "/tmp/ours", "/tmp/ours"),
              (None, None, "~/.cache/minivllm_jax/xla")]


@pytest.fixture(scope="module")
def precedence_run() -> list[list[str]]:
    """One process, started with $JAX_COMPILATION_CACHE_DIR and $MINIVLLM_JAX_COMPILE_CACHE as
    PRECEDENCE's first case sets them (jax reads the first at import), then each later case in
    turn: JAX's directory unset (its config as a process without the variable has it) and
    $MINIVLLM_JAX_COMPILE_CACHE set or unset. For each case, the lines enable_compilation_cache()'s
    result and JAX's config then."""
    import json

    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "MINIVLLM_JAX_COMPILE_CACHE")}
    jax_dir, ours, _ = PRECEDENCE[0]
    env.update({"JAX_COMPILATION_CACHE_DIR": jax_dir, "MINIVLLM_JAX_COMPILE_CACHE": ours})
    code = f"""
import json, os
import jax
from minivllm_jax.worker.executable_cache import enable_compilation_cache as e
out = []
for i, (jax_dir, ours, _) in enumerate({PRECEDENCE!r}):
    if i:
        assert jax_dir is None
        jax.config.update("jax_compilation_cache_dir", None)
        os.environ.pop("MINIVLLM_JAX_COMPILE_CACHE", None)
        if ours is not None:
            os.environ["MINIVLLM_JAX_COMPILE_CACHE"] = ours
    out.append([str(e()), str(jax.config.jax_compilation_cache_dir)])
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("case", range(len(PRECEDENCE)))
def test_compilation_cache_dir_precedence(precedence_run: list[list[str]], case: int) -> None:
    """enable_compilation_cache() keeps a directory JAX already has, else takes
    $MINIVLLM_JAX_COMPILE_CACHE, else the home cache; JAX's config ends up pointing there."""
    want = str(Path(PRECEDENCE[case][2]).expanduser())
    assert precedence_run[case] == [want, want]


@pytest.mark.parametrize("args, field", [
    (["--model", "/nonexistent/model.gguf"], "/nonexistent"),
    (["--temperature", "-1"], "error: --temperature must be"),
    (["--top-p", "1.5"], "error: --top-p must be"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "prompts.txt"),
    (["--prompts-file", "LATIN1"], "error: --prompts-file LATIN1: line 2 is not UTF-8"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--max-num-seqs", "0"], "error: --max-num-seqs must be >= 1"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
     "error: --speculative-config: num_speculative_tokens must be"),
    (["--seed", "-1"], "--seed"),
    (["--model", "TINY", "--prompt", "t5 t6 t7 " * 30, "--max-model-len", "64", "--num-kv-blocks", "16",
      "--no-chat"], "--max-model-len"),
])
def test_bad_input_one_line_error(args: list[str], field: str, tiny_llama: str, tmp_path: Path) -> None:
    """scripts/generate.py in this process (the console script's bad option, in a process of
    its own: test_console_script_usage_and_bad_commands); a field is named by its flag. The
    too-long prompt: the tiny random Llama's (TINY), one token per word. LATIN1: a prompts
    file whose second line is Latin-1 ("café")."""
    latin1 = tmp_path / "prompts.txt"
    latin1.write_bytes("hello\ncaf\u00e9\n".encode("latin-1"))
    named = {"TINY": tiny_llama, "LATIN1": str(latin1)}
    line = _one_error_line(_in_process(*(named.get(a, a) for a in args)))
    assert field.replace("LATIN1", str(latin1)) in line
    if "--max-model-len" in args:  # the too-long prompt is named by its index
        assert "prompt 0 has" in line


def test_console_script_usage_and_bad_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """`minivllm-jax --help` lists the three commands; no command, an unknown one or a bad option
    is one error line and status 2. The installed console script runs `--help` and a bad option
    (a process each); the rest is its `main()` in this process."""
    from minivllm_jax.cli import main

    r = _run("--help", command=(str(CONSOLE),))
    assert r.returncode == 0 and all(c in r.stdout for c in ("generate", "serve", "multihost")), r.stderr
    assert "--max-tokens" in _one_error_line(_run("generate", "--max-tokens", "-1", command=(str(CONSOLE),)))
    for command in ("generate", "serve", "multihost"):
        with pytest.raises(SystemExit) as exit_:  # argparse's --help
            main([command, "--help"])
        assert exit_.value.code in (0, None)
        assert capsys.readouterr().out.startswith(f"usage: minivllm-jax {command} ")
    for args, words in (((), "command"), (("bogus",), "bogus")):
        status = main(list(args))
        r = subprocess.CompletedProcess(args, status, *capsys.readouterr())
        assert words in _one_error_line(r)


def test_every_flag_has_help_with_its_default_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option of every command has help text; one with a default (not None, not a
    switch's False) says it; `--version` answers with the installed version, for the console
    script and for each command."""
    import importlib
    import importlib.metadata

    from minivllm_jax.cli import COMMANDS, main

    want = importlib.metadata.version("minivllm-jax")
    for command in COMMANDS:
        parser = importlib.import_module(f"minivllm_jax.cli.{command}").build_parser("x")
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            assert action.help, (command, action.option_strings)
            if action.default not in (None, False):
                assert "default" in action.help, (command, action.option_strings, action.help)
        with pytest.raises(SystemExit):
            main([command, "--version"])
        assert capsys.readouterr().out.strip() == f"minivllm-jax {command} {want}"
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"minivllm-jax {want}"


def test_engine_flags_are_the_config_fields(capsys: pytest.CaptureFixture[str]) -> None:
    """Each command's engine flags are EngineConfig's `option` fields (less the command's
    skips), and each flag's value reaches its field: a non-default value for every field at
    once gives the config holding all of them. A value outside a field's choices is one
    `error:` line naming the flag."""
    import dataclasses
    import importlib

    from minivllm_jax.cli import COMMANDS
    from minivllm_jax.cli.args import engine_fields, engine_kwargs, run_cli
    from minivllm_jax.config import EngineConfig

    exposed = [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]
    assert [f.name for f in engine_fields()] == [f.name for f in exposed]
    assert {"quantization", "kv_cache_dtype", "max_num_seqs", "speculative_config"} <= {
        f.name for f in exposed}
    skips = {"compile": {"async_scheduling"}, "multihost": {"tensor_parallel_size"}}
    given = dict(max_num_seqs=("--max-num-seqs", "7", 7),
                 max_num_batched_tokens=("--max-num-batched-tokens", "400", 400),
                 max_model_len=("--max-model-len", "333", 333),
                 block_size=("--block-size", "32", 32),
                 num_kv_blocks=("--num-kv-blocks", "50", 50),
                 gpu_memory_utilization=("--gpu-memory-utilization", "0.5", 0.5),
                 enable_prefix_caching=("--no-enable-prefix-caching", None, False),
                 enable_chunked_prefill=("--no-enable-chunked-prefill", None, False),
                 dtype=("--dtype", "bfloat16", "bfloat16"),
                 quantization=("--quantization", "int8", "int8"),
                 kv_cache_dtype=("--kv-cache-dtype", "fp8", "fp8"),
                 tensor_parallel_size=("--tensor-parallel-size", "2", 2),
                 attention_backend=("--attention-backend", "reference", "reference"),
                 layer_layout=("--layers", "stacked", "stacked"),
                 async_scheduling=("--async-scheduling", "off", False),
                 scheduling_policy=("--scheduling-policy", "priority", "priority"),
                 speculative_config=("--speculative-config", '{"method": "ngram", '
                                     '"num_speculative_tokens": 2}', None))
    assert set(given) == {f.name for f in exposed}
    for command in COMMANDS:
        parser = importlib.import_module(f"minivllm_jax.cli.{command}").build_parser("x")
        flags = {a.dest for a in parser._actions if a.option_strings}
        want = {f.name for f in exposed} - skips.get(command, set())
        assert want <= flags and not ({f.name for f in exposed} - want) & flags, command
        argv = [w for name in sorted(want) for w in given[name][:2] if w is not None]
        argv += ["--platform", "cuda"] if command == "compile" else []
        config = EngineConfig(**engine_kwargs(parser.parse_args(argv)))
        for name in want - {"speculative_config"}:
            assert getattr(config, name) == given[name][2], (command, name)
        assert config.speculative_config.num_speculative_tokens == 2
    from minivllm_jax.cli.generate import build_parser

    for flag, value in (("--quantization", "int4"), ("--kv-cache-dtype", "fp16")):
        assert run_cli(lambda: build_parser("x").parse_args([flag, value])) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith("error:") and flag in line and "\n" not in line, line


def test_cli_imports_no_jax() -> None:
    """Parsing a command line starts no jax (multihost picks the platform first), and a bad
    sampling or engine flag of generate and serve is refused before jax is imported."""
    code = ("import sys, minivllm_jax.cli, minivllm_jax.cli.args, minivllm_jax.cli.generate, "
            "minivllm_jax.cli.serve, minivllm_jax.cli.multihost; "
            "assert 'jax' not in sys.modules, 'jax imported'; "
            "assert minivllm_jax.cli.main(['generate', '--top-k', '-5']) == 2; "
            "assert minivllm_jax.cli.main(['serve', '--max-model-len', '1', '--port', '0']) == 2; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [line.split(" must")[0] for line in r.stderr.splitlines()] == [
        "error: --top-k", "error: --max-model-len"], r.stderr


def test_one_prompt_streams_and_ctrl_c_keeps_the_text(
        smollm2_run: tuple[dict[str, str], subprocess.CompletedProcess]) -> None:
    """One prompt streams: text arrives on stdout while the process still runs. SIGINT then ends
    it with status 130, the text generated so far and its summary line on stdout, and no
    traceback. The embedded model (its step programs from `smollm2_run`'s cache), asked to count
    to 300: seconds of decoding, so it is still generating when the signal comes. The process
    installs Python's SIGINT handler first, so that it raises KeyboardInterrupt even when the
    tests run with SIGINT ignored (started in a non-interactive shell's background, which
    every child inherits)."""
    import signal
    import threading
    import time

    env, _ = smollm2_run
    args = [str(SCRIPT), "--prompt", "Count from 1 to 300, one number per line.", "--max-tokens", "400",
            *SMOLLM2]
    # the script as its own process would run it, with Python's SIGINT handler installed first
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             f"sys.argv = {args!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", start], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    chunks: list[bytes] = []

    def read() -> None:
        while data := os.read(proc.stdout.fileno(), 4096):
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            text = b"".join(chunks).decode(errors="replace")
            if "### prompt:" in text and len(text.split("\n", 1)[-1].strip()) >= 8:
                break
            assert proc.poll() is None, f"exited early: {text!r}"
            time.sleep(0.05)
        streamed = b"".join(chunks).decode(errors="replace")
        assert proc.poll() is None and "finish_reason" not in streamed  # still generating
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=30)
        reader.join(timeout=10)
    finally:
        proc.kill()
    out = b"".join(chunks).decode(errors="replace")
    err = proc.stderr.read().decode(errors="replace")
    assert status == 130, (err, out[-300:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert out.startswith(streamed) and "finish_reason=interrupted" in out
    answer = out.split("\n", 1)[1].rsplit("### (", 1)[0].strip()
    assert len(answer) >= len(streamed.split("\n", 1)[1].strip()) >= 8


def test_long_prompts_are_quoted_short() -> None:
    """An answer's header quotes a long prompt by its first 200 characters and its length, a
    short one whole (the header stays a Python literal either way)."""
    from minivllm_jax.cli.generate import shown

    long = "word " * 1400
    assert shown(long) == f"{long[:200]!r}... (7000 characters)"
    assert ast.literal_eval(shown(long).split("...")[0]) == long[:200]
    assert shown("What is 'this'?") == repr("What is 'this'?")
