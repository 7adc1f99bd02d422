"""The seeds' promise: a 7B model that needs ~14 GB in fp16 fits in <= 6 GB with 4-bit weights.
Parameters are created on the meta device (shapes and dtypes only), exactly as the loader
creates them before reading the checkpoint."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime.layers.quantization import AWQConfig, GPTQConfig
from kvfleet_runtime.loader import model_size_bytes
from kvfleet_runtime.models import get_model_class
from kvfleet_runtime.models.config import ModelConfig

LLAMA_2_7B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "torch_dtype": "float16"}
GB = 10**9


def llama_2_7b_bytes(quant_config) -> int:
    cfg = ModelConfig.from_hf(LLAMA_2_7B)
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg, torch.float16, quant_config)
    return model_size_bytes(model)


def test_fp16_llama_2_7b_needs_about_14_gb():
    assert 13 * GB < llama_2_7b_bytes(None) < 14 * GB


@pytest.mark.parametrize("quant_config", [GPTQConfig(bits=4, group_size=128, desc_act=True),
                                          AWQConfig(group_size=128)], ids=["gptq", "awq"])
def test_4bit_llama_2_7b_fits_in_6_gb(quant_config):
    size = llama_2_7b_bytes(quant_config)
    # 6.5e9 projection weights at 4 bits = 3.2 GB, fp16 scales of 128-row groups 0.1 GB,
    # embed_tokens and lm_head stay fp16: 0.5 GB
    assert 3.5 * GB < size <= 6 * GB, size / GB
