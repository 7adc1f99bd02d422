"""Kernel tests run the real Triton kernels: on a GPU when there is one, else in Triton's interpreter.

TRITON_INTERPRET must be in the environment before triton is first imported (triton.jit reads it
when a kernel is decorated), so it is set here, at conftest import, ahead of every test module of
this folder. In a pytest run that imported triton earlier (another folder's tests), export
TRITON_INTERPRET=1 yourself, as scripts/test does. The interpreter gets bf16 wrong (triton 3.9),
so CPU tests use fp32 and fp16 only; bf16 is covered by the @pytest.mark.gpu tests.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The GPU machine runs these tests from a bare checkout (no `pip install -e .`): find the package.
if importlib.util.find_spec("kvfleet_kernels") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
