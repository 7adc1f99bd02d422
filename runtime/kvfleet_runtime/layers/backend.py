"""Which implementation a layer runs: Triton kernels on CUDA, the torch code elsewhere.

`KVFLEET_ATTENTION_BACKEND=torch` (or EngineConfig.attention_backend) forces the
torch path on a GPU too, which is how kernels are compared inside the engine.
"""

from __future__ import annotations

import os

import torch

_forced: str | None = None


def set_backend(name: str) -> None:
    global _forced
    _forced = None if name == "auto" else name


def use_triton(x: torch.Tensor) -> bool:
    choice = _forced or os.environ.get("KVFLEET_ATTENTION_BACKEND", "auto")
    if choice == "torch":
        return False
    return x.is_cuda
