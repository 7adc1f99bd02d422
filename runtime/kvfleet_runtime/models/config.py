"""ModelConfig: the architecture facts our model code needs, read from an HF config dict."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    checkpoint_dtype: torch.dtype | None
    hf_config: dict
    # False for a checkpoint without lm_head (an embedding model saved from its base model):
    # it serves embeddings only (loader.py)
    generates: bool = True
    # a sequence classifier's labels (XForSequenceClassification: a `score` head over the last
    # position's hidden state, no lm_head; it classifies and scores, never generates); 0: none
    num_labels: int = 0
    # sliding-window attention (Mistral 7B v0.1, Phi-3-mini-4k): the attention kernels attend to
    # every earlier token, which equals the window only up to its length, so contexts stop
    # there (context_limit)
    sliding_window: int | None = None

    def context_limit(self) -> tuple[int, str]:
        """The longest context this model runs here, and what sets it (for the error of a
        larger max_model_len)."""
        window = self.sliding_window
        if window is not None and window < self.max_position_embeddings:
            return window, (f"sliding window ({window} tokens; attention over a window is not "
                            "supported: contexts stop at its length, where it equals full "
                            "attention)")
        return self.max_position_embeddings, "max_position_embeddings"

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                                       "mistral": "MistralForCausalLM"}.get(hf.get("model_type"), "")
        num_labels = 0
        if arch.endswith("ForSequenceClassification"):
            # the decoder of XForCausalLM; with classifier_from_token (vLLM's cross-encoder
            # from a causal LM: Qwen3-Reranker's recipe) its lm_head's logits of those tokens
            # score (pooling.py), else the checkpoint's own `score` head of num_labels rows
            arch = arch.removesuffix("ForSequenceClassification") + "ForCausalLM"
            if "classifier_from_token" not in hf:
                num_labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
        heads = hf["num_attention_heads"]
        # transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                             else None)
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (rotary over the "
                             "whole head only)")
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            checkpoint_dtype=_DTYPES.get(hf.get("dtype") or hf.get("torch_dtype") or ""),
            hf_config=hf,
            generates=not num_labels,
            num_labels=num_labels,
            sliding_window=hf.get("sliding_window") or None,
        )
