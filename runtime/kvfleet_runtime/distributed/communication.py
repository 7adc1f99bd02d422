"""Collectives of the tensor-parallel group; each is a no-op (or the identity) at size 1.

`broadcast_step` is how rank 0 hands the step it scheduled (`StepInputs`) to the other ranks:
the small Python values go through the gloo control group as one pickled object, the tensors
through the device group (on GPU they never visit the host).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from kvfleet_runtime.distributed.parallel_state import get_state
from kvfleet_runtime.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks; returns the sum (`x` itself, summed in place, or a new tensor)."""
    state = get_state()
    if state.size > 1:
        one_shot = state.one_shot
        if one_shot is not None and one_shot.fits(x):
            return one_shot(x)
        dist.all_reduce(x, group=state.device_group)
    return x


class OneShotAllReduce:
    """Small all-reduces through symmetric memory (`torch.ops.symm_mem`): each rank copies its
    tensor into a buffer every peer can read over NVLink, and one kernel sums all ranks' copies.
    A decode step's all-reduces are a few KB (batch 1: 8 KB, 2 per layer) where NCCL's launch
    and protocol latency, not bandwidth, is the cost; larger tensors stay on NCCL.

    `create` returns None (NCCL for everything) where symmetric memory is unavailable, where
    KVFLEET_TP_ONE_SHOT_MAX_BYTES=0, or where its self-check against NCCL fails on any rank;
    every rank takes the same decision.
    """

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        state = get_state()
        self.group_name = state.device_group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    @classmethod
    def create(cls, device: torch.device) -> OneShotAllReduce | None:
        max_bytes = int(os.environ.get("KVFLEET_TP_ONE_SHOT_MAX_BYTES", str(512 * 1024)))
        if max_bytes <= 0:
            log.info("tensor-parallel all-reduce: NCCL for every size "
                     "(KVFLEET_TP_ONE_SHOT_MAX_BYTES=0)")
            return None
        # agree after each step that can fail on its own, so no rank enters a collective
        # (the self-check) that another rank skips
        one_shot, reason = None, "failed on another rank"
        try:
            one_shot = cls(device, max_bytes)
        except Exception as e:    # no P2P access, a torch without symm_mem, ...
            reason = f"unavailable: {type(e).__name__}: {e}"
        if min_over_ranks(int(one_shot is not None)):
            try:
                reason = one_shot._self_check(device)
            except Exception as e:
                reason = f"self-check raised {type(e).__name__}: {e}"
            if min_over_ranks(int(reason is None)):
                log.info("tensor-parallel all-reduce: one-shot symmetric memory up to %d KiB, "
                         "NCCL above", max_bytes // 1024)
                return one_shot
            reason = reason or "self-check failed on another rank"
        log.info("tensor-parallel all-reduce: NCCL for every size (one-shot %s)", reason)
        return None

    def _self_check(self, device: torch.device) -> str | None:
        """Sum rank-dependent values both ways; the reason it must not be used, or None."""
        state = get_state()
        gen = torch.Generator(device="cpu").manual_seed(1234 + state.rank)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            numel = min(8192, self.max_bytes // dtype.itemsize)
            x = torch.randn(numel, generator=gen).to(device=device, dtype=dtype)
            ours = self(x.clone())
            nccl = x.clone()
            dist.all_reduce(nccl, group=state.device_group)
            if not torch.allclose(ours.float(), nccl.float(), rtol=1e-2, atol=1e-2):
                return f"self-check: {dtype} sums differ from NCCL's"
        torch.cuda.synchronize(device)
        return None

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.numel() * x.element_size() <= self.max_bytes
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        n = x.numel()
        buffer = self.buffer.view(x.dtype)[:n]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, x.view(-1), "sum", self.group_name,
                                                         out.view(-1))
        return out


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


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _flatten(step: StepInputs) -> dict[str, Any]:
    meta = {f"meta.{f.name}": getattr(step.meta, f.name) for f in fields(step.meta)}
    return {"input_ids": step.input_ids, "positions": step.positions,
            "logits_rows": step.logits_rows, **meta}


def _unflatten(flat: dict[str, Any]) -> StepInputs:
    meta = AttentionMetadata(**{k.removeprefix("meta."): v for k, v in flat.items()
                                if k.startswith("meta.")})
    return StepInputs(flat["input_ids"], flat["positions"], meta, flat["logits_rows"])


def broadcast_step(step: StepInputs | None, device: torch.device) -> StepInputs | None:
    """Rank 0 passes its step (None means stop); every rank returns it, tensors on `device`."""
    state = get_state()
    if state.size == 1:
        return step
    if state.rank == 0:
        flat = None if step is None else _flatten(step)
        skeleton = None if flat is None else {
            k: _TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
            for k, v in flat.items()}
        dist.broadcast_object_list([skeleton], src=0, group=state.cpu_group)
        for v in (flat or {}).values():
            if isinstance(v, torch.Tensor):
                dist.broadcast(v.contiguous(), src=0, group=state.device_group)
        return step
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=state.cpu_group)
    if box[0] is None:
        return None
    flat = {}
    for k, v in box[0].items():     # same order as rank 0 sent the tensors
        if isinstance(v, _TensorSpec):
            v_t = torch.empty(v.shape, dtype=v.dtype, device=device)
            dist.broadcast(v_t, src=0, group=state.device_group)
            v = v_t
        flat[k] = v
    return _unflatten(flat)
