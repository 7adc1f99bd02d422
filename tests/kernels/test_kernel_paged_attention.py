"""paged_attention (Triton) against paged_attention_ref, and reshape_and_cache against its reference.

CPU cases run in Triton's interpreter with small shapes (fp32, fp16); the gpu-marked cases use
Llama-3.1-8B attention shapes (32 query heads, 8 kv heads, head_dim 128) in bf16 and fp16.
Every output buffer is poisoned with NaN before the launch, every case draws fresh inputs.
With `out_index` each token's output columns come in a permuted order: the plain output's
columns [:, perm], bit for bit (an act-order o_proj's input order).
"""

from __future__ import annotations

import os

import pytest
import torch
from kvfleet_kernels.paged_attention import (
    decode_config,
    decode_launch,
    decode_split,
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from paged_batch import ATTENTION_TOLERANCE as TOLERANCE
from paged_batch import CPU_DTYPES, DEVICE, PagedBatch, make_paged_batch


def _check(batch: PagedBatch, *, decode_only: bool = False) -> None:
    # max_query_len == 1 selects the decode kernel; None lets the launcher compute it (prefill).
    max_query_len = 1 if decode_only else None
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, batch.scale, max_query_len)
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(*args, batch.max_seq_len if decode_only else None, out=out)
    assert result is out
    expected = paged_attention_ref(*args)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0.0,
                               atol=TOLERANCE[batch.query.dtype])


