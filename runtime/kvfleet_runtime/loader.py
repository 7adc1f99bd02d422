"""Loads a model and its tokenizer: HF folders (config.json, safetensors shards, tokenizer) and GGUF files.

Weights stream tensor by tensor from the checkpoint into the model built on the
target device; nothing is materialised twice.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.layers.linear import Linear
from kvfleet_runtime.layers.quantization import get_quant_config
from kvfleet_runtime.layers.quantization.base import log_once
from kvfleet_runtime.models import get_model_class
from kvfleet_runtime.models.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: object          # transformers PreTrainedTokenizerFast
    dtype: torch.dtype
    name: str                  # default served name


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {path} holds no *.safetensors file")
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _drop_zero_biases(tensors: Iterator[tuple[str, torch.Tensor]],
                      cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Some AutoGPTQ checkpoints store all-zero biases for bias-free projections: skip them."""
    for name, tensor in tensors:
        if name.endswith("_proj.bias") and not (cfg.attention_bias and ".self_attn." in name
                                                 and ".o_proj." not in name):
            if not torch.any(tensor):
                continue
        yield name, tensor


# Calibrated KV-cache scales of FP8 checkpoints (compressed-tensors' kv_cache_scheme, vLLM-style
# fp8 ones; an older compressed-tensors stored them as k_proj / v_proj output scales, NVIDIA
# ModelOpt as k_proj.k_scale / v_proj.v_scale, AutoFP8 one `kv_scale` for both), by the suffix
# that follows a layer's `self_attn`: an fp8 KV cache (--kv-cache-dtype fp8) holds K / k_scale
# and V / v_scale (the model runner binds them)
_KV_SCALES = {"k_scale": "k", "attn.k_scale": "k", "k_proj.output_scale": "k",
              "k_proj.k_scale": "k", "v_scale": "v", "attn.v_scale": "v",
              "v_proj.output_scale": "v", "v_proj.v_scale": "v", "kv_scale": "kv",
              "attn.kv_scale": "kv"}
# scales for FP8 attention math (queries, probabilities), which kvfleet's attention does not use
_ATTENTION_SCALES = ("q_scale", "attn.q_scale", "prob_scale", "attn.prob_scale")


class KVScales:
    """Takes the calibrated KV-cache scales out of a checkpoint's tensors, then hands them to
    the attention layers (`Attention.checkpoint_kv_scales`)."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, float]] = {}    # `...self_attn` -> {"k": .., "v": ..}
        self.names: dict[str, str] = {}                 # `...self_attn` -> a tensor's name

    def take(self, tensors: Iterator[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            attn, sep, suffix = name.rpartition(".self_attn.")
            if sep and suffix in _ATTENTION_SCALES:
                log_once("the checkpoint's FP8 attention scales (self_attn.q_scale / prob_scale) "
                         "are not used: kvfleet's attention runs in the compute dtype")
                continue
            if not sep or suffix not in _KV_SCALES:
                yield name, tensor
                continue
            value = tensor.float()
            if value.numel() == 0 or not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
                raise ValueError(f"checkpoint tensor {name!r} is a KV-cache scale, which must be "
                                 f"finite and > 0; got {value.flatten()[:8].tolist()}")
            if value.numel() > 1:
                # per-head scales: the largest serves every head of the layer (its quotients
                # stay within e4m3's range; the other heads' lose a little precision)
                log_once("the checkpoint's KV-cache scales are per head; each layer's fp8 cache "
                         "takes its largest")
            key = attn + ".self_attn"
            for kind in ("k", "v") if _KV_SCALES[suffix] == "kv" else (_KV_SCALES[suffix],):
                self.found.setdefault(key, {})[kind] = float(value.max())
            self.names[key] = name

    def bind(self, model: torch.nn.Module) -> None:
        """Each layer's (k_scale, v_scale) onto its Attention (1.0 where only one is given)."""
        if not self.found:
            return
        from kvfleet_runtime.layers.attention import Attention
        layers = {name.removesuffix(".attn"): m for name, m in model.named_modules()
                  if isinstance(m, Attention)}
        for key, scales in self.found.items():
            if key not in layers:
                raise ValueError(f"checkpoint tensor {self.names[key]!r} has no place in "
                                 f"{type(model).__name__}: no attention layer {key}")
            layers[key].checkpoint_kv_scales = (scales.get("k", 1.0), scales.get("v", 1.0))


