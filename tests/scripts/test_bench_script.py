"""scripts/bench.py and its helpers: the workload generator, the random-shape builder (checked
against the real models' published parameter counts and torch's own count), and tiny end-to-end
runs (offline with the transformers comparison and the plots; online) on a small random Llama,
whose per-step records come from the engine's own `last_step` (nothing patched), and the GPU
runbook's plumbing (scripts/gpu_runbook.sh) at its small scale."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
from transformers import AutoConfig

import bench
import bench_common as bc
from minivllm_jax.cli import args as cli
import host_malloc
import plot_bench

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# Model cards: Qwen3-0.6B "0.6B parameters, 0.44B non-embedding"; Llama-3.2-1B "1.23B".
CARD = {"smollm2-135m": (134.5e6, 106.2e6), "qwen3-0.6b": (0.6e9, 0.44e9), "llama-3.2-1b": (1.23e9, None), "llama-3.1-8b": (8.03e9, None),
        "llama-tiny": (205_120, 205_120 - 2048 * 64)}  # tiny: counted by hand (bench_common)


def count_parameters(config: Any) -> int:
    """Distinct parameters of the causal LM of `config` (tied weights once), on torch's meta
    device: nothing is allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_workload_ranges_seed_and_validation() -> None:
    w = bc.make_workload(400, (3, 9), (2, 5), vocab_size=50, seed=7)
    lens = [len(p) for p in w.prompts]
    assert len(w.prompts) == len(w.output_lens) == 400
    assert set(lens) == set(range(3, 10))  # inclusive on both ends, every length reachable
    assert set(w.output_lens) == set(range(2, 6))
    ids = np.concatenate([np.asarray(p) for p in w.prompts])
    assert ids.min() >= 0 and ids.max() < 50
    assert w.num_prompt_tokens == sum(lens) and w.num_output_tokens == sum(w.output_lens)
    assert w.max_total_len == max(len(p) + o for p, o in zip(w.prompts, w.output_lens))
    assert bc.make_workload(400, (3, 9), (2, 5), 50, seed=7) == w
    assert bc.make_workload(400, (3, 9), (2, 5), 50, seed=8) != w
    big = bc.make_workload(50, (8, 8), (1, 1), vocab_size=1 << 20, seed=0)
    assert max(max(p) for p in big.prompts) < 10000  # ids capped below 10000, as nano-vllm
    with pytest.raises(ValueError, match="input_len"):
        bc.make_workload(2, (5, 4), (1, 1), 50, 0)
    with pytest.raises(ValueError, match="output_len"):
        bc.make_workload(2, (1, 4), (0, 1), 50, 0)
    with pytest.raises(ValueError, match="num_seqs"):
        bc.make_workload(0, (1, 4), (1, 1), 50, 0)
    arrivals = bc.poisson_arrivals(2000, rate=4.0, seed=0)
    assert arrivals[0] == 0.0 and all(b >= a for a, b in zip(arrivals, arrivals[1:]))
    assert abs(np.mean(np.diff(arrivals)) - 0.25) < 0.025  # mean gap 1/rate
    with pytest.raises(ValueError, match="rate"):
        bc.poisson_arrivals(3, rate=0.0, seed=0)
    assert bc.poisson_arrivals(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]  # a burst


@pytest.mark.parametrize("name", sorted(bc.MODEL_SHAPES))
def test_random_shapes_match_the_real_models(name: str) -> None:
    cfg = bc.build_hf_config(name)
    torch_count = count_parameters(cfg)  # torch's count of the built model (meta device)
    total, non_embedding = CARD[name]
    assert abs(torch_count - total) / total < 0.01
    if non_embedding is not None:
        embed = cfg.vocab_size * cfg.hidden_size
        assert abs(torch_count - embed - non_embedding) / non_embedding < 0.01
    spec = bc.spec_from_hf_config(cfg, label=name, engine_model=None, hf_dir="", hf_gguf_file=None)
    assert spec.num_params == torch_count  # the roofline's analytic count agrees exactly
    with pytest.raises(ValueError, match="model shape"):
        bc.build_hf_config("gpt-5")


