"""compressed-tensors checkpoints (llm-compressor's format: RedHatAI's and neuralmagic's
W4A16 / W8A16 / W8A8 / FP8 models), read as they are stored.

config.json's quantization_config (`quant_method: compressed-tensors`) holds `config_groups`,
each a scheme (`weights`, `input_activations`) and the `targets` it applies to ("Linear": every
linear layer; "re:<regex>": module names the regex matches from their start; else one module
name), `ignore` (same matching; usually lm_head), and the storage `format` (one for all, or a
group's own). Formats read:

  pack-quantized   integer weights of `num_bits` 4 or 8, `strategy` group or channel, symmetric
                   or not, activations unquantized (W4A16, W8A16 and their _ASYM presets):
      weight_packed      [N, K * bits / 32] int32, packed along the inputs, value j of a word at
                         bits [j*bits, (j+1)*bits), stored q + 2**(bits-1) (q signed)
      weight_scale       [N, G] (G = K / group_size; 1 per channel)
      weight_zero_point  [N * bits / 32, G] int32, packed along the outputs, the same offset
                         (asymmetric schemes only; symmetric ones mean zero 2**(bits-1))
      weight_g_idx       [K] group of each input (`actorder: group`, older checkpoints)
      weight_shape       [2]: N, K
    w[n, k] = (stored_q[n, k] - stored_zero[n, g]) * scale[n, g], g = g_idx[k]: the GPTQ / AWQ
    integer weight of int_weight.py, so the same W4A16 kernels (or the dequantized fallback).
  int-quantized    (alias naive-quantized) W8A8 int8: `weight` [N, K] int8, `weight_scale` and
                   (asymmetric) `weight_zero_point` a row ([N, 1]) or a tensor ([1]). Symmetric
                   weights and activations on a GPU: W8A8, the weight kept int8 [N, K] and the
                   activations quantized per token at run time (kvfleet_kernels.int8: the
                   integer tensor cores, a Triton GEMM), as vLLM's dynamic W8A8; a static
                   `input_scale` is read past (per-token scales instead, as for FP8), batch 1
                   runs the W8A16 GEMV on the unquantized activation (as FP8 weights do).
                   Otherwise (asymmetric, or no GPU) the same integer weight as GPTQ's (q + 128,
                   8 bits, one group) on the 8-bit integer kernels or dequantized, the
                   activations unquantized (W8A16), logged once.
  float-quantized  fp8-e4m3 weights (`strategy` tensor, channel or block): `weight` [N, K] and
                   `weight_scale` ([1], [N, 1], or [N / bn, K / bk] for `block_structure`
                   [bn, bk]); the FP8 method of fp8.py. Activations: dynamic per token (the
                   FP8_DYNAMIC preset) as our FP8 GEMM does; a static per-tensor `input_scale`
                   (the FP8 preset) or none (weight-only FP8) is served with per-token scales
                   too, logged once: per-token scales are at least as close to the unquantized
                   activations as one calibrated scale.

A `kv_cache_scheme` (FP8, symmetric, per tensor or per head) gives each layer calibrated
scales (self_attn.k_scale / v_scale, loader.KVScales): an fp8 KV cache (`--kv-cache-dtype fp8`)
holds K / k_scale and V / v_scale; per-head scales serve as their layer's largest. A checkpoint
may quantize the KV cache only (no config_groups: every Linear unquantized).

  nvfp4-pack-quantized / mxfp4-pack-quantized   FP4 (e2m1) weights, two a byte, a scale a 16
                   (NVFP4: e4m3, over a global scale a checkpoint piece) or 32 inputs (MXFP4:
                   e8m0): each value doubled into an 8-bit integer (-12..12) with half the
                   group's scale, so the 8-bit integer kernels serve them at a byte a weight
                   (unpack_fp4; Hopper has no FP4 tensor cores); W4A4's FP4 activations left
                   unquantized.

Refused with the field named: other formats (sparsity, mxfp6, mxfp8, marlin-24), integer
activations on packed weights (W4A8), a fused layer (qkv, gate/up) whose shards fall under
different schemes. Mixtures of experts' experts (models/moe.py) take one scheme for all: integer
ones stay packed (layers.moe's IntExperts; act-order ones dequantized), FP8 ones are
dequantized as they load and rounded a row at a time as `--quantization fp8` rounds them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial

import torch
from kvfleet_kernels.int8 import int8_gemm, int8_linear, int8_supported
from torch import nn

from kvfleet_runtime.layers.linear import Linear, LinearMethod, set_weight_attrs
from kvfleet_runtime.layers.quantization.base import (
    NEVER_QUANTIZED,
    QuantConfig,
    log_once,
    read_choice,
    shard_prefixes,
)
from kvfleet_runtime.layers.quantization.fp8 import (
    FP8LinearMethod,
    Int8Activation,
    batch_one_fp8_gemv,
    load_row_scale,
)
from kvfleet_runtime.layers.quantization.gptq import load_g_idx
from kvfleet_runtime.layers.quantization.int_weight import (
    IntWeight,
    IntWeightMethod,
    check_divisible,
    default_g_idx,
    split_groups,
)
from kvfleet_runtime.layers.quantization.packing import unpack_int32

NAME = "compressed-tensors"
# FP4 (e2m1) weights: NVFP4 (a scale a 16 inputs in e4m3, divided by a global scale a
# checkpoint piece) and MXFP4 (a power-of-two scale a 32 inputs, e8m0 bytes)
FP4_FORMATS = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized",
           *FP4_FORMATS)


def _where(key: str) -> str:
    return f"{NAME} quantization_config.{key}"


@dataclass(frozen=True)
class Scheme:
    """One config group's weights, as kvfleet runs them."""
    format: str                    # pack-quantized | int-quantized | float-quantized
    bits: int                      # 4 / 8 (int), 8 (fp8)
    strategy: str                  # group / channel (int); tensor / channel / block (fp8)
    group_size: int = -1           # int group strategy; -1: one group (channel)
    symmetric: bool = True
    act_order: bool = False        # actorder "group": weight_g_idx shuffles the groups
    block: tuple[int, int] | None = None      # fp8 block_structure
    static_input_scale: bool = False          # a calibrated input_scale (fp8, int8)
    # int8 activations (W8A8; int-quantized only) and whether they are symmetric
    int8_activations: bool = False
    symmetric_activations: bool = True
    fp4_activations: bool = False             # W4A4 FP4 schemes: served unquantized


