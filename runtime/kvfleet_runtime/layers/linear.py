"""Linear layers whose weights are created and applied by a pluggable LinearMethod.

One `Linear` serves plain and fused projections (qkv, gate_up): `output_sizes`
lists the pieces; checkpoint tensors of piece i are loaded with `shard_id=i`.
A quantization method (layers/quantization/) registers its own parameters
(qweight, scales, ...) and tags each with:
  output_dim:  which dim runs along the output features (None: not sharded by output)
  output_pack: how many output features one element holds along output_dim (packed ints)
so the shared `weight_loader` places each piece at its offset.

Tensor parallelism (Megatron style): a `parallel="column"` layer keeps this rank's part of
each output piece (`output_replicas[i]` ranks share one part of piece i: KV heads when there
are fewer than ranks); a `parallel="row"` layer keeps this rank's slice of the inputs (params
tag `input_dim`, and `input_pack`: how many inputs one element spans, 32 // bits for packed
ints, group_size for per-group scales) and all-reduces its output. The loader narrows each
checkpoint tensor to this rank's part before placing it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from kvfleet_kernels import cublaslt
from kvfleet_kernels.env import on_off
from torch import nn

from kvfleet_runtime.distributed.communication import (
    all_reduce,
    fused_norm_for,
    fused_norm_for_output,
    mark_pushed,
)
from kvfleet_runtime.distributed.parallel_state import get_tp_rank, get_tp_size
from kvfleet_runtime.layers.backend import use_triton


# batch-1 projections through kvfleet_kernels.gemv instead of cuBLAS / _scaled_mm.
# KVFLEET_TRITON_GEMV unset (default) or =tuned: FP8 weights (W8A16: 269.8 vs 186.7 tok/s through
# _scaled_mm at batch 1 on the H200) and the bf16 (device, shape) pairs of
# kvfleet_kernels.gemv.TUNED (measured faster than cuBLAS there: batch 1 203.1 -> 209.9 tok/s,
# TP=2 263.5 -> 282.9; docs/PERFORMANCE.md); other bf16 shapes stay on cuBLAS. =1: every shape.
# =0: none (cuBLAS and _scaled_mm only).
def gemv_modes(value: str) -> tuple[bool, bool, bool]:
    """(every bf16 shape, TUNED bf16 shapes, FP8 weights) for a KVFLEET_TRITON_GEMV value."""
    if value not in ("", "0", "1", "tuned"):
        raise ValueError(f"KVFLEET_TRITON_GEMV must be unset, 0, 1 or tuned; got {value!r}")
    return value == "1", value in ("", "tuned"), value != "0"


_TRITON_GEMV, _TUNED_GEMV, _FP8_GEMV = gemv_modes(os.environ.get("KVFLEET_TRITON_GEMV", ""))


# what the batch-1 GEMV of plain weights takes over (kvfleet_kernels.gemv: gated=, push=):
# KVFLEET_GEMV_SILU: the gated MLP's SiLU(gate) * up, computed inside the down projection's GEMV
# (with 4-bit weights, inside gate_up's: Linear.gated_output);
# KVFLEET_GEMV_PUSH: under tensor parallelism, sending its output to the peers for the fused
# all-reduce + RMSNorm that reads it. Both on by default; =0 turns one off (to measure it).
_GATED_GEMV = on_off("KVFLEET_GEMV_SILU", os.environ.get("KVFLEET_GEMV_SILU", ""))
_PUSH_GEMV = on_off("KVFLEET_GEMV_PUSH", os.environ.get("KVFLEET_GEMV_PUSH", ""))


def batch_one_gemv(x: torch.Tensor) -> bool:
    """x is a batch-1 input on the Triton path, where kvfleet_kernels.gemv can serve it."""
    return x.dim() == 2 and x.shape[0] == 1 and use_triton(x)


def unquantized_linear(owner: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, or at batch 1 kvfleet_kernels.gemv where KVFLEET_TRITON_GEMV routes this
    weight's shape (`owner`: the module holding the weight, where the choice is kept)."""
    if (_TRITON_GEMV or _TUNED_GEMV) and batch_one_gemv(x):
        choice = _batch_one_choice(owner, weight, x.device)
        if choice[0]:
            from kvfleet_kernels.gemv import gemv
            return gemv(x, weight, bias, choice[1])
    # the shapes and row counts the engine tuned at start (KVFLEET_CUBLASLT_TUNE=1, off by
    # default) run cuBLASLt's fastest algorithm there; lookup is None while nothing is tuned
    tuned = cublaslt.lookup(x, weight) if bias is None else None
    if tuned is not None:
        return tuned(x, weight)
    return F.linear(x, weight, bias)


