"""Paged attention over block tables, and the KV-cache write: torch references and Triton twins.

Layout (shared by the engine, the torch references and the Triton kernels):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; v_cache may also be a
                    token-major view (`token_major_v`: each block's values stored
                    [num_kv_heads, head_dim, block_size], the engine's choice for fp8 caches)
  block_tables:     [num_seqs, max_blocks_per_seq] int32 (padded with 0)
  seq_lens:         [num_seqs] int32, tokens in context after this step (cached + new)
  query_start_loc:  [num_seqs + 1] int32, cumulative new-token counts
  slot_mapping:     [num_tokens] int64, block_id * block_size + offset of each new token
The new tokens of sequence i are the last (query_start_loc[i+1] - query_start_loc[i])
positions of its context, so one call serves prefill chunks (with a cached prefix)
and decode (one query token) in the same batch.

The cache may be float8_e4m3fn (`--kv-cache-dtype fp8`) with scale 1.0: K/V are clamped to
+-FP8_E4M3_MAX and cast on write (so out-of-range values saturate instead of becoming NaN), and
cast back to the query's dtype on read; the attention math is unchanged. An fp8 cache keeps V
token-major: the P @ V product reduces over keys, and the tensor cores' operand wants them
adjacent. Triton reads a [keys, head_dim] e4m3 tile into that operand one byte at a time from
shared memory (16-bit elements have a transposing `ldmatrix`, 8-bit ones none); stored
token-major the tile loads with `ldmatrix` like K. On an H200 decode over an fp8 cache ran
9-15% faster (docs/KERNELS.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.env import on_off
from kvfleet_kernels.pdl import pdl_args, pdl_wait

# Largest finite float8_e4m3fn. K/V headed for an fp8 cache are clamped to +-this before the cast
# (every writer: reshape_and_cache, its reference, the torch path, rotary_and_cache).
FP8_E4M3_MAX = 448.0
FP8_KV_DTYPE = torch.float8_e4m3fn


def quantize_kv_ref(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x cast to the cache dtype, as the kernels write it: for an fp8 cache divided by its scale
    (times 1 / scale in fp32) and clamped first."""
    check_kv_scales(cache_dtype, scale)
    if cache_dtype == FP8_KV_DTYPE:
        if scale != 1.0:
            x = x.float() * (1.0 / scale)
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(cache_dtype)


def check_kv_scales(cache_dtype: torch.dtype, *scales: float) -> None:
    """Scales other than 1.0 belong to an fp8 cache only; each finite and positive."""
    for scale in scales:
        if not (0.0 < scale < float("inf")):
            raise ValueError(f"a KV-cache scale must be finite and > 0; got {scale}")
        if scale != 1.0 and cache_dtype != FP8_KV_DTYPE:
            raise ValueError(f"KV-cache scales apply to an fp8 cache only; got {scale} for a "
                             f"{cache_dtype} cache")


def token_major_v(v_cache: torch.Tensor) -> torch.Tensor:
    """A contiguous [num_blocks, block_size, num_kv_heads, head_dim] V cache reinterpreted as each
    block's values stored [num_kv_heads, head_dim, block_size] (keys adjacent), returned as a
    [num_blocks, block_size, num_kv_heads, head_dim] view of that storage: every function here
    takes it where it takes v_cache (the engine's layout for fp8 caches)."""
    if not v_cache.is_contiguous():
        raise ValueError("token_major_v needs the contiguous cache it reinterprets")
    num_blocks, block_size, num_kv_heads, head_dim = v_cache.shape
    return v_cache.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def head_major_k(k_cache: torch.Tensor) -> torch.Tensor:
    """A contiguous [num_blocks, block_size, num_kv_heads, head_dim] K cache reinterpreted as each
    block's keys stored [num_kv_heads, block_size, head_dim] (a head's keys of a block one run
    of block_size x head_dim elements, where rows put them num_kv_heads x head_dim apart),
    returned as a [num_blocks, block_size, num_kv_heads, head_dim] view of that storage: every
    function here takes it where it takes k_cache (the kernels read K through its strides).
    The engine lays an fp8 cache's K out so under KVFLEET_K_HEAD_MAJOR=1 (an A/B switch)."""
    if not k_cache.is_contiguous():
        raise ValueError("head_major_k needs the contiguous cache it reinterprets")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return k_cache.view(num_blocks, num_kv_heads, block_size, head_dim).permute(0, 2, 1, 3)


