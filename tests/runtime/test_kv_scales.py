"""Calibrated KV-cache scales (self_attn.k_scale / v_scale) with an fp8 KV cache, end to end.

The checkpoints are a tiny Llama-3 whose keys and values are made A times larger (k_proj and
v_proj times A, q_proj and o_proj divided by A: the same function). With A a power of two every
step is exact in fp32, so the amplified model with k_scale = v_scale = A must give the original
model's fp8-cache run bit for bit (the cache holds the same bytes, the scales come back out in the
softmax scale and the output), while the amplified model without scales saturates its cache at
+-448. Torch path (CPU); the kernels' scale arguments: tests/kernels/test_kernel_kv_fp8.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kvfleet_kernels.paged_attention import (
    FP8_KV_DTYPE,
    paged_attention_ref,
    reshape_and_cache_ref,
    token_major_v,
)
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.layers.attention import Attention
from safetensors.torch import load_file, save_file
from support.attention import paged_meta
from test_kv_cache_dtype import LOGPROB_TOLERANCE, _max_logprob_difference, _prompts

A = 4096.0
NUM_LAYERS = 2          # support.tiny_models
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, prompt_logprobs=0)


def _amplified(src: str, dst: Path, factor: float, extra: dict[str, torch.Tensor],
               quantization_config: dict | None = None) -> str:
    """src's checkpoint with K and V `factor` times larger (the same model), plus `extra`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        shutil.copy(f, dst / f.name)
    tensors = load_file(dst / "model.safetensors")
    for i in range(NUM_LAYERS):
        attn = f"model.layers.{i}.self_attn"
        for proj, times in (("q_proj", 1 / factor), ("k_proj", factor), ("v_proj", factor),
                            ("o_proj", 1 / factor)):
            tensors[f"{attn}.{proj}.weight"] = tensors[f"{attn}.{proj}.weight"] * times
    tensors.update(extra)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _scales(k: float | torch.Tensor, v: float | torch.Tensor, names=("k_scale", "v_scale"),
            layers=range(NUM_LAYERS)) -> dict[str, torch.Tensor]:
    out = {}
    for i in layers:
        for name, value in zip(names, (k, v), strict=False):
            out[f"model.layers.{i}.self_attn.{name}"] = torch.as_tensor(value, dtype=torch.float32).clone()
    return out


def _run(path: str, kv: str = "fp8"):
    llm = LLM(model=path, kv_cache_dtype=kv, max_num_seqs=8)
    return llm, llm.generate(_prompts(8, seed=3), PARAMS)


def _bound(llm: LLM) -> list[tuple[float, float]]:
    return [(layer.k_scale, layer.v_scale) for layer in llm.engine.runner.model.attention_layers()]


@pytest.fixture(scope="module")
def original(tiny_model_dir):
    path = tiny_model_dir("llama3")
    return path, {kv: _run(path, kv)[1] for kv in ("fp8", "auto")}


def _same_outputs(a, b) -> None:
    for ra, rb in zip(a, b, strict=True):
        assert ra.outputs[0].token_ids == rb.outputs[0].token_ids
    assert _max_logprob_difference(a, b) == 0.0


def test_calibrated_scales_give_the_amplified_model_the_original_fp8_runs_outputs(
        original, tmp_path: Path) -> None:
    src, runs = original
    scaled = _amplified(src, tmp_path / "scaled", A, _scales(A, A))
    llm, outputs = _run(scaled)
    assert _bound(llm) == [(A, A)] * NUM_LAYERS
    _same_outputs(outputs, runs["fp8"])
    # without the scales the amplified keys and values saturate the cache: far off, many times
    # what fp8 rounding moves (measured 0.22 against 0.0098; a tiny random model's next-token
    # distribution is near uniform, so no logprob moves much)
    bare = _amplified(src, tmp_path / "bare", A, {})
    llm, unscaled = _run(bare)
    assert _bound(llm) == [(1.0, 1.0)] * NUM_LAYERS
    rounding = _max_logprob_difference(runs["fp8"], runs["auto"])     # fp8 vs an fp32 cache
    assert 0.0 < rounding < LOGPROB_TOLERANCE
    assert _max_logprob_difference(unscaled, runs["fp8"]) > 10 * rounding
    # an fp32 cache keeps K and V as they are: the scales are not applied (the original's run)
    llm, plain = _run(scaled, "auto")
    assert _bound(llm) == [(1.0, 1.0)] * NUM_LAYERS
    assert [layer.checkpoint_kv_scales for layer in llm.engine.runner.model.attention_layers()] \
        == [(A, A)] * NUM_LAYERS
    _same_outputs(plain, runs["auto"])


