"""On the GPU: the W4A16 kernel and the FP8 GEMM against their fp32 references, and the
quantized methods choosing them after loading."""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.fp8 import fp8_linear, fp8_linear_ref, quantize_fp8_rowwise
from kvfleet_kernels.w4a16 import (
    DEQUANT_MIN_M,
    GemmConfig,
    block_columns,
    dequantize_ref,
    pick_config,
    w4a16_gemm,
    w4a16_gemm_ref,
)
from kvfleet_runtime.layers.linear import Linear
from kvfleet_runtime.layers.quantization import AWQConfig, FP8Config, GPTQConfig
from kvfleet_runtime.layers.quantization.awq import pack_awq
from kvfleet_runtime.layers.quantization.gptq import pack_gptq
from kvfleet_runtime.layers.quantization.packing import pack_int32

from quantization.checkpoints import quantize_int
from quantization.test_linear_methods import (
    INT_CASES,
    SHARDS,
    K,
    build,
    int_checkpoint,
    int_config,
    load,
    pack_shards,
    shard_weights,
)

pytestmark = pytest.mark.gpu


def random_layer(k: int, n: int, bits: int, group_size: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    q = torch.randint(0, 1 << bits, (k, n), device="cuda", generator=g)
    scales = (torch.rand(groups, n, device="cuda", generator=g) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 1 << bits, (groups, n), device="cuda", generator=g).half()
    return pack_int32(q, bits, dim=0), scales, zeros


SHAPES = [  # m, k, n, bits, group_size
    (1, 4096, 4096, 4, 128), (1, 4096, 6144, 4, 64), (3, 14336, 4096, 4, 128),
    (16, 4096, 28672, 4, 32), (17, 2048, 1000, 4, -1), (64, 4096, 4096, 8, 128),
    (100, 1024, 3000, 4, 128), (256, 4096, 14336, 4, 128), (1000, 512, 512, 8, 64),
    (300, 2048, 1000, 4, -1),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, k, n, bits, group_size", SHAPES)
def test_w4a16_kernel_matches_reference(m, k, n, bits, group_size, dtype):
    qweight, scales, zeros = random_layer(k, n, bits, group_size, seed=m + n)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = w4a16_gemm(x, qweight, scales, zeros, bits, k if group_size == -1 else group_size)
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, bits,
                         k if group_size == -1 else group_size)
    # bf16/fp16 rounding of the dequantized weight (<= 2**-8 relative) summed over K
    tol = ref.abs().max().item() * 1e-2
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("m", [DEQUANT_MIN_M, 2000])
@pytest.mark.parametrize("block", [1, 16])      # the checkpoint's layout, column-blocked
def test_w4a16_from_dequant_rows_is_cublas_over_the_dequantized_weight(m, block, monkeypatch):
    # from DEQUANT_MIN_M rows the weight is dequantized (rounded once to x's dtype) and
    # multiplied by torch.matmul: bit for bit that product; KVFLEET_W4A16_DEQUANT_M=0 keeps
    # the tiled kernel (no dequantized weight), within the reference's tolerance
    from kvfleet_kernels import w4a16 as w4a16_module
    calls = []
    dequantize = w4a16_module.dequantize
    monkeypatch.setattr(w4a16_module, "dequantize",
                        lambda *a: calls.append(a[-1]) or dequantize(*a))
    monkeypatch.delenv("KVFLEET_W4A16_DEQUANT_M", raising=False)
    k, n, group_size = 4096, 6144, 128
    qweight, scales, zeros = random_layer(k, n, 4, group_size, seed=m + block)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    tensors = (qweight, scales, zeros)
    if block > 1:
        tensors = tuple(block_columns(t, block) for t in tensors)
    cublas = torch.matmul(x, dequantize_ref(qweight, scales, zeros, 4, group_size).to(x.dtype))
    out = w4a16_gemm(x, *tensors, 4, group_size)
    assert torch.equal(out, cublas) and calls == [torch.bfloat16]
    monkeypatch.setenv("KVFLEET_W4A16_DEQUANT_M", "0")
    tiled = w4a16_gemm(x, *tensors, 4, group_size)
    assert calls == [torch.bfloat16]
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, 4, group_size)
    tol = ref.abs().max().item() * 1e-2
    torch.testing.assert_close(tiled.float(), ref, rtol=0, atol=tol)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=tol)
    # and one row fewer than the threshold keeps the tiled kernel too
    monkeypatch.setenv("KVFLEET_W4A16_DEQUANT_M", str(m + 1))
    w4a16_gemm(x, *tensors, 4, group_size)
    assert calls == [torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 3])    # 3: KVFLEET_W4A16_GEMV_MAX_M, a program a row
