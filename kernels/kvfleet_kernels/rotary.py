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
def _rotate_heads(x_ptr, out_ptr, token, stride_x, stride_o, cos, sin, i, i_valid,
                  NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, ROT_DIM: tl.constexpr,
                  IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # All heads of one token: rotate pairs (first[i], second[i]), copy dims >= ROT_DIM.
    h = tl.arange(0, BLOCK_H)
    h_valid = h < NUM_HEADS
    src = x_ptr + token * stride_x + h[:, None] * HEAD_SIZE
    dst = out_ptr + token * stride_o + h[:, None] * HEAD_SIZE
    if IS_NEOX:
        first = i
        second = i + ROT_DIM // 2
    else:
        first = 2 * i
        second = 2 * i + 1
    mask = h_valid[:, None] & i_valid[None, :]
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first[None, :], (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    if ROT_DIM < HEAD_SIZE:
        d = ROT_DIM + tl.arange(0, BLOCK_D)
        rest_mask = h_valid[:, None] & (d < HEAD_SIZE)[None, :]
        tl.store(dst + d[None, :], tl.load(src + d[None, :], mask=rest_mask), mask=rest_mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_sin_ptr,
                   stride_q, stride_k, stride_qo, stride_ko, stride_cache,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
                   ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr,
                   BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    # One program per token; cos/sin are loaded once and serve query and key.
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    i = tl.arange(0, BLOCK_HALF)
    i_valid = i < ROT_DIM // 2
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + i, mask=i_valid, other=0.0)[None, :]
    sin = tl.load(row + ROT_DIM // 2 + i, mask=i_valid, other=0.0)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q, stride_qo, cos, sin, i, i_valid,
                  NUM_Q_HEADS, HEAD_SIZE, ROT_DIM, IS_NEOX, BLOCK_HQ, BLOCK_REST)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_k, stride_ko, cos, sin, i, i_valid,
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
