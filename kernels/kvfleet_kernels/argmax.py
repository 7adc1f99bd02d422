"""Greedy sampling's argmax over a few long rows (batch-1 decode over a 128k vocabulary).

torch.argmax reduces a row in one thread block: on an H200, 28 us for one row of 128,256
logits, ~0.6% of a batch-1 decode step. Here each row is cut into chunks of BLOCK values,
one program per chunk finds its chunk's max, and the chunk that finishes last for its row
(counted in as the split-K GEMVs count, split_k.py) picks the row's answer: one launch.

Ties go to the first index (torch.argmax's rule): the leftmost maximum within a chunk, then
the leftmost chunk holding the row's maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.pdl import pdl_args, pdl_wait

# rows up to this many take the kernel; more rows already fill the GPU one block a row
MAX_ROWS = 16
BLOCK = 1024


@triton.jit
def _argmax_kernel(x_ptr, part_val_ptr, part_idx_ptr, count_ptr, out_ptr, V, stride_x,
                   num_chunks, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_val_ptr + row * CHUNKS_PAD + chunk, value)
    tl.store(part_idx_ptr + row * CHUNKS_PAD + chunk, chunk * BLOCK + index)
    # the stores are made before the count; the last arrival's acquire sees the others'
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == num_chunks - 1:
        c = tl.arange(0, CHUNKS_PAD)
        valid = c < num_chunks
        values = tl.load(part_val_ptr + row * CHUNKS_PAD + c, mask=valid, other=float("-inf"),
                         cache_modifier=".cg")
        indices = tl.load(part_idx_ptr + row * CHUNKS_PAD + c, mask=valid, other=0,
                          cache_modifier=".cg")
        _, best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.sum(tl.where(c == best, indices, 0), axis=0).to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")


# per (device, rows, chunks): partial values, their indices, the rows' counters. The sampler
# runs eagerly, outside CUDA graphs.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [N, V] float tensor (N <= MAX_ROWS): int64 [N]."""
    n, v = x.shape
    if n > MAX_ROWS or x.stride(-1) != 1:
        raise ValueError(f"argmax_rows takes up to {MAX_ROWS} rows with a contiguous last "
                         f"dimension; got {tuple(x.shape)} with strides {tuple(x.stride())}")
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    num_chunks = triton.cdiv(v, BLOCK)
    pad = triton.next_power_of_2(num_chunks)
    key = (x.device, n, pad)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = (torch.empty(n * pad, dtype=torch.float32, device=x.device),
                                 torch.empty(n * pad, dtype=torch.int32, device=x.device),
                                 torch.zeros(n, dtype=torch.int32, device=x.device))
    _argmax_kernel[(n, num_chunks)](x, *ws, out, v, x.stride(0), num_chunks, BLOCK=BLOCK,
                                    CHUNKS_PAD=pad, num_warps=4, **pdl_args(x.device))
    return out
