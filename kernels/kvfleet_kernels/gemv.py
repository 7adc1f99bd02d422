"""Batch-1 GEMV for unquantized (fp16/bf16/fp32) weights, split-K reduced inside the launch.

out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), w in nn.Linear's [N, K] layout (K contiguous).
Each program streams a [BLOCK_N, BLOCK_K] tile of w per step over its K slice, multiplies by x
in fp32 and keeps a [BLOCK_N, BLOCK_K] accumulator it reduces once at the end; the K slices
meet through split_k.store_or_reduce. The engine's linear layers use it at batch 1 for FP8
weights (W8A16, `scale=`) and for the bf16/fp16 (device, shape) pairs in TUNED, where an H200
or H100 sweep measured it faster than cuBLAS (docs/PERFORMANCE.md); `KVFLEET_TRITON_GEMV=1` sends every
batch-1 shape here, `=0` none.

Two fusions spare a decode step a launch each (one K slice only):
- `gated=True`: x is a gated MLP's [M, 2K] = [gate | up] and the GEMV's input is SiLU(gate) * up,
  computed as kvfleet_kernels.activation's kernel computes it (same rounding, the same bits)
  while the K tiles are loaded; the down projection then needs no activation kernel.
- `push=`: tensor parallelism. Besides its own output, each program sends its outputs into
  every peer's slot of the fused all-reduce + RMSNorm (kvfleet_kernels.all_reduce, whose
  protocol this keeps: cleaned of -0.0, written once, no reply awaited), so the norm kernel
  only waits for the peers' parts (`all_reduce_rms_norm(..., pushed=True)`) and the parts
  cross NVLink while the GEMV's last tiles are still being computed.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.activation import silu_and_mul_ref, silu_mul_row
from kvfleet_kernels.all_reduce import PeerSlots, clean_zero
from kvfleet_kernels.pdl import pdl_args, pdl_wait
from kvfleet_kernels.split_k import split_for, store_or_reduce, workspace


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             scale: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] * scale [N, 1])^T (+ bias) in fp32, cast to x's dtype; gated:
    x is [M, 2K] and silu_and_mul_ref(x) takes its place."""
    if gated:
        x = silu_and_mul_ref(x)
    w = weight.float() if scale is None else weight.float() * scale.float()[:, None]
    out = x.float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def _gemv_load_x(x_ptr, m, tile, K, stride_xm, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """x's K tile, in fp32 (GATED: SiLU(gate) * up of row m's [gate | up], rounded as stored)."""
    offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    if GATED:
        return silu_mul_row(x_ptr + m * stride_xm, offs_k, offs_k < K, K).to(tl.float32)
    return tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_load_w(w_ptr, offs_n, mask_n, tile, K, stride_wn, BLOCK_K: tl.constexpr):
    """w's [BLOCK_N, BLOCK_K] tile, as stored (all masked off past K)."""
    offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                   mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, split_k,
                 stride_xm, stride_wn, bases_ptr, rank, push_offset,
                 HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, GATED: tl.constexpr = False,
                 PUSH_WORLD: tl.constexpr = 0, PDL: tl.constexpr = False):
    # Program = (row of x, BLOCK_N outputs, K slice). HAS_SCALE: w holds fp8 (e4m3) values of
    # per-row scale s[n]; the sum over k is linear, so each slice's partial is scaled once.
    # PREFETCH: the slice's next tile is loaded before the current one is multiplied; its first
    # weight tile is loaded before the PDL wait (weights are no earlier kernel's output).
    # PUSH_WORLD > 0 (one K slice, no bias): the outputs also go to every other rank's buffer
    # (bases_ptr: int64 addresses), push_offset bytes in (this rank's part of the slot).
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    n_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:
        w = _gemv_load_w(w_ptr, offs_n, mask_n, pid_k, K, stride_wn, BLOCK_K)
        pdl_wait(PDL)
        if pid_k < n_tiles:      # split_k above the tile count leaves slices empty
            x = _gemv_load_x(x_ptr, m, pid_k, K, stride_xm, BLOCK_K, GATED)
            for tile in range(pid_k, n_tiles - split_k, split_k):
                xn = _gemv_load_x(x_ptr, m, tile + split_k, K, stride_xm, BLOCK_K, GATED)
                wn = _gemv_load_w(w_ptr, offs_n, mask_n, tile + split_k, K, stride_wn, BLOCK_K)
                acc += w.to(tl.float32) * x[None, :]
                x, w = xn, wn
            acc += w.to(tl.float32) * x[None, :]
    else:
        pdl_wait(PDL)
        for tile in range(pid_k, n_tiles, split_k):
            x = _gemv_load_x(x_ptr, m, tile, K, stride_xm, BLOCK_K, GATED)
            w = _gemv_load_w(w_ptr, offs_n, mask_n, tile, K, stride_wn, BLOCK_K)
            acc += w.to(tl.float32) * x[None, :]
    total = tl.sum(acc, axis=1)
    if HAS_SCALE:
        total *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    store_or_reduce(total, out_ptr, b_ptr, part_ptr, count_ptr, m, M, N, offs_n,
                    mask_n, pid_n, pid_k, split_k, HAS_BIAS)
    if PUSH_WORLD > 0:
        dtype = out_ptr.dtype.element_ty
        sent = clean_zero(total.to(dtype))
        for peer in tl.static_range(PUSH_WORLD):
            if peer != rank:
                dst = (tl.load(bases_ptr + peer) + push_offset).to(tl.pointer_type(dtype))
                tl.store(dst + m * N + offs_n, sent, mask=mask_n)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    prefetch: bool = False