def _args(raw: object, key: str) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{_where(key)} must be an object; got {raw!r}")
    return raw


def _pick(raw: dict, key: str, where: str, allowed: tuple, default: object = None) -> object:
    return read_choice(raw, (key,), default, allowed, NAME, where + ".")


def _activations(acts: object, where: str, kind: str) -> bool:
    """Checks a scheme's input_activations of `kind` (int / float), 8 bits, dynamic per token
    or static per tensor; whether they are static (a calibrated input_scale)."""
    key = where + ".input_activations"
    a = _args(acts, key)
    _pick(a, "type", key, (kind,))
    _pick(a, "num_bits", key, (8,))
    static = a.get("dynamic", False) is False
    _pick(a, "strategy", key, ("tensor",) if static else ("token",))
    return static


def _kv_cache_scheme(raw: object) -> None:
    """The KV cache's scheme must be what the fp8 cache holds: e4m3 (float, 8 bits), symmetric,
    one scale per layer (tensor) or per kv head (attn_head)."""
    key = "kv_cache_scheme"
    a = _args(raw, key)
    _pick(a, "type", key, ("float",))
    _pick(a, "num_bits", key, (8,))
    _pick(a, "strategy", key, ("tensor", "attn_head"))
    _pick(a, "symmetric", key, (True,), True)
    if a.get("dynamic", False) is not False:
        raise ValueError(f"{_where(key)}.dynamic must be false (calibrated scales); got "
                         f"{a.get('dynamic')!r}")


