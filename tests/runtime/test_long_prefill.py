"""vLLM's long_prefill_token_threshold: a prompt's chunk in one step is capped, so a long prompt
shares its steps with the other prompts' prefills (a short prompt behind it starts at once);
outputs are those without the cap."""

from __future__ import annotations

import pytest
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.config import EngineConfig
from support.engine_ops import all_blocks_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = [(11 * i) % 4000 + 3 for i in range(150)]
SHORT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def _run(path: str, threshold: int):
    llm = LLM(model=path, max_num_batched_tokens=64, num_gpu_blocks=64,
              long_prefill_token_threshold=threshold)
    engine, sched = llm.engine, llm.engine.scheduler
    chunks: dict[str, list[int]] = {"long": [], "short": []}
    schedule = sched.schedule

    def recorded():
        out = schedule()
        for s in out.scheduled:
            chunks[s.request.request_id].append(s.num_new_tokens)
        return out
    sched.schedule = recorded
    engine.add_request("long", LONG, GREEDY)
    engine.add_request("short", SHORT, GREEDY)
    first_token_step, step, outs = None, 0, {}
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.request_id == "short" and out.outputs[0].token_ids and first_token_step is None:
                first_token_step = step
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert all_blocks_free(engine)
    return chunks, first_token_step, outs


def test_a_long_prompt_shares_its_steps(tiny_model_dir):
    path = tiny_model_dir("llama3")
    chunks, first, outs = _run(path, 0)
    # the budget's 64 tokens all go to the long prompt first: the short one waits
    assert chunks["long"][:3] == [64, 64, 22] and first > 1
    capped_chunks, capped_first, capped_outs = _run(path, 16)
    prefill = [n for n in capped_chunks["long"] if n > 1]
    assert max(prefill) == 16 and sum(prefill) == len(LONG)
    assert capped_chunks["short"][0] == len(SHORT) and capped_first == 1
    assert capped_outs == outs


def test_bad_thresholds_are_clear_errors():
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0 tokens"):
        EngineConfig(model="x", long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="it needs chunked prefill"):
        EngineConfig(model="x", long_prefill_token_threshold=32, enable_chunked_prefill=False)
