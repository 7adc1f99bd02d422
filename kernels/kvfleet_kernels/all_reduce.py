"""All-reduce over the GPUs of one host fused with the residual add and RMSNorm that follow it.

In a tensor-parallel decoder every row-parallel projection (o_proj, down_proj) ends in an
all-reduce whose sum goes straight into `RMSNorm(x + residual)`. At decode batch sizes the sum
is a few KB: its cost is latency (a launch, a handshake between the GPUs, a read over NVLink),
paid twice per layer, and then the norm is one more launch. This kernel does all of it in one
launch, as TensorRT-LLM's fused all-reduce does.

Each program writes its rows of this rank's part straight into every peer's buffer (stores
over NVLink, no reply awaited), then waits until the peers' parts of the same rows have
arrived in its own buffer: an element is empty while it holds -0.0's bits (senders send -0.0
as +0.0) and the receiver marks its slot empty again after reading it, as TensorRT-LLM's
"Lamport" all-reduce does. No flags and no handshake: the data crosses NVLink once. Then it
sums every rank's part of the row in rank order, in fp32 (every rank computes the same bits),
rounds to the activation dtype as the all-reduce would, and applies `rms_norm_ref`'s residual
add and normalisation (kvfleet_kernels.norm). On two H200s a batch-1 call (4096 wide, bf16)
takes 3.7 us against 8.5 for torch's one-shot symmetric-memory all-reduce and the norm
kernel; a first version that copied into its own buffer, traded flags (compare-and-swap at
system scope) and read the peers' copies over NVLink took 6.2 (docs/PERFORMANCE.md).

Buffer layout: the caller picks `offset` (one region per dtype, so an empty mark is never
read in another dtype's bits, and two alternating slots); rank q's part lies at offset +
q * slot_bytes of every other rank's buffer. Consecutive calls must use different slots: a
rank only starts call i + 2, which reuses call i's slot, after its peers' parts of call i + 1
arrived, and they only send those after they finished call i (read its slot, marked it
empty). Under CUDA graphs the slot of each call is fixed at capture; the decoder's calls
alternate, across forward passes too (layers.norm.reduce_in_norm).

A batch-1 GEMV can do the sending itself (kvfleet_kernels.gemv, `push=`): each of its programs
stores its outputs into the peers' slots as it finishes them, and this kernel, called with
`pushed=True`, only waits for the peers' parts, sums and normalises.

`all_reduce_rms_norm_ref` is the reference: the sum of the parts, rounded, then rms_norm_ref.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.norm import residual_rms_norm_row, rms_norm_ref
from kvfleet_kernels.pdl import pdl_args, pdl_wait

# programs of one launch; rows beyond it are looped over
MAX_PROGRAMS = 64
MAX_WORLD = 8


def all_reduce_rms_norm_ref(parts: list[torch.Tensor], weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None = None):
    """parts: every rank's [T, D] partial sum. Returns rms_norm_ref of their sum (fp32, rounded
    to the parts' dtype), i.e. out, or (out, sum + residual) when residual is given."""
    total = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    return rms_norm_ref(total, weight, eps, residual)


@dataclass(frozen=True)
class PeerSlots:
    """Where one call's parts go: rank q's part lies `offset + q * slot_bytes` bytes into every
    other rank's symmetric buffer; `bases`: the buffers' addresses (int64 [world], on the GPU)."""

    bases: torch.Tensor
    rank: int
    world: int
    offset: int
    slot_bytes: int

    def part_offset(self) -> int:
        """Where this rank's part goes in its peers' buffers, in bytes."""
        return self.offset + self.rank * self.slot_bytes

    def check(self, rows: int, dim: int, dtype: torch.dtype) -> None:
        if (not 1 < self.world <= MAX_WORLD or not 0 <= self.rank < self.world
                or self.bases.shape != (self.world,)):
            raise ValueError(f"rank {self.rank} of {self.world} (at most {MAX_WORLD}) with "
                             f"{self.bases.numel()} buffer addresses")
        if rows * dim * dtype.itemsize > self.slot_bytes:
            raise ValueError(f"{rows} x {dim} {dtype} does not fit a slot of {self.slot_bytes} "
                             "bytes")