@pytest.mark.parametrize("layout", ["attn.k_scale", "kv_scale", "k_proj.output_scale",
                                    "k_proj.k_scale", "per-head", "one-element"])
def test_each_checkpoint_spelling_of_the_scales_binds_them(original, tmp_path: Path,
                                                           layout: str) -> None:
    # vLLM-style names under self_attn.attn, AutoFP8's one kv_scale for both, an older
    # compressed-tensors' k_proj / v_proj output scales, ModelOpt's k_proj.k_scale /
    # v_proj.v_scale, per-head scales (the largest serves), one-element tensors
    src, runs = original
    extra = {
        "attn.k_scale": _scales(A, A / 2, names=("attn.k_scale", "attn.v_scale")),
        "kv_scale": _scales(A, A, names=("kv_scale",)),
        "k_proj.output_scale": _scales(A, A / 2, names=("k_proj.output_scale",
                                                        "v_proj.output_scale")),
        "k_proj.k_scale": _scales(A, A / 2, names=("k_proj.k_scale", "v_proj.v_scale")),
        "per-head": _scales(torch.tensor([A / 8, A]), torch.tensor([A / 2, A / 4])),
        "one-element": _scales(torch.tensor([A]), torch.tensor([A / 2])),
    }[layout]
    llm, outputs = _run(_amplified(src, tmp_path / layout, A, extra))
    expected = (A, A) if layout == "kv_scale" else (A, A / 2)
    assert _bound(llm) == [expected] * NUM_LAYERS
    if expected == (A, A):
        _same_outputs(outputs, runs["fp8"])
    else:
        # V held at twice its range's share: a little coarser than the original's, not saturated
        assert _max_logprob_difference(outputs, runs["fp8"]) < LOGPROB_TOLERANCE


def test_a_compressed_tensors_kv_cache_scheme_alone_quantizes_the_cache_only(
        original, tmp_path: Path) -> None:
    # llm-compressor's KV-cache-only recipe: no config_groups, calibrated per-tensor scales (here
    # not powers of two: the cache rounds a little differently from the original's)
    src, runs = original
    config = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "quantization_status": "compressed", "config_groups": {},
              "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                                  "symmetric": True, "dynamic": False}}
    path = _amplified(src, tmp_path / "ct", A, _scales(A * 1.37, A * 0.71), config)
    llm, outputs = _run(path)
    assert _bound(llm) == [(pytest.approx(A * 1.37), pytest.approx(A * 0.71))] * NUM_LAYERS
    assert 0.0 < _max_logprob_difference(outputs, runs["fp8"]) < LOGPROB_TOLERANCE


