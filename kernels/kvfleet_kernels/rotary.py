"""Rotary position embedding of query and key: torch reference and Triton twin.

cos_sin_cache: [max_position, rot_dim] fp32, cos in the first half of a row, sin in the second.
is_neox=True pairs dim i with dim i + rot_dim/2 (HF rotate_half); False pairs 2i with 2i+1
(GPT-J). When rot_dim < head_size only the first rot_dim dims of each head rotate (partial
rotary); the rest pass through. Both functions return new tensors and leave the inputs alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.paged_attention import (
    check_kv_scales,
    check_v_cache_strides,
    reshape_and_cache_ref,
    to_cache_dtype,
)
from kvfleet_kernels.pdl import pdl_args, pdl_wait


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int,
                is_neox: bool) -> torch.Tensor:
    # x: [T, H * D]; cos, sin: [T, rot_dim / 2]
    h = x.reshape(x.shape[0], -1, head_size).float()
    rot_dim = 2 * cos.shape[-1]
    rot, rest = h[..., :rot_dim], h[..., rot_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype).reshape(x.shape)


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int64; query: [T, Hq * D]; key: [T, Hkv * D] -> rotated (query, key), fp32 math."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    return (_rotate_ref(query, cos, sin, head_size, is_neox),
            _rotate_ref(key, cos, sin, head_size, is_neox))


@triton.jit
def _store_rounded(dst, val, mask, src, inv_scale=1.0):
    # Round to the input's dtype first (what the unfused rotary returns), then to the
    # destination's as reshape_and_cache does (an e4m3 cache: times 1 / its scale, saturated at
    # +-FP8_E4M3_MAX): a cache holds exactly what rotary + reshape_and_cache would write.
    tl.store(dst, to_cache_dtype(val.to(src.dtype.element_ty), dst.dtype.element_ty, inv_scale),
             mask=mask)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_x, stride_o, stride_oh, cos, sin, i, i_valid,
                  NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, ROT_DIM: tl.constexpr,
                  IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  inv_scale=1.0):
    # All heads of one token: rotate pairs (first[i], second[i]), copy dims >= ROT_DIM.
    # Source heads are HEAD_SIZE apart; destination heads stride_oh apart.
    h = tl.arange(0, BLOCK_H)
    h_valid = h < NUM_HEADS
    src = x_ptr + token * stride_x + h[:, None] * HEAD_SIZE
    dst = out_ptr + token * stride_o + h[:, None] * stride_oh
    if IS_NEOX:
        first = i
        second = i + ROT_DIM // 2
    else:
        first = 2 * i
        second = 2 * i + 1
    mask = h_valid[:, None] & i_valid[None, :]
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    _store_rounded(dst + first[None, :], x1 * cos - x2 * sin, mask, src, inv_scale)
    _store_rounded(dst + second[None, :], x2 * cos + x1 * sin, mask, src, inv_scale)
    if ROT_DIM < HEAD_SIZE:
        d = ROT_DIM + tl.arange(0, BLOCK_D)
        rest_mask = h_valid[:, None] & (d < HEAD_SIZE)[None, :]
        _store_rounded(dst + d[None, :], tl.load(src + d[None, :], mask=rest_mask), rest_mask, src,
                       inv_scale)


@triton.jit
def _cos_sin(positions_ptr, cos_sin_ptr, token, stride_cache, ROT_DIM: tl.constexpr,
             BLOCK_HALF: tl.constexpr):
    # this token's cos and sin rows ([1, BLOCK_HALF]) and the pair indices they serve
    pos = tl.load(positions_ptr + token)
    i = tl.arange(0, BLOCK_HALF)
    i_valid = i < ROT_DIM // 2
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + i, mask=i_valid, other=0.0)[None, :]
    sin = tl.load(row + ROT_DIM // 2 + i, mask=i_valid, other=0.0)[None, :]
    return cos, sin, i, i_valid


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_sin_ptr,
                   stride_q, stride_k, stride_qo, stride_ko, stride_cache,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
                   ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr,
                   BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    # One program per token; cos/sin are loaded once and serve query and key.
    token = tl.program_id(0)
    cos, sin, i, i_valid = _cos_sin(positions_ptr, cos_sin_ptr, token, stride_cache, ROT_DIM,
                                    BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q, stride_qo, HEAD_SIZE, cos, sin, i, i_valid,
                  NUM_Q_HEADS, HEAD_SIZE, ROT_DIM, IS_NEOX, BLOCK_HQ, BLOCK_REST)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_k, stride_ko, HEAD_SIZE, cos, sin, i, i_valid,
                  NUM_KV_HEADS, HEAD_SIZE, ROT_DIM, IS_NEOX, BLOCK_HK, BLOCK_REST)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `rotary_embedding_ref`."""
    num_tokens = positions.shape[0]
    rot_dim = cos_sin_cache.shape[1]
    for name, t in (("query", query), ("key", key)):
        if t.shape[0] != num_tokens or t.shape[1] % head_size:
            raise ValueError(f"{name} must be [{num_tokens}, num_heads * {head_size}]; got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension; got strides {tuple(t.stride())}")
    if rot_dim % 2 or not 0 < rot_dim <= head_size:
        raise ValueError(f"cos_sin_cache's rot_dim must be even and in (0, head_size={head_size}]; got {rot_dim}")
    if cos_sin_cache.stride(-1) != 1:
        raise ValueError("cos_sin_cache must have a contiguous last dimension")
    q_out, k_out = torch.empty_like(query), torch.empty_like(key)
    if num_tokens:
        num_q_heads, num_kv_heads = query.shape[1] // head_size, key.shape[1] // head_size
        _rotary_kernel[(num_tokens,)](
            positions, query, key, q_out, k_out, cos_sin_cache,
            query.stride(0), key.stride(0), q_out.stride(0), k_out.stride(0), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, ROT_DIM=rot_dim,
            IS_NEOX=is_neox, BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(rot_dim // 2),
            BLOCK_REST=triton.next_power_of_2(max(head_size - rot_dim, 1)),
        )
    return q_out, k_out


def rotary_and_cache_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
                         is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> torch.Tensor:
    """rotary_embedding_ref, then reshape_and_cache_ref of the rotated key and the value;
    returns the rotated query [T, Hq * D]."""
    q, k = rotary_embedding_ref(positions, query, key, head_size, cos_sin_cache, is_neox)
    num_tokens = positions.shape[0]
    reshape_and_cache_ref(k.view(num_tokens, -1, head_size), value.reshape(num_tokens, -1, head_size),
                          k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


@triton.jit
def _rotary_and_cache_kernel(positions_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                             slot_mapping_ptr, cos_sin_ptr, k_inv_scale, v_inv_scale,
                             stride_q, stride_k, stride_v, stride_qo, stride_cache,
                             stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                             stride_vcd, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                             HEAD_SIZE: tl.constexpr, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr,
                             BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             BLOCK_REST: tl.constexpr, BLOCK_D: tl.constexpr,
                             PDL: tl.constexpr = False):
    # One program per token: rotate its query heads into q_out; rotate its key heads and copy
    # its value heads straight into the token's cache slot (slot -1: padding, query only).
    pdl_wait(PDL)
    token = tl.program_id(0)
    cos, sin, i, i_valid = _cos_sin(positions_ptr, cos_sin_ptr, token, stride_cache, ROT_DIM,
                                    BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q, stride_qo, HEAD_SIZE, cos, sin, i, i_valid,
                  NUM_Q_HEADS, HEAD_SIZE, ROT_DIM, IS_NEOX, BLOCK_HQ, BLOCK_REST)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
        _rotate_heads(k_ptr, k_dst, token, stride_k, 0, stride_kch, cos, sin, i, i_valid,
                      NUM_KV_HEADS, HEAD_SIZE, ROT_DIM, IS_NEOX, BLOCK_HK, BLOCK_REST, k_inv_scale)
        h = tl.arange(0, BLOCK_HK)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_SIZE)
        src = v_ptr + token * stride_v + h[:, None] * HEAD_SIZE + d[None, :]
        # stride_vcd: 1, or block_size for a token-major V cache (paged_attention.token_major_v)
        v_dst = (v_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch
                 + d[None, :] * stride_vcd)
        _store_rounded(v_dst, tl.load(src, mask=mask), mask, src, v_inv_scale)


def rotary_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
                     is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """Triton twin of `rotary_and_cache_ref`: one launch does the rotary of query and key and the
    KV-cache write (a decode step's three small per-layer kernels and a copy in one).

    query [T, Hq * D], key and value [T, Hkv * D] (views into a fused qkv output are fine: only
    the last dimension must be contiguous); caches [num_blocks, block_size, Hkv, D], v_cache
    with a contiguous last dimension or token_major_v's view.
    """
    num_tokens = positions.shape[0]
    rot_dim = cos_sin_cache.shape[1]
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.shape[0] != num_tokens or t.shape[1] % head_size:
            raise ValueError(f"{name} must be [{num_tokens}, num_heads * {head_size}]; got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension; got strides {tuple(t.stride())}")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have one shape; got {tuple(key.shape)} and {tuple(value.shape)}")
    num_kv_heads = key.shape[1] // head_size
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[2:] != (num_kv_heads, head_size):
            raise ValueError(f"{name} must be [num_blocks, block_size, {num_kv_heads}, {head_size}]; "
                             f"got {tuple(c.shape)}")
    if k_cache.stride(3) != 1:
        raise ValueError(f"k_cache must have a contiguous last dimension; got strides {tuple(k_cache.stride())}")
    check_v_cache_strides(v_cache)
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    if rot_dim % 2 or not 0 < rot_dim <= head_size:
        raise ValueError(f"cos_sin_cache's rot_dim must be even and in (0, head_size={head_size}]; got {rot_dim}")
    q_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens:
        num_q_heads = query.shape[1] // head_size
        _rotary_and_cache_kernel[(num_tokens,)](
            positions, query, key, value, q_out, k_cache, v_cache, slot_mapping, cos_sin_cache,
            1.0 / k_scale, 1.0 / v_scale,
            query.stride(0), key.stride(0), value.stride(0), q_out.stride(0), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, ROT_DIM=rot_dim,
            IS_NEOX=is_neox, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(rot_dim // 2),
            BLOCK_REST=triton.next_power_of_2(max(head_size - rot_dim, 1)),
            BLOCK_D=triton.next_power_of_2(head_size), **pdl_args(query.device),
        )
    return q_out