def is_token_major(v_cache: torch.Tensor) -> bool:
    """Whether v_cache is a token_major_v view (its keys adjacent within a block)."""
    return v_cache.stride(1) == 1 and v_cache.stride(3) != 1


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new K/V ([num_tokens, num_kv_heads, head_dim]) into their slots; slot -1 is skipped.
    An fp8 cache holds K / k_scale and V / v_scale (calibrated scales; 1.0 without)."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize_kv_ref(key[valid], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = quantize_kv_ref(value[valid], v_cache.dtype, v_scale)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, H, D] -> [seq_len, H, D]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        max_query_len: int | None = None, window: int = 0,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    query: [num_tokens, num_heads, head_dim] -> out: [num_tokens, num_heads, head_dim]
    Computed in fp32; GQA by repeating KV heads. The reference the kernels are tested against.
    window > 0: sliding-window attention (Mistral's, HF's mask): a query at position p sees the
    keys at positions p - window + 1 .. p only.
    k_scale / v_scale: an fp8 cache's scales (it holds K / k_scale, V / v_scale): read back
    times them.
    """
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if max_query_len == 1 and len(lens) > 1:
        return _decode_batched_ref(query, k_cache, v_cache, block_tables, lens, scale, window,
                                   k_scale, v_scale)
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _gather_context(k_cache, block_tables[i], seq_len).float() * k_scale   # [S, Hkv, D]
        v = _gather_context(v_cache, block_tables[i], seq_len).float() * v_scale
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()                                  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale               # [H, Q, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]
        if window:
            mask |= k_pos[None, :] <= q_pos[:, None] - window
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out.view(-1, num_heads, head_dim)


def _decode_batched_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, lens: list[int], scale: float,
                        window: int = 0, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
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
    scores = torch.einsum("bhgd,bshd->bhgs", q.float(), k.float() * k_scale) * scale
    seq_lens = torch.tensor(lens, device=query.device)
    k_pos = torch.arange(max_len, device=query.device)[None, :]
    mask = k_pos >= seq_lens[:, None]                                   # [B, S]
    if window:
        mask |= k_pos < seq_lens[:, None] - window
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v.float() * v_scale)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


# --------------------------------------------------------------------------------------
# Triton kernels. Shared choices:
# - K/V rows are gathered through the block table one key at a time (block id = n // block_size),
#   so any BLOCK_N works with any block_size and block tables may list blocks in any order.
# - Softmax runs in the log2 domain (exp2 is one instruction; scale * log2(e) folds into one multiply).
# - Block ids are widened to int64 before multiplying by the block stride: a per-layer cache on an
#   H200 can exceed 2**31 elements.
# - tl.dot uses "ieee" precision: it only changes fp32 inputs (no TF32 rounding, so fp32 caches
#   match the reference); fp16/bf16 inputs take the tensor cores either way.
# --------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_E4M3_MAX)    # kernels read only constexpr globals


@triton.jit
def to_cache_dtype(x, CACHE_DTYPE: tl.constexpr, inv_scale=1.0):
    """x cast to the KV cache's element type; for an fp8 cache times inv_scale (1 / the cache's
    scale) in fp32 and clamped to +-FP8_E4M3_MAX first (quantize_kv_ref's)."""
    if CACHE_DTYPE == tl.float8e4nv:
        x = x.to(tl.float32) * inv_scale      # exact for a scale of 1.0
        x = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)
    return x.to(CACHE_DTYPE)


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                              k_inv_scale, v_inv_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                              stride_vcd, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # One program per new token: its [num_kv_heads, head_dim] K and V rows go to one slot.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    # stride_vcd: 1, or block_size for a token-major V cache
    v_dst = (v_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch
             + d[None, :] * stride_vcd)
    tl.store(k_dst, to_cache_dtype(k, k_cache_ptr.dtype.element_ty, k_inv_scale), mask=mask)
    tl.store(v_dst, to_cache_dtype(v, v_cache_ptr.dtype.element_ty, v_inv_scale), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Triton twin of `reshape_and_cache_ref`: same arguments, same in-place effect."""
    num_tokens, num_kv_heads, head_dim = key.shape
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    if num_tokens == 0:
        return
    _require_unit_last_stride(key=key, value=value, k_cache=k_cache)
    check_v_cache_strides(v_cache)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


@triton.jit
def _to_fp16(q):
    # The query in fp16 for dots against an fp8 cache: e4m3 converts to fp16 in one instruction
    # per pair (to bf16 it goes through fp16 and fp32). Clamped to fp16's range first; fp16
    # holds a bf16 query's value within its own, finer rounding.
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


# Which keys of a K/V tile _attend_tile masks out.
_MASK_NONE: tl.constexpr = tl.constexpr(0)     # every key of the tile is visible to every row
_MASK_END: tl.constexpr = tl.constexpr(1)      # keys at or past kv_end are hidden
_MASK_CAUSAL: tl.constexpr = tl.constexpr(2)   # key n is visible to a row at q_pos >= n only


@triton.jit
def _kv_rows(table, n, mask, kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
             stride_vh, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    # keys n's offsets in the K and V caches, through the block table (MASKED: block 0 for the
    # keys outside mask)
    if MASKED:
        block = tl.load(table + n // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    else:
        block = tl.load(table + n // BLOCK_SIZE).to(tl.int64)
    offset = n % BLOCK_SIZE
    return (block * stride_kb + offset * stride_ks + kv_head * stride_kh,
            block * stride_vb + offset * stride_vs + kv_head * stride_vh)


@triton.jit
def _and_dims(mask, dims, D_REAL: tl.constexpr, HEAD_DIM: tl.constexpr):
    # mask, and, where the head's D_REAL dims are padded to the tile's HEAD_DIM (a power of
    # two: 96 -> 128), dims < D_REAL: the pad reads as 0 and is never written (D_REAL 0: none)
    DIMS: tl.constexpr = D_REAL if D_REAL > 0 else HEAD_DIM
    if DIMS < HEAD_DIM:
        mask = mask & (dims < DIMS)
    return mask


@triton.jit
def _out_cols(out_index_ptr, head, d, mask, stride_oh, D_REAL: tl.constexpr,
              HEAD_DIM: tl.constexpr, OUT_INDEX: tl.constexpr):
    # the columns within a token's output row that (head, dim d) are stored at: head *
    # stride_oh + d, or with OUT_INDEX where out_index_ptr puts column head * D + d of the
    # row viewed as [num_heads * D] (D: the head's D_REAL dims; read where mask, the store's)
    if OUT_INDEX:
        D: tl.constexpr = D_REAL if D_REAL > 0 else HEAD_DIM
        cols = tl.load(out_index_ptr + head * D + d, mask=mask, other=0)
    else:
        cols = head * stride_oh + d
    return cols


@triton.jit
def _load_kv(k_cache_ptr, v_cache_ptr, row_k, row_v, mask, HEAD_DIM: tl.constexpr,
             MASKED: tl.constexpr, K_BY_ROWS: tl.constexpr, LOAD_V: tl.constexpr = True,
             D_REAL: tl.constexpr = 0):
    # a K/V tile in the cache's dtype: V as [N, D], K as [N, D] (K_BY_ROWS) or gathered [D, N];
    # keys outside mask (MASKED) read as 0. LOAD_V=False: K only (v is K, unused). D_REAL (0:
    # HEAD_DIM): the head's dims, the tile's others read as 0
    d = tl.arange(0, HEAD_DIM)
    v_ptrs = v_cache_ptr + row_v[:, None] + d[None, :]
    if K_BY_ROWS:
        k_ptrs = k_cache_ptr + row_k[:, None] + d[None, :]
    else:
        k_ptrs = k_cache_ptr + row_k[None, :] + d[:, None]
    DIMS: tl.constexpr = D_REAL if D_REAL > 0 else HEAD_DIM
    if DIMS < HEAD_DIM:
        keys = mask if MASKED else tl.full(mask.shape, 1, tl.int1)
        if K_BY_ROWS:
            k = tl.load(k_ptrs, mask=keys[:, None] & (d < DIMS)[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=keys[None, :] & (d < DIMS)[:, None], other=0.0)
        v = k
        if LOAD_V:
            v = tl.load(v_ptrs, mask=keys[:, None] & (d < DIMS)[None, :], other=0.0)
    elif not MASKED:
        k = tl.load(k_ptrs)
        v = k
        if LOAD_V:
            v = tl.load(v_ptrs)                                          # [N, D]
    elif K_BY_ROWS:
        k = tl.load(k_ptrs, mask=mask[:, None], other=0.0)
        v = k
        if LOAD_V:
            v = tl.load(v_ptrs, mask=mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=mask[None, :], other=0.0)
        v = k
        if LOAD_V:
            v = tl.load(v_ptrs, mask=mask[:, None], other=0.0)
    return k, v


@triton.jit
def _v_token_major_ptrs(v_cache_ptr, table, start, hi, kv_head, stride_vb, stride_vh,
                        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    # Where the V tile of keys [start, start + BLOCK_N) lies in a token-major cache (a block's
    # values [kv_heads, head_dim, block_size]): pointers [D, NB, SEG] (NB runs of SEG adjacent
    # keys, one block each), those keys' positions [1, NB, SEG] and dims [D, 1, 1]. Each block's id is read once
    # (a scalar per run, not per key; MASKED: block 0 from hi on), so the compiler sees SEG
    # adjacent keys: 16-byte copies into shared memory, then ldmatrix into the P @ V operand.
    # start is a multiple of BLOCK_N.
    SEG: tl.constexpr = BLOCK_N if BLOCK_N < BLOCK_SIZE else BLOCK_SIZE
    NB: tl.constexpr = BLOCK_N // SEG
    first = tl.multiple_of(start, BLOCK_N) + tl.arange(0, NB) * SEG          # [NB] first keys
    if MASKED:
        block = tl.load(table + first // BLOCK_SIZE, mask=first < hi, other=0).to(tl.int64)
    else:
        block = tl.load(table + first // BLOCK_SIZE).to(tl.int64)
    j = tl.arange(0, SEG)
    d = tl.arange(0, HEAD_DIM)
    ptrs = (v_cache_ptr + kv_head * stride_vh + block[None, :, None] * stride_vb
            + (first % BLOCK_SIZE)[None, :, None] + d[:, None, None] * BLOCK_SIZE
            + j[None, None, :])
    return ptrs, first[None, :, None] + j[None, None, :], d[:, None, None]


@triton.jit
def _v_rows(v, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # a [D, NB, SEG] tile loaded through _v_token_major_ptrs as the [N, D] V tile
    return tl.trans(tl.reshape(v, (HEAD_DIM, BLOCK_N)))


@triton.jit
def _load_tile(k_cache_ptr, v_cache_ptr, table, start, hi, kv_head, stride_kb, stride_ks,
               stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
               K_BY_ROWS: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr, D_REAL: tl.constexpr):
    # The K and V tiles of keys [start, start + BLOCK_N) through the block table (_load_kv's
    # shapes); keys from hi on read as 0 (MASKED), dims from D_REAL on too.
    n = start + tl.arange(0, BLOCK_N)
    row_k, row_v = _kv_rows(table, n, n < hi, kv_head, stride_kb, stride_ks, stride_kh,
                            stride_vb, stride_vs, stride_vh, BLOCK_SIZE, MASKED)
    k, v = _load_kv(k_cache_ptr, v_cache_ptr, row_k, row_v, n < hi, HEAD_DIM, MASKED, K_BY_ROWS,
                    not V_TOKEN_MAJOR, D_REAL)
    if V_TOKEN_MAJOR:
        v_ptrs, n3, d3 = _v_token_major_ptrs(v_cache_ptr, table, start, hi, kv_head, stride_vb,
                                             stride_vh, BLOCK_N, HEAD_DIM, BLOCK_SIZE, MASKED)
        if MASKED:
            v = _v_rows(tl.load(v_ptrs, mask=_and_dims(n3 < hi, d3, D_REAL, HEAD_DIM), other=0.0),
                        BLOCK_N, HEAD_DIM)
        elif (D_REAL if D_REAL > 0 else HEAD_DIM) < HEAD_DIM:
            v = _v_rows(tl.load(v_ptrs, mask=_and_dims(n3 >= 0, d3, D_REAL, HEAD_DIM), other=0.0),
                        BLOCK_N, HEAD_DIM)
        else:
            v = _v_rows(tl.load(v_ptrs), BLOCK_N, HEAD_DIM)
    return k, v


@triton.jit
def _attend_kv(q, m_i, l_i, acc, k, v, n, kv_end, q_pos, scale_log2, MASK: tl.constexpr,
               K_BY_ROWS: tl.constexpr, q_lo, SLIDING: tl.constexpr):
    # One online-softmax step of the rows of q over the loaded tile of keys n (_load_kv).
    # SLIDING: keys below each row's q_lo are hidden too (its window's first position).
    # An fp8 cache is read back in the query's dtype (exact: e4m3 fits in fp16/bf16/fp32).
    # With a cache already in that dtype, .to() returns its input: no extra op.
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if K_BY_ROWS:
        k = tl.trans(k)                                                  # [D, N]
    qk = tl.dot(q, k, input_precision="ieee") * scale_log2              # [M, N]
    if MASK == _MASK_END:
        qk = tl.where((n < kv_end)[None, :], qk, float("-inf"))
    if MASK == _MASK_CAUSAL:
        qk = tl.where(n[None, :] <= q_pos[:, None], qk, float("-inf"))
    if SLIDING:
        qk = tl.where(n[None, :] >= q_lo[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if SLIDING:
        # a row may see no key of a tile (all below its window): its sums stay 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # every row sees at least one key in its first tile, so m_new is finite from the start
        m_use = m_new
    p = tl.exp2(qk - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_tile(q, m_i, l_i, acc, start, kv_end, q_pos, table, kv_head, scale_log2,
                 k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 MASK: tl.constexpr, K_BY_ROWS: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr,
                 q_lo, SLIDING: tl.constexpr, D_REAL: tl.constexpr):
    # One online-softmax step of the rows of q over keys [start, start + BLOCK_N).
    # Returns the updated running max m_i, denominator l_i and unnormalised output acc.
    # K_BY_ROWS loads K as the [N, D] rows it is stored in and transposes it for the dot;
    # otherwise K is gathered straight into [D, N]. On an H200 the first is faster for prefill
    # tiles, the second for decode's 16-row tiles. V_TOKEN_MAJOR: v_cache is token_major_v's.
    n = start + tl.arange(0, BLOCK_N)
    masked: tl.constexpr = MASK != _MASK_NONE
    k, v = _load_tile(k_cache_ptr, v_cache_ptr, table, start, kv_end, kv_head, stride_kb,
                      stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N, HEAD_DIM,
                      BLOCK_SIZE, masked, K_BY_ROWS, V_TOKEN_MAJOR, D_REAL)
    return _attend_kv(q, m_i, l_i, acc, k, v, n, kv_end, q_pos, scale_log2, MASK, K_BY_ROWS,
                      q_lo, SLIDING)


# Integer arguments that change from step to step are no specialisation keys: Triton would
# compile a kernel again (1.5-2.7 s on the H200) whenever one turned divisible by 16 or 1, inside
# a running batch (a block table's width; whether decode splits contexts).
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, out_index_ptr, block_tables_ptr,
                    seq_lens_ptr, query_start_loc_ptr, scale_log2, v_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    window,
                    GROUP: tl.constexpr, TOKENS_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    DOT_FP16: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr = False,
                    SLIDING: tl.constexpr = False, D_REAL: tl.constexpr = 0,
                    OUT_INDEX: tl.constexpr = False):
    # Program = (query tile, kv head, sequence). HEAD_DIM: a power of two, the head's D_REAL
    # dims padded up to it (0: HEAD_DIM itself). The tile's BLOCK_M rows are
    # TOKENS_PER_TILE query tokens x the GROUP query heads sharing this kv head, so each K/V
    # tile loaded through the block table serves the whole GQA group in one tl.dot.
    # Tiles run last-first: late tiles see the most keys, and starting them first evens out
    # the tail of the grid. OUT_INDEX: each token's output columns stored where out_index_ptr
    # puts them (_out_cols; paged_attention's out_index).
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = tile * TOKENS_PER_TILE
    # a sequence of one query (a decode row of a mixed batch) is the decode kernel's
    if (first_tok >= q_len) | (q_len == 1):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len          # new tokens are the last q_len positions of the context

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=_and_dims(row_valid[:, None], d[None, :], D_REAL, HEAD_DIM), other=0.0)
    if DOT_FP16:
        q = _to_fp16(q)
    q_pos = num_cached + tok              # [BLOCK_M] position in the context (causal limit)
    # Keys below the tile's first query position are visible to every row: no mask there.
    # Keys from the tile's last query position on are hidden from every valid row: stop there.
    kv_full = (num_cached + first_tok) // BLOCK_N * BLOCK_N
    kv_end = num_cached + tl.minimum(first_tok + TOKENS_PER_TILE, q_len)
    table = block_tables_ptr + seq * stride_bt
    # SLIDING: a row sees keys from q_pos - window + 1 on; none below the tile's first row's
    kv_lo = 0
    q_lo = q_pos
    if SLIDING:
        q_lo = q_pos - window + 1
        kv_lo = tl.maximum(num_cached + first_tok - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(kv_lo, kv_full, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, kv_end, q_pos, table, kv_head,
                                     scale_log2, k_cache_ptr, v_cache_ptr, stride_kb, stride_ks,
                                     stride_kh, stride_vb, stride_vs, stride_vh,
                                     BLOCK_N, HEAD_DIM, BLOCK_SIZE, _MASK_NONE, True,
                                     V_TOKEN_MAJOR, q_lo, SLIDING, D_REAL)
    for start in range(kv_full, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, kv_end, q_pos, table, kv_head,
                                     scale_log2, k_cache_ptr, v_cache_ptr, stride_kb, stride_ks,
                                     stride_kh, stride_vb, stride_vs, stride_vh,
                                     BLOCK_N, HEAD_DIM, BLOCK_SIZE, _MASK_CAUSAL, True,
                                     V_TOKEN_MAJOR, q_lo, SLIDING, D_REAL)

    out = acc / l_i[:, None] * v_scale      # an fp8 cache's V scale (attention is linear in V)
    store = _and_dims(row_valid[:, None], d[None, :], D_REAL, HEAD_DIM)
    cols = _out_cols(out_index_ptr, head[:, None], d[None, :], store, stride_oh, D_REAL,
                     HEAD_DIM, OUT_INDEX)
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + cols,
             out.to(out_ptr.dtype.element_ty), mask=store)


@triton.jit
def _window_base(lo, BLOCK_N: tl.constexpr):
    # where decode's partitions start: the first tile holding key lo
    return lo // BLOCK_N * BLOCK_N


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, out_index_ptr, part_out_ptr,
                   part_lse_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale_log2,
                   v_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                   partition_size, num_splits, window,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   K_BY_ROWS: tl.constexpr, DOT_FP16: tl.constexpr, PDL: tl.constexpr = False,
                   PRELOAD: tl.constexpr = False, V_TOKEN_MAJOR: tl.constexpr = False,
                   SLIDING: tl.constexpr = False, D_REAL: tl.constexpr = 0,
                   OUT_INDEX: tl.constexpr = False):
    # Program = (sequence, kv head, context partition). All GROUP query heads of the kv head
    # ride in one [GROUP_PAD, D] tile (padded to the 16 rows tl.dot needs), so K/V is read once
    # per group. With num_splits > 1 each program writes its partition's normalised output and
    # log-sum-exp, and _decode_reduce_kernel merges them. partition_size and num_splits follow the
    # batch's longest context, so they are runtime arguments: a constexpr would recompile as
    # contexts grow.
    # PRELOAD (few programs, small tiles: decode_preload): read before the PDL wait what no
    # earlier kernel of this step writes: the batch's metadata (host copies), the block table and
    # the first tile's keys older than this step's (earlier steps wrote them; the newest, which
    # the kernel right before writes, is read after the wait). Every program waits, those with
    # nothing to do too, before it returns.
    # SLIDING: the query sees the last `window` keys only; the partitions start at the tile
    # holding the first of them (_window_base), keys below it in that tile masked.
    # OUT_INDEX: the output's columns stored where out_index_ptr puts them (_out_cols), by this
    # kernel when num_splits == 1, else by _decode_reduce_kernel (the partials as they are).
    if not PRELOAD:
        pdl_wait(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    part_start = _window_base(lo, BLOCK_N) + split * partition_size
    part_end = tl.minimum(part_start + partition_size, seq_len)
    table = block_tables_ptr + seq * stride_bt
    if PRELOAD:
        active = (q_len == 1) & (part_start < seq_len)      # as the return below
        n = part_start + tl.arange(0, BLOCK_N)
        # the first tile's keys (none where the program has nothing to do)
        first_end = tl.where(active, tl.minimum(part_start + BLOCK_N, part_end), part_start)
        row_k, row_v = _kv_rows(table, n, n < first_end, kv_head, stride_kb, stride_ks,
                                stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, True)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, row_k, row_v,
                        n < tl.minimum(first_end, seq_len - 1), HEAD_DIM, True, K_BY_ROWS,
                        not V_TOKEN_MAJOR, D_REAL)
        if V_TOKEN_MAJOR:     # kept [D, NB, SEG] until this step's key is in
            v_ptrs, n3, d3 = _v_token_major_ptrs(v_cache_ptr, table, part_start, first_end,
                                                 kv_head, stride_vb, stride_vh, BLOCK_N,
                                                 HEAD_DIM, BLOCK_SIZE, True)
            v3 = tl.load(v_ptrs, mask=_and_dims(n3 < tl.minimum(first_end, seq_len - 1), d3,
                                                D_REAL, HEAD_DIM), other=0.0)
        pdl_wait(PDL)
    # only sequences of one query: padding rows have none, a mixed batch's prompt chunks more
    if (q_len != 1) | (part_start >= seq_len):
        return
    if PRELOAD:
        if seq_len - 1 < first_end:     # the first tile holds this step's key
            newest = n == seq_len - 1
            k_new, v_new = _load_kv(k_cache_ptr, v_cache_ptr, row_k, row_v, newest, HEAD_DIM,
                                    True, K_BY_ROWS, not V_TOKEN_MAJOR, D_REAL)
            if K_BY_ROWS:
                k = tl.where(newest[:, None], k_new, k)
            else:
                k = tl.where(newest[None, :], k_new, k)
            if V_TOKEN_MAJOR:
                v3 = tl.where(n3 == seq_len - 1,
                              tl.load(v_ptrs, mask=_and_dims(n3 == seq_len - 1, d3, D_REAL,
                                                             HEAD_DIM), other=0.0), v3)
            else:
                v = tl.where(newest[:, None], v_new, v)
        if V_TOKEN_MAJOR:
            v = _v_rows(v3, BLOCK_N, HEAD_DIM)

    g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + g
    g_valid = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_start * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=_and_dims(g_valid[:, None], d[None, :], D_REAL, HEAD_DIM), other=0.0)
    if DOT_FP16:
        q = _to_fp16(q)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    q_lo = tl.zeros([GROUP_PAD], tl.int32) + lo
    loop_start = part_start
    if PRELOAD:
        m_i, l_i, acc = _attend_kv(q, m_i, l_i, acc, k, v, n, first_end, q_start, scale_log2,
                                   _MASK_END, K_BY_ROWS, q_lo, SLIDING)
        loop_start = part_start + BLOCK_N
    full_end = part_start + (part_end - part_start) // BLOCK_N * BLOCK_N
    for start in range(loop_start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, part_end, q_start, table, kv_head,
                                     scale_log2, k_cache_ptr, v_cache_ptr, stride_kb, stride_ks,
                                     stride_kh, stride_vb, stride_vs, stride_vh,
                                     BLOCK_N, HEAD_DIM, BLOCK_SIZE, _MASK_NONE, K_BY_ROWS,
                                     V_TOKEN_MAJOR, q_lo, SLIDING, D_REAL)
    if (full_end >= loop_start) & (full_end < part_end):    # the last, partial tile
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, full_end, part_end, q_start, table, kv_head,
                                     scale_log2, k_cache_ptr, v_cache_ptr, stride_kb, stride_ks,
                                     stride_kh, stride_vb, stride_vs, stride_vh,
                                     BLOCK_N, HEAD_DIM, BLOCK_SIZE, _MASK_END, K_BY_ROWS,
                                     V_TOKEN_MAJOR, q_lo, SLIDING, D_REAL)

    out = acc / l_i[:, None] * v_scale      # an fp8 cache's V scale (attention is linear in V)
    if num_splits == 1:
        store = _and_dims(g_valid[:, None], d[None, :], D_REAL, HEAD_DIM)
        cols = _out_cols(out_index_ptr, head[:, None], d[None, :], store, stride_oh, D_REAL,
                         HEAD_DIM, OUT_INDEX)
        tl.store(out_ptr + q_start * stride_ot + cols, out.to(out_ptr.dtype.element_ty),
                 mask=store)
    else:
        part = (seq * NUM_HEADS + head) * num_splits + split                             # [G]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=g_valid[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g_valid)


@triton.jit
def _decode_reduce_kernel(out_ptr, out_index_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr,
                          query_start_loc_ptr, stride_ot, stride_oh,
                          partition_size, num_splits, window, NUM_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          PDL: tl.constexpr = False, SLIDING: tl.constexpr = False,
                          BLOCK_N: tl.constexpr = 1, D_REAL: tl.constexpr = 0,
                          OUT_INDEX: tl.constexpr = False):
    # Program = (sequence, query head): weight each partition by exp2(lse - max lse).
    # OUT_INDEX: the output's columns stored where out_index_ptr puts them (_out_cols).
    # Partitions past the sequence's end were never written, so they are masked, not read.
    # The batch's metadata (host copies) is read before the PDL wait.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    pdl_wait(PDL)
    if q_len != 1:      # as _decode_kernel: its partitions were never written
        return
    s = tl.arange(0, SPLITS_PAD)
    base = 0
    if SLIDING:     # as _decode_kernel's partitions (BLOCK_N: its tiles')
        base = _window_base(tl.maximum(seq_len - window, 0), BLOCK_N)
    s_valid = s < tl.cdiv(seq_len - base, partition_size)
    part = (seq * NUM_HEADS + head) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_valid, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    d = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_valid[:, None],
                    other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    store = _and_dims(d >= 0, d, D_REAL, HEAD_DIM)
    cols = _out_cols(out_index_ptr, head, d, store, stride_oh, D_REAL, HEAD_DIM, OUT_INDEX)
    tl.store(out_ptr + q_start * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=store)


@dataclass(frozen=True)
class DecodeSplit:
    """How decode divides each context: num_splits partitions of partition_size tokens."""
    partition_size: int
    num_splits: int


def _env_int(name: str, default: int, low: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    if not value.isdigit() or int(value) < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    return int(value)


def decode_env() -> int | None:
    """KVFLEET_DECODE_MIN_PARTITION: the shortest partition, in tokens, or None (the default,
    MIN_PARTITION_TOKENS's)."""
    value = _env_int("KVFLEET_DECODE_MIN_PARTITION", 0, 16)
    return value or None


# Partitions shorter than this cost more in the reduce launch than they win in parallelism
# (KVFLEET_DECODE_MIN_PARTITION overrides it): 32 tokens. Batch-1 decode of the 8B shape at
# 128-384 tokens of context on the H200 (a batch of one sequence's 8 kv heads fills 8 SMs unless
# its context is cut finer): 215.0 tok/s at 256, 223.1 at 64 (same call); with the first tile
# read before the PDL wait, 243.1 at 64 and 245.4 at 32 (same call), GPTQ 4-bit 454.8 and 462.2.
# A TP=2 rank's 4 KV heads: 386.2 at 64, 391.2 at 32, 373.3 at 128 (docs/PERFORMANCE.md).
# (Merging the partitions inside the decode launch, by the last to finish, measured slower at
# batch 1: 235.9 vs 241.2 tok/s, 215.0 vs 216.0; removed.)
MIN_PARTITION_TOKENS = decode_env() or 32
# KVFLEET_DECODE_PRELOAD=0: the decode kernel reads nothing before its PDL wait (an A/B knob)
_PRELOAD = on_off("KVFLEET_DECODE_PRELOAD", os.environ.get("KVFLEET_DECODE_PRELOAD", ""))
# Decode preloads its first tile (before the PDL wait) for at most this many (sequence, kv
# head) pairs and tiles of at most this many bytes of K (as many of V): batch 1 of the 8B shape
# (8 pairs, 32 x 128 bf16 keys) went 239.7 -> 243.0 tok/s, GPTQ 444.7 -> 454.8 (H200, same call;
# docs/PERFORMANCE.md). Held in registers across the wait, a larger tile costs more than it
# hides: 128 fp8 keys at 256 x 1500 ran 0.24 -> 0.33 ms.
PRELOAD_MAX_PAIRS = 64
PRELOAD_MAX_TILE_BYTES = 8192


def decode_preload(num_pairs: int, block_n: int, head_dim: int, cache_bytes: int) -> bool:
    """Whether decode reads its first tile before its PDL wait (the kernel's PRELOAD)."""
    return (_PRELOAD and num_pairs <= PRELOAD_MAX_PAIRS
            and block_n * head_dim * cache_bytes <= PRELOAD_MAX_TILE_BYTES)


# Programs to aim for per SM: enough in flight to keep HBM busy while each one waits on loads.
# (H200 sweep: 2 beat 4 by 15-20% at 16 x 4096 and 32 x 2048, and lost 6% at 4 x 8192.)
_PROGRAMS_PER_SM = 2
# The interpreter has no SMs; a small stand-in keeps small test shapes on the split path.
_CPU_SM_COUNT = 8


def decode_split(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                 device: torch.device) -> DecodeSplit:
    """Split the context only when (seqs x kv heads) programs would leave SMs idle."""
    sm_count = (torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda" else _CPU_SM_COUNT)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * sm_count, max(num_seqs * num_kv_heads, 1))
    num_splits = max(1, min(wanted, triton.cdiv(max_seq_len, MIN_PARTITION_TOKENS)))
    partition_size = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    return DecodeSplit(partition_size=partition_size, num_splits=triton.cdiv(max_seq_len, partition_size))


def decode_launch(num_seqs: int, num_kv_heads: int, max_seq_len: int, window: int, on_gpu: bool,
                fp8_cache: bool, device: torch.device) -> tuple[TileConfig, DecodeSplit]:
    """Decode's tiles and partitions for a batch (paged_attention's; the warm-up's keys). Under
    a sliding window decode reads the window's keys from the tile holding its first: tiles
    chosen for the window's length, partitions over at most window + block_n - 1 keys."""
    read = min(max_seq_len, window) if window else max_seq_len
    cfg = decode_config(on_gpu, fp8_cache, read, num_seqs * num_kv_heads)
    span = min(max_seq_len, window + cfg.block_n - 1) if window else max_seq_len
    return cfg, decode_split(num_seqs, num_kv_heads, span, cfg.block_n, device)


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of an attention kernel: BLOCK_M query rows x BLOCK_N keys per step.

    k_by_rows (decode; prefill always does): load K tiles as their stored [N, D] rows and
    transpose in registers, instead of gathering [D, N]. dot_fp16 (a bf16 query over an fp8
    cache only): the dots run in fp16 (the query converted once) instead of bf16.
    """
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    k_by_rows: bool = False
    dot_fp16: bool = False


def decode_many_programs() -> tuple[int, int]:
    """(sequence, kv head) programs from which decode runs one warp a program (decode_config),
    over an fp8 cache and over a bf16 one: 1024 (128 sequences of 8 kv heads) and 4096;
    KVFLEET_DECODE_MANY_PROGRAMS sets both (an A/B knob)."""
    value = _env_int("KVFLEET_DECODE_MANY_PROGRAMS", 0, 1)
    return (value, value) if value else (1024, 4096)


_MANY_PROGRAMS_FP8, _MANY_PROGRAMS = decode_many_programs()


def decode_config(on_gpu: bool, fp8_cache: bool = False, max_seq_len: int = 4096,
                  num_programs: int = 0) -> TileConfig:
    """Decode's rows are the GQA group, padded up to block_m (tl.dot needs >= 16 rows).

    GPU choices from the H200 sweeps (tests/kernels/bench_kernels.py [--kv-dtype fp8] --sweep
    decode|decode-short, bf16 queries, Llama-3.1-8B heads, blocks of 16; docs/PERFORMANCE.md):
    two warps and two stages (1024 x 160 tokens: 0.219 -> 0.180 ms against four warps, three
    stages); 32-key tiles up to 2048 tokens of context, 64 beyond. An fp8 cache reads half the
    bytes per key: 128-key tiles with fp16 dots (256 x 4096: 1.056 -> 0.618 ms, 1.7x). With
    num_programs (sequences x kv heads) >= 4096, ~31 an SM, one warp a program keeps more of
    them resident: 32-key tiles, fp8 1024 x 160 0.180 -> 0.126 ms, 880 x 1500 0.920 -> 0.813;
    bf16 up to 1024 tokens 1024 x 160 0.182 -> 0.177, 1024 x 256 0.276 -> 0.269 (at 880 x
    1500 two warps stay ahead). The one-warp fp8 tiles run a 5-stage pipeline (`--sweep
    decode-stages`, 2-5 stages: 1024 x 160 0.124 -> 0.119 ms, 1024 x 256 0.179 -> 0.167, 880 x
    1500 0.784 -> 0.783; bf16 gained nothing from stages past 2). Over an fp8 cache they won
    from 1024 programs (`--sweep decode-mid`, against two warps on 64/128-key tiles: 500 x 1016
    0.342 -> 0.275 ms, 500 x 1500 0.511 -> 0.392, 114 x 1500 0.130 -> 0.102, 128 x 2048 0.150
    -> 0.143, 256 x 160 0.053 -> 0.040).
    """
    if not on_gpu:   # the interpreter: small steps, no pipelining
        return TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, dot_fp16=fp8_cache)
    many = num_programs >= (_MANY_PROGRAMS_FP8 if fp8_cache else _MANY_PROGRAMS)
    if fp8_cache:
        if many:
            return TileConfig(block_m=16, block_n=32, num_warps=1, num_stages=5, dot_fp16=True)
        return TileConfig(block_m=16, block_n=128 if max_seq_len > 1024 else 64, num_warps=2,
                          num_stages=2, dot_fp16=True)
    return TileConfig(block_m=16, block_n=32 if max_seq_len <= 2048 else 64,
                      num_warps=1 if many and max_seq_len <= 1024 else 2, num_stages=2)


def prefill_config(group: int, block_size: int, on_gpu: bool, fp8_cache: bool = False) -> TileConfig:
    """block_m is at least the GQA group so that one tile holds whole groups.

    GPU choices are the fastest of a sweep on an H200 (bf16, Llama-3.1-8B heads, prompts of
    512..8192 tokens; tests/kernels/bench_kernels.py --sweep): 128x32 tiles for blocks of 16
    and 32, 64x64 for blocks of 64 (where 128-row tiles ran ~10% slower).
    """
    min_rows = triton.next_power_of_2(group)
    if not on_gpu:
        return TileConfig(block_m=max(32, min_rows), block_n=16, num_warps=4, num_stages=1,
                          k_by_rows=True, dot_fp16=fp8_cache)
    if block_size >= 64:
        return TileConfig(block_m=max(64, min_rows), block_n=64, num_warps=4, num_stages=2,
                          k_by_rows=True, dot_fp16=fp8_cache)
    return TileConfig(block_m=max(128, min_rows), block_n=32, num_warps=4, num_stages=3,
                      k_by_rows=True, dot_fp16=fp8_cache)


def _require_unit_last_stride(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1); "
                             f"got strides {tuple(t.stride())}")


def check_v_cache_strides(v_cache: torch.Tensor) -> None:
    """v_cache ([num_blocks, block_size, num_kv_heads, head_dim]) has a contiguous head_dim, or is
    token_major_v's view (keys adjacent, each block's [kv_heads, head_dim, block_size] packed)."""
    num_blocks, block_size, num_kv_heads, head_dim = v_cache.shape
    if v_cache.stride(3) == 1 or (is_token_major(v_cache) and v_cache.stride(3) == block_size
                                  and v_cache.stride(2) == head_dim * block_size):
        return
    raise ValueError("v_cache must have a contiguous last dimension or be token_major_v's view; "
                     f"got shape {tuple(v_cache.shape)}, strides {tuple(v_cache.stride())}")


def _check_attention_args(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if not 16 <= head_dim <= 256 or head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 in 16..256 (e.g. 64, 96, 128); "
                         f"got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                         f"{head_dim}]; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _require_unit_last_stride(query=query, k_cache=k_cache)
    check_v_cache_strides(v_cache)


def _check_out_index(out_index: torch.Tensor, size: int, device: torch.device) -> None:
    if (out_index.dim() != 1 or out_index.dtype != torch.int32 or out_index.numel() != size
            or out_index.device != device):
        raise ValueError(f"out_index must be a 1-D int32 tensor of num_heads * head_dim = {size} "
                         f"entries on {device} (a permutation of the output's columns); got "
                         f"{out_index.dtype} of shape {tuple(out_index.shape)} on "
                         f"{out_index.device}")


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    *, out: torch.Tensor | None = None,
                    plan_num_seqs: int | None = None,
                    min_query_len: int | None = None, window: int = 0,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    out_index: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `paged_attention_ref` (same layout and result; v_cache may be
    token_major_v's view).

    Sequences of one query (decode rows) take the split-KV decode kernel, longer ones the
    prefill kernel; a mixed batch launches both (each skips the other's sequences), a batch
    whose min_query_len is > 1 the prefill kernel alone. max_query_len / max_seq_len are
    computed from the tensors when None (a host sync); pass them to keep a step sync-free.
    `out` is an optional preallocated [num_tokens, num_heads, head_dim] buffer (static buffers
    under CUDA graphs).
    Decode cuts contexts into partitions planned for plan_num_seqs sequences (default: the
    batch's own count) and max_seq_len: a result depends on that partitioning (the order of its
    fp32 sums), so two calls planned alike give the same bits whatever their batch sizes.
    window > 0: sliding-window attention (the reference's); decode then reads and plans for the
    last `window` keys of each context only.
    out_index (int32 [num_heads * head_dim] on query's device, a permutation: argsort(perm)):
    each token's output column h * head_dim + d is stored at column out_index[h * head_dim + d]
    of `out` viewed as [num_tokens, num_heads * head_dim] (out's heads and dims then packed:
    strides (., head_dim, 1)), so that view comes out as the plain result's [:, perm] (an
    act-order GPTQ o_proj's input order: it gathers nothing); the values are unchanged.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: full attention); got {window}")
    _check_attention_args(query, k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    if out_index is not None:
        _check_out_index(out_index, num_heads * head_dim, query.device)
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    # tiles span a power of two of dims (96 -> 128: Phi-3-mini's heads), the pad masked
    dims = triton.next_power_of_2(head_dim)
    if out is None:
        out = torch.empty_like(query)
    if out_index is not None and (out.stride(1) != head_dim or out.stride(2) != 1):
        raise ValueError(f"with out_index, out's heads and dims must be packed (strides "
                         f"(., {head_dim}, 1)); got strides {tuple(out.stride())}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    # without an index `out` stands in for its pointer (never read)
    index_arg = out if out_index is None else out_index
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    # an fp8 cache's K scale folds into the softmax scale, its V scale into the output
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    scale_log2 = scale * k_scale * _LOG2E
    on_gpu = query.is_cuda
    fp8_cache = k_cache.dtype == FP8_KV_DTYPE
    # fp16 dots pay off for a bf16 query only (an fp32 one would lose precision)
    bf16_over_fp8 = fp8_cache and query.dtype == torch.bfloat16
    v_token_major = is_token_major(v_cache)

    # Sequences of one query (decode rows) run the split-KV decode kernel, also in a mixed
    # batch: there the prefill kernel would spend a whole BLOCK_M-row tile on each one's GQA
    # group over its whole context (a mixed step of 128 prompts and ~900 decode rows: 16 ms of
    # attention). Each kernel skips the other's sequences, so no host sync splits the batch.
    if max_query_len > 1:
        cfg = prefill_config(group, block_size, on_gpu, fp8_cache)
        tokens_per_tile = cfg.block_m // group
        grid = (triton.cdiv(max_query_len, tokens_per_tile), num_kv_heads, num_seqs)
        _prefill_kernel[grid](
            query, k_cache, v_cache, out, index_arg, block_tables, seq_lens, query_start_loc,
            scale_log2, v_scale, *strides, window, GROUP=group, TOKENS_PER_TILE=tokens_per_tile,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=dims, BLOCK_SIZE=block_size,
            DOT_FP16=cfg.dot_fp16 and bf16_over_fp8, V_TOKEN_MAJOR=v_token_major,
            SLIDING=window > 0, D_REAL=head_dim, OUT_INDEX=out_index is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if min_query_len is not None and min_query_len > 1:
            return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    cfg, split = decode_launch(plan_num_seqs or num_seqs, num_kv_heads, max_seq_len, window,
                               on_gpu, fp8_cache, query.device)
    if split.num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, split.num_splits, dims,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, split.num_splits,
                               dtype=torch.float32, device=query.device)
    else:   # the kernel writes `out` directly; these pointers are never touched
        part_out = part_lse = out
    _decode_kernel[(num_seqs, num_kv_heads, split.num_splits)](
        query, k_cache, v_cache, out, index_arg, part_out, part_lse, block_tables, seq_lens,
        query_start_loc, scale_log2, v_scale, *strides, split.partition_size, split.num_splits, window,
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(cfg.block_m, triton.next_power_of_2(group)),
        BLOCK_N=cfg.block_n, HEAD_DIM=dims, BLOCK_SIZE=block_size, D_REAL=head_dim,
        K_BY_ROWS=cfg.k_by_rows, DOT_FP16=cfg.dot_fp16 and bf16_over_fp8,
        V_TOKEN_MAJOR=v_token_major, SLIDING=window > 0, OUT_INDEX=out_index is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        PRELOAD=decode_preload((plan_num_seqs or num_seqs) * num_kv_heads, cfg.block_n, dims,
                               k_cache.element_size()),
        **pdl_args(query.device),
    )
    if split.num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, index_arg, part_out, part_lse, seq_lens, query_start_loc, out.stride(0),
            out.stride(1), split.partition_size, split.num_splits, window, NUM_HEADS=num_heads,
            HEAD_DIM=dims, D_REAL=head_dim, OUT_INDEX=out_index is not None,
            SPLITS_PAD=triton.next_power_of_2(split.num_splits), SLIDING=window > 0,
            BLOCK_N=cfg.block_n, **pdl_args(query.device),
        )
    return out