@pytest.mark.parametrize(("scheme", "message"), [
    ({"type": "int", "num_bits": 8, "strategy": "tensor", "symmetric": True},
     r"kv_cache_scheme.type must be one of float; got 'int'"),
    ({"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
     r"kv_cache_scheme.strategy must be one of tensor, attn_head; got 'channel'"),
    ({"type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": False},
     r"kv_cache_scheme.symmetric must be one of True; got False"),
    ({"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": True},
     r"kv_cache_scheme.dynamic must be false"),
], ids=["int", "channel", "asymmetric", "dynamic"])
def test_a_kv_cache_scheme_the_fp8_cache_cannot_hold_is_refused(original, tmp_path: Path,
                                                                 scheme: dict, message: str) -> None:
    config = {"quant_method": "compressed-tensors", "quantization_status": "compressed",
              "config_groups": {}, "kv_cache_scheme": scheme}
    path = _amplified(original[0], tmp_path / "bad", 1.0, _scales(1.0, 1.0), config)
    with pytest.raises(ValueError, match=message):
        LLM(model=path, kv_cache_dtype="fp8")


@pytest.mark.parametrize(("extra", "message"), [
    (_scales(0.0, 1.0), r"'model.layers.0.self_attn.k_scale' is a KV-cache scale, which must "
                        r"be finite and > 0; got \[0.0\]"),
    (_scales(1.0, float("nan")), r"self_attn.v_scale' is a KV-cache scale, which must be finite"),
    (_scales(1.0, 1.0, layers=[5]), r"'model.layers.5.self_attn.v_scale' has no place in "
                                    r"LlamaForCausalLM: no attention layer model.layers.5"),
], ids=["zero", "nan", "no-such-layer"])
def test_a_bad_kv_scale_is_a_clear_error(original, tmp_path: Path, extra: dict,
                                         message: str) -> None:
    path = _amplified(original[0], tmp_path / "bad", 1.0, extra)
    with pytest.raises(ValueError, match=message):
        LLM(model=path, kv_cache_dtype="fp8")


def test_fp8_attention_scales_are_read_past(original, tmp_path: Path) -> None:
    # q_scale / prob_scale are for FP8 attention math, which kvfleet does not run
    src, runs = original
    extra = {**_scales(A, A), **_scales(3.0, 5.0, names=("q_scale", "prob_scale"))}
    llm, outputs = _run(_amplified(src, tmp_path / "q", A, extra))
    _same_outputs(outputs, runs["fp8"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_lens", "seq_lens"), [
    ([9, 9, 30], [9, 9, 30]),
    ([5, 1, 12], [40, 70, 12]),
    ([1, 1, 1], [33, 70, 5]),
], ids=["fresh", "mixed", "decode"])
def test_attention_layer_torch_path_over_a_scaled_fp8_cache_matches_reference(
        dtype: torch.dtype, q_lens: list[int], seq_lens: list[int]) -> None:
    # the layer writes K / k_scale and V / v_scale and attends over them times the scales
    gen = torch.Generator().manual_seed(sum(seq_lens))
    num_blocks, block_size, num_heads, num_kv_heads, head_dim = 24, 16, 4, 2, 32
    k_scale, v_scale = 37.0, 0.013
    meta, slots = paged_meta(q_lens, seq_lens, block_size, num_blocks, gen)
    num_tokens = sum(q_lens)
    q = (torch.randn(num_tokens, num_heads * head_dim, generator=gen) / k_scale).to(dtype)
    k = (torch.randn(num_tokens, num_kv_heads * head_dim, generator=gen) * k_scale * 4).to(dtype)
    v = (torch.randn(num_tokens, num_kv_heads * head_dim, generator=gen) * v_scale * 4).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 4).to(FP8_KV_DTYPE)
    v_cache = token_major_v(torch.empty(shape, dtype=FP8_KV_DTYPE))
    v_cache.copy_((torch.randn(shape, generator=gen) * 4).to(FP8_KV_DTYPE))
    k_ref, v_ref = k_cache.clone(), v_cache.contiguous()
    layer = Attention(num_heads, head_dim, num_kv_heads, head_dim ** -0.5)
    layer.kv_cache, layer.k_scale, layer.v_scale = (k_cache, v_cache), k_scale, v_scale
    out = layer(q, k, v, meta)
    reshape_and_cache_ref(k.view(num_tokens, num_kv_heads, head_dim),
                          v.view(num_tokens, num_kv_heads, head_dim), k_ref, v_ref, slots,
                          k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.contiguous().view(torch.uint8), v_ref.view(torch.uint8))
    expected = paged_attention_ref(q.view(num_tokens, num_heads, head_dim), k_ref, v_ref,
                                   meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   head_dim ** -0.5, meta.max_query_len, k_scale=k_scale,
                                   v_scale=v_scale).view(num_tokens, -1)
    atol = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2}[dtype]
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(out.float() / scale, expected.float() / scale, rtol=0.0, atol=atol)


@pytest.mark.gpu
def test_gpu_calibrated_scales_on_the_triton_path(original, tmp_path: Path) -> None:
    # the fused rotary + cache write and the attention kernels (CUDA graphs on) with the scales,
    # bf16: not bit for bit (the kernels' fp16 dots round the divided queries), but as close to
    # the original's fp8 run as two bf16 backends are, and the saturated model far off
    src = original[0]
    runs = {}
    for name, path in [("original", src),
                       ("scaled", _amplified(src, tmp_path / "scaled", A, _scales(A, A))),
                       ("bare", _amplified(src, tmp_path / "bare", A, {}))]:
        llm = LLM(model=path, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
                  max_num_seqs=8)
        assert llm.engine.runner.model.attention_layers()[0].k_scale == (A if name == "scaled"
                                                                         else 1.0)
        runs[name] = llm.generate(_prompts(8, seed=3), PARAMS)
        del llm
    scaled = _max_logprob_difference(runs["scaled"], runs["original"])
    assert scaled < 0.1
    assert _max_logprob_difference(runs["bare"], runs["original"]) > 3 * max(scaled, 0.01)
