"""GPU timing of the W8A8 int8 linear (`kvfleet_kernels.int8.int8_linear`: per-token int8
quantization, cuBLAS's integer GEMM, the scaling epilogue) against bf16 F.linear and the FP8
linear (`fp8_linear`) at Llama-3.1-8B's projection shapes, each in a CUDA graph, with the
int8 pieces timed alone. Run on the GPU: python3 tests/quantization/bench_int8.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_w4a16 import graph_us  # noqa: E402
from kvfleet_kernels.fp8 import fp8_linear, quantize_fp8_rowwise  # noqa: E402
from kvfleet_kernels.int8 import int8_linear, int8_scale, quantize_int8_per_token  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}


def _row(name: str, k: int, n: int, rows: int, w: torch.Tensor, w8: torch.Tensor,
         w_scale: torch.Tensor, wf8: torch.Tensor, wf8_scale: torch.Tensor) -> None:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    padded = max(rows, 17)
    q, xs = quantize_int8_per_token(x, padded)
    acc = torch._int_mm(q, w8.t())
    bf16 = graph_us(lambda: F.linear(x, w))
    fp8 = graph_us(lambda: fp8_linear(x, wf8, wf8_scale))
    int8 = graph_us(lambda: int8_linear(x, w8, w_scale))
    quant = graph_us(lambda: quantize_int8_per_token(x, padded))
    mm = graph_us(lambda: torch._int_mm(q, w8.t()))
    scale = graph_us(lambda: int8_scale(acc, xs, w_scale, None, torch.bfloat16, rows))
    print(f"{name:>8} {rows:>6} {bf16:9.1f} {fp8:9.1f} {int8:9.1f} {quant:7.1f} "
          f"{mm:8.1f} {scale:7.1f} {2 * rows * n * k / int8 / 1e6:10.1f}")


def main() -> None:
    print(torch.cuda.get_device_name())
    print(f"{'shape':>8} {'rows':>6} {'bf16 us':>9} {'fp8 us':>9} {'int8 us':>9} "
          f"{'quant':>7} {'int_mm':>8} {'scale':>7} {'int8 TOPS':>10}")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w8 = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        w_scale = torch.rand(n, device="cuda") * 1e-3
        wf8, wf8_scale = quantize_fp8_rowwise(w)
        for rows in (16, 256, 2048, 16384):
            _row(name, k, n, rows, w, w8, w_scale, wf8, wf8_scale.reshape(-1))


if __name__ == "__main__":
    main()
