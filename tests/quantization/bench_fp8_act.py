"""H200 sweep of the fused SiLU-and-mul + per-token FP8 quantization (`silu_and_mul_fp8`, the
input of FP8 down projections): one pass over a row held in registers, or two passes (amax,
then the values) in BLOCK-wide steps, by warps; against the unfused bf16 `silu_and_mul` (one
write of bf16, no row reduction: what HBM allows). Every config's output must equal the
exact kernel's bit for bit unless fast (then the count of values that differ). Run on the GPU:
python3 tests/quantization/bench_fp8_act.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_w4a16 import graph_us  # noqa: E402
from kvfleet_kernels.activation import silu_and_mul, silu_and_mul_fp8  # noqa: E402
from kvfleet_kernels.fp8 import one_pass_block  # noqa: E402

# (one pass, BLOCK, num_warps, fast: approximate divisions, not bit-identical)
CONFIGS = [(True, 16384, 8, False), (True, 16384, 16, False), (False, 4096, 8, False),
           (True, 16384, 8, True), (True, 16384, 16, True), (True, 16384, 32, True)]


def main() -> None:
    inter = 14336           # Llama-3.1-8B
    print(torch.cuda.get_device_name(), "default", one_pass_block(inter))
    print(f"{'tokens':>7} {'config':>20} {'us':>9} {'TB/s':>6}")
    for tokens in (16384, 1024):
        x = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
        nbytes = tokens * (2 * inter * 2 + inter + 4)
        ref_q, ref_s = silu_and_mul_fp8(x, fast=False)     # the exact kernel
        us = graph_us(lambda x=x: silu_and_mul(x))
        print(f"{tokens:>7} {'bf16 silu_and_mul':>20} {us:9.1f} "
              f"{tokens * inter * 6 / us / 1e6:6.2f}")
        for cfg in CONFIGS:
            q, s = silu_and_mul_fp8(x, cfg[:3], fast=cfg[3])
            differ = (q.view(torch.uint8) != ref_q.view(torch.uint8)).sum().item()
            same = differ == 0 and torch.equal(s, ref_s)
            us = graph_us(lambda x=x, cfg=cfg: silu_and_mul_fp8(x, cfg[:3], fast=cfg[3]))
            print(f"{tokens:>7} {str(cfg):>20} {us:9.1f} {nbytes / us / 1e6:6.2f}"
                  f"{'' if same else f'  DIFFERS in {differ} of {q.numel()} values'}")


if __name__ == "__main__":
    main()
