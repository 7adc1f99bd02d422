"""compressed-tensors checkpoints (written by the compressed-tensors library: ct_checkpoints.py)
served from their tensors as stored: greedy tokens equal to HF transformers' on the weights the
library's own decompressor gives back, prompt log-probs to 1e-4, and the quantization shown to
have moved the model (against the fp32 original). Unserved schemes are refused by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.layers.quantization import CompressedTensorsConfig, get_quant_config
from support.tiny_models import make_tiny_model

from quantization.ct_checkpoints import (
    FP8_DYNAMIC_ACTS,
    FP8_STATIC_ACTS,
    FP8_WEIGHTS,
    INT8_DYNAMIC_ACTS,
    INT8_STATIC_ACTS,
    INT8_WEIGHTS,
    W4A16,
    W4A16_ASYM,
    W8A16,
    fp4_preset,
    scheme,
    write_compressed,
)
from quantization.test_tiny_llama import _assert_matches_hf, _prompts, hf_reference, kvfleet_run

# name -> (write_compressed arguments, how far the rounding may move a prompt log-prob from
# the fp32 model's: 4-bit <= 0.1, 8-bit and fp8 <= 0.02 on this tiny model, as test_tiny_llama)
CASES = {
    "w4a16-g32": ({"weights": W4A16}, 0.1),
    # scales in bf16, as real checkpoints store them; zero points packed along the outputs
    "w4a16-asym-bf16": ({"weights": W4A16_ASYM, "dtype": torch.bfloat16}, 0.1),
    "w8a16-channel": ({"weights": W8A16}, 0.02),
    "w4a16-actorder-group": ({"weights": W4A16_ASYM, "act_order": True}, 0.1),
    "fp8-dynamic": ({"weights": FP8_WEIGHTS, "input_activations": FP8_DYNAMIC_ACTS}, 0.02),
    # FP8 with a calibrated input_scale: read past, the activations scaled per token instead
    "fp8-static-per-tensor": ({"weights": {**FP8_WEIGHTS, "strategy": "tensor"},
                               "input_activations": FP8_STATIC_ACTS}, 0.02),
    "fp8-blocks-16x32": ({"weights": {**FP8_WEIGHTS, "strategy": "block",
                                      "block_structure": [16, 32]},
                          "input_activations": FP8_DYNAMIC_ACTS}, 0.02),
    # W8A8 int8 (int-quantized): int8 weights, on a CPU their activations unquantized (W8A16;
    # the GPU's W8A8 path: test_w8a8_int8_quantizes_activations_per_token_on_the_integer_gemm)
    "w8a8-int8-dynamic": ({"weights": INT8_WEIGHTS, "input_activations": INT8_DYNAMIC_ACTS},
                          0.02),
    "w8a8-int8-asym-per-tensor-static": ({"weights": {**INT8_WEIGHTS, "symmetric": False,
                                                      "strategy": "tensor"},
                                          "input_activations": INT8_STATIC_ACTS}, 0.02),
    # FP4 weights (the library's presets), dequantized on load: NVFP4 (e4m3 scales a 16
    # inputs over a global scale a projection), MXFP4 (power-of-two scales a 32), and NVFP4
    # W4A4 (its FP4 activations left unquantized, input_global_scale read past)
    "nvfp4a16": (dict(zip(("weights", "input_activations"), fp4_preset("NVFP4A16"),
                          strict=True)), 0.15),
    "mxfp4a16": (dict(zip(("weights", "input_activations"), fp4_preset("MXFP4A16"),
                          strict=True)), 0.15),
    "nvfp4-w4a4": (dict(zip(("weights", "input_activations"), fp4_preset("NVFP4"),
                            strict=True)), 0.15),
    # two groups (attention 8-bit by regex, the rest 4-bit), one layer's down_proj ignored
    "mixed-groups-and-ignore": ({"weights": None, "groups": {
        "attention": scheme(W8A16, targets=["re:.*self_attn"]),
        "rest": scheme(W4A16, targets=["Linear"])},
        "ignore": ("lm_head", "model.layers.1.mlp.down_proj")}, 0.1),
}


# cases HF transformers itself loads from the compressed checkpoint (decompressing on load):
# its model there is the reference's, exactly (a check of the reference by a second reader)
HF_READS = ("w4a16-g32", "w8a16-channel")


def _hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([_prompts()[1]])).logits


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_tensors_tiny_llama_matches_hf_on_decompressed_weights(
        case, tiny_llama, fp32_reference, tmp_path):
    args, tolerance = CASES[case]
    quantized, dequantized = tmp_path / "quantized", tmp_path / "dequantized"
    write_compressed(tiny_llama, quantized, dequantized, **args)
    if case in HF_READS:
        torch.testing.assert_close(_hf_logits(quantized), _hf_logits(dequantized), rtol=0, atol=0)
    logprobs = _assert_matches_hf(quantized, dequantized)
    for our_lp, fp32_lp in zip(logprobs, fp32_reference, strict=True):
        drift = (our_lp - fp32_lp).abs().max().item()
        assert 0 < drift < tolerance, drift


def _int8_activations(model) -> None:
    """Each projection's input rounded per token to int8 and back (W8A8's activations:
    kvfleet_kernels.int8.quantize_int8_per_token_ref), as forward pre-hooks on HF's model."""
    from kvfleet_kernels.int8 import quantize_int8_per_token_ref

    def hook(module, args):
        x = args[0]
        q, scale = quantize_int8_per_token_ref(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale).reshape(x.shape).to(x.dtype),)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("weights, backend", [("channel", "auto"), ("tensor", "triton")])
