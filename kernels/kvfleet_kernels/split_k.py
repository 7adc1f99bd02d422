"""Split-K for GEMV kernels, reduced inside the same launch (shared by the bf16 and W4A16 GEMVs).

A GEMV whose output tiles alone cannot fill the GPU splits K across programs. Instead of a
zero-filled fp32 buffer, atomic adds and a cast kernel (three launches), each program stores
its fp32 partial, counts itself in on its output tile's arrival counter, and the program that
arrives last sums the partials, adds the bias, writes the output and resets the counter to 0
for the next launch. Launches run one after another on a stream, so all layers of one shape
share one workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.activation import silu_mul

# K slices whose partials the last program loads at once. H200, batch-1 W4A16 GEMVs of the 8B
# shape (qkv / o / gate_up / down, us): one at a time 8.9 / 7.6 / 22.6 / 15.3; 8 at a time
# 8.3 / 6.8 / 22.0 / 13.8; 16: 8.1 / 6.3 / 21.8 / 13.1 (GPTQ batch 1 417.8 -> 426.8 tok/s);
# 32: 7.9 / 6.4 / 21.8 / 12.8 (docs/PERFORMANCE.md, fourteenth session)
MEET_ROWS = tl.constexpr(16)


@triton.jit
def store_or_reduce(acc, out_ptr, b_ptr, part_ptr, count_ptr, m, M, N, offs_n, mask_n,
                    pid_n, pid_k, split_k, HAS_BIAS: tl.constexpr):
    """acc: this program's fp32 [BLOCK_N] sum over its K slice, for row m and columns offs_n.
    Returns whether this program wrote the output tile (the only one with split_k == 1, else
    the last of its tile's slices to arrive)."""
    out_ptrs = out_ptr + m * N + offs_n
    done = split_k == 1
    if split_k == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(part_ptr + (pid_k * M + m) * N + offs_n, acc, mask=mask_n)
        # every thread's partial is written before one thread counts the program in; the
        # release (gpu scope, cumulative over the barrier) publishes them, the acquire of the
        # last arrival makes the others' visible to it
        tl.debug_barrier()
        counter = count_ptr + m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        done = arrived == split_k - 1
        if done:
            # the partials MEET_ROWS slices at a time: their loads in flight together (one at a
            # time, the meeting was ~60 ns a slice on the H200, 2.5-4.3 us of a 7-23 us GEMV;
            # bench_w4a16.py --floor)
            total = tl.zeros(acc.shape, dtype=tl.float32)
            rows = tl.arange(0, MEET_ROWS)[:, None]
            for first in range(0, split_k, MEET_ROWS):
                part = first + rows
                total += tl.sum(tl.load(part_ptr + (part * M + m) * N + offs_n[None, :],
                                        mask=(part < split_k) & mask_n[None, :], other=0.0,
                                        cache_modifier=".cg"), axis=0)
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return done


@triton.jit
def meet_gate_up(out_ptr, act_ptr, pair_ptr, m, N, offs_n, mask_n, pid_n):
    """A gated MLP's gate_up GEMV ([gate | up] across its N columns, a tile wholly in one half):
    called by the program that wrote its output tile (store_or_reduce's True), it counts the
    tile in on its pair's counter (gate tile t with up tile t + tiles / 2), and the second of
    the pair writes SiLU(gate) * up of those columns into act ([M, N / 2]) from both tiles'
    stored outputs (silu_mul on the rounded values: the activation kernel's bits), then puts
    the counter back to 0. The down projection then needs no activation launch."""
    half = N // 2
    pairs = tl.num_programs(1) // 2
    # every thread's stores of the tile precede the count; acq_rel as store_or_reduce's
    tl.debug_barrier()
    counter = pair_ptr + m * pairs + pid_n % pairs
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == 1:
        i = offs_n % half
        row = out_ptr + m * N
        gate = tl.load(row + i, mask=mask_n, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(row + half + i, mask=mask_n, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(act_ptr + m * half + i, silu_mul(gate, up, act_ptr.dtype.element_ty),
                 mask=mask_n)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


# per (device, M, N, split_k, output tiles): fp32 partials [split_k, M, N] and the counters
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device, m: int, n: int, split_k: int, n_tiles: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch's (partials, counters); split_k == 1 gets one-element stand-ins (never
    touched) of the same types. First met in an eager launch (CUDA-graph capture is preceded
    by one), so never allocated inside a capture."""
    if split_k == 1:
        m = n = n_tiles = 1
    key = (device, m, n, split_k, n_tiles)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = (torch.empty(split_k * m * n, dtype=torch.float32, device=device),
              torch.zeros(m * n_tiles, dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


def split_for(tiles: int, k_tiles: int, programs_per_sm: int, device: torch.device,
              min_k_tiles: int = 2) -> int:
    """K slices so that (output tiles x slices) is about programs_per_sm per SM, each slice
    at least min_k_tiles K tiles long."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 1)
    return max(1, min(k_tiles // min_k_tiles, triton.cdiv(programs_per_sm * sms, tiles)))
