"""An fp8 (e4m3) KV cache: reshape_and_cache and paged_attention against their references, with
a scale of 1.0 and with calibrated k_scale / v_scale (the cache holds K / k_scale, V / v_scale).

The write is compared byte for byte (`.view(torch.uint8)`); attention over an fp8 cache is
compared with paged_attention_ref over the same fp8 cache, so both read identical inputs (e4m3
converts exactly to fp16/bf16/fp32) and the tolerances are those of a bf16/fp16/fp32 cache.

Triton's interpreter (3.9) rounds float -> fp8 wrongly when the rounding carries into the exponent
(`_convert_float` adds the round bit to the 3-bit mantissa without a carry: 1.95 -> 1.0, not 2.0),
so on a CPU the write is checked on values e4m3 holds exactly plus out-of-range values (which
clamp to +-448, also exact); arbitrary values are checked on a GPU. Reads are exact in the
interpreter. The interpreter also skips the compiler: test_kernel_compile_sm90.py compiles the
kernels for an sm_90 target with an fp8 cache (what the H200 runs), which needs no GPU.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.paged_attention import (
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    head_major_k,
    paged_attention,
    paged_attention_ref,
    quantize_kv_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
    token_major_v,
)
from kvfleet_kernels.rotary import rotary_and_cache, rotary_and_cache_ref
from paged_batch import ATTENTION_TOLERANCE as TOLERANCE
from paged_batch import CPU_DTYPES, DEVICE, PagedBatch, make_paged_batch

# values past the e4m3 range: 464 is the midpoint to 480 (which e4m3fn lacks), 65504 is fp16's max
OUT_OF_RANGE = [449.0, 464.0, 480.0, 1000.0, 65504.0]


def _e4m3_values(shape: tuple[int, ...], gen: torch.Generator, max_exponent: int = 15) -> torch.Tensor:
    """Random finite e4m3 values as fp32: biased exponents 0..max_exponent (subnormals and zeros
    included; 15 reaches +-448, 9 stays below +-8)."""
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7
    exponent = torch.randint(0, max_exponent + 1, shape, generator=gen, dtype=torch.uint8) << 3
    mantissa = torch.randint(0, 8, shape, generator=gen, dtype=torch.uint8)
    bits = sign | exponent | mantissa
    bits[(bits & 0x7F) == 0x7F] -= 1              # 0x7F / 0xFF are NaN: +-448 instead
    return bits.view(FP8_KV_DTYPE).float()


def _poisoned_fp8_cache(num_blocks: int, block_size: int, num_kv_heads: int,
                        head_dim: int) -> torch.Tensor:
    # NaN bytes: slots the write must leave alone keep them
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), 0x7F, dtype=torch.uint8,
                      device=DEVICE).view(FP8_KV_DTYPE)


def _write_both(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                num_blocks: int, block_size: int, *scales: float) -> list[torch.Tensor]:
    """[kernel k, kernel v, ref k, ref v] fp8 caches after writing key/value at slot_mapping
    (scales: k_scale, v_scale)."""
    caches = [_poisoned_fp8_cache(num_blocks, block_size, *key.shape[1:]) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slot_mapping, *scales)
    reshape_and_cache_ref(key, value, caches[2], caches[3], slot_mapping, *scales)
    return caches


def _assert_same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    mismatched = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
    assert mismatched == 0, f"{mismatched} of {a.numel()} bytes differ"


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_reshape_and_cache_fp8_writes_the_references_bytes_and_saturates(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 3, 32
    num_tokens = 9
    key = _e4m3_values((num_tokens, num_kv_heads, head_dim), gen)
    value = _e4m3_values((num_tokens, num_kv_heads, head_dim), gen)
    # token 0: every out-of-range value, both signs, in K and V
    big = torch.tensor(OUT_OF_RANGE)
    key[0, 0, :len(big)], key[0, 1, :len(big)] = big, -big
    value[0, 2, :len(big)] = -big
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 7]] = -1
    slot_mapping = slots.to(DEVICE)
    key, value = key.to(dtype=dtype, device=DEVICE), value.to(dtype=dtype, device=DEVICE)

    caches = _write_both(key, value, slot_mapping, num_blocks, block_size)
    _assert_same_bytes(caches[0], caches[2])
    _assert_same_bytes(caches[1], caches[3])
    # the values themselves, not only agreement with the reference
    block, offset = divmod(int(slots[0]), block_size)
    k_row, v_row = caches[0][block, offset].float().cpu(), caches[1][block, offset].float().cpu()
    assert k_row[0, :len(big)].tolist() == [FP8_E4M3_MAX] * len(big)
    assert k_row[1, :len(big)].tolist() == [-FP8_E4M3_MAX] * len(big)
    assert v_row[2, :len(big)].tolist() == [-FP8_E4M3_MAX] * len(big)
    exact = slots >= 0
    exact[0] = False
    for cache, src in ((caches[0], key), (caches[1], value)):
        written = cache.view(-1, num_kv_heads, head_dim)[slots[exact].to(DEVICE)]
        assert torch.equal(written.float(), src[exact.to(DEVICE)].float())
    # skipped tokens and unused slots still hold the NaN poison
    assert caches[0].float().isnan().all(dim=(2, 3)).sum() == num_blocks * block_size - 7


def _fp8_batch(q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, *, num_heads: int = 4,
               num_kv_heads: int = 2, head_dim: int = 32, block_size: int = 16,
               seed: int = 0, v_layout: str = "token-major",
               k_layout: str = "rows") -> PagedBatch:
    """A paged batch in `dtype` whose caches hold fp8: randn * 4 rounded to e4m3 (magnitudes
    from e4m3's subnormals to ~20, so several exponents and rounding steps are in play). V
    token-major as the engine lays out an fp8 cache (token_major_v), or in rows; K in rows, or
    head-major (head_major_k, the engine's under KVFLEET_K_HEAD_MAJOR=1)."""
    batch = make_paged_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, block_size=block_size, dtype=torch.float32,
                             device=DEVICE, seed=seed)
    batch.query = (batch.query / 4).to(dtype)       # keeps softmax mixed over keys ~4x randn
    batch.k_cache = quantize_kv_ref(batch.k_cache * 4, FP8_KV_DTYPE)
    batch.v_cache = quantize_kv_ref(batch.v_cache * 4, FP8_KV_DTYPE)
    if v_layout == "token-major":
        batch.v_cache = token_major_v(torch.empty_like(batch.v_cache)).copy_(batch.v_cache)
    if k_layout == "head-major":
        batch.k_cache = head_major_k(torch.empty_like(batch.k_cache)).copy_(batch.k_cache)
    return batch


def _check_fp8(batch: PagedBatch, *, decode_only: bool = False, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
    """paged_attention against paged_attention_ref over batch's fp8 caches; returns the
    reference's output."""
    assert batch.k_cache.dtype == FP8_KV_DTYPE and batch.v_cache.dtype == FP8_KV_DTYPE
    max_query_len = 1 if decode_only else None
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, batch.scale, max_query_len)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(*args, batch.max_seq_len if decode_only else None, out=out, **scales)
    assert result is out and out.dtype == batch.query.dtype
    expected = paged_attention_ref(*args, **scales)
    # outputs are averages of V values up to ~20: the tolerance is relative to their scale
    scale = max(float(expected.float().abs().max()), 1.0)
    torch.testing.assert_close(out.float() / scale, expected.float() / scale, rtol=0.0,
                               atol=TOLERANCE[batch.query.dtype])
    if not (batch.k_cache.is_contiguous() and batch.v_cache.is_contiguous()):
        # token-major V, head-major K: the same tiles reach the same dots, so the bits of K
        # and V in rows
        rows = (args[0], batch.k_cache.contiguous(), batch.v_cache.contiguous(), *args[3:])
        in_rows = paged_attention(*rows, batch.max_seq_len if decode_only else None, **scales)
        assert torch.equal(out, in_rows)
    return expected


@pytest.mark.parametrize("v_layout", ["token-major", "rows"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_prefill_over_fp8_cache_matches_reference(dtype: torch.dtype, v_layout: str) -> None:
    # fresh prompts and a 9-token chunk after a 38-token cached prefix
    _check_fp8(_fp8_batch([5, 23, 9], [5, 23, 47], dtype, seed=11, v_layout=v_layout))


@pytest.mark.parametrize("v_layout", ["token-major", "rows"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_mixed_decode_and_prefill_over_fp8_cache_matches_reference(dtype: torch.dtype,
                                                                   v_layout: str) -> None:
    _check_fp8(_fp8_batch([1, 12, 1, 6], [40, 12, 70, 33], dtype, num_heads=8, seed=12,
                          v_layout=v_layout))


@pytest.mark.parametrize("v_layout", ["token-major", "rows"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("seq_lens", [[600, 37, 290], [17, 50]], ids=["split", "one-partition"])
def test_decode_over_fp8_cache_matches_reference(dtype: torch.dtype, seq_lens: list[int],
                                                 v_layout: str) -> None:
    _check_fp8(_fp8_batch([1] * len(seq_lens), seq_lens, dtype, seed=13, v_layout=v_layout),
               decode_only=True)


@pytest.mark.parametrize("block_size", [8, 64])
def test_token_major_v_tiles_across_and_within_blocks(block_size: int) -> None:
    # decode's 32-key tiles (and prefill's 16-key ones on a CPU) span 4 blocks of 8 keys, or
    # half of one block of 64: both ways of cutting a tile into runs of adjacent keys
    _check_fp8(_fp8_batch([1, 1, 1], [100, 7, 64], torch.float16, block_size=block_size, seed=15),
               decode_only=True)
    _check_fp8(_fp8_batch([30, 1], [95, 70], torch.float16, block_size=block_size, seed=16))


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_head_major_k_attends_as_k_in_rows(block_size: int) -> None:
    # decode cut into partitions and in one, prefill after a cached prefix, a mixed batch; V
    # token-major as the engine's (each against the reference and, bit for bit, K in rows)
    for q_lens, seq_lens, decode_only in [([1, 1, 1], [600, 37, 290], True),
                                          ([1, 1], [17, 50], True),
                                          ([5, 23, 9], [5, 23, 47], False),
                                          ([1, 12, 1, 6], [40, 12, 70, 33], False)]:
        batch = _fp8_batch(q_lens, seq_lens, torch.float16, num_heads=8, block_size=block_size,
                           seed=block_size + len(q_lens), k_layout="head-major")
        assert not batch.k_cache.is_contiguous()
        _check_fp8(batch, decode_only=decode_only)


@pytest.mark.parametrize("layout", ["k-head-major", "v-token-major"])
def test_reshape_and_cache_writes_a_head_major_k_or_token_major_v_cache(layout: str) -> None:
    gen = torch.Generator().manual_seed(17)
    num_blocks, block_size, num_kv_heads, head_dim = 4, 8, 2, 16
    key = _e4m3_values((6, num_kv_heads, head_dim), gen).to(DEVICE)
    value = _e4m3_values((6, num_kv_heads, head_dim), gen).to(DEVICE)
    slots = torch.tensor([3, 17, -1, 8, 31, 0], device=DEVICE)
    rows = _write_both(key, value, slots, num_blocks, block_size)
    storage = [_poisoned_fp8_cache(num_blocks, block_size, num_kv_heads, head_dim)
               for _ in range(2)]
    k_cache = head_major_k(storage[0]) if layout == "k-head-major" else storage[0]
    v_cache = token_major_v(storage[1]) if layout == "v-token-major" else storage[1]
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    _assert_same_bytes(k_cache.contiguous(), rows[0])
    _assert_same_bytes(v_cache.contiguous(), rows[1])
    # and where the bytes lie: token t's key at [block, head, offset, dim], or its value at
    # [block, head, dim, offset]
    if layout == "k-head-major":
        laid = storage[0].view(num_blocks, num_kv_heads, block_size, head_dim)
        written = key
    else:
        laid = storage[1].view(num_blocks, num_kv_heads, head_dim, block_size).transpose(2, 3)
        written = value
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            assert torch.equal(laid[block, :, offset].float(), written[t].float())


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_write_then_attend_through_fp8_cache_matches_reference(dtype: torch.dtype) -> None:
    # The engine's order: this step's K/V go into the fp8 cache, then attention reads it.
    gen = torch.Generator().manual_seed(14)
    batch = _fp8_batch([4, 1], [20, 33], dtype, seed=14)
    new_k = _e4m3_values((5, 2, 32), gen, max_exponent=9).to(dtype=dtype, device=DEVICE)
    new_v = _e4m3_values((5, 2, 32), gen, max_exponent=9).to(dtype=dtype, device=DEVICE)
    table = batch.block_tables.cpu().long()
    positions = [(0, p) for p in range(16, 20)] + [(1, 32)]          # the last q_len of each
    slots = torch.tensor([int(table[s, p // 16]) * 16 + p % 16 for s, p in positions],
                         device=DEVICE)
    caches = [batch.k_cache.clone(), batch.v_cache.clone(), batch.k_cache, batch.v_cache]
    reshape_and_cache(new_k, new_v, caches[0], caches[1], slots)
    reshape_and_cache_ref(new_k, new_v, caches[2], caches[3], slots)
    _assert_same_bytes(caches[0], caches[2])
    batch.k_cache, batch.v_cache = caches[0], caches[1]
    _check_fp8(batch)


# ------------------------------------------------------------------ calibrated k_scale / v_scale
# Powers of two on a CPU: K / k_scale of an e4m3 value times k_scale is that value again, so the
# interpreter's fp8 rounding (module docstring) never comes into play; any scale on the GPU.
POW2_SCALES = (4.0, 0.25)


def _scaled_e4m3(shape: tuple[int, ...], gen: torch.Generator, scale: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, those values times scale in dtype): what the cache must hold, what to write."""
    held = _e4m3_values(shape, gen).to(DEVICE)
    return held, (held * scale).to(dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_reshape_and_cache_fp8_stores_k_and_v_over_their_scales(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(18)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 3, 32
    k_scale, v_scale = POW2_SCALES
    k_held, key = _scaled_e4m3((9, num_kv_heads, head_dim), gen, k_scale, dtype)
    v_held, value = _scaled_e4m3((9, num_kv_heads, head_dim), gen, v_scale, dtype)
    # past the range after the division too: saturates at +-448
    key[0, 0, :2] = torch.tensor([1000.0 * k_scale, -500.0 * k_scale])
    k_held[0, 0, :2] = torch.tensor([FP8_E4M3_MAX, -FP8_E4M3_MAX])
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9].to(DEVICE)
    caches = _write_both(key, value, slots, num_blocks, block_size, k_scale, v_scale)
    _assert_same_bytes(caches[0], caches[2])
    _assert_same_bytes(caches[1], caches[3])
    blocks, offsets = slots // block_size, slots % block_size
    _assert_same_bytes(caches[0][blocks, offsets], k_held.to(FP8_KV_DTYPE))
    _assert_same_bytes(caches[1][blocks, offsets], v_held.to(FP8_KV_DTYPE))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rotary_and_cache_stores_k_and_v_over_their_scales(dtype: torch.dtype) -> None:
    # every token at position 0 (cos 1, sin 0): the rotated key is the key itself, exact in
    # the interpreter; the GPU test (test_kernel_pointwise) rotates at real positions
    gen = torch.Generator().manual_seed(19)
    num_tokens, num_q_heads, num_kv_heads, head_dim = 6, 4, 2, 32
    k_scale, v_scale = POW2_SCALES
    k_held, key = _scaled_e4m3((num_tokens, num_kv_heads * head_dim), gen, k_scale, dtype)
    v_held, value = _scaled_e4m3((num_tokens, num_kv_heads * head_dim), gen, v_scale, dtype)
    query = torch.randn(num_tokens, num_q_heads * head_dim, generator=gen).to(dtype=dtype,
                                                                             device=DEVICE)
    cos_sin = torch.cat([torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)], -1)
    positions = torch.zeros(num_tokens, dtype=torch.long, device=DEVICE)
    slots = torch.tensor([5, 17, 0, 30, 9, 22], device=DEVICE)
    caches = [_poisoned_fp8_cache(4, 8, num_kv_heads, head_dim) for _ in range(4)]
    args = (positions, query, key, value, head_dim, cos_sin.to(DEVICE), True)
    q_out = rotary_and_cache(*args, caches[0], caches[1], slots, k_scale, v_scale)
    q_ref = rotary_and_cache_ref(*args, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(q_out, q_ref)
    _assert_same_bytes(caches[0], caches[2])
    _assert_same_bytes(caches[1], caches[3])
    blocks, offsets = slots // 8, slots % 8
    _assert_same_bytes(caches[0][blocks, offsets],
                       k_held.view(num_tokens, num_kv_heads, head_dim).to(FP8_KV_DTYPE))
    _assert_same_bytes(caches[1][blocks, offsets],
                       v_held.view(num_tokens, num_kv_heads, head_dim).to(FP8_KV_DTYPE))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("q_lens", "seq_lens"), [
    ([5, 23, 9], [5, 23, 47]),                # fresh prompts, a chunk after a cached prefix
    ([1, 12, 1, 6], [40, 12, 70, 33]),        # mixed decode and prefill
    ([1, 1, 1], [600, 37, 290]),              # decode cut into partitions
], ids=["prefill", "mixed", "decode-split"])
def test_attention_over_a_scaled_fp8_cache_reads_k_and_v_times_their_scales(
        dtype: torch.dtype, q_lens: list[int], seq_lens: list[int]) -> None:
    k_scale, v_scale = 3.3, 0.07
    batch = _fp8_batch(q_lens, seq_lens, dtype, num_heads=8, seed=sum(seq_lens))
    batch.query = (batch.query.float() / k_scale).to(dtype)      # scores stay as unscaled ones
    decode_only = max(q_lens) == 1
    expected = _check_fp8(batch, decode_only=decode_only, k_scale=k_scale, v_scale=v_scale)
    # what the scales mean: attention over the cache dequantized (times them) in fp32
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale,
            1 if decode_only else None)
    dequantized = paged_attention_ref(batch.query.float(), batch.k_cache.float() * k_scale,
                                      batch.v_cache.float() * v_scale, *args)
    torch.testing.assert_close(expected.float(), dequantized, rtol=0.0,
                               atol=TOLERANCE[dtype] * float(dequantized.abs().max()))
    unscaled = paged_attention_ref(batch.query, batch.k_cache, batch.v_cache, *args)
    assert (unscaled.float() - dequantized).abs().max() > 0.5 * dequantized.abs().max()


def test_kv_scales_belong_to_an_fp8_cache_and_must_be_finite_and_positive() -> None:
    key = torch.ones(2, 1, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    plain = [torch.zeros(2, 4, 1, 16, device=DEVICE) for _ in range(2)]
    with pytest.raises(ValueError, match=r"fp8 cache only; got 2.0 for a torch.float32 cache"):
        reshape_and_cache(key, key, *plain, slots, k_scale=2.0)
    with pytest.raises(ValueError, match="fp8 cache only"):
        paged_attention(key, *plain, torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
                        torch.ones(2, dtype=torch.int32, device=DEVICE),
                        torch.arange(3, dtype=torch.int32, device=DEVICE), 1.0, v_scale=0.5)
    fp8 = [_poisoned_fp8_cache(2, 4, 1, 16) for _ in range(2)]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be finite and > 0"):
            reshape_and_cache(key, key, *fp8, slots, v_scale=bad)
        with pytest.raises(ValueError, match="must be finite and > 0"):
            reshape_and_cache_ref(key, key, *fp8, slots, k_scale=bad)


# ----------------------------------------------------------------------------- GPU, real shapes
LLAMA8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 0.0021)], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_reshape_and_cache_fp8_rounds_like_torch(dtype: torch.dtype,
                                                     scales: tuple[float, float]) -> None:
    # arbitrary values: round-to-nearest-even ties and carries into the exponent included
    gen = torch.Generator().manual_seed(20)
    key = (torch.randn(1000, 8, 128, generator=gen) * 100).to(dtype=dtype, device="cuda")
    value = (torch.randn(1000, 8, 128, generator=gen) * 0.01).to(dtype=dtype, device="cuda")
    key[0, 0, :len(OUT_OF_RANGE)] = torch.tensor(OUT_OF_RANGE, dtype=dtype)
    slot_mapping = torch.randperm(300 * 16, generator=gen)[:1000].cuda()
    slot_mapping[::7] = -1
    caches = _write_both(key, value, slot_mapping, 300, 16, *scales)
    _assert_same_bytes(caches[0], caches[2])
    _assert_same_bytes(caches[1], caches[3])


@pytest.mark.gpu
def test_gpu_attention_over_a_scaled_fp8_cache() -> None:
    # the compiled kernels' scale arguments: decode (batch 1 before the PDL wait, partitions,
    # one warp a program) and prefill after a cached prefix
    gen = torch.Generator().manual_seed(33)
    for num_seqs, max_len in [(1, 700), (64, 3000), (256, 1500)]:
        seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
        seq_lens[0] = max_len
        _check_fp8(_fp8_batch([1] * num_seqs, seq_lens.tolist(), torch.bfloat16, seed=num_seqs,
                              **LLAMA8B), decode_only=True, k_scale=0.6, v_scale=2.7)
    _check_fp8(_fp8_batch([1000, 1, 300], [1000, 1500, 2000], torch.bfloat16, seed=34, **LLAMA8B),
               k_scale=0.6, v_scale=2.7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_decode_over_fp8_cache(dtype: torch.dtype, block_size: int) -> None:
    # token-major V (the engine's): each case also against V in rows, bit for bit (_check_fp8)
    gen = torch.Generator().manual_seed(block_size)
    for num_seqs, max_len in [(1, 8192), (1, 700), (64, 3000), (256, 1500), (600, 1200)]:
        # (1, 700): the first tile read before the PDL wait; 256 and 600: one warp a program
        # (>= 1024 programs, decode_config); 64: two warps
        seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
        seq_lens[0] = max_len
        _check_fp8(_fp8_batch([1] * num_seqs, seq_lens.tolist(), dtype, block_size=block_size,
                              seed=num_seqs, **LLAMA8B), decode_only=True)


@pytest.mark.gpu
def test_gpu_head_major_k_attends_as_k_in_rows() -> None:
    # compiled kernels over a head-major K (KVFLEET_K_HEAD_MAJOR=1): batch 1 (the first tile
    # before the PDL wait), two warps, one warp a program, prefill; bits of K in rows
    gen = torch.Generator().manual_seed(31)
    for num_seqs, max_len in [(1, 700), (64, 3000), (256, 1500)]:
        seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
        seq_lens[0] = max_len
        _check_fp8(_fp8_batch([1] * num_seqs, seq_lens.tolist(), torch.bfloat16, seed=num_seqs,
                              k_layout="head-major", **LLAMA8B), decode_only=True)
    _check_fp8(_fp8_batch([1000, 1, 300], [1000, 1500, 2000], torch.bfloat16, seed=32,
                          k_layout="head-major", **LLAMA8B))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_prefill_over_fp8_cache(dtype: torch.dtype, block_size: int) -> None:
    _check_fp8(_fp8_batch([2048, 1000, 1, 333], [2048, 8000, 4097, 333], dtype,
                          block_size=block_size, seed=block_size, **LLAMA8B))