@pytest.mark.parametrize("gemv", ["", "whole_k=0"])     # the default (whole-K where it won), split
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, n, group_size", [(4096, 6144, 128), (14336, 4096, 128),
                                              (4096, 1000, 64), (1152, 4096, 32),
                                              # a TP=2 rank's o (one 2048-row step), down
                                              (2048, 4096, 128), (7168, 4096, 128)])
def test_w4a16_gemv_f16x2_matches_the_fp32_path_and_the_reference(k, n, group_size, dtype, gemv,
                                                                   rows, monkeypatch):
    # the GEMVs at pick_config's tiles, the fp16x2 PTX against the plain-Triton fp32 path; a
    # few activations in the thousands (as the FFN's massive activations) stay finite in fp16;
    # several rows: each row's bits are its own launch's
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", gemv)
    monkeypatch.setenv("KVFLEET_W4A16_GEMV_MAX_M", str(rows))
    qweight, scales, zeros = random_layer(k, n, 4, group_size, seed=k + n)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    x[:, :: k // 4] = torch.tensor([3000.0, -2000.0, 500.0, -4000.0], dtype=dtype)
    cfg = pick_config(rows, n, k, group_size, x.device)
    assert cfg.f16x2 and cfg.block_m == 1
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, 4, group_size)
    out = w4a16_gemm(x, qweight, scales, zeros, 4, group_size, cfg)
    fp32 = w4a16_gemm(x, qweight, scales, zeros, 4, group_size,
                      GemmConfig(**{**cfg.__dict__, "f16x2": False}))
    # the prefetching loop: same tiles, same sums (the compiler may fuse differently)
    prefetched = w4a16_gemm(x, qweight, scales, zeros, 4, group_size,
                            GemmConfig(**{**cfg.__dict__, "prefetch": not cfg.prefetch}))
    tol = ref.abs().max().item() * 5e-3
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=tol)
    torch.testing.assert_close(fp32.float(), ref, rtol=0, atol=tol)
    torch.testing.assert_close(prefetched.float(), ref, rtol=0, atol=tol)
    if rows > 1 and cfg.whole_k:
        one = pick_config(1, n, k, group_size, x.device)
        for row in range(rows):
            assert torch.equal(out[row:row + 1], w4a16_gemm(x[row:row + 1], qweight, scales,
                                                            zeros, 4, group_size, one))


@pytest.mark.parametrize("setting, m", [(2, 2), (4, 3), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, n, blocked", [(4096, 6144, True), (14336, 4096, True),
                                           (4096, 28672, False)])     # qkv, down, gate_up
def test_w4a16_several_rows_a_program_give_the_one_row_bits(setting, m, dtype, k, n, blocked,
                                                            monkeypatch):
    # KVFLEET_W4A16_GEMV=rows=R (an experiment): the fp16x2 dequantization once for R rows of
    # x; each row the one-row whole-K GEMV's bits at the same steps (1024 rows for 4 rows of x,
    # 2048 for 2), near the reference
    qweight, scales, zeros = random_layer(k, n, 4, 128, seed=k + n + m)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    x[:, :: k // 4] = torch.tensor([3000.0, -2000.0, 500.0, -4000.0], dtype=dtype)
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, 4, 128)
    if blocked:
        qweight, scales, zeros = (block_columns(t, 16) for t in (qweight, scales, zeros))
    step = 1024 if m > 2 else 2048
    one = torch.cat([w4a16_gemm(x[r:r + 1], qweight, scales, zeros, 4, 128,
                                GemmConfig(1, 16, step, 1, 8, 1, whole_k=True))
                     for r in range(m)])
    monkeypatch.setenv("KVFLEET_W4A16_GEMV", f"rows={setting}")
    cfg = pick_config(m, n, k, 128, x.device) if not blocked else GemmConfig(
        1, 16, 2048, 1, 8, 1, whole_k=True)     # a blocked layer passes its whole-K config
    assert cfg.whole_k and cfg.block_n == 16
    out = w4a16_gemm(x, qweight, scales, zeros, 4, 128, cfg)
    assert torch.equal(out, one)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 5e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, n, block_k, block_n, warps", [(4096, 6144, 1024, 16, 8),
                                                           (14336, 4096, 1024, 16, 8),
                                                           (4096, 28672, 2048, 32, 4)])