def parse_scheme(group: dict, name: str, default_format: str | None) -> Scheme:
    """A config group -> Scheme, or an error naming the field kvfleet does not serve."""
    where = f"config_groups.{name}"
    fmt = group.get("format") or default_format
    if fmt not in FORMATS:
        raise ValueError(f"{_where(where + '.format')} (or the top-level format) must be one of "
                         f"{', '.join(FORMATS)} (W4A16 / W8A16 / W8A8 integer weights, FP8 "
                         "weights, NVFP4 / MXFP4 weights); "
                         f"got {fmt!r}")
    if group.get("output_activations") is not None:
        raise ValueError(f"{_where(where + '.output_activations')} must be null: quantized "
                         "outputs are not served")
    w = _args(group.get("weights"), where + ".weights")
    acts = group.get("input_activations")
    wkey = where + ".weights"
    if w.get("dynamic", False) not in (False, None):
        raise ValueError(f"{_where(wkey)}.dynamic must be false (weights are stored quantized)")
    if fmt in ("int-quantized", "naive-quantized"):
        # W8A8 int8 (RedHatAI's *.w8a8): int8 weights a row (or a tensor) a scale, served as
        # W8A16: the activations stay unquantized
        _pick(w, "type", wkey, ("int",))
        _pick(w, "num_bits", wkey, (8,))
        strategy = _pick(w, "strategy", wkey, ("channel", "tensor"))
        static = acts is not None and _activations(acts, where, "int")
        return Scheme("int-quantized", 8, strategy,
                      symmetric=_pick(w, "symmetric", wkey, (True, False), True),
                      static_input_scale=static, int8_activations=acts is not None,
                      symmetric_activations=acts is None or _pick(
                          acts, "symmetric", where + ".input_activations", (True, False), True))
    if fmt == "pack-quantized":
        if acts is not None:
            raise ValueError(f"{_where(where + '.input_activations')} must be null for "
                             "pack-quantized weights (W4A16 / W8A16); integer activations "
                             "(W8A8, W4A8) are not served")
        _pick(w, "type", wkey, ("int",))
        bits = _pick(w, "num_bits", wkey, (4, 8))
        strategy = _pick(w, "strategy", wkey, ("group", "channel"))
        group_size = -1
        if strategy == "group":
            group_size = w.get("group_size")
            if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
                raise ValueError(f"{_where(wkey)}.group_size must be a positive integer for "
                                 f"strategy group; got {group_size!r}")
        actorder = _pick(w, "actorder", wkey, (None, False, "group", "weight", "static"))
        return Scheme(fmt, bits, strategy, group_size,
                      symmetric=_pick(w, "symmetric", wkey, (True, False), True),
                      act_order=actorder == "group")
    if fmt in FP4_FORMATS:
        _pick(w, "type", wkey, ("float",))
        _pick(w, "num_bits", wkey, (4,))
        _pick(w, "symmetric", wkey, (True,), True)
        nvfp4 = fmt.startswith("nvfp4")
        strategy = _pick(w, "strategy", wkey, ("tensor_group",) if nvfp4 else ("group",))
        group_size = _pick(w, "group_size", wkey, (FP4_FORMATS[fmt],))
        if acts is not None:
            a = _args(acts, where + ".input_activations")
            _pick(a, "type", where + ".input_activations", ("float",))
            _pick(a, "num_bits", where + ".input_activations", (4,))
        return Scheme(fmt, 4, strategy, group_size, fp4_activations=acts is not None)
    _pick(w, "type", wkey, ("float",))
    _pick(w, "num_bits", wkey, (8,))
    _pick(w, "symmetric", wkey, (True,), True)
    strategy = _pick(w, "strategy", wkey, ("tensor", "channel", "block"))
    block = None
    if strategy == "block":
        block = w.get("block_structure")
        if not isinstance(block, list) or len(block) != 2 or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise ValueError(f"{_where(wkey)}.block_structure must be two positive integers "
                             f"[rows, columns] for strategy block; got {block!r}")
        block = tuple(block)
    static = acts is not None and _activations(acts, where, "float")
    return Scheme(fmt, 8, strategy, block=block, static_input_scale=static)


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' matching of a target against a checkpoint module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


