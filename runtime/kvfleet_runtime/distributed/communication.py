"""Collectives of the tensor-parallel group; each is a no-op (or the identity) at size 1.

`broadcast_step` is how rank 0 hands the step it scheduled (`StepInputs`) to the other ranks
in two collectives: the small Python values (and the tensors' shapes and dtypes) go through the
gloo control group as one pickled message, every tensor's bytes through the device group packed
into one buffer (on GPU they never visit the host).
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from kvfleet_runtime.distributed.parallel_state import get_state
from kvfleet_runtime.layers.attention import AttentionMetadata
from kvfleet_runtime.layers.backend import use_triton

log = logging.getLogger(__name__)


def _set_up_on_every_rank(make, device: torch.device) -> tuple[Any, str | None]:
    """Build a symmetric-memory path (`make()`) and run its `_self_check(device)` on every
    rank, agreeing after each step that can fail on one rank alone, so that no rank enters a
    collective (the self-check) that another skips: (the path, None) where every rank
    succeeded, else (None, why not)."""
    made, reason = None, "failed on another rank"
    try:
        made = make()
    except Exception as e:    # no P2P access, a torch without symm_mem, ...
        reason = f"unavailable: {type(e).__name__}: {e}"
    if min_over_ranks(int(made is not None)):
        try:
            reason = made._self_check(device)
        except Exception as e:
            reason = f"self-check raised {type(e).__name__}: {e}"
        if min_over_ranks(int(reason is None)):
            return made, None
        reason = reason or "self-check failed on another rank"
    return None, reason


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks; returns the sum (`x` itself, summed in place, or a new tensor)."""
    state = get_state()
    if state.size > 1:
        one_shot = state.one_shot
        if one_shot is not None and one_shot.fits(x):
            return one_shot(x)
        dist.all_reduce(x, group=state.device_group)
    return x



# the byte limits of the symmetric-memory paths (0 turns one off)
SIZE_SETTINGS = {"KVFLEET_TP_ONE_SHOT_MAX_BYTES": 512 * 1024, "KVFLEET_TP_TWO_SHOT_MAX_BYTES": 0,
                 "KVFLEET_TP_FUSED_NORM_MAX_BYTES": 512 * 1024}


def size_setting(name: str) -> int:
    """One of SIZE_SETTINGS from the environment: an integer >= 0, or its default if unset."""
    value = os.environ.get(name, "")
    if value == "":
        return SIZE_SETTINGS[name]
    try:
        size = int(value)
    except ValueError:
        size = -1
    if size < 0:
        raise ValueError(f"{name} must be a number of bytes (an integer >= 0); got {value!r}")
    return size


