"""Time the batch-1 Triton GEMV against torch (cuBLAS) on Llama-3.1-8B's projection shapes.

Run on a GPU: python tests/kernels/bench_gemv.py [--sweep]
Both are replayed from CUDA graphs (as the engine's decode runs them); TB/s = weight bytes / time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "quantization"))
from bench_w4a16 import graph_us  # noqa: E402
from kvfleet_kernels import gemv as gv  # noqa: E402

SHAPES = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
          ("down_proj", 4096, 14336), ("lm_head", 128256, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'shape':<14}{'triton us':>10}{'TB/s':>7}{'cuBLAS us':>11}{'TB/s':>7}  config")
    for name, n, k in SHAPES:
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        nbytes = n * k * 2
        t_c = graph_us(partial(F.linear, x, w))
        t_t = graph_us(partial(gv.gemv, x, w))
        print(f"{name:<14}{t_t:>10.1f}{nbytes / t_t / 1e6:>7.2f}{t_c:>11.1f}{nbytes / t_c / 1e6:>7.2f}"
              f"  {gv.pick_config(1, n, k, dev)}")
        if args.sweep:
            best = None
            for bn, bk, warps, stages, per_sm in itertools.product(
                    (8, 16, 32), (256, 512, 1024), (4, 8), (2, 4), (2, 4, 8)):
                tiles, k_tiles = triton.cdiv(n, bn), triton.cdiv(k, bk)
                split = max(1, min(k_tiles, triton.cdiv(per_sm * sms, tiles)))
                cfg = gv.GemvConfig(bn, bk, split, warps, stages)
                try:
                    t = graph_us(partial(gv.gemv, x, w, None, cfg), rep=20)
                except Exception as e:  # noqa: BLE001 - out of resources: skip the config
                    print(f"  skip {cfg}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            print(f"{'  best':<14}{best[0]:>10.1f}{nbytes / best[0] / 1e6:>7.2f}{'':>18}  {best[1]}")


if __name__ == "__main__":
    main()
