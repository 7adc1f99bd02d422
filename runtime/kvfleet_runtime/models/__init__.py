"""Model registry: HF `architectures` name -> our implementation."""

from __future__ import annotations

from kvfleet_runtime.models.config import ModelConfig
from kvfleet_runtime.models.llama import LlamaForCausalLM
from kvfleet_runtime.models.moe import (
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from kvfleet_runtime.models.phi3 import Phi3ForCausalLM
from kvfleet_runtime.models.qwen2 import Qwen2ForCausalLM
from kvfleet_runtime.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}


def get_model_class(config: ModelConfig):
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"architecture must be one of {', '.join(MODEL_REGISTRY)}; "
                         f"got {config.architecture!r}") from None
