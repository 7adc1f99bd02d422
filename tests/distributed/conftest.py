"""Fixtures for tensor-parallel tests: tiny checkpoints of each case, made once per session."""

from __future__ import annotations

import pytest
from support.tiny_models import make_tiny_model

# case -> (architecture, overrides of the tiny config)
CASES = {
    "llama": ("llama", {}),                                    # 4 KV heads: 2 per rank
    "llama3-gqa": ("llama3", {}),                              # 2 KV heads: 1 per rank
    "llama3-one-kv-head": ("llama3", {"num_key_value_heads": 1}),   # replicated on both ranks
    "qwen2": ("qwen2", {}),                                    # qkv bias, tied embeddings
    "qwen3": ("qwen3", {}),                                    # q/k norm, head_dim 32
}


@pytest.fixture(scope="session")
def tp_model_dir(tmp_path_factory):
    """Callable case -> folder of a saved tiny random checkpoint (cached per session)."""
    made: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in made:
            arch, overrides = CASES[case]
            made[case] = str(make_tiny_model(arch, tmp_path_factory.mktemp(f"tp-{case}"),
                                             **overrides))
        return made[case]
    return get
