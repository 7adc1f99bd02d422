"""Llama-family decoder (Llama 2/3, Mistral); Qwen2/Qwen3 reuse it with their switches.

Math only: projections are fused (qkv, gate_up), K/V go through the paged
Attention layer, and the batch is a flat run of tokens ([T, ...]).
Under tensor parallelism each rank builds its shard: its share of the query heads and KV heads
(KV heads replicated when there are fewer than ranks), column-parallel qkv and gate_up,
row-parallel o and down, a vocab-parallel embedding and lm_head.
With FP8 weights the norms and the activation hand qkv, gate_up and down their input quantized
(feeds_fp8); o_proj's input, the attention output, is quantized by the GEMM itself.
With act-order GPTQ weights (each projection's input rows sorted by group: a gather of its
input a step) qkv and gate_up get theirs from the norms in that order, o_proj from attention
(its kernels store each output column at its place), and down from gate_up, whose output
columns are put in down's order at load time (`order_inputs`); none gathers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvfleet_runtime.distributed.layers import VocabParallelEmbedding
from kvfleet_runtime.distributed.parallel_state import get_tp_size
from kvfleet_runtime.layers.activation import SiluAndMul
from kvfleet_runtime.layers.attention import Attention, AttentionMetadata
from kvfleet_runtime.layers.backend import use_triton
from kvfleet_runtime.layers.linear import Linear, cpu_packed_weight, packed_linear
from kvfleet_runtime.layers.moe import SparseMoeBlock
from kvfleet_runtime.layers.norm import RMSNorm, reduce_in_norm
from kvfleet_runtime.layers.quantization.fp8 import feeds_fp8
from kvfleet_runtime.layers.rotary import RotaryEmbedding
from kvfleet_runtime.models.config import ModelConfig


def _method(quant_config, prefix: str):
    return quant_config.get_linear_method(prefix) if quant_config is not None else None


def act_order_experts(quant_config) -> bool:
    """Whether a GPTQ / compressed-tensors integer checkpoint's experts are act-order (GPTQ
    desc_act, compressed-tensors actorder group: each expert's inputs shuffled its own way)."""
    name = getattr(quant_config, "name", None)
    if name == "compressed-tensors":
        s = quant_config.expert_scheme          # (set by models/moe.py)
        return s is not None and s.act_order
    return name == "gptq" and getattr(quant_config, "desc_act", False)


def _int_experts(quant_config) -> tuple[int, int] | None:
    """(bits, group_size) of a GPTQ / AWQ / compressed-tensors integer checkpoint's experts
    (layers.moe), else None (act-order ones too: each expert's inputs sorted by group)."""
    name = getattr(quant_config, "name", None)
    if name == "compressed-tensors":
        from kvfleet_runtime.layers.quantization.compressed_tensors import FP4_FORMATS
        s = quant_config.expert_scheme          # (set by models/moe.py)
        if s is None:
            return None
        if s.format in FP4_FORMATS:
            return 8, s.group_size              # (held as 8-bit integers: unpack_fp4)
        if s.format not in ("pack-quantized", "int-quantized"):
            return None
        return s.bits, s.group_size
    if name == "modelopt":       # NVFP4 experts as 8-bit integers (unpack_fp4)
        from kvfleet_runtime.layers.quantization.modelopt import NVFP4_GROUP
        return (8, NVFP4_GROUP) if quant_config.algo == "nvfp4" and \
            not quant_config.experts_excluded else None
    if name not in ("gptq", "awq"):
        return None
    return getattr(quant_config, "bits", 4), quant_config.group_size


def _fp8_experts(quant_config) -> bool:
    """Whether a mixture of experts' experts are rounded to e4m3 once loaded (FP8 checkpoints'
    arrive dequantized: models/moe.py)."""
    name = getattr(quant_config, "name", None)
    if name == "compressed-tensors":
        s = quant_config.expert_scheme
        return s is not None and s.format == "float-quantized"
    if name == "modelopt":
        return quant_config.algo != "nvfp4" and not quant_config.experts_excluded
    return name == "fp8"


