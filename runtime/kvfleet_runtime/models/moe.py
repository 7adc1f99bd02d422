"""Mixture-of-experts decoders: Mixtral (`MixtralForCausalLM`: every layer sparse, top-2 of 8
renormalized), Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3's attention, top-8 of 128,
norm_topk_prob, decoder_sparse_step / mlp_only_layers for the dense layers) and Qwen2-MoE
(`Qwen2MoeForCausalLM`: Qwen2's attention, a shared expert gated by a sigmoid). The Llama decoder
with layers.moe.SparseMoeBlock as the MLP of its sparse layers; the checkpoint's experts (one
tensor a projection an expert) are stacked into the block's w13 / w2 as they load.

Tensor parallelism splits each expert's intermediate size over the ranks (layers.moe);
`--quantization fp8` quantizes the experts as it does the other projections (e4m3, a scale a
row); a block-scaled FP8 checkpoint's experts (Qwen3-30B-A3B-FP8) are dequantized as they load,
then rounded the same way. Not yet: GPTQ/AWQ or per-channel FP8 experts, LoRA on the experts
(attention and dense layers' adapters apply), expert parallelism."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from kvfleet_runtime.layers.moe import SparseMoeBlock
from kvfleet_runtime.layers.quantization.fp8 import dequantize_blocks
from kvfleet_runtime.models.config import ModelConfig
from kvfleet_runtime.models.llama import LlamaForCausalLM

_EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(\w+)\.gate\.weight")


class _MoeForCausalLM(LlamaForCausalLM):
    block_name = "mlp"                          # the checkpoint's name of a sparse layer's MLP
    expert_pieces: dict[str, str] = {}          # checkpoint projection -> gate / up / down

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant_config=None) -> None:
        fp8 = quant_config is not None and quant_config.name == "fp8"
        # a block-scaled FP8 checkpoint (Qwen3-30B-A3B-FP8): each expert tensor dequantized by
        # its weight_scale_inv as it loads, then rounded a row at a time as on-load FP8 does
        self.expert_block = getattr(quant_config, "block", None) if fp8 else None
        if quant_config is not None and not (
                fp8 and (not quant_config.serialized or self.expert_block is not None)):
            raise ValueError(f"{cfg.architecture} (a mixture of experts) takes no quantized "
                             "checkpoint yet but block-scaled FP8 (GPTQ, AWQ, per-tensor or "
                             "per-channel FP8): serve its bf16/fp16 weights, or quantize them "
                             "to FP8 as they load (--quantization fp8)")
        super().__init__(cfg, dtype, quant_config)

    def _block(self, layer: int, name: str) -> SparseMoeBlock:
        if layer >= len(self.model.layers) or not isinstance(self.model.layers[layer].mlp,
                                                            SparseMoeBlock):
            raise ValueError(f"checkpoint tensor {name!r}: layer {layer} of "
                             f"{self.config.architecture} is not a mixture of experts here")
        return self.model.layers[layer].mlp

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        pieces: dict[int, set[tuple[int, str]]] = {}
        halves: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}    # block-scaled FP8

        def dense():
            for name, tensor in weights:
                expert = _EXPERT.fullmatch(name)
                router = _ROUTER.fullmatch(name)
                if expert and expert[2] == self.block_name:
                    layer, index, proj = int(expert[1]), int(expert[3]), expert[4]
                    block = self._block(layer, name)
                    if proj not in self.expert_pieces or index >= block.w13.shape[0] or (
                            expert[5] == "weight_scale_inv" and self.expert_block is None):
                        raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                         f"{self.config.architecture}")
                    if self.expert_block is not None:
                        got = halves.setdefault((layer, index, proj), {})
                        got[expert[5]] = tensor
                        if len(got) < 2:
                            continue
                        tensor = dequantize_blocks(name, got.pop("weight"),
                                                   got.pop("weight_scale_inv"),
                                                   self.expert_block).to(block.w13.dtype)
                    block.load_expert(index, self.expert_pieces[proj], tensor)
                    pieces.setdefault(layer, set()).add((index, self.expert_pieces[proj]))
                elif router and router[2] == self.block_name:
                    layer = int(router[1])
                    gate = self._block(layer, name).gate.weight
                    if gate.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                         f"model shape {tuple(gate.shape)}")
                    gate.data.copy_(tensor)
                    loaded.add(f"model.layers.{layer}.mlp.gate.weight")
                else:
                    yield name, tensor

        loaded |= super().load_weights(dense())
        for layer, got in pieces.items():   # w13 / w2 count as loaded once every piece is in
            block = self.model.layers[layer].mlp
            experts = range(block.w13.shape[0])
            if got >= {(e, p) for e in experts for p in ("gate", "up")}:
                loaded.add(f"model.layers.{layer}.mlp.w13")
            if got >= {(e, "down") for e in experts}:
                loaded.add(f"model.layers.{layer}.mlp.w2")
        return loaded


class MixtralForCausalLM(_MoeForCausalLM):
    block_name = "block_sparse_moe"
    expert_pieces = {"w1": "gate", "w3": "up", "w2": "down"}


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    expert_pieces = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (qkv bias), and a shared expert beside the
    routed ones (its mlp.shared_expert.* tensors load as a dense MLP's)."""
