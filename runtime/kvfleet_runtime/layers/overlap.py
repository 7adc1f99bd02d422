"""Decode steps as two half-batches: one half's attention runs while the other's GEMMs do.

At 1000/1000's contexts a decode step is about half attention (memory-bound: it reads the KV
cache) and half GEMMs (compute-bound), and on one stream they take turns. Here the batch is cut
into halves A and B; each half's attention runs on a side stream while the main stream runs the
other half's projections and MLP:

    main:  pre 0A  pre 0B  post 0A  pre 1A  post 0B  pre 1B  post 1A  pre 2A ...
    side:         attn 0A  attn 0B          attn 1A          attn 1B ...

pre = input norm, qkv, rotary + cache write; post = o_proj, norm, MLP (DecoderLayer). Each
attention waits for its own pre (the side stream waits on the main stream), and each post waits
for its own attention only (an event recorded after it), so `attn 0B` overlaps `post 0A, pre
1A`. Both halves plan their split-KV partitions for the whole batch (plan_num_seqs), so a row's
attention is computed exactly as without the split.

Off by default; `KVFLEET_DECODE_OVERLAP=N` turns it on for decode steps of at least N sequences
(Triton path, one GPU). Also under CUDA graphs: the side stream joins the capture through the
events. Experiments: `KVFLEET_OVERLAP_CARVEOUT=S` runs the overlapped steps' GEMMs through
cuBLASLt on all SMs but S (leaving S to the attention), `KVFLEET_OVERLAP_HIGH_PRIORITY=0` gives
the side stream normal priority (default: high, so attention blocks take SMs as they free up).
On a CPU (Triton's interpreter, the tests) the same schedule runs on one stream.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvfleet_runtime.distributed.parallel_state import get_tp_size
from kvfleet_runtime.layers.attention import AttentionMetadata
from kvfleet_runtime.layers.backend import use_triton


@dataclass(frozen=True)
class OverlapSettings:
    min_batch: int             # 0: off
    carveout: int | None       # SMs cuBLAS leaves free in overlapped steps; None: untouched
    high_priority: bool


def overlap_settings() -> OverlapSettings:
    """The KVFLEET_DECODE_OVERLAP / _OVERLAP_CARVEOUT / _OVERLAP_HIGH_PRIORITY settings."""
    from kvfleet_kernels.env import env_int, on_off

    def read(name: str) -> str:
        return os.environ.get(name, "")

    carveout = read("KVFLEET_OVERLAP_CARVEOUT")
    return OverlapSettings(
        min_batch=env_int("KVFLEET_DECODE_OVERLAP", read("KVFLEET_DECODE_OVERLAP"), 0, 0),
        carveout=env_int("KVFLEET_OVERLAP_CARVEOUT", carveout, 0, 0) if carveout else None,
        high_priority=on_off("KVFLEET_OVERLAP_HIGH_PRIORITY",
                             read("KVFLEET_OVERLAP_HIGH_PRIORITY")))


# read once: every forward pass asks
SETTINGS = overlap_settings()


def decode_halves(x: torch.Tensor, meta: AttentionMetadata
                  ) -> tuple[AttentionMetadata, AttentionMetadata] | None:
    """The two halves' metadata where this step runs overlapped, else None. x: [T, D]."""
    n = x.shape[0]
    if (not SETTINGS.min_batch or n < max(SETTINGS.min_batch, 2) or meta.max_query_len != 1
            or not use_triton(x) or get_tp_size() != 1):
        return None
    h = n // 2
    plan = meta.plan_num_seqs or n

    def half(rows: slice, count: int) -> AttentionMetadata:
        # decode: one token a sequence, so each half's query_start_loc is 0, 1, ..., count
        return AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows], block_tables=meta.block_tables[rows],
            seq_lens=meta.seq_lens[rows], query_start_loc=meta.query_start_loc[: count + 1],
            max_query_len=1, max_seq_len=meta.max_seq_len, plan_num_seqs=plan, min_query_len=1)

    return half(slice(0, h), h), half(slice(h, n), n - h)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=-1 if SETTINGS.high_priority else 0)


@contextlib.contextmanager
def _gemm_carveout() -> Iterator[None]:
    if SETTINGS.carveout is None:
        yield
        return
    backend = torch.backends.cuda.preferred_blas_library()
    before = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(SETTINGS.carveout or None)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)
        torch.backends.cuda.preferred_blas_library(backend)


def run_layers(layers: Sequence, positions: torch.Tensor, x: torch.Tensor,
               halves: tuple[AttentionMetadata, AttentionMetadata]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers over the two halves (module docstring) -> (x, residual), [T, D]
    each, as the plain layer loop returns them."""
    h = halves[0].seq_lens.shape[0]
    rows = (slice(0, h), slice(h, x.shape[0]))
    xs = [x[r] for r in rows]
    pos = [positions[r] for r in rows]
    res: list[torch.Tensor | None] = [None, None]
    side = _side_stream(x.device) if x.is_cuda else None
    # per half: (q, attention output, its event). q stays referenced until the main stream has
    # waited for the attention that reads it: the allocator may then hand its memory on
    inflight: list[tuple | None] = [None, None]

    def start(i: int, layer) -> None:
        q, res[i] = layer.pre_attention(pos[i], xs[i], res[i], halves[i])
        if side is None:
            inflight[i] = (q, layer.self_attn.attend(q, halves[i]), None)
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = layer.self_attn.attend(q, halves[i])
            done = torch.cuda.Event()
            done.record(side)
        inflight[i] = (q, out, done)

    def finish(i: int, layer) -> None:
        _, out, done = inflight[i]
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        inflight[i] = None
        xs[i], res[i] = layer.post_attention(out, res[i])

    with _gemm_carveout():
        for i in (0, 1):
            start(i, layers[0])
        for n, layer in enumerate(layers):
            for i in (0, 1):
                finish(i, layer)
                if n + 1 < len(layers):
                    start(i, layers[n + 1])
    return torch.cat(xs), torch.cat(res)
