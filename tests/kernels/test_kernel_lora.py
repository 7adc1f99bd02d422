"""lora_expand (Triton) against lora_expand_ref: each token's own slot's columns, tokens without
an adapter (slot -1) left bit for bit as they were.

CPU cases run in Triton's interpreter (fp32, fp16); gpu-marked cases use the Llama-3.1-8B
projections' shapes in bf16 (rank 16, up to 4 slots). Each case draws fresh inputs.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.lora import lora_expand, lora_expand_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _case(tokens: int, n: int, slots: int, width: int, dtype: torch.dtype, seed: int,
          base_share: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(tokens, n, generator=gen).to(dtype=dtype, device=DEVICE)
    shrunk = torch.randn(tokens, slots * width, generator=gen).to(dtype=dtype, device=DEVICE)
    b = (torch.randn(n, slots * width, generator=gen) / width ** 0.5).to(dtype=dtype,
                                                                          device=DEVICE)
    token_slots = torch.randint(0, slots, (tokens + 3,), generator=gen, dtype=torch.int32)
    token_slots[torch.rand(tokens + 3, generator=gen) < base_share] = -1
    if base_share < 1 and bool((token_slots[:tokens] < 0).all()):
        token_slots[0] = 0          # (one token drawn to the base model: give it an adapter)
    return out, shrunk, b, token_slots.to(DEVICE)


def _check(tokens: int, n: int, slots: int, width: int, dtype: torch.dtype, seed: int,
           base_share: float = 0.3) -> None:
    out, shrunk, b, token_slots = _case(tokens, n, slots, width, dtype, seed, base_share)
    inputs = (shrunk.clone(), b.clone(), token_slots.clone())
    expected = lora_expand_ref(out.clone(), shrunk, b, token_slots, slots)
    base = token_slots[:tokens] < 0
    assert not torch.equal(expected[~base], out[~base])      # the case changes something
    actual = lora_expand(out, shrunk, b, token_slots, slots)
    assert actual.data_ptr() == out.data_ptr()                # in place
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    assert torch.equal(actual[base], expected[base])          # base-model rows untouched
    for before, after in zip(inputs, (shrunk, b, token_slots), strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "n", "slots", "width"), [
    (1, 48, 1, 16), (5, 200, 3, 8), (16, 64, 2, 48), (37, 130, 4, 16), (70, 96, 1, 32)])
def test_lora_expand_matches_reference(tokens, n, slots, width, dtype):
    _check(tokens, n, slots, width, dtype, seed=tokens * 7 + slots)


def test_lora_expand_tile_of_base_tokens_writes_nothing():
    # every token on the base model: out unchanged, NaN included (no read-modify-write)
    out, shrunk, b, token_slots = _case(20, 64, 2, 16, torch.float32, seed=3, base_share=1.0)
    out[0, 0] = float("nan")
    before = out.clone()
    lora_expand(out, shrunk, b, token_slots, 2)
    torch.testing.assert_close(out, before, equal_nan=True, rtol=0, atol=0)


def test_lora_expand_reads_only_the_tokens_slot():
    # token 0 in slot 1: poisoning slot 0's and slot 2's columns changes nothing
    out, shrunk, b, token_slots = _case(3, 32, 3, 16, torch.float32, seed=5, base_share=0.0)
    token_slots[:3] = torch.tensor([1, 1, 1], dtype=torch.int32)
    expected = lora_expand_ref(out.clone(), shrunk, b, token_slots, 3)
    shrunk[:, :16] = float("nan")
    b[:, 32:] = float("nan")
    actual = lora_expand(out, shrunk, b, token_slots, 3)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 256, 4096])
@pytest.mark.parametrize(("n", "width"), [(6144, 48), (4096, 16), (28672, 32)])
def test_lora_expand_matches_reference_gpu(tokens, n, width):
    if DEVICE != "cuda":
        pytest.skip("needs a GPU")
    _check(tokens, n, 4, width, torch.bfloat16, seed=tokens + n)
    _check(tokens, n, 1, width, torch.bfloat16, seed=tokens + n + 1)
