"""The W4A16 kernels (decode GEMV and tiled GEMM) against dequantize-then-matmul in fp32.

Here in Triton's interpreter (fp16/fp32, small shapes); tests/quantization/test_gpu.py runs
the same kernels on the GPU in bf16 at the 8B model's shapes.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.w4a16 import (
    GemmConfig,
    block_columns,
    dequant_min_m,
    dequantize,
    dequantize_ref,
    pick_config,
    unblock_columns,
    w4a16_gemm,
    w4a16_gemm_ref,
)


def _layer(k: int, n: int, bits: int, group_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = k // group_size
    q = torch.randint(0, 1 << bits, (k, n), generator=g)
    per_word = 32 // bits
    words = torch.zeros(k // per_word, n, dtype=torch.int64)
    for j in range(per_word):
        words |= q[j::per_word] << (j * bits)
    qweight = (words - ((words >> 31) << 32)).to(torch.int32)     # two's complement int32
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).half()
    return qweight, scales, zeros


@pytest.mark.parametrize("m", [1, 3])   # 3 rows: the GEMV kernel is not picked for it, but serves it
@pytest.mark.parametrize("bits, group_size, k, n", [(4, 32, 256, 96), (4, 128, 512, 64),
                                                    (8, 64, 256, 80), (4, 256, 256, 40)])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gemv_kernel_matches_reference(m, bits, group_size, k, n, split_k, dtype, prefetch):
    qweight, scales, zeros = _layer(k, n, bits, group_size, seed=m * 7 + n)
    x = torch.randn(m, k, dtype=dtype)
    auto = pick_config(1, n, k, group_size, x.device)
    assert auto.block_m == 1, "batch-1 decode must pick the GEMV kernel"
    cfg = GemmConfig(1, 32, min(auto.block_k, 64), split_k, 4, 1, prefetch=prefetch)
    out = w4a16_gemm(x, qweight, scales, zeros, bits, group_size, cfg)
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, bits, group_size)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0,
                               atol=ref.float().abs().max().item() * 2e-3)


@pytest.mark.parametrize("k, n, group_size", [(512, 256, 128), (384, 200, 64)])
def test_gemv_kernel_at_the_picked_config(k, n, group_size):
    # pick_config's own tiles (256 columns on two warps, prefetching); 200
    # columns and 384 rows leave a partial column tile (the masked path)
    qweight, scales, zeros = _layer(k, n, 4, group_size, seed=k + n)
    x = torch.randn(1, k, dtype=torch.float16)
    cfg = pick_config(1, n, k, group_size, x.device)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.prefetch) == (1, 256, 2, True)
    out = w4a16_gemm(x, qweight, scales, zeros, 4, group_size, cfg)
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, 4, group_size)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0,
                               atol=ref.float().abs().max().item() * 2e-3)


def test_tiled_block_k_must_divide_the_group():
    # a tile reads one group's scales: 128 rows over groups of 64 would read half of them
    # wrong (the H200 sweep's block_k 256 at group size 128 was off by ~55%)
    qweight, scales, zeros = _layer(256, 64, 4, 64, seed=0)
    with pytest.raises(ValueError, match="block_k 128 must be a multiple of 8 dividing group_size 64"):
        w4a16_gemm(torch.randn(16, 256), qweight, scales, zeros, 4, 64,
                   GemmConfig(16, 64, 128, 1, 4, 2))
    cfg = pick_config(16, 64, 256, 64, torch.device("cpu"))
    assert cfg.block_m == 16 and 64 % cfg.block_k == 0


def test_gemv_block_k_must_divide_the_group():
    qweight, scales, zeros = _layer(256, 32, 4, 32, seed=0)
    with pytest.raises(ValueError, match="dividing group_size 32"):
        w4a16_gemm(torch.randn(1, 256), qweight, scales, zeros, 4, 32, GemmConfig(1, 32, 64, 1, 4, 1))


@pytest.mark.parametrize("split_k", [2, 5, 9, 19])   # > the 8 K tiles: slices with none;
# 19: the partials meet in two loads of split_k.MEET_ROWS (16) slices, the second masked
@pytest.mark.parametrize("prefetch", [False, True])
def test_gemv_split_k_meets_in_one_launch_and_leaves_its_counters_at_zero(split_k, prefetch):
    from kvfleet_kernels import split_k as split_k_module
    qweight, scales, zeros = _layer(256, 64, 4, 32, seed=split_k)
    cfg = GemmConfig(1, 32, 32, split_k, 4, 1, prefetch=prefetch)
    for seed in (1, 2):      # the second launch reuses the workspace the first one left
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(seed))
        ref = w4a16_gemm_ref(x, qweight, scales, zeros, 4, 32)
        out = w4a16_gemm(x, qweight, scales, zeros, 4, 32, cfg)
        torch.testing.assert_close(out, ref, rtol=0, atol=ref.abs().max().item() * 2e-3)
        _, counters = split_k_module._WORKSPACES[(x.device, 1, 64, split_k, 2)]
        assert counters.tolist() == [0, 0]


@pytest.mark.parametrize("bits, group_size, k, n, block_k, block_n, warps", [
    (4, 32, 256, 64, 128, 16, 4),     # 8 groups a 128-row step: each pair scaled by its own
    (4, 128, 512, 32, 256, 32, 2),
    (8, 64, 256, 48, 64, 16, 4),
    (4, 256, 256, 32, 64, 16, 1),     # one group for all of K (group_size -1)
    (4, 64, 256, 32, 256, 16, 4)])    # all of K in one step (a TP=2 rank's o_proj: 2048 rows)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_whole_k_gemv_matches_reference(bits, group_size, k, n, block_k, block_n, warps, dtype,
                                        blocked, m):
    # one program per row and block_n columns over all of K: no K slices, no counters;
    # blocked: the weight column-blocked by block_n (each program's words one contiguous run)
    qweight, scales, zeros = _layer(k, n, bits, group_size, seed=k + n + bits)
    x = torch.randn(m, k).to(dtype)
    cfg = GemmConfig(1, block_n, block_k, 1, warps, 1, whole_k=True)
    ref = w4a16_gemm_ref(x.float(), qweight, scales.to(dtype), zeros.to(dtype), bits, group_size)
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    if blocked:
        qweight, scales, zeros = (block_columns(t, block_n) for t in (qweight, scales, zeros))
    out = w4a16_gemm(x, qweight, scales, zeros, bits, group_size, cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 2e-3)
    if m > 1:       # each row alone: the same bits
        for row in range(m):
            assert torch.equal(out[row:row + 1], w4a16_gemm(x[row:row + 1], qweight, scales,
                                                            zeros, bits, group_size, cfg))


@pytest.mark.parametrize("rows, m", [(2, 2), (2, 3), (4, 3), (4, 4), (4, 7)])
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_several_rows_a_program_give_the_whole_k_gemvs_bits(monkeypatch, rows, m, blocked, dtype):
    # KVFLEET_W4A16_GEMV=rows=R: R rows of x a program, each step's weights loaded once for
    # them; every row as the one-row whole-K GEMV computes it, bit for bit (rows past M
    # masked: 3 rows in programs of 2 and 4, 7 in two programs of 4)
    qweight, scales, zeros = _layer(512, 64, 4, 64, seed=m + rows)
    x = torch.randn(m, 512).to(dtype)
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    if blocked:
        qweight, scales, zeros = (block_columns(t, 16) for t in (qweight, scales, zeros))
    cfg = GemmConfig(1, 16, 128, 1, 4, 1, whole_k=True)
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", "rows=1")
    one_row = w4a16_gemm(x, qweight, scales, zeros, 4, 64, cfg)
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", f"rows={rows}")
    out = torch.full_like(one_row, float("nan"))
    out = w4a16_gemm(x, qweight, scales, zeros, 4, 64, cfg)
    assert torch.equal(out, one_row)
    ref = w4a16_gemm_ref(x.float(), *(unblock_columns(t) if blocked else t
                                      for t in (qweight, scales, zeros)), 4, 64)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 2e-3)


@pytest.mark.parametrize("setting, programs", [("", 2), ("rows=2", 2), ("rows=4", 1),
                                               ("rows=1", 0)])
def test_two_to_four_rows_take_two_rows_a_program_by_default(monkeypatch, setting, programs):
    # where 2-4 rows run the whole-K GEMV, its programs take GEMV_ROWS = 2 rows of x each
    # unless rows= says otherwise (rows=1: the one-row kernel, a program a row); same bits
    from kvfleet_kernels import w4a16
    launched = []
    real = w4a16._w4a16_gemv_rows_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    qweight, scales, zeros = _layer(512, 64, 4, 64, seed=5)
    x = torch.randn(3, 512)
    cfg = GemmConfig(1, 16, 128, 1, 4, 1, whole_k=True)
    one_row = torch.cat([w4a16_gemm(x[r:r + 1], qweight, scales, zeros, 4, 64, cfg)
                         for r in range(3)])
    monkeypatch.setattr(w4a16, "_w4a16_gemv_rows_kernel", Spy())
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", setting)
    assert torch.equal(w4a16_gemm(x, qweight, scales, zeros, 4, 64, cfg), one_row)
    assert launched == ([(programs, 4)] if programs else [])
    # batch 1 never takes it
    w4a16_gemm(x[:1], qweight, scales, zeros, 4, 64, cfg)
    assert len(launched) == (1 if programs else 0)


def test_several_rows_setting(monkeypatch):
    # rows=R picks the whole-K GEMV for 2-4 rows on a GPU, at any N it tiles (gate_up's too);
    # batch 1 and the interpreter keep their defaults; R is 1, 2 or 4
    from kvfleet_kernels import w4a16
    cuda = torch.device("cuda")
    monkeypatch.setattr(w4a16, "_num_sms", lambda device: 132)
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", "rows=4")
    assert w4a16._gemv_config(4, 28672, 4096, 128, cuda, "rows=4") == GemmConfig(
        1, 16, 2048, 1, 8, 1, whole_k=True)
    assert not w4a16._gemv_config(1, 28672, 4096, 128, cuda, "rows=4").whole_k
    assert not pick_config(4, 28672, 4096, 128, torch.device("cpu")).whole_k
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", "rows=3")
    with pytest.raises(ValueError, match="rows must be 1, 2 or 4; got 3"):
        pick_config(4, 4096, 4096, 128, torch.device("cpu"))


def test_gemv_rows_from_the_environment(monkeypatch):
    # KVFLEET_W4A16_GEMV_MAX_M: the GEMV kernels (a program a row) up to that many rows
    from kvfleet_kernels.w4a16 import gemv_max_m
    cpu = torch.device("cpu")
    monkeypatch.delenv("KVFLEET_W4A16_GEMV_MAX_M", raising=False)
    assert gemv_max_m() == 4 and pick_config(4, 4096, 4096, 128, cpu).block_m == 1
    assert pick_config(5, 4096, 4096, 128, cpu).block_m == 16
    assert pick_config(2, 4096, 4096, 128, cpu, bits=8).block_m == 16     # 8 bits: batch 1
    monkeypatch.setenv("KVFLEET_W4A16_GEMV_MAX_M", "1")
    assert pick_config(2, 4096, 4096, 128, cpu).block_m == 16
    monkeypatch.setenv("KVFLEET_W4A16_GEMV_MAX_M", "0")
    with pytest.raises(ValueError, match="KVFLEET_W4A16_GEMV_MAX_M must be a row count >= 1"):
        gemv_max_m()


@pytest.mark.parametrize("m, block", [(5, 16), (20, 32), (70, 16)])     # 5: past GEMV_MAX_M
def test_tiled_kernel_reads_column_blocked_weights(m, block):
    # the tiled kernel (16-, 64- and 128-row tiles by M) over a weight column-blocked
    # for the whole-K GEMV gives what it gives over the checkpoint's layout; the round trip
    # through block_columns is exact
    k, n, group_size = 256, 128, 64
    qweight, scales, zeros = _layer(k, n, 4, group_size, seed=m)
    x = torch.randn(m, k, dtype=torch.float16)
    blocked = [block_columns(t, block) for t in (qweight, scales, zeros)]
    assert torch.equal(unblock_columns(blocked[0]), qweight)
    out = w4a16_gemm(x, *blocked, 4, group_size)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, w4a16_gemm(x, qweight, scales, zeros, 4, group_size),
                               rtol=0, atol=0)
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, 4, group_size)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 2e-3)


def test_column_blocked_weights_refuse_the_split_gemv():
    qweight, scales, zeros = _layer(256, 64, 4, 64, seed=2)
    blocked = [block_columns(t, 16) for t in (qweight, scales, zeros)]
    x = torch.randn(1, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match="whole-K GEMV at block_n 16"):
        w4a16_gemm(x, *blocked, 4, 64, GemmConfig(1, 32, 64, 1, 4, 1))
    with pytest.raises(ValueError, match="whole-K GEMV at block_n 16"):
        w4a16_gemm(x, *blocked, 4, 64, GemmConfig(1, 32, 128, 1, 4, 1, whole_k=True))
    with pytest.raises(ValueError, match="blocked alike"):
        w4a16_gemm(x, blocked[0], scales, zeros, 4, 64)


@pytest.mark.parametrize("m, k, n, block_k, block_n", [(1, 384, 32, 256, 16),   # K % block_k
                                                       (2, 256, 40, 128, 16)])  # N % block_n
def test_whole_k_gemv_refuses_what_it_cannot_tile(m, k, n, block_k, block_n):
    qweight, scales, zeros = _layer(k, n, 4, 128, seed=1)
    with pytest.raises(ValueError, match="the whole-K GEMV serves K % block_k == 0"):
        w4a16_gemm(torch.randn(m, k), qweight, scales, zeros, 4, 128,
                   GemmConfig(1, block_n, block_k, 1, 4, 1, whole_k=True))


def test_gemv_tiles_from_the_environment(monkeypatch):
    # KVFLEET_W4A16_GEMV overrides pick_config's batch-1 tiles (GPU experiments); the
    # kernel at those tiles (prefetch, one warp, split over all 8 K tiles) still matches
    monkeypatch.setenv("KVFLEET_W4A16_GEMV",
                       "prefetch=1,warps_per_sm=64,warps=1,block_n=64,block_k=32")
    cfg = pick_config(1, 64, 256, 32, torch.device("cpu"))
    assert cfg == GemmConfig(1, 64, 32, 8, 1, 1, prefetch=True)    # 8 K tiles < 64 per SM
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", "prefetch=0,tiles_per_slice=1,warps_per_sm=1")
    assert pick_config(1, 512, 1024, 128, torch.device("cpu")) == GemmConfig(
        1, 256, 64, 16, 2, 1, prefetch=False)                    # a slice per K tile
    qweight, scales, zeros = _layer(256, 64, 4, 32, seed=3)
    x = torch.randn(1, 256, dtype=torch.float16)
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, 4, 32)
    out = w4a16_gemm(x, qweight, scales, zeros, 4, 32)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 2e-3)
    # the whole-K GEMV, opted into: its defaults where K and N tile, else the split GEMV
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", "whole_k=1")
    assert pick_config(1, 4096, 4096, 128, torch.device("cpu")) == GemmConfig(
        1, 16, 1024, 1, 8, 1, whole_k=True)
    assert not pick_config(1, 4096, 1536, 128, torch.device("cpu")).whole_k   # 1536 % 1024
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", "whole_k=1,block_k=128,block_n=32,warps=4")
    cfg = pick_config(1, 64, 256, 32, torch.device("cpu"))
    assert cfg == GemmConfig(1, 32, 128, 1, 4, 1, whole_k=True)
    out = w4a16_gemm(x, qweight, scales, zeros, 4, 32)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 2e-3)
    # whole_k=0: the split GEMV even where the GPU default would pick the whole-K one
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", "whole_k=0")
    assert not pick_config(1, 4096, 4096, 128, torch.device("cpu")).whole_k
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", "prefetch=yes")
    with pytest.raises(ValueError, match="KVFLEET_W4A16_GEMV: expected comma-separated"):
        pick_config(1, 64, 256, 32, torch.device("cpu"))


@pytest.mark.parametrize("n, k, tiles", [
    (6144, 4096, (16, 2048, 8, 80)),  # qkv of the 8B shape: 384 programs, 3 a SM
    (4096, 4096, (16, 2048, 8, 128)),  # o: 256 programs, 2 a SM
    (4096, 14336, (16, 2048, 8, 128)),  # down
    (4096, 7168, (16, 1024, 8, 128)),  # down of a TP=2 rank: 7168 % 2048
    (2048, 4096, (16, 2048, 8, 0)),   # 128 programs: one a SM, no cap
    (8192, 4096, (32, 1024, 8, 128)),  # 512 programs of 16 columns would be 4 a SM
    (28672, 4096, None),              # gate_up: the split GEMV
    (4096, 1536, None),               # K too short
    (1000, 4096, None)])              # N % 16
def test_whole_k_is_the_gpu_default_where_it_won(n, k, tiles):
    from kvfleet_kernels.w4a16 import whole_k_tiles
    assert whole_k_tiles(n, k, 132) == tiles


def test_the_interpreter_keeps_the_split_gemv():
    # on the CPU (the interpreter's tests) pick_config's default stays the split GEMV
    assert not pick_config(1, 4096, 4096, 128, torch.device("cpu")).whole_k


def test_the_gpu_default_is_whole_k_for_4_bits_only(monkeypatch):
    # on a GPU (its SM count stubbed: no GPU here) 4-bit weights take the whole-K GEMV where it
    # won; 8-bit ones (its fp32 path, not measured there) keep the split GEMV
    from kvfleet_kernels import w4a16
    monkeypatch.setattr(w4a16, "_num_sms", lambda device: 132)
    monkeypatch.delenv("KVFLEET_W4A16_GEMV", raising=False)
    w4a16._gemv_config.cache_clear()
    try:
        cuda = torch.device("cuda")
        assert pick_config(1, 4096, 4096, 128, cuda) == GemmConfig(1, 16, 2048, 1, 8, 1,
                                                                   whole_k=True, maxnreg=128)
        assert not pick_config(1, 4096, 4096, 128, cuda, bits=8).whole_k
    finally:
        w4a16._gemv_config.cache_clear()


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize(("bits", "dtype"), [(4, torch.float32), (4, torch.float16),
                                             (8, torch.float32)])
@pytest.mark.parametrize("rows", [1, 2])
def test_gated_gemv_gives_silu_and_mul_of_its_output(split_k, bits, dtype, rows):
    # a gated MLP's gate_up ([gate | up], 4 column tiles of 32 a half): silu_out's result is
    # the activation kernel's over the plain GEMV's output, bit for bit; the pair counters are
    # back at 0 for the next launch
    from kvfleet_kernels import w4a16 as w4a16_module
    from kvfleet_kernels.activation import silu_and_mul
    qweight, scales, zeros = _layer(256, 256, bits, 64, seed=split_k + bits)
    cfg = GemmConfig(1, 32, 64, split_k, 4, 1, prefetch=True)
    for seed in (1, 2):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed)).to(dtype)
        plain = w4a16_gemm(x, qweight, scales, zeros, bits, 64, cfg)
        act = w4a16_gemm(x, qweight, scales, zeros, bits, 64, cfg, silu_out=True)
        assert act.shape == (rows, 128) and act.dtype == dtype
        assert torch.equal(act, silu_and_mul(plain))
        assert w4a16_module._PAIR_COUNTERS[(x.device, rows, 4)].tolist() == [0] * 4 * rows


def test_gated_gemv_serves_the_split_gemv_with_tiles_of_one_half():
    from kvfleet_kernels.w4a16 import gated_output_serves
    qweight, scales, zeros = _layer(256, 96, 4, 64, seed=0)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="tiles of a half's columns"):       # 48 = 1.5 tiles
        w4a16_gemm(x, qweight, scales, zeros, 4, 64, GemmConfig(1, 32, 64, 2, 4, 1), silu_out=True)
    with pytest.raises(ValueError, match="split batch-1 GEMV"):
        w4a16_gemm(x, qweight, scales, zeros, 4, 64, GemmConfig(1, 32, 256, 1, 4, 1, whole_k=True),
                   silu_out=True)
    cpu = torch.device("cpu")
    assert gated_output_serves(1, 28672, 4096, 128, cpu)         # the 8B gate_up: 256-column tiles
    assert not gated_output_serves(1, 2 * 200, 4096, 128, cpu)   # 200 columns a half
    assert gated_output_serves(4, 28672, 4096, 128, cpu)         # the GEMVs' rows
    assert not gated_output_serves(5, 28672, 4096, 128, cpu)     # the tiled kernel's rows


@pytest.mark.parametrize("bits, k, group_size", [(4, 256, 32), (4, 192, 192), (8, 256, 64),
                                                 (4, 512, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("block", [1, 16])      # the checkpoint's layout, column-blocked
def test_dequantize_kernel_gives_the_reference_rounded_once(bits, k, group_size, dtype, block):
    # the weight prefill multiplies with cuBLAS from dequant_min_m() rows: the fp32
    # reference's values rounded once to x's dtype, bit for bit, from either layout (N = 96:
    # a partial 128-column tile; K = 192: a partial 128-row tile of one group)
    qweight, scales, zeros = _layer(k, 96, bits, group_size, seed=bits + k)
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    tensors = (qweight, scales, zeros)
    if block > 1:
        tensors = tuple(block_columns(t, block) for t in tensors)
    out = dequantize(*tensors, bits, group_size, dtype)
    ref = dequantize_ref(qweight, scales, zeros, bits, group_size)
    assert out.shape == (k, 96) and out.dtype == dtype
    assert torch.equal(out, ref.to(dtype))
    assert not torch.equal(out, torch.zeros_like(out))


def test_dequant_rows_from_the_environment(monkeypatch):
    from kvfleet_kernels.w4a16 import DEQUANT_MIN_M
    monkeypatch.delenv("KVFLEET_W4A16_DEQUANT_M", raising=False)
    assert dequant_min_m() == DEQUANT_MIN_M
    monkeypatch.setenv("KVFLEET_W4A16_DEQUANT_M", "0")
    assert dequant_min_m() == 0
    monkeypatch.setenv("KVFLEET_W4A16_DEQUANT_M", "64")
    assert dequant_min_m() == 64
    monkeypatch.setenv("KVFLEET_W4A16_DEQUANT_M", "many")
    with pytest.raises(ValueError, match="KVFLEET_W4A16_DEQUANT_M must be a row count"):
        dequant_min_m()


def test_tiled_settings_from_the_environment(monkeypatch):
    cpu = torch.device("cpu")
    # KVFLEET_W4A16_TILED: the tiled kernel's settings from GEMV_MAX_M rows to 64
    monkeypatch.setenv("KVFLEET_W4A16_TILED", "per_sm=4,stages=2,warps=8,block_n=32")
    cfg = pick_config(16, 4096, 4096, 128, cpu)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (16, 32, 8, 2)
    assert pick_config(100, 4096, 4096, 128, cpu).num_stages == 3   # from 65 rows: untouched
    monkeypatch.setenv("KVFLEET_W4A16_TILED", "depth=2")
    with pytest.raises(ValueError, match="KVFLEET_W4A16_TILED: expected"):
        pick_config(16, 4096, 4096, 128, cpu)
