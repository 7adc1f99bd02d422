"""FP8 GEMM inputs quantized by the kernel that writes them (RMSNorm, SiLU-and-mul) instead of
by fp8_linear: an FP8 Linear fed an FP8Activation gives the unfused output exactly, batch 1 keeps
the bf16 activation for the W8A16 GEMV, and a tiny FP8 Llama's greedy tokens and prompt
log-probs do not change with the fusion.

A CPU has no FP8 GEMM: `fp8_supported` is forced (the layers keep their e4m3 weights, as on a
Hopper GPU), torch._scaled_mm is replaced by its fp32 reference, and the Triton kernels run in
Triton's interpreter (TRITON_INTERPRET=1 exported before triton is imported, as scripts/test does).
Both paths round to e4m3 through the same interpreter, so its e4m3 flaw
(test_kernel_fp8_quant.py) cannot tell them apart.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvfleet_kernels import activation as activation_kernels
from kvfleet_kernels import fp8 as fp8_kernels
from kvfleet_kernels import norm as norm_kernels
from kvfleet_runtime.layers.activation import SiluAndMul
from kvfleet_runtime.layers.backend import set_backend
from kvfleet_runtime.layers.linear import Linear
from kvfleet_runtime.layers.norm import RMSNorm
from kvfleet_runtime.layers.quantization import FP8Config
from kvfleet_runtime.layers.quantization import fp8 as fp8_method
from kvfleet_runtime.layers.quantization.fp8 import FP8Activation, feeds_fp8

from quantization.checkpoints import quantize_fp8

K = 128


def scaled_mm_ref(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    # torch._scaled_mm with row-wise scales, in fp32 (the accumulation mode is the GPU's)
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


@pytest.fixture
def fp8_gemm(monkeypatch):
    """FP8 layers keep their e4m3 weights on this CPU; kernels run in the interpreter; counts
    the quantizations fp8_linear runs itself and the fused kernels' calls."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fp8_method, "fp8_supported", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_ref)
    calls: list[str] = []
    for module, name in ((fp8_kernels, "quantize_fp8_rowwise_triton"),
                         (norm_kernels, "rms_norm_fp8"),
                         (activation_kernels, "silu_and_mul_fp8")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    set_backend("triton")
    yield calls
    set_backend("auto")


def fp8_layer(input_size: int, output_size: int, dtype: torch.dtype, seed: int) -> Linear:
    w8, scale = quantize_fp8(torch.randn(output_size, input_size,
                                         generator=torch.Generator().manual_seed(seed)) * 0.05, True)
    layer = Linear(input_size, output_size, dtype=dtype, prefix="model.layers.0.mlp.down_proj",
                   linear_method=FP8Config(serialized=True).get_linear_method("down_proj"))
    layer.weight_loader(layer.weight, w8)
    layer.weight_loader(layer.weight_scale, scale)
    return layer


def _randn(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [3, 1])
def test_fp8_layer_fed_by_fused_rms_norm_matches_unfused(fp8_gemm, dtype, rows):
    norm = RMSNorm(K, 1e-5, dtype)
    norm.weight.data.copy_(1 + 0.2 * _randn(1, K, torch.float32, seed=1)[0])
    layer = fp8_layer(K, 64, dtype, seed=2)
    feeds_fp8(norm, layer)
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.uses_fp8 and norm.fp8_out       # set at load time by the consumer
    x, residual = _randn(rows, K, dtype, seed=3), _randn(rows, K, dtype, seed=4)
    normed, summed = norm(x, residual)
    assert isinstance(normed, FP8Activation) == (rows > 1)   # batch 1: the GEMV's bf16 input
    fused = layer(normed)
    assert fp8_gemm == (["rms_norm_fp8"] if rows > 1 else [])
    norm.fp8_out = False
    unfused_normed, unfused_summed = norm(x, residual)
    assert torch.equal(fused, layer(unfused_normed)) and fused.dtype == dtype
    assert torch.equal(summed, unfused_summed)
    # the first layer's norm has no residual
    norm.fp8_out = True
    fused = layer(norm(x))
    norm.fp8_out = False
    assert torch.equal(fused, layer(norm(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_down_proj_fed_by_fused_silu_and_mul_matches_unfused(fp8_gemm, dtype):
    act = SiluAndMul()
    layer = fp8_layer(64, 32, dtype, seed=5)
    feeds_fp8(act, layer)
    layer.linear_method.process_weights_after_loading(layer)
    x = _randn(5, 128, dtype, seed=6)
    fused = layer(act(x))
    assert fp8_gemm == ["silu_and_mul_fp8"]
    act.fp8_out = False
    assert torch.equal(fused, layer(act(x)))
    assert fp8_gemm == ["silu_and_mul_fp8", "quantize_fp8_rowwise_triton"]


def test_fp8_linear_takes_a_quantized_activation_and_its_dtype(fp8_gemm):
    from kvfleet_kernels.fp8 import fp8_linear, quantize_fp8_rowwise_triton
    layer = fp8_layer(K, 64, torch.float16, seed=9)
    x = _randn(4, K, torch.float16, seed=10)
    xq, x_scale = quantize_fp8_rowwise_triton(x)
    out = fp8_linear(xq, layer.weight, layer.weight_scale, x_scale=x_scale, out_dtype=x.dtype)
    assert torch.equal(out, fp8_linear(x, layer.weight, layer.weight_scale))
    with pytest.raises(ValueError, match="x_scale takes x in torch.float8_e4m3fn and an out_dtype"):
        fp8_linear(xq, layer.weight, layer.weight_scale, x_scale=x_scale)


def test_without_fp8_gemm_the_producer_stays_unquantized():
    # a CPU (or a size that is no multiple of 16): the weights are dequantized on load
    norm, act = RMSNorm(K), SiluAndMul()
    layer = fp8_layer(K, 64, torch.float32, seed=7)
    feeds_fp8(norm, layer)
    feeds_fp8(act, layer)
    layer.linear_method.process_weights_after_loading(layer)
    assert not layer.uses_fp8 and not norm.fp8_out and not act.fp8_out
    x = _randn(3, K, torch.float32, seed=8)
    assert isinstance(norm(x), torch.Tensor) and isinstance(act(x), torch.Tensor)


def test_tiny_fp8_llama_is_unchanged_by_the_fusion(fp8_gemm, monkeypatch, tmp_path):
    from kvfleet_runtime import LLM, SamplingParams
    from kvfleet_runtime.models import llama
    from support.tiny_models import make_tiny_model
    path = make_tiny_model("llama", tmp_path / "tiny-llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (4, 17, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)

    def run():
        llm = LLM(model=str(path), quantization="fp8", attention_backend="triton", max_num_seqs=4)
        try:
            outs = llm.generate(prompts, params)
        finally:
            llm.engine.shutdown()
            set_backend("triton")
        return ([o.outputs[0].token_ids for o in outs],
                [[pos[tok].logprob for pos, tok in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
                 for o, p in zip(outs, prompts, strict=True)])

    fused = run()
    assert {"rms_norm_fp8", "silu_and_mul_fp8"} <= set(fp8_gemm)
    # every GEMM input but o_proj's came quantized (batch-1 decode steps: the GEMV, unquantized)
    assert fp8_gemm.count("quantize_fp8_rowwise_triton") * 3 == (
        fp8_gemm.count("rms_norm_fp8") + fp8_gemm.count("silu_and_mul_fp8"))
    fp8_gemm.clear()
    monkeypatch.setattr(llama, "feeds_fp8", lambda producer, consumer: None)
    unfused = run()
    assert not {"rms_norm_fp8", "silu_and_mul_fp8"} & set(fp8_gemm)
    assert fused == unfused


def test_fp8_fast_accumulation_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("KVFLEET_FP8_FAST_ACCUM", raising=False)
    assert fp8_kernels.fast_accum_default() is True
    monkeypatch.setenv("KVFLEET_FP8_FAST_ACCUM", "0")
    assert fp8_kernels.fast_accum_default() is False
    monkeypatch.setenv("KVFLEET_FP8_FAST_ACCUM", "yes")
    with pytest.raises(ValueError, match="KVFLEET_FP8_FAST_ACCUM must be 0 or 1; got 'yes'"):
        fp8_kernels.fast_accum_default()
