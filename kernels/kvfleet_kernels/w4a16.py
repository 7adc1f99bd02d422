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
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.env import on_off
from kvfleet_kernels.pdl import pdl_args, pdl_wait
from kvfleet_kernels.split_k import meet_gate_up, store_or_reduce, workspace


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
def _split_words(words, BITS: tl.constexpr):
    """[R, C] words -> the [R * 32 / BITS, C] values they pack (row r * 32 / BITS + j of a
    word's column at bits [j * BITS, (j + 1) * BITS))."""
    PER_WORD: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PER_WORD) * BITS
    return tl.reshape((words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1),
                      (words.shape[0] * PER_WORD, words.shape[1]))


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, group_size,
                  stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                  stride_om, stride_on,
                  BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, LB: tl.constexpr = 1):
    """Column n of qweight (and of scales, zeros) sits at (n // LB) * stride_qn + n % LB:
    the checkpoint's layout with LB = 1, the column-blocked one (`block_columns`) with LB its
    block and stride_qn (stride_sn) the block's stride. A tile's words are loaded once and
    split into their rows (loaded once per row they hold, through L1, the kernel ran 1.3-2x
    slower on the H200: docs/PERFORMANCE.md, eighteenth session)."""
    PER_WORD: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    col_q = (offs_n // LB) * stride_qn + offs_n % LB
    col_s = (offs_n // LB) * stride_sn + offs_n % LB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        offs_kw = tile * (BLOCK_K // PER_WORD) + tl.arange(0, BLOCK_K // PER_WORD)
        words = tl.load(qw_ptr + offs_kw[:, None] * stride_qk + col_q[None, :],
                        mask=(offs_kw < K // PER_WORD)[:, None] & mask_n[None, :], other=0)
        q = _split_words(words, BITS)
        # the host picks BLOCK_K dividing group_size: one group per tile
        group = (tile * BLOCK_K) // group_size
        s = tl.load(s_ptr + group * stride_sg + col_s, mask=mask_n, other=0.0)
        z = tl.load(z_ptr + group * stride_sg + col_s, mask=mask_n, other=0.0)
        w = (_small_int_to_float(q) - z.to(tl.float32)[None, :]) * s.to(tl.float32)[None, :]
        acc += tl.dot(a, w.to(a.dtype))
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask)


@triton.jit
def _dequantize_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size,
                       stride_qk, stride_qn, stride_sg, stride_sn,
                       BITS: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr,
                       LB: tl.constexpr = 1):
    """out [K, N] (contiguous, x's dtype) = (q - z) * s in fp32, rounded once: dequantize_ref's
    values. A program takes BLOCK_KW word rows (BLOCK_KW * 32 / BITS rows of K, one group)
    of BLOCK_N columns; columns addressed as in _w4a16_kernel (LB: the column-blocked
    layout's block)."""
    PER_WORD: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_KW * PER_WORD
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_kw = pid_k * BLOCK_KW + tl.arange(0, BLOCK_KW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    col_q = (offs_n // LB) * stride_qn + offs_n % LB
    col_s = (offs_n // LB) * stride_sn + offs_n % LB
    words = tl.load(qw_ptr + offs_kw[:, None] * stride_qk + col_q[None, :],
                    mask=(offs_kw < K // PER_WORD)[:, None] & mask_n[None, :], other=0)
    q = _split_words(words, BITS)
    # the host picks BLOCK_KW so that the tile lies in one group
    group = (pid_k * ROWS) // group_size
    sc = tl.load(s_ptr + group * stride_sg + col_s, mask=mask_n, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + group * stride_sg + col_s, mask=mask_n, other=0.0).to(tl.float32)
    w = (_small_int_to_float(q) - z[None, :]) * sc[None, :]
    rows = pid_k * ROWS + tl.arange(0, ROWS)
    tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(rows < K)[:, None] & mask_n[None, :])


# fp16x2 dequantization for the GEMV (sm_80+ PTX; Triton's interpreter cannot run it, so the
# kernel keeps a plain-Triton path of the same structure). A 4-bit word holds rows 0..7 of one
# column; `lop3` puts nibbles j and j+4 into the mantissas of two fp16 1024s (1024 + q, or
# 1024 + 16q for the high nibble of a byte) and one fp16x2 fma per pair takes them to
# (q - z) / 16, exactly. x arrives as the matching pairs (x_j, x_j+4) in fp16; the products of
# two words (16 rows) are summed in fp16x2, then once in fp32 (x 16 and the scale outside).
def _dequant_word(word: str, t: tuple[str, str, str, str], nza: str, nzb: str) -> str:
    """PTX turning 4-bit word `word` into four fp16x2 (q - z) / 16 in registers t (s, k16 and
    k256 declared and set by the caller)."""
    return f"""
shr.u32 s, {word}, 8;
lop3.b32 {t[0]}, {word}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 {t[1]}, {word}, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 {t[2]}, s, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 {t[3]}, s, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 {t[0]}, {t[0]}, k16, {nza};
fma.rn.f16x2 {t[1]}, {t[1]}, k256, {nzb};
fma.rn.f16x2 {t[2]}, {t[2]}, k16, {nza};
fma.rn.f16x2 {t[3]}, {t[3]}, k256, {nzb};
"""


_DEQUANT_CONSTANTS = """
mov.b32 k16, 0x2C002C00;
mov.b32 k256, 0x1C001C00;
"""
# the pair sum in fp16, widened to fp32 output $0
_PAIR_SUM = """
mov.b32 {lo, hi}, acc;
add.rn.f16 h, lo, hi;
cvt.f32.f16 $0, h;
}
"""
_T = ("t0", "t1", "t2", "t3")
_F16X2_TWO_WORDS = tl.constexpr("""
{
.reg .b32 s, t0, t1, t2, t3, acc, k16, k256;
.reg .b16 lo, hi, h;""" + _DEQUANT_CONSTANTS + "".join(_dequant_word(f"${w}", _T, "$11", "$12") + f"""\
{"mul.rn.f16x2 acc, t0, $3;" if w == 1 else "fma.rn.f16x2 acc, t0, $7, acc;"}
fma.rn.f16x2 acc, t1, ${4 if w == 1 else 8}, acc;
fma.rn.f16x2 acc, t2, ${5 if w == 1 else 9}, acc;
fma.rn.f16x2 acc, t3, ${6 if w == 1 else 10}, acc;
""" for w in (1, 2)) + _PAIR_SUM)
_F16X2_TWO_WORDS_CONSTRAINTS = tl.constexpr("=f" + ",r" * 12)
# _F16X2_TWO_WORDS in two halves, for several rows of x over one load of the weights: the
# dequantization of words $8 (a), $9 (b) into four fp16x2 (q - z) / 16 each ($0-$3, $4-$7;
# nza $10, nzb $11), then a row's products, summed in the same order (the same bits)
_F16X2_DEQUANT = tl.constexpr("""
{
.reg .b32 s, k16, k256;""" + _DEQUANT_CONSTANTS + "".join(
    _dequant_word(f"${w}", tuple(f"${o + i}" for i in range(4)), "$10", "$11")
    for w, o in ((8, 0), (9, 4))) + """
}
""")
_F16X2_DOT = tl.constexpr("""
{
.reg .b32 acc;
.reg .b16 lo, hi, h;
mul.rn.f16x2 acc, $1, $9;
""" + "".join(f"fma.rn.f16x2 acc, ${i}, ${i + 8}, acc;\n" for i in range(2, 9)) + _PAIR_SUM)
_BF16_PAIRS = tl.constexpr("""
{
.reg .b32 a0, a1, b0, b1, c0, c1, d0, d1;
shl.b32 a0, $4, 16; and.b32 a1, $4, 0xFFFF0000;
shl.b32 b0, $5, 16; and.b32 b1, $5, 0xFFFF0000;
shl.b32 c0, $6, 16; and.b32 c1, $6, 0xFFFF0000;
shl.b32 d0, $7, 16; and.b32 d1, $7, 0xFFFF0000;
cvt.rn.satfinite.f16x2.f32 $0, c0, a0;
cvt.rn.satfinite.f16x2.f32 $1, c1, a1;
cvt.rn.satfinite.f16x2.f32 $2, d0, b0;
cvt.rn.satfinite.f16x2.f32 $3, d1, b1;
}
""")
_F16_PAIRS = tl.constexpr("""
prmt.b32 $0, $4, $6, 0x5410;
prmt.b32 $1, $4, $6, 0x7632;
prmt.b32 $2, $5, $7, 0x5410;
prmt.b32 $3, $5, $7, 0x7632;
""")


@triton.jit
def _f16x2_two_words(wa, wb, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, nza, nzb):
    """fp32 sum over the 16 rows of words wa, wb (one column) of x_k (q_k - z) / 16.
    x*: the fp16x2 pairs of _f16x2_pairs for each word's rows; nza, nzb: fp16x2 of
    -(64 + z/16) and -(4 + z/16)."""
    return tl.inline_asm_elementwise(
        _F16X2_TWO_WORDS, _F16X2_TWO_WORDS_CONSTRAINTS,
        [wa, wb, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, nza, nzb],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _f16x2_dequant(wa, wb, nza, nzb):
    """Words wa, wb (one column, 16 rows) as eight fp16x2 (q - z) / 16, in _F16X2_TWO_WORDS's
    order; nza, nzb as there."""
    return tl.inline_asm_elementwise(_F16X2_DEQUANT, "=r," * 8 + "r,r,r,r", [wa, wb, nza, nzb],
                                     dtype=(tl.int32,) * 8, is_pure=True, pack=1)


@triton.jit
def _f16x2_row_dot(w0, w1, w2, w3, w4, w5, w6, w7, xa01, xa23, xb01, xb23,
                   X_BF16: tl.constexpr):
    """fp32 sum of the 16 products of _f16x2_dequant's eight values with one row of x's quads
    (_gemv_load_x), summed as _F16X2_TWO_WORDS sums them."""
    xa0, xa1, xa2, xa3 = _f16x2_pairs(xa01.to(tl.int32), (xa01 >> 32).to(tl.int32),
                                      xa23.to(tl.int32), (xa23 >> 32).to(tl.int32), X_BF16)
    xb0, xb1, xb2, xb3 = _f16x2_pairs(xb01.to(tl.int32), (xb01 >> 32).to(tl.int32),
                                      xb23.to(tl.int32), (xb23 >> 32).to(tl.int32), X_BF16)
    return tl.inline_asm_elementwise(
        _F16X2_DOT, "=f" + ",r" * 16,
        [w0, w1, w2, w3, w4, w5, w6, w7, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _f16x2_splat(v):
    """fp16x2 (v, v) of fp32 v, as an int32."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $1;", "=r,f", [v],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _f16x2_pairs(a, b, c, d, X_BF16: tl.constexpr):
    """From the 8 activations of one word's rows as four int32 pairs (x0 x1, x2 x3, x4 x5,
    x6 x7), the fp16x2 pairs (x0 x4, x1 x5, x2 x6, x3 x7) the lop3 unpacking lines up with.
    bf16 goes through fp32 and saturates at the fp16 range."""
    if X_BF16:
        return tl.inline_asm_elementwise(_BF16_PAIRS, "=r,=r,=r,=r,r,r,r,r", [a, b, c, d],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_F16_PAIRS, "=r,=r,=r,=r,r,r,r,r", [a, b, c, d],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                         is_pure=True, pack=1)


@triton.jit
def _word_rows_dot(x_ptr, xrow, xmask, w, z, PER_WORD: tl.constexpr, BITS: tl.constexpr):
    """Plain Triton: fp32 sum over the PER_WORD rows of words w of x_k (q_k - z)."""
    part = tl.zeros(w.shape, dtype=tl.float32)
    for j in tl.static_range(PER_WORD):
        xj = tl.load(x_ptr + xrow * PER_WORD + j, mask=xmask, other=0.0).to(tl.float32)
        q = _small_int_to_float((w >> (j * BITS)) & ((1 << BITS) - 1))
        part += xj * (q - z)
    return part


@triton.jit
def _gemv_load_weights(qw_ptr, s_ptr, z_ptr, tile, kw, group_size, stride_qk, stride_sg,
                       cols, mask_n, BLOCK_KW: tl.constexpr, PER_WORD: tl.constexpr,
                       EVEN: tl.constexpr):
    """One K tile's weights: its even and odd word rows (wa, wb) and its group's scales and
    zeros (fp32, [1, BLOCK_N]). tile must exist (tile * BLOCK_KW < kw)."""
    HALF_KW: tl.constexpr = BLOCK_KW // 2
    row_a = (tile * BLOCK_KW + 2 * tl.arange(0, HALF_KW))[:, None]     # even word rows
    group = (tile * BLOCK_KW * PER_WORD) // group_size
    if EVEN:     # K % BLOCK_K == 0 == N % BLOCK_N: no masks
        wa = tl.load(qw_ptr + row_a * stride_qk + cols)
        wb = tl.load(qw_ptr + (row_a + 1) * stride_qk + cols)
        s = tl.load(s_ptr + group * stride_sg + cols).to(tl.float32)
        z = tl.load(z_ptr + group * stride_sg + cols).to(tl.float32)
    else:
        ma = row_a < kw
        mb = row_a + 1 < kw
        wa = tl.load(qw_ptr + row_a * stride_qk + cols, mask=ma & mask_n[None, :], other=0)
        wb = tl.load(qw_ptr + (row_a + 1) * stride_qk + cols, mask=mb & mask_n[None, :],
                     other=0)
        s = tl.load(s_ptr + group * stride_sg + cols, mask=mask_n[None, :],
                    other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group * stride_sg + cols, mask=mask_n[None, :],
                    other=0.0).to(tl.float32)
    # s, z: [1, BLOCK_N], loaded in the words' layout when BLOCK_N = 128 * num_warps
    # (each thread's 4 columns); otherwise Triton shuffles them through shared memory
    return wa, wb, s, z


@triton.jit
def _gemv_load_x(x64, tile, kw, BLOCK_KW: tl.constexpr, F16X2: tl.constexpr,
                 EVEN: tl.constexpr):
    """For F16X2, x's rows of one K tile as int64 quads (else zeros: the fp32 path loads x
    where it multiplies)."""
    HALF_KW: tl.constexpr = BLOCK_KW // 2
    row_a = (tile * BLOCK_KW + 2 * tl.arange(0, HALF_KW))[:, None]
    if F16X2:
        # a masked-off word row (0) must meet x = 0: 0 - z is not
        if EVEN:
            xa01 = tl.load(x64 + row_a * 2)
            xa23 = tl.load(x64 + row_a * 2 + 1)
            xb01 = tl.load(x64 + row_a * 2 + 2)
            xb23 = tl.load(x64 + row_a * 2 + 3)
        else:
            ma = row_a < kw
            mb = row_a + 1 < kw
            xa01 = tl.load(x64 + row_a * 2, mask=ma, other=0)
            xa23 = tl.load(x64 + row_a * 2 + 1, mask=ma, other=0)
            xb01 = tl.load(x64 + row_a * 2 + 2, mask=mb, other=0)
            xb23 = tl.load(x64 + row_a * 2 + 3, mask=mb, other=0)
    else:
        xa01 = tl.zeros((HALF_KW, 1), dtype=tl.int64)
        xa23 = xa01
        xb01 = xa01
        xb23 = xa01
    return xa01, xa23, xb01, xb23


@triton.jit
def _gemv_load_tile(qw_ptr, s_ptr, z_ptr, x64, tile, kw, group_size, stride_qk, stride_sg,
                    cols, mask_n, BLOCK_KW: tl.constexpr, PER_WORD: tl.constexpr,
                    F16X2: tl.constexpr, EVEN: tl.constexpr):
    """One K tile's loads: _gemv_load_weights' and _gemv_load_x's."""
    wa, wb, s, z = _gemv_load_weights(qw_ptr, s_ptr, z_ptr, tile, kw, group_size, stride_qk,
                                      stride_sg, cols, mask_n, BLOCK_KW, PER_WORD, EVEN)
    xa01, xa23, xb01, xb23 = _gemv_load_x(x64, tile, kw, BLOCK_KW, F16X2, EVEN)
    return wa, wb, s, z, xa01, xa23, xb01, xb23


@triton.jit
def _gemv_tile_dot(wa, wb, s, z, xa01, xa23, xb01, xb23, tile, x_ptr, m, stride_xm, kw,
                   BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                   F16X2: tl.constexpr, X_BF16: tl.constexpr):
    """The fp32 [BLOCK_N] contribution of one K tile loaded by _gemv_load_tile. Each pair of
    words (16 consecutive rows of K, one column) is dotted with x, (q - z) taken before the
    product; the pairs' sums over the tile's rows are scaled once per column."""
    part = _word_pair_sums(wa, wb, z, xa01, xa23, xb01, xb23, tile, x_ptr + m * stride_xm, kw,
                           BITS, BLOCK_KW, F16X2, X_BF16)
    if F16X2:
        return tl.sum(part, axis=0) * tl.reshape(s * 16.0, (BLOCK_N,))
    return tl.sum(part, axis=0) * tl.reshape(s, (BLOCK_N,))


@triton.jit
def _word_pair_sums(wa, wb, z, xa01, xa23, xb01, xb23, tile, xrow, kw, BITS: tl.constexpr,
                    BLOCK_KW: tl.constexpr, F16X2: tl.constexpr, X_BF16: tl.constexpr):
    """fp32 [BLOCK_KW / 2, BLOCK_N]: each pair of words' (even row wa, odd row wb of tile
    `tile`) sum of x_k (q_k - z) over its rows, before the scale; / 16 for F16X2. z: the
    zeros, broadcastable to wa; xrow: x's row (the fp32 path loads x here)."""
    if F16X2:
        xa0, xa1, xa2, xa3 = _f16x2_pairs(xa01.to(tl.int32), (xa01 >> 32).to(tl.int32),
                                          xa23.to(tl.int32), (xa23 >> 32).to(tl.int32),
                                          X_BF16)
        xb0, xb1, xb2, xb3 = _f16x2_pairs(xb01.to(tl.int32), (xb01 >> 32).to(tl.int32),
                                          xb23.to(tl.int32), (xb23 >> 32).to(tl.int32),
                                          X_BF16)
        nza = _f16x2_splat(-64.0 - z * 0.0625)
        nzb = _f16x2_splat(-4.0 - z * 0.0625)
        return _f16x2_two_words(wa, wb, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, nza, nzb)
    PER_WORD: tl.constexpr = 32 // BITS
    row_a = (tile * BLOCK_KW + 2 * tl.arange(0, BLOCK_KW // 2))[:, None]
    return (_word_rows_dot(xrow, row_a, row_a < kw, wa, z, PER_WORD, BITS)
            + _word_rows_dot(xrow, row_a + 1, row_a + 1 < kw, wb, z, PER_WORD, BITS))


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, act_ptr,
                       pair_ptr, M, N, K, group_size, split_k,
                       stride_xm, stride_qk, stride_sg,
                       BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                       F16X2: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr,
                       GATED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Decode: one program per (row of x, BLOCK_N columns, K slice); no tl.dot.

    A K tile is BLOCK_KW rows of words, one group, loaded as two [BLOCK_KW / 2, BLOCK_N]
    halves (even and odd word rows; 16 B of a row per thread). F16X2 (4 bits, 16-bit x):
    dequantize and multiply in fp16x2 PTX (_F16X2_TWO_WORDS, ~13 instructions a word); else
    in fp32 in plain Triton (the interpreter's path). EVEN: K % BLOCK_K == 0 == N % BLOCK_N,
    no masks. BLOCK_N = 128 * num_warps gives each thread 4 whole columns of the tile (see
    pick_config). PREFETCH: a program's next tile is loaded before its current one is
    multiplied (two tiles in flight per thread: a slice's loads no longer wait, tile after
    tile, for the previous tile's arithmetic), its first tile's weights before the PDL wait
    (kvfleet_kernels.pdl); else one tile at a time.

    qweight, scales and zeros have contiguous columns. With split_k > 1 the K slices meet
    inside this one launch (split_k.store_or_reduce): no zero-filled buffer, atomic
    accumulation or cast kernel around it. out is contiguous [M, N]. GATED: out is a gated
    MLP's [gate | up], and act ([M, N / 2]) gets SiLU(gate) * up too (split_k.meet_gate_up;
    pair_ptr: its counters).
    """
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    X_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    cols = offs_n[None, :]
    kw = K // PER_WORD
    n_tiles = tl.cdiv(K, BLOCK_K)
    # the 8 activations of a word row (4 bits, 16-bit x) as two int64 loads
    x64 = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + m * (stride_xm // 4)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PREFETCH:
        if pid_k < n_tiles:      # split_k above the tile count leaves slices empty
            wa, wb, s, z = _gemv_load_weights(qw_ptr, s_ptr, z_ptr, pid_k, kw, group_size,
                                              stride_qk, stride_sg, cols, mask_n, BLOCK_KW,
                                              PER_WORD, EVEN)
            pdl_wait(PDL)
            xa01, xa23, xb01, xb23 = _gemv_load_x(x64, pid_k, kw, BLOCK_KW, F16X2, EVEN)
            # every tile but the slice's last: load the next, then multiply this one
            for tile in range(pid_k, n_tiles - split_k, split_k):
                na, nb, ns, nz, nxa01, nxa23, nxb01, nxb23 = _gemv_load_tile(
                    qw_ptr, s_ptr, z_ptr, x64, tile + split_k, kw, group_size, stride_qk,
                    stride_sg, cols, mask_n, BLOCK_KW, PER_WORD, F16X2, EVEN)
                acc += _gemv_tile_dot(wa, wb, s, z, xa01, xa23, xb01, xb23, tile, x_ptr, m,
                                      stride_xm, kw, BITS, BLOCK_N, BLOCK_KW, F16X2, X_BF16)
                wa, wb, s, z = na, nb, ns, nz
                xa01, xa23, xb01, xb23 = nxa01, nxa23, nxb01, nxb23
            last = pid_k + ((n_tiles - 1 - pid_k) // split_k) * split_k
            acc += _gemv_tile_dot(wa, wb, s, z, xa01, xa23, xb01, xb23, last, x_ptr, m,
                                  stride_xm, kw, BITS, BLOCK_N, BLOCK_KW, F16X2, X_BF16)
        else:
            pdl_wait(PDL)
    else:
        pdl_wait(PDL)
        for tile in range(pid_k, n_tiles, split_k):
            wa, wb, s, z, xa01, xa23, xb01, xb23 = _gemv_load_tile(
                qw_ptr, s_ptr, z_ptr, x64, tile, kw, group_size, stride_qk, stride_sg, cols,
                mask_n, BLOCK_KW, PER_WORD, F16X2, EVEN)
            acc += _gemv_tile_dot(wa, wb, s, z, xa01, xa23, xb01, xb23, tile, x_ptr, m,
                                  stride_xm, kw, BITS, BLOCK_N, BLOCK_KW, F16X2, X_BF16)
    done = store_or_reduce(acc, out_ptr, out_ptr, part_ptr, count_ptr, m, M, N,
                           offs_n, mask_n, pid_n, pid_k, split_k, False)
    if GATED:
        if done:
            meet_gate_up(out_ptr, act_ptr, pair_ptr, m, N, offs_n, mask_n, pid_n)


@triton.jit
def _w4a16_gemv_whole_k_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size,
                               stride_xm, stride_qb, stride_qk, stride_sb, stride_sg,
                               BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_KW: tl.constexpr, F16X2: tl.constexpr,
                               PDL: tl.constexpr = False):
    """Batch 1 (up to gemv_max_m() rows, a program a row), one program per BLOCK_N columns
    over the whole of K: no K slices, so nothing to meet. A step loads BLOCK_KW word rows (as
    BLOCK_KW / 2 even-odd pairs), which Triton spreads over the program's warps; each pair's
    products are scaled by its own group and kept per pair, and the pairs are summed once at
    the end (the only exchange between the warps). The next step is loaded into registers
    before this one is multiplied; the first step's weights before the PDL wait. (Pipelined by
    Triton through shared memory instead, 2 or 4 steps in flight with 48-80 registers, it ran
    slower: GPTQ batch 1 407.1 / 397.8 tok/s against 442.4; removed.) The host requires
    K % (BLOCK_KW * 32 // BITS) == 0, N % BLOCK_N == 0 and x, qweight, scales and zeros with
    contiguous rows; out is contiguous [M, N]. Program p's columns of qweight start at
    qw_ptr + p * stride_qb, its rows stride_qk apart (the checkpoint's [K / 8, N]: BLOCK_N and
    N; column-blocked, `block_columns`: K / 8 * BLOCK_N and BLOCK_N); scales and zeros
    likewise (stride_sb, stride_sg)."""
    PER_WORD: tl.constexpr = 32 // BITS
    HALF_KW: tl.constexpr = BLOCK_KW // 2
    X_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    m = tl.program_id(0)      # a column block's rows are neighbouring programs
    offs_n, cols, qw_ptr, s_ptr, z_ptr, kw, n_steps = _whole_k_block(
        qw_ptr, s_ptr, z_ptr, K, stride_qb, stride_sb, BLOCK_N, BLOCK_KW, PER_WORD)
    x64 = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + m * (stride_xm // 4)
    x_ptr += m * stride_xm
    acc = tl.zeros((HALF_KW, BLOCK_N), dtype=tl.float32)
    wa, wb, s, z = _whole_k_weights(qw_ptr, s_ptr, z_ptr, 0, group_size, stride_qk, stride_sg,
                                    cols, BLOCK_KW, PER_WORD)
    pdl_wait(PDL)
    xa01, xa23, xb01, xb23 = _gemv_load_x(x64, 0, kw, BLOCK_KW, F16X2, True)
    for step in range(0, n_steps - 1):
        na, nb, ns, nz = _whole_k_weights(qw_ptr, s_ptr, z_ptr, step + 1, group_size,
                                          stride_qk, stride_sg, cols, BLOCK_KW, PER_WORD)
        nxa01, nxa23, nxb01, nxb23 = _gemv_load_x(x64, step + 1, kw, BLOCK_KW, F16X2, True)
        acc += _word_pair_sums(wa, wb, z, xa01, xa23, xb01, xb23, step, x_ptr, kw, BITS,
                               BLOCK_KW, F16X2, X_BF16) * s
        wa, wb, s, z = na, nb, ns, nz
        xa01, xa23, xb01, xb23 = nxa01, nxa23, nxb01, nxb23
    acc += _word_pair_sums(wa, wb, z, xa01, xa23, xb01, xb23, n_steps - 1, x_ptr, kw,
                           BITS, BLOCK_KW, F16X2, X_BF16) * s
    out = tl.sum(acc, axis=0)
    if F16X2:
        out = out * 16.0
    tl.store(out_ptr + m * N + offs_n, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _w4a16_gemv_rows_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, group_size,
                            stride_xm, stride_qb, stride_qk, stride_sb, stride_sg,
                            BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                            F16X2: tl.constexpr, ROWS: tl.constexpr,
                            PDL: tl.constexpr = False):
    """The whole-K GEMV over ROWS (2 or 4) rows of x a program: each step's words, scales and
    zeros are loaded and (F16X2) dequantized once for all the rows, where the whole-K kernel
    takes a program a row and loads and dequantizes them per row. Each row's sums are those of
    the whole-K kernel, in its order (the same bits). Rows past M read row M - 1 and store
    nothing. Layout and host conditions as _w4a16_gemv_whole_k_kernel's. w4a16_gemm runs it
    wherever 2-4 rows take the whole-K GEMV (gemv_rows)."""
    PER_WORD: tl.constexpr = 32 // BITS
    HALF_KW: tl.constexpr = BLOCK_KW // 2
    X_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    m0 = tl.program_id(0) * ROWS
    offs_n, cols, qw_ptr, s_ptr, z_ptr, kw, n_steps = _whole_k_block(
        qw_ptr, s_ptr, z_ptr, K, stride_qb, stride_sb, BLOCK_N, BLOCK_KW, PER_WORD)
    x64 = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    # the rows' x (past M: row M - 1 again), as int64 quads (F16X2) or 16-bit pointers
    r1 = tl.minimum(m0 + 1, M - 1)
    r2 = tl.minimum(m0 + 2, M - 1)
    r3 = tl.minimum(m0 + 3, M - 1)
    x0 = x64 + m0 * (stride_xm // 4)
    x1 = x64 + r1 * (stride_xm // 4)
    x2 = x64 + r2 * (stride_xm // 4)
    x3 = x64 + r3 * (stride_xm // 4)
    acc0 = tl.zeros((HALF_KW, BLOCK_N), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    wa, wb, sc, z = _whole_k_weights(qw_ptr, s_ptr, z_ptr, 0, group_size, stride_qk, stride_sg,
                                     cols, BLOCK_KW, PER_WORD)
    pdl_wait(PDL)
    q0 = _gemv_load_x(x0, 0, kw, BLOCK_KW, F16X2, True)
    q1 = _gemv_load_x(x1, 0, kw, BLOCK_KW, F16X2, True)
    q2 = q1
    q3 = q1
    if ROWS > 2:
        q2 = _gemv_load_x(x2, 0, kw, BLOCK_KW, F16X2, True)
        q3 = _gemv_load_x(x3, 0, kw, BLOCK_KW, F16X2, True)
    for step in range(0, n_steps - 1):
        na, nb, ns, nz = _whole_k_weights(qw_ptr, s_ptr, z_ptr, step + 1, group_size,
                                          stride_qk, stride_sg, cols, BLOCK_KW, PER_WORD)
        n0 = _gemv_load_x(x0, step + 1, kw, BLOCK_KW, F16X2, True)
        n1 = _gemv_load_x(x1, step + 1, kw, BLOCK_KW, F16X2, True)
        n2 = n1
        n3 = n1
        if ROWS > 2:
            n2 = _gemv_load_x(x2, step + 1, kw, BLOCK_KW, F16X2, True)
            n3 = _gemv_load_x(x3, step + 1, kw, BLOCK_KW, F16X2, True)
        acc0, acc1, acc2, acc3 = _rows_step(acc0, acc1, acc2, acc3, wa, wb, sc, z, q0, q1, q2,
                                            q3, step, x_ptr, stride_xm, m0, r1, r2, r3, kw,
                                            BITS, BLOCK_KW, F16X2, X_BF16, ROWS)
        wa, wb, sc, z = na, nb, ns, nz
        q0, q1, q2, q3 = n0, n1, n2, n3
    acc0, acc1, acc2, acc3 = _rows_step(acc0, acc1, acc2, acc3, wa, wb, sc, z, q0, q1, q2, q3,
                                        n_steps - 1, x_ptr, stride_xm, m0, r1, r2, r3, kw,
                                        BITS, BLOCK_KW, F16X2, X_BF16, ROWS)
    scale: tl.constexpr = 16.0 if F16X2 else 1.0
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + m0 * N + offs_n, (tl.sum(acc0, axis=0) * scale).to(dtype))
    tl.store(out_ptr + (m0 + 1) * N + offs_n, (tl.sum(acc1, axis=0) * scale).to(dtype),
             mask=m0 + 1 + 0 * offs_n < M)
    if ROWS > 2:
        tl.store(out_ptr + (m0 + 2) * N + offs_n, (tl.sum(acc2, axis=0) * scale).to(dtype),
                 mask=m0 + 2 + 0 * offs_n < M)
        tl.store(out_ptr + (m0 + 3) * N + offs_n, (tl.sum(acc3, axis=0) * scale).to(dtype),
                 mask=m0 + 3 + 0 * offs_n < M)


@triton.jit
def _rows_step(acc0, acc1, acc2, acc3, wa, wb, sc, z, q0, q1, q2, q3, step, x_ptr, stride_xm,
               m0, r1, r2, r3, kw, BITS: tl.constexpr, BLOCK_KW: tl.constexpr,
               F16X2: tl.constexpr, X_BF16: tl.constexpr, ROWS: tl.constexpr):
    """One step of _w4a16_gemv_rows_kernel: the step's weights (dequantized once, F16X2) times
    each row's x, scaled by each pair's group, into the rows' accumulators."""
    if F16X2:
        nza = _f16x2_splat(-64.0 - z * 0.0625)
        nzb = _f16x2_splat(-4.0 - z * 0.0625)
        w0, w1, w2, w3, w4, w5, w6, w7 = _f16x2_dequant(wa, wb, nza, nzb)
        acc0 += _f16x2_row_dot(w0, w1, w2, w3, w4, w5, w6, w7, *q0, X_BF16) * sc
        acc1 += _f16x2_row_dot(w0, w1, w2, w3, w4, w5, w6, w7, *q1, X_BF16) * sc
        if ROWS > 2:
            acc2 += _f16x2_row_dot(w0, w1, w2, w3, w4, w5, w6, w7, *q2, X_BF16) * sc
            acc3 += _f16x2_row_dot(w0, w1, w2, w3, w4, w5, w6, w7, *q3, X_BF16) * sc
    else:     # the fp32 path loads x where it multiplies (q* are zeros)
        acc0 += _word_pair_sums(wa, wb, z, *q0, step, x_ptr + m0 * stride_xm, kw, BITS,
                                BLOCK_KW, False, X_BF16) * sc
        acc1 += _word_pair_sums(wa, wb, z, *q1, step, x_ptr + r1 * stride_xm, kw, BITS,
                                BLOCK_KW, False, X_BF16) * sc
        if ROWS > 2:
            acc2 += _word_pair_sums(wa, wb, z, *q2, step, x_ptr + r2 * stride_xm, kw, BITS,
                                    BLOCK_KW, False, X_BF16) * sc
            acc3 += _word_pair_sums(wa, wb, z, *q3, step, x_ptr + r3 * stride_xm, kw, BITS,
                                    BLOCK_KW, False, X_BF16) * sc
    return acc0, acc1, acc2, acc3


@triton.jit
def _whole_k_block(qw_ptr, s_ptr, z_ptr, K, stride_qb, stride_sb, BLOCK_N: tl.constexpr,
                   BLOCK_KW: tl.constexpr, PER_WORD: tl.constexpr):
    """A whole-K program's column block (program id 1): its output columns, its columns within
    the block (for _whole_k_weights), the block's qweight, scales and zeros, the word rows and
    the steps over them."""
    pid = tl.program_id(1)
    kw = K // PER_WORD
    return (pid * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_N)[None, :],
            qw_ptr + pid * stride_qb, s_ptr + pid * stride_sb, z_ptr + pid * stride_sb, kw,
            kw // BLOCK_KW)


@triton.jit
def _whole_k_weights(qw_ptr, s_ptr, z_ptr, step, group_size, stride_qk, stride_sg, cols,
                     BLOCK_KW: tl.constexpr, PER_WORD: tl.constexpr):
    """A whole-K step's even and odd word rows (wa, wb) and each pair's scales and zeros (fp32,
    [BLOCK_KW / 2, BLOCK_N]; a pair's 2 * PER_WORD rows lie in one group)."""
    row_a = (step * BLOCK_KW + 2 * tl.arange(0, BLOCK_KW // 2))[:, None]
    group = (row_a * PER_WORD) // group_size
    wa = tl.load(qw_ptr + row_a * stride_qk + cols)
    wb = tl.load(qw_ptr + (row_a + 1) * stride_qk + cols)
    s = tl.load(s_ptr + group * stride_sg + cols).to(tl.float32)
    z = tl.load(z_ptr + group * stride_sg + cols).to(tl.float32)
    return wa, wb, s, z


# M from this many rows (on a GPU): the weight dequantized into a scratch [K, N] (one pass,
# ~2.5 bytes of traffic a weight) and cuBLAS's GEMM, as vLLM's AWQ layer does from 256 rows,
# instead of the tiled kernel (KVFLEET_W4A16_DEQUANT_M overrides; 0: never). On the H200
# (bench_w4a16.py, 8B layer's four projections): at 64 rows the tiled kernel's 64 x 64 tiles
# 230 us against 278; from 65 rows its 128 x 128 tiles lose: 96 rows 592 against 288, 2048
# rows 2.9 ms against 1.4; GPTQ TTFT of 2048 tokens 105.7 -> 55.7 ms, 128/128 at 256 running
# 6,647 -> 12,320 output tok/s (docs/PERFORMANCE.md, eighteenth session)
DEQUANT_MIN_M = 65
# M up to this many rows of 4-bit weights runs the GEMV kernels, a program a row (8 bits: batch
# 1 only; KVFLEET_W4A16_GEMV_MAX_M overrides). On the H200 (bench_w4a16.py, commit 6309c58; the
# 8B layer's four projections) they took 74 us at 2 rows and 135 at 4 against the tiled
# kernel's 162 at any of 2-16 rows, and 254 at 8; GPTQ 4 at once 6.07 -> 5.06 ms a token
# (docs/PERFORMANCE.md, nineteenth session).
GEMV_MAX_M = 4


def gemv_max_m(bits: int = 4) -> int:
    """Rows up to which the batch-1 GEMV kernels serve (a program a row):
    KVFLEET_W4A16_GEMV_MAX_M, else GEMV_MAX_M for 4 bits and 1 for 8 (whose GEMV has no
    fp16x2 path and was not measured at several rows)."""
    value = os.environ.get("KVFLEET_W4A16_GEMV_MAX_M", "")
    if value and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"KVFLEET_W4A16_GEMV_MAX_M must be a row count >= 1; got {value!r}")
    return int(value) if value else GEMV_MAX_M if bits == 4 else 1


# The GEMV's K split: at least this many warps per SM (nothing is staged through shared
# memory, so the warps' own loads are what hides the latency), and slices of at most this many
# K tiles (a slice is a chain of tiles; with prefetch each waits on the one before). The L2-cold
# H200 sweep of commit 7b36514 (bench_w4a16.py --m 1 --sweep) put every 8B shape's best at
# 8 warps per SM or 2-4 tiles a slice, whichever split more.
GEMV_WARPS_PER_SM = 8
GEMV_TILES_PER_SLICE = 4
# the whole-K GEMV's (block_n, block_k, num_warps) under KVFLEET_W4A16_GEMV=whole_k=1 (ptxas
# for sm_90: 103 registers, no spills)
WHOLE_K_TILES = (16, 1024, 8)
# By default the whole-K GEMV serves N up to WHOLE_K_MAX_N at K >= WHOLE_K_MIN_K, where the
# L2-cold H200 sweep (bench_w4a16.py --m 1 --sweep, commit 8f7785c) had it ahead of the split
# GEMV; gate_up 4096x28672 stays split (21.7 us against the whole-K's best 22.4). Its tiles:
# 16 columns x 2048 rows (1024 where K % 2048) on 8 warps, each program's registers capped
# (ptxas' maxnreg) so that every program of the launch is resident at once, up to
# WHOLE_K_MAX_PER_SM a SM; else 32 columns x 1024 rows. On column-blocked weights
# (bench_w4a16.py --maxnreg, commit f88da6c) qkv 4096x6144 went 7.7 -> 6.6 us (384 programs, 3
# a SM at 80 registers; the uncapped default was 32 x 1024 at 128), o 4096x4096 5.1 -> 5.0
# and down 14336x4096 11.7 -> 11.3 (256 programs, 2 a SM at 128 registers, 138 uncapped).
WHOLE_K_MAX_N = 8192
WHOLE_K_MIN_K = 2048
WHOLE_K_MAX_PER_SM = 3


def whole_k_tiles(n: int, k: int, sms: int) -> tuple[int, int, int, int] | None:
    """The default whole-K tiles (block_n, block_k, num_warps, maxnreg; maxnreg 0: no cap) for
    [K, N], or None where the split GEMV serves it (N above WHOLE_K_MAX_N, K below
    WHOLE_K_MIN_K, shapes that do not tile)."""
    if n > WHOLE_K_MAX_N or k < WHOLE_K_MIN_K:
        return None
    warps = 8
    fits = [(block_n, block_ks, per_sm)
            for block_n, block_ks in ((16, (2048, 1024, 512)), (32, (1024, 512)))
            if n % block_n == 0
            for per_sm in [triton.cdiv(n // block_n, sms)]     # programs a SM
            if per_sm <= WHOLE_K_MAX_PER_SM]
    if not fits:
        return None
    block_n, block_ks, per_sm = fits[0]
    # the register file (64K) shared by per_sm programs, in ptxas' steps of 8
    cap = 0 if per_sm == 1 else 65536 // (per_sm * 32 * warps) // 8 * 8
    for block_k in block_ks:
        if k % block_k == 0:
            return block_n, block_k, warps, cap
    return None


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one launch; block_m == 1 selects the GEMV kernel (block_k rows per tile, at
    least 2 words: 16 for 4 bits). f16x2: the GEMV dequantizes in fp16x2 PTX where it can
    (4 bits, fp16/bf16 x, compiled for a GPU); else, and in the interpreter, in fp32.
    prefetch: the GEMV loads a slice's next K tile before multiplying the current one
    (the whole-K GEMV always does)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    f16x2: bool = True
    prefetch: bool = False
    # batch 1: one program per block_n columns over the whole of K, its warps sharing each
    # block_k-row step (no K slices, split_k 1); needs K % block_k == 0 == N % block_n
    whole_k: bool = False
    # ptxas' register cap for the batch-1 GEMVs (0: none; whole_k_tiles)
    maxnreg: int = 0


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


@functools.cache
def gemv_overrides(value: str) -> dict[str, int]:
    """KVFLEET_W4A16_GEMV (e.g. "prefetch=0,warps_per_sm=16,warps=2,block_k=64"): the batch-1
    GEMV's tiles for experiments on a GPU, over pick_config's defaults. rows=1|2|4: that many
    rows of x a whole-K GEMV program (_w4a16_gemv_rows_kernel; default GEMV_ROWS, where the
    whole-K GEMV serves); set, 2-4 rows of x (up to gemv_max_m()) take the whole-K GEMV at
    every shape it tiles (gate_up's too; maxnreg its register cap, default none)."""
    keys = ("prefetch", "warps_per_sm", "tiles_per_slice", "warps", "block_n", "block_k",
            "whole_k", "maxnreg", "rows")
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, _, number = item.partition("=")
        if key not in keys or not number.isdigit():
            raise ValueError(f"KVFLEET_W4A16_GEMV: expected comma-separated key=integer with keys "
                             f"{', '.join(keys)}; got {item!r}")
        out[key] = int(number)
    if out.get("rows", 1) not in (1, 2, 4):
        raise ValueError(f"KVFLEET_W4A16_GEMV: rows must be 1, 2 or 4; got {out['rows']}")
    return out


# Rows of x a program of the whole-K GEMV takes where 2-4 rows run it (qkv, o and down of the
# 8B layer; gate_up keeps the split GEMV, a program a row). On the H200 (bench_w4a16.py --m 2 4,
# commit bee63a9, the checkpoint's layout, us): 2 rows qkv 11.5 -> 10.9, o 9.1 -> 6.8, down
# 20.4 -> 14.5; 4 rows (two programs of 2) qkv 21.4 -> 18.0, o 16.4 -> 12.0, down 38.1 -> 25.7;
# 4 rows a program lost to 2 at 4 rows (qkv 22.0, o 14.8, down 32.6: 1024-row steps) and on
# gate_up either (2 rows 40.8, 4 rows 99.2 against the split GEMV's 33.6 and 59.3)
# (docs/PERFORMANCE.md, twenty-first session). KVFLEET_W4A16_GEMV=rows=1 a program a row.
GEMV_ROWS = 2


def gemv_rows(over: dict[str, int]) -> int:
    """Rows of x a whole-K GEMV program takes at 2+ rows: KVFLEET_W4A16_GEMV's rows=, else
    GEMV_ROWS."""
    return over.get("rows", GEMV_ROWS)


def _rows_tiles(n: int, k: int) -> tuple[int, int] | None:
    """(block_n, block_k) of the several-rows GEMV on a weight in the checkpoint's layout."""
    block_n = 16 if n % 16 == 0 else 0
    block_k = next((b for b in (2048, 1024, 512) if k % b == 0), 0)
    return (block_n, block_k) if block_n and block_k else None


@functools.cache
def _gemv_config(m: int, n: int, k: int, group_size: int, device: torch.device,
                 overrides: str, bits: int = 4) -> GemmConfig:
    """pick_config's batch-1 tiles (cached: the eager decode loop asks for every projection of
    every step); overrides: KVFLEET_W4A16_GEMV's value."""
    # one group per K tile. BLOCK_N = 128 * num_warps: each thread owns 4 columns (16-byte
    # loads) and every row of the tile, so the per-column scales/zeros load in the words'
    # layout and the sum over rows stays in registers (sm_90, ptxas 13: ~20 SASS
    # instructions per 32-bit word, no spills, no shared memory or barriers in the loop).
    # The L2-cold H200 sweep (commit 7b36514; weight copies 3x L2 timed in turn, as the
    # engine's 32 layers pass through L2) chose prefetch (next K tile loaded before this
    # one is multiplied: -15-25% on every shape), 64-row K tiles (128 rows at K = 14336
    # was no faster) and 1, 2 or 4 warps alike: per layer 78 -> 61 us (qkv 12.7 -> 9.9,
    # o 10.9 -> 9.1, gate_up 34.5 -> 24.8, down 19.9 -> 16.4), 1.4-2.5 TB/s.
    over = gemv_overrides(overrides)
    if (m > 1 and over.get("rows", 1) > 1 and bits == 4 and device.type == "cuda"
            and (tiles := _rows_tiles(n, k))):
        # rows= set: every shape it tiles takes the whole-K GEMV (w4a16_gemm launches
        # _w4a16_gemv_rows_kernel)
        return GemmConfig(1, tiles[0], tiles[1], 1, 8, 1, whole_k=True,
                          maxnreg=over.get("maxnreg", 0))
    if over.get("whole_k"):
        # WHOLE_K_TILES unless block_n / block_k / warps say otherwise; shapes it cannot tile
        # keep the split GEMV
        block_n = over.get("block_n", WHOLE_K_TILES[0])
        block_k = over.get("block_k", WHOLE_K_TILES[1])
        if k % block_k == 0 and n % block_n == 0:
            return GemmConfig(1, block_n, block_k, 1, over.get("warps", WHOLE_K_TILES[2]), 1,
                              whole_k=True, maxnreg=over.get("maxnreg", 0))
    elif "whole_k" not in over and bits == 4 and device.type == "cuda" and (
            tiles := whole_k_tiles(n, k, _num_sms(device))):
        # the default on a GPU for 4 bits (measured there, on its fp16x2 path; whole_k=0: the
        # split GEMV everywhere); the interpreter keeps the split GEMV, which its tests cover
        # at every shape
        return GemmConfig(1, tiles[0], tiles[1], 1, tiles[2], 1, whole_k=True,
                          maxnreg=over.get("maxnreg", tiles[3]))
    warps = over.get("warps", 2)
    block_n = over.get("block_n", 128 * warps)
    block_k = over.get("block_k", 64)
    while group_size < k and group_size % block_k:
        block_k //= 2
    tiles = m * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split_k = max(triton.cdiv(over.get("warps_per_sm", GEMV_WARPS_PER_SM) * _num_sms(device),
                              tiles * warps),
                  k_tiles // over.get("tiles_per_slice", GEMV_TILES_PER_SLICE))
    return GemmConfig(1, block_n, block_k, max(1, min(k_tiles, split_k)), warps, 1,
                      prefetch=bool(over.get("prefetch", 1)))


def pick_config(m: int, n: int, k: int, group_size: int, device: torch.device,
                bits: int = 4) -> GemmConfig:
    """Tile sizes by M: the GEMVs up to gemv_max_m() rows, the tiled kernel to 64 (both stream
    the weight), from dequant_min_m() (w4a16_gemm) cuBLAS over the dequantized weight."""
    if m <= gemv_max_m(bits):
        return _gemv_config(m, n, k, group_size, device,
                            os.environ.get("KVFLEET_W4A16_GEMV", ""), bits)
    return tiled_config(m, n, k, group_size, device)


def tiled_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> GemmConfig:
    """The tiled kernel's tiles for M rows (pick_config's past gemv_max_m() rows)."""
    sms = _num_sms(device)
    if m <= 64:
        # H200 sweep (bench_w4a16.py --m 16 64 --sweep, commit 154b151; the 8B projections):
        # 128-row K tiles, 128 columns where 64-column tiles would be 2 or more an SM (gate_up:
        # 16 rows 91.8 -> 73.3 us, 64 rows 100.7 -> 85.2), K split only while there are fewer
        # column tiles than SMs
        block_m, block_k, warps = (16 if m <= 16 else 64), 128, 4
        block_n = 128 if triton.cdiv(n, 64) >= 2 * sms else 64
        stages = 4 if m <= 16 else 3
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    # one group per K tile: halve BLOCK_K until it divides the group (tl.dot needs >= 16)
    while group_size < k and group_size % block_k:
        block_k //= 2
    over = tiled_overrides(os.environ.get("KVFLEET_W4A16_TILED", "")) if m <= 64 else {}
    block_n = over.get("block_n", block_n)
    split_k = 1
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if m <= 64 and tiles < sms:
        # enough programs for every SM to stream its share of the weight
        split_k = max(1, min(triton.cdiv(k, block_k) // 4,
                             triton.cdiv(over.get("per_sm", 2) * sms, tiles)))
    return GemmConfig(block_m, block_n, block_k, split_k, over.get("warps", warps),
                      over.get("stages", stages))


@functools.cache
def tiled_overrides(value: str) -> dict[str, int]:
    """KVFLEET_W4A16_TILED (e.g. "per_sm=4,stages=2"): the tiled kernel's settings for rows
    past gemv_max_m() up to 64, for experiments on a GPU (per_sm: the K split aims at this many
    programs a SM, 2 by default). (Its next tile loaded ahead in registers, as the GEMVs do,
    measured slower on the H200: docs/PERFORMANCE.md, nineteenth session.)"""
    keys = ("per_sm", "stages", "warps", "block_n")
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, _, number = item.partition("=")
        if key not in keys or not number.isdigit() or int(number) < 1:
            raise ValueError(f"KVFLEET_W4A16_TILED: expected comma-separated key=integer with "
                             f"keys {', '.join(keys)}; got {item!r}")
        out[key] = int(number)
    return out


def gated_output_serves(m: int, n: int, k: int, group_size: int, device: torch.device,
                        bits: int = 4) -> bool:
    """Whether w4a16_gemm(..., silu_out=True) serves this launch: the split batch-1 GEMV
    (pick_config's), its column tiles wholly in the gate or the up half."""
    if not kernel_supports(k, bits, group_size):
        return False
    return _tiles_gate_up(pick_config(m, n, k, group_size, device, bits), n)


def _tiles_gate_up(cfg: GemmConfig, n: int) -> bool:
    """cfg is the split batch-1 GEMV and its column tiles lie wholly in [gate | up]'s halves."""
    return cfg.block_m == 1 and not cfg.whole_k and n % 2 == 0 and (n // 2) % cfg.block_n == 0


# per (device, M, pairs): the gated GEMV's pair counters (meet_gate_up; back at 0 after a launch)
_PAIR_COUNTERS: dict[tuple, torch.Tensor] = {}


def kernel_supports(k: int, bits: int, group_size: int) -> bool:
    """Whether the kernel serves this shape; callers fall back to a dequantized weight otherwise."""
    return bits in (4, 8) and k % (32 // bits) == 0 and (group_size >= k or group_size % 16 == 0)


def block_columns(t: torch.Tensor, block: int) -> torch.Tensor:
    """[R, N] -> the column-blocked [N / block, R, block] (contiguous): each block of `block`
    columns a contiguous run of its R rows, which the whole-K GEMV's program streams from
    one place."""
    rows, n = t.shape
    if n % block:
        raise ValueError(f"block_columns: {n} columns do not split into blocks of {block}")
    return t.reshape(rows, n // block, block).permute(1, 0, 2).contiguous()


def unblock_columns(t: torch.Tensor) -> torch.Tensor:
    """block_columns' inverse: [N / block, R, block] -> [R, N]."""
    blocks, rows, block = t.shape
    return t.permute(1, 0, 2).reshape(rows, blocks * block)


def blocked_whole_k(n: int, k: int, bits: int, group_size: int,
                    device: torch.device) -> GemmConfig | None:
    """The batch-1 whole-K GEMV that a column-blocked weight is laid out for: pick_config's
    where it picks the whole-K GEMV (4 bits on a GPU by default), else None (the weight keeps
    the checkpoint's layout; also under KVFLEET_W4A16_BLOCKED=0)."""
    if not on_off("KVFLEET_W4A16_BLOCKED", os.environ.get("KVFLEET_W4A16_BLOCKED", "")) or (
            not kernel_supports(k, bits, group_size)):
        return None
    cfg = pick_config(1, n, k, group_size, device, bits)
    return cfg if cfg.whole_k else None


def _register_cap(cfg: GemmConfig) -> dict:
    """The launch's ptxas register cap (maxnreg), if cfg sets one."""
    return {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}


def _column_layout(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, tuple]:
    """(N, LB, (stride_qk, stride_qn, stride_sg, stride_sn)) of the checkpoint's layout (LB 1)
    or the column-blocked one (LB the block; stride_qn / stride_sn the block's stride)."""
    if qweight.dim() == 3:
        lb = qweight.shape[2]
        return (qweight.shape[0] * lb, lb, (qweight.stride(1), qweight.stride(0),
                                            scales.stride(1), scales.stride(0)))
    return (qweight.shape[1], 1, (qweight.stride(0), qweight.stride(1), scales.stride(0),
                                  scales.stride(1)))


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The [K, N] weight in `dtype` (dequantize_ref's values, rounded once), from either
    layout (qweight [K / 8, N] or column-blocked)."""
    n, lb, strides = _column_layout(qweight, scales)
    per_word = 32 // bits
    k = qweight.shape[-2] * per_word
    block_kw = 128 // per_word     # 128 rows of K, halved until a group holds them
    while group_size < k and group_size % (block_kw * per_word):
        block_kw //= 2
    out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k // per_word, block_kw), triton.cdiv(n, 128))
    _dequantize_kernel[grid](qweight, scales, zeros, out, n, k, group_size, *strides,
                             BITS=bits, BLOCK_KW=block_kw, BLOCK_N=128, LB=lb, num_warps=4)
    return out


def dequantized_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """w4a16_gemm's route from dequant_min_m() rows: x @ the dequantized weight, by cuBLAS."""
    return torch.matmul(x, dequantize(qweight, scales, zeros, bits, group_size, x.dtype))


def dequant_min_m() -> int:
    """Rows from which w4a16_gemm dequantizes the weight and multiplies with torch.matmul
    (cuBLAS) on a GPU instead of the tiled kernel: KVFLEET_W4A16_DEQUANT_M (0: never)."""
    value = os.environ.get("KVFLEET_W4A16_DEQUANT_M", "")
    if value and not value.isdigit():
        raise ValueError(f"KVFLEET_W4A16_DEQUANT_M must be a row count (0: never); got {value!r}")
    return int(value) if value else DEQUANT_MIN_M


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bits: int, group_size: int,
               config: GemmConfig | None = None, silu_out: bool = False) -> torch.Tensor:
    """x: [M, K] fp16/bf16 -> [M, N] in x's dtype. silu_out (where gated_output_serves): the
    weight is a gated MLP's gate_up, and the result is SiLU(gate) * up, [M, N / 2] (the same
    bits as silu_and_mul of the [M, N] result). qweight [K / 8, N] and scales, zeros [G, N]
    as the checkpoint lays them out, or all three column-blocked (`block_columns`, 3-D): then
    batch 1 runs the whole-K GEMV with block_n the layout's block."""
    m, k = x.shape
    blocked = qweight.dim() == 3
    n, lb, tiled_strides = _column_layout(qweight, scales)
    if not kernel_supports(k, bits, group_size):
        raise ValueError(f"w4a16_gemm does not serve K={k}, bits={bits}, group_size={group_size}")
    if scales.stride() != zeros.stride():
        raise ValueError("scales and zeros must share strides")
    if blocked and (scales.dim() != 3 or scales.shape[2] != lb or not qweight.is_contiguous()
                    or not scales.is_contiguous() or silu_out):
        raise ValueError(f"a column-blocked qweight {tuple(qweight.shape)} needs contiguous "
                         f"scales and zeros blocked alike (got {tuple(scales.shape)}) and no "
                         f"silu_out")
    cfg = config or pick_config(m, n, k, group_size, x.device, bits)
    if blocked and cfg.block_m == 1 and not (cfg.whole_k and cfg.block_n == lb):
        raise ValueError(f"a weight blocked by {lb} columns serves batch 1 through the whole-K "
                         f"GEMV at block_n {lb}; got {cfg}")
    if silu_out and not _tiles_gate_up(cfg, n):
        raise ValueError(f"silu_out needs the split batch-1 GEMV with tiles of a half's columns; "
                         f"got M={m}, N={n}, {cfg}")
    per_word = 32 // bits
    if cfg.whole_k:
        if cfg.block_m != 1 or k % cfg.block_k or n % cfg.block_n or (
                cfg.block_k % (2 * per_word)):
            raise ValueError(f"the whole-K GEMV serves K % block_k == 0 == "
                             f"N % block_n and block_k a multiple of {2 * per_word}; got M={m}, "
                             f"K={k}, N={n}, block_k={cfg.block_k}, block_n={cfg.block_n}")
    elif cfg.block_m == 1 and (cfg.block_k % (2 * per_word)
                               or (group_size < k and group_size % cfg.block_k)):
        raise ValueError(f"GEMV block_k {cfg.block_k} must be a multiple of {2 * per_word} "
                         f"dividing group_size {group_size}")
    elif cfg.block_m > 1 and (cfg.block_k % per_word
                              or (group_size < k and group_size % cfg.block_k)):
        # a tile reads one group's scales and zeros
        raise ValueError(f"block_k {cfg.block_k} must be a multiple of {per_word} dividing "
                         f"group_size {group_size}")
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    if cfg.block_m == 1:
        f16x2 = (cfg.f16x2 and bits == 4 and x.dtype in (torch.float16, torch.bfloat16)
                 and x.is_cuda and not triton.knobs.runtime.interpret)
        # the kernel reads x's rows as int64 quads (f16x2) and the weights' rows whole
        if x.stride(1) != 1 or (f16x2 and (x.stride(0) % 4 or x.data_ptr() % 8)):
            x = x.contiguous() if x.stride(1) != 1 or x.stride(0) % 4 else x.clone()
        if qweight.stride(-1) != 1 or scales.stride(-1) != 1:
            qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if cfg.whole_k:
            if blocked:
                strides = (qweight.stride(0), qweight.stride(1), scales.stride(0),
                           scales.stride(1))
            else:
                strides = (cfg.block_n, qweight.stride(0), cfg.block_n, scales.stride(0))
            if m > 1 and (rows := gemv_rows(over := gemv_overrides(
                    os.environ.get("KVFLEET_W4A16_GEMV", "")))) > 1:   # (batch 1 reads no setting)
                rows = min(rows, 2 if m <= 2 else 4)
                # steps of at most 1024 rows for 4 rows of x (sm_90, 8 warps: 128 registers,
                # 2 programs a SM; 2048-row steps took 178), 2048 for 2 (128)
                block_k = over.get("block_k", min(cfg.block_k, 1024 if rows == 4 else 2048))
                if k % block_k or block_k % (2 * per_word):
                    block_k = cfg.block_k
                _w4a16_gemv_rows_kernel[(triton.cdiv(m, rows), n // cfg.block_n)](
                    x, qweight, scales, zeros, out, m, n, k, group_size, x.stride(0), *strides,
                    BITS=bits, BLOCK_N=cfg.block_n, BLOCK_KW=block_k // per_word,
                    F16X2=f16x2, ROWS=rows, num_warps=cfg.num_warps, num_stages=1,
                    **({"maxnreg": over["maxnreg"]} if over.get("maxnreg") else {}),
                    **pdl_args(x.device))
                return out
            _w4a16_gemv_whole_k_kernel[(m, n // cfg.block_n)](
                x, qweight, scales, zeros, out, n, k, group_size, x.stride(0), *strides,
                BITS=bits, BLOCK_N=cfg.block_n,
                BLOCK_KW=cfg.block_k // per_word, F16X2=f16x2, num_warps=cfg.num_warps,
                num_stages=1, **_register_cap(cfg), **pdl_args(x.device))
            return out
        part, count = workspace(x.device, m, n, cfg.split_k, grid[1])
        act = pairs = out     # never touched unless silu_out
        if silu_out:
            act = torch.empty((m, n // 2), dtype=x.dtype, device=x.device)
            key = (x.device, m, grid[1] // 2)
            pairs = _PAIR_COUNTERS.get(key)
            if pairs is None:     # first met eagerly, as the workspace
                pairs = _PAIR_COUNTERS[key] = torch.zeros(m * (grid[1] // 2), dtype=torch.int32,
                                                          device=x.device)
        _w4a16_gemv_kernel[grid](
            x, qweight, scales, zeros, out, part, count, act, pairs, m, n, k, group_size,
            cfg.split_k, x.stride(0), qweight.stride(0), scales.stride(0),
            BITS=bits, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_k // per_word, F16X2=f16x2,
            EVEN=k % cfg.block_k == 0 and n % cfg.block_n == 0, PREFETCH=cfg.prefetch,
            GATED=silu_out, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **_register_cap(cfg), **pdl_args(x.device))
        return act if silu_out else out
    if config is None and x.is_cuda and 0 < dequant_min_m() <= m and not (
            triton.knobs.runtime.interpret):
        return dequantized_gemm(x, qweight, scales, zeros, bits, group_size)
    if cfg.split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, out, m, n, k, group_size,
        x.stride(0), x.stride(1), *tiled_strides, out.stride(0), out.stride(1),
        BITS=bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, LB=lb, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if cfg.split_k == 1 else out.to(x.dtype)
