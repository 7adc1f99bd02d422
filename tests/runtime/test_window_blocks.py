"""Sliding windows free their blocks: when every layer attends over the same window (Mistral 7B
v0.1, Phi-3-mini-4k), a block no later query can see goes back to the pool while its request
runs, its table entry pointing at the null block.

The manager (which blocks leave, when, what stays findable in the prefix cache, no double
free), the kernels (a block that left is never read: its entries point at a NaN-filled block
and the outputs stay the reference's), and the engine (a sequence longer than the whole pool
generates HF's greedy tokens; nothing leaks).
"""

from __future__ import annotations

import random

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.engine.kv_cache_manager import WINDOW_FREE_ALIGN, KVCacheManager
from kvfleet_runtime.request import Request
from support.hf_reference import hf_greedy
from support.tiny_models import make_tiny_model


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1000))


def _step(kv: KVCacheManager, r: Request, num_new: int) -> None:
    """One scheduled step of `num_new` tokens, then its sampled token (a decode step's)."""
    assert kv.allocate_slots(r, num_new) is not None
    r.num_computed_tokens += num_new
    if r.num_computed_tokens == r.num_tokens:
        r.append_token(7)


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_below_the_aligned_window_go_back_to_the_pool(caching: bool) -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_caching=caching, sliding_window=40)
    usable = kv.block_pool.num_usable_blocks
    r = _req("a", list(range(100, 400)))               # 300 tokens: 19 blocks
    _step(kv, r, 300)
    assert kv.block_pool.get_num_free_blocks() == usable - 19
    # the next query (position 300) sees keys from 261 on: the 256 tokens below go back
    _step(kv, r, 1)
    assert kv.get_block_ids("a")[:16] == [0] * 16 and 0 not in kv.get_block_ids("a")[16:]
    assert kv.block_pool.get_num_free_blocks() == usable - 3
    # nothing more leaves until the window's first key passes the next multiple of 256
    while r.num_computed_tokens < 512 + 40 - 1:
        _step(kv, r, 1)
        assert kv.num_freed_blocks["a"] == 16
    _step(kv, r, 1)     # the next query at 551: keys from 512 on
    assert kv.num_freed_blocks["a"] == 32 and kv.get_block_ids("a")[:32] == [0] * 32
    assert kv.block_pool.get_num_free_blocks() == usable - (35 - 32)
    kv.free(r)          # the null entries are not freed again (a double free would raise)
    assert kv.block_pool.get_num_free_blocks() == usable
    assert kv.block_pool.null_block.ref_cnt == 1


def test_a_prefix_that_left_the_window_is_still_found_in_the_cache() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_caching=True, sliding_window=40)
    usable = kv.block_pool.num_usable_blocks
    prompt = list(range(100, 700))
    first = _req("a", prompt)
    _step(kv, first, 600)
    _step(kv, first, 1)                 # keys from 561 on: 512 tokens left
    assert kv.num_freed_blocks["a"] == 32
    assert kv.block_pool.get_num_free_blocks() == usable - 6
    # the blocks that left a's window keep their hashes in the free queue: b's prompt hits them
    second = _req("b", prompt)
    hits, num_computed = kv.get_computed_blocks(second)
    assert num_computed == 592 and [b.block_id for b in hits[32:]] == kv.get_block_ids("a")[32:37]
    assert kv.allocate_slots(second, 600 - num_computed, hits) is not None
    # b's first query (592) sees keys from 553 on: the hits below 512 go back at once
    assert kv.num_freed_blocks["b"] == 32 and kv.get_block_ids("b")[:32] == [0] * 32
    assert kv.block_pool.get_num_free_blocks() == usable - 6 - 1        # (b's 38th block)
    kv.free(first)
    kv.free(second)
    assert kv.block_pool.get_num_free_blocks() == usable


def test_no_window_or_mixed_layers_free_nothing() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_caching=True)
    r = _req("a", list(range(600)))
    _step(kv, r, 600)
    _step(kv, r, 1)
    assert 0 not in kv.get_block_ids("a") and not kv.num_freed_blocks


