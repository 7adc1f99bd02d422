"""kvfleet_kernels.cublaslt: F.linear's GEMMs through cuBLASLt's fastest algorithm at tuned
shapes (KVFLEET_CUBLASLT_TUNE=1, off by default). CPU: the settings and the routing's refusals;
GPU (marker gpu): every algorithm against F.linear, the choice, lookup and a CUDA-graph replay
(the engine with tuning on: tests/runtime/test_cublaslt_tuning.py)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from kvfleet_kernels import cublaslt

HAS_NVMATH = importlib.util.find_spec("nvmath") is not None


@pytest.mark.parametrize("value", [None, "0"])
def test_tuning_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("KVFLEET_CUBLASLT_TUNE", raising=False)
    else:
        monkeypatch.setenv("KVFLEET_CUBLASLT_TUNE", value)
    assert cublaslt.tune_requested() is False


def test_a_bad_tuning_switch_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_CUBLASLT_TUNE", "yes")
    with pytest.raises(ValueError, match="KVFLEET_CUBLASLT_TUNE must be unset, 0 or 1; got 'yes'"):
        cublaslt.tune_requested()


@pytest.mark.skipif(HAS_NVMATH, reason="nvmath-python installed: the error cannot happen")
def test_tuning_without_nvmath_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_CUBLASLT_TUNE", "1")
    with pytest.raises(ValueError, match="KVFLEET_CUBLASLT_TUNE=1 needs nvmath-python"):
        cublaslt.tune_requested()


def test_tuning_with_another_nvmath_version_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_CUBLASLT_TUNE", "1")
    monkeypatch.setitem(sys.modules, "nvmath", types.SimpleNamespace(__version__="1.1.0"))
    with pytest.raises(ValueError, match="written against nvmath-python 1.0's Matmul plans; found 1.1.0"):
        cublaslt.tune_requested()
    monkeypatch.setitem(sys.modules, "nvmath", types.SimpleNamespace(__version__="1.0.3"))
    assert cublaslt.tune_requested() is True


def test_tuned_rows_are_the_prefill_chunk_and_the_extra_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLEET_CUBLASLT_ROWS", raising=False)
    assert cublaslt.tune_rows(16384) == [16384]
    monkeypatch.setenv("KVFLEET_CUBLASLT_ROWS", "1024, 3")
    assert cublaslt.tune_rows(8192) == [3, 1024, 8192]
    for bad in ("0", "a,2", "-4"):
        monkeypatch.setenv("KVFLEET_CUBLASLT_ROWS", bad)
        with pytest.raises(ValueError, match="KVFLEET_CUBLASLT_ROWS must be comma-separated"):
            cublaslt.tune_rows(16384)


def test_nothing_routes_while_nothing_is_tuned() -> None:
    cublaslt.clear()
    assert cublaslt.lookup(torch.randn(256, 64), torch.randn(32, 64)) is None


# ------------------------------------------------------------------------------------ on a GPU
def _bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(256, 6144, 4096), (512, 4096, 14336), (1000, 128256, 4096)])
def test_gpu_every_algorithm_computes_f_linear(m: int, n: int, k: int) -> None:
    x, w = _bf16(m, k), _bf16(n, k, scale=k ** -0.5)
    scratch = torch.zeros(m * k * 2 + 512, dtype=torch.uint8, device="cuda")
    gemm = cublaslt.TunedGemm(m, w, scratch)   # planned over scratch's bytes
    assert gemm.num_algorithms >= 1 and (gemm.m, gemm.n, gemm.k) == (m, n, k)
    ref = F.linear(x, w).float()
    for i in range(gemm.num_algorithms):
        out = gemm(x, w, i)
        assert out.shape == (m, n) and out.is_contiguous()
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_tuned_shapes_route_and_replay_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    # MIN_GAIN below any gain: the fastest algorithm is kept even where F.linear is as fast
    monkeypatch.setattr(cublaslt, "MIN_GAIN", -1.0)
    cublaslt.clear()
    try:
        x, w = _bf16(512, 4096), _bf16(4096, 4096, scale=4096 ** -0.5)
        report = cublaslt.tune([(w, [512])])
        assert len(report) == 1 and "512x4096x4096" in report[0], report
        gemm = cublaslt.lookup(x, w)
        assert gemm is not None and gemm.choice is not None
        assert cublaslt.lookup(x[1:], w) is None                    # other rows: F.linear
        assert cublaslt.lookup(x.t().contiguous().t(), w) is None   # not contiguous
        assert cublaslt.lookup(_bf16(512, 4096).float(), w.float()) is None
        expected = F.linear(x, w)
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gemm(static, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gemm(static, w)
        static.copy_(x)
        graph.replay()
        torch.testing.assert_close(captured.float(), expected.float(), rtol=2e-2, atol=2e-2)
        # the same algorithm, replayed or not
        torch.testing.assert_close(captured, gemm(x, w), rtol=1e-2, atol=1e-2)
    finally:
        cublaslt.clear()