def _batch_one_choice(owner: nn.Module, weight: torch.Tensor, device: torch.device):
    """(take the GEMV, its tiles) for this weight at batch 1, decided once per module (its
    shape and device do not change): the eager decode loop asks for every projection of every
    step. The tiles are the tuned ones, else (KVFLEET_TRITON_GEMV=1) gemv.pick_config's."""
    choice = owner.__dict__.get("_batch_one_gemv")
    if choice is None:
        from kvfleet_kernels.gemv import pick_config, tuned_config
        config = tuned_config(*weight.shape, device)
        take = config is not None or _TRITON_GEMV
        if take and config is None:
            config = pick_config(1, *weight.shape, device)
        choice = owner.__dict__["_batch_one_gemv"] = (take, config)
    return choice


def fusing_gemv_config(layer: Linear, x: torch.Tensor):
    """The tiles of the batch-1 GEMV where it serves `layer` (plain weights) on x in one K
    slice, i.e. where it can also take SiLU(gate) * up as its input and push its output to
    the peers (kvfleet_kernels.gemv); None elsewhere. The same answer on every rank."""
    if (type(layer.linear_method) is not LinearMethod or layer.weight.is_mkldnn
            or not (_TRITON_GEMV or _TUNED_GEMV) or not batch_one_gemv(x)):
        return None
    take, config = _batch_one_choice(layer, layer.weight, x.device)
    return config if take and config.split_k == 1 else None


class LinearMethod:
    """Unquantized weights: [out_features, in_features] in the compute dtype.

    On a CPU in bf16, process_weights_after_loading turns the weight into oneDNN's prepacked
    (blocked) layout, as torch.compile's CPU freezing does: F.linear reorders a plain weight
    on every call, 20-40% of a decode-sized matmul. Same kernel, bit-identical results; the
    plain copy is dropped (layer.weight is then an opaque mkldnn tensor of the same shape).
    """

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype),
                              requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight.is_mkldnn:
            return packed_linear(x, layer.weight, bias)
        return unquantized_linear(layer, x, layer.weight, bias)

    def process_weights_after_loading(self, layer: Linear) -> None:
        packed = cpu_packed_weight(layer.weight)
        if packed is not None:
            layer.weight = nn.Parameter(packed, requires_grad=False)

    def permute_outputs(self, layer: Linear, index: torch.Tensor) -> bool:
        """Make output column j what column index[j] was (weight rows, bias); False where this
        method cannot (a subclass's quantized weights, unless it does its own; a CPU-packed
        weight)."""
        if type(self) is not LinearMethod or layer.weight.is_mkldnn:
            return False
        layer.weight = nn.Parameter(layer.weight.data[index].contiguous(), requires_grad=False)
        if layer.bias is not None:
            layer.bias = nn.Parameter(layer.bias.data[index].contiguous(), requires_grad=False)
        return True


