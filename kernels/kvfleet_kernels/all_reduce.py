"""All-reduce over the GPUs of one host fused with the residual add and RMSNorm that follow it.

In a tensor-parallel decoder every row-parallel projection (o_proj, down_proj) ends in an
all-reduce whose sum goes straight into `RMSNorm(x + residual)`. At decode batch sizes the sum
is a few KB: its cost is latency (a launch, a handshake between the GPUs, a read over NVLink),
paid twice per layer, and then the norm is one more launch. This kernel does all of it in one
launch, as TensorRT-LLM's fused all-reduce does:

  1. each program copies its rows of this rank's partial sum into this rank's slot of a
     buffer that every rank can address (torch symmetric memory: peer pointers over NVLink);
  2. it signals every peer and waits for every peer's signal (one flag per program and rank
     pair: set 0 -> 1 by the sender, taken 1 -> 0 by the receiver, both compare-and-swap at
     system scope, release / acquire, so a flag is only set again once it has been taken);
  3. it sums every rank's copy of its rows in rank order, in fp32 (every rank computes the same
     bits), rounds to the activation dtype as the all-reduce would, and applies
     `rms_norm_ref`'s residual add and normalisation (kvfleet_kernels.norm).

Layout of each rank's symmetric buffer (bytes): [flags: int32 [MAX_PROGRAMS, MAX_WORLD], the
flag of program p from rank r at (p, r)][slot 0][slot 1]. Calls alternate between the two slots: a rank can only start
call i + 2, which overwrites call i's slot, after passing call i + 1's handshake, and a peer
only arrives there after it has finished reading call i. Under CUDA graphs the slot of each
call is fixed at capture; consecutive calls still alternate.

`all_reduce_rms_norm_ref` is the reference: the sum of the parts, rounded, then rms_norm_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.norm import residual_rms_norm_row, rms_norm_ref
from kvfleet_kernels.pdl import pdl_args, pdl_wait

# programs of one launch (each owns its flags); rows beyond it are looped over
MAX_PROGRAMS = 64
MAX_WORLD = 8
FLAGS_BYTES = MAX_PROGRAMS * MAX_WORLD * 4


def all_reduce_rms_norm_ref(parts: list[torch.Tensor], weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None = None):
    """parts: every rank's [T, D] partial sum. Returns rms_norm_ref of their sum (fp32, rounded
    to the parts' dtype), i.e. out, or (out, sum + residual) when residual is given."""
    total = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    return rms_norm_ref(total, weight, eps, residual)


@triton.jit
def _all_reduce_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, bases_ptr,
                                rank, num_rows, eps, slot_offset,
                                stride_x, stride_r, stride_o, stride_s,
                                D: tl.constexpr, BLOCK_D: tl.constexpr, WORLD: tl.constexpr,
                                MAX_WORLD: tl.constexpr, FLAGS_BYTES: tl.constexpr,
                                HAS_RESIDUAL: tl.constexpr,
                                PDL: tl.constexpr = False):
    # bases_ptr: int64 [WORLD], each rank's symmetric buffer as an address; slot_offset: the
    # bytes from a buffer's first slot to this call's slot (0 or the slot size)
    pdl_wait(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dtype = x_ptr.dtype.element_ty
    own_base = tl.load(bases_ptr + rank)
    own = (own_base + FLAGS_BYTES + slot_offset).to(tl.pointer_type(dtype))
    for row in range(pid, num_rows, nprog):
        tl.store(own + row * D + d, tl.load(x_ptr + row * stride_x + d, mask=mask), mask=mask)
    # every thread's copy is written before the flags go out (the scalar atomics below run on
    # one thread, and their results reach the others through a barrier)
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = (tl.load(bases_ptr + peer).to(tl.pointer_type(tl.int32))
                    + pid * MAX_WORLD + rank)
            while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
                pass
    own_flags = own_base.to(tl.pointer_type(tl.int32)) + pid * MAX_WORLD
    for peer in tl.static_range(WORLD):
        if peer != rank:
            while tl.atomic_cas(own_flags + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()
    for row in range(pid, num_rows, nprog):
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            part = (tl.load(bases_ptr + r) + FLAGS_BYTES + slot_offset).to(tl.pointer_type(dtype))
            # volatile: never a line an earlier replay left in this SM's L1
            acc += tl.load(part + row * D + d, mask=mask, other=0.0, volatile=True).to(tl.float32)
        out = residual_rms_norm_row(acc.to(dtype), residual_ptr, weight_ptr, sum_ptr, row,
                                    stride_r, stride_s, d, mask, eps, D, HAS_RESIDUAL)
        tl.store(out_ptr + row * stride_o + d, out, mask=mask)


def slot_bytes_needed(num_rows: int, dim: int, dtype: torch.dtype) -> int:
    return num_rows * dim * dtype.itemsize


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None, bases: torch.Tensor, rank: int,
                        world: int, slot_offset: int):
    """Sum `x` ([T, D], this rank's partial) over the ranks whose symmetric buffers start at
    `bases` (int64 addresses on x's device, [world]), then RMSNorm as rms_norm does: returns
    out, or (out, sum + residual). Every rank calls it with its own rank and the same shapes
    and slot_offset; the caller sizes the buffers (FLAGS_BYTES + 2 slots of
    slot_bytes_needed) and zeroes the flags once, on every rank, before the first call."""
    num_rows, dim = x.shape
    if not 1 < world <= MAX_WORLD or not 0 <= rank < world or bases.shape != (world,):
        raise ValueError(f"rank {rank} of {world} (at most {MAX_WORLD}) with {bases.numel()} "
                         f"buffer addresses")
    if weight.shape != (dim,):
        raise ValueError(f"weight must have shape ({dim},) to match x [T, {dim}]; "
                         f"got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}; "
                         f"got {tuple(residual.shape)}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension; "
                             f"got strides {tuple(t.stride())}")
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    if num_rows:
        residual_arg = residual if residual is not None else x
        summed_arg = summed if summed is not None else out
        _all_reduce_rms_norm_kernel[(min(num_rows, MAX_PROGRAMS),)](
            x, residual_arg, weight, out, summed_arg, bases, rank, num_rows, eps, slot_offset,
            x.stride(0), residual_arg.stride(0), out.stride(0), summed_arg.stride(0),
            D=dim, BLOCK_D=triton.next_power_of_2(dim), WORLD=world, MAX_WORLD=MAX_WORLD,
            FLAGS_BYTES=FLAGS_BYTES,
            HAS_RESIDUAL=residual is not None, num_warps=8 if dim >= 4096 else 4,
            **pdl_args(x.device))
    return out if residual is None else (out, summed)