def test_w4a16_whole_k_gemv_matches_the_fp32_path_and_the_reference(k, n, block_k, block_n,
                                                                     warps, dtype):
    # the whole-K GEMV at the 8B shapes, at tiles other than the defaults' too: the
    # fp16x2 PTX with each row pair's own group scale, and the rows met inside the program
    qweight, scales, zeros = random_layer(k, n, 4, 128, seed=k + n)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    x[0, :: k // 4] = torch.tensor([3000.0, -2000.0, 500.0, -4000.0], dtype=dtype)
    cfg = GemmConfig(1, block_n, block_k, 1, warps, 1, whole_k=True)
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, 4, 128)
    out = w4a16_gemm(x, qweight, scales, zeros, 4, 128, cfg)
    fp32 = w4a16_gemm(x, qweight, scales, zeros, 4, 128,
                      GemmConfig(**{**cfg.__dict__, "f16x2": False}))
    tol = ref.abs().max().item() * 5e-3
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=tol)
    torch.testing.assert_close(fp32.float(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("split_k", [1, 3, 8])
def test_w4a16_split_k_is_exact_up_to_summation_order(split_k):
    qweight, scales, zeros = random_layer(4096, 512, 4, 128, seed=1)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.float16)
    base = pick_config(8, 512, 4096, 128, x.device)        # the tiled kernel
    assert base.block_m > 1
    cfg = GemmConfig(base.block_m, base.block_n, base.block_k, split_k, base.num_warps,
                     base.num_stages)
    ref = w4a16_gemm_ref(x.float(), qweight, scales, zeros, 4, 128)
    out = w4a16_gemm(x, qweight, scales, zeros, 4, 128, cfg)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 1e-2)


@pytest.mark.parametrize("method, bits, group_size, sym, desc_act", INT_CASES)
def test_int_methods_use_the_kernel_on_gpu(method, bits, group_size, sym, desc_act):
    tensors, w = int_checkpoint(method, bits, group_size, sym, desc_act)
    with torch.device("cuda"):
        layer = build(int_config(method, bits, group_size, sym, desc_act))
    load(layer, [{k: v.cuda() for k, v in t.items()} for t in tensors])
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.uses_kernel
    x = torch.randn(9, K, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.cuda().t()
    torch.testing.assert_close(layer(x).float(), ref, rtol=0, atol=ref.abs().max().item() * 2e-2)


@pytest.mark.parametrize("m, k, n", [(1, 4096, 4096), (33, 4096, 14336), (512, 1024, 6144)])
def test_fp8_scaled_mm_matches_reference(m, k, n):
    w = torch.randn(n, k, device="cuda") * 0.02
    w8, scale = quantize_fp8_rowwise(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = fp8_linear_ref(x.float(), w8, scale.reshape(-1))
    out = fp8_linear(x, w8, scale.reshape(-1))
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 1e-2)


@pytest.mark.parametrize("k", [4096, 14336])
def test_fp8_fast_accumulation_stays_near_the_promoted_sums(k):
    # the default (fast accumulation) and promotion to fp32 every 128 values, each against the
    # fp32 product of the same quantized operands: errors of one order (bf16 output rounding)
    w = torch.randn(4096, k, device="cuda") * 0.02
    w8, scale = quantize_fp8_rowwise(w)
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    ref = fp8_linear_ref(x.float(), w8, scale.reshape(-1))
    err = {fast: ((fp8_linear(x, w8, scale.reshape(-1), fast_accum=fast).float() - ref).norm()
                  / ref.norm()).item() for fast in (False, True)}
    assert err[True] <= max(2 * err[False], 4e-3) and err[True] < 1e-2, err
    assert torch.equal(fp8_linear(x, w8, scale.reshape(-1)),
                       fp8_linear(x, w8, scale.reshape(-1), fast_accum=True))


def test_fp8_quantize_on_load_uses_scaled_mm():
    weights = [torch.randn(n, K) * 0.05 for n in SHARDS]
    with torch.device("cuda"):
        layer = build(FP8Config(serialized=False))
    load(layer, [{"weight": w.cuda()} for w in weights])
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.uses_fp8 and layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(5, K, device="cuda")
    ref = x @ torch.cat(weights).cuda().t()
    assert (layer(x) - ref).norm() / ref.norm() < 0.05


def test_fp8_block_scaled_checkpoint_runs_the_fp8_gemm():
    # Qwen3-*-FP8's format ([16, 32] blocks at these sizes): requantized a row at a time for
    # the FP8 GEMM, within the rounding of the checkpoint's dequantized weight
    from quantization.checkpoints import quantize_fp8_blocks
    weights = [torch.randn(n, K) * 0.05 for n in SHARDS]
    blocks = [quantize_fp8_blocks(w, (16, 32)) for w in weights]
    with torch.device("cuda"):
        layer = build(FP8Config(serialized=True, block=(16, 32)))
    load(layer, [{"weight": w8.cuda(), "weight_scale_inv": s.cuda()} for w8, s in blocks])
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.uses_fp8 and layer.weight.dtype == torch.float8_e4m3fn
    exact = torch.cat([w8.float() * s.repeat_interleave(16, 0).repeat_interleave(32, 1)
                       for w8, s in blocks]).cuda()
    x = torch.randn(5, K, device="cuda")
    ref = x @ exact.t()
    assert (layer(x) - ref).norm() / ref.norm() < 0.05


def test_fp8_weight_gemv_at_batch_one_matches_dequantized_weight():
    # KVFLEET_TRITON_GEMV=1's batch-1 path for FP8 weights (W8A16, no activation rounding)
    from kvfleet_kernels.gemv import gemv, gemv_ref
    w8, scale = quantize_fp8_rowwise(torch.randn(4096, 4096, device="cuda") * 0.02)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    ref = gemv_ref(x, w8, None, scale.reshape(-1))
    out = gemv(x, w8, None, scale=scale.reshape(-1).contiguous())
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2,
                               atol=ref.float().abs().max().item() * 1e-2)


