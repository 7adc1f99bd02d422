"""Sliding-window attention (Mistral 7B v0.1, Phi-3-mini-4k, Qwen2's windowed layers): a query
at position p sees the keys at p - window + 1 .. p only (HF's mask: kv_idx > q_idx - window).

paged_attention_ref(window=) against attention computed key by key over each query's window
(float64), then the Triton kernels against the reference: prefill (fresh prompts longer than the
window, chunks after a cached prefix, tiles whose rows' windows start in different tiles),
decode (split over partitions that start at the window's first tile, with and without the
first tile read early), mixed batches, an fp8 cache with V token-major. Each case also checks
that the window changed the result, so a kernel ignoring it fails.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.paged_attention import (
    FP8_KV_DTYPE,
    decode_config,
    decode_split,
    paged_attention,
    paged_attention_ref,
    quantize_kv_ref,
    token_major_v,
)
from paged_batch import ATTENTION_TOLERANCE as TOLERANCE
from paged_batch import CPU_DTYPES, DEVICE, PagedBatch, make_paged_batch


def _batch(q_lens, seq_lens, dtype, *, block_size=16, seed=0, num_heads=4, num_kv_heads=2,
           head_dim=32, device=DEVICE) -> PagedBatch:
    return make_paged_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, block_size=block_size, dtype=dtype, device=device,
                            seed=seed)


def _keywise(batch: PagedBatch, window: int) -> torch.Tensor:
    """Each query's attention over exactly the keys of its window, gathered one by one."""
    q_all, k_cache, v_cache = batch.query.double(), batch.k_cache.double(), batch.v_cache.double()
    group = q_all.shape[1] // k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.empty_like(q_all)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[i].tolist()
        for t in range(starts[i], starts[i + 1]):
            p = seq_len - (starts[i + 1] - t)                # the query's position
            keys = range(max(0, p - window + 1), p + 1)
            k = torch.stack([k_cache[table[j // bs], j % bs] for j in keys])    # [W, Hkv, D]
            v = torch.stack([v_cache[table[j // bs], j % bs] for j in keys])
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            probs = (torch.einsum("hd,khd->hk", q_all[t], k) * batch.scale).softmax(-1)
            out[t] = torch.einsum("hk,khd->hd", probs, v)
    return out


def _args(batch: PagedBatch, decode_only: bool) -> tuple:
    return (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, batch.scale, 1 if decode_only else None)


def _check(batch: PagedBatch, window: int, *, decode_only: bool = False,
           relative: bool = False) -> None:
    args = _args(batch, decode_only)
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(*args, batch.max_seq_len if decode_only else None, out=out,
                             window=window)
    assert result is out
    expected = paged_attention_ref(*args, window=window)
    scale = max(float(expected.float().abs().max()), 1.0) if relative else 1.0
    torch.testing.assert_close(out.float() / scale, expected.float() / scale, rtol=0.0,
                               atol=TOLERANCE[batch.query.dtype])
    # the window mattered here: full attention is farther from it than the tolerance, and
    # than this kernel's own error, several times over (a kernel ignoring it would fail)
    full = paged_attention_ref(*args)
    gap = float((full.float() - expected.float()).abs().max())
    err = float((out.float() - expected.float()).abs().max())
    assert gap > max(4 * err, TOLERANCE[batch.query.dtype]), (gap, err)


@pytest.mark.parametrize("window", [1, 7, 16, 45])
def test_the_reference_attends_to_each_querys_window_only(window: int) -> None:
    # prompts, a chunk after a cached prefix, decode rows: every kind of row the kernels take
    batch = _batch([30, 9, 1, 1], [30, 50, 70, 5], torch.float32, seed=window, device="cpu")
    for decode_only, b in [(False, batch), (True, _batch([1, 1, 1], [70, 5, 33], torch.float32,
                                                         seed=window + 1, device="cpu"))]:
        expected = _keywise(b, window)
        got = paged_attention_ref(*_args(b, decode_only), window=window)
        torch.testing.assert_close(got.double(), expected, rtol=0.0, atol=1e-5)
    # a window as long as every context is full attention
    torch.testing.assert_close(paged_attention_ref(*_args(batch, False), window=70),
                               paged_attention_ref(*_args(batch, False)), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("window", [5, 13, 40])
def test_prefill_over_a_window(dtype: torch.dtype, window: int) -> None:
    # fresh prompts longer than the window, a chunk of 9 after 38 cached tokens, one shorter
    # than the window; windows of under a tile (16 keys), between tiles, over two
    _check(_batch([57, 9, 4], [57, 47, 4], dtype, seed=window), window)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_mixed_batch_over_a_window(dtype: torch.dtype) -> None:
    _check(_batch([1, 12, 1, 6], [40, 12, 70, 33], dtype, seed=2), 10)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("window", [1, 50, 100])
def test_decode_over_a_window(dtype: torch.dtype, block_size: int, preload: bool, window: int,
                              monkeypatch) -> None:
    from kvfleet_kernels import paged_attention as pa
    # (two sequences: few enough programs that the window's keys are cut into partitions)
    seq_lens = [600, 290] if window == 100 else [600, 37, 290, 101]
    monkeypatch.setattr(pa, "_PRELOAD", preload)
    batch = _batch([1] * len(seq_lens), seq_lens, dtype, block_size=block_size, seed=window)
    if window == 100:   # the window's keys still cut into several partitions
        block_n = decode_config(on_gpu=False).block_n
        split = decode_split(len(seq_lens), 2, window + block_n - 1, block_n, torch.device("cpu"))
        assert split.num_splits > 2
    _check(batch, window, decode_only=True)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("head_dim", [32, 96])
def test_over_an_fp8_cache_with_v_token_major(phase: str, head_dim: int) -> None:
    decode = phase == "decode"
    q_lens, seq_lens = ([1, 1, 1], [300, 41, 129]) if decode else ([40, 1, 7], [40, 90, 60])
    batch = _batch(q_lens, seq_lens, torch.float32, seed=5, head_dim=head_dim)
    batch.query = (batch.query / 4).to(torch.float16)
    batch.k_cache = quantize_kv_ref(batch.k_cache * 4, FP8_KV_DTYPE)
    batch.v_cache = token_major_v(torch.empty_like(batch.v_cache)).copy_(
        quantize_kv_ref(batch.v_cache * 4, FP8_KV_DTYPE))
    _check(batch, 24, decode_only=decode, relative=True)


def test_a_negative_window_is_refused() -> None:
    batch = _batch([1], [5], torch.float32, device="cpu")
    with pytest.raises(ValueError, match="window must be >= 0"):
        paged_attention(*_args(batch, True), window=-1)


# ----------------------------------------------------------------------------- GPU, real shapes
LLAMA8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [2047, 4096])
def test_gpu_windows_over_long_contexts(kv_dtype: torch.dtype, window: int) -> None:
    # Phi-3-mini-4k's window and Mistral's; prompts across it, decode rows past it
    q_lens = [3000, 1000, 1, 1, 1]
    seq_lens = [3000, 6000, 8000, 2100, 300]
    batch = _batch(q_lens, seq_lens, torch.bfloat16, seed=window, **LLAMA8B)
    if kv_dtype == torch.float8_e4m3fn:
        batch.k_cache = quantize_kv_ref(batch.k_cache, kv_dtype)
        batch.v_cache = token_major_v(torch.empty_like(batch.v_cache)).copy_(
            quantize_kv_ref(batch.v_cache, kv_dtype))
    _check(batch, window, relative=True)
    decode = _batch([1] * 64, [8000 - 97 * i for i in range(64)], torch.bfloat16, seed=3,
                    **LLAMA8B)
    _check(decode, window, decode_only=True)
