"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama decoder, its checkpoint storing the projections
fused as ours are (qkv_proj, gate_up_proj: loaded piece by piece, LlamaForCausalLM.load_weights).
Not supported: partial rotary (Phi-4-mini) and longrope scaling (the 128k variants), both
refused when the config is read. Phi-3-mini-4k's sliding window (2047) is applied in attention
(ModelConfig.sliding_windows)."""

from kvfleet_runtime.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
