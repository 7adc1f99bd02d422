"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama decoder, its checkpoint storing the projections
fused as ours are (qkv_proj, gate_up_proj: loaded piece by piece, LlamaForCausalLM.load_weights).
Partial rotary (Phi-4-mini: 0.75 of each head) and longrope scaling (Phi-3-mini-128k,
Phi-3.5-mini, Phi-4-mini: layers.rotary._longrope, its factor set chosen by max_model_len) are
read from the config; Phi-3-mini-4k's sliding window (2047) is applied in attention
(ModelConfig.sliding_windows)."""

from kvfleet_runtime.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
