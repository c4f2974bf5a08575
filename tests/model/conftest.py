"""Shared model-test fixtures: the embedded SmolLM2 GGUF loaded by us and by transformers (the
oracle), and a factory of tiny random-weight Hugging Face checkpoints saved with save_pretrained."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # paged_harness, tiny_configs

from tiny_configs import FAMILIES, TINY  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# The CI box has 2 cores shared with XLA's own threads: torch's intra-op pool oversubscribes them
# (a 34-token SmolLM2 forward measured 2.5 s with 2 threads vs 0.3 s with 1 under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from minivllm_jax.loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> Any:
    """Our load of the default GGUF in float32 (fresh conversion; the param cache is tested on
    tiny checkpoints, so nothing is written here)."""
    from minivllm_jax.loader import load_model

    return load_model(None, dtype="float32", use_cache=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: str) -> Any:
    """transformers' own load of the same GGUF, float32 (the oracle; ~20 s)."""
    path = Path(smollm2_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def _randomize(model: Any, seed: int) -> None:
    """Weights large enough that logits are peaked (greedy parity is then meaningful)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """``make(family, max_shard_size=None) -> (checkpoint dir, the torch model)``, memoised."""
    made: dict[tuple[str, Any], tuple[Path, Any]] = {}

    def make(family: str, max_shard_size: str | None = None) -> tuple[Path, Any]:
        key = (family, max_shard_size)
        if key not in made:
            cls_name, extra = FAMILIES[family]
            config = getattr(transformers, cls_name)(**TINY, **extra)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            _randomize(model, seed=len(made))
            out = tmp_path_factory.mktemp(f"tiny_{family}")
            kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
            model.save_pretrained(out, **kwargs)
            made[key] = (out, model)
        return made[key]

    return make
