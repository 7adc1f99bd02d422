"""Weight-only int4/int8 GEMM with the dequantization fused (W4A16), and its fp32 reference.

Layout (GPTQ's, which AWQ checkpoints are repacked into at load):
  qweight: [K // (32 // bits), N] int32; word [i, n] holds rows i*P .. i*P+P-1 (P = 32 // bits)
           of column n, row i*P + j at bits [j*bits, (j+1)*bits)
  scales:  [G, N] fp16/bf16/fp32, zeros: [G, N] same dtype (integer-valued zero points)
  row k belongs to group k // group_size (rows sorted by group at load when act-order
  shuffled them), so w[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n].
out[M, N] = x[M, K] @ w: each program dequantizes a [BLOCK_K, BLOCK_N] tile in registers
and feeds it to tl.dot; HBM traffic for the weight stays at bits/8 bytes per element.
Decode (M small) splits K across programs so that one row of output still fills the GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.split_k import store_or_reduce, workspace


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bits: int, group_size: int) -> torch.Tensor:
    """The [K, N] fp32 weight of the layout above."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=qweight.device) * bits
    q = ((qweight.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1))
    q = q.reshape(-1, qweight.shape[1]).float()                      # [K, N]
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    return (q - zeros.float()[groups]) * scales.float()[groups]


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Dequantize, then matmul in fp32; the kernel is tested against this."""
    return (x.float() @ dequantize_ref(qweight, scales, zeros, bits, group_size)).to(x.dtype)


@triton.jit
def _small_int_to_float(q):
    # q in [0, 2**23) as fp32 without an int-to-float conversion (a quarter-rate instruction
    # on the GPU): OR it into the mantissa of 2**23 and subtract 2**23 (exact)
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, group_size,
                  stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                  stride_om, stride_on,
                  BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    PER_WORD: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # each word is loaded PER_WORD times in a row; those hit L1
        words = tl.load(qw_ptr + (offs_k // PER_WORD)[:, None] * stride_qk
                        + offs_n[None, :] * stride_qn,
                        mask=mask_k[:, None] & mask_n[None, :], other=0)
        q = (words >> ((offs_k % PER_WORD) * BITS)[:, None]) & ((1 << BITS) - 1)
        # the host picks BLOCK_K dividing group_size: one group per tile
        group = (tile * BLOCK_K) // group_size
        s = tl.load(s_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
        z = tl.load(z_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
        w = (_small_int_to_float(q) - z.to(tl.float32)[None, :]) * s.to(tl.float32)[None, :]
        acc += tl.dot(a, w.to(a.dtype))
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                       group_size, split_k,
                       stride_xm, stride_qk, stride_qn, stride_sg, stride_sn,
                       BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Decode: one program per (row of x, BLOCK_N columns, K slice); no tl.dot.

    Each int32 word is loaded once and unpacked in registers into its PER_WORD rows
    ([BLOCK_KW, PER_WORD, BLOCK_N]); with one group per tile the zero point comes out of
    the sum: sum_k x_k (q_kn - z_n) s_n = s_n (sum_k x_k q_kn - z_n sum_k x_k).

    With split_k > 1 the K slices meet inside this one launch (split_k.store_or_reduce): no
    zero-filled buffer, atomic accumulation or cast kernel around it (at batch 1 those were
    two extra launches per linear layer). out is contiguous [M, N].
    """
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    shifts = tl.arange(0, PER_WORD) * BITS
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(pid_k, tl.cdiv(K, BLOCK_K), split_k):
        rows = tile * BLOCK_KW + tl.arange(0, BLOCK_KW)
        mask_w = rows < K // PER_WORD
        words = tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=mask_w[:, None] & mask_n[None, :], other=0)       # [KW, BN]
        q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [KW, P, BN]
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        x3 = tl.reshape(x, (BLOCK_KW, PER_WORD))
        dot = tl.sum(tl.sum(x3[:, :, None] * _small_int_to_float(q), axis=1), axis=0)   # [BN]
        group = (tile * BLOCK_K) // group_size
        s = tl.load(s_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
        z = tl.load(z_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
        acc += s.to(tl.float32) * (dot - z.to(tl.float32) * tl.sum(x, axis=0))
    store_or_reduce(acc, out_ptr, out_ptr, part_ptr, count_ptr, m, M, N, offs_n, mask_n,
                    pid_n, pid_k, split_k, False)


# M up to this many rows runs the GEMV kernel. On the H200 (bench_w4a16.py, commit 06e9c73)
# M=4 re-reading the tiles per row was 3-10x slower than the tiled kernel at M=16: batch 1 only.
GEMV_MAX_M = 1
# GEMV programs (column tiles x K slices) to aim for per SM
GEMV_PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one launch; block_m == 1 selects the GEMV kernel (block_k rows per tile)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def pick_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> GemmConfig:
    """Tile sizes by M: decode (M <= 16) streams the weight, prefill reuses each tile over M."""
    if m <= GEMV_MAX_M:
        # one group per K tile; about two programs per SM (rows x column tiles x K slices),
        # in slices of >= 2 K-blocks each. The tiles are the H200 sweep's best (bench_w4a16.py
        # --sweep, commit 06e9c73: 22-59 us on the 8B shapes where 64-column tiles took 60-306)
        block_n, block_k = 128, 128
        while group_size < k and group_size % block_k:
            block_k //= 2
        tiles = m * triton.cdiv(n, block_n)
        k_tiles = triton.cdiv(k, block_k)
        split_k = max(1, min(k_tiles // 2,
                             triton.cdiv(GEMV_PROGRAMS_PER_SM * _num_sms(device), tiles)))
        return GemmConfig(1, block_n, block_k, split_k, 2, 3)
    if m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 64, 64, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    # one group per K tile: halve BLOCK_K until it divides the group (tl.dot needs >= 16)
    while group_size < k and group_size % block_k:
        block_k //= 2
    split_k = 1
    if m <= 64:
        # enough programs for every SM to stream its share of the weight
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        k_tiles = triton.cdiv(k, block_k)
        split_k = max(1, min(k_tiles // 4, triton.cdiv(2 * _num_sms(device), tiles)))
    return GemmConfig(block_m, block_n, block_k, split_k, warps, stages)


def kernel_supports(k: int, bits: int, group_size: int) -> bool:
    """Whether the kernel serves this shape; callers fall back to a dequantized weight otherwise."""
    return bits in (4, 8) and k % (32 // bits) == 0 and (group_size >= k or group_size % 16 == 0)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bits: int, group_size: int,
               config: GemmConfig | None = None) -> torch.Tensor:
    """x: [M, K] fp16/bf16 -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    if not kernel_supports(k, bits, group_size):
        raise ValueError(f"w4a16_gemm does not serve K={k}, bits={bits}, group_size={group_size}")
    if scales.stride() != zeros.stride():
        raise ValueError("scales and zeros must share strides")
    cfg = config or pick_config(m, n, k, group_size, x.device)
    per_word = 32 // bits
    if cfg.block_m == 1 and (cfg.block_k % per_word or (group_size < k and group_size % cfg.block_k)):
        raise ValueError(f"GEMV block_k {cfg.block_k} must be a multiple of {per_word} "
                         f"dividing group_size {group_size}")
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    if cfg.block_m == 1:
        x = x if x.stride(1) == 1 else x.contiguous()
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        part, count = workspace(x.device, m, n, cfg.split_k, grid[1])
        _w4a16_gemv_kernel[grid](
            x, qweight, scales, zeros, out, part, count, m, n, k, group_size, cfg.split_k,
            x.stride(0), qweight.stride(0), qweight.stride(1), scales.stride(0),
            scales.stride(1),
            BITS=bits, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_k // per_word,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    if cfg.split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, out, m, n, k, group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), out.stride(0), out.stride(1),
        BITS=bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if cfg.split_k == 1 else out.to(x.dtype)