@triton.jit
def clean_zero(x):
    # -0.0 -> +0.0: a 16/32-bit -0.0 marks an empty element of a slot
    return tl.where(x == 0.0, 0.0, x)


@triton.jit
def _take(addr, row, D: tl.constexpr, d, mask, dtype, BITS: tl.constexpr):
    """One row of a peer's part from this rank's own buffer at `addr`, once every element has
    arrived (none is the empty mark any more), marking the row empty again."""
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
                                BITS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                                PUSHED: tl.constexpr = False, PDL: tl.constexpr = False):
    # bases_ptr: int64 [WORLD], each rank's symmetric buffer as an address; rank q's part of
    # this call goes `offset + q * slot_bytes` bytes into every other rank's buffer. PUSHED:
    # the kernel that wrote x has already sent it there (gemv's push=)
    pdl_wait(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dtype = x_ptr.dtype.element_ty
    if not PUSHED:
        for row in range(pid, num_rows, nprog):
            x = clean_zero(tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0))
            for peer in tl.static_range(WORLD):
                if peer != rank:
                    dst = (tl.load(bases_ptr + peer) + offset + rank * slot_bytes).to(
                        tl.pointer_type(dtype))
                    tl.store(dst + row * D + d, x, mask=mask)
    own_base = tl.load(bases_ptr + rank) + offset
    for row in range(pid, num_rows, nprog):
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            if q == rank:
                acc += clean_zero(tl.load(x_ptr + row * stride_x + d, mask=mask,
                                          other=0.0)).to(tl.float32)
            else:
                acc += _take(own_base + q * slot_bytes, row, D, d, mask, dtype, BITS)
        out = residual_rms_norm_row(acc.to(dtype), residual_ptr, weight_ptr, sum_ptr, row,
                                    stride_r, stride_s, d, mask, eps, D, HAS_RESIDUAL)
        tl.store(out_ptr + row * stride_o + d, out, mask=mask)


def empty_mark(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(integer view, value) of an empty element of `dtype` in a slot: -0.0's bits."""
    return (torch.int16, -32768) if dtype.itemsize == 2 else (torch.int32, -2**31)


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None, bases: torch.Tensor, rank: int,
                        world: int, offset: int, slot_bytes: int, pushed: bool = False):
    """Sum `x` ([T, D], this rank's partial) over the ranks whose symmetric buffers start at
    `bases` (int64 addresses on x's device, [world]), then RMSNorm as rms_norm does: returns
    out, or (out, sum + residual). Rank q's part goes `offset + q * slot_bytes` bytes into
    the other ranks' buffers (slot_bytes >= T * D * itemsize). Every rank calls it with its
    own rank and the same shapes and offsets; the slots (a region per dtype) hold
    empty_mark(dtype) on every rank before the first call, and the kernel leaves them so.
    pushed: x's kernel already sent x to the peers (gemv's push= with the same slots)."""
    num_rows, dim = x.shape
    PeerSlots(bases, rank, world, offset, slot_bytes).check(num_rows, dim, x.dtype)
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
            x, residual_arg, weight, out, summed_arg, bases, rank, num_rows, eps, offset,
            slot_bytes, x.stride(0), residual_arg.stride(0), out.stride(0), summed_arg.stride(0),
            D=dim, BLOCK_D=triton.next_power_of_2(dim), WORLD=world,
            BITS=8 * x.element_size(), HAS_RESIDUAL=residual is not None, PUSHED=pushed,
            num_warps=8 if dim >= 4096 else 4, **pdl_args(x.device))
    return out if residual is None else (out, summed)