def test_w8a8_int8_quantizes_activations_per_token_on_the_integer_gemm(
        weights, backend, tiny_llama, fp32_reference, tmp_path, monkeypatch):
    # the GPU's W8A8 path run on a CPU (int8_supported forced: the Triton kernels interpreted):
    # HF on the library's decompressed weights with every projection's input rounded per token
    # to int8 is the same arithmetic. backend triton: the whole GPU path, where the norms and
    # the activation hand qkv, gate_up and down their input quantized (Int8Activation)
    from kvfleet_runtime.layers.quantization import compressed_tensors as ct
    from kvfleet_runtime.layers.quantization.fp8 import Int8Activation
    monkeypatch.setattr(ct, "int8_supported", lambda device: True)
    quantized, dequantized = tmp_path / "q", tmp_path / "d"
    write_compressed(tiny_llama, quantized, dequantized, {**INT8_WEIGHTS, "strategy": weights},
                     INT8_DYNAMIC_ACTS)
    llm = LLM(model=str(quantized), attention_backend=backend)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if hasattr(m, "uses_int8")]
    assert len(layers) == 8 and all(m.uses_int8 for m in layers)     # 4 projections x 2 layers
    # the producers in front of qkv, gate_up and down quantize (o_proj's input, the attention
    # output, is quantized by its GEMM)
    producers = [m for name, m in model.named_modules()
                 if name.endswith(("input_layernorm", "post_attention_layernorm", "act_fn"))]
    assert len(producers) == 6 and all(m.int8_out and not m.fp8_out for m in producers)
    del llm
    fed = []
    apply = ct.CTInt8LinearMethod.apply

    def counting_apply(self, layer, x, bias):
        fed.append(isinstance(x, Int8Activation))
        return apply(self, layer, x, bias)
    monkeypatch.setattr(ct.CTInt8LinearMethod, "apply", counting_apply)
    prompts = _prompts()
    tokens, logprobs = kvfleet_run(quantized, prompts, attention_backend=backend)
    # triton: 3 of a layer's 4 projections fed quantized (all but batch-1 steps' GEMVs)
    assert (0.6 < sum(fed) / len(fed) <= 0.75) if backend == "triton" else not any(fed)
    ref_tokens, ref_logprobs = hf_reference(dequantized, prompts, prepare=_int8_activations)
    _, w8a16_logprobs = hf_reference(dequantized, prompts)
    assert tokens == ref_tokens
    for ours, ref, w8a16, fp32 in zip(logprobs, ref_logprobs, w8a16_logprobs, fp32_reference,
                                      strict=True):
        # ~1e-6 (fp32 sums in other orders) but where an activation sat on an int8 rounding
        # boundary: one step apart there (measured 3.6e-4 at one prompt position of 96)
        diff = (ours - ref).abs()
        assert int((diff > 1e-5).sum()) <= 1 and diff.max() < 5e-4, diff
        # the activations' rounding moved the model past the weights' alone (measured
        # 1.4e-3 to 2.2e-3 a prompt), within int8's reach of the fp32 model
        assert (ours - w8a16).abs().max() > 1e-3
        assert (ours - fp32).abs().max() < 0.02


