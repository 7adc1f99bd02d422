"""W8A8 int8 linear: int8 weights with per-channel scales, activations quantized per token.

`int8_linear` quantizes the activation's rows to int8 (one Triton kernel: scale = max|x| of
the row times fp32(1/127), q = x / scale rounded half to even, saturated to [-128, 127]), then
one Triton GEMM runs the int8 x int8 -> int32 product on the integer tensor cores and scales the
sums in its epilogue (acc * x_scale * w_scale in fp32, + bias, rounded once to the output
dtype). `int8_linear_ref` computes the same in torch (exact integer sums) and is what it is
tested against: the integer product is exact, so the two agree bit for bit. (cuBLAS's integer
GEMM, torch._int_mm, ran at bf16's speed on an H100 where FP8 ran 1.7x faster, and needs an
epilogue pass over int32 sums: docs/PERFORMANCE.md, forty-second session.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.fp8 import _MIN_SCALE, MIN_SCALE

INT8_MAX = 127
_INV_INT8_MAX = torch.tensor(1.0 / INT8_MAX, dtype=torch.float32).item()   # fp32-rounded 1/127
INV_INT8_MAX = tl.constexpr(_INV_INT8_MAX)


def int8_supported(device: torch.device) -> bool:
    """Integer tensor cores (tl.dot of int8): Ampere and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def quantize_int8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (int8 [M, K], fp32 scales [M, 1]): scale = max(max|row|, 1e-12) * fp32(1/127),
    q = x / scale rounded half to even, saturated to [-128, 127]."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) * _INV_INT8_MAX
    q = torch.round(x.float() / scale).clamp(-128, INT8_MAX).to(torch.int8)
    return q, scale


@triton.jit
def _round_half_even(y):
    # rint for |y| < 2**22 (here |y| <= ~128): floor(y + 0.5), one less where y sat exactly
    # halfway and that landed on an odd integer (y + 0.5 is exact at these magnitudes)
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def int8_scale(amax):
    # the per-token scale of a row whose largest |value| is amax: max(amax, 1e-12) * fp32(1/127)
    return tl.maximum(amax, MIN_SCALE) * INV_INT8_MAX


@triton.jit
def int8_round(x, scale, FAST: tl.constexpr = False):
    # x / scale (IEEE round to nearest, as torch's division), rounded half to even, saturated
    # to [-128, 127], still in fp32. FAST: x times fp32(1 / scale) instead (one division a
    # row; a value sitting near a rounding boundary may land one step from the division's)
    if FAST:
        y = x * (1.0 / scale)
    else:
        y = tl.math.div_rn(x, scale)
    return tl.clamp(_round_half_even(y), -128.0, 127.0)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_per_token_ref in one Triton kernel ([M, K] with a contiguous last
    dimension; quant_row.quantize_rows to int8)."""
    from kvfleet_kernels.quant_row import quantize_rows  # quant_row imports this module

    return quantize_rows(x, torch.int8)


def int8_scale_ref(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int32 sums [M, N] -> acc * x_scale [M, 1] * w_scale [N] (+ bias) in fp32, in dtype."""
    out = acc.float() * x_scale.float() * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: int8 [N, K], weight_scale: fp32 [N] -> [M, N] in x's dtype."""
    q, x_scale = quantize_int8_per_token_ref(x)
    # exact integer sums through fp64 (|sum| < 2**53; CUDA has no integer matmul in torch)
    acc = (q.double() @ weight.double().t()).to(torch.int32)
    return int8_scale_ref(acc, x_scale, weight_scale, bias, x.dtype)


@dataclass(frozen=True)
class Int8Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# two waves of programs on an H100's / H200's 132 SMs: past it, 128 x 128 tiles keep every SM
# busy and reuse each tile better than 64 x 128 ones
_WAVES_TILES = 2 * 132


def pick_config(m: int, n: int, k: int, on_gpu: bool) -> Int8Config:
    """Tiles by row count (an H100 sweep, docs/PERFORMANCE.md, forty-fourth session): thin ones
    for decode batches (weight-bound: more programs over N), 128 x 128 ones once they fill two
    waves of the SMs (tensor-core bound, grouped for L2 reuse)."""
    if not on_gpu:      # the interpreter: few, wide programs
        return Int8Config(16 if m <= 16 else 32, 64, 64, 4, 1)
    if m <= 32:
        return Int8Config(16, 64, 256, 4, 4)
    if triton.cdiv(m, 128) * triton.cdiv(n, 128) < _WAVES_TILES:
        return Int8Config(64, 128, 128, 4, 4)
    return Int8Config(128, 128, 128, 8, 3)


# the GEMM's epilogue rounds each product as int8_scale_ref does: no fused multiply-adds
GEMM_LAUNCH = dict(enable_fp_fusion=False)


@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K, stride_am,
                      stride_bn, stride_cm, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    # C = (A @ B^T) * a_scale[:, None] * b_scale[None, :] (+ bias): A int8 [M, K] (per-token
    # quantized activations), B int8 [N, K] (the weight, K contiguous as the tensor cores take
    # it), int32 accumulation, the scales applied once in fp32 (int8_scale_ref's order: the
    # launch turns off fp fusion, which made the bias add an FMA with the scale's product).
    # Programs walk GROUP_M row tiles per column tile so neighbours share B tiles in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok, other=0)
            b = tl.load(b_ptrs, mask=n_ok, other=0)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=m_ok & (rk[None, :] < left), other=0)
            b = tl.load(b_ptrs, mask=n_ok & (rk[:, None] < left), other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)     # (Triton 3.6 asks for it by name)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_scale = tl.load(as_ptr + rm, mask=rm < M, other=0.0)
    b_scale = tl.load(bs_ptr + rn, mask=rn < N, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :],
             out.to(c_ptr.dtype.element_ty), mask=m_ok & n_ok)


def int8_gemm(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
              weight_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
              config: Int8Config | None = None) -> torch.Tensor:
    """(q [M, K] int8 @ weight [N, K] int8^T) * x_scale [M, 1] * weight_scale [N] (+ bias), in
    dtype: int8_scale_ref of the exact integer product, in one Triton kernel."""
    m, k = q.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or q.stride(1) != 1:
        raise ValueError(f"int8_gemm takes q [M, K] and weight [N, K] with contiguous rows; got "
                         f"{tuple(q.shape)} and {tuple(weight.shape)}")
    out = torch.empty((m, n), dtype=dtype, device=q.device)
    if m == 0:
        return out
    cfg = config or pick_config(m, n, k, q.is_cuda)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _int8_gemm_kernel[grid](q, weight, out, x_scale, weight_scale,
                            bias if bias is not None else out, m, n, k, q.stride(0),
                            weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                            EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m,
                            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            **GEMM_LAUNCH)
    return out


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, config: Int8Config | None = None
                ) -> torch.Tensor:
    """As int8_linear_ref: the activation quantized per token, then the int8 GEMM with the
    scales and bias applied in its epilogue (two Triton kernels)."""
    q, x_scale = quantize_int8_per_token(x if x.stride(-1) == 1 else x.contiguous())
    return int8_gemm(q, x_scale, weight, weight_scale, bias, x.dtype, config)
