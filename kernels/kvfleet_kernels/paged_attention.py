"""Paged attention over block tables, and the KV-cache write.

Layout (shared by the engine, the torch references and the Triton kernels):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables:     [num_seqs, max_blocks_per_seq] int32 (padded with 0)
  seq_lens:         [num_seqs] int32, tokens in context after this step (cached + new)
  query_start_loc:  [num_seqs + 1] int32, cumulative new-token counts
  slot_mapping:     [num_tokens] int64, block_id * block_size + offset of each new token
The new tokens of sequence i are the last (query_start_loc[i+1] - query_start_loc[i])
positions of its context, so one call serves prefill chunks (with a cached prefix)
and decode (one query token) in the same batch.
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V ([num_tokens, num_kv_heads, head_dim]) into their slots; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[valid].to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, H, D] -> [seq_len, H, D]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        max_query_len: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    query: [num_tokens, num_heads, head_dim] -> out: [num_tokens, num_heads, head_dim]
    Computed in fp32; GQA by repeating KV heads. The reference the kernels are tested against.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if max_query_len == 1 and len(lens) > 1:
        return _decode_batched_ref(query, k_cache, v_cache, block_tables, lens, scale)
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _gather_context(k_cache, block_tables[i], seq_len).float()   # [S, Hkv, D]
        v = _gather_context(v_cache, block_tables[i], seq_len).float()
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()                                  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale               # [H, Q, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out.view(-1, num_heads, head_dim)


def _decode_batched_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """One query token per sequence: gather all contexts padded, one masked softmax."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    max_len = max(lens)
    max_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :max_blocks].long()
    k = k_cache[table].flatten(1, 2)[:, :max_len]      # [B, S, Hkv, D]
    v = v_cache[table].flatten(1, 2)[:, :max_len]
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", q.float(), k.float()) * scale
    seq_lens = torch.tensor(lens, device=query.device)
    mask = torch.arange(max_len, device=query.device)[None, :] >= seq_lens[:, None]   # [B, S]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v.float())
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