def test_ignored_and_unmatched_layers_stay_in_the_models_dtype(tiny_llama, tmp_path):
    write_compressed(tiny_llama, tmp_path / "q", tmp_path / "d", None, groups={
        "attention": scheme(W4A16, targets=["re:.*self_attn\\.(q|k|v)_proj$"])},
        ignore=("lm_head", "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.k_proj",
                "model.layers.0.self_attn.q_proj"))
    config = get_quant_config(json.loads((tmp_path / "q" / "config.json").read_text()),
                              str(tmp_path / "q"), None)
    assert isinstance(config, CompressedTensorsConfig)
    assert config.get_linear_method("model.layers.0.self_attn.qkv_proj") is None
    assert config.get_linear_method("model.layers.1.self_attn.qkv_proj") is not None
    assert config.get_linear_method("model.layers.1.self_attn.o_proj") is None
    assert config.get_linear_method("model.layers.1.mlp.gate_up_proj") is None
    _assert_matches_hf(tmp_path / "q", tmp_path / "d")


@pytest.mark.parametrize("weights, acts", [(W4A16_ASYM, None), (FP8_WEIGHTS, FP8_STATIC_ACTS)],
                         ids=["w4a16-asym", "fp8-per-channel-static"])
def test_phi3_fused_compressed_projections_match_hf(weights, acts, tmp_path):
    # Phi-3 stores qkv_proj and gate_up_proj fused: the packed weight, scales, zero points
    # (packed along the outputs) split into the pieces; weight_shape names the fused layer
    source = make_tiny_model("phi3", tmp_path / "phi3")
    write_compressed(source, tmp_path / "q", tmp_path / "d", weights, acts)
    _assert_matches_hf(tmp_path / "q", tmp_path / "d")


