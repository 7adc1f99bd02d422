"""KVFLEET_TRITON_GEMV: a batch-1 Linear (bias included) goes through kvfleet_kernels.gemv where
the Triton path runs (here: Triton's interpreter), and gives F.linear's result; by default
(unset, or =tuned) only the (device, shape) pairs of gemv.TUNED do, with their tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvfleet_runtime.layers import linear
from kvfleet_runtime.layers.backend import set_backend
from kvfleet_runtime.layers.linear import Linear


@pytest.fixture
def triton_gemv(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_TRITON_GEMV", True)
    set_backend("triton")
    yield
    set_backend("auto")


@pytest.mark.parametrize("rows", [1, 3])      # 3 rows stay on F.linear
def test_batch_one_linear_with_bias_through_the_gemv(triton_gemv, monkeypatch, rows):
    from kvfleet_kernels import gemv as gemv_module
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = Linear(64, [32, 16], bias=True, dtype=torch.float32, prefix="qkv_proj")
    g = torch.Generator().manual_seed(rows)
    layer.weight.data.copy_(torch.randn(48, 64, generator=g))
    layer.bias.data.copy_(torch.randn(48, generator=g))
    x = torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert len(calls) == (rows == 1)


@pytest.mark.parametrize("mode, tuned", [("tuned", False), ("tuned", True), ("", False), ("", True),
                                         ("0", True)])
def test_tuned_mode_takes_the_gemv_for_tuned_shapes_only(monkeypatch, mode, tuned):
    # the default (unset) is =tuned; =0 keeps even a tuned shape on cuBLAS
    from kvfleet_kernels import gemv as gemv_module
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_TUNED_GEMV", linear.gemv_modes(mode)[1])
    set_backend("triton")
    try:
        cfg = gemv_module.GemvConfig(block_n=8, block_k=32, split_k=2, num_warps=4, num_stages=1)
        if tuned:    # this machine's name and the layer's [N, K]
            monkeypatch.setitem(gemv_module.TUNED, ("cpu", 48, 64), cfg)
        calls = []
        real = gemv_module.gemv
        monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
        layer = Linear(64, [32, 16], bias=False, dtype=torch.float32, prefix="o_proj")
        g = torch.Generator().manual_seed(5)
        layer.weight.data.copy_(torch.randn(48, 64, generator=g))
        x = torch.randn(1, 64, generator=g)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
        assert calls == ([cfg] if tuned and mode != "0" else [])
    finally:
        set_backend("auto")


@pytest.mark.parametrize("rows", [1, 2])
def test_lm_head_at_batch_one_takes_its_tuned_gemv(monkeypatch, rows):
    # the lm_head (a VocabParallelEmbedding's compute_logits) routes like any projection:
    # a tuned [vocab, hidden] shape runs the GEMV at batch 1, with the same logits
    from kvfleet_kernels import gemv as gemv_module
    from kvfleet_runtime.distributed.layers import VocabParallelEmbedding
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_TUNED_GEMV", True)
    set_backend("triton")
    try:
        cfg = gemv_module.GemvConfig(block_n=16, block_k=32, split_k=1, num_warps=4, num_stages=1,
                                     prefetch=True)
        monkeypatch.setitem(gemv_module.TUNED, ("cpu", 40, 64), cfg)
        calls = []
        real = gemv_module.gemv
        monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
        head = VocabParallelEmbedding(40, 64, torch.float32)
        g = torch.Generator().manual_seed(rows)
        head.weight.data.copy_(torch.randn(40, 64, generator=g))
        hidden = torch.randn(rows, 64, generator=g)
        logits = head.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (rows, 40)
        torch.testing.assert_close(logits, hidden @ head.weight.t(), rtol=1e-5, atol=1e-4)
        assert calls == ([cfg] if rows == 1 else [])
    finally:
        set_backend("auto")
