"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rotary (set by ModelConfig)."""

from kvfleet_runtime.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
