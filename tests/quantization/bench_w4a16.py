"""Time the W4A16 GEMM against bf16 torch.matmul on Llama-3.1-8B's projection shapes.

Run on a GPU: python tests/quantization/bench_w4a16.py [--group-size 128] [--bits 4]
Prints, per shape and M, the time of each (replayed from a CUDA graph, as decode runs, over
weight copies 3x the L2 cache in turn: each call's weight comes from HBM, as in the engine)
and the "TB/s-equivalent": bytes a GEMM must move
(weight + x + out) divided by its time, which for decode (M=1) is the figure to compare with
the GPU's HBM bandwidth (H200: 4.8 TB/s peak, ~4.3 measured copy).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from functools import partial

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "kernels"))
import triton.language as tl  # noqa: E402
from kvfleet_kernels.pdl import pdl_args, pdl_wait  # noqa: E402
from kvfleet_kernels.split_k import store_or_reduce, workspace  # noqa: E402
from kvfleet_kernels.w4a16 import (  # noqa: E402
    WHOLE_K_TILES,
    GemmConfig,
    _gemv_config,
    _gemv_load_weights,
    block_columns,
    dequant_min_m,
    dequantized_gemm,
    gemv_max_m,
    pick_config,
    tiled_config,
    w4a16_gemm,
    w4a16_gemm_ref,
    whole_k_tiles,
)

# (name, K, N) of one Llama-3.1-8B layer, q/k/v and gate/up fused as the engine runs them
SHAPES = [("qkv_proj", 4096, 6144), ("o_proj", 4096, 4096),
          ("gate_up_proj", 4096, 28672), ("down_proj", 14336, 4096)]
# --sweep: candidate tiles (block_m, block_n, block_k, num_warps, num_stages); split-K of
# decode tiles is tried at 1 and at pick_config's choice
SWEEP_SMALL_M = [(16, n, k, w, st) for n in (64, 128) for k in (128, 256) for w in (4, 8)
                 for st in (2, 4)]
# 16 < M <= 64
SWEEP_MID_M = [(bm, n, k, 4, st) for bm in (32, 64) for n in (64, 128) for k in (64, 128)
               for st in (3, 4)]
# the GEMV kernel (block_m 1) for M <= gemv_max_m(), (block_m, block_n, block_k, num_warps,
# f16x2): block_n = 128 * num_warps keeps the scales in the words' layout (~20 SASS
# instructions per word); 128 columns on 2-4 warps shuffle through shared memory but won the
# last sweep (commit ab8e752); 64-column tiles and the plain-Triton fp32 path (f16x2=False)
# lost every shape there and are left out. Each f16x2 config runs with and without prefetch.
SWEEP_GEMV = ([(1, 128 * w, k, w, True) for w in (1, 2, 4) for k in (64, 128)]
              + [(1, 128, k, w, True) for k in (64, 128) for w in (2, 4)])
# the whole-K GEMV (GemmConfig.whole_k, KVFLEET_W4A16_GEMV=whole_k=1): (block_n, block_k,
# num_warps), where K and N tile and a thread holds at most 32 words a step (ptxas for sm_90:
# 16 x 1024 on 8 warps 103 registers, 16 x 2048 138, 32 x 1024 128, no spills; 64 columns x
# 2048 rows on 8 warps, 64 words a thread, spilled 20 KB)
SWEEP_WHOLE_K = [(bn, bk, w) for bn in (16, 32, 64) for bk in (512, 1024, 2048)
                 for w in (4, 8, 16) if bn * bk // 8 <= 32 * 32 * w]
# and its split-K at these programs per SM (split_k is a runtime argument: no recompile)
SWEEP_GEMV_PER_SM = (1, 2, 4, 8, 16, 32)
SWEEP_LARGE_M = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
                 (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (64, 256, 64, 8, 3),
                 (128, 256, 64, 8, 3)]


def graph_us(fns, rep: int = 100) -> float:
    """GPU time per call of fns (one callable, or a list called in turn) replayed from a CUDA
    graph (as the engine's decode runs it: no launch overhead, which at a few microseconds per
    kernel would swamp a GEMV). A list of calls over different weight copies keeps each call's
    weight out of L2 (the H200's 50 MB holds a whole qkv projection), as in the engine, where
    32 layers' weights pass between two uses of one."""
    fns = fns if isinstance(fns, list) else [fns]
    calls = fns * max(1, -(-10 // len(fns)))
    for fn in fns:
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=rep // 4, rep=rep) * 1e3 / len(calls)


@triton.jit
def _pattern_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, N, K, group_size,
                    split_k, stride_qk, stride_sg, BLOCK_N: tl.constexpr,
                    BLOCK_KW: tl.constexpr, MEET: tl.constexpr, PDL: tl.constexpr):
    """--floor: the batch-1 GEMV's loads (same grid, tiles and order, prefetch included) with
    no dequantization or products: each program folds its words into one float per column.
    MEET: the K slices then meet as the GEMV's do (split_k.store_or_reduce); else each
    program stores its own partial (no meeting)."""
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    cols = offs_n[None, :]
    kw = K // 8
    n_tiles = tl.cdiv(kw, BLOCK_KW)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    wa, wb, s, z = _gemv_load_weights(qw_ptr, s_ptr, z_ptr, pid_k, kw, group_size, stride_qk,
                                      stride_sg, cols, mask_n, BLOCK_KW, 8, True)
    pdl_wait(PDL)
    for tile in range(pid_k, n_tiles - split_k, split_k):
        na, nb, ns, nz = _gemv_load_weights(qw_ptr, s_ptr, z_ptr, tile + split_k, kw,
                                            group_size, stride_qk, stride_sg, cols, mask_n,
                                            BLOCK_KW, 8, True)
        acc += tl.reshape(tl.sum((wa ^ wb).to(tl.float32), axis=0)[None, :] + s + z, (BLOCK_N,))
        wa, wb, s, z = na, nb, ns, nz
    acc += tl.reshape(tl.sum((wa ^ wb).to(tl.float32), axis=0)[None, :] + s + z, (BLOCK_N,))
    if MEET:
        store_or_reduce(acc, out_ptr, out_ptr, part_ptr, count_ptr, 0, 1, N, offs_n, mask_n,
                        pid_n, pid_k, split_k, False)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, acc, mask=mask_n)


@triton.jit
def _read_kernel(ptr, out_ptr, n_words, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """--floor: a weight's words read contiguously, each program a run of them, CHUNK words
    a step."""
    pid = tl.program_id(0)
    per = tl.cdiv(n_words, tl.num_programs(0) * CHUNK) * CHUNK
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros((CHUNK,), dtype=tl.int32)
    pdl_wait(PDL)
    for start in range(pid * per, tl.minimum(pid * per + per, n_words), CHUNK):
        acc ^= tl.load(ptr + start + offs, mask=start + offs < n_words, other=0)
    tl.store(out_ptr + pid * CHUNK + offs, acc)


def floor_rows(name: str, x: torch.Tensor, layers, group_size: int, q_bytes: int) -> None:
    """--floor: for batch 1, the GEMV's time next to its loads alone (with and without the
    K slices' meeting) and a contiguous read of the same bytes: what its arithmetic and its
    meeting cost over the bytes' own time; and the whole-K GEMV (no slices) at its defaults."""
    k = x.shape[1]
    n = layers[0][0].shape[1]
    cfg = _gemv_config(1, n, k, group_size, x.device, "whole_k=0")   # the split GEMV's tiles
    grid = (1, triton.cdiv(n, cfg.block_n), cfg.split_k)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    part, count = workspace(x.device, 1, n, cfg.split_k, grid[1])
    own = torch.empty(cfg.split_k * n, dtype=torch.float32, device=x.device)   # no meeting

    def pattern(layer, meet):
        qweight, scales, zeros = layer
        _pattern_kernel[grid](qweight, scales, zeros, out, part if meet else own, count, n, k,
                              group_size,
                              cfg.split_k, qweight.stride(0), scales.stride(0),
                              BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_k // 8, MEET=meet,
                              num_warps=cfg.num_warps, num_stages=1, **pdl_args(x.device))

    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = 4 * sms                      # 8 warps an SM, as the GEMV's split aims for
    sink = torch.empty(programs * 1024, dtype=torch.int32, device=x.device)

    def read(layer):
        flat = layer[0].view(-1)
        _read_kernel[(programs,)](flat, sink, flat.numel(), CHUNK=1024, num_warps=2,
                                  num_stages=3, **pdl_args(x.device))

    words = layers[0][0].numel() * 4
    times = {"split gemv": (graph_us([partial(w4a16_gemm, x, *layer, 4, group_size, cfg)
                                      for layer in layers]), q_bytes),
             "loads+meeting": (graph_us([partial(pattern, layer, True) for layer in layers]),
                               q_bytes),
             "loads": (graph_us([partial(pattern, layer, False) for layer in layers]), q_bytes),
             "contiguous read of the words": (graph_us([partial(read, layer)
                                                        for layer in layers]), words)}
    # the whole-K GEMV at its default tiles for the shape, else at KVFLEET_W4A16_GEMV=whole_k=1's
    block_n, block_k, warps, cap = whole_k_tiles(n, k, sms) or (*WHOLE_K_TILES, 0)
    whole_k = GemmConfig(1, block_n, block_k, 1, warps, 1, whole_k=True, maxnreg=cap)
    if k % block_k == 0 and n % block_n == 0:
        times["whole-K gemv"] = (graph_us([partial(w4a16_gemm, x, *layer, 4, group_size, whole_k)
                                           for layer in layers]), q_bytes)
    print(f"  floor {name}: " + ", ".join(
        f"{what} {t:.1f} us ({nbytes / t / 1e6:.2f} TB/s)" for what, (t, nbytes) in times.items()))


def copies_for(nbytes: int, device: torch.device) -> int:
    """Weight copies to rotate through so that together they are 3x the L2 cache."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(2, -(-3 * l2 // nbytes))


def sweep(x, layers, bits, group_size, args_verbose: bool = False, whole_k_only: bool = False
          ) -> tuple[float, GemmConfig]:
    """The fastest of the candidate configs for this shape that match the reference:
    (us, config); layers: (qweight, scales, zeros) copies timed in turn (L2-cold);
    args_verbose prints every config's time; whole_k_only: the whole-K GEMV's tiles alone."""
    qweight, scales, zeros = layers[0]
    m, k = x.shape
    n = qweight.shape[1]
    best: tuple[float, GemmConfig] | None = None
    candidates = (SWEEP_GEMV if m <= gemv_max_m(bits) else SWEEP_SMALL_M if m <= 16
                  else SWEEP_MID_M if m <= 64 else SWEEP_LARGE_M)
    ref = w4a16_gemm_ref(x, qweight, scales, zeros, bits, group_size).float()
    configs = [GemmConfig(1, bn, bk, 1, warps, 1, whole_k=True)
               for bn, bk, warps in SWEEP_WHOLE_K
               if m == 1 and k % bk == 0 and n % bn == 0]
    for bm, bn, bk, warps, last in () if whole_k_only else candidates:
        if bm == 1:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            tiles, k_tiles = m * triton.cdiv(n, bn), triton.cdiv(k, bk)
            splits = sorted({max(1, min(k_tiles, triton.cdiv(per_sm * sms, tiles)))
                             for per_sm in SWEEP_GEMV_PER_SM})
            # last: f16x2 (no pipelined loads: one stage); each with and without prefetch
            makes = [partial(GemmConfig, bm, bn, bk, num_warps=warps, num_stages=1, f16x2=last,
                             prefetch=pf) for pf in ((False, True) if last else (False,))]
        else:
            # no split, and a split to about 2 programs an SM
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            tiles, k_tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, bk)
            splits = sorted({1, max(1, min(k_tiles // 4, triton.cdiv(2 * sms, tiles)))})
            makes = [partial(GemmConfig, bm, bn, bk, num_warps=warps, num_stages=last)]
        configs += [make(split_k=split) for make in makes for split in splits]
    for cfg in configs:
        fns = [partial(w4a16_gemm, x, *layer, bits, group_size, cfg) for layer in layers]
        try:
            err = (fns[0]().float() - ref).abs().max().item() / ref.abs().max().item()
            if not err < 2e-2:     # a fast wrong config must not win
                print(f"  WRONG {cfg}: off by {err:.3g} of max")
                continue
            t = graph_us(fns, rep=20)
        except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip it
            print(f"  skip {cfg}: {type(e).__name__}")
            continue
        if args_verbose:
            print(f"    {t:8.1f} us  {cfg}")
        if best is None or t < best[0]:
            best = (t, cfg)
    assert best is not None
    return best


def checked_us(x, copies, bits, group_size, cfg, ref) -> float:
    """cfg's L2-cold time over the weight copies, after its output is checked against ref."""
    fns = [partial(w4a16_gemm, x, *layer, bits, group_size, cfg) for layer in copies]
    err = (fns[0]().float() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-2, f"{cfg}: off by {err:.3g} of max"
    return graph_us(fns, rep=30)


def layouts(x, layers, bits, group_size) -> None:
    """--layouts: every whole-K tile of SWEEP_WHOLE_K over the checkpoint's layout and over
    the weight column-blocked by its block_n (block_columns), L2-cold."""
    k = x.shape[1]
    n = layers[0][0].shape[1]
    ref = w4a16_gemm_ref(x, *layers[0], bits, group_size).float()
    rows = []
    for bn, bk, warps in SWEEP_WHOLE_K:
        if k % bk or n % bn:
            continue
        cfg = GemmConfig(1, bn, bk, 1, warps, 1, whole_k=True)
        blocked = [tuple(block_columns(t, bn) for t in layer) for layer in layers]
        times = [checked_us(x, copies, bits, group_size, cfg, ref)
                 for copies in (layers, blocked)]
        rows.append((times[1], times[0], bn, bk, warps))
        print(f"    {bn:>3} x {bk:>4}, {warps:>2} warps: checkpoint layout {times[0]:6.1f} us, "
              f"blocked {times[1]:6.1f} us", flush=True)
    best = min(rows)
    print(f"  layouts best: blocked {best[0]:.1f} us at {best[2]} x {best[3]}, {best[4]} warps; "
          f"checkpoint layout's best {min(r[1] for r in rows):.1f} us")


def regcaps(x, layers, bits, group_size) -> None:
    """--maxnreg: the default whole-K tiles over column-blocked weights under register caps."""
    k = x.shape[1]
    n = layers[0][0].shape[1]
    ref = w4a16_gemm_ref(x, *layers[0], bits, group_size).float()
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for bn, bk, warps in {(whole_k_tiles(n, k, sms) or WHOLE_K_TILES)[:3], (16, 2048, 8),
                          (16, 1024, 8), (32, 1024, 8)}:
        if k % bk or n % bn:
            continue
        blocked = [tuple(block_columns(t, bn) for t in layer) for layer in layers]
        line = [f"{cap or 'none'}: " + format(checked_us(
                    x, blocked, bits, group_size,
                    GemmConfig(1, bn, bk, 1, warps, 1, whole_k=True, maxnreg=cap), ref), ".1f")
                for cap in (0, 128, 96, 80, 64)]
        print(f"    {bn:>3} x {bk:>4}, {warps} warps, blocked, by register cap: "
              + "  ".join(line), flush=True)
    # the split GEMV (pick_config's tiles with KVFLEET_W4A16_GEMV=whole_k=0) likewise
    cfg = _gemv_config(1, n, k, group_size, x.device, "whole_k=0")
    line = [f"{cap or 'none'}: " + format(checked_us(
                x, layers, bits, group_size, replace(cfg, maxnreg=cap), ref), ".1f")
            for cap in (0, 128, 96, 80, 72, 64, 56, 48)]
    print(f"    split GEMV {cfg.block_n} x {cfg.block_k}, {cfg.num_warps} warps, split "
          f"{cfg.split_k}, by register cap: " + "  ".join(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 256])
    parser.add_argument("--sweep", action="store_true", help="also time candidate tile configs")
    parser.add_argument("--verbose", action="store_true", help="with --sweep: every config's time")
    parser.add_argument("--whole-k-only", action="store_true",
                        help="with --sweep at batch 1: the whole-K GEMV's tiles only")
    parser.add_argument("--layouts", action="store_true",
                        help="batch 1 only: the whole-K GEMV's tiles over the checkpoint's "
                             "layout and over the column-blocked one")
    parser.add_argument("--maxnreg", action="store_true",
                        help="batch 1 only: the whole-K and the split GEMV under register "
                             "caps")
    parser.add_argument("--floor", action="store_true",
                        help="batch 1 only: the GEMV next to its loads alone and a contiguous "
                             "read of the same bytes")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"W{args.bits}A16 group_size={args.group_size} vs bf16 torch.matmul")
    print(f"{'shape':<14}{'M':>5}{'w4a16 us':>10}{'TB/s':>7}{'bf16 us':>9}{'TB/s':>7}"
          f"{'speedup':>9}  config")
    for name, k, n in SHAPES:
        groups = k // args.group_size
        q_bytes = (k * args.bits // 32) * n * 4 + groups * n * 4
        layers = []
        for _ in range(copies_for(q_bytes, dev)):
            qweight = torch.randint(-2**31, 2**31 - 1, (k * args.bits // 32, n),
                                    dtype=torch.int32, device=dev)
            scales = (torch.rand(groups, n, device=dev) * 0.01).half()
            zeros = torch.full((groups, n), 1 << (args.bits - 1), device=dev, dtype=torch.float16)
            layers.append((qweight, scales, zeros))
        weights = [torch.randn(k, n, device=dev, dtype=torch.bfloat16)
                   for _ in range(copies_for(k * n * 2, dev))]
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = w4a16_gemm(x, *layers[0], args.bits, args.group_size)
            ref = w4a16_gemm_ref(x, *layers[0], args.bits, args.group_size)
            err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
            assert err < 2e-2, f"{name} M={m}: kernel off by {err:.3g} of max"
            t_q = graph_us([partial(w4a16_gemm, x, *layer, args.bits, args.group_size)
                            for layer in layers])
            t_b = graph_us([partial(torch.matmul, x, w) for w in weights])
            io = (m * k + m * n) * 2
            cfg = pick_config(m, n, k, args.group_size, dev)
            print(f"{name:<14}{m:>5}{t_q:>10.1f}{(q_bytes + io) / t_q / 1e6:>7.2f}{t_b:>9.1f}"
                  f"{(k * n * 2 + io) / t_b / 1e6:>7.2f}{t_b / t_q:>8.2f}x  "
                  f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} split_k={cfg.split_k}"
                  f"{' prefetch' if cfg.prefetch else ''}")
            if m > 1:
                # the tiled kernel and the dequantize + cuBLAS route, each forced
                tcfg = tiled_config(m, n, k, args.group_size, dev)
                tiled = graph_us([partial(w4a16_gemm, x, *layer, args.bits, args.group_size,
                                          tcfg) for layer in layers])
                deq = graph_us([partial(dequantized_gemm, x, *layer, args.bits,
                                        args.group_size) for layer in layers])
                # the batch-1 GEMVs at this many rows, a program a row
                gcfg = _gemv_config(m, n, k, args.group_size, dev,
                                    os.environ.get("KVFLEET_W4A16_GEMV", ""), args.bits)
                gemv = graph_us([partial(w4a16_gemm, x, *layer, args.bits, args.group_size,
                                         gcfg) for layer in layers])
                print(f"    tiled kernel {tiled:.1f} us, dequantize + cuBLAS {deq:.1f} us "
                      f"(default from {dequant_min_m()} rows), GEMV a program a row "
                      f"{gemv:.1f} us", flush=True)
            if args.floor and m == 1 and args.bits == 4:
                floor_rows(name, x, layers, args.group_size, q_bytes)
            if args.maxnreg and m == 1:
                regcaps(x, layers, args.bits, args.group_size)
            if args.layouts and m == 1:
                layouts(x, layers, args.bits, args.group_size)
            if args.sweep:
                t_best, best = sweep(x, layers, args.bits, args.group_size, args.verbose,
                                      args.whole_k_only and m == 1)
                print(f"{'  best':<19}{t_best:>10.1f}{(q_bytes + io) / t_best / 1e6:>7.2f}"
                      f"{'':>16}{t_b / t_best:>8.2f}x  {best}")


if __name__ == "__main__":
    main()