def _heads_per_rank(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query heads, KV heads) of one rank, and how many ranks share each KV head."""
    tp = get_tp_size()
    if cfg.num_heads % tp:
        raise ValueError(f"num_attention_heads ({cfg.num_heads}) must be a multiple of "
                         f"tensor_parallel_size ({tp})")
    if cfg.num_kv_heads >= tp:
        if cfg.num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads ({cfg.num_kv_heads}) must be a multiple of "
                             f"tensor_parallel_size ({tp}) when it is not smaller")
        return cfg.num_heads // tp, cfg.num_kv_heads // tp, 1
    if tp % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of num_key_value_heads "
                         f"({cfg.num_kv_heads}) when it is larger")
    return cfg.num_heads // tp, 1, tp // cfg.num_kv_heads


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant_config, prefix: str,
                 rotary_emb: RotaryEmbedding, window: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, kv_replicas = _heads_per_rank(cfg)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        full_q, full_kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [full_q, full_kv, full_kv],
                               bias=cfg.attention_bias, dtype=dtype,
                               linear_method=_method(quant_config, f"{prefix}.qkv_proj"),
                               prefix=f"{prefix}.qkv_proj", parallel="column",
                               output_replicas=[1, kv_replicas, kv_replicas])
        self.o_proj = Linear(full_q, cfg.hidden_size, bias=False, dtype=dtype,
                             linear_method=_method(quant_config, f"{prefix}.o_proj"),
                             prefix=f"{prefix}.o_proj", parallel="row")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.qk_norm = cfg.qk_norm
        self.rotary_emb = rotary_emb       # one cos/sin cache shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim ** -0.5,
                              window=window)

    def order_inputs(self) -> None:
        """An act-order o_proj: attention writes its output in o_proj's input order, and o_proj
        gathers nothing (o_proj reads nothing else; under tensor parallelism its perm orders
        this rank's rows, the output of this rank's heads)."""
        _hand_over_in_order(self.attn, self.o_proj)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        # rope: this step's rotary tables (torch path), made once by DecoderModel; rows: only
        # these rows of the output are wanted (every token's K/V still goes into the cache)
        qkv = self.qkv_proj(x)                                            # [T, q + 2kv]
        qk_size = self.q_size + self.kv_size
        if rope is not None and not self.qk_norm:
            # torch path: rotate q and k side by side in one pass, one set of ops for both
            q, k = self.rotary_emb.apply_tables(qkv[:, :qk_size], rope).split(
                [self.q_size, self.kv_size], dim=-1)
            return self.o_proj(_rows(self.attn(q, k, qkv[:, qk_size:].contiguous(), meta), rows))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        if use_triton(qkv):
            # one kernel rotates q and k and writes k and v into the paged cache
            from kvfleet_kernels.rotary import rotary_and_cache
            k_cache, v_cache = self.attn.kv_cache
            q = rotary_and_cache(positions, q, k, v, self.head_dim, self.rotary_emb.cos_sin_cache,
                                 True, k_cache, v_cache, meta.slot_mapping, self.attn.k_scale,
                                 self.attn.v_scale)
            return self.o_proj(_rows(self.attn(q, None, None, meta), rows))
        q, k = self.rotary_emb(positions, q, k, rope)
        return self.o_proj(_rows(self.attn(q, k, v.contiguous(), meta), rows))


def _hand_over_in_order(producer: nn.Module, layer: nn.Module) -> None:
    """An act-order `layer` (its input rows sorted by group: `perm`) whose one input is
    `producer`'s output: the producer writes it in that order (set_output_order), and the layer
    gathers nothing."""
    perm = getattr(layer, "perm", None)
    if perm is not None and not layer.input_permuted:
        producer.set_output_order(perm)
        layer.input_permuted = True


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant_config, prefix: str,
                 intermediate_size: int = 0) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], bias=False, dtype=dtype,
                                   linear_method=_method(quant_config, f"{prefix}.gate_up_proj"),
                                   prefix=f"{prefix}.gate_up_proj", parallel="column")
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False, dtype=dtype,
                                linear_method=_method(quant_config, f"{prefix}.down_proj"),
                                prefix=f"{prefix}.down_proj", parallel="row")
        self.act_fn = SiluAndMul()
        feeds_fp8(self.act_fn, self.down_proj)

    def order_inputs(self) -> None:
        """An act-order down_proj: gate_up's gate and up columns are both put in its input
        order (an MLP's intermediate units, relabelled the same way on both sides, compute the
        same function), so SiLU(gate) * up comes out in that order on every path and down
        gathers nothing."""
        down, gate_up = self.down_proj, self.gate_up_proj
        perm = getattr(down, "perm", None)
        if perm is None or down.input_permuted:
            return
        inter = gate_up.output_size // 2
        if gate_up.linear_method.permute_outputs(gate_up, torch.cat([perm, perm + inter])):
            down.input_permuted = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):     # not quantized by the norm (FP8 / int8 activation)
            act = self.gate_up_proj.gated_output(x)     # SiLU(gate) * up inside gate_up's GEMV
            if act is not None:
                return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        if self.down_proj.takes_gated(gate_up):     # SiLU(gate) * up inside the down GEMV
            return self.down_proj(gate_up, gated=True)
        return self.down_proj(self.act_fn(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant_config, prefix: str,
                 rotary_emb: RotaryEmbedding, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, dtype, quant_config, f"{prefix}.self_attn",
                                          rotary_emb, window=cfg.layer_window(layer))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        feeds_fp8(self.input_layernorm, self.self_attn.qkv_proj)
        if layer in cfg.moe_layers:     # a mixture of experts (models/moe.py)
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.moe_renormalize,
                                      cfg.architecture != "MixtralForCausalLM", dtype,
                                      fp8=_fp8_experts(quant_config),
                                      int_weights=_int_experts(quant_config),
                                      act_order=act_order_experts(quant_config))
            if cfg.shared_expert_intermediate_size:     # Qwen2-MoE's, a dense MLP
                self.mlp.shared_expert = DecoderMLP(
                    cfg, dtype, quant_config, f"{prefix}.mlp.shared_expert",
                    intermediate_size=cfg.shared_expert_intermediate_size)
                self.mlp.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False,
                                                        dtype=dtype)
        else:
            self.mlp = DecoderMLP(cfg, dtype, quant_config, f"{prefix}.mlp")
            feeds_fp8(self.post_attention_layernorm, self.mlp.gate_up_proj)

    def order_inputs(self) -> None:
        """Each norm whose one reader is an act-order projection (qkv; gate_up of a dense MLP)
        writes its output in that projection's input order, which then gathers nothing
        (o_proj's input: DecoderAttention.order_inputs; down's: DecoderMLP.order_inputs)."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, DecoderMLP):
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        for norm, layer in pairs:
            _hand_over_in_order(norm, layer)

    def forward(self, positions, x, residual, meta, rope=None, rows=None):
        # rows: the only rows of the output wanted (DecoderModel's last layer)
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, rope, rows)
        x, residual = self.post_attention_layernorm(x, _rows(residual, rows))
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant_config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype,
                                                   replicated=True)
        rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim or cfg.head_dim,
                                     cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                     context=cfg.rope_context)
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, quant_config, f"model.layers.{i}", rotary_emb, layer=i)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # under tensor parallelism each row-parallel projection's all-reduce may run fused
        # with the norm that reads its output
        readers = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, readers, strict=True)):
            reduce_in_norm(layer.self_attn.o_proj, layer.post_attention_layernorm, 2 * i)
            if isinstance(layer.mlp, DecoderMLP):
                reduce_in_norm(layer.mlp.down_proj, next_norm, 2 * i + 1)

    def forward(self, input_ids, positions, meta, rows=None):
        # rows (a device tensor of row indices, or None: all): the rows of the hidden states
        # returned. Only the cache needs the last layer's other rows, and it has them once that
        # layer's K/V are written: its attention output, o_proj and MLP run on these rows alone
        # (a prefill step wants one row a prompt: ~3% of a 32-layer model's GEMMs not run)
        x = self.embed_tokens(input_ids)                                   # [T, D]
        rope = self.rotary_emb.prepare(positions, x.dtype)     # cos/sin once, not per layer
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, meta, rope, rows if i == last else None)
        x, _ = self.norm(x, residual)
        return x


