"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A decode step at batch 1 is ~300 short kernels in a row; between two of them the GPU drains
the first and ramps the second up, and the GEMVs' first weight loads wait behind that. Launched
with PDL (`launch_pdl=True`), a kernel may start while the one before it is still running: it
loads what no earlier kernel writes (a GEMV's weights) and then waits (`griddepcontrol.wait`)
until the previous kernel has finished and its writes are visible, before it reads its
activations or writes anything. Right after that wait it lets the next kernel launch
(`griddepcontrol.launch_dependents`).

The rule every kernel here keeps (`pdl_wait` in each program, before any load of an earlier
kernel's output and before any store): a kernel only completes after the one before it has,
so the chain of waits orders each kernel after all earlier ones, PDL or not. Kernels without
PDL (cuBLAS, torch, NCCL) launch as usual and wait for everything before them.

What a kernel loads before its wait must not be written by the kernel right before it: the
GEMVs' weights are written once, at load time, many kernels before any forward pass.

On by default on sm_90 and newer (KVFLEET_PDL unset or =1; =0 turns it off; the interpreter
never uses it). Measured on an H200 in one call (docs/PERFORMANCE.md): batch-1 decode of the
Llama-3.1-8B shape 214.1 -> 226.5 tok/s in bf16, 331.8 -> 359.3 with GPTQ 4-bit, TP=2 285.1 ->
299.1; 128/128 at 1024 running unchanged (17,766 vs 17,787).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kvfleet_kernels.env import on_off


def pdl_mode(value: str) -> bool:
    """KVFLEET_PDL's value -> on/off."""
    return on_off("KVFLEET_PDL", value)


# read once: the eager decode loop launches ~300 kernels a step
_ON = pdl_mode(os.environ.get("KVFLEET_PDL", ""))
_OFF_ARGS = {"PDL": False}
_ON_ARGS = {"PDL": True, "launch_pdl": True}


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (an sm_90+ GPU, KVFLEET_PDL not 0)."""
    return (_ON and device.type == "cuda" and not triton.knobs.runtime.interpret
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_args(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel with a `PDL: tl.constexpr` parameter."""
    return _ON_ARGS if pdl_enabled(device) else _OFF_ARGS


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
