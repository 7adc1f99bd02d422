"""Fixtures of the quantized tiny-Llama tests (test_tiny_llama.py, test_compressed_tensors.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tiny_models import make_tiny_model

from quantization.test_tiny_llama import _prompts, hf_reference


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def fp32_reference(tiny_llama):
    """The fp32 model's log-prob of each prompt token (what quantization moves)."""
    return hf_reference(tiny_llama, _prompts())[1]
