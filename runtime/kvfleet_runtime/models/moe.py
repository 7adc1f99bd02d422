"""Mixture-of-experts decoders: Mixtral (`MixtralForCausalLM`: every layer sparse, top-2 of 8
renormalized), Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3's attention, top-8 of 128,
norm_topk_prob, decoder_sparse_step / mlp_only_layers for the dense layers) and Qwen2-MoE
(`Qwen2MoeForCausalLM`: Qwen2's attention, a shared expert gated by a sigmoid). The Llama decoder
with layers.moe.SparseMoeBlock as the MLP of its sparse layers; the checkpoint's experts (one
tensor a projection an expert) are stacked into the block's w13 / w2 as they load.

Tensor parallelism splits each expert's intermediate size over the ranks (layers.moe);
`--quantization fp8` quantizes the experts as it does the other projections (e4m3, a scale a
row); a block-scaled FP8 checkpoint's experts (Qwen3-30B-A3B-FP8) are dequantized as they load,
then rounded the same way. GPTQ and AWQ checkpoints' experts (Qwen3-30B-A3B-GPTQ-Int4,
Mixtral AWQ) stay packed integers (layers.moe: IntExperts), each projection unpacked and
repacked as it loads; GPTQ's act-order experts (desc_act) are dequantized as they load. Not yet:
per-channel FP8 experts, LoRA on the experts (attention and dense layers' adapters apply),
expert parallelism."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from kvfleet_runtime.layers.moe import SparseMoeBlock
from kvfleet_runtime.layers.quantization.base import log_once
from kvfleet_runtime.layers.quantization.fp8 import dequantize_blocks
from kvfleet_runtime.models.config import ModelConfig
from kvfleet_runtime.models.llama import LlamaForCausalLM

_EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\."
                     r"(weight|weight_scale_inv|qweight|qzeros|scales|g_idx)")
_INT_PIECES = {"qweight", "qzeros", "scales"}     # a GPTQ / AWQ projection (+ GPTQ's g_idx)
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(\w+)\.gate\.weight")


class _MoeForCausalLM(LlamaForCausalLM):
    block_name = "mlp"                          # the checkpoint's name of a sparse layer's MLP
    expert_pieces: dict[str, str] = {}          # checkpoint projection -> gate / up / down

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant_config=None) -> None:
        fp8 = quant_config is not None and quant_config.name == "fp8"
        # a block-scaled FP8 checkpoint (Qwen3-30B-A3B-FP8): each expert tensor dequantized by
        # its weight_scale_inv as it loads, then rounded a row at a time as on-load FP8 does
        self.expert_block = getattr(quant_config, "block", None) if fp8 else None
        # GPTQ / AWQ: the experts' integers kept packed (layers.moe.SparseMoeBlock.int_weights)
        self.expert_int = (quant_config.name if quant_config is not None
                           and quant_config.name in ("gptq", "awq") else None)
        # GPTQ with act-order (desc_act): each expert's rows shuffled its own way, which the
        # kernels do not gather: those experts are dequantized as they load instead
        self.expert_act_order = self.expert_int == "gptq" and quant_config.desc_act
        if self.expert_act_order:
            log_once("gptq: act-order (desc_act) experts are dequantized on load to the "
                     "model's dtype")
        if getattr(quant_config, "name", None) == "compressed-tensors":
            raise ValueError(f"{cfg.architecture} (a mixture of experts): compressed-tensors "
                             "experts are not read yet (dense models' are); serve its GPTQ, AWQ "
                             "or block-scaled FP8 checkpoint, or its bf16 weights (with "
                             "--quantization fp8 to quantize them as they load)")
        if quant_config is not None and self.expert_int is None and not (
                fp8 and (not quant_config.serialized or self.expert_block is not None)):
            raise ValueError(f"{cfg.architecture} (a mixture of experts) takes no per-tensor "
                             "or per-channel FP8 checkpoint yet (GPTQ, AWQ and block-scaled "
                             "FP8 ones load): serve its bf16/fp16 weights, or quantize them "
                             "to FP8 as they load (--quantization fp8)")
        self.quant_config = quant_config
        super().__init__(cfg, dtype, quant_config)

    def _unpack(self, got: dict[str, torch.Tensor]):
        """A GPTQ / AWQ expert projection's tensors -> IntWeight (g_idx: act-order's)."""
        q = self.quant_config
        if self.expert_int == "awq":
            from kvfleet_runtime.layers.quantization.awq import unpack_awq
            return unpack_awq(got["qweight"], got["qzeros"], got["scales"], q.group_size)
        from kvfleet_runtime.layers.quantization.gptq import unpack_gptq
        from kvfleet_runtime.layers.quantization.int_weight import default_g_idx
        rows = got["qweight"].shape[0] * 32 // q.bits
        g_idx = got["g_idx"] if "g_idx" in got else default_g_idx(rows, q.group_size)
        return unpack_gptq(got["qweight"], got["qzeros"], got["scales"], g_idx, q.bits,
                           q.checkpoint_format)

    def _check_g_idx(self, name: str, g_idx: torch.Tensor) -> None:
        from kvfleet_runtime.layers.quantization.int_weight import default_g_idx
        if not torch.equal(g_idx.to(torch.int32).cpu(),
                           default_g_idx(g_idx.numel(), self.quant_config.group_size)):
            raise ValueError(f"checkpoint tensor {name!r}: a shuffled g_idx (GPTQ act-order) "
                             "needs desc_act true in the quantization_config")

    def _block(self, layer: int, name: str) -> SparseMoeBlock:
        if layer >= len(self.model.layers) or not isinstance(self.model.layers[layer].mlp,
                                                            SparseMoeBlock):
            raise ValueError(f"checkpoint tensor {name!r}: layer {layer} of "
                             f"{self.config.architecture} is not a mixture of experts here")
        return self.model.layers[layer].mlp

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        pieces: dict[int, set[tuple[int, str]]] = {}
        halves: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}    # an expert projection's pieces until complete (FP8 blocks, GPTQ / AWQ)

        def dense():
            for name, tensor in weights:
                expert = _EXPERT.fullmatch(name)
                router = _ROUTER.fullmatch(name)
                if expert and expert[2] == self.block_name:
                    layer, index, proj = int(expert[1]), int(expert[3]), expert[4]
                    block = self._block(layer, name)
                    kind = expert[5]
                    integer = kind in _INT_PIECES or kind == "g_idx"
                    if proj not in self.expert_pieces or index >= block.num_experts or (
                            kind == "weight_scale_inv" and self.expert_block is None) or (
                            integer != (self.expert_int is not None)):
                        raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                         f"{self.config.architecture}" + (
                                             f" with {self.expert_int} experts"
                                             if self.expert_int else ""))
                    if kind == "g_idx" and not self.expert_act_order:
                        self._check_g_idx(name, tensor)
                        continue
                    if integer:         # (act-order: its g_idx too, then dequantized)
                        got = halves.setdefault((layer, index, proj), {})
                        got[kind] = tensor
                        if len(got) < len(_INT_PIECES) + self.expert_act_order:
                            continue
                        del halves[(layer, index, proj)]
                        w, piece = self._unpack(got), self.expert_pieces[proj]
                        if self.expert_act_order:
                            block.load_expert(index, piece, w.dequantize().to(block.w13.dtype))
                        else:
                            block.load_int_expert(index, piece, w)
                        pieces.setdefault(layer, set()).add((index, piece))
                        continue
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
            experts = range(block.num_experts)
            suffixes = ("",) if block.int_weights is None else ("_qweight", "_scales", "_zeros")
            for name, wanted in (("w13", {(e, p) for e in experts for p in ("gate", "up")}),
                                 ("w2", {(e, "down") for e in experts})):
                if got >= wanted:
                    loaded |= {f"model.layers.{layer}.mlp.{name}{s}" for s in suffixes}
        return loaded


class MixtralForCausalLM(_MoeForCausalLM):
    block_name = "block_sparse_moe"
    expert_pieces = {"w1": "gate", "w3": "up", "w2": "down"}


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    expert_pieces = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (qkv bias), and a shared expert beside the
    routed ones (its mlp.shared_expert.* tensors load as a dense MLP's)."""
