"""Qwen2 / Qwen2.5: the Llama decoder with qkv bias (set by ModelConfig) and usually tied embeddings."""

from kvfleet_runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
