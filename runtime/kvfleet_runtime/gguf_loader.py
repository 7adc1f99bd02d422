"""GGUF checkpoints (llama.cpp's format) read as HF-style config + tensors.

This module owns the translation from GGUF to what the rest of the runtime
expects from an HF folder: a config.json-style dict, tensors under HF names in
HF's layout (dequantized to float32 one at a time from a memory map), and the
tokenizer (with its chat template). Weight-name and layout fixes stay here.

Dequantization goes through `gguf.quants.dequantize`, so every tensor type the
gguf package knows (F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...) loads.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import gguf
    from transformers import PreTrainedTokenizerFast


@dataclass(frozen=True)
class _Arch:
    architecture: str        # HF class name for config["architectures"]
    model_type: str
    # llama.cpp's convert script interleaves the rows of Q and K (its rope pairs
    # adjacent dims, HF's pairs halves) only for arch "llama"; Qwen keeps HF order.
    permuted_qk: bool


ARCHS: dict[str, _Arch] = {
    "llama": _Arch("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

# GGUF tensor name (without "blk.N." and ".weight"/".bias") -> HF module path
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
# llama.cpp stores Llama 3 rope scaling as precomputed per-frequency divisors
_ROPE_FREQS = "rope_freqs.weight"
# Llama 3.x checkpoints all use these; only the factor differs (8 for 3.1, 32 for 3.2)
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart; known tensors are "
                     f"{', '.join(_GLOBAL_NAMES)} and blk.N.{{{', '.join(_LAYER_NAMES)}}}")


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave: per head, rows [d0, dN, d1, dN+1, ...] -> [d0..dN-1, dN..]."""
    # w: [num_heads * head_dim, ...]; llama.cpp wrote head rows as [head_dim/2, 2] of HF's [2, head_dim/2]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors(factor: float, low_freq_factor: float, high_freq_factor: float,
                         original_max_position_embeddings: int, head_dim: int,
                         rope_theta: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs.weight for Llama 3 rope scaling."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    divisors = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < high_wavelen, 1.0, divisors)
    return np.where(wavelen > low_wavelen, factor, divisors)


@dataclass
class GGUFCheckpoint:
    """One GGUF file: `config` read up front, tensors dequantized only when iterated."""

    path: str
    config: dict[str, Any]
    reader: gguf.GGUFReader = field(repr=False)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor in HF layout), one tensor dequantized at a time."""
        from gguf.quants import dequantize

        # model_type is the GGUF arch name for every entry of ARCHS
        permute = ARCHS[self.config["model_type"]].permuted_qk
        for t in self.reader.tensors:
            if t.name == _ROPE_FREQS:       # folded into config["rope_scaling"]
                continue
            name = hf_tensor_name(t.name)
            # t.shape is ggml's (innermost first); numpy/HF order is its reverse
            w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            if permute and ".q_proj." in name:
                w = unpermute_qk(w, self.config["num_attention_heads"])
            elif permute and ".k_proj." in name:
                w = unpermute_qk(w, self.config["num_key_value_heads"])
            # copy: the memory map is read-only, and the caller may keep the tensor
            yield name, torch.from_numpy(np.array(w, dtype=np.float32))

    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer stored in the GGUF, with its chat template."""
        return gguf_tokenizer(self.path)


def gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer stored in the GGUF file at `path` (no tensors or config read)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                         gguf_file=os.path.basename(path))


def _scalar(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _torch_dtype(file_type: int | None) -> str:
    import gguf

    ft = gguf.LlamaFileType
    if file_type == ft.ALL_F32:
        return "float32"
    if file_type == ft.MOSTLY_F16:
        return "float16"
    # BF16 files, and quantized ones: their sources were trained in bf16, whose
    # range fp16 activations may overflow
    return "bfloat16"


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int,
                  rope_theta: float) -> dict[str, Any] | None:
    kind = _scalar(reader, f"{arch}.rope.scaling.type")
    factor = _scalar(reader, f"{arch}.rope.scaling.factor")
    original = _scalar(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(original)}
    if kind not in (None, "none"):
        raise ValueError(f"{arch}.rope.scaling.type must be one of none, linear, yarn; got {kind!r}")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is None:
        return None
    divisors = np.asarray(freqs.data, dtype=np.float64)
    # stored in float32: round so that 8 reads back as 8.0, not 7.9999995
    scaling = {"rope_type": "llama3", "factor": round(float(divisors.max()), 4), **_LLAMA3_ROPE}
    expected = llama3_rope_divisors(**{k: v for k, v in scaling.items() if k != "rope_type"},
                                    head_dim=head_dim, rope_theta=rope_theta)
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-4):
        raise ValueError(f"{_ROPE_FREQS} matches no Llama 3 rope scaling (factor "
                         f"{scaling['factor']}, low_freq_factor 1, high_freq_factor 4, "
                         "original_max_position_embeddings 8192)")
    return scaling


def _config(reader: gguf.GGUFReader) -> dict[str, Any]:
    arch = _scalar(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"general.architecture must be one of {', '.join(ARCHS)}; got {arch!r}")

    def key(name: str, default: Any = None) -> Any:
        value = _scalar(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{name} is missing")
        return value

    names = {t.name for t in reader.tensors}
    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    head_dim = key("attention.key_length", hidden_size // num_heads)
    rope_theta = float(key("rope.freq_base", 10000.0))
    vocab_size = _scalar(reader, f"{arch}.vocab_size")
    if vocab_size is None:      # older files: the embedding's row count
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab_size = int(embd.shape[1])
    return {
        "architectures": [ARCHS[arch].architecture],
        "model_type": ARCHS[arch].model_type,
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, arch, head_dim, rope_theta),
        "max_position_embeddings": key("context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _scalar(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": _torch_dtype(_scalar(reader, "general.file_type")),
    }


def load_gguf(path: str) -> GGUFCheckpoint:
    """Open a GGUF file (memory-mapped) and read its config; tensors load on iteration."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: no GGUF file at {path!r}")
    reader = gguf.GGUFReader(path, "r")
    return GGUFCheckpoint(path=path, config=_config(reader), reader=reader)