def _config(**overrides) -> dict:
    group = {"targets": ["Linear"], "weights": dict(W4A16), "input_activations": None,
             "output_activations": None}
    raw = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ["lm_head"],
           "config_groups": {"group_0": group}}
    for key, value in overrides.items():
        if key.startswith("group."):
            group[key.removeprefix("group.")] = value
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize("overrides, message", [
    ({"group.input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                  "dynamic": True}},
     r"config_groups\.group_0\.input_activations must be null for pack-quantized weights"),
    ({"format": "marlin-24"}, r"config_groups\.group_0\.format \(or the top-level format\) "
                              r"must be one of pack-quantized, int-quantized, naive-quantized, "
                              r"float-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized "
                              r".*'marlin-24'"),
    ({"format": "int-quantized", "group.weights": {**INT8_WEIGHTS, "strategy": "group",
                                                   "group_size": 32}},
     r"weights\.strategy must be one of channel, tensor; got 'group'"),
    ({"format": "int-quantized", "group.weights": INT8_WEIGHTS,
      "group.input_activations": {**INT8_DYNAMIC_ACTS, "num_bits": 4}},
     r"input_activations\.num_bits must be one of 8; got 4"),
    ({"format": "mxfp6-pack-quantized"}, r"got 'mxfp6-pack-quantized'"),
    ({"format": "nvfp4-pack-quantized", "group.weights": {**W4A16, "type": "float",
                                                          "strategy": "tensor_group"}},
     r"weights\.group_size must be one of 16; got 32"),
    ({"format": "mxfp4-pack-quantized", "group.weights": {**W4A16, "type": "float",
                                                          "group_size": 32,
                                                          "symmetric": False}},
     r"weights\.symmetric must be one of True; got False"),
    ({"group.weights": {**W4A16, "num_bits": 2}},
     r"config_groups\.group_0\.weights\.num_bits must be one of 4, 8; got 2"),
    ({"group.weights": {**W4A16, "strategy": "tensor"}},
     r"weights\.strategy must be one of group, channel; got 'tensor'"),
    ({"group.weights": {**W4A16, "group_size": None}},
     r"weights\.group_size must be a positive integer for strategy group; got None"),
    ({"format": "float-quantized", "group.weights": {**FP8_WEIGHTS, "strategy": "block"}},
     r"weights\.block_structure must be two positive integers"),
    ({"format": "float-quantized", "group.weights": FP8_WEIGHTS,
      "group.input_activations": {**FP8_STATIC_ACTS, "strategy": "channel"}},
     r"input_activations\.strategy must be one of tensor; got 'channel'"),
    ({"quantization_status": "frozen"}, r"quantization_status must be compressed .* 'frozen'"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, r"sparse checkpoints are not served"),
    ({"group.output_activations": {"num_bits": 8}}, r"output_activations must be null"),
    ({"transform_config": {"config_groups": {"R1": {"type": "hadamard"}}}},
     r"transform_config must be null: rotated \(transformed\) weights are not served"),
    ({"moe_sparsity_config": {"method": "prune"}}, r"moe_sparsity_config must be null"),
], ids=["int8-activations", "marlin-24", "int8-groups", "int4-activations", "mxfp6",
        "nvfp4-group-32", "mxfp4-asymmetric", "2-bit", "int-per-tensor", "no-group-size",
        "fp8-block-without-structure", "static-per-channel-activations",
        "frozen", "sparse", "output-activations", "transform", "moe-sparsity"])
def test_unserved_schemes_are_refused_by_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_quant_config({"quantization_config": _config(**overrides)}, None, None)


def test_fused_shards_under_different_schemes_are_refused():
    raw = _config()
    raw["config_groups"]["wide"] = {"targets": ["re:.*v_proj$"], "weights": W8A16}
    raw["config_groups"] = {"wide": raw["config_groups"].pop("wide"), **raw["config_groups"]}
    config = get_quant_config({"quantization_config": raw}, None, "compressed-tensors")
    assert config.get_linear_method("model.layers.0.mlp.gate_up_proj").bits == 4
    with pytest.raises(ValueError, match=r"the shards of the fused layer "
                                         r"model\.layers\.0\.self_attn\.qkv_proj fall under "
                                         r"different schemes"):
        config.get_linear_method("model.layers.0.self_attn.qkv_proj")


def test_a_method_requested_against_the_checkpoints_is_named(tiny_llama, tmp_path):
    write_compressed(tiny_llama, tmp_path / "q", tmp_path / "d", W4A16)
    with pytest.raises(ValueError, match="'gptq' was requested but the checkpoint is quantized "
                                         "with 'compressed-tensors'"):
        LLM(model=str(tmp_path / "q"), quantization="gptq")


def test_a_weight_shape_of_another_layer_is_refused(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file
    write_compressed(tiny_llama, tmp_path / "q", tmp_path / "d", W4A16)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([128, 64])
    save_file(tensors, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: checkpoint "
                                         r"weight_shape \[128, 64\] of piece 0 is not the "
                                         r"layer's \[64, 128\]"):
        LLM(model=str(tmp_path / "q"))


@pytest.mark.parametrize(("arch", "weights", "acts", "act_order"), [
    ("qwen3_moe", {**W4A16_ASYM, "group_size": 8}, None, False),
    ("mixtral", {**W4A16, "group_size": 16}, None, False),
    ("qwen3_moe", {**W4A16_ASYM, "group_size": 8}, None, True),
    ("qwen3_moe", {**INT8_WEIGHTS, "symmetric": False}, INT8_STATIC_ACTS, False),
    ("qwen3_moe", *fp4_preset("NVFP4"), False),
    ("mixtral", *fp4_preset("MXFP4A16"), False)],
    ids=["qwen3_moe-w4a16-asym", "mixtral-w4a16", "qwen3_moe-actorder", "qwen3_moe-w8a8-asym",
         "qwen3_moe-nvfp4-w4a4", "mixtral-mxfp4"])
def test_compressed_tensors_experts_match_hf_on_their_decompressed_weights(arch, weights, acts,
                                                                          act_order, tmp_path):
    # every projection quantized, experts too (each expert's its own tensors); the routers
    # left alone as llm-compressor's recipes ignore them. Integer experts stay packed (the
    # MoE kernels' IntExperts; FP4 ones as 8-bit integers), act-order ones too
    from kvfleet_runtime.layers.moe import SparseMoeBlock
    from support.hf_reference import hf_greedy
    source = make_tiny_model(arch, tmp_path / "source")
    write_compressed(source, tmp_path / "q", tmp_path / "d", weights, acts, act_order=act_order,
                     ignore=("lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"))
    prompts = _prompts()
    ref = hf_greedy(tmp_path / "d", prompts, 10)
    assert ref != hf_greedy(source, prompts, 10)        # the rounding moves these outputs
    llm = LLM(model=str(tmp_path / "q"), num_gpu_blocks=16)
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    # (the FP4 presets are QuantizationArgs: their values doubled into 8 bits)
    bits = weights["num_bits"] if isinstance(weights, dict) else 8
    assert block.w13 is None and block.int_experts[0].bits == bits
    # act-order experts: their inputs sorted by group, each expert's order kept
    assert (block.int_experts[0].perm is not None) == act_order
    params = SamplingParams(temperature=0.0, max_tokens=10)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref


def test_compressed_tensors_fp8_experts_match_hf_over_their_rounding(tmp_path):
    # FP8 experts a scale a row, dynamic activations (FP8_DYNAMIC): dequantized as they load,
    # then rounded a row at a time as --quantization fp8 rounds experts
    from runtime.test_moe import hf_greedy_experts_rounded
    from support.hf_reference import hf_greedy
    source = make_tiny_model("qwen3_moe", tmp_path / "source")
    write_compressed(source, tmp_path / "q", tmp_path / "d", FP8_WEIGHTS, FP8_DYNAMIC_ACTS,
                     ignore=("lm_head", "re:.*mlp.gate$"))
    prompts = _prompts()
    ref = hf_greedy_experts_rounded(tmp_path / "d", prompts, 10)
    assert ref != hf_greedy(source, prompts, 10)
    llm = LLM(model=str(tmp_path / "q"), num_gpu_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref


def test_experts_under_different_schemes_are_refused(tmp_path):
    source = make_tiny_model("qwen3_moe", tmp_path / "moe")
    config = json.loads((source / "config.json").read_text())
    raw = _config()
    raw["config_groups"] = {"down": {"targets": ["re:.*experts.*down_proj$"], "weights": W8A16},
                            **raw["config_groups"]}
    config["quantization_config"] = raw
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="compressed-tensors experts must all fall under one "
                                         "quantization scheme"):
        LLM(model=str(source), num_gpu_blocks=16)


def test_calibrated_kv_cache_scales_bind_to_an_fp8_cache(tiny_llama, tmp_path, caplog):
    # FP8 with a kv_cache_scheme (llm-compressor's FP8 + KV recipes): self_attn.k_scale /
    # v_scale beside the weights; an fp8 cache takes them (tests/runtime/test_kv_scales.py),
    # the default cache keeps K and V as they are (HF's outputs)
    from safetensors.torch import load_file, save_file
    write_compressed(tiny_llama, tmp_path / "q", tmp_path / "d", FP8_WEIGHTS, FP8_DYNAMIC_ACTS)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    for layer in range(2):
        for kind in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{kind}"] = torch.tensor(
                0.02 if kind == "k_scale" else 0.03)
    save_file(tensors, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
        "symmetric": True}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with caplog.at_level("INFO"):
        _assert_matches_hf(tmp_path / "q", tmp_path / "d")
    assert "calibrated KV-cache scales apply to an fp8 cache" in caplog.text
    llm = LLM(model=str(tmp_path / "q"), kv_cache_dtype="fp8", num_gpu_blocks=16)
    assert [(layer.k_scale, layer.v_scale) for layer in llm.engine.runner.model.attention_layers()] \
        == [(pytest.approx(0.02), pytest.approx(0.03))] * 2
