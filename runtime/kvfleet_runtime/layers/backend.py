"""Which implementation a layer runs: Triton kernels on CUDA, the torch code elsewhere.

`KVFLEET_ATTENTION_BACKEND=torch` (or EngineConfig.attention_backend) forces the
torch path on a GPU too, which is how kernels are compared inside the engine. `triton` on a
CPU runs the Triton kernels in Triton's interpreter when TRITON_INTERPRET=1 is set (slow: the
tests use it to run the GPU code path's model wiring on tiny models); without the interpreter
a CPU keeps the torch path.
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
    if choice == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return x.is_cuda
