"""scripts/generate.py and the `minivllm-jax` console script as a user runs them: a real
completion, compiled steps reused by the next run, and one-line errors for bad input.

Every run of the embedded model takes one engine shape (SMOLLM2) and one compile cache: the
module's first run (`smollm2_run`) compiles the step programs into a fresh directory, the later
ones load them, so the module compiles SmolLM2 once."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "generate.py"
CONSOLE = Path(sys.executable).parent / "minivllm-jax"  # pip's entry point (pyproject.toml)


SMALL = ("--max-tokens", "4", "--max-model-len", "64", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "16", "--num-kv-blocks", "16", "--no-tqdm")
# the embedded model's runs: 4-token steps (prefills chunked: one forward bucket), and a context
# and KV blocks for the streaming test's long answer
SMOLLM2 = ("--max-model-len", "1200", "--max-num-seqs", "4", "--max-num-batched-tokens", "4",
           "--num-kv-blocks", "80", "--no-tqdm")


def _run(*args: str, env: dict[str, str] | None = None,
         command: tuple[str, ...] = (sys.executable, str(SCRIPT))) -> subprocess.CompletedProcess:
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=env)


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single `error: ...` line of a bad command line (status 2, no traceback)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[dict[str, str], subprocess.CompletedProcess]:
    """The module's first run of the embedded model: two prompts from a file, greedy, 4 tokens,
    with $MINIVLLM_JAX_COMPILE_CACHE (the default compile cache) a fresh directory, which the
    run fills. (The environment, which the later runs of the embedded model take, and the run.)"""
    tmp = tmp_path_factory.mktemp("smollm2_cli")
    prompts = tmp / "prompts.txt"
    prompts.write_text("The capital of France is\n\nHello, my name is\n")
    env = {**os.environ, "MINIVLLM_JAX_COMPILE_CACHE": str(tmp / "xla")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env, _run("--prompts-file", str(prompts), *SMOLLM2, "--max-tokens", "4", env=env)


def test_generate_prints_completion(smollm2_run: tuple[dict[str, str], subprocess.CompletedProcess],
                                    tokenizer) -> None:
    env, r = smollm2_run
    assert r.returncode == 0, r.stderr
    # the default compile cache, by env: the directory was empty before this run
    assert any(Path(env["MINIVLLM_JAX_COMPILE_CACHE"]).glob("step-*.bin"))
    assert "Traceback" not in r.stderr
    for prompt in ("The capital of France is", "Hello, my name is"):
        assert f"### prompt: {prompt!r}" in r.stdout
    assert r.stdout.count("finish_reason=length") == 2  # 4 greedy tokens each, EOS-free prompts
    completion = r.stdout.split("\n")[1]
    assert len(tokenizer.encode(completion)) >= 2  # some real generated text


def test_generate_loads_compiled_steps_from_the_cache(tmp_path: Path, tiny_llama: str) -> None:
    """A second run with the same --compile-cache compiles no step program (it loads those the
    first stored) and prints the same completion; --no-compile-cache compiles them again and
    stores nothing. Before them, while JAX's own persistent cache is on
    ($JAX_COMPILATION_CACHE_DIR), a run stores no step program: there, programs come from JAX's
    cache (filled here by a run without the engine's cache), which XLA:CPU serializes again
    without their code (a later process failed to run them: "Function ... not found"); so the
    first run without JAX's cache finds nothing to load. Every run prints transformers' greedy
    tokens. The tiny random Llama: its 6-token prompt meets the 8-token forward, decode the 4."""
    cache, jax_dir = tmp_path / "xla", tmp_path / "jax"
    prompt = "t5 t6 t7 t8 t9 t10"
    args = ("--model", tiny_llama, "--prompt", prompt, *SMALL, "--no-chat")
    env = {**os.environ, "JAX_LOG_COMPILES": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    # JAX's cache on, keeping every program however fast it compiled (as enable_compilation_cache)
    jax_env = {**env, "JAX_COMPILATION_CACHE_DIR": str(jax_dir),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    filled = _run(*args, "--no-compile-cache", env=jax_env)
    from_jax = _run(*args, "--compile-cache", str(cache), env=jax_env)
    assert filled.returncode == 0 and from_jax.returncode == 0, filled.stderr + from_jax.stderr
    assert any(jax_dir.iterdir()) and list(cache.glob("step-*.bin")) == []
    first, second = (_run(*args, "--compile-cache", str(cache), env=env) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    stored = sorted(cache.glob("step-*.bin"))
    off = _run(*args, "--no-compile-cache", env=env)
    for program, least in (("forward", 2), ("sample_tokens", 1)):  # a prefill and a decode forward
        assert first.stderr.count(f"Compiling jit({program})") >= least, program
        assert second.stderr.count(f"Compiling jit({program})") == 0, program
        assert off.stderr.count(f"Compiling jit({program})") >= least, program
    assert len(stored) >= 3 and sorted(cache.glob("step-*.bin")) == stored
    assert second.stdout == first.stdout == off.stdout and "finish_reason=length" in first.stdout
    assert filled.stdout == from_jax.stdout == first.stdout
    assert first.stdout.split("\n")[1] == _hf_greedy_text(tiny_llama, prompt, 4)
    both = _run(*args, "--compile-cache", str(cache), "--no-compile-cache")
    assert "--no-compile-cache" in _one_error_line(both)


def _hf_greedy_text(checkpoint: str, prompt: str, max_new_tokens: int) -> str:
    """transformers' greedy continuation of ``prompt`` (no chat template), decoded."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).float().eval()
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=2)
    return tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True,
                      clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("jax_dir, ours, expected", [
    ("/tmp/jax-set", "/tmp/ours", "/tmp/jax-set"), (None, "/tmp/ours", "/tmp/ours"),
    (None, None, "~/.cache/minivllm_jax/xla"),
])
def test_compilation_cache_dir_precedence(jax_dir: str | None, ours: str | None, expected: str) -> None:
    """enable_compilation_cache() keeps a directory JAX already has, else takes
    $MINIVLLM_JAX_COMPILE_CACHE, else the home cache; JAX's config ends up pointing there."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "MINIVLLM_JAX_COMPILE_CACHE")}
    env.update({k: v for k, v in [("JAX_COMPILATION_CACHE_DIR", jax_dir),
                                  ("MINIVLLM_JAX_COMPILE_CACHE", ours)] if v is not None})
    code = ("import jax; from minivllm_jax.executable_cache import enable_compilation_cache as e; "
            "print(e()); print(jax.config.jax_compilation_cache_dir)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    want = str(Path(expected).expanduser())
    assert r.stdout.split() == [want, want]


@pytest.mark.parametrize("args, field", [
    (["--model", "/nonexistent/model.gguf"], "/nonexistent"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "prompts.txt"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--seed", "-1"], "--seed"),
    (["--prompt", "one two three " * 30, "--max-model-len", "64", "--no-chat"], "--max-model-len"),
])
def test_bad_input_one_line_error(args: list[str], field: str) -> None:
    line = _one_error_line(_run(*args))
    assert field in line
    if "--max-model-len" in args:  # the too-long prompt is named by its index
        assert "prompt 0 has" in line


def test_chat_template_by_default_answers_paris(
        smollm2_run: tuple[dict[str, str], subprocess.CompletedProcess]) -> None:
    """The embedded instruct model's tokenizer has a chat template: without --chat the prompt is
    sent as a user turn, and the greedy answer names Paris; `minivllm-jax generate` prints the
    same as scripts/generate.py."""
    env = smollm2_run[0]
    args = ("--prompt", "What is the capital of France?", "--max-tokens", "8", *SMOLLM2)
    r = _run(*args, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "Paris" in r.stdout
    console = _run("generate", *args, env=env, command=(str(CONSOLE),))
    assert console.returncode == 0, console.stderr
    assert console.stdout == r.stdout


def test_console_script_usage_and_bad_commands() -> None:
    """`minivllm-jax --help` lists the three commands; no command, an unknown one or a bad option
    is one error line and status 2."""
    r = _run("--help", command=(str(CONSOLE),))
    assert r.returncode == 0 and all(c in r.stdout for c in ("generate", "serve", "multihost")), r.stderr
    for command in ("generate", "serve", "multihost"):
        r = _run(command, "--help", command=(str(CONSOLE),))
        assert r.returncode == 0 and r.stdout.startswith(f"usage: minivllm-jax {command} ")
    for args, words in (((), "command"), (("bogus",), "bogus"),
                        (("generate", "--max-tokens", "-1"), "max_tokens")):
        assert words in _one_error_line(_run(*args, command=(str(CONSOLE),)))


def test_cli_imports_no_jax() -> None:
    """Parsing a command line starts no jax (multihost picks the platform first)."""
    code = ("import sys, minivllm_jax.cli, minivllm_jax.cli.args, minivllm_jax.cli.generate, "
            "minivllm_jax.cli.serve, minivllm_jax.cli.multihost; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_context_cut_warns_naming_the_flag(tiny_llama: str) -> None:
    """A prompt 6 tokens short of --max-model-len with --max-tokens 20: the answer stops at the
    context (finish_reason=length after 6 tokens) and stderr says to raise --max-model-len."""
    prompt = " ".join(f"t{3 + i % 7}" for i in range(58))  # one token per word
    r = _run("--model", tiny_llama, "--prompt", prompt, *SMALL, "--max-tokens", "20", "--no-chat")
    assert r.returncode == 0, r.stderr
    assert "### (6 tokens, finish_reason=length)" in r.stdout
    warning = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "--max-model-len" in warning[0] and "prompt 0" in warning[0]


def test_one_prompt_streams_and_ctrl_c_keeps_the_text(
        smollm2_run: tuple[dict[str, str], subprocess.CompletedProcess]) -> None:
    """One prompt streams: text arrives on stdout while the process still runs. SIGINT then ends
    it with status 130, the text generated so far and its summary line on stdout, and no
    traceback."""
    import signal
    import threading
    import time

    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--prompt",
                             "Write a very long story about a dragon who learns to bake bread.",
                             "--max-tokens", "1000", *SMOLLM2],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=smollm2_run[0])
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
            if "### prompt:" in text and len(text.split("\n", 1)[-1].strip()) >= 40:
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
    assert status == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert out.startswith(streamed) and "finish_reason=interrupted" in out
    answer = out.split("\n", 1)[1].rsplit("### (", 1)[0].strip()
    assert len(answer) >= len(streamed.split("\n", 1)[1].strip()) >= 40
