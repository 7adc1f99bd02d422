"""kvfleet_kernels.argmax.argmax_rows against torch.argmax (interpreter; bf16 on the GPU)."""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels import argmax as argmax_module
from kvfleet_kernels.argmax import argmax_rows


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
    assert argmax_module._WORKSPACES[(x.device, 3, pad)][2].tolist() == [0, 0, 0]


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