def _batch(q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, *, num_heads: int = 4,
           num_kv_heads: int = 2, head_dim: int = 32, block_size: int = 16, seed: int = 0,
           device: str = DEVICE) -> PagedBatch:
    return make_paged_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, block_size=block_size, dtype=dtype, device=device,
                            seed=seed)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_varlen_causal_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    _check(_batch([5, 23, 1], [5, 23, 1], dtype, block_size=block_size, seed=block_size))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_prefill_chunk_after_cached_prefix(dtype: torch.dtype) -> None:
    # The 9 new tokens are positions 38..46 of a 47-token context (not a multiple of block_size).
    _check(_batch([9, 4], [47, 21], dtype, seed=1))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_mixed_batch_of_decode_and_prefill_rows(dtype: torch.dtype) -> None:
    _check(_batch([1, 12, 1, 6], [40, 12, 70, 33], dtype, seed=2))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_mixed_batch_decode_rows_take_the_decode_kernel(dtype: torch.dtype) -> None:
    # the decode rows of a mixed batch get exactly the bits of a decode-only launch over them,
    # planned for the same batch size and longest context (the split-KV kernel's partitions)
    q_lens, seq_lens = [1, 12, 1, 6], [40, 12, 70, 33]
    batch = _batch(q_lens, seq_lens, dtype, seed=13)
    mixed = paged_attention(*batch.args(), max(seq_lens), min_query_len=1)
    rows = [0, 13]                       # the decode sequences' tokens (0 and 2)
    alone = (batch.query[rows], batch.k_cache, batch.v_cache, batch.block_tables[[0, 2]],
             batch.seq_lens[[0, 2]], torch.tensor([0, 1, 2], dtype=torch.int32,
                                                  device=batch.query.device), batch.scale, 1)
    decode = paged_attention(*alone, max(seq_lens), plan_num_seqs=len(q_lens))
    assert torch.equal(mixed[rows], decode)
    # told that no row is a decode row, a prefill batch launches its kernel alone: the same
    prefill = _batch([5, 23, 2], [9, 23, 40], dtype, seed=14)
    assert torch.equal(paged_attention(*prefill.args(), 40, min_query_len=2),
                       paged_attention(*prefill.args(), 40))


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(2, 2, 64), (8, 2, 32), (6, 2, 16)])
def test_prefill_gqa_groups_and_head_dims(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    _check(_batch([7, 3], [19, 35], torch.float16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, seed=3))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("preload", [True, False])
def test_decode_split_kv_matches_reference(dtype: torch.dtype, block_size: int, preload: bool,
                                           monkeypatch) -> None:
    from kvfleet_kernels import paged_attention as pa
    seq_lens = [600, 37, 290]
    batch = _batch([1, 1, 1], seq_lens, dtype, block_size=block_size, seed=4)
    # Pin that this case really takes several partitions (and partitions of unequal use), and
    # which of decode's two paths it takes: the first tile read before the PDL wait or not
    block_n = decode_config(on_gpu=False).block_n
    split = decode_split(len(seq_lens), 2, max(seq_lens), block_n, torch.device("cpu"))
    assert split.num_splits > 2
    monkeypatch.setattr(pa, "_PRELOAD", preload)
    assert pa.decode_preload(3 * 2, block_n, 32, batch.k_cache.element_size()) is preload
    _check(batch, decode_only=True)


def test_decode_preloads_for_few_pairs_and_small_tiles(monkeypatch) -> None:
    from kvfleet_kernels import paged_attention as pa
    monkeypatch.setattr(pa, "_PRELOAD", True)
    assert pa.decode_preload(8, 32, 128, 2)             # batch 1 of the 8B shape, bf16 cache
    assert pa.decode_preload(8, 64, 128, 1)             # its fp8 cache up to 1024 tokens
    assert not pa.decode_preload(8, 128, 128, 1)        # 128-key fp8 tiles
    assert not pa.decode_preload(65 * 8, 32, 128, 2)    # a batch of 65
    monkeypatch.setattr(pa, "_PRELOAD", False)          # KVFLEET_DECODE_PRELOAD=0
    assert not pa.decode_preload(8, 32, 128, 2)


def test_decode_tiles_by_programs_and_cache_dtype() -> None:
    # the GPU's choice (no GPU needed to make it): over an fp8 cache one warp a program from
    # 1024 (sequence, kv head) programs, over a bf16 cache from 4096 (1024 tokens at most)
    def warps(fp8: bool, programs: int, max_seq_len: int = 4096) -> int:
        return decode_config(True, fp8, max_seq_len, programs).num_warps
    assert [warps(True, n) for n in (512, 1016, 1024, 4000)] == [2, 2, 1, 1]
    assert decode_config(True, True, 4096, 1024).block_n == 32
    assert [warps(False, n, 1024) for n in (1024, 4000, 4096)] == [2, 2, 1]


@pytest.mark.parametrize("dtype", [*CPU_DTYPES, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_decode_planned_for_a_padded_batch_gives_its_bits(dtype: torch.dtype) -> None:
    # an eager decode step planned as the CUDA graph of its padded size (plan_num_seqs, the
    # bucket as max_seq_len) cuts contexts as that graph does: the same bits as the padded run
    n, padded_n, bucket = (3, 4, 1024) if DEVICE == "cpu" else (40, 48, 1024)   # SM counts differ
    lens = ([600, 37, 290, 513, 1000] * 10)[:n] + [1] * (padded_n - n)   # padding: 1 token
    batch = _batch([1] * padded_n, lens, dtype, num_heads=4, num_kv_heads=1, seed=12)
    own, planned = (decode_split(k, 1, bucket, decode_config(DEVICE == "cuda", False, bucket, k).block_n,
                                 batch.query.device) for k in (n, padded_n))
    assert own.partition_size != planned.partition_size    # else the case would prove nothing
    padded = paged_attention(*batch.args(), bucket)
    alone = (batch.query[:n], batch.k_cache, batch.v_cache, batch.block_tables[:n],
             batch.seq_lens[:n], batch.query_start_loc[: n + 1], batch.scale, 1)
    out = paged_attention(*alone, bucket, plan_num_seqs=padded_n)
    assert torch.equal(out, padded[:n])
    torch.testing.assert_close(out.float(), paged_attention_ref(*alone).float(), rtol=0.0,
                               atol=TOLERANCE[dtype])


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 32), (8, 1, 64)])
def test_decode_single_partition_gqa(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    seq_lens = [17, 30]
    block_n = decode_config(on_gpu=False).block_n
    assert decode_split(2, num_kv_heads, 30, block_n, torch.device("cpu")).num_splits == 1
    _check(_batch([1, 1], seq_lens, torch.float32, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, seed=5), decode_only=True)


def test_contexts_are_cut_into_partitions_of_at_least_32_tokens(monkeypatch) -> None:
    from kvfleet_kernels import paged_attention as pa
    cpu = torch.device("cpu")
    # batch 1, 384 tokens: 32-token partitions for Llama-3.1-8B's 8 KV heads and a TP=2 rank's
    # 4 alike; KVFLEET_DECODE_MIN_PARTITION (parsed at import) overrides
    assert os.environ.get("KVFLEET_DECODE_MIN_PARTITION") or pa.MIN_PARTITION_TOKENS == 32
    monkeypatch.setattr(pa, "MIN_PARTITION_TOKENS", 32)
    monkeypatch.setattr(pa, "_CPU_SM_COUNT", 132)         # as many programs as an H200 wants
    assert decode_split(1, 8, 384, 32, cpu).num_splits == 12
    assert decode_split(1, 4, 384, 32, cpu).num_splits == 12
    assert decode_split(8, 8, 384, 32, cpu).num_splits == 4     # 64 pairs: 96-token partitions
    monkeypatch.setattr(pa, "MIN_PARTITION_TOKENS", 128)
    assert decode_split(1, 4, 384, 32, cpu).num_splits == 3


@pytest.mark.parametrize("head_dim", [12, 100, 264])
def test_rejects_head_dims_the_tiles_do_not_take(head_dim: int) -> None:
    batch = _batch([1], [4], torch.float32, head_dim=head_dim, num_heads=2)
    with pytest.raises(ValueError, match=rf"head_dim must be a multiple of 8 in 16..256 "
                                         rf"\(e.g. 64, 96, 128\); got {head_dim}"):
        paged_attention(*batch.args())


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim", [96, 24])
def test_head_dims_padded_to_a_power_of_two(dtype: torch.dtype, head_dim: int, monkeypatch) -> None:
    # Phi-3-mini's 96 (tiles of 128, the pad masked): prefill after a cached prefix, a mixed
    # batch, split decode with and without its first tile read early, a sliding window
    from kvfleet_kernels import paged_attention as pa
    _check(_batch([9, 1, 23, 1], [47, 40, 23, 70], dtype, head_dim=head_dim, seed=head_dim))
    for preload in (True, False):
        monkeypatch.setattr(pa, "_PRELOAD", preload)
        _check(_batch([1, 1, 1], [600, 37, 290], dtype, head_dim=head_dim, seed=int(preload)),
               decode_only=True)
    batch = _batch([30, 1], [30, 90], dtype, head_dim=head_dim, seed=7)
    out = paged_attention(*batch.args(), window=11)
    torch.testing.assert_close(out.float(), paged_attention_ref(*batch.args(), window=11).float(),
                               rtol=0.0, atol=TOLERANCE[dtype])


def _check_out_index(batch: PagedBatch, seed: int, **kwargs) -> None:
    # out_index = argsort(perm): each token's output row comes out as the plain call's [:, perm]
    # (the input order of an act-order o_proj), bit for bit, every column written
    num_tokens, num_heads, head_dim = batch.query.shape
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_heads * head_dim, generator=gen).to(batch.query.device)
    out_index = torch.argsort(perm).to(torch.int32)
    plain = paged_attention(*batch.args(), batch.max_seq_len,
                            out=torch.full_like(batch.query, float("nan")), **kwargs)
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(*batch.args(), batch.max_seq_len, out=out, out_index=out_index,
                             **kwargs)
    assert result is out
    rows = out.view(num_tokens, num_heads * head_dim)
    assert torch.equal(rows, plain.view(num_tokens, num_heads * head_dim)[:, perm])
    # and without `out`: the buffer it allocates
    allocated = paged_attention(*batch.args(), batch.max_seq_len, out_index=out_index, **kwargs)
    assert torch.equal(allocated, out)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_out_index_mixed_batch(dtype: torch.dtype) -> None:
    # prefill rows after cached prefixes and decode rows (those split: both decode kernels)
    batch = _batch([1, 12, 1, 6], [40, 12, 70, 33], dtype, seed=21)
    assert decode_split(4, 2, 70, decode_config(on_gpu=False).block_n,
                        torch.device("cpu")).num_splits > 1
    _check_out_index(batch, seed=1)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_out_index_split_decode(dtype: torch.dtype) -> None:
    seq_lens = [600, 37, 290]
    split = decode_split(len(seq_lens), 2, max(seq_lens), decode_config(on_gpu=False).block_n,
                         torch.device("cpu"))
    assert split.num_splits > 2          # the reduce kernel stores the output
    _check_out_index(_batch([1, 1, 1], seq_lens, dtype, seed=22), seed=2)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_out_index_single_partition_decode(dtype: torch.dtype) -> None:
    seq_lens = [17, 30]
    block_n = decode_config(on_gpu=False).block_n
    assert decode_split(2, 2, 30, block_n, torch.device("cpu")).num_splits == 1   # stored by decode
    _check_out_index(_batch([1, 1], seq_lens, dtype, num_heads=8, seed=23), seed=3)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_out_index_head_dims_padded(dtype: torch.dtype) -> None:
    # 24 dims in tiles of 32: the index read for the real dims only, the pad never stored;
    # a mixed batch, split decode, and a sliding window
    _check_out_index(_batch([9, 1, 23, 1], [47, 40, 23, 70], dtype, head_dim=24, seed=24), seed=4)
    _check_out_index(_batch([1, 1, 1], [600, 37, 290], dtype, head_dim=24, seed=25), seed=5)
    _check_out_index(_batch([30, 1], [30, 90], dtype, head_dim=24, seed=26), seed=6, window=11)


