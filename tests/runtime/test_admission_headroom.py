"""admission_headroom: new requests wait while the running ones could not grow by that many
tokens in the free blocks, so a full KV cache preempts (and recomputes) less, or not at all."""

from __future__ import annotations

import random

import pytest
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.config import EngineConfig

MAX_TOKENS = 24


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 250) for _ in range(40)] for _ in range(n)]


def _run(path: str, headroom: int, num_blocks: int, prompts: list[list[int]],
         async_scheduling: bool = False):
    llm = LLM(model=path, max_num_seqs=16, num_gpu_blocks=num_blocks, block_size=16,
              enable_prefix_caching=False, admission_headroom=headroom,
              async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    kv = llm.engine.kv
    assert not kv.req_to_blocks
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks
    return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_full_headroom_admits_only_what_can_finish_and_never_preempts(tiny_model_dir,
                                                                      async_scheduling):
    # 12 requests of 40 + 24 tokens = 4 blocks each at the end; a pool of 20 usable blocks
    # takes 6 prompts (3 blocks each) at once, then they all grow into a 4th block
    path, prompts = tiny_model_dir("llama3"), _prompts(12)
    greedy_ref, preempted = _run(path, 0, 21, prompts, async_scheduling)
    assert preempted > 0                     # the default admits into the room they grow into
    tokens, preempted = _run(path, MAX_TOKENS, 21, prompts, async_scheduling)
    assert preempted == 0
    assert tokens == greedy_ref              # the same tokens, whatever the admission order


def test_partial_headroom_preempts_less(tiny_model_dir):
    path, prompts = tiny_model_dir("llama3"), _prompts(12)
    _, none = _run(path, 0, 21, prompts)
    _, some = _run(path, 12, 21, prompts)     # into the 4th block: one block reserved each
    assert some < none


def test_a_request_whose_growth_exceeds_the_free_room_still_runs_alone(tiny_model_dir):
    # 5 usable blocks: one request (40 + 24 tokens = 4 blocks) at a time; each waits for the
    # one before, nothing deadlocks, nothing is preempted
    tokens, preempted = _run(tiny_model_dir("llama3"), 1000, 6, _prompts(3))
    assert preempted == 0 and all(len(t) == MAX_TOKENS for t in tokens)


def test_negative_headroom_is_a_clear_error():
    with pytest.raises(ValueError, match="admission_headroom must be >= 0 tokens; got -1"):
        EngineConfig(model="x", admission_headroom=-1).finalize(2048)
