"""GPTQ / AWQ / FP8 methods on standalone Linear layers: fused shards loaded through the
shared weight_loader, then dequantized on load (CPU path) or repacked for the W4A16 kernel
(run by Triton's interpreter here), compared with x @ w of the dequantized weights in fp32."""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.fp8 import fp8_linear_ref
from kvfleet_runtime.layers.linear import Linear
from kvfleet_runtime.layers.quantization import AWQConfig, FP8Config, GPTQConfig
from kvfleet_runtime.layers.quantization.awq import pack_awq
from kvfleet_runtime.layers.quantization.gptq import pack_gptq

from quantization.checkpoints import IntQuantized, quantize_fp8, quantize_int

K = 128
SHARDS = [64, 32, 32]           # q, k, v of a GQA attention


def shard_weights(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, K, generator=g) * 0.05 for n in SHARDS]


def build(config, prefix: str = "model.layers.0.self_attn.qkv_proj") -> Linear:
    return Linear(K, SHARDS, bias=False, dtype=torch.float32,
                  linear_method=config.get_linear_method(prefix), prefix=prefix)


def load(layer: Linear, shards: list[dict[str, torch.Tensor]]) -> None:
    # in checkpoint order v, k, q: shard placement must not depend on load order
    for shard_id in reversed(range(len(shards))):
        for name, tensor in shards[shard_id].items():
            layer.weight_loader(getattr(layer, name), tensor, shard_id=shard_id)


def quantize_shards(method: str, bits: int, group_size: int, sym: bool,
                    desc_act: bool) -> list[IntQuantized]:
    # one act-order seed for all shards: they share their input
    return [quantize_int(w, bits, group_size, sym, desc_act, min_zero=int(method == "gptq"),
                         seed=7) for w in shard_weights()]


def pack_shards(method: str, bits: int, shards: list[IntQuantized]):
    """Packed tensors of each shard, and the dequantized fused weight [N, K]."""
    tensors = [pack_gptq(iq.q, iq.zeros, iq.scales, iq.g_idx, bits) if method == "gptq"
               else pack_awq(iq.q, iq.zeros, iq.scales) for iq in shards]
    return tensors, torch.cat([iq.dequantize() for iq in shards])


def int_checkpoint(method: str, bits: int, group_size: int, sym: bool, desc_act: bool):
    return pack_shards(method, bits, quantize_shards(method, bits, group_size, sym, desc_act))


INT_CASES = [
    # method, bits, group_size, sym, desc_act
    ("gptq", 4, 32, False, False),
    ("gptq", 4, 32, True, True),
    ("gptq", 4, 64, False, True),
    ("gptq", 4, -1, True, False),
    ("gptq", 8, 64, False, True),
    ("awq", 4, 32, False, False),
    ("awq", 4, 128, False, False),
]


def int_config(method: str, bits: int, group_size: int, sym: bool, desc_act: bool):
    if method == "gptq":
        return GPTQConfig(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act)
    return AWQConfig(group_size=group_size)