def _fused_pieces(name: str, param: torch.Tensor, tensor: torch.Tensor,
                  sizes: list[int]) -> list[torch.Tensor]:
    """A fused checkpoint tensor split into its pieces along the parameter's output dim (in
    packed units where the format packs it); one number, or a tensor with no output dim (a
    per-tensor scale, GPTQ's g_idx), goes to every piece whole."""
    dim = getattr(param, "output_dim", None)
    if dim is None or tensor.numel() == 1:
        return [tensor] * len(sizes)
    pack = getattr(param, "output_pack", 1)
    parts = [size // pack for size in sizes]
    if tensor.dim() <= dim or tensor.shape[dim] != sum(parts):
        raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} does not "
                         f"hold the fused pieces {sizes} along dim {dim}")
    return list(tensor.split(parts, dim))


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (our fused module, shard id)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant_config=None) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, dtype, quant_config)
        if cfg.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        if cfg.num_labels:      # a sequence classifier's head (pooling.py), whole on each rank
            self.score = torch.nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False,
                                         dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)
        self.lm_head_packed: torch.Tensor | None = None    # set by load_weights (CPU bf16)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, rows: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, D] (rows: [R] -> those rows, [R, D])
        return self.model(input_ids, positions, meta, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [N, D] -> logits [N, V] in the model's dtype, gathered on rank 0 (None on the
        # others); the sampler widens them to fp32 where it needs to (not for greedy rows)
        if self.lm_head_packed is not None:
            logits = packed_linear(hidden, self.lm_head_packed, None)
            return logits[:, : self.config.vocab_size]
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route checkpoint tensors (HF names) into our parameters; returns the names loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            module_path, param_name = name.rsplit(".", 1)
            parent, _, proj = module_path.rpartition(".")
            module = modules.get(module_path)
            if isinstance(module, Linear) and len(module.output_sizes) > 1:
                # a checkpoint that stores the projection fused as ours is (Phi-3's qkv_proj,
                # gate_up_proj): its pieces one by one, as separate tensors would come
                param = getattr(module, param_name)
                for shard, piece in enumerate(_fused_pieces(name, param, tensor,
                                                             module.full_output_sizes)):
                    module.weight_loader(param, piece, shard)
                loaded.add(name)
                continue
            if proj in self.stacked_params:
                fused, shard = self.stacked_params[proj]
                target = f"{parent}.{fused}"
                module = modules[target]
                module.weight_loader(getattr(module, param_name), tensor, shard)
                loaded.add(f"{target}.{param_name}")
                continue
            if module is None or f"{module_path}.{param_name}" not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{self.config.architecture}")
            param = params[f"{module_path}.{param_name}"]
            if hasattr(module, "weight_loader"):
                module.weight_loader(param, tensor, None)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                     f"model shape {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(f"{module_path}.{param_name}")
        # the 49k-row lm_head is the largest matmul of a decode step: on a CPU in bf16 keep a
        # prepacked copy of its weight too (as Linear does; the embedding keeps the plain one)
        self.lm_head_packed = (cpu_packed_weight(self.lm_head.weight)
                               if get_tp_size() == 1 else None)
        return loaded
