"""Time every cuBLASLt algorithm its heuristic offers (nvmath-python) against torch.matmul at the
Llama-3.1-8B projection shapes and the engine's row counts (not a test): whether choosing the
GEMM algorithm by measurement, per shape, would beat the one cuBLAS picks for F.linear.

    python tests/kernels/bench_cublaslt_algos.py [--rows 1024,512] [--shapes qkv,o_proj] [--limit 32]

Needs nvmath-python (and cuda-bindings, cuda-core, cuda-pathfinder: scripts/fetch-gpu-wheels
carries them). Each call is timed alone by CUDA events with the GPU kept busy while the host
enqueues it (so Python's overhead is not counted) and L2 flushed before it: torch.matmul and
each algorithm the same way, the median of --reps. TFLOP/s counts 2 * M * N * K.

--sustained times each back to back for --seconds instead (torch.matmul and the algorithms in
turns, three rounds, the median), after warming the GPU for two seconds: the rate under the
board's power cap, where the engine's throughput rows run (~1470 MHz SM clock, twenty-third
session), rather than at a cold GPU's boost clock. The weights stay in one copy there (L2-warm
for the smaller shapes); a row is marked host-bound when enqueueing took as long as the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_gemm_shapes import SHAPES

ROWS = [256, 488, 500, 512, 896, 1000, 1024, 16384]


def timed(fn, flush: torch.Tensor, reps: int) -> float:
    """Median milliseconds of one fn() call, L2 flushed before it and the stream kept busy
    (torch.cuda._sleep) while the host enqueues it."""
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(2_000_000)   # ~1 ms of cycles: the host enqueues meanwhile
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def back_to_back(fn, seconds: float, per_call_ms: float) -> tuple[float, float]:
    """(GPU ms a call, host ms a call) over ~seconds of fn() calls enqueued back to back."""
    calls = max(5, int(seconds * 1e3 / per_call_ms))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    host = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = time.perf_counter() - host
    end.synchronize()
    return start.elapsed_time(end) / calls, host * 1e3 / calls


def sustained(fns: list, seconds: float, cold_ms: list[float]) -> list[tuple[float, bool]]:
    """Per fn: (median GPU ms a call over three rounds of back-to-back calls, host-bound?)."""
    rounds: list[list[tuple[float, float]]] = [[] for _ in fns]
    for _ in range(3):
        for i, fn in enumerate(fns):
            rounds[i].append(back_to_back(fn, seconds, cold_ms[i]))
    out = []
    for r in rounds:
        gpu_ms, host_ms = statistics.median(g for g, _ in r), statistics.median(h for _, h in r)
        out.append((gpu_ms, host_ms >= 0.9 * gpu_ms))
    return out


def describe(algo) -> str:
    """The algorithm's tile, stages and split-K, as far as cuBLASLt tells them."""
    parts = []
    for attr in ("tile", "stages", "split_k"):
        try:
            parts.append(str(getattr(algo, attr)))
        except Exception:     # nvjet (sm_90) kernels leave some of them undefined
            parts.append("?")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    parser.add_argument("--limit", type=int, default=32, help="algorithms asked of the heuristic")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sustained", action="store_true",
                        help="also time back to back under the power cap (see above)")
    parser.add_argument("--seconds", type=float, default=0.3, help="--sustained: seconds a timing")
    args = parser.parse_args()
    import nvmath
    from nvmath.linalg.advanced import Matmul, MatmulPlanPreferences

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, nvmath {nvmath.__version__}, "
          f"cuBLASLt {nvmath.bindings.cublasLt.get_version()}")
    print("| shape | M | torch.matmul us (TFLOP/s) | heuristic's first us | best us (TFLOP/s) | best: rank, tile, stages, split-K | algorithms |")
    print("|---|---:|---:|---:|---:|---|---:|")
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * n * k
            t_torch = timed(lambda x=x, w=w, out=out: torch.matmul(x, w.t(), out=out), flush, args.reps)
            try:
                with Matmul(x, w.t(), stream=stream) as mm:
                    algos = mm.plan(preferences=MatmulPlanPreferences(limit=args.limit), stream=stream)
                    ref = torch.matmul(x, w.t())
                    got = mm.execute(stream=stream)
                    err = (got.float() - ref.float()).abs().max().item()
                    results = []
                    for rank, algo in enumerate(algos):
                        t = timed(lambda mm=mm, algo=algo: mm.execute(algorithm=algo, stream=stream), flush, args.reps)
                        results.append((t, rank, algo))
                    best_t, best_rank, best = min(results, key=lambda r: r[0])
                    cfg = f"{best_rank}, {describe(best)}"
                    print(f"| {name} {n}x{k} | {m} | {t_torch * 1e3:.1f} ({flop / t_torch / 1e9:.0f}) | "
                          f"{results[0][0] * 1e3:.1f} | {best_t * 1e3:.1f} ({flop / best_t / 1e9:.0f}) | {cfg} | "
                          f"{len(algos)} (max abs diff vs torch {err:.2e}) |", flush=True)
                    if args.sustained:
                        fns = [lambda x=x, w=w, out=out: torch.matmul(x, w.t(), out=out)] + [
                            lambda mm=mm, algo=algo: mm.execute(algorithm=algo, stream=stream)
                            for _, _, algo in results]
                        back_to_back(fns[0], 2.0, t_torch)          # into the power cap
                        timed_s = sustained(fns, args.seconds, [t_torch] + [t for t, _, _ in results])
                        (s_torch, torch_host), algo_s = timed_s[0], timed_s[1:]
                        s_best = min(range(len(algo_s)), key=lambda i: algo_s[i][0])
                        s_t, s_host = algo_s[s_best]
                        print(f"| {name} {n}x{k} | {m} sustained | {s_torch * 1e3:.1f} ({flop / s_torch / 1e9:.0f})"
                              f"{' host-bound' if torch_host else ''} | {algo_s[0][0] * 1e3:.1f} | "
                              f"{s_t * 1e3:.1f} ({flop / s_t / 1e9:.0f}){' host-bound' if s_host else ''} | "
                              f"{s_best}, {describe(results[s_best][2])} | |", flush=True)
            except Exception as exc:    # one shape's failure (an unsupported layout) leaves the rest
                print(f"| {name} {n}x{k} | {m} | {t_torch * 1e3:.1f} ({flop / t_torch / 1e9:.0f}) | "
                      f"failed: {type(exc).__name__}: {exc} | | | |", flush=True)


if __name__ == "__main__":
    main()
