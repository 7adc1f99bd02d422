"""LoRA adapters' expand: each token's own adapter's B applied, added into the projection.

The engine keeps every adapter slot of a projection side by side (kvfleet_runtime.lora.layers):
`shrunk` [T, L * W] is x @ A^T over all L slots (one cuBLAS GEMM: W = pieces x rank columns a
slot), `b` [N, L * W] holds each slot's B in its W columns. For token t in slot s (-1: no
adapter)
  out[t] += shrunk[t, s*W:(s+1)*W] @ b[:, s*W:(s+1)*W]^T
computed in fp32 and rounded once into out (torch's addmm_ rounds the same way). One launch,
instead of the torch path's mask multiply and addmm over every slot's columns: a tile of tokens
computes only the slots its tokens hold, and writes nothing where none holds an adapter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.pdl import pdl_args, pdl_wait


def lora_expand_ref(out: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor,
                    token_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """out [T, N] plus, for each token, its slot's columns of shrunk [T, L * W] times that
    slot's columns of b [N, L * W] transposed; fp32 accumulation, one rounding. In place;
    returns out."""
    width = shrunk.shape[1] // num_slots
    update = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    slots = token_slots[: out.shape[0]].long()
    for s in range(num_slots):
        cols = slice(s * width, (s + 1) * width)
        mine = (slots == s).to(torch.float32)[:, None]
        update += (shrunk[:, cols].float() * mine) @ b[:, cols].float().t()
    rows = slots >= 0
    out[rows] = (out[rows].float() + update[rows]).to(out.dtype)
    return out


# T (the step's token count) unspecialised: one compiled variant for every step size
@triton.jit(do_not_specialize=["T"])
def _lora_expand_kernel(out_ptr, s_ptr, b_ptr, slots_ptr, T, N, stride_o, stride_s, stride_b,
                        WIDTH: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, IEEE: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    row_ok, col_ok, w_ok = rows < T, cols < N, w < WIDTH
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    if tl.max(slots, 0) >= 0:       # some token of the tile runs an adapter
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(NUM_SLOTS):
            mine = slots == s
            if tl.max(mine.to(tl.int32), 0) > 0:
                shrunk = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_s + s * WIDTH
                                 + w[None, :], mask=mine[:, None] & w_ok[None, :], other=0.0)
                bt = tl.load(b_ptr + cols[None, :].to(tl.int64) * stride_b + s * WIDTH
                             + w[:, None], mask=w_ok[:, None] & col_ok[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(shrunk, bt, input_precision="ieee")
                else:
                    acc += tl.dot(shrunk, bt)
        offs = rows[:, None].to(tl.int64) * stride_o + cols[None, :]
        where = (slots >= 0)[:, None] & col_ok[None, :]
        o = tl.load(out_ptr + offs, mask=where, other=0.0)
        tl.store(out_ptr + offs, (o.to(tl.float32) + acc).to(o.dtype), mask=where)


def lora_expand(out: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor,
                token_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """lora_expand_ref in one launch (token_slots int32, at least T entries; out's rows
    contiguous in their columns). In place; returns out."""
    T, N = out.shape
    width = shrunk.shape[1] // num_slots
    assert shrunk.shape == (T, num_slots * width) and b.shape == (N, num_slots * width)
    assert out.stride(1) == 1 and shrunk.stride(1) == 1 and b.stride(1) == 1
    assert token_slots.dtype == torch.int32 and token_slots.shape[0] >= T
    if T == 0:
        return out
    block_m = 16 if T <= 16 else 64
    block_n = 64 if T <= 16 else 128
    grid = (triton.cdiv(T, block_m), triton.cdiv(N, block_n))
    _lora_expand_kernel[grid](
        out, shrunk, b, token_slots, T, N, out.stride(0), shrunk.stride(0), b.stride(0),
        WIDTH=width, NUM_SLOTS=num_slots, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_W=max(16, triton.next_power_of_2(width)), IEEE=out.dtype == torch.float32,
        num_warps=4, **pdl_args(out.device))
    return out
