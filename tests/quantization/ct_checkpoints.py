"""compressed-tensors checkpoints of a tiny HF model, written by the compressed-tensors library
itself (llm-compressor's format: RedHatAI's / neuralmagic's W4A16, W8A16, FP8 models).

The library's own pieces do the work: `calculate_qparams` picks each scale and zero point from
the weight's min / max (what llm-compressor's min-max observer feeds it), the format's
compressor (`PackedQuantizationCompressor`, `FloatQuantizationCompressor`) quantizes and packs,
its `decompress` gives the dequantized weight HF transformers loads as the reference, and
`QuantizationConfig` writes config.json's quantization_config. Only act-order by group
(`actorder: group`, a `weight_g_idx` a layer), which the library dropped in 2026 but older
checkpoints carry, is laid out here, from the library's packer and the published layout.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from quantization.checkpoints import PROJECTIONS, SAME_INPUT, read_tensors, write_pair


def scheme(weights, input_activations=None, targets=("Linear",)):
    """A QuantizationScheme of weights / input_activations (dicts of QuantizationArgs fields,
    or the library's QuantizationArgs as its presets hold them)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def args(a):
        return a if a is None or isinstance(a, QuantizationArgs) else QuantizationArgs(**a)
    return QuantizationScheme(targets=list(targets), weights=args(weights),
                              input_activations=args(input_activations))


def fp4_preset(name: str) -> tuple:
    """(weights, input_activations) of the library's NVFP4A16 / NVFP4 / MXFP4A16 / MXFP4
    presets (their scale dtypes set: e4m3 for NVFP4, e8m0 bytes for MXFP4)."""
    from compressed_tensors.quantization import quant_scheme
    preset = getattr(quant_scheme, name)
    return preset["weights"], preset.get("input_activations")


# named as llm-compressor's preset schemes
W4A16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
W4A16_ASYM = {**W4A16, "symmetric": False}
W8A16 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
FP8_DYNAMIC_ACTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                    "dynamic": True}
FP8_STATIC_ACTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                   "dynamic": False}
# W8A8 int8 (int-quantized): int8 weights a scale a row, int8 activations (dynamic per token)
INT8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
INT8_DYNAMIC_ACTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                     "dynamic": True}
INT8_STATIC_ACTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                    "dynamic": False}