# The small runbook's workload (scripts/gpu_runbook.sh, MINIVLLM_RUNBOOK_SCALE=small: its `qwen`
# options): the offline and online runs take its model and engine shape, so the programs they
# compile (stored in the session's compile cache), its random checkpoint and its converted params
# serve the runbook's own bench process too. Its one prefill step meets the 128-token forward,
# decodes the 4-token one; the sampler's 4-row bucket serves both.
RUNBOOK = ["--model", "llama-tiny", "--num-seqs", "4", "--input-len", "8", "24",
           "--output-len", "4", "6", "--dtype", "float32"]
LLAMA_TINY_VOCAB = bc.MODEL_SHAPES["llama-tiny"]["vocab_size"]


def _runbook_workload() -> bc.Workload:
    """RUNBOOK's workload (seed 0: bench.py's default)."""
    return bc.make_workload(4, (8, 24), (4, 6), LLAMA_TINY_VOCAB, seed=0)


@pytest.fixture(scope="module")
def llama_tiny() -> Path:
    """bench.py's llama-tiny random checkpoint (built in $MINIVLLM_BENCH_CACHE on first use)."""
    return Path(bc.resolve_model("llama-tiny", "float32").engine_model)


def _roofline_bytes(checkpoint: Path, w: bc.Workload) -> int:
    """Roofline bytes of llama-tiny in float32, computed independently: every step reads all
    weights (tied embedding once); request i's step j reads the KV of its prompt plus j
    generated tokens."""
    n_params = count_parameters(AutoConfig.from_pretrained(checkpoint))
    kv_per_token = 2 * 2 * 2 * 16 * 4  # layers * (k, v) * kv heads * head_dim * float32
    kv_tokens = sum(len(p) + j for p, o in zip(w.prompts, w.output_lens) for j in range(o))
    return max(w.output_lens) * n_params * 4 + kv_tokens * kv_per_token


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_offline_run_counts_tokens_and_matches_roofline(llama_tiny: Path, tmp_path: Path,
                                                        async_scheduling: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "r.json"
    # RUNBOOK's workload: 4 prompts of 8-24 tokens, 4-6 output tokens
    argv = [*RUNBOOK, "--warmup", "short", "--hbm-gbps", "100", "--compare-hf",
            "--hf-batch-size", "4", "--repeat", "2", "--json", str(out),
            "--async-scheduling", async_scheduling]
    events: list[tuple[str, list[list[int]]]] = []  # (side, the prompts it ran), in call order
    patched: list[str] = []  # engine attributes that are not the engine's own during a run
    modules = [importlib.import_module(f"minivllm_jax.{m}")
               for m in ("engine.llm_engine", "worker.runner", "parallel.sharding")]
    module_attrs = [dict(vars(m)) for m in modules]

    def engine_run(llm: Any, workload: bc.Workload, *rest: Any) -> Any:
        events.append(("engine", workload.prompts))
        out = run_offline(llm, workload, *rest)
        for obj in (llm, llm.engine, llm.engine.runner, llm.engine.scheduler):
            patched.extend(f"{type(obj).__name__}.{k}" for k, v in vars(obj).items()
                           if callable(v) and hasattr(type(obj), k))
        patched.extend(m.__name__ for m, attrs in zip(modules, module_attrs)
                       if any(vars(m).get(k) is not v for k, v in attrs.items()))
        return out

    def hf_pass(self: bench.HFBaseline, workload: bc.Workload) -> Any:
        events.append(("hf", workload.prompts))
        return timed_pass(self, workload)

    run_offline, timed_pass = bench.run_offline, bench.HFBaseline.timed_pass
    monkeypatch.setattr(bench, "run_offline", engine_run)
    monkeypatch.setattr(bench.HFBaseline, "timed_pass", hf_pass)
    monkeypatch.setattr(host_malloc, "tune_glibc_malloc", lambda: pytest.fail("malloc tuned"))
    rec = bench.main(argv)
    w = _runbook_workload()
    eng = rec["engine"]
    assert eng["per_request_tokens"] == w.output_lens
    assert eng["output_tokens"] == w.num_output_tokens
    assert patched == []  # checked in each engine run: bench.py reads the engine's record, wraps nothing
    assert not any(hasattr(bench, name) for name in ("StepProfiler", "patch", "install"))
    assert rec["cpu_malloc"] == "default"  # malloc left alone unless asked
    # the records are the engine's: one per step() call; every prompt token and every fed-back
    # output token (all but each request's last) scheduled once; one sampled token per request
    # and step, so the scheduled requests add up to the output tokens
    steps = rec["steps"]
    assert len(steps) == eng["num_steps"] == rec["split"]["all"]["num_steps"]
    assert sum(s["num_tokens"] for s in steps) == (w.num_prompt_tokens + w.num_output_tokens
                                                   - len(w.prompts))
    assert sum(s["num_reqs"] for s in steps) == w.num_output_tokens
    decode = [s for s in steps if s["num_reqs"] and s["num_tokens"] == s["num_reqs"]]
    assert rec["split"]["decode"]["num_steps"] == len(decode) == max(w.output_lens) - 1
    assert rec["split"]["prefill"]["num_steps"] == 1
    for key in bench.PHASES:
        assert rec["split"]["decode"][key] == pytest.approx(1e3 * np.mean([s[key] for s in decode]))
    # one prefill step, then one token per step; with async scheduling the first call only
    # dispatches, and each later call collects the step before
    assert eng["num_steps"] == max(w.output_lens) + (1 if async_scheduling == "on" else 0)
    assert [s["num_tokens"] > 0 for s in rec["steps"]] == [False] * (
        eng["num_steps"] - max(w.output_lens)) + [True] * max(w.output_lens)
    assert len(eng["elapsed_all_s"]) == 2 and eng["elapsed_s"] == min(eng["elapsed_all_s"])
    for step in steps:
        assert (step["device"] > 0) == (step["num_tokens"] > 0) and step["host"] > 0
        assert step["host"] + step["device"] == pytest.approx(step["total"])
        assert step["schedule"] + step["dispatch"] + step["update"] + step["process"] <= step["host"]
    assert rec["roofline"]["bound_s"] * 100e9 == pytest.approx(_roofline_bytes(llama_tiny, w),
                                                               rel=1e-9)
    saved = json.loads(out.read_text())
    assert len(saved) == 1 and saved[0]["engine"]["output_tokens"] == w.num_output_tokens
    for png in plot_bench.main([str(out), "--out-dir", str(tmp_path)]):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    hf = rec["hf"]
    if jax.default_backend() != "cpu" and not torch.cuda.is_available():
        assert hf is None  # a GPU engine is never compared with a CPU transformers run
        return
    assert hf["output_tokens"] == w.num_output_tokens
    # one batch (--hf-batch-size: every prompt) padded to its longest
    assert hf["generated_tokens"] == len(w.prompts) * max(w.output_lens)
    assert len(hf["elapsed_all_s"]) == 2 and hf["elapsed_s"] == min(hf["elapsed_all_s"])
    assert rec["ratio"] == pytest.approx(eng["output_tok_s"] / hf["output_tok_s"])
    # the rounds interleave (after the engine's untimed warm-up run): engine, transformers on
    # the same token ids, engine on redrawn ids, transformers on those; a round's ratio is its
    # transformers time over its engine time
    sides = [side for side, _ in events]
    assert sides == ["engine", "engine", "hf", "engine", "hf"]
    assert events[1][1] == w.prompts and events[2][1] == w.prompts
    assert events[3][1] == events[4][1] != w.prompts
    assert hf["round_ratios"] == pytest.approx(
        [h / e for h, e in zip(hf["elapsed_all_s"], eng["elapsed_all_s"])])


def test_online_run_reports_latencies(llama_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the offline test's model and engine shape (max_model_len and KV blocks given: those bench.py
    # sizes for RUNBOOK's workload), so its compiled programs serve: 1- and 2-token prompts meet
    # the 4-token forward; seed 6: prompts of 1 and 2 tokens, 4 and 3 output tokens
    sized = bc.sized_engine_kwargs(bench.parse_args(RUNBOOK), _runbook_workload(), "float32", True)
    argv = ["--model", "llama-tiny", "--num-seqs", "2", "--input-len", "1", "2",
            "--output-len", "2", "5", "--dtype", "float32", "--warmup", "none", "--online", "50",
            "--cpu-malloc", "tuned", "--seed", "6", "--max-model-len", str(sized["max_model_len"]),
            "--num-kv-blocks", str(sized["num_kv_blocks"])]
    tuned: list[bool] = []  # a stand-in: the real settings would stay for the whole test process
    monkeypatch.setattr(host_malloc, "tune_glibc_malloc", lambda: tuned.append(True) or True)
    rec = bench.main(argv)
    assert tuned == [True] and rec["cpu_malloc"] == "tuned"
    w = bc.make_workload(2, (1, 2), (2, 5), LLAMA_TINY_VOCAB, seed=6)
    assert rec["engine"]["per_request_tokens"] == w.output_lens
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        q = rec["engine"][key]
        assert 0 < q["p50"] <= q["p90"] <= q["p99"]
    assert rec["engine"]["e2e_s"]["p99"] <= rec["engine"]["elapsed_s"]


def test_bad_arguments_are_rejected() -> None:
    for argv in (["--input-len", "9", "3"], ["--num-seqs", "0"], ["--online", "-1"],
                 ["--temperature", "-0.5"], ["--repeat", "0"], ["--model"],
                 ["--tensor-parallel-size", "0"], ["--max-num-seqs", "0"],
                 ["--data-parallel-size", "2"], ["--attention-backend", "triton"],
                 ["--layers", "unrolled"], ["--cpu-malloc", "fast"]):
        with pytest.raises(ValueError):  # run_cli's one line
            bench.parse_args(argv)
    from minivllm_jax.plan import ModelPlan

    choices = {f.name: f.metadata["choices"] for f in cli.engine_fields()}
    for backend in choices["attention_backend"][1:]:  # the flags' choices: each one the plan takes
        assert ModelPlan(backend).attention_backend == backend
    for layout in choices["layer_layout"]:
        assert ModelPlan(layer_layout=layout).layer_layout == layout
    args = bench.parse_args(["--layers", "stacked", "--attention-backend", "reference",
                             "--async-scheduling", "off"])
    assert cli.engine_kwargs(args) == {"attention_backend": "reference",
                                       "layer_layout": "stacked", "async_scheduling": False}
    for model in ("/nonexistent/dir", "/nonexistent/model.gguf"):
        with pytest.raises(ValueError, match="--model"):
            bc.resolve_model(model, "float32")


def test_json_schema_option(tmp_path: Path) -> None:
    """--json-schema: the built-in records schema (a grammar llguidance builds) or a file's,
    checked before any model loads, and carried only by the constrained run's requests."""
    from minivllm_jax.structured_output.grammar_worker import grammar_text

    args = bench.parse_args(["--json-schema", "builtin"])
    assert bench.sampling_params(args, 4).structured_outputs is None
    assert bench.sampling_params(args, 4, constrained=True).structured_outputs.json == bench.RECORDS_SCHEMA
    assert grammar_text(args.structured)
    assert bench.parse_args([]).structured is None
    schema = {"type": "array", "items": {"type": "integer"}}
    (tmp_path / "ok.json").write_text(json.dumps(schema))
    assert bench.parse_args(["--json-schema", str(tmp_path / "ok.json")]).structured.json == schema
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "text.json").write_text("{not json")
    for bad in ("missing.json", "list.json", "text.json"):
        with pytest.raises(ValueError, match=f"^--json-schema {tmp_path / bad}: "):
            bench.parse_args(["--json-schema", str(tmp_path / bad)])


def test_cli_reports_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.py run as a script, in this process (runpy: its `__main__` block as written; a
    process of its own costs seconds of imports and is what the runbook and the
    tensor-parallel run start)."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / "bench.py"), "--model", str(tmp_path / "none")])
    with pytest.raises(SystemExit) as status:
        runpy.run_path(str(SCRIPTS / "bench.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert status.value.code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("error: --model must be") and str(tmp_path / "none") in line


def test_tensor_parallel_run_splits_the_kv_cache(llama_tiny: Path, tmp_path: Path) -> None:
    """--tensor-parallel-size 2 over two virtual CPU devices (a subprocess: the device count is
    fixed at jax's start): the KV cache spans both, every requested token comes out, and the
    roofline counts both devices' bandwidth. On this one-device process, 2 is rejected."""
    # every step in the 4-token bucket: one forward compilation; seed 6: prompts of 1 and 2
    # tokens, 4 and 3 output tokens
    argv = ["--model", "llama-tiny", "--num-seqs", "2", "--input-len", "1", "2",
            "--output-len", "2", "5", "--dtype", "float32", "--warmup", "none", "--hbm-gbps", "100",
            "--tensor-parallel-size", "2", "--seed", "6"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), *argv, "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())
    w = bc.make_workload(2, (1, 2), (2, 5), LLAMA_TINY_VOCAB, seed=6)
    assert rec["tensor_parallel_size"] == 2 and rec["kv_cache_devices"] == 2
    assert rec["engine"]["per_request_tokens"] == w.output_lens
    assert rec["roofline"]["bound_s"] * 2 * 100e9 == pytest.approx(_roofline_bytes(llama_tiny, w),
                                                                   rel=1e-9)
    if len(jax.devices()) == 1:
        with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds"):
            bench.main(argv)


def _runbook(part: str, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "MINIVLLM_RUNBOOK_SCALE": "small",
           "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPTS / "gpu_runbook.sh"), part], env=env,
                          capture_output=True, text=True, timeout=600, cwd=SCRIPTS.parent)


def test_gpu_runbook_bench_part_runs_and_reports_failures(tmp_path: Path) -> None:
    """The runbook's `bench` part, shrunk (what a lent GPU's first device calls run): its log and
    JSON land in $OUT, and the exit status is non-zero exactly when a step fails."""
    done = _runbook("bench", tmp_path / "ok")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "ok" / "bench.log").read_text().rstrip().endswith("== rc=0")
    (rec,) = json.loads((tmp_path / "ok" / "gpu.json").read_text())
    # the small scale's workload (RUNBOOK): 4 llama-tiny prompts of 8-24 tokens, 4-6 outputs, seed 0
    assert " ".join(RUNBOOK) in (tmp_path / "ok" / "bench.log").read_text().splitlines()[0]
    w = _runbook_workload()
    assert rec["model"] == "llama-tiny" and rec["prompt_tokens"] == sum(map(len, w.prompts))
    assert rec["engine"]["per_request_tokens"] == w.output_lens
    if jax.default_backend() == "cpu" or torch.cuda.is_available():  # else no transformers run
        assert rec["hf"]["output_tokens"] == w.num_output_tokens
    failing = _runbook("bench", tmp_path / "bad", PYTHON="false")  # the step's command exits 1
    assert failing.returncode == 1 and "1 step(s) failed" in failing.stderr
    assert "== rc=1" in (tmp_path / "bad" / "bench.log").read_text()
    usage = _runbook("nonsense", tmp_path / "usage")
    assert usage.returncode == 2 and "usage:" in usage.stderr
