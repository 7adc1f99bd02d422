"""W8A8 int8 linear (kvfleet_kernels.int8): the per-token int8 quantization kernel, the int8
GEMM with its scaling epilogue and int8_linear against their torch references, bit for bit (the
integer product is exact, the fp32 arithmetic the same operations in the same order). On a CPU
the kernels run in Triton's interpreter; the gpu-marked cases run them compiled at Llama shapes,
every tile config of pick_config."""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.fp8 import _ONE_PASS_MAX
from kvfleet_kernels.int8 import (
    Int8Config,
    int8_gemm,
    int8_linear,
    int8_linear_ref,
    int8_scale_ref,
    pick_config,
    quantize_int8_per_token,
    quantize_int8_per_token_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16]


def _rows(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    # rows of sizes 0.1 to 10; row 0 all zero (the minimum scale, no NaN)
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-1, 1, rows)[:, None]
    t[0] = 0.0
    return t.to(dtype=dtype, device=DEVICE)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 1e-3 + 1e-4
    return w.to(DEVICE), scale.to(DEVICE)


def _assert_quantized_like_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_int8_per_token(x)
    q_ref, scale_ref = quantize_int8_per_token_ref(x)
    assert q.dtype == torch.int8 and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)
    return q, scale


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_int8_quantization_matches_reference_and_uses_the_range(dtype: torch.dtype) -> None:
    x = _rows(6, 96, dtype, seed=1)
    q, scale = _assert_quantized_like_ref(x)
    assert (q[0] == 0).all()                                   # a zero row stays zero
    # each other row reaches +-127 at its largest value and dequantizes within half a step
    assert (q[1:].abs().amax(dim=1) == 127).all()
    error = (q.float() * scale - x.float()).abs()
    assert (error <= scale * 0.5 * (1 + 1e-5)).all()


def test_int8_quantization_rounds_ties_to_even() -> None:
    # values exactly halfway between two steps: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2 (torch.round's)
    x = torch.zeros(1, 16, device=DEVICE)
    x[0, 0] = 127.0                                  # amax: scale = 127 * fp32(1/127)
    _, scale = quantize_int8_per_token_ref(x)
    halves = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -2.5, -3.5, 100.5], device=DEVICE)
    x[0, 1:9] = halves * scale[0, 0]
    ties = x[0, 1:9].float() / scale[0, 0]
    assert torch.equal(ties, halves)                 # the quotients are exact ties
    q, _ = _assert_quantized_like_ref(x)
    assert q[0, 1:9].tolist() == [0, 2, 2, 4, 0, -2, -4, 100]


def test_int8_quantization_of_rows_longer_than_one_pass() -> None:
    _assert_quantized_like_ref(_rows(3, _ONE_PASS_MAX + 100, torch.float32, seed=2))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "k", "config"), [
    (70, 256, None),                                  # K a multiple of the tile: no K masks
    (5, 200, Int8Config(16, 32, 64, 4, 1, 2)),        # K ragged; one row tile
    (40, 96, Int8Config(16, 32, 32, 4, 1, 2)),        # groups of row tiles over column tiles
], ids=["even-k", "ragged-k", "grouped"])
def test_int8_gemm_is_the_exact_product_scaled(dtype: torch.dtype, with_bias: bool, m: int,
                                               k: int, config: Int8Config | None) -> None:
    g = torch.Generator().manual_seed(m + k)
    q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8).to(DEVICE)
    x_scale = (torch.rand(m, 1, generator=g) * 1e-2).to(DEVICE)
    w, w_scale = _weight(150, k, seed=3)
    bias = torch.randn(150, generator=g).to(dtype=dtype, device=DEVICE) if with_bias else None
    out = int8_gemm(q, x_scale, w, w_scale, bias, dtype, config)
    acc = (q.double() @ w.double().t()).to(torch.int32)
    assert out.dtype == dtype and torch.equal(out, int8_scale_ref(acc, x_scale, w_scale, bias,
                                                                  dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_int8_linear_matches_reference_and_the_unquantized_product(dtype: torch.dtype,
                                                                   m: int) -> None:
    x = _rows(m, 128, dtype, seed=4 + m) + 0.01
    w, w_scale = _weight(96, 128, seed=5)
    bias = torch.randn(96, device=DEVICE).to(dtype)
    out = int8_linear(x, w, w_scale, bias)
    assert out.dtype == dtype and out.shape == (m, 96)
    assert torch.equal(out, int8_linear_ref(x, w, w_scale, bias))
    # and it is the product: within the activations' int8 rounding of x @ dequantized w
    exact = x.float() @ (w.float() * w_scale[:, None]).t() + bias.float()
    assert ((out.float() - exact).norm() / exact.norm()) < 0.02


# ----------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_int8_linear_is_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    # Llama-3.1-8B's qkv (4096 -> 6144) and down (14336 -> 4096) shapes at each of
    # pick_config's tile configs (decode batches, mid, prefill), ragged row counts
    configs = set()
    for k, n in [(4096, 6144), (14336, 4096)]:
        w, w_scale = _weight(n, k, seed=k)
        bias = torch.randn(n, device=DEVICE).to(dtype)
        for m in (1, 9, 33, 300, 2048):
            configs.add(pick_config(m, n, k, True))
            x = _rows(m, k, dtype, seed=m)
            assert torch.equal(int8_linear(x, w, w_scale, bias),
                               int8_linear_ref(x, w, w_scale, bias)), (k, m)
    assert len(configs) == 3
