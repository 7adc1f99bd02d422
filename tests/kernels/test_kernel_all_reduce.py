"""The fused all-reduce + RMSNorm kernel against all_reduce_rms_norm_ref, one rank at a time.

Here the ranks' "symmetric" buffers are plain tensors of one process (in Triton's interpreter on
CPU, or on one GPU): the rank under test runs the kernel while its peers are played by hand,
their partial sums already in their slots and their flags already raised. The test checks the
sum, the norm, the handshake (each peer's flag for this rank raised, this rank's flags taken)
and that the other slot and the inputs are untouched. The kernel across real GPUs is
tests/distributed/test_fused_norm_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.all_reduce import (
    FLAGS_BYTES,
    MAX_PROGRAMS,
    all_reduce_rms_norm,
    all_reduce_rms_norm_ref,
)

# a handshake that never completes spins forever: fail instead
pytestmark = pytest.mark.timeout(300)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class Ranks:
    """world buffers laid out as the kernel expects: flags, then two slots."""

    def __init__(self, world: int, slot_bytes: int) -> None:
        self.world, self.slot_bytes = world, slot_bytes
        self.buffers = [torch.zeros(FLAGS_BYTES + 2 * slot_bytes, dtype=torch.uint8, device=DEVICE)
                        for _ in range(world)]
        self.bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64,
                                  device=DEVICE)

    def flags(self, rank: int) -> torch.Tensor:
        return self.buffers[rank][:FLAGS_BYTES].view(torch.int32).view(MAX_PROGRAMS, -1)[:, :self.world]

    def slot(self, rank: int, slot: int, like: torch.Tensor) -> torch.Tensor:
        start = FLAGS_BYTES + slot * self.slot_bytes
        raw = self.buffers[rank][start:start + like.numel() * like.element_size()]
        return raw.view(like.dtype).view(like.shape)

    def play_peers(self, rank: int, slot: int, parts: list[torch.Tensor], programs: int) -> None:
        """Every peer has copied its part and raised its flag for `rank` (one per program)."""
        for peer in range(self.world):
            if peer != rank:
                self.slot(peer, slot, parts[peer]).copy_(parts[peer])
                self.flags(rank)[:programs, peer] = 1


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _check(world: int, rank: int, rows: int, dim: int, dtype: torch.dtype, slot: int,
           with_residual: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    parts = [_randn(rows, dim, dtype=dtype, gen=gen) for _ in range(world)]
    residual = _randn(rows, dim, dtype=dtype, gen=gen) if with_residual else None
    weight = (1 + 0.1 * _randn(dim, dtype=torch.float32, gen=gen)).to(dtype)
    slot_bytes = -(-rows * dim * dtype.itemsize // 128) * 128
    ranks = Ranks(world, slot_bytes)
    programs = min(rows, MAX_PROGRAMS)
    ranks.play_peers(rank, slot, parts, programs)
    other_slot = ranks.slot(rank, 1 - slot, parts[rank]).clone()
    x_before = parts[rank].clone()

    got = all_reduce_rms_norm(parts[rank], weight, 1e-6, residual, ranks.bases, rank, world,
                              slot * slot_bytes)
    ref = all_reduce_rms_norm_ref(parts, weight, 1e-6, residual)
    tol = TOLERANCE[dtype]
    if with_residual:
        torch.testing.assert_close(got[0], ref[0], rtol=tol, atol=tol)
        # the sum is rounded once, then the residual added and rounded: exactly the reference
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    # this rank's copy went to its slot of this call, not the other one
    assert torch.equal(ranks.slot(rank, slot, parts[rank]), x_before)
    assert torch.equal(ranks.slot(rank, 1 - slot, parts[rank]), other_slot)
    # handshake: every flag this rank was given is taken; it raised its flag at every peer
    assert int(ranks.flags(rank).sum()) == 0
    for peer in range(world):
        if peer != rank:
            expected = torch.zeros(MAX_PROGRAMS, world, dtype=torch.int32, device=DEVICE)
            expected[:programs, rank] = 1
            assert torch.equal(ranks.flags(peer), expected)
    assert torch.equal(parts[rank], x_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world, rank", [(2, 0), (2, 1), (3, 2)])
def test_one_row_sums_every_rank_then_normalises(world, rank, dtype):
    _check(world, rank, rows=1, dim=96, dtype=dtype, slot=rank % 2, with_residual=True,
           seed=10 * world + rank)


@pytest.mark.parametrize("with_residual", [True, False])
def test_rows_beyond_the_program_count_are_looped_over(with_residual):
    # MAX_PROGRAMS programs, each taking several rows, and a width that is not a power of two
    _check(2, 1, rows=MAX_PROGRAMS + 7, dim=48, dtype=torch.float32, slot=1,
           with_residual=with_residual, seed=3)


def test_a_peer_whose_part_is_missing_changes_the_sum():
    # the peers' parts do enter: without peer 1's copy the result is rank 0's part alone
    gen = torch.Generator().manual_seed(5)
    parts = [_randn(2, 64, dtype=torch.float32, gen=gen) for _ in range(2)]
    weight = torch.ones(64, dtype=torch.float32, device=DEVICE)
    ranks = Ranks(2, 1024)
    ranks.flags(0)[:2, 1] = 1                       # the flag is up but the slot holds zeros
    got = all_reduce_rms_norm(parts[0], weight, 1e-6, None, ranks.bases, 0, 2, 0)
    torch.testing.assert_close(got, all_reduce_rms_norm_ref([parts[0]], weight, 1e-6))
    assert not torch.allclose(got, all_reduce_rms_norm_ref(parts, weight, 1e-6))


def test_bad_arguments_are_named():
    x = torch.zeros(1, 64, device=DEVICE)
    bases = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        all_reduce_rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, None, bases, 2, 2, 0)
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\)"):
        all_reduce_rms_norm(x, torch.ones(32, device=DEVICE), 1e-6, None, bases, 0, 2, 0)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        all_reduce_rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, torch.zeros(2, 64), bases,
                            0, 2, 0)
