"""kvfleet_kernels.argmax: argmax_rows against torch.argmax, sample_rows against the distribution
it draws from (interpreter; bf16 and the 128k vocabulary on the GPU)."""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels import argmax as argmax_module
from kvfleet_kernels.argmax import argmax_rows, sample_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n, v", [(1, 5000), (3, 1024), (2, 700), (16, 3001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch_argmax(n, v, dtype):
    g = torch.Generator().manual_seed(n * v)
    x = torch.randn(n, v, generator=g).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_go_to_the_first_index_and_counters_return_to_zero():
    x = torch.zeros(3, 4100)
    x[0, [5, 2000, 4099]] = 7.0          # within a chunk and across chunks: the first wins
    x[1, [1500, 1100]] = 3.0             # two in one chunk, the first of them
    x[2] = float("-inf")
    x[2, [3000, 4097]] = -1.0            # a row of -inf with two finite values
    for _ in range(2):                   # the counters must be back at zero for a second launch
        assert argmax_rows(x).tolist() == [5, 1100, 3000] == x.argmax(dim=-1).tolist()
    pad = 8                              # 5 chunks of 1024, padded to 8
    assert argmax_module._WORKSPACES[(x.device, pad)][2][:3].tolist() == [0, 0, 0]


def test_one_workspace_serves_every_row_count():
    # the sampler's batch shrinks and grows step by step: one workspace per chunk count, grown
    # to the largest launch, not one per row count
    x = torch.randn(9, 2000, generator=torch.Generator().manual_seed(8))
    for n in (9, 4, 9, 2):
        assert torch.equal(sample_rows(x[:n], torch.zeros(n), 1), x[:n].argmax(dim=-1))
    keys = [k for k in argmax_module._WORKSPACES if k[1] == 2]       # 2 chunks of 1024
    assert len(keys) == 1 and argmax_module._WORKSPACES[keys[0]][2].numel() >= 9


def test_refuses_more_rows_than_it_serves():
    with pytest.raises(ValueError, match="up to 16 rows"):
        argmax_rows(torch.zeros(17, 10))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4, 16])
def test_gpu_matches_torch_argmax_over_a_128k_vocabulary(n):
    x = torch.randn(n, 128256, device="cuda")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    x = x.to(torch.bfloat16)         # bf16 logits hold many ties
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def _chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(ids.cpu(), minlength=probs.numel()).float()
    expected = probs * ids.numel()
    keep = expected > 0
    assert observed[~keep].sum() == 0, "drew a token of probability 0"
    return float(((observed - expected)[keep] ** 2 / expected[keep]).sum())


def test_sample_rows_follows_softmax_at_each_rows_temperature():
    # 600 rows at temperature 1.0 and 600 at 0.4 of one distribution over 5 tokens (one masked):
    # chi-square, 3 degrees of freedom, below 16.3 with probability 0.999 each
    logits = torch.tensor([0.3, -1.0, 1.2, float("-inf"), 0.0])
    x = logits.expand(1200, -1).contiguous().to(DEVICE)
    temps = torch.tensor([1.0] * 600 + [0.4] * 600, device=DEVICE)
    ids = sample_rows(x, temps, seed=17)
    for half, t in ((ids[:600], 1.0), (ids[600:], 0.4)):
        probs = torch.softmax(logits / t, 0)
        assert _chi_square(half, probs) < 16.3
        # rows are independent: two rows draw the same token as often as p . p
        same = (half[0::2] == half[1::2]).float().mean().item()
        assert abs(same - float((probs ** 2).sum())) < 0.1


def test_sample_rows_zero_temperature_rows_take_the_argmax_and_seeds_repeat():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 3000, generator=g).to(DEVICE)
    temps = torch.tensor([0.0, 1.0] * 32, device=DEVICE)
    first = sample_rows(x, temps, seed=5)
    assert torch.equal(first[0::2], x[0::2].argmax(dim=-1))
    assert torch.equal(sample_rows(x, temps, seed=5), first)             # same seed, same draws
    assert not torch.equal(sample_rows(x, temps, seed=6)[1::2], first[1::2])
    assert not torch.equal(first[1::2], x[1::2].argmax(dim=-1))          # the random rows do draw


def test_sample_rows_refuses_bad_arguments():
    x = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="temperatures must be float32 of shape"):
        sample_rows(x, torch.ones(3, device=DEVICE), 1)
    with pytest.raises(ValueError, match="seed must be in"):
        sample_rows(x, torch.ones(2, device=DEVICE), -1)


@pytest.mark.gpu
def test_gpu_sample_rows_over_a_128k_vocabulary_in_bf16():
    # 1024 rows, each its own peaked distribution over 128,256 logits: the drawn tokens'
    # probabilities average p . p over rows (the chance a draw lands on each token)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1024, 128256, device="cuda", generator=g) * 3).to(torch.bfloat16)
    probs = torch.softmax(x.float(), dim=-1)
    ids = sample_rows(x, torch.ones(1024, device="cuda"), seed=3)
    drawn = probs.gather(1, ids[:, None]).squeeze(1)
    expected = (probs * probs).sum(dim=-1)
    assert abs(drawn.mean().item() - expected.mean().item()) < 4 * expected.std().item() / 32 + 1e-4


def _nan_rows(device: str, v: int) -> torch.Tensor:
    """Rows a model that overflowed would hand the sampler: all NaN, NaN among finite values,
    NaN next to +inf, and NaN only in the last (partial) chunk."""
    x = torch.randn(4, v, generator=torch.Generator().manual_seed(v)).to(device)
    x[0] = float("nan")
    x[1, [v // 3, v - 2]] = float("nan")
    x[2, 7] = float("inf")
    x[2, v // 2] = float("nan")
    x[3, v - 1] = float("nan")
    return x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("v", [3001, 128256])
def test_nan_logits_give_torch_argmax_index(v, device):
    # torch.argmax takes NaN as the largest value (its first NaN wins); an index past the
    # vocabulary would crash the embedding lookup of the next step with a device-side assert
    x = _nan_rows(device, v)
    for dtype in (torch.float32, torch.float16):
        got = argmax_rows(x.to(dtype))
        assert got.tolist() == x.to(dtype).argmax(dim=-1).tolist() == [0, v // 3, v // 2, v - 1]
    # the sampler's race too: a NaN row draws a token inside the vocabulary, the NaN's
    t = torch.tensor([1.0, 0.0, 0.7, 2.0], device=device)
    got = sample_rows(x, t, 3)
    assert got.tolist() == [0, v // 3, v // 2, v - 1]