@dataclass
class CompressedTensorsConfig(QuantConfig):
    groups: list[tuple[str, list[str], Scheme]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    # a mixture of experts' experts' scheme (set by models/moe.py before its layers are built)
    expert_scheme: Scheme | None = None

    name = NAME

    @classmethod
    def from_config(cls, raw: dict) -> CompressedTensorsConfig:
        status = raw.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"{_where('quantization_status')} must be compressed (the weights "
                             f"stored quantized); got {status!r}")
        for key, what in (("transform_config", "rotated (transformed) weights"),
                          ("moe_sparsity_config", "pruned or replaced experts")):
            if raw.get(key):
                raise ValueError(f"{_where(key)} must be null: {what} are not served")
        sparsity = raw.get("sparsity_config")
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise ValueError(f"{_where('sparsity_config')}: sparse checkpoints are not served; "
                             f"got format {sparsity.get('format')!r}")
        kv_cache = raw.get("kv_cache_scheme")
        if kv_cache is not None:
            _kv_cache_scheme(kv_cache)
        config_groups = raw.get("config_groups")
        if not (isinstance(config_groups, dict) and config_groups
                or kv_cache is not None and not config_groups):
            raise ValueError(f"{_where('config_groups')} must name at least one group (or a "
                             f"kv_cache_scheme be given); got {config_groups!r}")
        top = raw.get("format")
        top = None if top in (None, "mixed-precision") else top
        groups = []
        for name, group in (config_groups or {}).items():
            group = _args(group, f"config_groups.{name}")
            targets = group.get("targets")
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise ValueError(f"{_where(f'config_groups.{name}.targets')} must be a list of "
                                 f"names; got {targets!r}")
            groups.append((name, targets, parse_scheme(group, name, top)))
        ignore = raw.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise ValueError(f"{_where('ignore')} must be a list of module names; got {ignore!r}")
        return cls(groups=groups, ignore=ignore)

    def scheme_of_module(self, module: str) -> Scheme | None:
        """The scheme of one checkpoint module (None: left unquantized)."""
        if any(_matches(module, i) for i in self.ignore):
            return None
        for _, targets, scheme in self.groups:
            # "Linear" is a class name: every projection kvfleet asks about is one
            if any(t == "Linear" or _matches(module, t) for t in targets):
                return scheme
        return None

    def scheme_of(self, prefix: str) -> Scheme | None:
        """The scheme of the Linear at `prefix`; its shards must agree."""
        schemes = {s: self.scheme_of_module(s) for s in shard_prefixes(prefix)}
        if len(set(schemes.values())) > 1:
            raise ValueError(f"{NAME}: the shards of the fused layer {prefix} fall under "
                             f"different schemes ({', '.join(f'{s}: {v}' for s, v in schemes.items())}); "
                             "they must be quantized alike")
        return next(iter(schemes.values()))

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        if prefix.rpartition(".")[2] in NEVER_QUANTIZED:
            log_once(f"{NAME}: {prefix} stays unquantized (lm_head is never quantized)")
            return None
        scheme = self.scheme_of(prefix)
        if scheme is None:
            log_once(f"{NAME}: {prefix} stays unquantized (ignored or matched by no config "
                     "group), in the model's dtype")
            return None
        if scheme.format == "pack-quantized":
            return CTIntLinearMethod(scheme)
        if scheme.format == "int-quantized":
            return CTInt8LinearMethod(scheme)
        if scheme.format in FP4_FORMATS:
            return CTFP4LinearMethod(scheme)
        return CTFP8LinearMethod(scheme)


