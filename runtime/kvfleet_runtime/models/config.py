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
    # sliding-window attention, a window a layer (0: full attention): Mistral 7B v0.1 and
    # Phi-3-mini-4k window every layer; Qwen2/Qwen3 with use_sliding_window those that their
    # layer_types name "sliding_attention" (by default the layers from max_window_layers on).
    # A window as long as the positions is full attention: 0. (layer_windows)
    sliding_windows: tuple[int, ...] = ()
    # the dims of a head that rotary rotates (head_dim unless partial_rotary_factor < 1); 0:
    # head_dim
    rotary_dim: int = 0
    # the longest context the engine serves (its max_model_len, set at load): longrope picks
    # its long or short factors by it (layers.rotary._longrope); 0: max_position_embeddings
    rope_context: int = 0
    # a sparse mixture of experts (Mixtral, Qwen3-MoE; 0 experts: dense): each MoE layer's
    # router picks num_experts_per_tok of num_experts MLPs of moe_intermediate_size, their
    # weights renormalized to sum 1 (moe_renormalize) or not; moe_layers: which layers are
    # sparse (the others dense MLPs of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    moe_layers: tuple[int, ...] = ()
    # Qwen2-MoE: a shared expert of this size beside the routed ones in every sparse layer,
    # its output weighted by sigmoid(shared_expert_gate(x)); 0: none
    shared_expert_intermediate_size: int = 0

    def layer_window(self, layer: int) -> int:
        """The sliding window of decoder layer `layer`, 0 for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                                       "mistral": "MistralForCausalLM",
                                       "mixtral": "MixtralForCausalLM",
                                       "qwen3_moe": "Qwen3MoeForCausalLM",
                                       "qwen2_moe": "Qwen2MoeForCausalLM",
                                       }.get(hf.get("model_type"), "")
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
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind in ("llama3", "yarn", "longrope"):
            # as HF: the pretraining length beside the config's rope parameters (Phi-3's
            # checkpoints keep it there) wins; absent everywhere, max_position_embeddings
            original = (hf.get("original_max_position_embeddings")
                        or scaling.get("original_max_position_embeddings")
                        or hf.get("max_position_embeddings", 4096))
            scaling = {**scaling, "original_max_position_embeddings": original}
        # partial rotary (Phi-4-mini: 0.75): the first rotary_dim dims of each head rotate
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
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
            head_dim=(head_dim := hf.get("head_dim") or hf["hidden_size"] // heads),
            rotary_dim=int(head_dim * partial),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=(bool(hf.get("attention_bias", False)) or arch == "Qwen2ForCausalLM"
                            or (arch == "Qwen2MoeForCausalLM" and hf.get("qkv_bias", True))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            checkpoint_dtype=_DTYPES.get(hf.get("dtype") or hf.get("torch_dtype") or ""),
            hf_config=hf,
            generates=not num_labels,
            num_labels=num_labels,
            sliding_windows=layer_windows(hf, arch),
            **_moe_fields(hf, arch),
        )


def _moe_fields(hf: dict, arch: str) -> dict:
    """ModelConfig's mixture-of-experts fields as HF's Mixtral and Qwen3-MoE read them."""
    layers = hf["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(num_experts=hf.get("num_local_experts", 8),
                    num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                    moe_intermediate_size=hf["intermediate_size"], moe_renormalize=True,
                    moe_layers=tuple(range(layers)))
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        # (Qwen's checkpoints write num_experts; transformers 5 saves num_local_experts)
        qwen2 = arch == "Qwen2MoeForCausalLM"
        experts = hf.get("num_experts") or hf.get("num_local_experts") or (60 if qwen2 else 128)
        step = hf.get("decoder_sparse_step", 1)
        dense = set(hf.get("mlp_only_layers") or ())
        return dict(num_experts=experts,
                    num_experts_per_tok=hf.get("num_experts_per_tok", 4 if qwen2 else 8),
                    moe_intermediate_size=hf.get("moe_intermediate_size", 1408 if qwen2 else 768),
                    shared_expert_intermediate_size=(
                        hf.get("shared_expert_intermediate_size", 5632) if qwen2 else 0),
                    moe_renormalize=bool(hf.get("norm_topk_prob", False)),
                    moe_layers=tuple(i for i in range(layers)
                                     if experts > 0 and i not in dense and (i + 1) % step == 0))
    return {}


def layer_windows(hf: dict, arch: str) -> tuple[int, ...]:
    """Each layer's sliding window as HF's model code applies it (0: full attention); () when
    no layer has one."""
    window = hf.get("sliding_window") or 0
    layers = hf["num_hidden_layers"]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        # the window only under use_sliding_window; then the layers layer_types names, by
        # default those from max_window_layers on
        if not hf.get("use_sliding_window"):
            return ()
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)]
    elif arch == "Qwen3MoeForCausalLM":     # every layer, under use_sliding_window
        if not hf.get("use_sliding_window"):
            return ()
        types = ["sliding_attention"] * layers
    elif arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        types = ["sliding_attention"] * layers
    else:       # HF's Llama has no window
        return ()
    if not window or window >= hf.get("max_position_embeddings", 4096):
        return ()
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()
