"""This process's place in the tensor-parallel group: rank, size and the process groups.

Set once per process before the model is built (layers read the rank and size while they
create their shards) and reset when the engine shuts down. A process that never joins a
group is rank 0 of 1, so single-GPU code paths never touch torch.distributed.

Two groups: `device_group` carries the forward's all-reduces and gathers (NCCL on GPU,
gloo on CPU); `cpu_group` (always gloo) carries the step's small control messages, so a
worker idling between steps waits on a socket, not on a GPU collective.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# workers wait for the next step on the control group for as long as the server idles;
# a dead peer still fails a wait at once (gloo sees the socket close)
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class ParallelState:
    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    one_shot: object | None = None       # communication.OneShotAllReduce, on CUDA when it works
    fused_norm: object | None = None     # communication.FusedAllReduceNorm, on CUDA when it works


_state = ParallelState()


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.size


def get_state() -> ParallelState:
    return _state


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float) -> None:
    """Join the group of `size` ranks as `rank`; every rank calls this with the same arguments
    but its rank. `timeout_s` bounds the device collectives (and the rendezvous)."""
    global _state
    if _state.size > 1:
        raise RuntimeError(f"this process is already rank {_state.rank} of a tensor-parallel "
                           f"group of {_state.size}; shut that engine down first")
    if device.type == "cuda":
        # NVLink multicast (NVLS) is off on the machines we run on (see docs/TENSOR_PARALLEL.md)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(rank if device.index is None else device.index)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _state = ParallelState(rank=rank, size=size, device_group=device_group, cpu_group=cpu_group)
    if device.type == "cuda":
        from kvfleet_runtime.distributed.communication import FusedAllReduceNorm, OneShotAllReduce
        _state.one_shot = OneShotAllReduce.create(device)
        _state.fused_norm = FusedAllReduceNorm.create(device)


_abandoned = False      # a group's teardown hung and was left behind (forget_tensor_parallel)


def forget_tensor_parallel() -> None:
    """Become rank 0 of 1 again without leaving the group (its teardown hung): collectives
    are no longer issued through it; torch still counts it as initialised."""
    global _state, _abandoned
    _state = ParallelState()
    _abandoned = True


def teardown_abandoned() -> bool:
    return _abandoned


def finish_process(code: int) -> int:
    """`code`, or, where a group's teardown was left behind, end the process now with it: the
    interpreter's exit would run the same NCCL teardown (the group's destructor) and hang."""
    if _abandoned:
        import sys
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        logging.shutdown()
        os._exit(code)
    return code


def destroy_tensor_parallel() -> None:
    """Leave the group (if any) and become rank 0 of 1 again."""
    global _state
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as e:    # groups aborted after a rank died (NCCL)
            log.warning("leaving the tensor-parallel group: %s", e)
    _state = ParallelState()
