"""The batch-1 GEMV (Triton) against x @ w.T in fp32, in the interpreter (fp32/fp16)."""

from __future__ import annotations

import json

import pytest
import torch
from kvfleet_kernels import gemv as gemv_module
from kvfleet_kernels import split_k as split_k_module
from kvfleet_kernels.gemv import TUNED, GemvConfig, gemv, gemv_ref


@pytest.mark.parametrize("m, n, k", [(1, 40, 96), (1, 64, 512), (2, 33, 200)])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gemv_matches_reference(m, n, k, split_k, bias, dtype, prefetch):
    g = torch.Generator().manual_seed(n * k + split_k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = gemv(x, w, b, GemvConfig(16, 32, split_k, 4, 1, prefetch=prefetch))
    ref = gemv_ref(x, w, b)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("split_k", [1, 3, 7])    # 7 > the 5 K tiles: a slice has none
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_fp8_weight_with_row_scales_matches_reference(split_k, bias, prefetch):
    # W8A16: e4m3 weights (values the format holds exactly) times per-row fp32 scales
    g = torch.Generator().manual_seed(split_k + 2 * bias)
    n, k = 40, 160
    w8 = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = torch.randn(1, k, generator=g, dtype=torch.float32).to(torch.float16)
    b = torch.randn(n, generator=g).to(torch.float16) if bias else None
    out = gemv(x, w8, b, GemvConfig(8, 32, split_k, 4, 1, prefetch=prefetch), scale=scale)
    torch.testing.assert_close(out.float(), gemv_ref(x, w8, b, scale).float(), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="one per weight row"):
        gemv(x, w8, b, scale=scale[:-1])


def test_split_k_counters_are_back_at_zero_and_the_workspace_is_reused():
    x, w = torch.randn(1, 256), torch.randn(48, 256)
    cfg = GemvConfig(16, 32, 5, 4, 1)
    for _ in range(2):
        torch.testing.assert_close(gemv(x, w, None, cfg), gemv_ref(x, w), rtol=1e-5, atol=1e-4)
        _, counters = split_k_module._WORKSPACES[(x.device, 1, 48, 5, 3)]
        assert counters.tolist() == [0, 0, 0]


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"expected \[N, 8\]"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"expected \[N, 4\]"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 8), gated=True)
    with pytest.raises(ValueError, match=r"not \[M, 2K\]"):
        gemv(torch.zeros(1, 7), torch.zeros(4, 3), gated=True)
    with pytest.raises(ValueError, match="one K slice"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 4), None, GemvConfig(16, 32, 2, 4, 1), gated=True)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gated_input_is_the_activation_kernels_output_bit_for_bit(m, dtype, prefetch):
    # gated=True: x = [gate | up] and the GEMV's input is SiLU(gate) * up, rounded as
    # silu_and_mul rounds it: the same bits as the activation kernel and then the GEMV
    from kvfleet_kernels.activation import silu_and_mul
    g = torch.Generator().manual_seed(m + 2 * prefetch)
    k, n = 72, 40                       # K not a multiple of the K tile
    x = (torch.randn(m, 2 * k, generator=g) * 3).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    cfg = GemvConfig(16, 32, 1, 4, 1, prefetch=prefetch)
    out = gemv(x, w, b, cfg, gated=True)
    assert torch.equal(out, gemv(silu_and_mul(x), w, b, cfg))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    ref = gemv_ref(x, w, b, gated=True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    # a gate|up row that is not contiguous in memory (a slice of a wider tensor)
    wide = torch.zeros(m, 2 * k + 8, dtype=dtype)
    wide[:, :2 * k] = x
    assert torch.equal(gemv(wide[:, :2 * k], w, b, cfg, gated=True), out)


def test_push_arguments_are_checked():
    from kvfleet_kernels.all_reduce import PeerSlots
    x, w = torch.zeros(1, 8), torch.zeros(16, 8)
    cfg = GemvConfig(16, 32, 1, 4, 1)
    bases = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="takes no bias"):
        gemv(x, w, torch.zeros(16), cfg, push=PeerSlots(bases, 0, 2, 0, 1024))
    with pytest.raises(ValueError, match="does not fit a slot of 32 bytes"):
        gemv(x, w, None, cfg, push=PeerSlots(bases, 0, 2, 0, 32))
    with pytest.raises(ValueError, match="rank 2 of 2"):
        gemv(x, w, None, cfg, push=PeerSlots(bases, 2, 2, 0, 1024))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                  (128256, 4096)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_gemv_at_llama_8b_shapes(n, k, prefetch):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device="cuda", dtype=torch.bfloat16)
    ref = gemv_ref(x, w)
    cfg = gemv_module.pick_config(1, n, k, x.device)
    cfg = gemv_module.GemvConfig(**{**cfg.__dict__, "prefetch": prefetch})
    # fp32 sums of bf16 products, one bf16 rounding at the end (as the reference)
    torch.testing.assert_close(gemv(x, w, None, cfg).float(), ref.float(), rtol=1.6e-2,
                               atol=1e-2 * ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("key", sorted(TUNED), ids=lambda key: f"{key[0]}-{key[1]}x{key[2]}")
def test_gpu_gemv_at_its_tuned_tiles(key):
    # KVFLEET_TRITON_GEMV=tuned runs these tiles in the engine: each against the reference
    name, n, k = key
    if torch.cuda.get_device_name() != name:
        pytest.skip(f"tuned for {name}")
    g = torch.Generator().manual_seed(n ^ k)
    x = torch.randn(1, k, generator=g).to(device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device="cuda", dtype=torch.bfloat16)
    ref = gemv_ref(x, w)
    torch.testing.assert_close(gemv(x, w, None, TUNED[key]).float(), ref.float(), rtol=1.6e-2,
                               atol=1e-2 * ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["fp8", "int8"])
@pytest.mark.parametrize("key", sorted(gemv_module.TUNED_8BIT),
                         ids=lambda key: f"{key[0]}-{key[1]}x{key[2]}")
def test_gpu_8bit_gemv_takes_its_tuned_tiles(key, weights):
    # batch-1 FP8 / W8A8 projections run these tiles (gemv with scale= and no config): each
    # against the reference, and the call without tiles is the call with them, bit for bit
    name, n, k = key
    if torch.cuda.get_device_name() != name:
        pytest.skip(f"tuned for {name}")
    g = torch.Generator().manual_seed(n ^ k)
    x = torch.randn(1, k, generator=g).to(device="cuda", dtype=torch.bfloat16)
    if weights == "int8":
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).cuda()
    else:
        w = (torch.randn(n, k, generator=g) * 40).to(device="cuda", dtype=torch.float8_e4m3fn)
    scale = (torch.rand(n, generator=g) * 1e-3 + 1e-4).cuda()
    ref = gemv_ref(x, w, None, scale)
    out = gemv(x, w, None, scale=scale)
    assert torch.equal(out, gemv(x, w, None, gemv_module.TUNED_8BIT[key], scale=scale))
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2,
                               atol=1e-2 * ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("k", [14336, 7168])         # down_proj at TP=1 and on a TP=2 rank