def _check_shape(layer: Linear, param: torch.Tensor, loaded: torch.Tensor,
                 shard_id: int | None) -> None:
    """weight_shape [N, K] of a checkpoint piece: the piece's (or, where the checkpoint stores
    the layer fused, as Phi-3 does, the whole layer's) outputs and inputs."""
    piece = shard_id or 0
    k = layer.full_input_size
    expected = [[sum(layer.full_output_sizes), k]]
    if shard_id is not None:
        expected.append([layer.full_output_sizes[piece], k])
    got = loaded.reshape(-1).tolist()
    if got not in expected:
        raise ValueError(f"{layer.prefix}: checkpoint weight_shape {got} of piece {piece} "
                         f"is not the layer's {expected[-1]}")
    param.is_loaded = True


class CTIntLinearMethod(IntWeightMethod):
    """pack-quantized weights, unpacked into IntWeight and served like GPTQ's."""
    name = NAME

    def __init__(self, scheme: Scheme) -> None:
        super().__init__(scheme.bits, scheme.group_size)
        self.scheme = scheme

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        per_word = 32 // self.bits
        check_divisible(layer, "input size", input_size, per_word, self.name)
        if not self.scheme.symmetric:
            for size in output_sizes:
                check_divisible(layer, "output size", size, per_word, self.name)
        split = split_groups(layer, self.group_size, self.scheme.act_order, self.name)
        # the group tensors keep their groups along dim 1: a row-parallel rank cuts them there
        groups = {**split.attrs, "input_dim": 1} if split.attrs else {}
        n, g = sum(output_sizes), split.num_groups
        g_idx = default_g_idx(input_size, self.group_size, layer.input_start) - split.first_group
        params = {
            "weight_packed": (torch.empty(n, input_size // per_word, dtype=torch.int32),
                              {"output_dim": 0, "input_dim": 1, "input_pack": per_word}),
            "weight_scale": (torch.empty(n, g, dtype=torch.float32), {"output_dim": 0, **groups}),
            "weight_shape": (torch.zeros(2, dtype=torch.int64),
                             {"weight_loader": partial(_check_shape, layer)}),
        }
        if not self.scheme.symmetric:
            params["weight_zero_point"] = (
                torch.empty(n // per_word, g, dtype=torch.int32),
                {"output_dim": 0, "output_pack": per_word, **groups})
        # as GPTQ's g_idx: the plain grouping unless the checkpoint has one (actorder group)
        params["weight_g_idx"] = (g_idx, {"input_dim": 0, "optional": True,
                                          "weight_loader": partial(load_g_idx, layer, split)})
        self.checkpoint_params = tuple(register_params(layer, params, self.scheme))   # finalize's

    def unpack(self, layer: Linear) -> IntWeight:
        return unpack_ct(layer.weight_packed, layer.weight_scale,
                         getattr(layer, "weight_zero_point", None), layer.weight_g_idx, self.bits)


def unpack_ct(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
              g_idx: torch.Tensor, bits: int) -> IntWeight:
    """pack-quantized tensors of one projection (weight_packed [N, K / P], weight_scale [N, G],
    weight_zero_point [N / P, G] or None: symmetric) -> IntWeight."""
    q = unpack_int32(packed, bits, dim=1).t()                                   # [K, N]
    if zero_point is None:
        zeros = torch.full_like(scale, 1 << (bits - 1), dtype=torch.float32).t()
    else:
        zeros = unpack_int32(zero_point, bits, dim=0).t().float()
    scales = scale.t()
    if not torch.equal(scales.to(torch.float16).float(), scales.float()):
        log_once(f"{NAME}: scales that fp16 does not hold exactly are rounded to fp16 for "
                 "the W4A16 kernels (the CPU path keeps them exact)")
    return IntWeight(q=q.contiguous(), zeros=zeros.contiguous(), scales=scales.contiguous(),
                     g_idx=g_idx.to(q.device), bits=bits)


def unpack_ct_int8(weight: torch.Tensor, scale: torch.Tensor,
                   zero_point: torch.Tensor | None) -> IntWeight:
    """int-quantized tensors of one projection (weight int8 [N, K], a scale and a zero point
    [N] a row) -> IntWeight (unsigned: q + 128, zero + 128)."""
    n = weight.shape[0]
    q = (weight.to(torch.int32) + 128).t()                                       # [K, N]
    scale = scale.float().reshape(-1).expand(n).reshape(1, n)     # (one a tensor: every row)
    zeros = torch.full_like(scale, 128)
    if zero_point is not None:
        zeros = zeros + zero_point.float().reshape(-1).expand(n).reshape(1, n)
    return IntWeight(q=q.contiguous(), zeros=zeros, scales=scale.contiguous(),
                     g_idx=torch.zeros(q.shape[0], dtype=torch.int32, device=q.device), bits=8)


class CTInt8LinearMethod(IntWeightMethod):
    """int-quantized int8 weights (W8A8 checkpoints): on a GPU, symmetric weights and
    activations run W8A8 (kvfleet_kernels.int8, the activations quantized per token);
    otherwise unpacked into IntWeight: the 8-bit integer kernels, the activations unquantized."""
    name = NAME

    def __init__(self, scheme: Scheme) -> None:
        super().__init__(8, -1)
        self.scheme = scheme

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        check_divisible(layer, "input size", input_size, 4, self.name)
        n = sum(output_sizes)
        rows = partial(load_row_scale, layer)
        params = {"weight": (torch.empty(n, input_size, dtype=torch.int8),
                             {"output_dim": 0, "input_dim": 1}),
                  "weight_scale": (torch.empty(n, dtype=torch.float32),
                                   {"output_dim": 0, "weight_loader": rows})}
        if not self.scheme.symmetric:
            params["weight_zero_point"] = (torch.empty(n, dtype=torch.int8),
                                           {"output_dim": 0, "weight_loader": rows})
        self.checkpoint_params = tuple(register_params(layer, params, self.scheme))

    def unpack(self, layer: Linear) -> IntWeight:
        return unpack_ct_int8(layer.weight.data, layer.weight_scale.data,
                              getattr(layer, "weight_zero_point", None))

    def process_weights_after_loading(self, layer: Linear) -> None:
        s = self.scheme
        n, k = layer.weight.shape
        layer.uses_int8 = (s.int8_activations and s.symmetric and s.symmetric_activations
                           and int8_supported(layer.weight.device) and n % 8 == 0 and k % 8 == 0)
        # the norm or activation in front (feeds_fp8) quantizes the input inside its kernel
        for producer in getattr(layer, "fp8_input_producers", ()):
            producer.int8_out = layer.uses_int8
        if layer.uses_int8:
            # the checkpoint's int8 [N, K] and fp32 [N] scales are the kernels' operands as stored
            layer.uses_kernel = False
            log_once(f"{NAME}: W8A8 int8 layers quantize their activations per token (the "
                     "integer tensor cores); batch 1 runs the W8A16 GEMV")
            return
        if s.int8_activations:
            why = ("no GPU" if not int8_supported(layer.weight.device) else
                   "asymmetric weights or activations" if not (s.symmetric and
                                                               s.symmetric_activations)
                   else "dimensions not multiples of 8")
            log_once(f"{NAME}: W8A8 int8 layers are served as W8A16 ({why}): the int8 weights "
                     "on the integer kernels or dequantized, the activations unquantized")
        super().process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor | Int8Activation,
              bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Int8Activation):     # only a producer with int8_out, so uses_int8
            return int8_gemm(x.q, x.scale, layer.weight, layer.weight_scale, bias, x.dtype)
        if not layer.uses_int8:
            return super().apply(layer, x, bias)
        if batch_one_fp8_gemv(x):
            # batch 1: the weight-bound GEMV, x unquantized (as FP8 weights; KVFLEET_TRITON_GEMV=0:
            # off)
            from kvfleet_kernels.gemv import gemv
            return gemv(x, layer.weight, bias, scale=layer.weight_scale)
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


def read_past(message: str):
    """The weight loader of a checkpoint tensor kvfleet does not apply (a static activation
    scale or zero point): logs `message` once and counts the tensor as loaded."""
    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None) -> None:
        log_once(message)
        param.is_loaded = True
    return load