def test_out_index_rejects_wrong_indices_and_layouts() -> None:
    batch = _batch([1, 3], [5, 9], torch.float32, seed=27)
    size = 4 * 32
    good = torch.arange(size, dtype=torch.int32)
    for bad in (torch.arange(size - 1, dtype=torch.int32), good.long(), good.view(4, 32),
                good.to("meta")):
        with pytest.raises(ValueError, match="out_index must be a 1-D int32 tensor of "
                                             r"num_heads \* head_dim = 128 entries"):
            paged_attention(*batch.args(), out_index=bad)
    # out's heads and dims must be packed: [T, D, H] storage seen as [T, H, D] is not
    transposed = torch.empty(4, 32, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="with out_index, out's heads and dims must be packed"):
        paged_attention(*batch.args(), out=transposed, out_index=good)
    paged_attention(*batch.args(), out=transposed)          # fine without an index


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_reshape_and_cache_writes_slots_and_skips_minus_one(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 3, 32
    key = torch.randn(7, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(7, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7]
    slots[[2, 5]] = -1
    slot_mapping = slots.to(DEVICE)
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                         dtype=dtype, device=DEVICE) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slot_mapping)
    reshape_and_cache_ref(key, value, caches[2], caches[3], slot_mapping)
    # equal_nan: untouched slots (skipped tokens included) must still hold the poison.
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)
    assert caches[0].isnan().any(dim=(2, 3)).sum() == num_blocks * block_size - 5


