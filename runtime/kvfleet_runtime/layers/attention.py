"""Paged attention layer: writes this step's K/V into the cache, attends over block tables.

The model runner binds each layer's cache (`layer.kv_cache = (k_cache, v_cache)`,
each [num_blocks, block_size, num_kv_heads, head_dim]) and passes an
`AttentionMetadata` describing the flattened batch explicitly through forward().

Backends: the Triton kernels on CUDA; elsewhere a torch path built on
scaled_dot_product_attention (fast on CPU). Both are checked against
`kvfleet_kernels.paged_attention.paged_attention_ref`.

An fp8 cache (`kv_cache_dtype="fp8"`) holds K / k_scale and V / v_scale clamped and cast to
e4m3: each layer's scales are the checkpoint's calibrated ones (`self_attn.k_scale / v_scale`,
bound by the model runner), else 1.0. Both backends read it back in the query's dtype and
attend over exactly what the cache holds, k_scale folded into the softmax scale and v_scale
into the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_runtime.layers.backend import use_triton


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64: cache slot of each new token
    block_tables: torch.Tensor       # [B, max_blocks] int32
    seq_lens: torch.Tensor           # [B] int32: context length after this step
    query_start_loc: torch.Tensor    # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    seq_lens_cpu: list[int] | None = None         # host copies for the torch path
    query_start_loc_cpu: list[int] | None = None
    # decode: the batch size split-KV decode attention plans its partitions for (a CUDA graph's
    # padded size, also in an eager step: cuda_graphs.decode_plan); None: the batch's own
    plan_num_seqs: int | None = None
    # the shortest query of the batch: > 1 tells a prefill batch it holds no decode rows (it
    # then skips the decode kernel's launch); None: not known
    min_query_len: int | None = None


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 window: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # sliding-window attention: a token sees the last `window` positions (itself included)
        self.window = window
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # an fp8 cache's scales (the model runner's choice); 1.0 for any other cache
        self.k_scale = 1.0
        self.v_scale = 1.0
        # the checkpoint's calibrated (k_scale, v_scale), set by the loader; None: it has none
        self.checkpoint_kv_scales: tuple[float, float] | None = None
        self.out_perm = None          # set_output_order's: the output is out[:, out_perm]
        self.out_index = None         # where each column goes: argsort(out_perm), int32

    def set_output_order(self, perm: torch.Tensor) -> None:
        """Hand the [T, H*D] output over as out[:, perm] (the act-order input order of o_proj,
        which then gathers nothing): the Triton kernels store each column at its place in that
        order (paged_attention's out_index), the same values."""
        self.out_perm = perm
        self.out_index = torch.argsort(perm).to(torch.int32)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]. k = v = None: this step's K/V are already
        # in the cache (the Triton path's fused rotary + cache write, `rotary_and_cache`).
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k_cache, v_cache = self.kv_cache
        on_triton = use_triton(q)
        if k is None:
            if not on_triton:
                raise ValueError("k and v may be None only on the Triton path")
        else:
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if on_triton:
            from kvfleet_kernels import paged_attention as pa
            if k is not None:
                pa.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale,
                                     self.v_scale)
            out = pa.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, self.scale, meta.max_query_len,
                                     meta.max_seq_len, plan_num_seqs=meta.plan_num_seqs,
                                     min_query_len=meta.min_query_len, window=self.window,
                                     k_scale=self.k_scale, v_scale=self.v_scale,
                                     out_index=self.out_index)
        else:
            k, v = write_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale,
                                  self.v_scale)
            out = paged_attention_torch(q, k, v, k_cache, v_cache, meta,
                                        self.scale * self.k_scale, self.window)
            if self.v_scale != 1.0:
                out = out * self.v_scale
            if self.out_perm is not None:
                return out.reshape(num_tokens, self.num_heads * self.head_dim)[:, self.out_perm]
        return out.view(num_tokens, self.num_heads * self.head_dim)


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v ([T, Hkv, D]) into their slots; return them as the cache now holds them.

    With a cache in k's dtype that is k and v themselves; an fp8 cache returns the rounded
    values (in k's dtype, still divided by k_scale / v_scale), so attention over this step's
    fresh tokens sees what later steps read back, as on the Triton path.
    """
    if slot_mapping.is_cuda:
        # CUDA-graph padding rows carry slot -1 (index_copy_ takes none): they write into the
        # pinned null block 0, which no sequence's block table lists (a CPU never pads)
        slot_mapping = slot_mapping.clamp(min=0)
    if k_cache.dtype == k.dtype:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
        return k, v
    from kvfleet_kernels.paged_attention import quantize_kv_ref
    kq, vq = quantize_kv_ref(k, k_cache.dtype, k_scale), quantize_kv_ref(v, v_cache.dtype, v_scale)
    for xq, cache in ((kq, k_cache), (vq, v_cache)):
        # index_copy_ has no float8 kernel on a CPU: copy the bytes of 1-byte elements
        as_bytes = torch.uint8 if cache.element_size() == 1 else cache.dtype
        if cache.is_contiguous():
            cache.view(as_bytes).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping,
                                                                        xq.view(as_bytes))
        else:   # a token-major V cache (paged_attention.token_major_v): write through the view
            bs = cache.shape[1]
            cache.view(as_bytes)[slot_mapping // bs, slot_mapping % bs] = xq.view(as_bytes)
    return kq.to(k.dtype), vq.to(v.dtype)


def _context(cache: torch.Tensor, table: torch.Tensor, seq_len: int,
             dtype: torch.dtype) -> torch.Tensor:
    # [num_blocks, bs, Hkv, D] -> [Hkv, S, D] in `dtype` (an fp8 cache is read back in q's dtype)
    bs = cache.shape[1]
    blocks = table[: -(-seq_len // bs)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1).to(dtype)


def paged_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, window: int = 0) -> torch.Tensor:
    """SDPA over runs of fresh prompts of one length (prefill), one sequence at a time over
    its cached context (chunked prefill, prefix hits), or batched over padded contexts (decode).
    window > 0: each token attends to the last `window` positions only."""
    lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    starts = (meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None
              else meta.query_start_loc.tolist())
    if meta.max_query_len == 1:
        return _decode(q, k_cache, v_cache, meta.block_tables, lens, scale, window)
    out = torch.empty_like(q)
    i, num_seqs = 0, len(lens)
    while i < num_seqs:
        seq_len = lens[i]
        s, e = starts[i], starts[i + 1]
        q_len = e - s
        if q_len == seq_len and not (window and seq_len > window):
            # nothing cached before: attend over the new tokens only, as one batch with the
            # next sequences that are fresh prompts of the same length (one SDPA, not n)
            n = 1
            while (i + n < num_seqs and lens[i + n] == seq_len
                   and starts[i + n + 1] - starts[i + n] == seq_len):
                n += 1
            end = s + n * seq_len
            qi = q[s:end].view(n, seq_len, *q.shape[1:]).transpose(1, 2)       # [n, H, L, D]
            ki = k[s:end].view(n, seq_len, *k.shape[1:]).transpose(1, 2)       # [n, Hkv, L, D]
            vi = v[s:end].view(n, seq_len, *v.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                               enable_gqa=True)
            out[s:end] = o.transpose(1, 2).reshape(end - s, *q.shape[1:])
            i += n
            continue
        qi = q[s:e].transpose(0, 1)                                      # [H, Q, D]
        ki = _context(k_cache, meta.block_tables[i], seq_len, q.dtype)
        vi = _context(v_cache, meta.block_tables[i], seq_len, q.dtype)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos[:, None]
        if window:
            allowed &= k_pos > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale,
                                           enable_gqa=True)
        out[s:e] = o.transpose(0, 1)
        i += 1
    return out


def _decode(q, k_cache, v_cache, block_tables, lens: list[int], scale: float,
            window: int = 0) -> torch.Tensor:
    """One query token per sequence over padded contexts: two batched matmuls and a softmax.

    Plain matmuls, not SDPA: with a padding mask SDPA takes its slow math path on a CPU
    (7x slower in bf16 at 32 sequences). The blocks are gathered by index_select (8x faster
    than advanced indexing on a CPU).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    bs = k_cache.shape[1]
    max_len = max(lens)
    num_blocks = -(-max_len // bs)
    table = block_tables[:, :num_blocks].reshape(-1).long()
    # (index_select returns contiguous blocks, whatever the cache's layout)
    ks = k_cache.index_select(0, table).view(num_seqs, num_blocks * bs, num_kv_heads, head_dim)
    vs = v_cache.index_select(0, table).view(num_seqs, num_blocks * bs, num_kv_heads, head_dim)
    ks = ks[:, :max_len].transpose(1, 2).to(q.dtype)                      # [B, Hkv, S, D]
    vs = vs[:, :max_len].transpose(1, 2).to(q.dtype)
    q4 = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)   # [B, Hkv, G, D]
    scores = torch.matmul(q4, ks.transpose(-1, -2)).float() * scale   # [B, Hkv, G, S]
    if min(lens) < max_len or (window and max_len > window):
        seq_lens = torch.tensor(lens, device=q.device)
        k_pos = torch.arange(max_len, device=q.device)[None, :]
        hidden = k_pos >= seq_lens[:, None]                                  # [B, S] padding
        if window:
            hidden |= k_pos < seq_lens[:, None] - window
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, vs).reshape(num_seqs, num_heads, head_dim)
