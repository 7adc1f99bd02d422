"""What GPTQ and AWQ share once their tensors are unpacked: the integer weight, its fused
W4A16 kernel on GPU, and the dequantized fallback.

Under tensor parallelism (layers/linear.py) a column-parallel layer keeps its output
columns of every tensor; a row-parallel one keeps its input rows of qweight and, through
`split_groups`, either only its own groups of scales and zero points (plain grouping: the
split must fall on group boundaries) or all of them (act-order: its rows fall into every group,
so its slice of g_idx keeps the checkpoint's group numbers).

After loading, a method unpacks its checkpoint tensors into an `IntWeight` and this module
either repacks it into the kernel's layout (kvfleet_kernels.w4a16: qweight packed along K,
rows sorted by group, fp16 scales and zero points per group; column-blocked where batch 1
runs the whole-K GEMV) or, where the kernel cannot
serve the layer (CPU, an odd shape, unequal act-order groups), stores the dequantized weight
in the model's dtype and logs why, once per reason.

An act-order layer gathers its input into the sorted order (`x[:, perm]`, a launch a projection)
unless whatever computes that input hands it over in that order already (`input_permuted`,
set at load time by the model: models/llama.py `order_inputs`); `permute_outputs` reorders a
layer's output columns for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from kvfleet_kernels.w4a16 import (
    block_columns,
    blocked_whole_k,
    gated_output_serves,
    gemv_max_m,
    kernel_supports,
    unblock_columns,
    w4a16_gemm,
)
from torch import nn

from kvfleet_runtime.distributed.parallel_state import get_tp_size
from kvfleet_runtime.layers.linear import Linear, LinearMethod
from kvfleet_runtime.layers.quantization.base import log_once
from kvfleet_runtime.layers.quantization.packing import pack_int32


@dataclass
class IntWeight:
    """w[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n] for input row k, output n."""
    q: torch.Tensor          # [K, N] int32 in [0, 2**bits)
    zeros: torch.Tensor      # [G, N] integer-valued zero points (float)
    scales: torch.Tensor     # [G, N]
    g_idx: torch.Tensor      # [K] group of each input row
    bits: int

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32, laid out like nn.Linear's weight."""
        g = self.g_idx.long()
        return ((self.q.float() - self.zeros.float()[g]) * self.scales.float()[g]).t()


def default_g_idx(input_size: int, group_size: int, start: int = 0) -> torch.Tensor:
    """Group of each of the input rows [start, start + input_size) under plain grouping."""
    rows = torch.arange(start, start + input_size, dtype=torch.int32)
    return rows // group_size if group_size != -1 else torch.zeros_like(rows)