_read_past = read_past(f"{NAME}: the checkpoint's static activation scales (input_scale) are "
                       "not used: activations are scaled per token at run time (FP8, W8A8 int8 "
                       "on a GPU) or stay unquantized (W8A16)")


def register_params(layer: Linear, params: dict[str, tuple[torch.Tensor, dict]],
                    scheme: Scheme | None = None) -> dict[str, tuple[torch.Tensor, dict]]:
    """Registers `params` (name -> (tensor, weight attrs)) on the layer, with the optional
    static activation scales a scheme's checkpoint carries (read past); returns them all."""
    if scheme is not None and scheme.static_input_scale:
        params = {**params, "input_scale": (torch.ones(1), {"optional": True,
                                                            "weight_loader": _read_past})}
        if scheme.format == "int-quantized":
            params["input_zero_point"] = (torch.zeros(1), {"optional": True,
                                                           "weight_loader": _read_past})
    for name, (tensor, attrs) in params.items():
        param = nn.Parameter(tensor, requires_grad=False)
        set_weight_attrs(param, **attrs)
        layer.register_parameter(name, param)
    return params


class CTFP8LinearMethod(FP8LinearMethod):
    """float-quantized weights on the FP8 method; a block scale arrives as `weight_scale`."""

    def __init__(self, scheme: Scheme) -> None:
        super().__init__(serialized=True, block=scheme.block)
        self.scheme = scheme

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_sizes, dtype)
        if self.block is not None:
            # the block scales under the checkpoint's name; the per-channel scale the
            # FP8 method derives from them stays a buffer until then
            blocks, channel = layer.weight_scale_inv, layer.weight_scale
            del layer.weight_scale_inv
            del layer.weight_scale
            layer.register_parameter("weight_scale", blocks)
            layer.ct_channel_scale = channel
        register_params(layer, {}, self.scheme)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if hasattr(layer, "input_scale"):
            del layer.input_scale
        if self.block is not None:
            blocks = layer.weight_scale
            del layer.weight_scale
            layer.register_parameter("weight_scale_inv", blocks)
            layer.register_buffer("weight_scale", layer.ct_channel_scale, persistent=False)
            del layer.ct_channel_scale
        super().process_weights_after_loading(layer)