# GEMV programs (output tiles x K slices) to aim for per SM
PROGRAMS_PER_SM = 4


def pick_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    # the interpreter runs each program in Python: few, wide ones (a tiny model's 49k-vocab
    # lm_head took 5 minutes a test in 16-column programs, 30 s in 1024-column ones)
    block_n, block_k = (16, 512) if device.type == "cuda" else (1024, 512)
    tiles = m * triton.cdiv(n, block_n)
    split = split_for(tiles, triton.cdiv(k, block_k), PROGRAMS_PER_SM, device)
    return GemvConfig(block_n, block_k, split, 4, 3)


# (device name, N, K) -> the tiles that beat cuBLAS there, used at batch 1 by default
# (KVFLEET_TRITON_GEMV unset or =tuned). `python tests/kernels/bench_gemv.py --sweep` on an H200
# (tree 24ddd95; weight copies 3x L2 timed in turn from CUDA graphs, as decode meets them),
# Llama-3.1-8B's batch-1 projections, us per call, best tiles vs cuBLAS: qkv 15.2 vs 16.8,
# o_proj 11.7 vs 14.1, down 30.4 vs 32.3, gate_up 56.3 vs 57.3, lm_head 236.9 vs 240.3, and a
# TP=2 rank's qkv 9.0 vs 12.3, o_proj 7.3 vs 8.0, down 16.9 vs 20.7, gate_up 31.1 vs 31.4. All
# prefetch the next K tile, one K slice. End to end with the first six (those >= 3% faster):
# batch 1 203.1 -> 209.9 tok/s, TP=2 batch 1 263.5 -> 282.9 (docs/PERFORMANCE.md). gate_up and
# lm_head (1-2%) joined them so that every projection of a batch-1 step is a Triton kernel,
# which programmatic dependent launch can overlap with the kernel before it (pdl.py).
_H200 = "NVIDIA H200"
_H100 = "NVIDIA H100 80GB HBM3"
TUNED: dict[tuple[str, int, int], GemvConfig] = {
    (_H200, 6144, 4096): GemvConfig(16, 512, 1, 4, 1, prefetch=True),
    (_H200, 4096, 4096): GemvConfig(8, 512, 1, 8, 1, prefetch=True),
    (_H200, 4096, 14336): GemvConfig(8, 512, 1, 8, 1, prefetch=True),
    (_H200, 28672, 4096): GemvConfig(16, 256, 1, 4, 1, prefetch=True),
    (_H200, 128256, 4096): GemvConfig(16, 256, 1, 4, 1, prefetch=True),
    (_H200, 3072, 4096): GemvConfig(8, 1024, 1, 4, 1, prefetch=True),
    (_H200, 4096, 2048): GemvConfig(8, 512, 1, 4, 1, prefetch=True),
    (_H200, 4096, 7168): GemvConfig(8, 512, 1, 8, 1, prefetch=True),
    (_H200, 14336, 4096): GemvConfig(8, 256, 1, 4, 1, prefetch=True),
    # An H100 (forty-sixth session, trees 4c03ad2 / 30fa7b7, `--sweep --prefetch-only`), us per
    # call against cuBLAS: qkv 18.1 vs 21.0, o_proj 13.2 vs 17.3, gate_up 76.1 vs 79.4, down
    # 40.1 vs 44.0 (a layer 147.5 vs 161.8), lm_head 327.7 vs 358.2; a TP=2 rank's qkv 9.6 vs
    # 14.8, o_proj 7.6 vs 9.8, gate_up 39.8 vs 41.5, down 21.2 vs 25.2. Batch 1 170.8 -> 187.2
    # tok/s with the layer's four, 188.3 with lm_head too (one machine).
    (_H100, 6144, 4096): GemvConfig(16, 512, 1, 4, 1, prefetch=True),
    (_H100, 4096, 4096): GemvConfig(8, 512, 1, 8, 1, prefetch=True),
    (_H100, 28672, 4096): GemvConfig(8, 1024, 1, 4, 1, prefetch=True),
    (_H100, 4096, 14336): GemvConfig(8, 512, 1, 8, 1, prefetch=True),
    (_H100, 128256, 4096): GemvConfig(8, 1024, 1, 4, 1, prefetch=True),
    (_H100, 3072, 4096): GemvConfig(8, 1024, 1, 4, 1, prefetch=True),
    (_H100, 4096, 2048): GemvConfig(8, 512, 1, 8, 1, prefetch=True),
    (_H100, 14336, 4096): GemvConfig(8, 512, 1, 4, 1, prefetch=True),
    (_H100, 4096, 7168): GemvConfig(8, 512, 1, 8, 1, prefetch=True),
}


