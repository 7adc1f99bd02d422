"""Mixture-of-experts decoders: Mixtral (`MixtralForCausalLM`: every layer sparse, top-2 of 8
renormalized), Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3's attention, top-8 of 128,
norm_topk_prob, decoder_sparse_step / mlp_only_layers for the dense layers) and Qwen2-MoE
(`Qwen2MoeForCausalLM`: Qwen2's attention, a shared expert gated by a sigmoid). The Llama decoder
with layers.moe.SparseMoeBlock as the MLP of its sparse layers; the checkpoint's experts (one
tensor a projection an expert) are stacked into the block's w13 / w2 as they load.

Tensor parallelism splits each expert's intermediate size over the ranks (layers.moe);
`--quantization fp8` quantizes the experts as it does the other projections (e4m3, a scale a
row); FP8 checkpoints' experts (block-scaled: Qwen3-30B-A3B-FP8; per channel or per tensor;
compressed-tensors and ModelOpt FP8) are dequantized as they load, then rounded the same way.
GPTQ, AWQ and compressed-tensors integer checkpoints' experts (Qwen3-30B-A3B-GPTQ-Int4, Mixtral
AWQ, W4A16) and FP4 ones (compressed-tensors and ModelOpt NVFP4, as 8-bit integers) stay packed
integers (layers.moe: IntExperts), each projection unpacked and repacked as it loads; act-order
experts (GPTQ desc_act, compressed-tensors actorder group) too, each expert's inputs sorted by
group (the kernels gather gate / up's inputs through their permutation; gate / up's rows are put
in down's sorted order, so under tensor parallelism each rank's slice of down's inputs holds
whole groups). `ExpertReader` says which tensors make one expert projection in each format. Not yet: LoRA on the experts (attention and dense
layers' adapters apply), expert parallelism."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvfleet_runtime.layers.moe import SparseMoeBlock
from kvfleet_runtime.layers.quantization.base import log_once
from kvfleet_runtime.layers.quantization.fp8 import dequantize_fp8
from kvfleet_runtime.models.config import ModelConfig
from kvfleet_runtime.models.llama import LlamaForCausalLM

_EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.(\w+)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(\w+)\.gate\.weight")


@dataclass
class ExpertReader:
    """How one expert projection's checkpoint tensors (by kind: `weight`, `qweight`, ...)
    become what SparseMoeBlock loads: a dense weight [N, K] (load_expert; FP8 experts are
    rounded a row at a time once loaded) or an IntWeight (load_int_expert, kept packed)."""
    name: str                           # the format, for errors
    required: frozenset[str]            # the kinds that make one projection
    build: Callable[[str, dict[str, torch.Tensor]], object]     # (name, tensors) -> weight
    packed: bool = False                # build gives an IntWeight
    # kinds read past: each checked (or merely logged) as it arrives
    extra: dict[str, Callable[[str, torch.Tensor], None]] = field(default_factory=dict)


def _gptq_reader(q, act_order: bool) -> ExpertReader:
    from kvfleet_runtime.layers.quantization.gptq import unpack_gptq
    from kvfleet_runtime.layers.quantization.int_weight import default_g_idx

    def build(name: str, got: dict[str, torch.Tensor]):
        rows = got["qweight"].shape[0] * 32 // q.bits
        g_idx = got["g_idx"] if act_order else default_g_idx(rows, q.group_size)
        return unpack_gptq(got["qweight"], got["qzeros"], got["scales"], g_idx, q.bits,
                           q.checkpoint_format)

    def plain_g_idx(name: str, g_idx: torch.Tensor) -> None:
        if not torch.equal(g_idx.to(torch.int32).cpu(), default_g_idx(g_idx.numel(),
                                                                      q.group_size)):
            raise ValueError(f"checkpoint tensor {name!r}: a shuffled g_idx (GPTQ act-order) "
                             "needs desc_act true in the quantization_config")
    kinds = {"qweight", "qzeros", "scales"} | ({"g_idx"} if act_order else set())
    return ExpertReader("gptq", frozenset(kinds), build, packed=True,
                        extra={} if act_order else {"g_idx": plain_g_idx})


def _awq_reader(q) -> ExpertReader:
    from kvfleet_runtime.layers.quantization.awq import unpack_awq
    return ExpertReader("awq", frozenset({"qweight", "qzeros", "scales"}),
                        lambda name, got: unpack_awq(got["qweight"], got["qzeros"], got["scales"],
                                                     q.group_size), packed=True)


def _fp8_reader(q) -> ExpertReader:
    # a scale a block (Qwen3-30B-A3B-FP8: weight_scale_inv), else a row or a tensor
    scale = "weight_scale_inv" if q.block is not None else "weight_scale"
    return ExpertReader("fp8", frozenset({"weight", scale}),
                        lambda name, got: dequantize_fp8(name, got["weight"], got[scale], q.block))


def _modelopt_reader(q) -> ExpertReader:
    from kvfleet_runtime.layers.quantization.compressed_tensors import unpack_fp4
    from kvfleet_runtime.layers.quantization.modelopt import NVFP4_GROUP

    def read_past(name: str, tensor: torch.Tensor) -> None:
        log_once("modelopt: the experts' static activation scales (input_scale) are not used: "
                 "FP8 experts read their activations unquantized (W8A16), NVFP4 ones too")
    if q.algo == "nvfp4":
        # NVFP4 experts as 8-bit integers (unpack_fp4: weight_scale * weight_scale_2 a group),
        # kept packed
        return ExpertReader("modelopt NVFP4", frozenset({"weight", "weight_scale",
                                                         "weight_scale_2"}),
                            lambda name, got: unpack_fp4(got["weight"], got["weight_scale"],
                                                         None, NVFP4_GROUP,
                                                         scale_2=got["weight_scale_2"]),
                            packed=True, extra={"input_scale": read_past})
    # FP8 / FP8_PER_CHANNEL_PER_TOKEN: a scale a tensor or a row
    return ExpertReader("modelopt FP8", frozenset({"weight", "weight_scale"}),
                        lambda name, got: dequantize_fp8(name, got["weight"], got["weight_scale"],
                                                         None), extra={"input_scale": read_past})


def _ct_reader(scheme) -> ExpertReader:
    from kvfleet_runtime.layers.quantization.compressed_tensors import (
        FP4_FORMATS,
        unpack_ct,
        unpack_ct_int8,
        unpack_fp4,
    )
    from kvfleet_runtime.layers.quantization.int_weight import default_g_idx

    def read_past(name: str, tensor: torch.Tensor) -> None:
        log_once("compressed-tensors: the checkpoint's static activation scales (input_scale) "
                 "are not used: FP8 activations are scaled per token at run time, int8 ones "
                 "stay unquantized")
    static = {"input_scale": read_past, "input_zero_point": read_past} \
        if scheme.static_input_scale else {}
    if scheme.format == "float-quantized":
        return ExpertReader("compressed-tensors FP8", frozenset({"weight", "weight_scale"}),
                            lambda name, got: dequantize_fp8(name, got["weight"],
                                                             got["weight_scale"], scheme.block),
                            extra=static)
    if scheme.format in FP4_FORMATS:
        # NVFP4 / MXFP4 experts: held as 8-bit integers (unpack_fp4), kept packed
        def fp4_acts(name: str, tensor: torch.Tensor) -> None:
            log_once("compressed-tensors: FP4 activations (W4A4: input_global_scale) are not "
                     "applied: the activations stay unquantized")
        kinds = {"weight_packed", "weight_scale"}
        kinds |= {"weight_global_scale"} if scheme.format.startswith("nvfp4") else set()
        return ExpertReader("compressed-tensors FP4", frozenset(kinds),
                            lambda name, got: unpack_fp4(
                                got["weight_packed"], got["weight_scale"],
                                got.get("weight_global_scale"), scheme.group_size),
                            packed=True, extra={"input_global_scale": fp4_acts} if scheme.fp4_activations
                            else {})
    if scheme.format == "int-quantized":
        kinds = {"weight", "weight_scale"} | (set() if scheme.symmetric else {"weight_zero_point"})
        return ExpertReader("compressed-tensors int8", frozenset(kinds),
                            lambda name, got: unpack_ct_int8(got["weight"], got["weight_scale"],
                                                             got.get("weight_zero_point")),
                            packed=True, extra=static)

    def build(name: str, got: dict[str, torch.Tensor]):
        n, k = got["weight_shape"].reshape(-1).tolist()
        if got["weight_packed"].shape != (n, k * scheme.bits // 32):
            raise ValueError(f"{name}: weight_packed of shape {tuple(got['weight_packed'].shape)} "
                             f"does not hold weight_shape {[n, k]}")
        g_idx = got["weight_g_idx"] if scheme.act_order else default_g_idx(k, scheme.group_size)
        return unpack_ct(got["weight_packed"], got["weight_scale"],
                         got.get("weight_zero_point"), g_idx, scheme.bits)
    kinds = {"weight_packed", "weight_scale", "weight_shape"}
    kinds |= set() if scheme.symmetric else {"weight_zero_point"}
    kinds |= {"weight_g_idx"} if scheme.act_order else set()
    return ExpertReader("compressed-tensors", frozenset(kinds), build, packed=True)


class _MoeForCausalLM(LlamaForCausalLM):
    block_name = "mlp"                          # the checkpoint's name of a sparse layer's MLP
    expert_pieces: dict[str, str] = {}          # checkpoint projection -> gate / up / down

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant_config=None) -> None:
        self.quant_config = quant_config
        self.expert_scheme = None
        self.reader = self._reader(cfg, quant_config)
        super().__init__(cfg, dtype, quant_config)

    def _reader(self, cfg: ModelConfig, q) -> ExpertReader:
        """What the experts' tensors are, from the checkpoint's quantization."""
        name = getattr(q, "name", None)
        if name is None or (name == "fp8" and not q.serialized):
            # unquantized (--quantization fp8 rounds the experts once loaded)
            return ExpertReader("unquantized", frozenset({"weight"}),
                                lambda name, got: got["weight"])
        if name == "fp8":
            return _fp8_reader(q)
        if name == "awq":
            return _awq_reader(q)
        if name == "gptq":
            return _gptq_reader(q, q.desc_act)
        if name == "modelopt":
            # the experts quantized, or all of them left in exclude_modules (each expert
            # tensor's own is checked as it arrives)
            excluded = {q.excluded(m) for m in self._first_experts(cfg)}
            if len(excluded) != 1:
                raise ValueError(f"{cfg.architecture}: ModelOpt's exclude_modules must name "
                                 "every expert projection or none")
            q.experts_excluded = excluded.pop()
            if q.experts_excluded:
                log_once("modelopt: the experts stay unquantized (exclude_modules)")
                return ExpertReader("unquantized", frozenset({"weight"}),
                                    lambda name, got: got["weight"])
            return _modelopt_reader(q)
        # compressed-tensors: the experts' scheme, the same for every expert projection of
        # the first sparse layer (each tensor's own is checked as it arrives)
        schemes = {q.scheme_of_module(m) for m in self._first_experts(cfg)}
        if len(schemes) != 1 or None in schemes:
            raise ValueError(f"{cfg.architecture}: compressed-tensors experts must all fall "
                             f"under one quantization scheme; got {schemes}")
        self.expert_scheme = q.expert_scheme = schemes.pop()
        return _ct_reader(self.expert_scheme)

    def _first_experts(self, cfg: ModelConfig) -> list[str]:
        """The modules of the first sparse layer's expert 0 (a checkpoint's scheme for all)."""
        layer = min(cfg.moe_layers)
        return [f"model.layers.{layer}.{self.block_name}.experts.0.{p}"
                for p in self.expert_pieces]

    def _block(self, layer: int, name: str) -> SparseMoeBlock:
        if layer >= len(self.model.layers) or not isinstance(self.model.layers[layer].mlp,
                                                            SparseMoeBlock):
            raise ValueError(f"checkpoint tensor {name!r}: layer {layer} of "
                             f"{self.config.architecture} is not a mixture of experts here")
        return self.model.layers[layer].mlp

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        pieces: dict[int, set[tuple[int, str]]] = {}
        # an expert projection's tensors until all its kinds are in
        halves: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}
        reader = self.reader

        def dense():
            for name, tensor in weights:
                expert = _EXPERT.fullmatch(name)
                router = _ROUTER.fullmatch(name)
                if expert and expert[2] == self.block_name:
                    layer, index, proj, kind = int(expert[1]), int(expert[3]), expert[4], expert[5]
                    block = self._block(layer, name)
                    module = name.rpartition(".")[0]
                    if getattr(self.quant_config, "name", None) == "modelopt" and \
                            self.quant_config.excluded(module) != \
                            self.quant_config.experts_excluded:
                        raise ValueError(f"checkpoint tensor {name!r}: ModelOpt's "
                                         "exclude_modules names some experts but not all; "
                                         "experts must all be quantized alike")
                    if proj not in self.expert_pieces or index >= block.num_experts or (
                            kind not in reader.required and kind not in reader.extra):
                        raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                         f"{self.config.architecture} with {reader.name} "
                                         "experts")
                    if self.expert_scheme is not None and \
                            self.quant_config.scheme_of_module(module) != self.expert_scheme:
                        raise ValueError(f"checkpoint tensor {name!r}: its compressed-tensors "
                                         "scheme is not the other experts'; experts must all "
                                         "be quantized alike")
                    if kind in reader.extra:
                        reader.extra[kind](name, tensor)
                        continue
                    got = halves.setdefault((layer, index, proj), {})
                    got[kind] = tensor
                    if len(got) < len(reader.required):
                        continue
                    del halves[(layer, index, proj)]
                    w, piece = reader.build(module, got), self.expert_pieces[proj]
                    if reader.packed:
                        block.load_int_expert(index, piece, w)
                    else:
                        block.load_expert(index, piece, w.to(block.w13.dtype))
                    pieces.setdefault(layer, set()).add((index, piece))
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