def test_gptq_layer_on_gpu_is_smaller_than_fp16():
    w = torch.randn(4096, 4096) * 0.02
    iq = quantize_int(w, 4, 128, sym=True, act_order=False, min_zero=1)
    with torch.device("cuda"):
        layer = Linear(4096, 4096, dtype=torch.float16,
                       linear_method=GPTQConfig(bits=4, group_size=128).get_linear_method("o_proj"))
    for name, t in pack_gptq(iq.q, iq.zeros, iq.scales, iq.g_idx, 4).items():
        layer.weight_loader(getattr(layer, name), t.cuda())
    layer.linear_method.process_weights_after_loading(layer)
    size = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert size < 4096 * 4096 * 2 * 0.3      # 4.25 bits of 16


@pytest.mark.parametrize("rows", [1, 7, 512])
def test_fp8_layers_fed_by_fused_norm_and_activation_match_unfused(rows):
    # 8B shapes in bf16: qkv_proj fed by RMSNorm (residual add), down_proj by SiLU-and-mul; an
    # FP8Activation from the fused kernels gives the unfused output (but where a rare activation
    # lands one e4m3 step away, test_kernel_fp8_fused.py's GPU_MAX_DIFFERING), and batch 1
    # hands the W8A16 GEMV the bf16 activation
    from kvfleet_runtime.layers.activation import SiluAndMul
    from kvfleet_runtime.layers.norm import RMSNorm
    from kvfleet_runtime.layers.quantization.fp8 import FP8Activation, feeds_fp8
    torch.manual_seed(rows)
    with torch.device("cuda"):
        norm, act = RMSNorm(4096, 1e-5, torch.bfloat16), SiluAndMul()
        qkv, down = (Linear(k, n, dtype=torch.bfloat16, prefix=name,
                            linear_method=FP8Config(serialized=False).get_linear_method(name))
                     for k, n, name in ((4096, 6144, "qkv_proj"), (14336, 4096, "down_proj")))
    norm.weight.data.copy_(1 + 0.1 * torch.randn(4096, device="cuda"))
    for layer, producer in ((qkv, norm), (down, act)):
        layer.weight_loader(layer.weight, torch.randn(layer.output_size, layer.input_size,
                                                      device="cuda") * 0.02)
        feeds_fp8(producer, layer)
        layer.linear_method.process_weights_after_loading(layer)
        assert layer.uses_fp8 and producer.fp8_out
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    normed, summed = norm(x, residual)
    activated = act(gate_up)
    assert isinstance(normed, FP8Activation) == isinstance(activated, FP8Activation) == (rows > 1)
    fused = qkv(normed), down(activated)
    norm.fp8_out = act.fp8_out = False
    unfused_normed, unfused_summed = norm(x, residual)
    assert torch.equal(summed, unfused_summed)
    for out, ref in ((fused[0], qkv(unfused_normed)), (fused[1], down(act(gate_up)))):
        # one activation of a row a step (1/16 of itself) apart moves that row's outputs by
        # ~|w| |x_k| / 16: far below a bf16 ulp of the row's largest output. At ~1 activation in
        # 2M a step off, ~0.7% of down's 14336-wide rows hold one: up to 5% of the rows may
        # differ, and one row of a few (of 7 rows one differed on the H200, twenty-fifth session)
        differ = (out != ref).any(dim=1)
        assert int(differ.sum()) <= max(1, rows // 20), int(differ.sum())
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2,
                                   atol=ref.float().abs().max().item() * 2e-3)


