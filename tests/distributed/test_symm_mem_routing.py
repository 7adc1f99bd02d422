"""Which all-reduces the symmetric-memory path takes (the kernels themselves need GPUs and
NVLink: scripts/gpu-check runs them, and every engine start checks them against NCCL)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kvfleet_runtime.distributed.communication import OneShotAllReduce


@dataclass
class FakeTensor:       # what _path reads of a tensor (CUDA tensors cannot exist here)
    numel_: int
    dtype: torch.dtype = torch.bfloat16
    is_cuda: bool = True
    contiguous: bool = True

    def numel(self) -> int:
        return self.numel_

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_contiguous(self) -> bool:
        return self.contiguous


def _router(max_bytes: int, two_shot_max_bytes: int) -> OneShotAllReduce:
    r = object.__new__(OneShotAllReduce)      # no buffer, no group: routing only
    r.max_bytes, r.two_shot_max_bytes = max_bytes, two_shot_max_bytes
    return r


@pytest.mark.parametrize("numel, dtype, expected", [
    (4096, torch.bfloat16, "one"),                  # batch 1 of a 4096-wide model: 8 KiB
    (256 * 1024, torch.bfloat16, "one"),            # exactly the one-shot limit
    (256 * 1024 + 64, torch.bfloat16, "two"),
    (1024 * 4096, torch.bfloat16, "two"),           # a 1024-row decode graph: 8 MiB
    (1024 * 4096 + 64, torch.bfloat16, None),       # past the two-shot limit: NCCL
    (256 * 1024 + 1, torch.bfloat16, None),         # not a multiple of 64 elements
    (4096, torch.float16, None),                    # no fp16 in torch's symm-mem kernels
    (2 * 1024 * 1024, torch.float32, "two"),
])
def test_sizes_and_dtypes_pick_their_path(numel, dtype, expected):
    router = _router(512 * 1024, 8 * 1024 * 1024)
    assert router._path(FakeTensor(numel, dtype)) == expected
    assert router.fits(FakeTensor(numel, dtype)) == (expected is not None)


def test_two_shot_is_off_by_default_and_cpu_or_strided_tensors_stay_on_the_group():
    router = _router(512 * 1024, 0)
    assert router._path(FakeTensor(256 * 1024 + 64)) is None
    assert router._path(FakeTensor(64, is_cuda=False)) is None
    assert router._path(FakeTensor(64, contiguous=False)) is None
