"""Time cuBLAS (x @ w.t(), as F.linear; bf16) at the Llama-3.1-8B projection shapes and the batch sizes the
engine runs them at (not a test): which row counts run well below the GEMM rate, and whether
padding the rows to a multiple of 64/128 would pay.

    python tests/kernels/bench_gemm_shapes.py [--kernels] [--rows 488,500,512]

--kernels also names the kernel cuBLAS runs for each shape and row count under F.linear, the
engine's call (a profile of one call), to tell apart shapes whose launches look alike in the
engine's per-kernel profile (e.g. qkv and o_proj at 1024 rows).

Each shape is timed over enough weight copies to exceed L2 (as the engine's 32 layers pass
through it), as CUDA-graph replays; TFLOP/s counts 2 * M * N * K.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.testing
from kvfleet_kernels.cublaslt import captured

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}     # (N, K)
ROWS = [128, 256, 384, 512, 880, 896, 1000, 1024, 16384]
L2_BYTES = 50 * 2 ** 20


def graph_ms(fn) -> float:
    return triton.testing.do_bench(captured(fn, 1).replay, warmup=10, rep=50)


def kernel_names(fn) -> str:
    """The CUDA kernels one call of fn runs, by name, eagerly and replayed from a CUDA graph
    (as the engine's decode runs it: cuBLAS may choose otherwise under capture)."""
    names = []
    for call in (fn, captured(fn, 1).replay):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        names.append(", ".join(sorted({e.name for e in prof.events()
                                       if e.device_type.name == "CUDA"})))
    return f"eager {names[0]}; graph {names[1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", action="store_true",
                        help="also name cuBLAS's kernel for F.linear at each shape and row count")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="row counts (M), comma-separated (default: %(default)s)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="shapes by name, comma-separated (default: %(default)s)")
    args = parser.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, (n, k) in shapes.items():
        copies = max(1, -(-3 * L2_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(copies)]
        cells = []
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def run(x=x, out=out, weights=weights):
                for w in weights:
                    torch.matmul(x, w.t(), out=out)
            t = graph_ms(run) / copies
            cells.append(f"{2 * m * n * k / t / 1e9:.0f} ({t * 1e3:.0f} us)")
        print(f"| {name} {n}x{k} | " + " | ".join(cells) + " |", flush=True)
        if args.kernels:
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                print(f"#   {name} M={m}: {kernel_names(lambda x=x, w=weights[0]: F.linear(x, w))}",
                      flush=True)
        weights.clear()


if __name__ == "__main__":
    main()