def _qparams(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) of w [N, K] for args' strategy, from its min / max."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    n, k = w.shape
    if args.strategy in ("group", "tensor_group"):
        tiles = w.reshape(n, k // args.group_size, args.group_size)
        lo, hi = tiles.amin(-1), tiles.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        tiles = w.reshape(n // bn, bn, k // bk, bk)
        lo, hi = tiles.amin((1, 3)), tiles.amax((1, 3))
    else:   # tensor
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    return calculate_qparams(lo, hi, args, _global_scale(w, args))


def _global_scale(w: torch.Tensor, args) -> torch.Tensor | None:
    """NVFP4's scale of the group scales (tensor_group), from the weight's min / max."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam
    return generate_gparam(w.amin(), w.amax()) if args.strategy == "tensor_group" else None


def _act_order_tensors(w: torch.Tensor, args, seed: int) -> dict[str, torch.Tensor]:
    """A layer quantized with `actorder: group`: groups formed by a shuffle of the inputs, a
    `weight_g_idx` [K] naming each input's group; scales [N, G]; packed by the library."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    n, k = w.shape
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // args.group_size
    grouped = w[:, order].reshape(n, k // args.group_size, args.group_size)
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    lo, hi = -(1 << (args.num_bits - 1)), (1 << (args.num_bits - 1)) - 1
    q = torch.clamp(torch.round(w / scale[:, g_idx]) + zero[:, g_idx], lo, hi).to(torch.int8)
    out = {"weight_packed": pack_to_int32(q, args.num_bits), "weight_scale": scale,
           "weight_shape": torch.tensor([n, k]), "weight_g_idx": g_idx.to(torch.int32)}
    if not args.symmetric:
        out["weight_zero_point"] = pack_to_int32(zero.to(torch.int8), args.num_bits, packed_dim=0)
    out["dequantized"] = (q.float() - zero[:, g_idx].float()) * scale[:, g_idx].float()
    return out


def format_of(s) -> str:
    """The storage format the library gives a scheme's weights."""
    if s.weights.type == "float" and s.weights.num_bits == 4:
        return "nvfp4-pack-quantized" if s.weights.group_size == 16 else "mxfp4-pack-quantized"
    if s.weights.type == "float":
        return "float-quantized"
    acts = s.input_activations
    return "int-quantized" if acts is not None and acts.type == "int" else "pack-quantized"


def compress_weight(w: torch.Tensor, s, act_order: bool = False, seed: int = 0
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the checkpoint tensors of one projection w [N, K] under scheme s, its dequantized
    weight in fp32)."""
    from compressed_tensors.compressors import BaseCompressor
    if act_order:
        out = _act_order_tensors(w, s.weights, seed)
        return out, out.pop("dequantized")
    scale, zero = _qparams(w, s.weights)
    compressor = BaseCompressor.get_value_from_registry(format_of(s))
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    global_scale = _global_scale(w, s.weights)
    if global_scale is not None:
        state["weight_global_scale"] = global_scale
    out = compressor.compress(state, s)
    if s.weights.num_bits == 4 and s.weights.type == "float":
        # FP4: the library's decompress rounds the weight to bf16; its own unpacking and
        # dequantization in fp32 instead
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization.lifecycle.forward import dequantize
        n, half = out["weight_packed"].shape
        q = unpack_fp4_from_uint8(out["weight_packed"], n, 2 * half, dtype=torch.float32)
        return out, dequantize(x_q=q, scale=compressor._decompress_scale(out["weight_scale"],
                                                                          torch.float32),
                               args=s.weights, global_scale=out.get("weight_global_scale"),
                               dtype=torch.float32)
    # decompressed with the scales widened to fp32: the library's own dequantization returns
    # the scales' dtype (bf16 would round the products kvfleet keeps exact)
    state = {**out, "weight_scale": out["weight_scale"].float()}
    return out, compressor.decompress(state, s)["weight"].float()


def quantization_config(groups: dict, ignore: tuple[str, ...] = ("lm_head",),
                        act_order: bool = False) -> dict:
    """config.json's quantization_config, as the library writes it."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    fmt = {name: format_of(s) for name, s in groups.items()}
    formats = set(fmt.values())
    qc = QuantizationConfig(config_groups=groups, ignore=list(ignore),
                            format=formats.pop() if len(formats) == 1 else "mixed-precision",
                            quantization_status=QuantizationStatus.COMPRESSED)
    raw = json.loads(json.dumps(qc.model_dump(exclude_none=False), default=str))
    if qc.format == "mixed-precision":
        for name, g in raw["config_groups"].items():
            g["format"] = fmt[name]
    if act_order:
        for g in raw["config_groups"].values():
            g["weights"]["actorder"] = "group"
    return raw


def write_compressed(src: Path, dst: Path, reference: Path, weights: dict | None,
                     input_activations: dict | None = None, ignore: tuple[str, ...] = ("lm_head",),
                     act_order: bool = False, dtype: torch.dtype = torch.float32,
                     groups: dict | None = None) -> dict:
    """Quantize src's projections into a compressed-tensors checkpoint dst; write the
    dequantized weights (fp32; everything else unchanged) to `reference`. `groups` (name ->
    QuantizationScheme) replaces the one group of `weights` / `input_activations` (mixed
    schemes). Returns the quantization_config written."""
    from compressed_tensors.utils import match_name
    groups = groups or {"group_0": scheme(weights, input_activations)}
    tensors = read_tensors(src)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        parts = module.split(".")
        chosen = next((g for g, s in groups.items()
                       if any(t == "Linear" or match_name(module, t) for t in s.targets)), None)
        if not (name.endswith(".weight") and parts[-1] in PROJECTIONS) or chosen is None or any(
                match_name(module, i) for i in ignore):
            quantized[name] = dequantized[name] = w
            continue
        s = groups[chosen]
        parent, _, proj = module.rpartition(".")
        seed = zlib.crc32(f"{parent}.{SAME_INPUT.get(proj, proj)}".encode())
        out, dequantized[name] = compress_weight(w.to(dtype), s, act_order, seed)
        acts = s.input_activations
        if acts is not None and acts.type == "float" and acts.num_bits == 4:
            # NVFP4 / MXFP4 W4A4: a calibrated global scale of the activations' group scales
            out["input_global_scale"] = torch.tensor([3000.0])
        elif s.input_activations is not None and not s.input_activations.dynamic:
            # a static activation scale, as calibration would leave it
            out["input_scale"] = torch.tensor([0.05], dtype=dtype)
            if s.input_activations.type == "int":
                out["input_zero_point"] = torch.tensor([0], dtype=torch.int8)
        quantized.update({f"{module}.{k}": v for k, v in out.items()})
    raw = quantization_config(groups, ignore, act_order)
    write_pair(src, dst, reference, quantized, dequantized, raw)
    return raw
