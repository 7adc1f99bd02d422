"""vLLM's cache_salt (SamplingParams.cache_salt, the server's `cache_salt`): the prefix cache
shares blocks only among requests of the same salt, so one tenant's prompts cannot be timed by
another's cache hits; the output does not change."""

from __future__ import annotations

import pytest
from kvfleet_runtime import LLM, SamplingParams
from support.engine_ops import all_blocks_free

PROMPT = [(13 * j) % 700 + 5 for j in range(40)]      # two full 16-token blocks and more


def test_only_requests_of_the_same_salt_share_cached_blocks(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama"), device="cpu", dtype="float32", num_gpu_blocks=64)

    def run(salt: str | None):
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt=salt)
        out = llm.generate([PROMPT], params)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first = run("tenant-a")
    assert first[0] == 0
    assert run("tenant-b")[0] == 0          # another salt: no hit on tenant-a's blocks
    assert run(None)[0] == 0                # nor without one
    again = run("tenant-a")
    assert again[0] == 32                   # its own: both full blocks of the prompt
    assert again[1] == first[1]             # same answer
    assert run(None)[0] == 32               # the unsalted prompt's blocks are its own too
    assert all_blocks_free(llm.engine)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")