def _base_model_names(tensors: Iterator[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint saved from the base model (embedding models: Qwen3-Embedding's tensors are
    `layers.0...`, `embed_tokens.weight`, `norm.weight`) named as the causal LM's (`model.`)."""
    for name, tensor in tensors:
        if name.split(".", 1)[0] in ("layers", "embed_tokens", "norm"):
            name = "model." + name
        yield name, tensor


def _eos_ids(path: Path | None, cfg: ModelConfig, tokenizer) -> list[int]:
    ids = list(cfg.eos_token_ids)
    gen = path / "generation_config.json" if path else None
    if gen is not None and gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def _resolve(config: EngineConfig):
    """(hf config dict, tensor iterator factory, tokenizer, folder or None, name)."""
    src = Path(config.model)
    if not src.exists():
        raise ValueError(f"model {config.model!r} is neither a folder nor a .gguf file (models "
                         "elsewhere: a Hub id ORG/NAME, hf://ORG/NAME[@REVISION] or "
                         "s3://BUCKET/PREFIX)")
    if src.is_file():
        if src.suffix != ".gguf":
            raise ValueError(f"model file {src} must be a .gguf file (or give an HF folder)")
        from kvfleet_runtime.gguf_loader import load_gguf
        ckpt = load_gguf(str(src))
        name = src.name.split(".")[0] if ".Q" in src.name else src.stem
        tokenizer = ckpt.load_tokenizer() if config.tokenizer is None else _hf_tokenizer(config)
        return ckpt.config, ckpt.tensors, tokenizer, None, name
    cfg_file = src / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model folder {src} has no config.json")
    hf = json.loads(cfg_file.read_text())
    files = _safetensors_files(src) if config.load_format != "dummy" else []
    tokenizer = _hf_tokenizer(config, str(src))
    return hf, (lambda: _iter_safetensors(files)), tokenizer, src, src.name


def _hf_tokenizer(config: EngineConfig, folder: str | None = None):
    """config.tokenizer's (a Hub id's at config.tokenizer_revision), else the model folder's;
    with config.trust_remote_code, as vLLM, the tokenizer may run code of its repo."""
    from transformers import AutoTokenizer
    path = config.tokenizer or folder
    revision = config.tokenizer_revision if config.tokenizer is not None else None
    try:
        return AutoTokenizer.from_pretrained(path, revision=revision,
                                             trust_remote_code=config.trust_remote_code)
    except Exception as e:   # noqa: BLE001 - transformers raises many kinds here
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e


def merged(base: dict, overrides: dict) -> dict:
    """base with overrides' keys, nested objects merged key by key (vLLM's hf_overrides)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = merged(out[key], value)
        out[key] = value
    return out


def load_model(config: EngineConfig) -> LoadedModel:
    hf, tensors, tokenizer, folder, name = _resolve(config)
    if config.hf_overrides:
        hf = merged(hf, config.hf_overrides)
    cfg = ModelConfig.from_hf(hf)
    cfg.rope_context = config.max_model_len or cfg.max_position_embeddings
    cls = get_model_class(cfg)
    dtype = config.resolve_dtype(cfg.checkpoint_dtype)
    quant_config = get_quant_config(hf, str(folder) if folder else None, config.quantization)
    with torch.device(config.torch_device):
        model = cls(cfg, dtype, quant_config)
    if config.load_format == "dummy":
        _init_dummy(model, act_order=getattr(quant_config, "desc_act", False))
    else:
        head = getattr(model, "lm_head", None)
        if not cfg.tie_word_embeddings and isinstance(getattr(head, "weight", None), torch.Tensor):
            head.weight.data.zero_()        # defined if the checkpoint has none (below)
        kv_scales = KVScales()
        loaded = model.load_weights(
            kv_scales.take(_base_model_names(_drop_zero_biases(tensors(), cfg))))
        kv_scales.bind(model)
        # some tensors are optional (GPTQ's g_idx: plain grouping when absent; a static FP8
        # input_scale kvfleet does not use)
        expected = {n for n, p in model.named_parameters() if not getattr(p, "optional", False)}
        missing = sorted(expected - loaded)
        if missing == ["lm_head.weight"] and cfg.num_labels:
            pass                # a sequence classifier: its `score` head, no lm_head
        elif missing == ["lm_head.weight"]:
            cfg.generates = False
            log.warning("checkpoint %s has no lm_head.weight (an embedding model's): it serves "
                        "embeddings only", config.model)
        elif missing:
            raise ValueError(f"checkpoint {config.model} lacks {len(missing)} tensors, e.g. "
                             f"{', '.join(missing[:3])}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.linear_method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):    # layers.moe's experts
            module.process_weights_after_loading()
    # act-order layers take their input already in their order from the module before them
    # (models/llama.py); not with LoRA adapters, which read those inputs in the model's order
    if not config.enable_lora and os.environ.get("KVFLEET_ORDER_INPUTS", "1") != "0":
        for module in model.modules():
            if hasattr(module, "order_inputs"):
                module.order_inputs()
    cfg.eos_token_ids = _eos_ids(folder, cfg, tokenizer)
    model.eval()
    return LoadedModel(model=model, config=cfg, tokenizer=tokenizer, dtype=dtype, name=name)


def _init_dummy(model: torch.nn.Module, act_order: bool = False) -> None:
    """Random weights of the right shapes (benchmarks of real-sized models without a checkpoint).
    Integer tensors keep what their layer made them (packed weights: uninitialized memory; g_idx:
    the plain grouping), except that with `act_order` (GPTQ desc_act) each g_idx row is shuffled,
    as an act-order checkpoint's is, so that the layers take their act-order paths."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, p in model.named_parameters():
        if act_order and name.endswith("g_idx"):
            order = torch.rand(p.shape, generator=gen).argsort(dim=-1).to(p.device)
            p.data.copy_(p.data.gather(-1, order))
            continue
        if not p.is_floating_point():
            continue
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype)
                         if p.numel() < 1 << 24 else
                         torch.empty_like(p).normal_(0, 0.02))


def model_size_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = ["LoadedModel", "load_model", "model_size_bytes"]
