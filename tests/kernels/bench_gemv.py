"""Time the batch-1 Triton GEMV against torch (cuBLAS) on Llama-3.1-8B's projection shapes.

Run on a GPU: python tests/kernels/bench_gemv.py [--weights bf16|fp8|int8] [--sweep] [--write-tuned PATH]
                [--shapes NAME,...] [--prefetch-only]
Both are replayed from CUDA graphs (as the engine's decode runs them) over weight copies 3x the
L2 cache in turn (each call's weight comes from HBM, as in the engine); TB/s = weight bytes /
time. The shapes are one layer's at TP=1 and at TP=2 (each rank's half). --write-tuned writes
the sweep's winners that beat cuBLAS by 3% or more as JSON for KVFLEET_GEMV_TUNED (with
KVFLEET_TRITON_GEMV=tuned the engine then runs those shapes at those tiles).
--weights fp8 / int8: 8-bit weights with per-row scales (the W8A16 GEMV that batch-1 FP8 and
W8A8 projections take; it has no cuBLAS twin): timed against pick_config's tiles, the winners
that beat those by 3% written with "weight_bytes": 1 (gemv.TUNED_8BIT's entries).
--shapes: only these SHAPES (by name, e.g. qkv_proj,lm_head); --prefetch-only: sweep only the
one-K-slice tiles that prefetch their next K tile (every H200 bf16 winner was one: a third of
the candidates, for a sweep that fits one device call with the runs that use its file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "quantization"))
from bench_w4a16 import copies_for, graph_us  # noqa: E402
from kvfleet_kernels import gemv as gv  # noqa: E402

# (name, N, K): one Llama-3.1-8B layer and lm_head, then a TP=2 rank's share of the layer
SHAPES = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
          ("down_proj", 4096, 14336), ("lm_head", 128256, 4096),
          ("tp2_qkv_proj", 3072, 4096), ("tp2_o_proj", 4096, 2048),
          ("tp2_gate_up", 14336, 4096), ("tp2_down_proj", 4096, 7168)]
# --sweep: (block_n, block_k, num_warps, num_stages, prefetch) x programs per SM
SWEEP = ([(bn, bk, w, st, False) for bn in (8, 16, 32) for bk in (256, 512, 1024)
          for w in (4, 8) for st in (2, 4)]
         + [(bn, bk, w, 1, True) for bn in (8, 16, 32) for bk in (256, 512, 1024)
            for w in (4, 8)])
SWEEP_PER_SM = (2, 4, 8, 16)
# 8-bit weights: half the bytes a row, so K tiles up to 2048
SWEEP_8BIT = ([(bn, bk, w, 2, False) for bn in (8, 16, 32) for bk in (512, 1024, 2048)
               for w in (4, 8)]
              + [(bn, bk, w, 1, True) for bn in (8, 16, 32) for bk in (512, 1024, 2048)
                 for w in (4, 8)])
SWEEP_8BIT_PER_SM = (1, 2, 4, 8)


def eight_bit_weights(n: int, k: int, dtype: str, dev: torch.device) -> torch.Tensor:
    """A random [n, k] fp8 (e4m3) or int8 weight (the scale is the caller's)."""
    if dtype == "int8":
        return torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
    return (torch.randn(n, k, device=dev) * 40).to(torch.float8_e4m3fn)


def sweep_best(x, ws, ref, candidates, per_sm_counts, sms, scale=None):
    """(us, GemvConfig) of the fastest candidate tile (x its split for each programs-a-SM
    count) whose output on ws[0] is within 2% of ref's largest value."""
    n, k = ws[0].shape
    best = None
    for (bn, bk, warps, stages, prefetch), per_sm in itertools.product(candidates, per_sm_counts):
        tiles, k_tiles = triton.cdiv(n, bn), triton.cdiv(k, bk)
        split = max(1, min(k_tiles, triton.cdiv(per_sm * sms, tiles)))
        cfg = gv.GemvConfig(bn, bk, split, warps, stages, prefetch)
        try:
            err = (gv.gemv(x, ws[0], None, cfg, scale=scale).float() - ref).abs().max().item()
            if not err <= 2e-2 * ref.abs().max().item():    # a fast wrong config must not win
                print(f"  WRONG {cfg}: off by {err:.3g}")
                continue
            t = graph_us([partial(gv.gemv, x, w, None, cfg, scale=scale) for w in ws], rep=20)
        except Exception as e:  # noqa: BLE001 - out of resources: skip the config
            print(f"  skip {cfg}: {type(e).__name__}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def _candidates(sweep: list[tuple], args) -> list[tuple]:
    """The sweep's tiles, only the prefetching ones with --prefetch-only."""
    return [c for c in sweep if c[4] or not args.prefetch_only]


def write_tuned(path: str | None, tuned: list[dict], what: str) -> None:
    """The winners so far, rewritten after each shape: a sweep its time limit cuts still
    leaves the shapes it finished."""
    if path:
        with open(path, "w") as f:
            json.dump(tuned, f, indent=1)
        print(f"{len(tuned)} shape(s) {what} so far -> {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--write-tuned", metavar="PATH",
                        help="with --sweep: the winners (>= 3%% faster than cuBLAS) as JSON")
    parser.add_argument("--weights", choices=("bf16", "fp8", "int8"), default="bf16")
    parser.add_argument("--shapes", help="comma-separated SHAPES names (default: all)")
    parser.add_argument("--prefetch-only", action="store_true",
                        help="with --sweep: only the tiles that prefetch their next K tile")
    args = parser.parse_args()
    known = [name for name, _, _ in SHAPES]
    wanted = args.shapes.split(",") if args.shapes else known
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {','.join(known)}")
    args.shape_list = [s for s in SHAPES if s[0] in wanted]
    if args.weights != "bf16":
        return main_8bit(args)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    device_name = torch.cuda.get_device_name(dev)
    print(f"{device_name}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'shape':<15}{'triton us':>10}{'TB/s':>7}{'cuBLAS us':>11}{'TB/s':>7}  config")
    tuned = []
    candidates = _candidates(SWEEP, args)
    for name, n, k in args.shape_list:
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        nbytes = n * k * 2
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
              for _ in range(copies_for(nbytes, dev))]
        ref = gv.gemv_ref(x, ws[0]).float()
        t_c = graph_us([partial(F.linear, x, w) for w in ws])
        t_t = graph_us([partial(gv.gemv, x, w) for w in ws])
        print(f"{name:<15}{t_t:>10.1f}{nbytes / t_t / 1e6:>7.2f}{t_c:>11.1f}"
              f"{nbytes / t_c / 1e6:>7.2f}  {gv.pick_config(1, n, k, dev)}", flush=True)
        if not args.sweep:
            continue
        best = sweep_best(x, ws, ref, candidates, SWEEP_PER_SM, sms)
        print(f"{'  best':<15}{best[0]:>10.1f}{nbytes / best[0] / 1e6:>7.2f}"
              f"{t_c / best[0]:>17.2f}x  {best[1]}", flush=True)
        if best[0] <= t_c / 1.03:
            tuned.append({"device": device_name, "n": n, "k": k, "triton_us": round(best[0], 2),
                          "cublas_us": round(t_c, 2), "config": best[1].__dict__})
        write_tuned(args.write_tuned, tuned, "faster than cuBLAS")


def main_8bit(args) -> None:
    """--weights fp8 / int8: the W8A16 GEMV at pick_config's tiles (and TUNED_8BIT's, where
    the shape has some), then with --sweep each SWEEP_8BIT tile; 1 byte a weight."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    device_name = torch.cuda.get_device_name(dev)
    print(f"{device_name}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{args.weights} weights")
    print(f"{'shape':<15}{'default us':>11}{'TB/s':>7}{'tuned us':>10}  default tiles")
    tuned = []
    candidates = _candidates(SWEEP_8BIT, args)
    for name, n, k in args.shape_list:
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        nbytes = n * k
        ws = [eight_bit_weights(n, k, args.weights, dev) for _ in range(copies_for(nbytes, dev))]
        scale = torch.rand(n, device=dev) * 1e-3 + 1e-4
        ref = gv.gemv_ref(x, ws[0], scale=scale).float()
        default = gv.pick_config(1, n, k, dev)
        t_d = graph_us([partial(gv.gemv, x, w, None, default, scale=scale) for w in ws])
        current = gv.tuned_config(n, k, dev, 1)
        t_cur = (graph_us([partial(gv.gemv, x, w, None, current, scale=scale) for w in ws])
                 if current is not None else float("nan"))
        print(f"{name:<15}{t_d:>11.1f}{nbytes / t_d / 1e6:>7.2f}{t_cur:>10.1f}  {default}",
              flush=True)
        if not args.sweep:
            continue
        best = sweep_best(x, ws, ref, candidates, SWEEP_8BIT_PER_SM, sms, scale)
        print(f"{'  best':<15}{best[0]:>11.1f}{nbytes / best[0] / 1e6:>7.2f}"
              f"{t_d / best[0]:>9.2f}x  {best[1]}", flush=True)
        if best[0] <= t_d / 1.03:
            tuned.append({"device": device_name, "n": n, "k": k, "weight_bytes": 1,
                          "triton_us": round(best[0], 2), "default_us": round(t_d, 2),
                          "config": best[1].__dict__})
        write_tuned(args.write_tuned, tuned, "faster than pick_config's tiles")


if __name__ == "__main__":
    main()
