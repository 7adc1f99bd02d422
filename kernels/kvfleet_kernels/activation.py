"""The gated MLP activation SiLU(gate) * up: torch reference and Triton twin.

`silu_and_mul_fp8` writes the same output quantized per token to e4m3 (the input of an FP8
down_proj): silu_and_mul followed by quantize_fp8_rowwise_triton, one kernel (bit for bit in the
interpreter and, measured, on the H200). `silu_and_mul_int8` the same to int8 (a W8A8
down_proj's input): silu_and_mul followed by int8.quantize_int8_per_token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.fp8 import FP8, one_pass_block, quantize_fp8_per_token_ref
from kvfleet_kernels.int8 import quantize_int8_per_token_ref
from kvfleet_kernels.pdl import pdl_args, pdl_wait
from kvfleet_kernels.quant_row import row_quantize, row_scale


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> [T, I], computed in fp32 and rounded once to x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2I] -> (e4m3 [T, I], fp32 scales [T, 1]): silu_and_mul_ref's output quantized per
    token as quantize_fp8_per_token_ref does."""
    return quantize_fp8_per_token_ref(silu_and_mul_ref(x))


def silu_and_mul_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2I] -> (int8 [T, I], fp32 scales [T, 1]): silu_and_mul_ref's output quantized per
    token as quantize_int8_per_token_ref does."""
    return quantize_int8_per_token_ref(silu_and_mul_ref(x))


@triton.jit
def silu_mul_row(x_row, i, mask, INTER, FAST: tl.constexpr = False):
    # columns i of one row's SiLU(gate) * up (the up half starts INTER elements in), in fp32,
    # rounded to x's dtype; also the input of gemv's gated GEMV. FAST: the approximate
    # division (div.full, <= 2 ulp) instead of IEEE's
    gate = tl.load(x_row + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + INTER + i, mask=mask, other=0.0).to(tl.float32)
    return silu_mul(gate, up, x_row.dtype.element_ty, FAST)


@triton.jit
def silu_mul(gate, up, OUT_DTYPE: tl.constexpr, FAST: tl.constexpr = False):
    # SiLU(gate) * up of fp32 values, rounded to OUT_DTYPE (silu_mul_row's arithmetic; also the
    # W4A16 GEMV's gated output, split_k.meet_gate_up)
    if FAST:
        silu = tl.fdiv(gate, 1.0 + tl.exp(-gate), ieee_rounding=False)
    else:
        silu = gate / (1.0 + tl.exp(-gate))
    return (silu * up).to(OUT_DTYPE)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < INTER
    tl.store(out_ptr + row * stride_o + i, silu_mul_row(x_ptr + row * stride_x, i, mask, INTER),
             mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, INTER: tl.constexpr,
                               BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                               PDL: tl.constexpr = False, FAST: tl.constexpr = False,
                               INT8: tl.constexpr = False):
    # One program per row, as quant_row's _quantize_rows_kernel: a row longer than its one-pass
    # limit is computed twice (amax, then the values), instead of written and read back. q is
    # e4m3 or, INT8, int8 (quant_row's row_scale / row_quantize).
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < INTER
        y = silu_mul_row(x_row, offs, mask, INTER, FAST).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), 0), INT8)
        q = row_quantize(y, scale, INT8, FAST)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, INTER, BLOCK):
            mask = start + offs < INTER
            y = silu_mul_row(x_row, start + offs, mask, INTER).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = row_scale(tl.max(amax, 0), INT8)
        for start in range(0, INTER, BLOCK):
            mask = start + offs < INTER
            y = silu_mul_row(x_row, start + offs, mask, INTER).to(tl.float32)
            tl.store(q_row + start + offs,
                     row_quantize(y, scale, INT8, False).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def _check(x: torch.Tensor) -> int:
    width = x.shape[1]
    if width % 2:
        raise ValueError(f"x must be [T, 2 * intermediate_size]; got last dimension {width} (odd)")
    if x.stride(-1) != 1:
        raise ValueError(f"x must have a contiguous last dimension; got strides {tuple(x.stride())}")
    return width // 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of `silu_and_mul_ref`."""
    inter = _check(x)
    num_tokens = x.shape[0]
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, **pdl_args(x.device))
    return out


def _silu_and_mul_quant(x: torch.Tensor, dtype: torch.dtype,
                        config: tuple[bool, int, int] | None, fast: bool | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    inter = _check(x)
    num_tokens = x.shape[0]
    q = torch.empty(num_tokens, inter, dtype=dtype, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens:
        one_pass, block, num_warps = config or one_pass_block(inter)
        if fast is None:
            fast = x.is_cuda
        if config is None and one_pass and block >= 16384:
            # H200 sweep (bench_fp8_act.py, Llama-3.1-8B's 14336): 16 warps, 32 values a thread,
            # beat one_pass_block's 8: 550 -> 462 us at 16384 tokens, 42.0 -> 34.8 at 1024
            num_warps = 16
        if one_pass and block < inter:
            raise ValueError(f"a one-pass BLOCK ({block}) must hold the whole row ({inter})")
        _silu_and_mul_quant_kernel[(num_tokens,)](
            x, q, scale, x.stride(0), q.stride(0), INTER=inter, BLOCK=block, ONE_PASS=one_pass,
            FAST=bool(fast and one_pass), INT8=dtype == torch.int8, num_warps=num_warps,
            **pdl_args(x.device))
    return q, scale


def silu_and_mul_fp8(x: torch.Tensor, config: tuple[bool, int, int] | None = None,
                     fast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `silu_and_mul_fp8_ref`, the same as silu_and_mul followed by
    quantize_fp8_rowwise_triton: (e4m3 [T, I], fp32 scales [T, 1]). config: (one pass, BLOCK,
    num_warps) instead of one_pass_block's (tests/quantization/bench_fp8_act.py sweeps them).

    fast (default: on a GPU, one-pass rows): SiLU's division approximate (<= 2 ulp) and each
    value times the row's 1 / scale instead of divided by the scale. The H200 sweep: 473 ->
    306 us at 16384 x 14336 (the IEEE divisions made the kernel compute-bound), 36 -> 24 us at
    1024 rows; 454 of 234,881,024 e4m3 values one step from the exact kernel's."""
    return _silu_and_mul_quant(x, FP8, config, fast)


def silu_and_mul_int8(x: torch.Tensor, config: tuple[bool, int, int] | None = None,
                      fast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `silu_and_mul_int8_ref`, the same as silu_and_mul followed by
    quantize_int8_per_token: (int8 [T, I], fp32 scales [T, 1]). config, fast: as
    silu_and_mul_fp8's (fast: a value near a rounding boundary may land one int8 step off)."""
    return _silu_and_mul_quant(x, torch.int8, config, fast)
