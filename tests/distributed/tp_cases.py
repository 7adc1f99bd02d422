"""The tiny models every tensor-parallel test runs: one per sharding situation."""

# case -> (architecture, overrides of the tiny config)
CASES = {
    "llama": ("llama", {}),                                    # 4 KV heads: 2 per rank
    "llama3-gqa": ("llama3", {}),                              # 2 KV heads: 1 per rank
    "llama3-one-kv-head": ("llama3", {"num_key_value_heads": 1}),   # replicated on both ranks
    "qwen2": ("qwen2", {}),                                    # qkv bias, tied embeddings
    "qwen3": ("qwen3", {}),                                    # q/k norm, head_dim 32
    "phi3": ("phi3", {}),                  # fused qkv / gate_up tensors split, then sharded
    "mixtral": ("mixtral", {}),            # each expert's intermediate split, outputs summed
    "qwen3-moe": ("qwen3_moe", {}),        # the same, beside a dense layer (mlp_only_layers)
    "qwen2-moe": ("qwen2_moe", {}),        # and a shared expert, row-parallel as a dense MLP
}
