"""GPU timing of the W8A8 int8 linear (`kvfleet_kernels.int8.int8_linear`: per-token int8
quantization, then the Triton int8 GEMM with the scales in its epilogue) against bf16 F.linear,
the FP8 linear (`fp8_linear`) and cuBLAS's integer GEMM alone (`torch._int_mm`, no scaling), at
Llama-3.1-8B's projection shapes, each in a CUDA graph. --sweep also times candidate tile
configs of the GEMM per row count (to set `pick_config` from). Run on the GPU:
python3 tests/quantization/bench_int8.py [--sweep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_w4a16 import graph_us  # noqa: E402
from kvfleet_kernels.fp8 import fp8_linear, quantize_fp8_rowwise  # noqa: E402
from kvfleet_kernels.int8 import (  # noqa: E402
    Int8Config,
    int8_gemm,
    int8_linear,
    pick_config,
    quantize_int8_per_token,
)

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
ROWS = (16, 256, 2048, 16384)
CANDIDATES = [Int8Config(bm, bn, bk, w, s) for bm, bn, bk, w, s in [
    (16, 64, 256, 4, 4), (16, 32, 256, 4, 4), (32, 64, 256, 4, 4), (64, 128, 128, 4, 4),
    (64, 256, 128, 8, 3), (128, 128, 128, 8, 3), (128, 128, 128, 4, 4), (128, 256, 128, 8, 3),
    (128, 256, 64, 8, 4), (256, 128, 128, 8, 3)]]


def _row(name: str, k: int, n: int, rows: int, w: torch.Tensor, w8: torch.Tensor,
         w_scale: torch.Tensor, wf8: torch.Tensor, wf8_scale: torch.Tensor, sweep: bool) -> None:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q, xs = quantize_int8_per_token(x)
    bf16 = graph_us(lambda: F.linear(x, w))
    fp8 = graph_us(lambda: fp8_linear(x, wf8, wf8_scale))
    int8 = graph_us(lambda: int8_linear(x, w8, w_scale))
    quant = graph_us(lambda: quantize_int8_per_token(x))
    gemm = graph_us(lambda: int8_gemm(q, xs, w8, w_scale, None, torch.bfloat16))
    qp = torch.cat([q, q.new_zeros(max(0, 17 - rows), k)])     # _int_mm takes > 16 rows
    int_mm = graph_us(lambda: torch._int_mm(qp, w8.t()))
    print(f"{name:>8} {rows:>6} {bf16:9.1f} {fp8:9.1f} {int8:9.1f} {quant:7.1f} {gemm:8.1f} "
          f"{int_mm:8.1f} {2 * rows * n * k / gemm / 1e6:10.1f}  {pick_config(rows, n, k, True)}")
    if sweep:
        ref = int8_gemm(q, xs, w8, w_scale, None, torch.bfloat16)
        for cfg in CANDIDATES:
            try:
                out = int8_gemm(q, xs, w8, w_scale, None, torch.bfloat16, cfg)
                us = graph_us(lambda cfg=cfg: int8_gemm(q, xs, w8, w_scale, None,
                                                        torch.bfloat16, cfg))
            except Exception as e:   # noqa: BLE001 - a config that does not compile here
                print(f"{'':>16} {cfg}: {type(e).__name__}")
                continue
            same = "" if torch.equal(out, ref) else "  DIFFERS"
            print(f"{'':>16} {us:9.1f} us {2 * rows * n * k / us / 1e6:7.1f} TOPS  {cfg}{same}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    print(f"{'shape':>8} {'rows':>6} {'bf16 us':>9} {'fp8 us':>9} {'int8 us':>9} "
          f"{'quant':>7} {'gemm':>8} {'_int_mm':>8} {'gemm TOPS':>10}  config")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w8 = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        w_scale = torch.rand(n, device="cuda") * 1e-3
        wf8, wf8_scale = quantize_fp8_rowwise(w)
        for rows in ROWS:
            _row(name, k, n, rows, w, w8, w_scale, wf8, wf8_scale.reshape(-1), args.sweep)


if __name__ == "__main__":
    main()
