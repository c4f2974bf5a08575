"""Model-test fixtures: the embedded model under its model-test name, and a factory of tiny
random-weight Hugging Face checkpoints saved with save_pretrained."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # paged_harness, tiny_configs

from tiny_configs import FAMILIES, TINY  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)  # the 2-core CI machine's second core is XLA's (see tests/conftest.py)


@pytest.fixture(scope="session")
def smollm2(loaded_model: Any) -> Any:
    """Our load of the embedded GGUF in float32 (the session's `loaded_model`)."""
    return loaded_model


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
    """``make(family, max_shard_size=None) -> (checkpoint dir, the torch model)``, memoised. A
    family's weights depend only on the family (not on which test, on which xdist worker, made
    a checkpoint first): seed = its index in sorted(FAMILIES), the order of a serial run."""
    made: dict[tuple[str, Any], tuple[Path, Any]] = {}

    def make(family: str, max_shard_size: str | None = None) -> tuple[Path, Any]:
        key = (family, max_shard_size)
        if key not in made:
            cls_name, extra = FAMILIES[family]
            config = getattr(transformers, cls_name)(**TINY, **extra)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            _randomize(model, seed=sorted(FAMILIES).index(family))
            out = tmp_path_factory.mktemp(f"tiny_{family}")
            kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
            model.save_pretrained(out, **kwargs)
            made[key] = (out, model)
        return made[key]

    return make
