"""Paged attention layer: writes this step's K/V into the cache, attends over block tables.

The model runner binds each layer's cache (`layer.kv_cache = (k_cache, v_cache)`,
each [num_blocks, block_size, num_kv_heads, head_dim]) and passes an
`AttentionMetadata` describing the flattened batch explicitly through forward().
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvfleet_kernels import paged_attention as pa
from kvfleet_runtime.layers.backend import use_triton


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64: cache slot of each new token
    block_tables: torch.Tensor       # [B, max_blocks] int32
    seq_lens: torch.Tensor           # [B] int32: context length after this step
    query_start_loc: torch.Tensor    # [B + 1] int32
    max_query_len: int
    max_seq_len: int


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = self.kv_cache
        if use_triton(q):
            pa.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            out = pa.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, self.scale, meta.max_query_len,
                                     meta.max_seq_len)
        else:
            pa.reshape_and_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
            out = pa.paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, self.scale, meta.max_query_len)
        return out.view(num_tokens, self.num_heads * self.head_dim)
