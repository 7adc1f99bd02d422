"""Which scheme a checkpoint carries, how --quantization meets it, and which layers stay fp16."""

from __future__ import annotations

import json
import logging

import pytest
from kvfleet_runtime.layers.quantization import AWQConfig, FP8Config, GPTQConfig, get_quant_config
from kvfleet_runtime.layers.quantization.awq import AWQLinearMethod
from kvfleet_runtime.layers.quantization.fp8 import FP8LinearMethod
from kvfleet_runtime.layers.quantization.gptq import GPTQLinearMethod

GPTQ_RAW = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
            "sym": False, "checkpoint_format": "gptq"}
AWQ_RAW = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
           "version": "GEMM", "modules_to_not_convert": ["mlp.down_proj"]}


def test_detects_gptq_from_config_json():
    cfg = get_quant_config({"quantization_config": GPTQ_RAW}, None, None)
    assert cfg == GPTQConfig(bits=4, group_size=128, desc_act=True, sym=False)
    assert isinstance(cfg.get_linear_method("model.layers.0.self_attn.qkv_proj"), GPTQLinearMethod)


def test_detects_gptq_from_quantize_config_json(tmp_path):
    # AutoGPTQ's side file, which older checkpoints carry without quant_method
    (tmp_path / "quantize_config.json").write_text(json.dumps(
        {"bits": 8, "group_size": -1, "desc_act": False, "sym": True}))
    cfg = get_quant_config({}, str(tmp_path), "gptq")
    assert cfg == GPTQConfig(bits=8, group_size=-1, desc_act=False, sym=True)


def test_detects_awq_from_autoawq_quant_config_json(tmp_path):
    (tmp_path / "quant_config.json").write_text(json.dumps(
        {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}))
    assert get_quant_config({}, str(tmp_path), None) == AWQConfig(group_size=128)


def test_unquantized_checkpoint_without_request_is_none(tmp_path):
    assert get_quant_config({"model_type": "llama"}, str(tmp_path), None) is None


def test_fp8_request_on_unquantized_checkpoint_quantizes_on_load(tmp_path):
    cfg = get_quant_config({}, str(tmp_path), "fp8")
    assert cfg == FP8Config(serialized=False)
    assert cfg.get_linear_method("model.layers.0.mlp.down_proj").serialized is False


def test_fp8_checkpoint_is_read_as_serialized():
    cfg = get_quant_config({"quantization_config": {"quant_method": "fp8",
                                                    "activation_scheme": "dynamic"}}, None, "fp8")
    method = cfg.get_linear_method("model.layers.0.mlp.gate_up_proj")
    assert isinstance(method, FP8LinearMethod) and method.serialized


def test_mismatch_between_request_and_checkpoint_names_both():
    with pytest.raises(ValueError, match="'gptq' was requested.*quantized with 'awq'"):
        get_quant_config({"quantization_config": AWQ_RAW}, None, "gptq")


def test_int_request_on_unquantized_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="'awq' needs a awq checkpoint"):
        get_quant_config({}, str(tmp_path), "awq")


@pytest.mark.parametrize("raw, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method must be one of gptq, awq, fp8, compressed-tensors, modelopt; got 'bitsandbytes'"),
    ({**GPTQ_RAW, "bits": 3}, "gptq quantization_config.bits must be one of 4, 8; got 3"),
    ({**GPTQ_RAW, "group_size": 0}, "group_size must be -1 or a positive integer"),
    ({**GPTQ_RAW, "desc_act": "yes"}, "desc_act must be true or false; got 'yes'"),
    ({**GPTQ_RAW, "checkpoint_format": "marlin"}, "checkpoint_format must be one of gptq, gptq_v2"),
    ({**AWQ_RAW, "version": "gemv"}, "awq quantization_config.version must be one of gemm; got 'gemv'"),
    ({**AWQ_RAW, "zero_point": False}, "zero_point must be one of True; got False"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme must be one of dynamic"),
    ({"quant_method": "fp8", "weight_block_size": [128]},
     "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "must be two positive integers"),
])
def test_bad_fields_are_named_with_allowed_values(raw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        get_quant_config({"quantization_config": raw}, None, None)


def test_unknown_request_is_rejected():
    with pytest.raises(ValueError, match="quantization must be one of gptq, awq, fp8, "
                                         "compressed-tensors, modelopt; got 'int3'"):
        get_quant_config({}, None, "int3")


@pytest.mark.parametrize("given, taken", [("gptq_marlin", "gptq"), ("awq_marlin", "awq"),
                                          ("compressed_tensors", "compressed-tensors"),
                                          ("modelopt_fp4", "modelopt"), ("none", None),
                                          ("fp8", "fp8")])
def test_vllm_quantization_names_are_taken_as_kvfleets(given, taken):
    # a vLLM command line's --quantization gptq_marlin / awq_marlin works unchanged: kvfleet's
    # own kernels serve those checkpoints
    from kvfleet_runtime.config import EngineConfig
    assert EngineConfig(model="m", quantization=given).quantization == taken
    with pytest.raises(ValueError, match="quantization must be one of gptq, awq, fp8, "
                                         "compressed-tensors, modelopt; got 'marlin'"):
        EngineConfig(model="m", quantization="marlin")


def test_lm_head_and_modules_to_not_convert_stay_unquantized_with_one_log_line(caplog):
    cfg = get_quant_config({"quantization_config": AWQ_RAW}, None, None)
    with caplog.at_level(logging.INFO, logger="kvfleet_runtime.layers.quantization.base"):
        assert cfg.get_linear_method("lm_head") is None
        assert cfg.get_linear_method("model.layers.3.mlp.down_proj") is None
        assert cfg.get_linear_method("model.layers.3.mlp.down_proj") is None
    assert isinstance(cfg.get_linear_method("model.layers.3.mlp.gate_up_proj"), AWQLinearMethod)
    lines = [r.getMessage() for r in caplog.records if "down_proj" in r.getMessage()]
    assert lines == ["awq: model.layers.3.mlp.down_proj stays unquantized "
                     "(modules_to_not_convert), in the model's dtype"]


def test_fused_layer_is_skipped_when_all_its_shards_are_listed():
    cfg = GPTQConfig(modules_to_not_convert=["model.layers.0.self_attn.q_proj",
                                             "model.layers.0.self_attn.k_proj",
                                             "model.layers.0.self_attn.v_proj"])
    assert cfg.get_linear_method("model.layers.0.self_attn.qkv_proj") is None
    # whole dotted components only: layers.0 does not match layers.10
    assert cfg.get_linear_method("model.layers.10.self_attn.qkv_proj") is not None


def test_fused_layer_with_only_some_shards_listed_is_an_error():
    cfg = GPTQConfig(modules_to_not_convert=["model.layers.0.mlp.gate_proj"])
    with pytest.raises(ValueError, match="gate_up_proj; its shards must all be quantized"):
        cfg.get_linear_method("model.layers.0.mlp.gate_up_proj")
