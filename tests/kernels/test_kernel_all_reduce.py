"""The fused all-reduce + RMSNorm kernel against all_reduce_rms_norm_ref, one rank at a time.

Here the ranks' "symmetric" buffers are plain tensors of one process (in Triton's interpreter on
CPU, or on one GPU): the rank under test runs the kernel while its peers are played by hand,
their partial sums already sent into its buffer. The test checks the sum, the norm, what it
sent into each peer's buffer, that it emptied what it read, and that nothing else changed.
The kernel across real GPUs is tests/distributed/test_fused_norm_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.all_reduce import (
    MAX_PROGRAMS,
    all_reduce_rms_norm,
    all_reduce_rms_norm_ref,
    empty_mark,
)

# a handshake that never completes spins forever: fail instead
pytestmark = pytest.mark.timeout(300)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class Ranks:
    """world buffers laid out as the engine lays out one dtype's region: two slots, each with
    every rank's part, all empty (-0.0's bits) at first."""

    def __init__(self, world: int, slot_bytes: int, dtype: torch.dtype) -> None:
        self.world, self.slot_bytes = world, slot_bytes
        view, mark = empty_mark(dtype)
        self.buffers = [torch.full((2 * world * slot_bytes // view.itemsize,), mark, dtype=view,
                                   device=DEVICE).view(torch.uint8) for _ in range(world)]
        self.bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64,
                                  device=DEVICE)

    def offset(self, slot: int) -> int:
        return slot * self.world * self.slot_bytes

    def part_of(self, buffer: torch.Tensor, slot: int, source: int,
                like: torch.Tensor) -> torch.Tensor:
        """The bytes of `source`'s part in `buffer`, viewed as `like`."""
        start = self.offset(slot) + source * self.slot_bytes
        raw = buffer[start:start + like.numel() * like.element_size()]
        return raw.view(like.dtype).view(like.shape)

    def play_peers(self, rank: int, slot: int, parts: list[torch.Tensor]) -> None:
        """Every peer has sent its part into `rank`'s buffer."""
        for peer in range(self.world):
            if peer != rank:
                self.part_of(self.buffers[rank], slot, peer, parts[peer]).copy_(parts[peer])


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _check(world: int, rank: int, rows: int, dim: int, dtype: torch.dtype, slot: int,
           with_residual: bool, seed: int, pushed: bool = False) -> None:
    # pushed: the GEMV that wrote x sent it (gemv's push=, tests/kernels/test_kernel_gemv.py):
    # the kernel must not send it again
    gen = torch.Generator().manual_seed(seed)
    parts = [_randn(rows, dim, dtype=dtype, gen=gen) for _ in range(world)]
    parts[rank][0, :3] = -0.0          # sent as +0.0 (-0.0 marks "empty")
    residual = _randn(rows, dim, dtype=dtype, gen=gen) if with_residual else None
    weight = (1 + 0.1 * _randn(dim, dtype=torch.float32, gen=gen)).to(dtype)
    slot_bytes = -(-rows * dim * dtype.itemsize // 128) * 128
    ranks = Ranks(world, slot_bytes, dtype)
    ranks.play_peers(rank, slot, parts)
    before = [b.clone() for b in ranks.buffers]
    x_before = parts[rank].clone()

    got = all_reduce_rms_norm(parts[rank], weight, 1e-6, residual, ranks.bases, rank, world,
                              ranks.offset(slot), slot_bytes, pushed)
    ref = all_reduce_rms_norm_ref(parts, weight, 1e-6, residual)
    tol = TOLERANCE[dtype]
    if with_residual:
        torch.testing.assert_close(got[0], ref[0], rtol=tol, atol=tol)
        # the sum is rounded once, then the residual added and rounded: exactly the reference
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    assert torch.equal(parts[rank], x_before)
    # the buffers afterwards: `before` with exactly these changes, nothing else (not the other
    # slot, not another rank's part)
    expected = [b.clone() for b in before]
    sent = torch.where(x_before == 0, torch.zeros_like(x_before), x_before)
    view, mark = empty_mark(dtype)
    emptied = torch.full(sent.shape, mark, dtype=view, device=DEVICE).view(dtype)
    for peer in range(world):
        if peer != rank:
            if not pushed:
                ranks.part_of(expected[peer], slot, rank, sent).copy_(sent)   # into every peer's
            ranks.part_of(expected[rank], slot, peer, sent).copy_(emptied)    # read, emptied
    for owner, (b, e) in enumerate(zip(ranks.buffers, expected, strict=True)):
        assert torch.equal(b, e), f"rank {owner}'s buffer"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world, rank", [(2, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("pushed", [False, True])
def test_one_row_sums_every_rank_then_normalises(world, rank, dtype, pushed):
    _check(world, rank, rows=1, dim=96, dtype=dtype, slot=rank % 2, with_residual=True,
           seed=10 * world + rank, pushed=pushed)


@pytest.mark.parametrize("with_residual", [True, False])
def test_rows_beyond_the_program_count_are_looped_over(with_residual):
    # MAX_PROGRAMS programs, each taking several rows, and a width that is not a power of two
    _check(2, 1, rows=MAX_PROGRAMS + 7, dim=48, dtype=torch.float32, slot=1,
           with_residual=with_residual, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
def test_gemvs_that_push_then_norms_that_only_wait_reduce_like_the_reference(dtype, gated):
    # Both ranks of two played in one process, in the order the GPUs may run them: each
    # rank's batch-1 GEMV (gemv's push=) sends its output into the other's slot, then each
    # rank's norm (pushed=True) sums. Same result on both ranks, the reference's, and every
    # slot empty again afterwards.
    from kvfleet_kernels.all_reduce import PeerSlots
    from kvfleet_kernels.gemv import GemvConfig, gemv, gemv_ref
    world, rows, dim, k, slot = 2, 1, 80, 96, 1
    gen = torch.Generator().manual_seed(5 + gated)
    xs = [_randn(rows, 2 * k if gated else k, dtype=dtype, gen=gen) for _ in range(world)]
    ws = [_randn(dim, k, dtype=dtype, gen=gen) * 0.1 for _ in range(world)]
    if dtype != torch.float32:
        ws[0][3] = 0.0             # output column 3 of rank 0: a tiny negative sum, rounded
        ws[0][3, 0] = -1e-5        # to -0.0 in 16 bits (sent as +0.0)
        xs[0][0, 0] = 1e-3 if gated else 1e-4
        if gated:
            xs[0][0, k] = 1e-3
    residual = _randn(rows, dim, dtype=dtype, gen=gen)
    weight = (1 + 0.1 * _randn(dim, dtype=torch.float32, gen=gen)).to(dtype)
    slot_bytes = 512
    ranks = Ranks(world, slot_bytes, dtype)
    empty = [b.clone() for b in ranks.buffers]
    cfg = GemvConfig(16, 32, 1, 4, 1, prefetch=True)
    parts = []
    for rank in range(world):
        to = PeerSlots(ranks.bases, rank, world, ranks.offset(slot), slot_bytes)
        parts.append(gemv(xs[rank], ws[rank], None, cfg, gated=gated, push=to))
        assert torch.equal(parts[rank], gemv(xs[rank], ws[rank], None, cfg, gated=gated))
        torch.testing.assert_close(parts[rank].float(),
                                   gemv_ref(xs[rank], ws[rank], gated=gated).float(),
                                   rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if dtype != torch.float32:
        assert str(parts[0][0, 3].item()) == "-0.0"
    got = [all_reduce_rms_norm(parts[r], weight, 1e-6, residual, ranks.bases, r, world,
                               ranks.offset(slot), slot_bytes, pushed=True)
           for r in range(world)]
    ref = all_reduce_rms_norm_ref(parts, weight, 1e-6, residual)
    for out, summed in got:
        assert torch.equal(out, got[0][0]) and torch.equal(summed, got[0][1])
        torch.testing.assert_close(out, ref[0], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        torch.testing.assert_close(summed, ref[1], rtol=0, atol=0)
    for b, e in zip(ranks.buffers, empty, strict=True):
        assert torch.equal(b, e)


def test_bad_arguments_are_named():
    x = torch.zeros(1, 64, device=DEVICE)
    bases = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        all_reduce_rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, None, bases, 2, 2, 0, 256)
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\)"):
        all_reduce_rms_norm(x, torch.ones(32, device=DEVICE), 1e-6, None, bases, 0, 2, 0, 256)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        all_reduce_rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, torch.zeros(2, 64), bases,
                            0, 2, 0, 256)
    with pytest.raises(ValueError, match="does not fit a slot of 128 bytes"):
        all_reduce_rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, None, bases, 0, 2, 0, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_llama_width_in_bf16(rows):
    for rank in range(2):
        _check(2, rank, rows=rows, dim=4096, dtype=torch.bfloat16, slot=rank, with_residual=True,
               seed=rows + rank)