@pytest.mark.parametrize("n", [28672, 2 * 7168])      # the 8B gate_up, a TP=2 rank's
def test_w4a16_gated_gemv_equals_the_activation_over_its_output(n):
    # SiLU(gate) * up written by the second of each gate/up tile pair inside the GEMV (its
    # counters, its partner's stores across SMs): the activation kernel's bits, launch after
    # launch, in a CUDA graph as the engine replays it
    from kvfleet_kernels.activation import silu_and_mul
    from kvfleet_kernels.w4a16 import gated_output_serves
    qweight, scales, zeros = random_layer(4096, n, 4, 128, seed=n)
    assert gated_output_serves(1, n, 4096, 128, torch.device("cuda"))
    x = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    act = w4a16_gemm(x.normal_(), qweight, scales, zeros, 4, 128, silu_out=True)   # eager first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act = w4a16_gemm(x, qweight, scales, zeros, 4, 128, silu_out=True)
    for _ in range(20):
        x.normal_()
        graph.replay()
        plain = w4a16_gemm(x, qweight, scales, zeros, 4, 128)
        assert torch.equal(act, silu_and_mul(plain))


@pytest.mark.parametrize("method, bits, group_size, sym, desc_act",
                         [case for case in INT_CASES if case[1] == 4])
def test_gate_up_layer_gives_the_activation_of_its_output_at_batch_one(method, bits, group_size,
                                                                       sym, desc_act):
    # Linear.gated_output (the MLP's path at batch 1): act-order's input permutation and AWQ's
    # repacked layout included, the same bits as the layer's output through the activation
    from kvfleet_kernels.activation import silu_and_mul
    g = torch.Generator().manual_seed(3)
    shards = [quantize_int(torch.randn(256, K, generator=g) * 0.05, bits, group_size, sym,
                           desc_act, min_zero=int(method == "gptq"), seed=7) for _ in range(2)]
    tensors, _ = pack_shards(method, bits, shards)
    prefix = "model.layers.0.mlp.gate_up_proj"
    with torch.device("cuda"):
        layer = Linear(K, [256, 256], bias=False, dtype=torch.bfloat16, prefix=prefix,
                       linear_method=int_config(method, bits, group_size, sym,
                                                desc_act).get_linear_method(prefix))
    load(layer, [{k: v.cuda() for k, v in t.items()} for t in tensors])
    layer.linear_method.process_weights_after_loading(layer)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    act = layer.gated_output(x)
    assert act is not None and act.shape == (1, 256)
    assert torch.equal(act, silu_and_mul(layer(x)))
    # batch 1 only (Linear's batch_one_gemv), though the GEMVs serve up to GEMV_MAX_M rows
    assert layer.gated_output(torch.randn(2, K, device="cuda", dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("method, desc_act, shards", [
    ("gptq", True, [4096, 1024, 1024]),     # the 8B shape's qkv: 16-column blocks
    ("awq", False, [4096])])                # its o_proj
def test_layers_for_the_whole_k_gemv_are_column_blocked_and_exact(method, desc_act, shards):
    # at the 8B shapes the batch-1 default is the whole-K GEMV, so the layer stores its
    # weight column-blocked (block_columns); batch 1 (whole-K) and 9 rows (the tiled kernel)
    # both read that layout and match the fp32 product of the dequantized weight
    k = 4096
    g = torch.Generator().manual_seed(11)
    quantized = [quantize_int(torch.randn(n, k, generator=g) * 0.02, 4, 128, False, desc_act,
                              min_zero=int(method == "gptq"), seed=5) for n in shards]
    tensors = [pack_gptq(iq.q, iq.zeros, iq.scales, iq.g_idx, 4) if method == "gptq"
               else pack_awq(iq.q, iq.zeros, iq.scales) for iq in quantized]
    w = torch.cat([iq.dequantize() for iq in quantized]).cuda()
    config = (GPTQConfig(bits=4, group_size=128, desc_act=desc_act) if method == "gptq"
              else AWQConfig(group_size=128))
    with torch.device("cuda"):
        layer = Linear(k, shards, bias=False, dtype=torch.bfloat16,
                       linear_method=config.get_linear_method("model.layers.0.x_proj"),
                       prefix="model.layers.0.x_proj")
    load(layer, [{name: t.cuda() for name, t in shard.items()} for shard in tensors])
    layer.linear_method.process_weights_after_loading(layer)
    n = sum(shards)
    cfg = pick_config(1, n, k, 128, torch.device("cuda"))
    assert layer.uses_kernel and cfg.whole_k
    assert layer.qweight.shape == (n // cfg.block_n, k // 8, cfg.block_n)
    assert layer.scales.shape == layer.zeros.shape == (n // cfg.block_n, k // 128, cfg.block_n)
    for rows in (1, 9):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.t()
        torch.testing.assert_close(layer(x).float(), ref, rtol=0,
                                   atol=ref.abs().max().item() * 2e-2)


@pytest.mark.parametrize("weights", ["w4a16-asym-bf16", "w8a16", "w8a8-int8-asym", "w8a8-int8",
                                     "fp8-channel", "fp8-blocks", "nvfp4", "mxfp4"])
def test_compressed_tensors_layers_run_the_kernels_on_gpu(weights):
    # compressed-tensors tensors (the library's compressor) of a fused qkv layer: the W4A16
    # kernel (integers) or the FP8 GEMM, within rounding of the library's decompressed weight
    from kvfleet_runtime.layers.quantization import CompressedTensorsConfig

    from quantization.ct_checkpoints import (
        FP8_DYNAMIC_ACTS,
        FP8_WEIGHTS,
        INT8_DYNAMIC_ACTS,
        INT8_WEIGHTS,
        W4A16_ASYM,
        W8A16,
        compress_weight,
        fp4_preset,
        quantization_config,
        scheme,
    )
    args, acts, dtype = {
        "w4a16-asym-bf16": (W4A16_ASYM, None, torch.bfloat16),
        "w8a16": (W8A16, None, torch.float32),
        "w8a8-int8-asym": ({**INT8_WEIGHTS, "symmetric": False}, INT8_DYNAMIC_ACTS,
                           torch.bfloat16),
        "w8a8-int8": (INT8_WEIGHTS, INT8_DYNAMIC_ACTS, torch.bfloat16),
        # FP4 as 8-bit integers on the integer kernels (group scales rounded to fp16)
        "nvfp4": (*fp4_preset("NVFP4A16"), torch.bfloat16),
        "mxfp4": (*fp4_preset("MXFP4A16"), torch.bfloat16),
        "fp8-channel": (FP8_WEIGHTS, FP8_DYNAMIC_ACTS, torch.bfloat16),
        "fp8-blocks": ({**FP8_WEIGHTS, "strategy": "block", "block_structure": [16, 32]},
                       FP8_DYNAMIC_ACTS, torch.bfloat16)}[weights]
    s = scheme(args, acts)
    pieces = [compress_weight(w.to(dtype), s) for w in shard_weights()]
    config = CompressedTensorsConfig.from_config(quantization_config({"group_0": s}))
    with torch.device("cuda"):
        layer = build(config)
    load(layer, [{k: v.cuda() for k, v in t.items()} for t, _ in pieces])
    layer.linear_method.process_weights_after_loading(layer)
    assert getattr(layer, "uses_fp8" if weights.startswith("fp8") else
                   "uses_int8" if weights == "w8a8-int8" else "uses_kernel")
    exact = torch.cat([d for _, d in pieces]).cuda()
    for rows in (1, 9, 300):        # the GEMV, the fused tiles (int8: padded), the big GEMM
        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ exact.t()
        # FP8 / int8 activations: their per-token rounding (int8 ~0.9% of a row's norm)
        tolerance = (0.05 if weights.startswith("fp8") else 0.02 if weights == "w8a8-int8"
                     else 1e-2)
        assert (layer(x).float() - ref).norm() / ref.norm() < tolerance