# e2m1's eight magnitudes doubled (integers), by the low three bits of a nibble (bit 3: sign)
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12)


def unpack_fp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
               group_size: int, scale_2: torch.Tensor | None = None) -> IntWeight:
    """FP4 tensors of one projection -> IntWeight: packed uint8 [N, K / 2] (value 2j in the low
    nibble, 2j + 1 in the high one), scale [N, K / group_size] (NVFP4: e4m3; MXFP4: e8m0
    bytes, 2 ** (byte - 127)), global_scale [N] or [1] (NVFP4's, each row its piece's; None for
    MXFP4; ModelOpt's NVFP4 gives scale_2 instead, [N] or [1], the inverse: scale * scale_2).
    w = e2m1 * (scale / global_scale), as the compressed-tensors library dequantizes,
    held as 8-bit integers: q = 2 * e2m1 + 128 (-12..12 shifted), zero 128, a group's scale
    (scale / global_scale) / 2, exactly the same products; so the 8-bit integer kernels serve
    FP4 weights at a byte a weight."""
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(1).long()   # [N, K]
    doubled = torch.tensor(E2M1_DOUBLED, dtype=torch.int32, device=packed.device)[nibbles & 7]
    q = (torch.where(nibbles >= 8, -doubled, doubled) + 128).t().contiguous()         # [K, N]
    if scale.dtype == torch.uint8:
        scale = torch.exp2(scale.float() - 127.0)
    scale = scale.float()
    if global_scale is not None:
        scale = scale / global_scale.float().reshape(-1, 1)
    if scale_2 is not None:
        scale = scale * scale_2.float().reshape(-1, 1)
    scales = (scale / 2).t().contiguous()                                             # [G, N]
    if not torch.equal(scales.to(torch.float16).float(), scales):
        log_once(f"{NAME}: FP4 group scales that fp16 does not hold exactly are rounded to "
                 "fp16 for the integer kernels (the CPU path keeps them exact)")
    return IntWeight(q=q, zeros=torch.full_like(scales, 128), scales=scales,
                     g_idx=default_g_idx(q.shape[0], group_size).to(q.device), bits=8)