def cpu_packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a bf16 [out, in] weight on a CPU; None where it does not apply
    (other devices and dtypes: fp32 keeps F.linear, whose MKL results HF's match bit for bit)."""
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.is_mkldnn
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():   # oneDNN bf16 needs AVX512
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
    except (RuntimeError, AttributeError):   # a torch built without these ops
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """F.linear with a weight from cpu_packed_weight; x: [..., in] -> [..., out]."""
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias,
                                             "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def set_weight_attrs(param: torch.Tensor, **attrs: object) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


class Linear(nn.Module):
    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool = False,
                 dtype: torch.dtype | None = None, linear_method: LinearMethod | None = None,
                 prefix: str = "", parallel: str | None = None,
                 output_replicas: list[int] | None = None) -> None:
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"{prefix}: parallel must be one of column, row, None; "
                             f"got {parallel!r}")
        full_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.prefix = prefix
        self.parallel = parallel if get_tp_size() > 1 else None
        # this rank's input slice (row) and the start of its part of each output piece (column)
        self.input_size, self.input_start = input_size, 0
        self.output_sizes, self.output_starts = full_sizes, [0] * len(full_sizes)
        if self.parallel == "row":
            self.input_size = _split(input_size, get_tp_size(), f"{prefix} input size")
            self.input_start = get_tp_rank() * self.input_size
        elif self.parallel == "column":
            self.output_sizes, self.output_starts = _column_parts(
                full_sizes, output_replicas or [1] * len(full_sizes), prefix)
        self.full_input_size, self.full_output_sizes = input_size, full_sizes
        # [norm] for a row-parallel layer whose only reader is that RMSNorm (reduce_in_norm)
        self.reduced_by: list = []
        # LoRA adapters' slots (kvfleet_runtime.lora.layers.LoRASlots), set by the engine's
        # LoRAManager: their update is added to the output (before the all-reduce)
        self.lora = None
        input_size = self.input_size
        self.output_size = sum(self.output_sizes)
        dtype = dtype or torch.get_default_dtype()
        self.params_dtype = dtype
        self.linear_method = linear_method or LinearMethod()
        self.linear_method.create_weights(self, input_size, self.output_sizes, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        # x: [T, in] -> [T, out]. gated (only where takes_gated(x) said so): x is [T, 2 * in] =
        # [gate | up] of a gated MLP and the layer's input is SiLU(gate) * up
        # (with LoRA adapters' slots: gated is False, takes_gated said so)
        lora = self.lora
        if self.parallel != "row":
            out = self._apply(x, self.bias, gated)
            return out if lora is None else lora.add_to(out, x)
        if self.reduced_by and _PUSH_GEMV and self.bias is None and lora is None:
            pushed = self._pushing_gemv(x, gated)
            if pushed is not None:
                return pushed     # the norm that reads it only waits for the peers' parts
        # every rank's partial sum goes into the all-reduce; the bias must enter it once
        bias = self.bias if get_tp_rank() == 0 else None
        out = self._apply(x, bias, gated)
        if lora is not None:        # the adapters' partial update joins it
            out = lora.add_to(out, x)
        if self.reduced_by and fused_norm_for(out, self.reduced_by[0]) is not None:
            return out            # the norm that reads it sums it over the ranks
        return all_reduce(out)

    def gated_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """A gated MLP's gate_up projection: SiLU(gate) * up of its output ([T, out / 2]),
        computed inside its batch-1 GEMV where the linear method offers that (4-bit weights:
        no activation launch), else None (the MLP then runs gate_up and its activation)."""
        apply_gated = getattr(self.linear_method, "apply_gated", None)
        if (apply_gated is None or not _GATED_GEMV or self.bias is not None
                or self.lora is not None or not batch_one_gemv(x)):
            return None
        return apply_gated(self, x)

    def takes_gated(self, x: torch.Tensor) -> bool:
        """Whether forward(x, gated=True) computes SiLU(gate) * up of x = [gate | up] inside
        this layer's batch-1 GEMV (the gated MLP asks; otherwise it runs its activation)."""
        return (_GATED_GEMV and self.lora is None      # (an adapter reads this layer's input)
                and fusing_gemv_config(self, x) is not None)

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
        if gated:
            from kvfleet_kernels.gemv import gemv
            return gemv(x, self.weight, bias, fusing_gemv_config(self, x), gated=True)
        return self.linear_method.apply(self, x, bias)

    def _pushing_gemv(self, x: torch.Tensor, gated: bool) -> torch.Tensor | None:
        """A row-parallel layer at batch 1 whose norm takes the fused all-reduce + RMSNorm: the
        GEMV that also sends its output into the peers' slots of that norm's call (gemv's
        push=); None where that does not serve (every rank decides the same)."""
        config = fusing_gemv_config(self, x)
        norm = self.reduced_by[0]
        fused = (fused_norm_for_output(x, x.shape[0], self.output_size, norm)
                 if config is not None else None)
        if fused is None:
            return None
        from kvfleet_kernels.gemv import gemv
        out = gemv(x, self.weight, None, config, gated=gated,
                   push=fused.slots(x.dtype, norm.reduce_site % 2))
        return mark_pushed(out)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        custom = getattr(param, "weight_loader", None)
        if custom is not None:
            custom(param, loaded, shard_id)
            return
        self.place(param, loaded, shard_id)

    def place(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Copy this rank's part of a checkpoint tensor (one piece, or the whole layer) into
        `param` at the piece's offset; custom loaders call it after their own checks."""
        loaded = self.rank_part(param, loaded, shard_id)
        output_dim = getattr(param, "output_dim", None)
        if shard_id is None or output_dim is None:
            if param.shape != loaded.shape:
                raise ValueError(f"{self.prefix}: checkpoint tensor of shape {tuple(loaded.shape)} "
                                 f"does not fit parameter of shape {tuple(param.shape)}")
            param.data.copy_(loaded)
            return
        pack = getattr(param, "output_pack", 1)
        offset = sum(self.output_sizes[:shard_id]) // pack
        size = self.output_sizes[shard_id] // pack
        target = param.data.narrow(output_dim, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"{self.prefix} shard {shard_id}: checkpoint tensor of shape "
                             f"{tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)

    def rank_part(self, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: int | None) -> torch.Tensor:
        """The part of a checkpoint tensor (one piece, or the whole layer) this rank holds."""
        if self.parallel == "row":
            dim, pack = getattr(param, "input_dim", None), getattr(param, "input_pack", 1)
            full, start, size = self.full_input_size, self.input_start, self.input_size
        elif self.parallel == "column":
            if shard_id is None and len(self.output_sizes) > 1:
                raise ValueError(f"{self.prefix}: a fused column-parallel layer loads its "
                                 "pieces one by one (shard_id), not as one tensor")
            piece = shard_id or 0
            dim, pack = getattr(param, "output_dim", None), getattr(param, "output_pack", 1)
            full = self.full_output_sizes[piece]
            start, size = self.output_starts[piece], self.output_sizes[piece]
        else:
            return loaded
        if dim is None:         # e.g. a row layer's bias: every rank holds all of it
            return loaded
        if loaded.shape[dim] != full // pack:
            raise ValueError(f"{self.prefix}: checkpoint tensor of shape {tuple(loaded.shape)} "
                             f"has {loaded.shape[dim]} rows along dim {dim}; expected "
                             f"{full // pack}")
        if start % pack or size % pack:
            raise ValueError(f"{self.prefix}: this rank's part [{start}, {start + size}) of "
                             f"{full} does not fall on whole elements of {pack} along dim {dim}")
        return loaded.narrow(dim, start // pack, size // pack)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, "
                f"method={type(self.linear_method).__name__}, parallel={self.parallel}")


def _split(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} ({size}) must be a multiple of tensor_parallel_size "
                         f"({parts})")
    return size // parts


def _column_parts(sizes: list[int], replicas: list[int], prefix: str
                  ) -> tuple[list[int], list[int]]:
    """(this rank's size of each output piece, its start in the full piece)."""
    size, rank = get_tp_size(), get_tp_rank()
    local, starts = [], []
    for i, (full, shared_by) in enumerate(zip(sizes, replicas, strict=True)):
        if size % shared_by:
            raise ValueError(f"{prefix}: output piece {i} is shared by {shared_by} ranks, which "
                             f"must divide tensor_parallel_size ({size})")
        part = _split(full, size // shared_by, f"{prefix} output piece {i}")
        local.append(part)
        starts.append(rank // shared_by * part)
    return local, starts