# ----------------------------------------------------------------------------- GPU, real shapes
LLAMA8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_gpu_decode_batches(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    # 600 x 8 kv heads: the one-warp tiles of many programs (decode_config)
    for num_seqs, max_len in [(1, 8192), (4, 8192), (64, 3000), (256, 1500), (600, 300)]:
        seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
        seq_lens[0] = max_len
        _check(_batch([1] * num_seqs, seq_lens.tolist(), dtype, block_size=block_size,
                      seed=num_seqs, **LLAMA8B), decode_only=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_gpu_prefill_with_cached_prefix_and_decode_rows(dtype: torch.dtype, block_size: int) -> None:
    # A fresh 2k prompt, a 1k chunk on a 7k cached prefix, decode rows, an odd-length tail.
    q_lens = [2048, 1000, 1, 1, 333]
    seq_lens = [2048, 8000, 4097, 17, 333]
    _check(_batch(q_lens, seq_lens, dtype, block_size=block_size, seed=block_size, **LLAMA8B))


@pytest.mark.gpu
def test_gpu_out_index_llama8b_shapes() -> None:
    # the 8B's heads in bf16: long decode contexts split (the reduce kernel stores), many short
    # ones not (the decode kernel does), and a prefill batch with decode rows
    cuda = torch.device("cuda")
    for seed, (q_lens, seq_lens) in enumerate([([1] * 4, [8192, 5000, 3001, 77]),
                                                ([1] * 256, [300 - i for i in range(256)]),
                                                ([2048, 1000, 1, 1, 333],
                                                 [2048, 8000, 4097, 17, 333])]):
        batch = _batch(q_lens, seq_lens, torch.bfloat16, seed=30 + seed, **LLAMA8B)
        if max(q_lens) == 1:
            splits = decode_launch(len(q_lens), 8, max(seq_lens), 0, True, False,
                                   cuda)[1].num_splits
            assert (splits > 1) == (seed == 0), splits
        _check_out_index(batch, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_phi3_mini_heads_of_96_dims(kv_dtype: torch.dtype) -> None:
    # Phi-3-mini: 32 heads of 96 dims, no GQA; tiles of 128 dims with the pad masked
    from kvfleet_kernels.paged_attention import quantize_kv_ref, token_major_v
    shape = {"num_heads": 32, "num_kv_heads": 32, "head_dim": 96}
    for q_lens, seq_lens in [([2048, 1000, 1, 1, 333], [2048, 4000, 4097, 17, 333]),
                             ([1] * 64, [3000 - 41 * i for i in range(64)])]:
        batch = _batch(q_lens, seq_lens, torch.bfloat16, seed=len(q_lens), **shape)
        if kv_dtype == torch.float8_e4m3fn:
            batch.k_cache = quantize_kv_ref(batch.k_cache, kv_dtype)
            batch.v_cache = token_major_v(torch.empty_like(batch.v_cache)).copy_(
                quantize_kv_ref(batch.v_cache, kv_dtype))
        _check(batch, decode_only=len(q_lens) == 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_reshape_and_cache(dtype: torch.dtype) -> None:
    num_blocks, block_size = 300, 16
    key = torch.randn(1000, 8, 128, device="cuda")
    value = torch.randn(1000, 8, 128, device="cuda")
    slot_mapping = torch.randperm(num_blocks * block_size, device="cuda")[:1000]
    slot_mapping[::7] = -1
    caches = [torch.full((num_blocks, block_size, 8, 128), float("nan"), dtype=dtype, device="cuda")
              for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slot_mapping)
    reshape_and_cache_ref(key, value, caches[2], caches[3], slot_mapping)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_decode_reads_the_key_written_right_before_it(kv_dtype: torch.dtype) -> None:
    # Under PDL the decode kernel loads its first tile's older keys before its wait and this
    # step's key, which rotary_and_cache (PDL too) writes right before it, only after. A CUDA
    # graph of the pair (as the engine's decode step) replayed with a new key each time: the
    # output must follow the new key, also where it sits in a partition's first tile.
    from kvfleet_kernels.rotary import rotary_and_cache, rotary_and_cache_ref

    seq_lens = [1, 17, 64, 65, 300, 1000]        # first tiles holding the newest key, and not
    n = len(seq_lens)
    b = _batch([1] * n, seq_lens, torch.bfloat16, block_size=16, seed=11, **LLAMA8B)
    k_cache, v_cache = b.k_cache.to(kv_dtype), b.v_cache.to(kv_dtype)
    last = b.seq_lens.long() - 1
    slots = b.block_tables[torch.arange(n), last // 16].long() * 16 + last % 16
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    freqs = torch.outer(torch.arange(1024, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).cuda()
    qkv = torch.empty(n, (32 + 16) * 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    out = torch.empty(n, 32, 128, dtype=torch.bfloat16, device="cuda")

    def step():
        q_rot = rotary_and_cache(last, q, k, v, 128, cos_sin, True, k_cache, v_cache, slots)
        paged_attention(q_rot.view(n, 32, 128), k_cache, v_cache, b.block_tables, b.seq_lens,
                        b.query_start_loc, b.scale, 1, 1024, out=out)

    gen = torch.Generator().manual_seed(5)
    qkv.copy_(torch.randn(qkv.shape, generator=gen))
    step()                                       # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        # a large new key: attention all but ignores the others, so a stale one shows
        qkv.copy_(torch.randn(qkv.shape, generator=gen))
        k.mul_(8.0)
        exp_k, exp_v = k_cache.clone(), v_cache.clone()
        q_ref = rotary_and_cache_ref(last, q, k, v, 128, cos_sin, True, exp_k, exp_v, slots)
        graph.replay()
        expected = paged_attention_ref(q_ref.view(n, 32, 128), exp_k, exp_v, b.block_tables,
                                       b.seq_lens, b.query_start_loc, b.scale)
        torch.testing.assert_close(out.float(), expected.float(), rtol=0.0,
                                   atol=TOLERANCE[torch.bfloat16] * 4)
