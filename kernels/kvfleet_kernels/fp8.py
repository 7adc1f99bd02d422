"""FP8 (e4m3) linear: per-channel weight scales, dynamic per-token activation scales.

fp8_linear runs torch._scaled_mm (cuBLASLt FP8 GEMM with row-wise scales, fast accumulation
unless KVFLEET_FP8_FAST_ACCUM=0) on GPUs of compute capability >= 8.9 (Ada, Hopper);
fp8_linear_ref computes the same quantized product in fp32 and is what it is tested against. The activations' per-token quantization before each GEMM is
one Triton kernel on the GPU (`quantize_fp8_rowwise_triton`, bit-identical to its torch twin
`quantize_fp8_per_token_ref`, which takes ~7 kernels and fp32 temporaries of the whole
activation). The producers of three of a decoder layer's four GEMM inputs (RMSNorm, SiLU-and-mul)
can write them quantized themselves (`rms_norm_fp8`, `silu_and_mul_fp8`, through `fp8_scale` and
`fp8_quantize` below, bit-identical to this kernel on their output); fp8_linear then takes the
pair (x_scale) and skips the kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max        # 448
_MIN_SCALE = 1e-12                     # an all-zero row still gets a finite scale
_INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()   # fp32-rounded 1/448


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each row of t: [R, C] to the fp8 range. Returns (fp8 [R, C], fp32 scales [R, 1])."""
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) / FP8_MAX
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


FP8_E4M3_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(_MIN_SCALE)
INV_FP8_E4M3_MAX = tl.constexpr(_INV_FP8_MAX)
_ONE_PASS_MAX = 16384      # a row this long stays in registers (8 warps: 64 values a thread)


@triton.jit
def fp8_scale(amax):
    # the per-token scale of a row whose largest |value| is amax: max(amax, 1e-12) * fp32(1/448)
    return tl.maximum(amax, MIN_SCALE) * INV_FP8_E4M3_MAX


@triton.jit
def fp8_quantize(x, scale):
    # x / scale is IEEE round-to-nearest (div_rn), as torch's tensor division is; saturated to
    # e4m3's range (the caller's cast to e4m3 rounds to nearest)
    return tl.clamp(tl.math.div_rn(x, scale), -FP8_E4M3_MAX, FP8_E4M3_MAX)


def one_pass_block(cols: int) -> tuple[bool, int, int]:
    """(one pass, BLOCK, num_warps) of a per-row quantization over rows of `cols` values."""
    one_pass = cols <= _ONE_PASS_MAX
    block = triton.next_power_of_2(cols) if one_pass else 4096
    return one_pass, block, 8 if block >= 8192 else 4


def quantize_fp8_per_token_ref(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What quantize_fp8_rowwise_triton computes: quantize_fp8_rowwise with the scale taken as
    amax times the fp32-rounded 1/448 (what torch on CUDA does for `/ 448`; a CPU divides
    exactly, which can differ in the scale's last bit)."""
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) * _INV_FP8_MAX
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_fp8_rowwise_triton(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_per_token_ref in one Triton kernel (rows with a contiguous last dimension):
    the per-token activation quantization of fp8_linear (quant_row.quantize_rows to e4m3)."""
    from kvfleet_kernels.quant_row import quantize_rows  # quant_row imports this module

    return quantize_rows(t, FP8)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: fp8 [N, K], weight_scale: fp32 [N] -> [M, N] in x's dtype."""
    xq, x_scale = quantize_fp8_rowwise(x)
    out = (xq.float() * x_scale) @ (weight.float() * weight_scale.float()[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fast_accum_default() -> bool:
    """KVFLEET_FP8_FAST_ACCUM (default 1): FP8 GEMMs accumulate in the tensor cores' own
    accumulators over the whole K instead of promoting partial sums to fp32 every 128 values,
    as vLLM's CUTLASS FP8 kernels on Hopper do (their FP8FastAccum schedules). 0: promote."""
    value = os.environ.get("KVFLEET_FP8_FAST_ACCUM", "1")
    if value not in ("0", "1"):
        raise ValueError(f"KVFLEET_FP8_FAST_ACCUM must be 0 or 1; got {value!r}")
    return value == "1"


_FAST_ACCUM = fast_accum_default()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, fast_accum: bool | None = None
               ) -> torch.Tensor:
    """As fp8_linear_ref, on the GPU's FP8 tensor cores (K and N multiples of 16).

    With x_scale, x is the activation already quantized per token (e4m3 [M, K] and fp32 [M, 1]
    scales, as quantize_fp8_rowwise_triton, rms_norm_fp8 and silu_and_mul_fp8 return them) and
    out_dtype is the output's dtype (the unquantized activation's). fast_accum: None takes
    fast_accum_default()."""
    if x_scale is None:
        out_dtype = x.dtype
        x, x_scale = quantize_fp8_rowwise_triton(x if x.stride(-1) == 1 else x.contiguous())
    elif out_dtype is None or x.dtype != FP8:
        raise ValueError(f"fp8_linear with x_scale takes x in {FP8} and an out_dtype; got x in "
                         f"{x.dtype}, out_dtype {out_dtype}")
    # row-wise scaling in _scaled_mm produces bf16 only; weight.t() is the column-major operand
    if fast_accum is None:
        fast_accum = _FAST_ACCUM
    out = torch._scaled_mm(x, weight.t(), scale_a=x_scale,
                           scale_b=weight_scale.float().reshape(1, -1), out_dtype=torch.bfloat16,
                           use_fast_accum=fast_accum)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)