def test_the_most_blocks_a_sequence_holds() -> None:
    windowed = KVCacheManager(num_blocks=8, block_size=16, enable_caching=True, sliding_window=40)
    full = KVCacheManager(num_blocks=8, block_size=16, enable_caching=True)
    assert full.max_blocks_held(10_000, 32) == 625
    assert windowed.max_blocks_held(10_000, 32) == -(-(40 + WINDOW_FREE_ALIGN + 32) // 16) + 2
    assert windowed.max_blocks_held(100, 32) == 7          # short ones: all of them


def test_a_block_that_left_the_window_is_never_read_by_the_kernels(monkeypatch) -> None:
    # decode rows and a prefill chunk after a cached prefix; the blocks the manager would give
    # back point at a block of NaNs (NaN V times a masked key's 0 is NaN: any read shows)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvfleet_kernels.paged_attention import paged_attention, paged_attention_ref
    window, bs = 40, 16
    q_lens, seq_lens = [1, 30, 1], [600, 400, 300]
    gen = torch.Generator().manual_seed(0)
    blocks = sum(-(-s // bs) for s in seq_lens)
    k_cache = torch.randn(blocks + 1, bs, 2, 32, generator=gen)
    v_cache = torch.randn(blocks + 1, bs, 2, 32, generator=gen)
    width = -(-max(seq_lens) // bs) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 1                                     # block 0: the NaN block
    for i, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[i, :n] = torch.arange(used, used + n)
        used += n
    query = torch.randn(sum(q_lens), 4, 32, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = paged_attention_ref(query, k_cache, v_cache, tables, lens, starts, 32 ** -0.5,
                                   None, window=window)
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    left = tables.clone()
    for i, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        first_seen = s - q - window + 1
        left[i, :first_seen // WINDOW_FREE_ALIGN * WINDOW_FREE_ALIGN // bs] = 0
    assert (left == 0).sum() > (tables == 0).sum() + 40       # 32 + 16 + 16 entries left

    def run(table: torch.Tensor) -> torch.Tensor:
        return paged_attention(query, k_cache, v_cache, table, lens, starts, 32 ** -0.5, None,
                               window=window)

    torch.testing.assert_close(run(left), expected, rtol=0, atol=2e-5)
    # the poison shows when a block still in a window points at it: the 600-token row's first
    # key (560) lies in block 35
    seen = left.clone()
    seen[0, 35] = 0
    assert run(seen)[0].isnan().any()


def test_a_sequence_longer_than_the_pool_generates_hfs_tokens(tmp_path) -> None:
    # 600-token sequences of 38 blocks each, in a pool of 29 usable blocks: with a window of 24
    # a sequence holds at most 22 (its window from the last multiple of 256, a step's 32)
    path = make_tiny_model("mistral", tmp_path / "m", sliding_window=24)
    rng = random.Random(3)
    shared = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (10, 5)]
    ref = hf_greedy(path, prompts, 550)
    assert min(len(t) for t in ref) > 400            # (no early EOS: the window is crossed)
    llm = LLM(model=str(path), num_gpu_blocks=30, block_size=16, max_num_batched_tokens=32,
              max_num_seqs=1)
    kv = llm.engine.kv
    assert kv.sliding_window == 24 and kv.max_blocks_held(600, 32) == 22
    assert kv.max_blocks_held(600, 32) < kv.block_pool.num_usable_blocks < 38
    held = []
    allocate = kv.allocate_slots

    def counting(request, *args, **kwargs):
        out = allocate(request, *args, **kwargs)
        rid = request.request_id
        held.append(len(kv.get_block_ids(rid)) - kv.num_freed_blocks.get(rid, 0))
        return out

    kv.allocate_slots = counting
    params = SamplingParams(temperature=0.0, max_tokens=550)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert max(held) <= 22 and llm.engine.scheduler.num_preemptions == 0
    # the second prompt found the first's shared blocks, though they had left its window
    assert outs[1].num_cached_tokens == 32
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks
    assert not kv.num_freed_blocks and not kv.req_to_blocks
