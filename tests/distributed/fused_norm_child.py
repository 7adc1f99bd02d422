"""One rank of test_fused_norm_gpu.py: joins a group of WORLD GPUs (NCCL), then checks the
fused all-reduce + RMSNorm the engine set up (distributed.communication.FusedAllReduceNorm)
against the reference, eagerly and replayed from a CUDA graph, and times it against the
unfused pair. Prints one JSON line.

    python fused_norm_child.py RANK WORLD INIT_METHOD
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from kvfleet_kernels import gemv as gemv_module
from kvfleet_kernels.all_reduce import all_reduce_rms_norm_ref
from kvfleet_kernels.norm import rms_norm
from kvfleet_runtime.distributed.communication import all_reduce
from kvfleet_runtime.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_state,
    init_tensor_parallel,
)

DIM = 4096


def _inputs(world: int, rows: int, dtype: torch.dtype, seed: int, device: torch.device):
    """Every rank's part, the residual and the weight: the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(rows, DIM, generator=gen).to(device=device, dtype=dtype)
             for _ in range(world)]
    residual = torch.randn(rows, DIM, generator=gen).to(device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(DIM, generator=gen)).to(device=device, dtype=dtype)
    return parts, residual, weight


def _same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(get_state().size)]
    dist.all_gather(gathered, t.contiguous(), group=get_state().device_group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _quiesce(device: torch.device) -> None:
    """Every rank's GPU idle: calls on either side of this may use the same slot."""
    torch.cuda.synchronize(device)
    dist.barrier(group=get_state().cpu_group)


def _max_err(got, ref) -> float:
    return max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, ref, strict=True))