# (device name, N, K) -> the tiles of the 8-bit (FP8 / int8, `scale=`) weights' GEMV, which
# has no cuBLAS twin (batch-1 FP8 and W8A8 projections always take it): the `bench_gemv.py
# --weights fp8 --sweep` winners >= 3% faster than pick_config's tiles. An H100 (tree
# 8102b6a, us per call against pick_config's 16 x 512 tiles split 1-3 ways): qkv 12.2 vs 14.6,
# o_proj 9.4 vs 11.6, gate_up 44.1 vs 45.5, down 25.3 vs 29.7 (a layer 91.0 vs 101.4), a TP=2
# rank's qkv 7.9 vs 9.9 and o_proj 5.6 vs 6.9: one K slice on 8-column tiles, K tiles as long
# as 1-2 KB a row. Not yet swept on an H200.
TUNED_8BIT: dict[tuple[str, int, int], GemvConfig] = {
    (_H100, 6144, 4096): GemvConfig(8, 512, 1, 4, 2),
    (_H100, 4096, 4096): GemvConfig(8, 1024, 1, 4, 2),
    (_H100, 28672, 4096): GemvConfig(8, 512, 1, 4, 2),
    (_H100, 4096, 14336): GemvConfig(8, 2048, 1, 8, 2),
    (_H100, 3072, 4096): GemvConfig(8, 512, 1, 8, 1, prefetch=True),
    (_H100, 4096, 2048): GemvConfig(8, 512, 1, 4, 1, prefetch=True),
}


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@functools.cache
def tuned_file(path: str) -> dict[tuple[str, int, int, int], GemvConfig]:
    """The entries of a JSON file that `bench_gemv.py --sweep --write-tuned PATH` wrote
    (KVFLEET_GEMV_TUNED=PATH): [{"device", "n", "k", "config": {GemvConfig fields}}, with
    "weight_bytes": 1 for 8-bit weights' tiles (2 when absent)], keyed (device, n, k, bytes)."""
    table = {}
    try:
        for e in json.loads(pathlib.Path(path).read_text()):
            key = (e["device"], int(e["n"]), int(e["k"]), int(e.get("weight_bytes", 2)))
            table[key] = GemvConfig(**e["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"KVFLEET_GEMV_TUNED={path}: not a list of "
                         f'{{"device", "n", "k", "config"}} entries ({e})') from e
    return table


def tuned_config(n: int, k: int, device: torch.device, weight_bytes: int = 2
                 ) -> GemvConfig | None:
    """The measured-faster tiles for an [N, K] weight of weight_bytes-byte elements on this
    device (KVFLEET_GEMV_TUNED's file first, then TUNED, or TUNED_8BIT for 1-byte weights),
    or None (2 bytes: use cuBLAS; 1 byte: pick_config's tiles)."""
    key = (_device_name(device), n, k)
    path = os.environ.get("KVFLEET_GEMV_TUNED", "")
    found = tuned_file(path).get((*key, weight_bytes)) if path else None
    if found is not None:
        return found
    return (TUNED_8BIT if weight_bytes == 1 else TUNED).get(key)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, scale: torch.Tensor | None = None,
         gated: bool = False, push: PeerSlots | None = None) -> torch.Tensor:
    """Triton twin of gemv_ref: x [M, K] (M small), weight [N, K] -> [M, N] in x's dtype.
    `scale` [N] (fp32): weight holds fp8 (or int8) values of per-row scales (W8A16: x stays
    unquantized); without `config` those take TUNED_8BIT's tiles where the shape has some.
    `gated`: x is [M, 2K] = [gate | up] and the input is SiLU(gate) * up. `push`: the output
    also goes into this rank's part of every peer's slot (module docstring)."""
    m, k = x.shape
    n = weight.shape[0]
    if gated:
        if k % 2:
            raise ValueError(f"gated: x is [{m}, {k}], not [M, 2K] = [gate | up]")
        k //= 2
    if weight.shape[1] != k:
        raise ValueError(f"x is [{m}, {x.shape[1]}] but weight is {tuple(weight.shape)}: expected "
                         f"[N, {k}]")
    if weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise ValueError("weight (and bias) need a contiguous last dimension")
    if scale is not None and (scale.shape != (n,) or scale.stride(0) != 1):
        raise ValueError(f"scale must be a contiguous [{n}] (one per weight row); got "
                         f"{tuple(scale.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config
    if cfg is None and scale is not None and weight.element_size() == 1:
        cfg = tuned_config(n, k, x.device, 1)
    cfg = cfg or pick_config(m, n, k, x.device)
    if (gated or push is not None) and cfg.split_k != 1:
        raise ValueError(f"gated and push= need one K slice; the tiles have {cfg.split_k}")
    if push is not None:
        if bias is not None:
            raise ValueError("push= takes no bias (a row-parallel bias is added once, after the sum)")
        push.check(m, n, x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (m, triton.cdiv(n, cfg.block_n), cfg.split_k)
    part, count = workspace(x.device, m, n, cfg.split_k, grid[1])
    _gemv_kernel[grid](x, weight, scale if scale is not None else out,
                       bias if bias is not None else out, out, part, count,
                       m, n, k, cfg.split_k, x.stride(0), weight.stride(0),
                       push.bases if push is not None else count,
                       push.rank if push is not None else 0,
                       push.part_offset() if push is not None else 0,
                       HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PREFETCH=cfg.prefetch,
                       GATED=gated, PUSH_WORLD=push.world if push is not None else 0,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device))
    return out