def test_gpu_gated_down_projection_is_the_unfused_pair_bit_for_bit(k):
    from kvfleet_kernels.activation import silu_and_mul
    g = torch.Generator().manual_seed(k)
    x = (2 * torch.randn(1, 2 * k, generator=g)).to(device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(4096, k, generator=g) * 0.02).to(device="cuda", dtype=torch.bfloat16)
    cfg = gemv_module.tuned_config(4096, k, x.device) or GemvConfig(8, 512, 1, 8, 1, True)
    out = gemv(x, w, None, cfg, gated=True)
    assert torch.equal(out, gemv(silu_and_mul(x), w, None, cfg))
    ref = gemv_ref(x, w, gated=True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2,
                               atol=1e-2 * ref.float().abs().max().item())


def test_tuned_tiles_from_a_sweep_file(tmp_path, monkeypatch):
    # KVFLEET_GEMV_TUNED: the winners bench_gemv.py --sweep --write-tuned wrote, over TUNED
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps([{"device": "cpu", "n": 48, "k": 256, "triton_us": 1.0,
                                 "config": {"block_n": 16, "block_k": 64, "split_k": 2,
                                            "num_warps": 4, "num_stages": 1, "prefetch": True}}]))
    monkeypatch.setenv("KVFLEET_GEMV_TUNED", str(path))
    cpu = torch.device("cpu")
    cfg = gemv_module.tuned_config(48, 256, cpu)
    assert cfg == GemvConfig(16, 64, 2, 4, 1, prefetch=True)
    assert gemv_module.tuned_config(48, 128, cpu) is None
    x, w = torch.randn(1, 256), torch.randn(48, 256)
    torch.testing.assert_close(gemv(x, w, None, cfg), gemv_ref(x, w), rtol=1e-5, atol=1e-4)
    path2 = tmp_path / "bad.json"
    path2.write_text(json.dumps([{"device": "cpu", "n": 48}]))
    monkeypatch.setenv("KVFLEET_GEMV_TUNED", str(path2))
    with pytest.raises(ValueError, match="KVFLEET_GEMV_TUNED=.*bad.json"):
        gemv_module.tuned_config(48, 256, cpu)


def test_8bit_weights_take_their_own_tuned_tiles(tmp_path, monkeypatch):
    # FP8 / int8 weights (scale=) without config: TUNED_8BIT's tiles for the shape, where it
    # has some, else pick_config's; 2-byte weights never take the 8-bit tiles
    cpu = torch.device("cpu")
    tiles = GemvConfig(16, 64, 2, 4, 1, prefetch=True)
    monkeypatch.setitem(gemv_module.TUNED_8BIT, ("cpu", 48, 256), tiles)
    picked = []
    pick = gemv_module.pick_config
    monkeypatch.setattr(gemv_module, "pick_config", lambda *a: picked.append(a[1:3]) or pick(*a))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 256, generator=g).to(torch.float16)
    w8 = (torch.randn(48, 256, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(48, generator=g) * 0.01 + 1e-3
    out = gemv(x, w8, None, scale=scale)
    assert picked == []
    assert torch.equal(out, gemv(x, w8, None, tiles, scale=scale))
    torch.testing.assert_close(out.float(), gemv_ref(x, w8, None, scale).float(), rtol=2e-3,
                               atol=2e-3)
    gemv(x, w8[:40], None, scale=scale[:40])          # a shape with no tuned tiles
    gemv(x, w8.to(torch.float16), None)               # 2-byte weights
    assert picked == [(40, 256), (48, 256)]
    # a sweep file's 8-bit entries (weight_bytes 1) come first, and only for 8-bit weights
    path = tmp_path / "tuned8.json"
    path.write_text(json.dumps([{"device": "cpu", "n": 48, "k": 256, "weight_bytes": 1,
                                 "config": {"block_n": 8, "block_k": 128, "split_k": 1,
                                            "num_warps": 4, "num_stages": 2,
                                            "prefetch": False}}]))
    monkeypatch.setenv("KVFLEET_GEMV_TUNED", str(path))
    assert gemv_module.tuned_config(48, 256, cpu, 1) == GemvConfig(8, 128, 1, 4, 2)
    assert gemv_module.tuned_config(48, 256, cpu) is None