def main(rank: int, world: int, init_method: str) -> int:
    device = torch.device(f"cuda:{rank}")
    init_tensor_parallel(rank, world, init_method, device, timeout_s=60)
    fused = get_state().fused_norm
    result = {"rank": rank, "fused": fused is not None}
    if fused is None:
        print(json.dumps(result), flush=True)
        return 0
    # eager: many calls in a row (both slots, every flag reused), batch sizes up to the limit
    errors, same = [], True
    max_rows = fused.max_bytes // (DIM * 2)
    for i in range(60):
        dtype = (torch.bfloat16, torch.float16, torch.float32)[i % 3]
        rows = (1, 2, 7, max_rows)[i % 4]
        if rows * DIM * dtype.itemsize > fused.max_bytes:
            rows = fused.max_bytes // (DIM * dtype.itemsize)
        parts, residual, weight = _inputs(world, rows, dtype, 100 + i, device)
        x = parts[rank].clone()
        assert fused.fits(x)
        got = fused(x, residual, weight, 1e-5, i % 2)
        ref = all_reduce_rms_norm_ref(parts, weight, 1e-5, residual)
        errors.append((str(dtype), rows, _max_err(got, ref)))
        same = same and _same_on_every_rank(got[0]) and _same_on_every_rank(got[1])
    result.update(eager_errors=errors, eager_same_on_every_rank=same)
    _quiesce(device)

    # a CUDA graph of four fused calls (slots 0 1 0 1: consecutive calls alternate, across
    # replays too), replayed with new inputs each time
    parts, residual, weight = _inputs(world, 1, torch.bfloat16, 7, device)
    static_x = [parts[rank].clone() for _ in range(4)]
    static_r = residual.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fused(static_x[0], static_r, weight, 1e-5, 0)        # warm (compiled) before capture
        _quiesce(device)
        with torch.cuda.graph(graph, stream=stream):
            outs, summed = [], static_r
            for c in range(4):
                out, summed = fused(static_x[c], summed, weight, 1e-5, c % 2)
                outs += [out, summed]
    torch.cuda.current_stream(device).wait_stream(stream)
    graph_errors = []
    for i in range(50):
        calls = [_inputs(world, 1, torch.bfloat16, 1000 + 4 * i + c, device) for c in range(4)]
        for c in range(4):
            static_x[c].copy_(calls[c][0][rank])
        static_r.copy_(calls[0][1])
        graph.replay()
        refs, summed = [], calls[0][1]
        for c in range(4):
            ref_out, summed = all_reduce_rms_norm_ref(calls[c][0], weight, 1e-5, summed)
            refs += [ref_out, summed]
        graph_errors.append(_max_err(outs, refs))
    result.update(graph_max_error=max(graph_errors),
                  graph_same_on_every_rank=_same_on_every_rank(outs[-2]))

    _quiesce(device)
    # the batch-1 GEMVs that send their output themselves (gemv's push=), each followed by the
    # fused norm that only waits (pushed=True): a CUDA graph of four such pairs, replayed
    k = DIM // 2
    gen = torch.Generator().manual_seed(99)
    weights = [(0.02 * torch.randn(DIM, k, generator=gen)).to(device=device, dtype=torch.bfloat16)
               for _ in range(world)]
    static_in = [torch.empty(1, k, device=device, dtype=torch.bfloat16) for _ in range(4)]
    cfg = gemv_module.pick_config(1, DIM, k, device)
    cfg = gemv_module.GemvConfig(**{**cfg.__dict__, "split_k": 1})

    def pushed_chain(residual: torch.Tensor):
        outs = []
        for c in range(4):
            part = gemv_module.gemv(static_in[c], weights[rank], None, cfg,
                                    push=fused.slots(torch.bfloat16, c % 2))
            out, residual = fused(part, residual, weight, 1e-5, c % 2, pushed=True)
            outs += [out, residual]
        return outs

    with torch.cuda.stream(stream):
        _quiesce(device)
        pushed_chain(static_r)                 # warm (compiled) before capture
        _quiesce(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = pushed_chain(static_r)
    torch.cuda.current_stream(device).wait_stream(stream)
    pushed_errors = []
    for i in range(20):
        g = torch.Generator().manual_seed(5000 + i)
        ins = [[torch.randn(1, k, generator=g).to(device=device, dtype=torch.bfloat16)
                for _ in range(world)] for _ in range(4)]
        r0 = torch.randn(1, DIM, generator=g).to(device=device, dtype=torch.bfloat16)
        for c in range(4):
            static_in[c].copy_(ins[c][rank])
        static_r.copy_(r0)
        graph.replay()
        refs, summed = [], r0
        for c in range(4):
            parts_c = [gemv_module.gemv_ref(ins[c][q], weights[q]) for q in range(world)]
            ref_out, summed = all_reduce_rms_norm_ref(parts_c, weight, 1e-5, summed)
            refs += [ref_out, summed]
        pushed_errors.append(_max_err(outs, refs))
    result.update(pushed_max_error=max(pushed_errors),
                  pushed_same_on_every_rank=_same_on_every_rank(outs[-2]))

    _quiesce(device)
    # batch-1 time per call, from graphs of 64 calls: fused vs all_reduce + rms_norm; and
    # o_proj's GEMV (TP=2 shape) + fused norm with and without the GEMV sending its output
    x, r = parts[rank].clone(), residual.clone()
    timings = {}
    for name in ("fused", "unfused", "gemv+fused", "gemv_push+fused"):
        slots = [0]

        def call(x=x, r=r, name=name, slots=slots):
            slots[0] ^= 1
            if name == "gemv_push+fused":
                part = gemv_module.gemv(static_in[0], weights[rank], None, cfg,
                                        push=fused.slots(torch.bfloat16, slots[0]))
                return fused(part, r, weight, 1e-5, slots[0], pushed=True)
            if name == "gemv+fused":
                part = gemv_module.gemv(static_in[0], weights[rank], None, cfg)
                return fused(part, r, weight, 1e-5, slots[0])
            if name == "fused":
                return fused(x, r, weight, 1e-5, slots[0])
            return rms_norm(all_reduce(x), weight, 1e-5, r)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            call()
            _quiesce(device)
            with torch.cuda.graph(g, stream=stream):
                for _ in range(64):
                    call()
        _quiesce(device)
        start = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize(device)
        timings[name] = (time.perf_counter() - start) / (20 * 64) * 1e6
        _quiesce(device)
    result["us_per_call"] = timings
    print(json.dumps(result), flush=True)
    torch.cuda.synchronize(device)
    destroy_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