def num_groups(input_size: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-input_size // group_size)


def _per_rank(layer: Linear) -> str:
    return f" per rank (tensor_parallel_size {get_tp_size()})" if layer.parallel else ""


def check_divisible(layer: Linear, what: str, size: int, divisor: int, method: str) -> None:
    if size % divisor:
        raise ValueError(f"{method}: {layer.prefix} has {what} {size}{_per_rank(layer)}, which "
                         f"must be a multiple of {divisor} to be packed")


@dataclass(frozen=True)
class GroupSplit:
    """This rank's rows of the per-group tensors (scales, zero points) of one layer."""
    num_groups: int           # rows it holds
    first_group: int          # checkpoint group number of its first row (g_idx is rebased by it)
    attrs: dict = field(default_factory=dict)   # weight attrs that make the loader slice them


def split_groups(layer: Linear, group_size: int, act_order: bool, method: str) -> GroupSplit:
    """Which groups a layer's rank keeps; refuses a row split that would cut a group."""
    if layer.parallel != "row" or group_size == -1 or act_order:
        # unsplit input, one group over all of K, or act-order: all of the checkpoint's groups
        return GroupSplit(num_groups(layer.full_input_size, group_size), 0)
    if layer.input_size % group_size:
        raise ValueError(f"{method}: {layer.prefix} has input size {layer.full_input_size}, "
                         f"split over tensor_parallel_size {get_tp_size()} into "
                         f"{layer.input_size} rows per rank, which must be a multiple of "
                         f"group_size {group_size} (each rank keeps whole groups)")
    # one row of scales/qzeros spans group_size inputs: the loader cuts them like qweight
    return GroupSplit(layer.input_size // group_size, layer.input_start // group_size,
                      {"input_dim": 0, "input_pack": group_size})


def _replace(layer: Linear, name: str, tensor: torch.Tensor | None) -> None:
    if hasattr(layer, name):
        delattr(layer, name)
    if tensor is not None:
        layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


class IntWeightMethod(LinearMethod):
    """Base of the GPTQ and AWQ methods: they create and unpack their tensors, this runs them."""
    name = "int"
    checkpoint_params: tuple[str, ...] = ()

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits = bits
        self.group_size = group_size

    def unpack(self, layer: Linear) -> IntWeight:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = self.unpack(layer)
        self.finalize(layer, w, use_kernel=w.q.device.type == "cuda")

    def finalize(self, layer: Linear, w: IntWeight, use_kernel: bool) -> None:
        """Replace the checkpoint tensors by the kernel's layout, or by the dequantized weight."""
        for name in self.checkpoint_params:
            delattr(layer, name)
        k = w.q.shape[0]
        group_size = k if self.group_size == -1 else self.group_size
        if not use_kernel:
            reason = f"{self.name}: no GPU, layers are dequantized on load"
        elif not kernel_supports(k, self.bits, group_size):
            reason = (f"{self.name}: the W4A16 kernel does not serve in={k}, bits={self.bits}, "
                      f"group_size={group_size}; such layers are dequantized on load")
        else:
            reason = self._to_kernel_layout(layer, w, group_size)
        layer.uses_kernel = reason is None
        if reason is not None:
            log_once(reason)
            _replace(layer, "weight", w.dequantize().to(layer.params_dtype))

    def _to_kernel_layout(self, layer: Linear, w: IntWeight, group_size: int) -> str | None:
        """Repack for the kernel; returns why it cannot, or None."""
        k = w.q.shape[0]
        g_idx = w.g_idx.long()
        contiguous = torch.arange(k, device=g_idx.device) // group_size
        perm = None
        q = w.q
        if not torch.equal(g_idx, contiguous):
            # act-order: sort rows by group so that each K tile has one group; x is permuted
            # the same way at run time
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], contiguous):
                return (f"{self.name}: a g_idx gives groups of unequal size; such layers are "
                        "dequantized on load")
            q = q[perm]
        tensors = {"qweight": pack_int32(q, self.bits, dim=0),
                   "scales": w.scales.to(torch.float16).contiguous(),
                   "zeros": w.zeros.to(torch.float16).contiguous()}
        n = q.shape[1]
        # where batch 1 runs the whole-K GEMV (on a GPU), its tiles, and the weight blocked by
        # its columns: each of its programs then streams one contiguous run of words (the
        # tiled kernel of 2-64 rows and the dequantize kernel of more read this layout too)
        layer.whole_k_config = blocked_whole_k(n, k, self.bits, group_size, q.device)
        if layer.whole_k_config:
            tensors = {name: block_columns(t, layer.whole_k_config.block_n)
                       for name, t in tensors.items()}
        for name, t in tensors.items():
            _replace(layer, name, t)
        layer.register_buffer("perm", perm, persistent=False)
        layer.input_permuted = False        # x arrives as x[:, perm] (order_inputs)
        layer.kernel_group_size = group_size
        return None

    def permute_outputs(self, layer: Linear, index: torch.Tensor) -> bool:
        """Make output column j what column index[j] was (the packed words, scales and zero
        points of each column move with it, in the blocked layout too); False where the layer
        holds neither that layout nor a dequantized weight (W8A8's int8 rows and their scales)."""
        if not layer.uses_kernel and layer.weight.dtype != layer.params_dtype:
            return False
        if layer.bias is not None:
            _replace(layer, "bias", layer.bias.data[index].contiguous())
        if not layer.uses_kernel:
            _replace(layer, "weight", layer.weight.data[index].contiguous())
            return True
        blocked = layer.whole_k_config
        for name in ("qweight", "scales", "zeros"):
            t = getattr(layer, name).data
            t = (unblock_columns(t) if blocked else t)[:, index]
            _replace(layer, name, block_columns(t, blocked.block_n) if blocked else t.contiguous())
        return True

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not layer.uses_kernel:
            return F.linear(x, layer.weight, bias)
        # x: [T, in] -> [T, out]
        x = _in_order(layer, x)
        out = w4a16_gemm(x.contiguous(), layer.qweight, layer.scales, layer.zeros, self.bits,
                         layer.kernel_group_size,
                         layer.whole_k_config if x.shape[0] <= gemv_max_m(self.bits) else None)
        return out if bias is None else out + bias

    def apply_gated(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """A gated MLP's gate_up layer (no bias): SiLU(gate) * up of its output, [T, out / 2],
        from inside its batch-1 GEMV (w4a16_gemm's silu_out), or None where that does not
        serve."""
        if not layer.uses_kernel or not gated_output_serves(
                x.shape[0], layer.output_size, x.shape[1], layer.kernel_group_size,
                x.device, self.bits):
            return None
        return w4a16_gemm(_in_order(layer, x).contiguous(), layer.qweight, layer.scales,
                          layer.zeros, self.bits, layer.kernel_group_size, silu_out=True)


def _in_order(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """x in the kernel layout's input order (act-order: rows sorted by group)."""
    return x if layer.perm is None or layer.input_permuted else x[:, layer.perm]
