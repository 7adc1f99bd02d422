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


def early_mode(value: str) -> bool:
    """KVFLEET_PDL_EARLY's value -> on/off (off by default: unset or 0; 1 on)."""
    if value not in ("", "0", "1"):
        raise ValueError(f"KVFLEET_PDL_EARLY must be unset, 0 or 1; got {value!r}")
    return value == "1"


def l2_budget(value: str) -> int:
    """KVFLEET_L2_PREFETCH_MB's value -> bytes (unset or 0: no L2 prefetch)."""
    try:
        mb = int(value or "0")
    except ValueError:
        mb = -1
    if mb < 0:
        raise ValueError(f"KVFLEET_L2_PREFETCH_MB must be a whole number of MB >= 0; got {value!r}")
    return mb << 20


# PDL = 2: the small kernels (norms, rotary, attention, SiLU) let the next kernel launch as they
# start (pdl_launch_early), not after their wait: a GEMV two kernels on starts its weight loads
_EARLY = early_mode(os.environ.get("KVFLEET_PDL_EARLY", ""))
_L2_BYTES = l2_budget(os.environ.get("KVFLEET_L2_PREFETCH_MB", ""))
_OFF_ARGS = {"PDL": False}
_ON_ARGS = {"PDL": 2 if _EARLY else 1, "launch_pdl": True}


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (an sm_90+ GPU, KVFLEET_PDL not 0)."""
    return (_ON and device.type == "cuda" and not triton.knobs.runtime.interpret
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_args(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel with a `PDL: tl.constexpr` parameter."""
    return _ON_ARGS if pdl_enabled(device) else _OFF_ARGS


def l2_prefetch_tiles(device: torch.device, programs: int, tile_bytes: int) -> int:
    """How many weight tiles past its first each GEMV program asks L2 for before its PDL wait
    (KVFLEET_L2_PREFETCH_MB: all programs' together within that budget; 0 without PDL)."""
    if not _L2_BYTES or not pdl_enabled(device):
        return 0
    return max(0, _L2_BYTES // max(1, programs * tile_bytes) - 1)


@triton.jit
def l2_prefetch(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (a tensor of addresses); fills no register."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_small_wait(PDL: tl.constexpr):
    """pdl_wait for the small kernels (norms, rotary, attention, SiLU): with KVFLEET_PDL_EARLY=1
    they let the next kernel launch before their wait, not after it. The next kernel still
    waits for this one to finish (its own pdl_wait) before it reads what this one writes."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    pdl_wait(PDL)
