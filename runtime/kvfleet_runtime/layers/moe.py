"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top_k
experts, each a gated SiLU MLP, and the token's output is their weighted sum.

The experts' weights are stacked: w13 [E, 2I, H] (each expert's gate then up rows), w2
[E, H, I]. On the Triton path one grouped GEMM a projection (kvfleet_kernels.moe.fused_moe);
elsewhere HF's loop over the experts hit (fused_moe_ref).
Under tensor parallelism each rank holds every expert's slice of I (its rows of gate and up,
its columns of down, as a dense MLP's column / row split) and the ranks' outputs are summed;
the router is whole on every rank (its input is, so every rank routes alike).

Integer experts (GPTQ / AWQ checkpoints, 4 or 8 bits): each projection's integers packed along
its input dim an output row at a time, with fp16 scales and zero points a group of inputs
(kvfleet_kernels.moe.IntExperts), kept packed on every device: the kernels dequantize tiles in
registers, the torch path an expert at a time. Act-order ones (GPTQ desc_act) have each expert
projection's inputs sorted by group as they load; gate / up keep their permutation (the kernels
gather each pair's input through it); their rows are put in down's sorted order before a rank
takes its slice, so their outputs come out in the order of down's inputs (no gather there) and
under tensor parallelism each rank's slice of down's inputs holds whole groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_runtime.distributed.communication import all_reduce
from kvfleet_runtime.distributed.parallel_state import get_tp_rank, get_tp_size
from kvfleet_runtime.layers.backend import use_triton


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, weights_in_dtype: bool, dtype: torch.dtype,
                 fp8: bool = False, int_weights: tuple[int, int] | None = None,
                 act_order: bool = False) -> None:
        # renormalize: the top_k probabilities divided by their sum (Mixtral; Qwen3-MoE's
        # norm_topk_prob); weights_in_dtype: rounded to the model's dtype (Qwen3-MoE) or kept
        # in fp32 (Mixtral), as HF's routers do; fp8: the experts quantized once loaded
        # (`--quantization fp8`: e4m3, a scale a row; process_weights_after_loading);
        # int_weights: (bits, group_size) of a GPTQ / AWQ checkpoint's experts (load_int_expert);
        # act_order: theirs are (g_idx shuffled)
        super().__init__()
        self.fp8 = fp8
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}; got {top_k}")
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if intermediate_size % self.tp_size:
            raise ValueError(f"the experts' intermediate size ({intermediate_size}) must be a "
                             f"multiple of tensor_parallel_size ({self.tp_size})")
        intermediate_size //= self.tp_size
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_dtype = weights_in_dtype
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.int_weights = int_weights
        self.int_experts = None      # (w13, w2) as kvfleet_kernels.moe.IntExperts, once loaded
        if int_weights is None:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                hidden_size, dtype=dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size,
                                               dtype=dtype), requires_grad=False)
        else:
            self.w13 = self.w2 = None
            bits, group_size = int_weights
            for name, n, k in (("w13", 2 * intermediate_size, hidden_size),
                               ("w2", hidden_size, intermediate_size)):
                group = self._group(k)
                for what, size in (("values of 32 // bits", 32 // bits), ("group_size", group)):
                    if k % size:
                        raise ValueError(
                            f"{bits}-bit experts: the {'hidden' if name == 'w13' else 'intermediate'}"
                            f" size {k}{self._per_rank()} must be a multiple of {what} ({size})")
                for suffix, shape, t in (("qweight", (k * bits // 32,), torch.int32),
                                         ("scales", (k // group,), torch.float16),
                                         ("zeros", (k // group,), torch.float16)):
                    self.register_parameter(f"{name}_{suffix}", nn.Parameter(
                        torch.zeros(num_experts, n, *shape, dtype=t), requires_grad=False))
        self.act_order = act_order and int_weights is not None
        if self.act_order:
            # gate's and up's input order, sorted by group (load_int_expert; one input, so one
            # order: checked once loaded)
            self.register_buffer("w13_perm", torch.zeros(num_experts, 2, hidden_size,
                                                         dtype=torch.int32), persistent=False)
            # while loading: each expert's down order (its inputs sorted by group), and gate /
            # up projections waiting for it
            self._down_order: dict[int, torch.Tensor] = {}
            self._waiting: dict[tuple[int, str], object] = {}
        # Qwen2-MoE: a dense MLP every token takes, weighted by sigmoid(shared_expert_gate(x))
        # (set by the model: models/llama.py)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None

    def _group(self, k: int) -> int:
        """Inputs a group of scales spans in rows of k inputs (this rank's)."""
        group_size = self.int_weights[1]
        return k if group_size == -1 else group_size

    def _per_rank(self) -> str:
        return f" per rank (tensor_parallel_size {self.tp_size})" if self.tp_size > 1 else ""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top_k experts and their weights ([T, K] each)."""
        from kvfleet_kernels.moe import moe_route, moe_route_ref
        logits = F.linear(x, self.gate.weight)
        route = moe_route if use_triton(x) else moe_route_ref
        return route(logits, self.top_k, self.renormalize,
                     x.dtype if self.weights_in_dtype else torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        w13, w2 = self.int_experts or (self.w13, self.w2)
        if use_triton(x):
            from kvfleet_kernels.moe import fused_moe
            out = fused_moe(x, w13, w2, weights, ids, w13_scale=self.w13_scale,
                            w2_scale=self.w2_scale)
        else:
            from kvfleet_kernels.moe import fused_moe_ref
            out = fused_moe_ref(x, w13, w2, weights, ids, self.w13_scale, self.w2_scale)
        if self.tp_size > 1:
            out = all_reduce(out)
        if self.shared_expert is not None:     # (its down_proj sums over the ranks itself)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * \
                self.shared_expert(x)
        return out

    def process_weights_after_loading(self) -> None:
        """FP8 experts: each row of w13 and w2 rounded to e4m3 with its own scale. On a GPU
        with FP8 (compute capability >= 8.9) they stay e4m3 (half the memory; the grouped
        GEMM reads them in the activation's dtype); elsewhere they are dequantized back, so a
        CPU serves the same rounded weights."""
        if self.int_weights is not None:
            from kvfleet_kernels.moe import IntExperts
            bits, _ = self.int_weights
            perms = (None, None)
            if self.act_order:
                if self._waiting:
                    expert, piece = next(iter(self._waiting))
                    raise ValueError(f"expert {expert}'s {piece} projection (act-order) waits "
                                     "for its down projection, which never loaded")
                differ = (self.w13_perm[:, 0] != self.w13_perm[:, 1]).any(dim=1).nonzero()
                if differ.numel():
                    raise ValueError(f"expert {int(differ[0])}: its gate and up projections "
                                     "were quantized in different act-orders (g_idx); they "
                                     "share one input, so one order is expected")
                self._down_order.clear()
                perms = (self.w13_perm[:, 0].contiguous(), None)
            self.int_experts = tuple(
                IntExperts(getattr(self, f"{name}_qweight").data, getattr(self, f"{name}_scales").data,
                           getattr(self, f"{name}_zeros").data, bits,
                           self._group(getattr(self, f"{name}_qweight").shape[2] * 32 // bits),
                           perm)
                for name, perm in zip(("w13", "w2"), perms, strict=True))
            return
        if not self.fp8:
            return
        from kvfleet_kernels.fp8 import fp8_supported, quantize_fp8_rowwise
        from kvfleet_kernels.moe import dequantize_experts
        keep = fp8_supported(self.w13.device)
        for name in ("w13", "w2"):
            w = getattr(self, name).data
            q, scale = quantize_fp8_rowwise(w.reshape(-1, w.shape[2]))
            q, scale = q.reshape(w.shape), scale.reshape(w.shape[:2]).contiguous()
            if keep:
                setattr(self, name, nn.Parameter(q, requires_grad=False))
                setattr(self, f"{name}_scale", scale)
            else:
                getattr(self, name).data.copy_(dequantize_experts(q, scale, w.dtype))

    def load_expert(self, expert: int, piece: str, tensor: torch.Tensor) -> None:
        """One expert's checkpoint tensor: piece "gate", "up" (halves of w13) or "down" (w2);
        under tensor parallelism this rank's slice of it."""
        inter = self.intermediate_size
        if self.tp_size > 1:
            cut = slice(self.tp_rank * inter, (self.tp_rank + 1) * inter)
            if tensor.shape[1 if piece == "down" else 0] != inter * self.tp_size:
                raise ValueError(f"expert {expert}'s {piece} projection: checkpoint shape "
                                 f"{tuple(tensor.shape)} does not hold {self.tp_size} x {inter}")
            tensor = tensor[:, cut] if piece == "down" else tensor[cut]
        target = {"gate": self.w13.data[expert, :inter], "up": self.w13.data[expert, inter:],
                  "down": self.w2.data[expert]}[piece]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert}'s {piece} projection: checkpoint shape "
                             f"{tuple(tensor.shape)} != model shape {tuple(target.shape)}")
        target.copy_(tensor)

    def load_int_expert(self, expert: int, piece: str, w) -> None:
        """One expert's GPTQ / AWQ projection, unpacked (layers.quantization.int_weight's
        IntWeight: q [K, N], zeros / scales [G, N], plain grouping or, act-order, g_idx's), as
        load_expert places a dense one: this rank's rows of gate and up, its inputs (and their
        groups) of down. Act-order: the inputs sorted by group (gate / up's order kept in
        w13_perm); gate / up's rows put in down's order, so they wait for down's projection."""
        from kvfleet_runtime.layers.quantization.packing import pack_int32
        bits, group_size = self.int_weights
        q, zeros, scales = w.q.t(), w.zeros.t(), w.scales.t()       # [N, K], [N, G], [N, G]
        inter = self.intermediate_size
        name = "w2" if piece == "down" else "w13"
        if self.act_order:
            if piece != "down" and expert not in self._down_order:
                self._waiting[(expert, piece)] = w
                return
            g_idx = w.g_idx.long()
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], torch.arange(q.shape[1], device=perm.device)
                               // self._group(q.shape[1])):
                raise ValueError(f"expert {expert}'s {piece} projection: its g_idx gives groups "
                                 f"of unequal size (act-order groups of {group_size} inputs "
                                 "expected)")
            q = q[:, perm]
            if piece != "down":     # rows in the order of down's (sorted) inputs
                order = self._down_order[expert].to(q.device)
                if q.shape[0] != order.numel():
                    raise ValueError(f"expert {expert}'s {piece} projection: {q.shape[0]} "
                                     f"outputs, its down projection {order.numel()} inputs")
                q, zeros, scales = q[order], zeros[order], scales[order]
        if self.tp_size > 1:
            full = inter * self.tp_size
            if q.shape[1 if piece == "down" else 0] != full:
                raise ValueError(f"expert {expert}'s {piece} projection: checkpoint shape "
                                 f"{tuple(q.t().shape)} does not hold {self.tp_size} x {inter}")
            cut = slice(self.tp_rank * inter, (self.tp_rank + 1) * inter)
            if piece != "down":
                q, zeros, scales = q[cut], zeros[cut], scales[cut]
            else:
                q = q[:, cut]
                if group_size != -1:    # this rank's inputs' groups (whole: checked above)
                    groups = slice(cut.start // group_size, cut.stop // group_size)
                    zeros, scales = zeros[:, groups], scales[:, groups]
        rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter),
                "down": slice(None)}[piece]
        qweight = getattr(self, f"{name}_qweight").data[expert, rows]
        want = (qweight.shape[0], qweight.shape[1] * 32 // bits)
        if tuple(q.shape) != want or zeros.shape != getattr(self, f"{name}_zeros")[expert, rows].shape:
            raise ValueError(f"expert {expert}'s {piece} projection: checkpoint shape "
                             f"{tuple(q.t().shape)} (inputs x outputs, {zeros.shape[1]} groups) "
                             f"!= model shape {want[::-1]} with group_size {group_size}")
        qweight.copy_(pack_int32(q.contiguous(), bits, dim=1))
        getattr(self, f"{name}_zeros").data[expert, rows] = zeros
        getattr(self, f"{name}_scales").data[expert, rows] = scales
        if self.act_order:
            if piece == "down":
                self._down_order[expert] = perm
                for waiting in ("gate", "up"):
                    if (expert, waiting) in self._waiting:
                        self.load_int_expert(expert, waiting,
                                             self._waiting.pop((expert, waiting)))
            else:
                self.w13_perm[expert, 0 if piece == "gate" else 1].copy_(perm)
