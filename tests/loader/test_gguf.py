"""GGUF loading: the real SmolLM2 GGUF against transformers, and hand-made tiny GGUFs."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from kvfleet_runtime.config import default_model
from kvfleet_runtime.gguf_loader import load_gguf


@pytest.fixture(scope="module")
def smollm2():
    return load_gguf(default_model())


@pytest.fixture(scope="module")
def hf_state_dict() -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    path = default_model()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.state_dict()


def test_every_tensor_equals_transformers_dequantization(smollm2, hf_state_dict):
    ours = dict(smollm2.tensors())
    # a tied checkpoint has no lm_head tensor; HF's state_dict shows the embedding under both names
    assert smollm2.config["tie_word_embeddings"]
    assert set(ours) == set(hf_state_dict) - {"lm_head.weight"}
    assert len(ours) == 2 + 9 * 30
    for name, tensor in ours.items():
        ref = hf_state_dict[name]
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref.shape, name
        torch.testing.assert_close(tensor, ref, rtol=0, atol=1e-6, msg=name)
    assert sum(t.numel() for t in ours.values()) == 134_515_008


def test_config_matches_transformers_autoconfig(smollm2):
    from transformers import AutoConfig

    path = default_model()
    ref = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = smollm2.config
    assert ours["architectures"] == ["LlamaForCausalLM"]
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert ours["rope_scaling"] is None and ref.rope_parameters["rope_type"] == "default"
    assert (ours["vocab_size"], ours["num_hidden_layers"]) == (49152, 30)


def test_chat_template_renders_a_user_message(smollm2):
    tok = smollm2.load_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert len(tok) == 49152
    assert tok.convert_tokens_to_ids("<|im_end|>") == smollm2.config["eos_token_id"]


# --- hand-made tiny GGUFs -----------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 128, 2, 256
# 2-D weights cycle through these so every quantized type is exercised
WEIGHT_TYPES = (Q.Q8_0, Q.F16, Q.Q4_0, Q.Q4_1)


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama Q/K rows."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _hf_tensors(arch: str, tied: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def randn(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    out = {"model.embed_tokens.weight": randn(VOCAB, HIDDEN), "model.norm.weight": randn(HIDDEN)}
    if not tied:
        out["lm_head.weight"] = randn(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": randn(HIDDEN),
                p + "post_attention_layernorm.weight": randn(HIDDEN),
                p + "self_attn.q_proj.weight": randn(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": randn(HIDDEN, HEADS * HEAD_DIM),
                p + "mlp.gate_proj.weight": randn(FFN, HIDDEN),
                p + "mlp.up_proj.weight": randn(FFN, HIDDEN),
                p + "mlp.down_proj.weight": randn(HIDDEN, FFN)}
        if arch == "qwen2":
            out |= {p + f"self_attn.{x}_proj.bias": randn(n * HEAD_DIM)
                    for x, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
        if arch == "qwen3":
            out |= {p + "self_attn.q_norm.weight": randn(HEAD_DIM),
                    p + "self_attn.k_norm.weight": randn(HEAD_DIM)}
    return out


_GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    # written independently of the loader's table, from the GGUF spec's names
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_GGUF_PARTS[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_tiny_gguf(path: Path, arch: str, tied: bool, rope_freqs: np.ndarray | None = None
                    ) -> dict[str, np.ndarray]:
    """Write a tiny `arch` GGUF the way llama.cpp would; return the HF tensors it must load as."""
    hf = _hf_tensors(arch, tied, np.random.default_rng(0))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    expected = {}
    for i, (name, t) in enumerate(hf.items()):
        qtype = WEIGHT_TYPES[i % len(WEIGHT_TYPES)] if t.ndim == 2 else Q.F32
        stored = t
        if arch == "llama" and ".q_proj." in name:
            stored = _llama_cpp_permute(t, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            stored = _llama_cpp_permute(t, KV_HEADS)
        w.add_tensor(_gguf_name(name), quantize(stored, qtype), raw_dtype=qtype)
        # blocks run along rows, so quantizing commutes with the row permutation
        expected[name] = dequantize(quantize(t, qtype), qtype).reshape(t.shape)
        assert np.abs(expected[name] - t).max() < 0.25 * np.abs(t).max(), name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_tiny_gguf_round_trips(tmp_path, arch, tied):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", arch, tied)
    ckpt = load_gguf(str(tmp_path / "tiny.gguf"))
    got = dict(ckpt.tensors())
    assert list(got) == list(expected)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)
    c = ckpt.config
    assert c["model_type"] == arch
    assert c["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (c["vocab_size"], c["max_position_embeddings"]) == (VOCAB, 2048)
    assert c["tie_word_embeddings"] is tied
    assert c["attention_bias"] is (arch == "qwen2")
    assert c["rms_norm_eps"] == pytest.approx(1e-6)
    assert (c["rope_theta"], c["rope_scaling"]) == (500000.0, None)
    assert (c["bos_token_id"], c["eos_token_id"], c["torch_dtype"]) == (1, 2, "bfloat16")


def test_rope_freqs_tensor_becomes_llama3_rope_scaling(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                      rope_parameters={"rope_theta": 500000.0, **scaling})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    # llama.cpp stores the divisor of each frequency
    divisors = (base / scaled.double()).numpy()
    assert divisors.min() == pytest.approx(1.0) and divisors.max() == pytest.approx(8.0)
    write_tiny_gguf(tmp_path / "l3.gguf", "llama", tied=True, rope_freqs=divisors)
    ckpt = load_gguf(str(tmp_path / "l3.gguf"))
    assert ckpt.config["rope_scaling"] == scaling
    assert "rope_freqs.weight" not in {name for name, _ in ckpt.tensors()}


def test_unsupported_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture must be one of llama, qwen2, qwen3; got 'gpt2'"):
        load_gguf(str(tmp_path / "gpt2.gguf"))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        load_gguf(str(tmp_path / "absent.gguf"))