@pytest.mark.parametrize("method, bits, group_size, sym, desc_act", INT_CASES)
def test_cpu_path_dequantizes_on_load_exactly(method, bits, group_size, sym, desc_act):
    tensors, w = int_checkpoint(method, bits, group_size, sym, desc_act)
    layer = build(int_config(method, bits, group_size, sym, desc_act))
    load(layer, tensors)
    layer.linear_method.process_weights_after_loading(layer)
    assert not layer.uses_kernel and not hasattr(layer, "qweight")
    assert torch.equal(layer.weight, w)
    x = torch.randn(5, K)
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("method, bits, group_size, sym, desc_act", INT_CASES)
def test_kernel_path_matches_fp32_reference(method, bits, group_size, sym, desc_act):
    tensors, w = int_checkpoint(method, bits, group_size, sym, desc_act)
    layer = build(int_config(method, bits, group_size, sym, desc_act))
    load(layer, tensors)
    method_ = layer.linear_method
    method_.finalize(layer, method_.unpack(layer), use_kernel=True)
    assert layer.uses_kernel and not hasattr(layer, "weight")
    assert (layer.perm is not None) == desc_act
    # the kernel's layout: 32 // bits rows per int32 word, fp16 scales/zeros per group
    assert layer.qweight.shape == (K * bits // 32, sum(SHARDS))
    x = torch.randn(3, K, dtype=torch.float16)
    expected = x.float() @ w.t()
    torch.testing.assert_close(layer(x).float(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("method, desc_act", [("gptq", True), ("awq", False)])
def test_kernel_path_over_column_blocked_weights(method, desc_act, monkeypatch):
    # where batch 1 runs the whole-K GEMV (a GPU's default at the 8B shapes; stubbed here),
    # the layer keeps its weight blocked by the GEMV's columns, and both batch 1 and larger
    # batches (the tiled kernel) read that layout
    from kvfleet_kernels.w4a16 import GemmConfig, unblock_columns
    from kvfleet_runtime.layers.quantization import int_weight
    whole_k = GemmConfig(1, 16, 64, 1, 4, 1, whole_k=True)
    monkeypatch.setattr(int_weight, "blocked_whole_k", lambda *args: whole_k)
    tensors, w = int_checkpoint(method, 4, 32, False, desc_act)
    layer = build(int_config(method, 4, 32, False, desc_act))
    load(layer, tensors)
    method_ = layer.linear_method
    unpacked = method_.unpack(layer)
    method_.finalize(layer, unpacked, use_kernel=True)
    assert layer.whole_k_config == whole_k
    assert layer.qweight.shape == (sum(SHARDS) // 16, K // 8, 16)
    assert layer.scales.shape == (sum(SHARDS) // 16, K // 32, 16)
    assert torch.equal(unblock_columns(layer.zeros).float(), unpacked.zeros.float())
    for rows in (1, 3):
        x = torch.randn(rows, K, dtype=torch.float16)
        torch.testing.assert_close(layer(x).float(), x.float() @ w.t(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("layout", ["plain", "blocked", "dequantized"])
def test_permute_outputs_moves_each_column_with_its_words_scales_and_zeros(layout, monkeypatch):
    # what order_inputs does to gate_up for an act-order down_proj: output column j becomes
    # the old column index[j], in the kernel's plain and column-blocked layouts and in a
    # weight dequantized on load
    from kvfleet_kernels.w4a16 import GemmConfig
    from kvfleet_runtime.layers.quantization import int_weight
    if layout == "blocked":
        monkeypatch.setattr(int_weight, "blocked_whole_k",
                            lambda *args: GemmConfig(1, 16, 64, 1, 4, 1, whole_k=True))
    tensors, w = int_checkpoint("gptq", 4, 32, False, desc_act=True)
    layer = build(int_config("gptq", 4, 32, False, True))
    load(layer, tensors)
    layer.linear_method.finalize(layer, layer.linear_method.unpack(layer),
                                 use_kernel=layout != "dequantized")
    assert layer.uses_kernel == (layout != "dequantized")
    assert (getattr(layer, "whole_k_config", None) is not None) == (layout == "blocked")
    index = torch.randperm(sum(SHARDS), generator=torch.Generator().manual_seed(5))
    assert layer.linear_method.permute_outputs(layer, index)
    for rows in (1, 3):
        x = torch.randn(rows, K, dtype=layer.params_dtype if layout == "dequantized"
                        else torch.float16)
        torch.testing.assert_close(layer(x).float(), x.float() @ w[index].t(), rtol=2e-3,
                                   atol=2e-3)


def test_fused_shards_must_share_act_order():
    tensors, _ = int_checkpoint("gptq", 4, 32, False, desc_act=True)
    tensors[1]["g_idx"] = torch.flip(tensors[1]["g_idx"], [0])
    layer = build(GPTQConfig(bits=4, group_size=32, desc_act=True))
    with pytest.raises(ValueError, match="g_idx of shard 1 differs"):
        load(layer, tensors)


def test_unequal_groups_fall_back_to_dequantized_weight():
    # a g_idx that puts 40 rows in group 0 cannot be served by the kernel's one-group tiles
    shards = quantize_shards("gptq", 4, 32, False, desc_act=False)
    for iq in shards:
        iq.g_idx = torch.tensor([0] * 40 + [1] * 24 + [2] * 32 + [3] * 32)
    tensors, w = pack_shards("gptq", 4, shards)
    layer = build(GPTQConfig(bits=4, group_size=32))
    load(layer, tensors)
    layer.linear_method.finalize(layer, layer.linear_method.unpack(layer), use_kernel=True)
    assert not layer.uses_kernel
    x = torch.randn(2, K)
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=0, atol=1e-5)


def test_unpackable_output_size_is_named():
    with pytest.raises(ValueError, match="output size 12, which must be a multiple of 8"):
        Linear(K, [64, 12], linear_method=AWQConfig(group_size=32).get_linear_method("x.gate_up_proj"),
               prefix="x.gate_up_proj")


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_checkpoint_scales_of_fused_shards(per_channel):
    quantized = [quantize_fp8(w, per_channel) for w in shard_weights(1)]
    layer = build(FP8Config(serialized=True))
    load(layer, [{"weight": w8, "weight_scale": s} for w8, s in quantized])
    # per-tensor scales of q, k, v become exact per-channel scales of the fused rows
    expected_scale = torch.cat([s.expand(n) for (_, s), n in zip(quantized, SHARDS, strict=True)])
    assert torch.equal(layer.weight_scale, expected_scale)
    weight8, scale = layer.weight.clone(), layer.weight_scale.clone()
    layer.linear_method.process_weights_after_loading(layer)
    assert not layer.uses_fp8        # no FP8 GEMM on CPU: dequantized on load
    w = torch.cat([w8.float() * (s[:, None] if per_channel else s) for w8, s in quantized])
    assert torch.equal(layer.weight, w)
    x = torch.randn(4, K)
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=0, atol=1e-5)
    # the GPU path also quantizes activations per token (3 mantissa bits): a few % off overall
    error = fp8_linear_ref(x, weight8, scale) - x @ w.t()
    assert error.norm() / (x @ w.t()).norm() < 0.05


@pytest.mark.parametrize("rows,mode", [(1, ""), (3, ""), (1, "0")])
def test_fp8_batch_one_gemv_hook(monkeypatch, rows, mode):
    # FP8 weights kept (what a Hopper GPU does; forced here, the kernel in the interpreter):
    # by default batch 1 multiplies by the e4m3 weight and its row scales without quantizing
    # the activation; more rows, or KVFLEET_TRITON_GEMV=0, go to the FP8 GEMM (not on a CPU)
    from kvfleet_kernels import gemv as gemv_module
    from kvfleet_runtime.layers import linear
    from kvfleet_runtime.layers.backend import set_backend
    from kvfleet_runtime.layers.quantization import fp8 as fp8_method
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # the modes as linear.py reads KVFLEET_TRITON_GEMV at import
    names = ("_TRITON_GEMV", "_TUNED_GEMV", "_FP8_GEMV")
    for name, value in zip(names, linear.gemv_modes(mode), strict=True):
        monkeypatch.setattr(linear, name, value)
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(fp8_method, "fp8_linear", lambda *a: calls.append("fp8_linear") or a[0])
    quantized = [quantize_fp8(w, True) for w in shard_weights(2)]
    layer = build(FP8Config(serialized=True))
    load(layer, [{"weight": w8, "weight_scale": s} for w8, s in quantized])
    layer.uses_fp8 = True
    set_backend("triton")
    try:
        x = torch.randn(rows, K)
        out = layer(x)
    finally:
        set_backend("auto")
    if rows == 1 and mode != "0":
        w = layer.weight.float() * layer.weight_scale[:, None]
        torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4)
        assert calls == [1]
    else:
        assert calls == ["fp8_linear"]


def test_triton_gemv_modes():
    from kvfleet_runtime.layers.linear import gemv_modes
    assert gemv_modes("") == (False, True, True)         # default: FP8 and gemv.TUNED shapes
    assert gemv_modes("0") == (False, False, False)
    assert gemv_modes("1") == (True, False, True)
    assert gemv_modes("tuned") == (False, True, True)
    with pytest.raises(ValueError, match="KVFLEET_TRITON_GEMV must be"):
        gemv_modes("yes")


def test_fp8_quantize_on_load_matches_per_channel_rounding():
    weights = shard_weights(2)
    layer = build(FP8Config(serialized=False))
    load(layer, [{"weight": w} for w in weights])
    layer.linear_method.process_weights_after_loading(layer)
    fused = torch.cat(weights)
    w8, scale = quantize_fp8(fused, per_channel=True)
    assert torch.equal(layer.weight, w8.float() * scale[:, None])
    # e4m3 keeps 3 mantissa bits: each weight within 1/16 of itself relative
    assert ((layer.weight - fused).abs() <= fused.abs() / 16 + 1e-6).all()


def test_fp8_scale_of_wrong_size_is_named():
    layer = build(FP8Config(serialized=True))
    with pytest.raises(ValueError, match=r"weight_scale of shape \(5,\) is neither per-tensor"):
        layer.weight_loader(layer.weight_scale, torch.ones(5), shard_id=1)
