"""All-reduce over the GPUs of one host fused with the residual add and RMSNorm that follow it.

In a tensor-parallel decoder every row-parallel projection (o_proj, down_proj) ends in an
all-reduce whose sum goes straight into `RMSNorm(x + residual)`. At decode batch sizes the sum
is a few KB: its cost is latency (a launch, a handshake between the GPUs, a read over NVLink),
paid twice per layer, and then the norm is one more launch. This kernel does all of it in one
launch, as TensorRT-LLM's fused all-reduce does.

Two ways for the parts to meet (`push`; both sum every rank's part of a row in rank order,
in fp32, so every rank computes the same bits, round to the activation dtype as the
all-reduce would, then apply `rms_norm_ref`'s residual add and normalisation):

  pull  each program copies its rows of this rank's part into this rank's buffer, signals
        every peer and waits for every peer's signal (one flag per program and rank pair: set
        0 -> 1 by the sender, taken 1 -> 0 by the receiver, both compare-and-swap at system
        scope, release / acquire), then reads every peer's copy over NVLink.
  push  each program writes its rows of this rank's part straight into every peer's buffer
        (stores over NVLink, no reply awaited), then waits until the peers' parts have arrived
        in its own buffer: an element is empty while it holds -0.0's bits (senders turn -0.0
        into +0.0) and the receiver marks its slot empty again after reading it (as
        TensorRT-LLM's "Lamport" all-reduce). No flags, one crossing of NVLink.

Buffer layout (bytes, each rank's): [flags: int32 [MAX_PROGRAMS, MAX_WORLD], the flag of
program p from rank r at (p, r)] then slots; the caller picks `offset` (one region per dtype,
so an empty mark is never read in another dtype's bits, and two alternating slots) and rank
q's part lies at offset + q * slot_bytes. Consecutive calls must use different slots: a rank
can only start call i + 2, which reuses call i's slot, after its peers' parts of call i + 1
arrived, which they only send after they have finished call i (read its slot, marked it
empty). Under CUDA graphs the slot of each call is fixed at capture; the decoder's calls
alternate, across forward passes too.

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
def _clean(x):
    # -0.0 -> +0.0: a 16/32-bit -0.0 marks an empty element of a push slot
    return tl.where(x == 0.0, 0.0, x)


@triton.jit
def _take(addr, row, D: tl.constexpr, d, mask, dtype, BITS: tl.constexpr):
    """Push mode: one row of a peer's part from this rank's own buffer at `addr`, once every
    element has arrived (none is the empty mark any more), marking the row empty again."""
    if BITS == 16:
        empty = -32768
        p = addr.to(tl.pointer_type(tl.int16)) + row * D + d
    else:
        empty = -2147483648
        p = addr.to(tl.pointer_type(tl.int32)) + row * D + d
    bits = tl.load(p, mask=mask, other=0, volatile=True)
    while tl.max((bits == empty).to(tl.int32), 0) > 0:
        bits = tl.load(p, mask=mask, other=0, volatile=True)
    tl.store(p, tl.full(bits.shape, empty, bits.dtype), mask=mask)
    return bits.to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _all_reduce_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, bases_ptr,
                                rank, num_rows, eps, offset, slot_bytes,
                                stride_x, stride_r, stride_o, stride_s,
                                D: tl.constexpr, BLOCK_D: tl.constexpr, WORLD: tl.constexpr,
                                MAX_WORLD: tl.constexpr, BITS: tl.constexpr,
                                HAS_RESIDUAL: tl.constexpr, PUSH: tl.constexpr,
                                PDL: tl.constexpr = False):
    # bases_ptr: int64 [WORLD], each rank's symmetric buffer as an address. Rank q's part of
    # this call lies `offset + q * slot_bytes` bytes into a buffer: into its own (pull) or
    # into every other rank's (push).
    pdl_wait(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dtype = x_ptr.dtype.element_ty
    own_base = tl.load(bases_ptr + rank)
    for row in range(pid, num_rows, nprog):
        x = _clean(tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0))
        if PUSH:
            for peer in tl.static_range(WORLD):
                if peer != rank:
                    dst = (tl.load(bases_ptr + peer) + offset + rank * slot_bytes).to(
                        tl.pointer_type(dtype))
                    tl.store(dst + row * D + d, x, mask=mask)
        else:
            own = (own_base + offset + rank * slot_bytes).to(tl.pointer_type(dtype))
            tl.store(own + row * D + d, x, mask=mask)
    if not PUSH:
        # every thread's copy is written before the flags go out (the scalar atomics below
        # run on one thread, and their results reach the others through a barrier)
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
        for q in tl.static_range(WORLD):
            if PUSH:
                if q == rank:
                    acc += _clean(tl.load(x_ptr + row * stride_x + d, mask=mask,
                                          other=0.0)).to(tl.float32)
                else:
                    acc += _take(own_base + offset + q * slot_bytes, row, D, d, mask, dtype, BITS)
            else:
                part = (tl.load(bases_ptr + q) + offset + q * slot_bytes).to(tl.pointer_type(dtype))
                # volatile: never a line an earlier replay left in this SM's L1
                acc += tl.load(part + row * D + d, mask=mask, other=0.0,
                               volatile=True).to(tl.float32)
        out = residual_rms_norm_row(acc.to(dtype), residual_ptr, weight_ptr, sum_ptr, row,
                                    stride_r, stride_s, d, mask, eps, D, HAS_RESIDUAL)
        tl.store(out_ptr + row * stride_o + d, out, mask=mask)


def empty_mark(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """Push mode: (integer view, value) of an empty element of `dtype`: -0.0's bits."""
    return (torch.int16, -32768) if dtype.itemsize == 2 else (torch.int32, -2**31)


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None, bases: torch.Tensor, rank: int,
                        world: int, offset: int, slot_bytes: int, push: bool):
    """Sum `x` ([T, D], this rank's partial) over the ranks whose symmetric buffers start at
    `bases` (int64 addresses on x's device, [world]), then RMSNorm as rms_norm does: returns
    out, or (out, sum + residual). Rank q's part goes `offset + q * slot_bytes` bytes into
    the buffers (slot_bytes >= T * D * itemsize). Every rank calls it with its own rank and
    the same shapes and offsets. Pull: the flags (the buffers' first FLAGS_BYTES) zeroed once
    on every rank before the first call. Push: the slots, per dtype, hold empty_mark(dtype)
    before the first call (the kernel leaves them so)."""
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
    if num_rows * dim * x.element_size() > slot_bytes:
        raise ValueError(f"{num_rows} x {dim} {x.dtype} does not fit a slot of {slot_bytes} bytes")
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
            x, residual_arg, weight, out, summed_arg, bases, rank, num_rows, eps, offset,
            slot_bytes, x.stride(0), residual_arg.stride(0), out.stride(0), summed_arg.stride(0),
            D=dim, BLOCK_D=triton.next_power_of_2(dim), WORLD=world, MAX_WORLD=MAX_WORLD,
            BITS=8 * x.element_size(), HAS_RESIDUAL=residual is not None, PUSH=push,
            num_warps=8 if dim >= 4096 else 4, **pdl_args(x.device))
    return out if residual is None else (out, summed)
