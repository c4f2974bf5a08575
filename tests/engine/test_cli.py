"""scripts/generate.py as a user runs it: a real completion, and one-line errors for bad input."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "generate.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_completion(tmp_path: Path, tokenizer) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n\nHello, my name is\n")
    r = _run("--prompts-file", str(prompts), "--max-tokens", "4", "--max-model-len", "64",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--num-kv-blocks", "16", "--no-tqdm")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    for prompt in ("The capital of France is", "Hello, my name is"):
        assert f"### prompt: {prompt!r}" in r.stdout
    assert r.stdout.count("finish_reason=length") == 2  # 4 greedy tokens each, EOS-free prompts
    completion = r.stdout.split("\n")[1]
    assert len(tokenizer.encode(completion)) >= 2  # some real generated text


@pytest.mark.parametrize("args, field", [
    (["--model", "/nonexistent/model.gguf"], "/nonexistent"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "prompts.txt"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
])
def test_bad_input_one_line_error(args: list[str], field: str) -> None:
    r = _run(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], r.stderr