class CTFP4LinearMethod(IntWeightMethod):
    """nvfp4- / mxfp4-pack-quantized weights (unpack_fp4): on a GPU the 8-bit integer kernels
    (no FP4 tensor cores on Hopper; a byte a weight), dequantized on a CPU; FP4 activations
    (W4A4) are left unquantized."""
    name = NAME

    def __init__(self, scheme: Scheme) -> None:
        super().__init__(8, scheme.group_size)
        self.scheme = scheme

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        s = self.scheme
        nvfp4 = s.format.startswith("nvfp4")
        params = fp4_params(layer, input_size, output_sizes, s.group_size, NAME,
                            "weight_packed", torch.float8_e4m3fn if nvfp4 else torch.uint8,
                            "weight_global_scale" if nvfp4 else None)
        if s.fp4_activations:
            params["input_global_scale"] = (torch.ones(1), {"optional": True,
                                                             "weight_loader": _read_past_fp4})
        self.checkpoint_params = tuple(register_params(layer, params, s))

    def unpack(self, layer: Linear) -> IntWeight:
        global_scale = getattr(layer, "weight_global_scale", None)
        return unpack_fp4(layer.weight_packed.data, layer.weight_scale.data,
                          None if global_scale is None else global_scale.data,
                          self.scheme.group_size)


def fp4_params(layer: Linear, input_size: int, output_sizes: list[int], group_size: int,
               method: str, packed: str, scale_dtype: torch.dtype,
               global_scale: str | None) -> dict[str, tuple[torch.Tensor, dict]]:
    """An FP4 projection's checkpoint tensors (for register_params): `packed` [N, K / 2] uint8,
    `weight_scale` [N, K / group_size] of scale_dtype (this rank's groups), and `global_scale`
    (None: none), one fp32 a checkpoint piece held a row each."""
    check_divisible(layer, "input size", input_size, group_size, method)
    split = split_groups(layer, group_size, False, method)
    groups = {**split.attrs, "input_dim": 1} if split.attrs else {}
    n = sum(output_sizes)
    params = {
        packed: (torch.empty(n, input_size // 2, dtype=torch.uint8),
                 {"output_dim": 0, "input_dim": 1, "input_pack": 2}),
        "weight_scale": (torch.empty(n, split.num_groups, dtype=scale_dtype),
                         {"output_dim": 0, **groups}),
    }
    if global_scale is not None:
        # one a checkpoint piece (q, k, v apart): each row gets its piece's
        params[global_scale] = (torch.empty(n, dtype=torch.float32),
                                {"output_dim": 0, "weight_loader": partial(load_row_scale, layer)})
    return params


_read_past_fp4 = read_past(f"{NAME}: FP4 activations (W4A4: input_global_scale) are not "
                           "applied: the activations stay unquantized")
