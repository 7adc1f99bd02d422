"""Bit packing of small unsigned integers into int32 words, as GPTQ and AWQ checkpoints store them.

A word holds 32 // bits values; value j of a word sits at bits [j*bits, (j+1)*bits).
`order` names which element of each run of 32 // bits consecutive elements goes to slot j:
GPTQ uses the natural order, AWQ's GEMM layout interleaves (AWQ_ORDER).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# AWQ GEMM: slot j of a word holds output column order[j] of its run of 8 (so that the CUDA
# kernel's dequantization emits pairs in register order).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _check_bits(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be one of 2, 4, 8; got {bits!r}")
    return 32 // bits


def pack_int32(values: torch.Tensor, bits: int, dim: int,
               order: Sequence[int] | None = None) -> torch.Tensor:
    """Pack `values` (integers in [0, 2**bits)) along `dim`, which shrinks by 32 // bits."""
    per_word = _check_bits(bits)
    if values.shape[dim] % per_word:
        raise ValueError(f"dim {dim} of size {values.shape[dim]} is not a multiple of "
                         f"{per_word} ({bits}-bit values per int32)")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise ValueError(f"values to pack must lie in [0, {(1 << bits) - 1}]; got "
                         f"[{int(values.min())}, {int(values.max())}]")
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], -1, per_word)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(per_word, dtype=torch.int64, device=v.device) * bits
    words = (v << shifts).sum(-1)
    # two's-complement wrap into int32: the checkpoint's dtype is signed
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 order: Sequence[int] | None = None) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words -> int32 values, `dim` grows by 32 // bits."""
    per_word = _check_bits(bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32; got {packed.dtype}")
    w = packed.movedim(dim, -1)
    shifts = torch.arange(per_word, dtype=torch.int32, device=w.device) * bits
    # arithmetic shift of negative words drags sign bits in; the mask drops them
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inverse = [0] * per_word
        for slot, element in enumerate(order):
            inverse[element] = slot
        v = v[..., inverse]
    v = v.reshape(*w.shape[:-1], w.shape[-1] * per_word)
    return v.movedim(-1, dim).contiguous()
