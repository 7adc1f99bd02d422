"""Collectives of the tensor-parallel group; each is a no-op (or the identity) at size 1.

`broadcast_step` is how rank 0 hands the step it scheduled (`StepInputs`) to the other ranks:
the small Python values go through the gloo control group as one pickled object, the tensors
through the device group (on GPU they never visit the host).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from kvfleet_runtime.distributed.parallel_state import get_state
from kvfleet_runtime.layers.attention import AttentionMetadata


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns it."""
    state = get_state()
    if state.size > 1:
        dist.all_reduce(x, group=state.device_group)
    return x


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
