"""Greedy sampling's argmax over a few long rows (batch-1 decode over a 128k vocabulary).

torch.argmax reduces a row in one thread block: on an H200, 28 us for one row of 128,256
logits, ~0.6% of a batch-1 decode step. Here each row is cut into chunks of BLOCK values,
one program per chunk finds its chunk's max, and the chunk that finishes last for its row
(counted in as the split-K GEMVs count, split_k.py) picks the row's answer: one launch.

Ties go to the first index (torch.argmax's rule): the leftmost maximum within a chunk, then
the leftmost chunk holding the row's maximum. NaN ranks above every number, +inf included, as in
torch.argmax (a row's first NaN wins): a model whose logits overflowed gets a token inside its
vocabulary, not an index past it that would crash the next step's embedding lookup.

`sample_rows` is the same launch drawing a token per row from softmax(x / temperature): the
argmax of x / temperature + Gumbel noise (-log(-log u), u uniform from Philox, `tl.rand`),
which is the sampler's exponential race (argmax of probs / E, E ~ Exponential(1)) in log space.
At temperature 1.0 over [1024, 128256] logits the torch race made ~8 fp32 passes (~2 ms a
step on an H200); this reads the logits once, in their own dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.pdl import pdl_args, pdl_wait

# rows up to this many take the kernel; more rows already fill the GPU one block a row
MAX_ROWS = 16
BLOCK = 1024


# seed is a fresh random integer every sampling step: unspecialised, or each new divisibility
# class of it (seed % 16 == 0, seed == 1) would compile another variant mid-run
@triton.jit(do_not_specialize=["seed"])
def _argmax_kernel(x_ptr, part_val_ptr, part_idx_ptr, count_ptr, out_ptr, V, stride_x,
                   num_chunks, temp_ptr, seed, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                   GUMBEL: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    if GUMBEL:
        # one Philox key (seed) a launch, each value its own counter (row * V + column)
        t = tl.load(temp_ptr + row)
        u = tl.rand(seed, row * V + offs)
        x = tl.where(t > 0.0, x / tl.where(t > 0.0, t, 1.0) - tl.log(-tl.log(u)), x)  # 0: greedy
    value, index = _max_nan_first(x, tl.arange(0, BLOCK), BLOCK)
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
        _, best = _max_nan_first(values, c, CHUNKS_PAD)
        tl.store(out_ptr + row, tl.sum(tl.where(c == best, indices, 0), axis=0).to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")


@triton.jit
def _max_nan_first(x, pos, SIZE: tl.constexpr):
    """(value, index) of x's largest value, the first of ties; its first NaN instead where it
    holds one (value NaN). pos: tl.arange(0, SIZE)."""
    nan = x != x
    value, index = tl.max(tl.where(nan, float("inf"), x), axis=0, return_indices=True,
                          return_indices_tie_break_left=True)
    first_nan = tl.min(tl.where(nan, pos, SIZE), axis=0)
    has_nan = first_nan < SIZE
    return tl.where(has_nan, float("nan"), value), tl.where(has_nan, first_nan, index)


# per (device, chunks): partial values, their indices, the rows' counters, for as many rows as
# the largest launch so far (a launch uses the first rows; every launch puts its counters back
# to zero). One per chunk count, not per row count: the sampler's batch changes size every few
# steps. The sampler runs eagerly, outside CUDA graphs.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [N, V] float tensor (N <= MAX_ROWS): int64 [N]."""
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"argmax_rows takes up to {MAX_ROWS} rows; got {x.shape[0]}")
    return _launch(x, None, 0)


def sample_rows(x: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """One token id per row of the [N, V] logits x, drawn from softmax(x / temperatures[i])
    (fp32 [N]; 0: that row's argmax): int64 [N]. The draws follow seed (the Philox key).
    Philox counters are int32: N x V must stay below 2**31."""
    if temperatures.shape != (x.shape[0],) or temperatures.dtype != torch.float32:
        raise ValueError(f"temperatures must be float32 of shape ({x.shape[0]},); got "
                         f"{temperatures.dtype} {tuple(temperatures.shape)}")
    if x.numel() >= 2**31:
        raise ValueError(f"sample_rows takes fewer than 2**31 logits; got {tuple(x.shape)}")
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31); got {seed}")
    return _launch(x, temperatures, seed)


def _launch(x: torch.Tensor, temperatures: torch.Tensor | None, seed: int) -> torch.Tensor:
    n, v = x.shape
    if x.stride(-1) != 1:
        raise ValueError(f"the rows must have a contiguous last dimension; got strides "
                         f"{tuple(x.stride())}")
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    num_chunks = triton.cdiv(v, BLOCK)
    pad = triton.next_power_of_2(num_chunks)
    key = (x.device, pad)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[2].numel() < n:
        ws = _WORKSPACES[key] = (torch.empty(n * pad, dtype=torch.float32, device=x.device),
                                 torch.empty(n * pad, dtype=torch.int32, device=x.device),
                                 torch.zeros(n, dtype=torch.int32, device=x.device))
    gumbel = temperatures is not None
    _argmax_kernel[(n, num_chunks)](x, *ws, out, v, x.stride(0), num_chunks,
                                    temperatures if gumbel else out, seed, BLOCK=BLOCK,
                                    CHUNKS_PAD=pad, GUMBEL=gumbel, num_warps=4,
                                    **pdl_args(x.device))
    return out
