"""Time the mixture-of-experts kernels on Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes.

Run on a GPU: python tests/kernels/bench_moe.py [--sweep] [--int4] [--tokens 1,8,256]
Each figure is a call's GPU time replayed from a CUDA graph (as the engine's decode runs it)
over 8 routings in turn (random top-k ids; a layer's experts, 1.2 / 2.8 GB, are far past L2).
Rows: the router (torch ops vs moe_route), the grouping (moe_align's torch ops vs the one-launch
kernel) and fused_moe through the GEMV kernels and the grouped GEMM at their default tiles;
GB/s = the distinct experts' weight bytes a call reads / its time. --sweep: the tiles of both
paths at each token count, the best first (a tile that fails to compile or run: inf).
--int4: also the same experts as int4 IntExperts (groups of 128, random words) through both
paths at their default tiles (GB/s over their words, scales and zeros); with --sweep also the
GEMV tiles of the int4 experts (--int4-only: those alone); --act-order: the int4 experts
act-order (each expert's inputs in a random order of its own, gathered through IntExperts.perm).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "quantization"))
from bench_w4a16 import graph_us  # noqa: E402
from kvfleet_kernels import moe  # noqa: E402

# (name, experts, top_k, hidden, intermediate)
SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768), ("mixtral-8x7b", 8, 2, 4096, 14336)]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096]
GEMV_SWEEP = [moe.GemvTiles(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (128, 256, 512)
              for w in (4, 8)]
# int4 experts: 32 to 128 words of a row a tile
INT_GEMV_SWEEP = [moe.GemvTiles(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024)
                  for w in (4, 8)]
GROUPED_SWEEP = [moe.GroupedTiles(bm, bn, bk, w, 3) for bm in (16, 32, 64) for bn in (64, 128)
                 for bk in (64, 128) for w in (4, 8)]
# prefill-sized steps also try taller blocks and deeper pipelines
PREFILL_SWEEP = [moe.GroupedTiles(bm, bn, bk, w, st) for bm in (64, 128) for bn in (128, 256)
                 for bk in (64, 128) for w in (4, 8) for st in (3, 4) if (bm, st) != (64, 3)]
ROUTINGS = 8
DTYPE = torch.bfloat16
INT_GROUP = 128


def _routings(tokens, experts, top_k, hidden, dev):
    out = []
    for _ in range(ROUTINGS):
        logits = torch.randn(tokens, experts, device=dev)
        weights, ids = moe.moe_route_ref(logits, top_k, True)
        x = torch.randn(tokens, hidden, device=dev, dtype=DTYPE)
        out.append((x, logits, weights, ids))
    return out


def _bytes(ids, hidden, inter, per_weight: float = 2.0) -> float:
    return float(sum(r[3].unique().numel() for r in ids)) / len(ids) * 3 * hidden * inter * \
        per_weight


def _int4_experts(experts, rows, k, dev, act_order: bool = False) -> moe.IntExperts:
    # random words (any word is 8 valid 4-bit values), scales about a bf16 expert's 0.02 std
    words = torch.randint(-2 ** 31, 2 ** 31, (experts, rows, k // 8), device=dev,
                          dtype=torch.int32)
    groups = (experts, rows, k // INT_GROUP)
    perm = torch.stack([torch.randperm(k, device=dev) for _ in range(experts)]).to(torch.int32) \
        if act_order else None
    return moe.IntExperts(words, torch.full(groups, 0.005, device=dev, dtype=torch.float16),
                          torch.full(groups, 8.0, device=dev, dtype=torch.float16), 4, INT_GROUP,
                          perm)


def _time(fn, routings) -> float:
    try:
        return graph_us([partial(fn, *r) for r in routings])
    except Exception as err:           # a tile the kernel cannot take (shared memory)
        print(f"    failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
        return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument("--int4", action="store_true")
    parser.add_argument("--int4-only", action="store_true",
                        help="with --sweep: sweep the int4 experts' GEMV tiles only")
    parser.add_argument("--act-order", action="store_true",
                        help="with --int4: the int4 experts act-order (inputs gathered)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    for name, experts, top_k, hidden, inter in SHAPES:
        if name not in args.shapes.split(","):
            continue
        w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=DTYPE) * 0.02
        w2 = torch.randn(experts, hidden, inter, device=dev, dtype=DTYPE) * 0.02
        int13 = _int4_experts(experts, 2 * inter, hidden, dev, args.act_order) \
            if args.int4 else None
        int2 = _int4_experts(experts, hidden, inter, dev, args.act_order) if args.int4 else None
        print(f"== {name}: {experts} experts, top {top_k}, hidden {hidden}, inter {inter}")
        print(f"{'tokens':>7}{'route':>8}{'kernel':>8}{'align':>8}{'kernel':>8}"
              f"{'gemv us':>9}{'GB/s':>7}{'grouped':>9}{'GB/s':>7}"
              + (f"{'int4 gemv':>10}{'GB/s':>7}{'int4 grp':>10}{'GB/s':>7}" if args.int4 else "")
              + "  (us)")
        for tokens in map(int, args.tokens.split(",")):
            routings = _routings(tokens, experts, top_k, hidden, dev)
            nbytes = _bytes(routings, hidden, inter)
            x, _, weights, ids = routings[0]
            ref = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids) \
                if tokens <= 16 else None
            route_t = _time(partial(_route, moe.moe_route_ref, top_k), routings)
            route_k = _time(partial(_route, moe.moe_route, top_k), routings)
            align_t = _time(partial(_align, moe.moe_align, experts), routings)
            align_k = _time(partial(_align, moe.moe_align_triton, experts), routings) \
                if tokens * top_k <= 16384 else float("nan")
            run = partial(_experts, w13, w2)

            gemv_us = _time(run(True), routings) if tokens <= 64 else float("nan")
            grouped_us = _time(run(False), routings)
            if ref is not None:                          # both paths still right
                for gemv in (True, False):
                    out = moe.fused_moe(x, w13, w2, weights, ids, gemv=gemv).float()
                    err = float((out - ref).abs().max() / ref.abs().max())
                    assert err < 2e-2, (name, tokens, gemv, err)
            row = (f"{tokens:>7}{route_t:>8.1f}{route_k:>8.1f}{align_t:>8.1f}{align_k:>8.1f}"
                   f"{gemv_us:>9.1f}{nbytes / gemv_us / 1e3:>7.0f}{grouped_us:>9.1f}"
                   f"{nbytes / grouped_us / 1e3:>7.0f}")
            if args.int4:
                # a weight's half byte plus its group's fp16 scale and zero
                int_bytes = _bytes(routings, hidden, inter, 0.5 + 4 / INT_GROUP)
                int_run = partial(_experts, int13, int2)
                int_gemv = _time(int_run(True), routings) if tokens <= 64 else float("nan")
                int_grouped = _time(int_run(False), routings)
                if tokens <= 16:
                    int_ref = moe.fused_moe_ref(x.float(), int13, int2, weights, ids)
                    for gemv in (True, False):
                        out = moe.fused_moe(x, int13, int2, weights, ids, gemv=gemv).float()
                        err = float((out - int_ref).abs().max() / int_ref.abs().max())
                        assert err < 2e-2, (name, "int4", tokens, gemv, err)
                row += (f"{int_gemv:>10.1f}{int_bytes / int_gemv / 1e3:>7.0f}"
                        f"{int_grouped:>10.1f}{int_bytes / int_grouped / 1e3:>7.0f}")
            print(row, flush=True)
            if not args.sweep:
                continue
            if tokens <= 32:
                # the up tiles under the default down tiles, then the down tiles, then the pair
                default_up, default_down = moe.gemv_tiles(tokens, dev)
                if not args.int4_only:
                    ups = _best(run, True, [(t, default_down) for t in GEMV_SWEEP], routings)
                    downs = _best(run, True, [(default_up, t) for t in GEMV_SWEEP], routings)
                    both = _time(run(True, (ups[0][1][0], downs[0][1][1])), routings)
                    print(f"    gemv up {[(round(u, 1), t[0]) for u, t in ups[:3]]}")
                    print(f"    gemv down {[(round(u, 1), t[1]) for u, t in downs[:3]]}")
                    print(f"    gemv best pair {both:.1f} us ({nbytes / both / 1e3:.0f} GB/s)",
                          flush=True)
                if args.int4:       # the same for the int4 experts (their own tiles)
                    int_up, int_down = moe.gemv_tiles(tokens, dev, 4)
                    ups = _best(int_run, True, [(t, int_down) for t in INT_GEMV_SWEEP], routings)
                    downs = _best(int_run, True, [(int_up, t) for t in INT_GEMV_SWEEP], routings)
                    both = _time(int_run(True, (ups[0][1][0], downs[0][1][1])), routings)
                    print(f"    int4 gemv up {[(round(u, 1), t[0]) for u, t in ups[:3]]}")
                    print(f"    int4 gemv down {[(round(u, 1), t[1]) for u, t in downs[:3]]}")
                    print(f"    int4 gemv best pair {both:.1f} us "
                          f"({int_bytes / both / 1e3:.0f} GB/s)", flush=True)
            if args.int4_only:
                continue
            grouped = _best(run, False, GROUPED_SWEEP + (PREFILL_SWEEP if tokens >= 1024 else []),
                            routings)
            print(f"    grouped {[(round(u, 1), t) for u, t in grouped[:3]]}", flush=True)


def _route(fn, top_k, x, logits, weights, ids):
    return fn(logits, top_k, True)


def _align(fn, experts, x, logits, weights, ids):
    return fn(ids, experts, 16)


def _experts(w13, w2, gemv, tiles=None):
    return lambda x, logits, weights, ids: moe.fused_moe(x, w13, w2, weights, ids, gemv=gemv,
                                                         tiles=tiles)


def _best(run, gemv, candidates, routings):
    return sorted(((_time(run(gemv, t), routings), t) for t in candidates), key=lambda r: r[0])

if __name__ == "__main__":
    main()
