"""Quantized checkpoints of a tiny HF model, as GPTQ / AWQ / FP8 tools would write them.

No GPTQ/AWQ packer installs here (auto-gptq and autoawq need accelerate/peft/datasets and
pre-5 transformers, gptqmodel needs torch>=2.14), so the integers are chosen by plain
round-to-nearest below and packed by kvfleet's packer (pack_gptq / pack_awq), which
test_packing pins to hand-computed words. Beside each quantized folder goes a plain fp32
folder of the dequantized weights: what HF transformers loads as the reference.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from kvfleet_runtime.layers.quantization.awq import pack_awq
from kvfleet_runtime.layers.quantization.gptq import pack_gptq
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "qkv_proj", "gate_up_proj",      # (Phi-3's fused projections)
               "w1", "w2", "w3")                # (Mixtral's experts)
# projections that read the same input, hence get the same act-order from GPTQ
SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
              "up_proj": "gate_up", "w1": "w13", "w3": "w13"}
FP8_MAX = 448.0


@dataclass
class IntQuantized:
    """w[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]."""
    q: torch.Tensor        # [K, N] int64
    zeros: torch.Tensor    # [G, N] int64
    scales: torch.Tensor   # [G, N] fp16
    g_idx: torch.Tensor    # [K] int64

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32."""
        g = self.g_idx
        return ((self.q - self.zeros[g]).float() * self.scales.float()[g]).t().contiguous()


def quantize_int(w: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool,
                 min_zero: int = 0, seed: int = 0) -> IntQuantized:
    """Round-to-nearest quantization of w: [N, K]. act_order shuffles which rows form a group,
    as GPTQ's desc_act does; min_zero=1 keeps zero points storable in GPTQ v1."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    gs = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order \
        else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // gs
    num_groups = int(g_idx.max()) + 1
    wt = w.t().float()                                      # [K, N]
    scales = torch.empty(num_groups, n)
    zeros = torch.empty(num_groups, n, dtype=torch.int64)
    for g in range(num_groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        if sym:
            scales[g] = torch.maximum(-lo, hi).clamp(min=1e-8) * 2 / maxq
            zeros[g] = (maxq + 1) // 2
        else:
            scales[g] = (hi - lo).clamp(min=1e-8) / maxq
            zeros[g] = torch.round(-lo / scales[g]).long().clamp(min_zero, maxq)
    scales = scales.half()                                  # stored precision
    q = torch.round(wt / scales.float()[g_idx]) + zeros[g_idx]
    return IntQuantized(q.clamp(0, maxq).long(), zeros, scales, g_idx)


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], fp32 scale [N] or [])."""
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = amax.float().clamp(min=1e-12) / FP8_MAX
    w8 = (w.float() / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX)
    return w8.to(torch.float8_e4m3fn), scale


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], fp32 weight_scale_inv [N / bn, K / bk]): a scale a block, as
    Qwen3-*-FP8 and DeepSeek's checkpoints store them."""
    bn, bk = block
    n, k = w.shape
    tiles = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX        # [N/bn, K/bk]
    w8 = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(n, k)
    return w8.to(torch.float8_e4m3fn), scale


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "weight" and len(parts) > 1 and parts[-2] in PROJECTIONS


def write_quantized(src: Path, dst: Path, reference: Path, method: str, *, bits: int = 4,
                    group_size: int = 32, sym: bool = False, desc_act: bool = False,
                    per_channel: bool = True, not_convert: tuple[str, ...] = (),
                    block: tuple[int, int] | None = None) -> None:
    """Quantize src's projections into dst (method gptq, awq or fp8); write the dequantized
    fp32 weights (and everything else unchanged) to `reference`."""
    tensors = read_tensors(src)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        if not _is_projection(name) or any(p in module for p in not_convert):
            quantized[name] = dequantized[name] = w
            continue
        if method == "fp8" and block:
            w8, scale = quantize_fp8_blocks(w, block)
            quantized[name], quantized[f"{module}.weight_scale_inv"] = w8, scale
            dequantized[name] = w8.float() * scale.repeat_interleave(block[0], 0) \
                .repeat_interleave(block[1], 1)
            continue
        if method == "fp8":
            w8, scale = quantize_fp8(w, per_channel)
            quantized[name], quantized[f"{module}.weight_scale"] = w8, scale
            dequantized[name] = w8.float() * (scale[:, None] if per_channel else scale)
            continue
        parent, _, proj = module.rpartition(".")
        seed = zlib.crc32(f"{parent}.{SAME_INPUT.get(proj, proj)}".encode())
        iq = quantize_int(w, bits, group_size, sym, act_order=desc_act,
                          min_zero=1 if method == "gptq" else 0, seed=seed)
        packed = (pack_gptq(iq.q, iq.zeros, iq.scales, iq.g_idx, bits) if method == "gptq"
                  else pack_awq(iq.q, iq.zeros, iq.scales))
        quantized.update({f"{module}.{k}": v for k, v in packed.items()})
        dequantized[name] = iq.dequantize()
    raw = _quantization_config(method, bits, group_size, sym, desc_act, list(not_convert))
    if block:
        raw["weight_block_size"] = list(block)
    write_pair(src, dst, reference, quantized, dequantized, raw)


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's safetensors files."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def write_pair(src: Path, dst: Path, reference: Path, quantized: dict[str, torch.Tensor],
               dequantized: dict[str, torch.Tensor], quantization_config: dict) -> None:
    """The quantized folder (its config.json with `quantization_config`) and the reference
    folder of dequantized weights, each with src's other files (tokenizer, ...)."""
    for folder, tensors in ((dst, quantized), (reference, dequantized)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" \
                and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
            shutil.copy(f, reference / f.name)


def _quantization_config(method: str, bits: int, group_size: int, sym: bool, desc_act: bool,
                         not_convert: list[str]) -> dict:
    # field names as transformers / GPTQModel / AutoAWQ write them into config.json
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq",
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
                "modules_to_not_convert": not_convert or None}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": not_convert or None}
    return {"quant_method": "fp8", "activation_scheme": "dynamic",
            "ignored_layers": not_convert}
