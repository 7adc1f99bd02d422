"""Time the paged-attention kernels on a GPU at Llama-3.1-8B attention shapes (not a test).

    python tests/kernels/bench_kernels.py [--dtype bf16] [--block-size 16] [--kv-dtype fp8] [--sweep]

Triton and SDPA are timed as CUDA-graph replays (GPU time; eager launch overhead is printed
apart), the reference eagerly (it syncs on .tolist()).
Decode: Triton split-KV kernel vs paged_attention_ref vs torch SDPA over the same context held
contiguously ([B, Hkv, S, D], no paging: the dense best case). Achieved bandwidth counts the K and
V bytes every sequence reads once (2 * sum(seq_len) * Hkv * D * itemsize) over the kernel time.
Prefill: Triton prefill kernel vs the reference vs causal SDPA (flash) on fresh prompts, and a
prefill chunk on a cached prefix; TFLOP/s counts the causal half of QK^T and PV.
--sweep also times each tile configuration of both kernels and prints the fastest
(decode-short: a wider grid over many short contexts; decode-stages: those batches through
deeper pipelines, 2-5 stages, on one or two warps; prefill-engine: the prefill tiles on the
engine's own chunks: 16 x 1000, 1 x 2048, 128 x 128 fresh prompts; decode-mid: decode
batches under 4096 (sequence, kv head) programs, e.g. 500 x 1016).
--kv-dtype fp8: the caches hold e4m3 (the engine's --kv-cache-dtype fp8); SDPA reads a bf16 copy.
V is laid out as the engine lays it (token-major in an fp8 cache: paged_attention.token_major_v);
--v-rows keeps every cache's V in [block, key, head, dim] rows (the layout before the twentieth
session, for A/B timings); --k-head-major lays an fp8 cache's K out head-major
(paged_attention.head_major_k, the engine's under KVFLEET_K_HEAD_MAJOR=1).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
import kvfleet_kernels.paged_attention as pa  # noqa: E402
from paged_batch import PagedBatch, make_paged_batch  # noqa: E402

HEADS = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
sdpa = torch.nn.functional.scaled_dot_product_attention
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DECODE_CASES = [(1, 1024), (1, 8192), (16, 4096), (64, 2048), (128, 4096), (256, 1024),
                (256, 4096), (64, 8192), (1024, 160), (1024, 256), (512, 1500), (880, 1500)]   # (num_seqs, context)
# (num_seqs, context) of `--sweep decode-short`: a 128/128 decode batch early and late, 1000/1000's
SHORT_DECODE_CASES = [(1024, 160), (1024, 256), (880, 1500)]
# (num_seqs, context) of `--sweep decode-mid`: under 4096 (sequence, kv head) programs (where
# the one-warp tiles began before the twenty-second session), short and long contexts
MID_DECODE_CASES = [(500, 1016), (500, 1500), (114, 1500), (256, 1016), (488, 1900), (384, 1500),
                    (256, 2000), (256, 4096), (128, 2048), (256, 160), (256, 256), (448, 200)]
PREFILL_CASES = [([8192], [8192]), ([2048] * 4, [2048] * 4), ([512] * 16, [512] * 16),
                 ([2048], [8192])]                                      # (q_lens, seq_lens)


# --v-rows: every cache's V in rows (else as the engine lays it out)
V_ROWS = False
# --k-head-major: an fp8 cache's K head-major (else in rows, the engine's default)
K_HEAD_MAJOR = False


def ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def graph_ms(fn: Callable[[], object]) -> float:
    """GPU time of fn replayed from a CUDA graph, as the engine's decode step runs: no Python
    launch overhead (which exceeds a small decode's kernel time several times over)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):      # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return ms(graph.replay)


def batch(q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, block_size: int, seed: int,
          kv_fp8: bool) -> PagedBatch:
    b = make_paged_batch(q_lens, seq_lens, block_size=block_size, dtype=dtype, device="cuda",
                         seed=seed, **HEADS)
    if kv_fp8:
        b.k_cache = pa.quantize_kv_ref(b.k_cache, pa.FP8_KV_DTYPE)
        b.v_cache = pa.quantize_kv_ref(b.v_cache, pa.FP8_KV_DTYPE)
        if not V_ROWS:      # as the engine allocates an fp8 cache
            b.v_cache = pa.token_major_v(torch.empty_like(b.v_cache)).copy_(b.v_cache)
        if K_HEAD_MAJOR:
            b.k_cache = pa.head_major_k(torch.empty_like(b.k_cache)).copy_(b.k_cache)
    return b


def triton_call(b: PagedBatch) -> Callable[[], torch.Tensor]:
    out = torch.empty_like(b.query)
    return lambda: pa.paged_attention(*b.args(), b.max_seq_len, out=out)


def dense_kv(b: PagedBatch, cache: torch.Tensor, seq_len: int) -> torch.Tensor:
    # [B, Hkv, S, D] copy of equal-length contexts, for SDPA
    blocks = -(-seq_len // cache.shape[1])
    dense = cache[b.block_tables[:, :blocks].long()].flatten(1, 2)[:, :seq_len].transpose(1, 2)
    return dense.to(b.query.dtype).contiguous()


def bench_decode(dtype: torch.dtype, block_size: int, kv_fp8: bool) -> None:
    print(f"\n## decode ({dtype}{', fp8 cache' if kv_fp8 else ''}, block_size {block_size}, "
          "32 q heads / 8 kv heads, D=128)\n")
    print("| seqs | context | splits | triton ms | TB/s | triton eager ms | ref ms | SDPA (dense) ms | SDPA TB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for num_seqs, ctx in DECODE_CASES:
        b = batch([1] * num_seqs, [ctx] * num_seqs, dtype, block_size, num_seqs, kv_fp8)
        b.max_query_len = 1
        kv_bytes = 2 * num_seqs * ctx * HEADS["num_kv_heads"] * HEADS["head_dim"] * b.k_cache.element_size()
        split = pa.decode_split(num_seqs, 8, ctx, pa.decode_config(True, kv_fp8, ctx, num_seqs * 8).block_n,
                                b.query.device)
        t_triton, t_eager = graph_ms(triton_call(b)), ms(triton_call(b))
        t_ref = ms(partial(pa.paged_attention_ref, *b.args())) if num_seqs * ctx <= 2 ** 20 else float("nan")
        k, v = dense_kv(b, b.k_cache, ctx), dense_kv(b, b.v_cache, ctx)
        q = b.query.view(num_seqs, 32, 1, 128)
        t_sdpa = graph_ms(partial(sdpa, q, k, v, scale=b.scale, enable_gqa=True))
        print(f"| {num_seqs} | {ctx} | {split.num_splits} | {t_triton:.3f} | {kv_bytes / t_triton / 1e9:.2f} "
              f"| {t_eager:.3f} | {t_ref:.3f} | {t_sdpa:.3f} | {kv_bytes / t_sdpa / 1e9:.2f} |")


def causal_flops(q_lens: list[int], seq_lens: list[int]) -> float:
    # QK^T and PV: 2 * 2 * H * D per visible (query, key) pair
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(q_lens, seq_lens, strict=True))
    return 4 * HEADS["num_heads"] * HEADS["head_dim"] * pairs


def bench_prefill(dtype: torch.dtype, block_size: int, kv_fp8: bool) -> None:
    print(f"\n## prefill ({dtype}{', fp8 cache' if kv_fp8 else ''}, block_size {block_size})\n")
    print("| q_lens | seq_lens | triton ms | TFLOP/s | ref ms | SDPA causal ms | SDPA TFLOP/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for q_lens, seq_lens in PREFILL_CASES:
        b = batch(q_lens, seq_lens, dtype, block_size, len(q_lens), kv_fp8)
        flops = causal_flops(q_lens, seq_lens)
        t_triton = graph_ms(triton_call(b))
        t_ref = ms(partial(pa.paged_attention_ref, *b.args()))
        t_sdpa = float("nan")
        if q_lens == seq_lens:      # SDPA's is_causal aligns top-left: fresh prompts only
            n, s = len(q_lens), q_lens[0]
            q = b.query.view(n, s, 32, 128).transpose(1, 2)
            k, v = dense_kv(b, b.k_cache, s), dense_kv(b, b.v_cache, s)
            t_sdpa = graph_ms(partial(sdpa, q, k, v, is_causal=True, scale=b.scale, enable_gqa=True))
        print(f"| {_short(q_lens)} | {_short(seq_lens)} | {t_triton:.3f} | {flops / t_triton / 1e9:.1f} "
              f"| {t_ref:.3f} | {t_sdpa:.3f} | {flops / t_sdpa / 1e9:.1f} |")


def _short(lens: list[int]) -> str:
    return f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else str(lens)


def _print_best(case: str, results: list[tuple[float, pa.TileConfig]], default: pa.TileConfig) -> None:
    top = "; ".join(f"{t:.3f} ms {c}" for t, c in results[:3])
    timed = [t for t, c in results if c == default]
    print(f"{case}: default " + (f"{timed[0]:.3f} ms" if timed else f"{default} (not in this grid)")
          + f"; best {top}")


def _time_configs(b: PagedBatch, configs, hook: str) -> list[tuple[float, pa.TileConfig]]:
    """Each TileConfig timed on batch b through pa.<hook> (decode_config or prefill_config),
    fastest first; those the GPU cannot hold (shared memory) are skipped. The caller puts the
    library's own function back."""
    results = []
    for cfg in configs:
        setattr(pa, hook, lambda *_a, cfg=cfg: cfg)
        try:
            results.append((graph_ms(triton_call(b)), cfg))
        except triton.runtime.errors.OutOfResources:
            continue
    return sorted(results, key=lambda r: r[0])


def sweep(dtype: torch.dtype, block_size: int, which: str = "all", kv_fp8: bool = False) -> None:
    """Time every tile configuration; the library keeps using its defaults afterwards."""
    default_decode, default_prefill = pa.decode_config, pa.prefill_config
    default_per_sm = pa._PROGRAMS_PER_SM
    print(f"\n## sweep ({dtype}{', fp8 cache' if kv_fp8 else ''}, block_size {block_size})")
    # decode: (seqs, context) of batch-1 long contexts up to a full 128/128 (1024 x ~160) and
    # 1000/1000 (~500-900 x ~1500) batch
    decode_cases = [(1024, 160), (880, 1500), (512, 1500), (256, 4096), (64, 2048), (1, 8192)]
    try:
        for num_seqs, ctx in (decode_cases if which in ("all", "decode") else []):
            b = batch([1] * num_seqs, [ctx] * num_seqs, dtype, block_size, 1, kv_fp8)
            b.max_query_len = 1
            # an fp8 cache: fp16 dots won every case of the first sweep, 32-key tiles none
            results = _time_configs(b, [
                pa.TileConfig(16, block_n, warps, stages, k_by_rows=by_rows, dot_fp16=fp16)
                for block_n, warps, stages, by_rows, fp16 in itertools.product(
                    [64, 128] if kv_fp8 else [32, 64, 128], [2, 4] if kv_fp8 else [2, 4, 8], [2, 3],
                    [False, True], [True] if kv_fp8 else [False])], "decode_config")
            _print_best(f"decode {num_seqs}x{ctx}", results, default_decode(True, kv_fp8, ctx, num_seqs * 8))
            pa.decode_config = default_decode
        # many short contexts (128/128's decode batch, 1000/1000's): a wider grid, one stage
        # (no shared-memory ring: more programs resident) and whole-context tiles included
        for num_seqs, ctx in (SHORT_DECODE_CASES if which in ("all", "decode-short") else []):
            b = batch([1] * num_seqs, [ctx] * num_seqs, dtype, block_size, 1, kv_fp8)
            b.max_query_len = 1
            results = _time_configs(b, [
                pa.TileConfig(16, block_n, warps, stages, k_by_rows=by_rows, dot_fp16=kv_fp8)
                for block_n, warps, stages, by_rows in itertools.product(
                    [32, 64, 128, 256], [1, 2, 4], [1, 2], [False, True])], "decode_config")
            _print_best(f"decode-short {num_seqs}x{ctx}", results, default_decode(True, kv_fp8, ctx, num_seqs * 8))
            pa.decode_config = default_decode
        # the same batches through deeper pipelines on one or two warps (decode-short stops at
        # two stages): a tile's keys wait on their block-table entries, then on the cache
        for num_seqs, ctx in (SHORT_DECODE_CASES if which == "decode-stages" else []):
            b = batch([1] * num_seqs, [ctx] * num_seqs, dtype, block_size, 1, kv_fp8)
            b.max_query_len = 1
            results = _time_configs(b, [
                pa.TileConfig(16, block_n, warps, stages, k_by_rows=by_rows, dot_fp16=kv_fp8)
                for block_n, warps, stages, by_rows in itertools.product(
                    [16, 32, 64], [1, 2], [2, 3, 4, 5], [False, True])], "decode_config")
            _print_best(f"decode-stages {num_seqs}x{ctx}", results, default_decode(True, kv_fp8, ctx, num_seqs * 8))
            pa.decode_config = default_decode
        # under 4096 programs (sequences x kv heads): 1000/1000 in waves of ~500 and its tail,
        # 256-running rows; max_seq_len as the engine's graphs pass it (the context bucket:
        # 1024, else 4096)
        for num_seqs, ctx in (MID_DECODE_CASES if which == "decode-mid" else []):
            b = batch([1] * num_seqs, [ctx] * num_seqs, dtype, block_size, 1, kv_fp8)
            b.max_query_len = 1
            b.max_seq_len = 1024 if ctx <= 1024 else 4096
            results = _time_configs(b, [
                pa.TileConfig(16, block_n, warps, stages, dot_fp16=kv_fp8)
                for block_n, warps, stages in itertools.product(
                    [32, 64, 128], [1, 2], [2, 3, 5])], "decode_config")
            _print_best(f"decode-mid {num_seqs}x{ctx} (max_seq_len {b.max_seq_len})", results,
                        default_decode(True, kv_fp8, b.max_seq_len, num_seqs * 8))
            pa.decode_config = default_decode
        for num_seqs, ctx in ([(1, 8192), (4, 8192), (16, 4096), (32, 2048)]
                              if which in ("all", "decode") else []):
            b = batch([1] * num_seqs, [ctx] * num_seqs, dtype, block_size, 1, kv_fp8)
            b.max_query_len = 1
            timed = []
            for per_sm in (2, 4, 8, 16):
                pa._PROGRAMS_PER_SM = per_sm
                split = pa.decode_split(num_seqs, 8, ctx, default_decode(True, kv_fp8, ctx, num_seqs * 8).block_n,
                                        b.query.device)
                timed.append(f"{per_sm}/SM {split.num_splits} splits {graph_ms(triton_call(b)):.3f} ms")
            print(f"decode {num_seqs}x{ctx} programs per SM: " + "; ".join(timed))
            pa._PROGRAMS_PER_SM = default_per_sm
        for q_lens in ([[8192], [2048] * 4, [512] * 16] if which in ("all", "prefill") else []):
            b = batch(q_lens, q_lens, dtype, block_size, 2, kv_fp8)
            results = _time_configs(b, [
                pa.TileConfig(block_m, block_n, warps, stages, k_by_rows=True, dot_fp16=fp16)
                for block_m, block_n, warps, stages, fp16 in itertools.product(
                    [64, 128], [32, 64, 128], [4, 8], [2, 3, 4], [False, True] if kv_fp8 else [False])],
                "prefill_config")
            _print_best(f"prefill {_short(q_lens)}", results,
                        default_prefill(4, block_size, True, kv_fp8))
            pa.prefill_config = default_prefill
        # the engine's prefill chunks: 1000/1000's (16 fresh 1000-token prompts), the TTFT row's
        # 2048 tokens, 128/128's (128 prompts of 128)
        for q_lens in ([[1000] * 16, [2048], [128] * 128] if which == "prefill-engine" else []):
            b = batch(q_lens, q_lens, dtype, block_size, 3, kv_fp8)
            results = _time_configs(b, [
                pa.TileConfig(block_m, block_n, warps, stages, k_by_rows=True, dot_fp16=kv_fp8)
                for block_m, block_n, warps, stages in itertools.product(
                    [64, 128], [32, 64, 128], [4, 8], [2, 3, 4])], "prefill_config")
            flops = causal_flops(q_lens, q_lens)
            _print_best(f"prefill-engine {_short(q_lens)} ({flops / 1e12:.3f} TFLOP)", results,
                        default_prefill(4, block_size, True, kv_fp8))
            pa.prefill_config = default_prefill
    finally:
        pa.decode_config, pa.prefill_config = default_decode, default_prefill
        pa._PROGRAMS_PER_SM = default_per_sm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--block-size", type=int, default=16, choices=[16, 32, 64])
    parser.add_argument("--sweep", nargs="?", const="all",
                        choices=["all", "decode", "decode-short", "decode-stages", "decode-mid",
                                 "prefill", "prefill-engine"],
                        help="also time every tile configuration (of one kernel, or all)")
    parser.add_argument("--no-tables", action="store_true", help="only the sweep")
    parser.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: e4m3 caches, as --kv-cache-dtype fp8")
    parser.add_argument("--v-rows", action="store_true",
                        help="V in [block, key, head, dim] rows even in an fp8 cache")
    parser.add_argument("--k-head-major", action="store_true",
                        help="an fp8 cache's K head-major (KVFLEET_K_HEAD_MAJOR=1's layout)")
    args = parser.parse_args()
    global V_ROWS, K_HEAD_MAJOR
    V_ROWS, K_HEAD_MAJOR = args.v_rows, args.k_head_major
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    dtype = DTYPES[args.dtype]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if not args.no_tables:
        bench_decode(dtype, args.block_size, args.kv_dtype == "fp8")
        bench_prefill(dtype, args.block_size, args.kv_dtype == "fp8")
    if args.sweep:
        sweep(dtype, args.block_size, args.sweep, args.kv_dtype == "fp8")


if __name__ == "__main__":
    main()
