"""NVIDIA ModelOpt checkpoints (quant_method modelopt; or hf_quant_config.json) served from their
tensors as stored: greedy tokens equal to HF transformers' on the dequantized weights, prompt
log-probs to 1e-4, the quantization shown to move the model. ModelOpt itself does not install
here: the FP8 checkpoints are written from the published format (a per-tensor or per-channel
e4m3 scale), the NVFP4 ones from the compressed-tensors library's NVFP4 packer (the same e2m1
bytes and e4m3 group scales; ModelOpt's weight_scale_2 is its global scale's inverse), their
reference weights from the library's own FP4 unpacking times weight_scale * weight_scale_2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvfleet_runtime import LLM
from kvfleet_runtime.layers.quantization import ModelOptConfig, get_quant_config
from support.tiny_models import make_tiny_model

from quantization.checkpoints import PROJECTIONS, read_tensors, write_pair
from quantization.ct_checkpoints import compress_weight, fp4_preset, scheme
from quantization.test_tiny_llama import _assert_matches_hf

FP8_MAX = 448.0


def _fp8(w: torch.Tensor, per_channel: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    amax = w.abs().amax(dim=1) if per_channel else w.abs().max()
    scale = (amax / FP8_MAX).float()
    q = (w / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX).to(
        torch.float8_e4m3fn)
    out = {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(0.02)}
    return out, q.float() * (scale[:, None] if per_channel else scale)


def _nvfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    ct, _ = compress_weight(w, scheme(*fp4_preset("NVFP4A16")))
    scale_2 = 1.0 / ct["weight_global_scale"]
    n, half = ct["weight_packed"].shape
    values = unpack_fp4_from_uint8(ct["weight_packed"], n, 2 * half, dtype=torch.float32)
    reference = values * ct["weight_scale"].float().repeat_interleave(16, dim=1) * scale_2
    out = {"weight": ct["weight_packed"], "weight_scale": ct["weight_scale"],
           "weight_scale_2": scale_2, "input_scale": torch.tensor(0.02)}
    return out, reference


def write_modelopt(src: Path, dst: Path, reference: Path, algo: str,
                   exclude: tuple[str, ...] = ("lm_head",), side_file: bool = False) -> None:
    """src's projections quantized as ModelOpt exports them (FP8 / FP8_PER_CHANNEL_PER_TOKEN /
    NVFP4), calibrated KV scales (k_proj.k_scale / v_proj.v_scale) beside them; the reference
    folder the dequantized fp32 weights. side_file: the scheme in hf_quant_config.json."""
    from fnmatch import fnmatchcase
    quantized, dequantized = {}, {}
    for name, w in sorted(read_tensors(src).items()):
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS) or any(
                fnmatchcase(module, e) for e in exclude):
            quantized[name] = dequantized[name] = w
            continue
        out, dequantized[name] = (_nvfp4(w) if algo == "NVFP4" else
                                  _fp8(w, per_channel=algo != "FP8"))
        quantized.update({f"{module}.{k}": v for k, v in out.items()})
        if module.endswith(("k_proj", "v_proj")):
            quantized[f"{module}.{module[-6]}_scale"] = torch.tensor(0.5)
    quant = {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "exclude_modules": list(exclude),
             **({"group_size": 16} if algo == "NVFP4" else {})}
    write_pair(src, dst, reference, quantized, dequantized,
               {"quant_method": "modelopt", **quant})
    if side_file:
        config = json.loads((dst / "config.json").read_text())
        del config["quantization_config"]
        (dst / "config.json").write_text(json.dumps(config))
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": quant}))


@pytest.mark.parametrize(("algo", "side_file", "tolerance"), [
    ("FP8", False, 0.02), ("FP8", True, 0.02), ("FP8_PER_CHANNEL_PER_TOKEN", False, 0.02),
    ("NVFP4", False, 0.15)], ids=["fp8", "fp8-hf_quant_config", "fp8-per-channel", "nvfp4"])
def test_modelopt_tiny_llama_matches_hf_on_dequantized_weights(algo, side_file, tolerance,
                                                               tiny_llama, fp32_reference,
                                                               tmp_path):
    quantized, dequantized = tmp_path / "q", tmp_path / "d"
    write_modelopt(tiny_llama, quantized, dequantized, algo, side_file=side_file)
    logprobs = _assert_matches_hf(quantized, dequantized)
    for ours, fp32 in zip(logprobs, fp32_reference, strict=True):
        assert 0 < (ours - fp32).abs().max() < tolerance
    # the calibrated KV scales (k_proj.k_scale / v_proj.v_scale) go to an fp8 cache
    llm = LLM(model=str(quantized), kv_cache_dtype="fp8", num_gpu_blocks=16)
    assert [(a.k_scale, a.v_scale) for a in llm.engine.runner.model.attention_layers()] \
        == [(0.5, 0.5)] * 2


def test_excluded_modules_by_pattern_stay_in_the_models_dtype(tiny_llama, tmp_path):
    write_modelopt(tiny_llama, tmp_path / "q", tmp_path / "d", "NVFP4",
                   exclude=("lm_head", "model.layers.1.mlp.*"))
    config = get_quant_config(json.loads((tmp_path / "q" / "config.json").read_text()),
                              str(tmp_path / "q"), None)
    assert isinstance(config, ModelOptConfig)
    assert config.get_linear_method("model.layers.1.mlp.gate_up_proj") is None
    assert config.get_linear_method("model.layers.1.mlp.down_proj") is None
    assert config.get_linear_method("model.layers.0.mlp.down_proj") is not None
    _assert_matches_hf(tmp_path / "q", tmp_path / "d")


@pytest.mark.parametrize(("quant", "message"), [
    ({"quant_algo": "W4A8_AWQ"}, r"modelopt quantization_config\.quant_algo must be one of fp8, "
                                 r"fp8_per_channel_per_token, nvfp4; got 'w4a8_awq'"),
    ({"quant_algo": "NVFP4", "group_size": 32}, r"group_size must be one of 16; got 32"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
     r"kv_cache_quant_algo must be one of None, fp8; got 'nvfp4'"),
], ids=["w4a8-awq", "nvfp4-group-32", "fp4-kv-cache"])
def test_unserved_modelopt_schemes_are_refused_by_field(quant, message):
    with pytest.raises(ValueError, match=message):
        get_quant_config({"quantization_config": {"quant_method": "modelopt", **quant}}, None,
                         None)


@pytest.mark.parametrize(("arch", "algo"), [("qwen3_moe", "FP8"), ("mixtral", "NVFP4"),
                                          ("qwen3_moe", "FP8-experts-excluded")])
def test_modelopt_mixtures_of_experts_match_hf(arch, algo, tmp_path):
    # every projection quantized, the experts too (the routers are no projection): FP8 experts
    # dequantized as they load and rounded a row at a time (the reference rounds them alike),
    # NVFP4 ones kept packed as 8-bit integers (the exact products); experts that
    # exclude_modules names stay in the model's dtype
    from kvfleet_runtime import SamplingParams
    from kvfleet_runtime.layers.moe import SparseMoeBlock
    from runtime.test_moe import _prompts, hf_greedy_experts_rounded
    from support.hf_reference import hf_greedy
    source = make_tiny_model(arch, tmp_path / "source")
    excluded = algo.endswith("-experts-excluded")
    write_modelopt(source, tmp_path / "q", tmp_path / "d", algo.split("-")[0],
                   exclude=("lm_head", "*.experts.*") if excluded else ("lm_head",))
    prompts = _prompts(4, seed=29)
    rounded = algo == "FP8"
    ref = (hf_greedy_experts_rounded if rounded else hf_greedy)(tmp_path / "d", prompts, 10)
    assert ref != hf_greedy(source, prompts, 10)            # the quantization moves them
    llm = LLM(model=str(tmp_path / "q"), num_gpu_blocks=16)
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    assert block.fp8 == rounded and (block.int_experts is not None) == (algo == "NVFP4")
    if excluded:
        assert torch.equal(block.w13[0, :block.intermediate_size],
                           read_tensors(source)["model.layers.0.mlp.experts.0.gate_proj.weight"])
    params = SamplingParams(temperature=0.0, max_tokens=10)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref


def test_modelopt_experts_excluded_in_part_are_refused(tmp_path):
    source = make_tiny_model("qwen3_moe", tmp_path / "source")
    write_modelopt(source, tmp_path / "q", tmp_path / "d", "FP8",
                   exclude=("lm_head", "*.experts.0.gate_proj"))
    with pytest.raises(ValueError, match="exclude_modules must name every expert projection "
                                         "or none"):
        LLM(model=str(tmp_path / "q"), num_gpu_blocks=16)
    for part in ("*.experts.5.*", "*.experts.[1-7].*"):     # quantized expert 0, or not
        write_modelopt(source, tmp_path / "q2", tmp_path / "d2", "FP8", exclude=("lm_head", part))
        with pytest.raises(ValueError, match="exclude_modules names some experts but not all"):
            LLM(model=str(tmp_path / "q2"), num_gpu_blocks=16)