class OneShotAllReduce:
    """Small all-reduces through symmetric memory (`torch.ops.symm_mem`): each rank copies its
    tensor into a buffer every peer can read over NVLink, and one kernel sums all ranks' copies.
    A decode step's all-reduces are a few KB (batch 1: 8 KB, 2 per layer) where NCCL's launch
    and protocol latency, not bandwidth, is the cost; larger tensors stay on NCCL.

    `create` returns None (NCCL for everything) where symmetric memory is unavailable, where
    KVFLEET_TP_ONE_SHOT_MAX_BYTES=0, or where its self-check against NCCL fails on any rank;
    every rank takes the same decision.

    KVFLEET_TP_TWO_SHOT_MAX_BYTES (default 0: off) also sends tensors above the one-shot limit
    and up to this size through the same buffer with `two_shot_all_reduce_out` (reduce-scatter
    + all-gather over NVLink). Set to a decode graph's largest all-reduce (max batch x hidden
    x 2 bytes, e.g. 8 MiB for an 8B model at 1024), no NCCL collective is captured in the CUDA
    graphs, whose NCCL teardown hangs at shutdown (pytorch#115388). Not measured yet.
    """

    # the dtypes torch's one_shot_all_reduce serves (on the H200 with torch 2.11 fp16 raised
    # NotImplementedError, which failed the whole self-check: one-shot never ran); fp16
    # all-reduces stay on NCCL
    DTYPES = (torch.bfloat16, torch.float32)

    # a two-shot tensor's elements: a multiple of this (the ranks' halves stay 16-byte aligned)
    TWO_SHOT_MULTIPLE = 64

    def __init__(self, device: torch.device, max_bytes: int, two_shot_max_bytes: int = 0) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        state = get_state()
        self.group_name = state.device_group.group_name
        self.max_bytes = max_bytes
        self.two_shot_max_bytes = max(two_shot_max_bytes, 0)
        self.buffer = symm_mem.empty(max(max_bytes, self.two_shot_max_bytes), dtype=torch.uint8,
                                     device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    @classmethod
    def create(cls, device: torch.device) -> OneShotAllReduce | None:
        max_bytes = size_setting("KVFLEET_TP_ONE_SHOT_MAX_BYTES")
        if max_bytes <= 0:
            log.info("tensor-parallel all-reduce: NCCL for every size "
                     "(KVFLEET_TP_ONE_SHOT_MAX_BYTES=0)")
            return None
        two_shot_max = size_setting("KVFLEET_TP_TWO_SHOT_MAX_BYTES")
        one_shot, reason = _set_up_on_every_rank(lambda: cls(device, max_bytes, two_shot_max),
                                                 device)
        if one_shot is not None:
            log.info("tensor-parallel all-reduce: one-shot symmetric memory up to %d KiB, "
                     "two-shot up to %d KiB, NCCL above", max_bytes // 1024,
                     one_shot.two_shot_max_bytes // 1024)
            return one_shot
        log.info("tensor-parallel all-reduce: NCCL for every size (one-shot %s)", reason)
        return None

    def _self_check(self, device: torch.device) -> str | None:
        """Sum rank-dependent values both ways; the reason it must not be used, or None."""
        state = get_state()
        gen = torch.Generator(device="cpu").manual_seed(1234 + state.rank)
        for dtype in self.DTYPES:
            sizes = [min(8192, self.max_bytes // dtype.itemsize)]
            if self.two_shot_max_bytes > self.max_bytes:    # the two-shot path's largest
                n = self.two_shot_max_bytes // dtype.itemsize
                sizes.append(n - n % self.TWO_SHOT_MULTIPLE)
            for numel in sizes:
                x = torch.randn(numel, generator=gen).to(device=device, dtype=dtype)
                if not self.fits(x):
                    return f"self-check: {numel} {dtype} elements do not fit"
                ours = self(x.clone())
                nccl = x.clone()
                dist.all_reduce(nccl, group=state.device_group)
                if not torch.allclose(ours.float(), nccl.float(), rtol=1e-2, atol=1e-2):
                    return f"self-check: {numel} {dtype} sums differ from NCCL's"
        torch.cuda.synchronize(device)
        return None

    def _path(self, x: torch.Tensor) -> str | None:
        """"one", "two" (shot) or None (NCCL) for `x`."""
        if not (x.is_cuda and x.dtype in self.DTYPES and x.is_contiguous()):
            return None
        nbytes = x.numel() * x.element_size()
        if nbytes <= self.max_bytes:
            return "one"
        if nbytes <= self.two_shot_max_bytes and x.numel() % self.TWO_SHOT_MULTIPLE == 0:
            return "two"
        return None

    def fits(self, x: torch.Tensor) -> bool:
        return self._path(x) is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        n = x.numel()
        buffer = self.buffer.view(x.dtype)[:n]
        if n * x.element_size() <= self.max_bytes:       # fits() chose one-shot
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, x.view(-1), "sum",
                                                             self.group_name, out.view(-1))
        else:
            buffer.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_out(buffer, "sum", self.group_name,
                                                       out.view(-1))
        return out


class FusedAllReduceNorm:
    """The all-reduce of a row-parallel projection fused with the RMSNorm (and residual add)
    that consumes it (kvfleet_kernels.all_reduce): one launch instead of the one-shot
    all-reduce and the norm, for tensors of up to `max_bytes` (KVFLEET_TP_FUSED_NORM_MAX_BYTES,
    default 512 KiB: decode batches up to 64 rows of a 4096-wide model); larger ones take
    all_reduce then the norm. The row-parallel layers hand their unreduced output to the norm
    (`reduce_in_norm`) only where `fits` says this path serves it.

    `create` returns None (the unfused path) off CUDA, where KVFLEET_TP_FUSED_NORM_MAX_BYTES=0,
    or where symmetric memory or the self-check against NCCL + rms_norm fails on any rank;
    every rank takes the same decision.
    """

    DTYPES = (torch.bfloat16, torch.float16, torch.float32)

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from kvfleet_kernels.all_reduce import empty_mark
        state = get_state()
        self.rank, self.world = state.rank, state.size
        self.max_bytes = max_bytes
        self.slot_bytes = -(-max_bytes // 128) * 128
        # per dtype, two slots (consecutive calls alternate) of every rank's part, all empty
        self.region_bytes = 2 * self.world * self.slot_bytes
        self.buffer = symm_mem.empty(len(self.DTYPES) * self.region_bytes, dtype=torch.uint8,
                                     device=device)
        self.offsets = {}
        for i, dtype in enumerate(self.DTYPES):
            self.offsets[dtype] = start = i * self.region_bytes
            view, mark = empty_mark(dtype)
            self.buffer[start:start + self.region_bytes].view(view).fill_(mark)
        handle = symm_mem.rendezvous(self.buffer, state.device_group.group_name)
        self.bases = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64,
                                  device=device)
        torch.cuda.synchronize(device)

    @classmethod
    def create(cls, device: torch.device) -> FusedAllReduceNorm | None:
        max_bytes = size_setting("KVFLEET_TP_FUSED_NORM_MAX_BYTES")
        if max_bytes <= 0 or device.type != "cuda":
            log.info("tensor-parallel all-reduce + RMSNorm: not fused%s",
                     " (KVFLEET_TP_FUSED_NORM_MAX_BYTES=0)" if max_bytes <= 0 else "")
            return None
        # (the agreement after construction also means every rank's slots are empty before
        # any rank's first call)
        fused, reason = _set_up_on_every_rank(lambda: cls(device, max_bytes), device)
        if fused is not None:
            log.info("tensor-parallel all-reduce + RMSNorm fused up to %d KiB", max_bytes // 1024)
            return fused
        log.info("tensor-parallel all-reduce + RMSNorm: not fused (%s)", reason)
        return None

    def _self_check(self, device: torch.device) -> str | None:
        """Fused vs NCCL's all-reduce and then rms_norm_ref, on rank-dependent values (every
        dtype: a row, the largest batch, a row again; consecutive calls on alternate slots);
        the reason not to use it, or None."""
        from kvfleet_kernels.norm import rms_norm_ref
        state = get_state()
        gen = torch.Generator(device="cpu").manual_seed(4321 + state.rank)
        dim = 512
        calls = 0
        for dtype in self.DTYPES:
            for rows in (1, self.max_bytes // (dim * dtype.itemsize), 1):
                x = torch.randn(rows, dim, generator=gen).to(device=device, dtype=dtype)
                residual = torch.randn(rows, dim, generator=gen).to(device=device, dtype=dtype)
                weight = torch.rand(dim, generator=torch.Generator().manual_seed(7)).to(
                    device=device, dtype=dtype)
                if not self.fits(x):
                    return f"self-check: {rows} x {dim} {dtype} does not fit"
                out, summed = self(x, residual, weight, 1e-6, calls % 2)
                calls += 1
                total = x.clone()
                dist.all_reduce(total, group=state.device_group)
                ref, ref_summed = rms_norm_ref(total, weight, 1e-6, residual)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                if not (torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)
                        and torch.allclose(summed.float(), ref_summed.float(), rtol=tol,
                                           atol=tol)):
                    return f"self-check: {rows} x {dim} {dtype} differs from NCCL + rms_norm"
        torch.cuda.synchronize(device)
        return None

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.is_contiguous()
                and self.fits_output(x.shape[0], x.shape[1], x.dtype, x.device))

    def fits_output(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a contiguous [rows, cols] output of this dtype and device fits."""
        return (device.type == "cuda" and dtype in self.DTYPES
                and rows * cols * dtype.itemsize <= self.max_bytes and cols <= 16384)

    def slots(self, dtype: torch.dtype, slot: int):
        """Where a call on `slot` (0, 1) sends this dtype's parts (kvfleet_kernels.all_reduce's
        PeerSlots): what a GEMV pushing its output there needs (gemv's push=)."""
        from kvfleet_kernels.all_reduce import PeerSlots
        return PeerSlots(self.bases, self.rank, self.world,
                         self.offsets[dtype] + slot * self.world * self.slot_bytes,
                         self.slot_bytes)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, slot: int, pushed: bool = False):
        """Sum x over the ranks, then RMSNorm(sum + residual). Consecutive calls must use
        different slots (0, 1): the decoder's call sites alternate (reduce_in_norm).
        pushed: the GEMV that wrote x sent it to the peers' `slots(x.dtype, slot)` already."""
        from kvfleet_kernels.all_reduce import all_reduce_rms_norm
        to = self.slots(x.dtype, slot)
        return all_reduce_rms_norm(x, weight, eps, residual, to.bases, to.rank, to.world,
                                   to.offset, to.slot_bytes, pushed)


def fused_norm_for(x: torch.Tensor, norm) -> FusedAllReduceNorm | None:
    """The fused all-reduce + RMSNorm that serves `norm` on `x` (a row-parallel layer's
    output), or None. The layer (before it computes x: fused_norm_for_output) and the norm
    both ask about the same tensor: the layer leaves `x` unreduced exactly where the norm
    will reduce it."""
    if x.dim() != 2 or not x.is_contiguous():
        return None
    return fused_norm_for_output(x, x.shape[0], x.shape[1], norm)


def fused_norm_for_output(like: torch.Tensor, rows: int, cols: int,
                          norm) -> FusedAllReduceNorm | None:
    """fused_norm_for of a contiguous [rows, cols] output of `like`'s dtype and device."""
    fused = get_state().fused_norm
    if (fused is None or norm.fp8_out or norm.int8_out or norm.out_perm is not None
            or not fused.fits_output(rows, cols, like.dtype, like.device)
            or not use_triton(like)):
        return None
    return fused


_PUSHED = "_kvfleet_pushed_to_peers"


def mark_pushed(x: torch.Tensor) -> torch.Tensor:
    """Record that the GEMV that wrote `x` also sent it into the peers' slots of the fused
    all-reduce + RMSNorm (gemv's push=), so the norm only waits for theirs."""
    setattr(x, _PUSHED, True)
    return x


def was_pushed(x: torch.Tensor) -> bool:
    return getattr(x, _PUSHED, False)


def gather_to_first(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's `x` along the last dim on rank 0; other ranks get None."""
    state = get_state()
    if state.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.size)] if state.rank == 0 else None
    dist.gather(x, parts, dst=0, group=state.device_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (each rank sizes its KV pool from its own memory)."""
    state = get_state()
    if state.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.cpu_group)
    return int(t.item())


@dataclass
class StepInputs:
    """What every rank's forward needs for one step; rank 0 builds it from its schedule."""
    input_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T]
    meta: AttentionMetadata
    logits_rows: list[int]           # rows of the hidden states whose logits are needed
    # LoRA engines: each token's adapter slot [T] (-1: none) and the adapters to put into
    # slots first, ((slot, LoRARequest), ...) (kvfleet_runtime.lora.manager)
    lora_slots: torch.Tensor | None = None
    lora_loads: tuple = ()


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int                      # of its bytes in the packed buffer


_ALIGN = 16          # every tensor starts at a multiple of this in the packed buffer


def _pack_layout(tensors: list[torch.Tensor]) -> tuple[list[_TensorSpec], int]:
    """Where each tensor's bytes go in the packed buffer, and the buffer's size."""
    specs, offset = [], 0
    for t in tensors:
        specs.append(_TensorSpec(tuple(t.shape), t.dtype, offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return specs, offset


def _pack(tensors: list[torch.Tensor], specs: list[_TensorSpec], out: torch.Tensor) -> None:
    """Copy the tensors' bytes (any dtype, layout or device) into `out` (uint8, as long as the
    layout's size) at their specs' offsets, in one kernel on GPU; the padding is zeros."""
    pieces, end = [], 0
    pads = _Buffers.get_pads(out.device)
    for t, spec in zip(tensors, specs, strict=True):
        if spec.offset > end:
            pieces.append(pads[spec.offset - end])
        data = t.contiguous().view(-1)
        if data.device != out.device:
            data = data.to(out.device)
        data = data.view(torch.uint8)
        pieces.append(data)
        end = spec.offset + data.numel()
    if out.numel() > end:
        pieces.append(pads[out.numel() - end])
    if pieces:
        torch.cat(pieces, out=out)


def _unpack(buf: torch.Tensor, specs: list[_TensorSpec]) -> list[torch.Tensor]:
    """The tensors `_pack` put in `buf`, as views of it."""
    out = []
    for spec in specs:
        n = spec.dtype.itemsize
        for d in spec.shape:
            n *= d
        out.append(buf[spec.offset:spec.offset + n].view(spec.dtype).view(spec.shape))
    return out


def _flatten(step: StepInputs) -> dict[str, Any]:
    meta = {f"meta.{f.name}": getattr(step.meta, f.name) for f in fields(step.meta)}
    return {"input_ids": step.input_ids, "positions": step.positions,
            "logits_rows": step.logits_rows, "lora_slots": step.lora_slots,
            "lora_loads": step.lora_loads, **meta}


def _unflatten(flat: dict[str, Any]) -> StepInputs:
    meta = AttentionMetadata(**{k.removeprefix("meta."): v for k, v in flat.items()
                                if k.startswith("meta.")})
    return StepInputs(flat["input_ids"], flat["positions"], meta, flat["logits_rows"],
                      flat["lora_slots"], flat["lora_loads"])


# The control message is one broadcast of this many bytes: an 8-byte length, then the pickled
# skeleton (a decode step of ~1500 sequences fits); a longer pickle sends its rest in a second
# broadcast. broadcast_object_list would always take two (the size, then the bytes).
_CONTROL_BYTES = 16 * 1024
_HEADER = struct.Struct("<q")


class _Buffers:
    """This process's reused buffers: the control message and, per device, the packed tensors."""
    control: torch.Tensor | None = None
    packed: dict[torch.device, torch.Tensor] = {}
    pads: dict[torch.device, list[torch.Tensor]] = {}     # n -> n zero bytes, n < _ALIGN

    @classmethod
    def get_pads(cls, device: torch.device) -> list[torch.Tensor]:
        if device not in cls.pads:
            zeros = torch.zeros(_ALIGN, dtype=torch.uint8, device=device)
            cls.pads[device] = [zeros[:n] for n in range(_ALIGN)]
        return cls.pads[device]

    @classmethod
    def get_control(cls) -> torch.Tensor:
        if cls.control is None:
            cls.control = torch.zeros(_CONTROL_BYTES, dtype=torch.uint8)
        return cls.control

    @classmethod
    def get_packed(cls, device: torch.device, nbytes: int) -> torch.Tensor:
        buf = cls.packed.get(device)
        if buf is None or buf.numel() < nbytes:
            # grown by half again, so slowly growing batches do not reallocate every step
            size = max(nbytes, 64 * 1024, 0 if buf is None else buf.numel() * 3 // 2)
            buf = cls.packed[device] = torch.empty(size, dtype=torch.uint8, device=device)
        return buf[:nbytes]


def _broadcast_control(obj: Any, group: dist.ProcessGroup, is_src: bool) -> Any:
    """broadcast_object_list for one object, in one broadcast when its pickle is small."""
    control = _Buffers.get_control()
    room = _CONTROL_BYTES - _HEADER.size
    view = memoryview(control.numpy())
    if is_src:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        _HEADER.pack_into(view, 0, len(data))
        head = min(len(data), room)
        view[_HEADER.size:_HEADER.size + head] = data[:head]
        dist.broadcast(control, src=0, group=group)
        if len(data) > room:
            dist.broadcast(torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8),
                           src=0, group=group)
        return obj
    dist.broadcast(control, src=0, group=group)
    (length,) = _HEADER.unpack_from(view, 0)
    data = bytes(view[_HEADER.size:_HEADER.size + min(length, room)])
    if length > room:
        rest = torch.empty(length - room, dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=group)
        data += rest.numpy().tobytes()
    return pickle.loads(data)


@torch.inference_mode()
def broadcast_step(step: StepInputs | None, device: torch.device) -> StepInputs | None:
    """Rank 0 passes its step (None means stop); every rank returns it, tensors on `device`.

    On the other ranks the tensors are views of one buffer that the next call overwrites (in
    stream order on GPU: after the work already queued that reads them)."""
    state = get_state()
    if state.size == 1:
        return step
    if state.rank == 0:
        if step is None:
            _broadcast_control(None, state.cpu_group, is_src=True)
            return None
        flat = _flatten(step)
        names = [k for k, v in flat.items() if isinstance(v, torch.Tensor)]
        tensors = [flat[k] for k in names]
        specs, nbytes = _pack_layout(tensors)
        skeleton = {**flat, **dict(zip(names, specs, strict=True)), "_nbytes": nbytes}
        _broadcast_control(skeleton, state.cpu_group, is_src=True)
        if nbytes:
            buf = _Buffers.get_packed(device, nbytes)
            _pack(tensors, specs, buf)
            dist.broadcast(buf, src=0, group=state.device_group)
        return step
    skeleton = _broadcast_control(None, state.cpu_group, is_src=False)
    if skeleton is None:
        return None
    nbytes = skeleton.pop("_nbytes")
    names = [k for k, v in skeleton.items() if isinstance(v, _TensorSpec)]
    if nbytes:
        buf = _Buffers.get_packed(device, nbytes)
        dist.broadcast(buf, src=0, group=state.device_group)
    else:
        buf = torch.empty(0, dtype=torch.uint8, device=device)
    views = _unpack(buf, [skeleton[k] for k in names])
    return _unflatten({**skeleton, **dict(zip(names, views, strict=True))})
