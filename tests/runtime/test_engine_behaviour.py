"""Engine behaviour beyond greedy equality: logprobs, seeds, n > 1, stops, aborts, block accounting."""

from __future__ import annotations

import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.engine.engine import LLMEngine
from support.engine_ops import run_random_ops


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama3")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=llama_dir, max_num_seqs=16, num_gpu_blocks=64)


def _all_blocks_free(engine: LLMEngine) -> bool:
    pool = engine.kv.block_pool
    return (not engine.kv.req_to_blocks and pool.get_num_free_blocks() == pool.num_usable_blocks
            and all(b.ref_cnt >= 0 for b in pool.blocks))


def test_logprobs_match_hf_log_softmax(llm, llama_dir):
    from transformers import AutoModelForCausalLM
    prompt = [5, 17, 300, 4000, 12, 99, 7]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                prompt_logprobs=2))[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + out.outputs[0].token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    for i, (tok, pos) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert abs(pos[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(3)
        assert [t for t, lp in pos.items() if lp.rank is not None][:3] == top.indices.tolist()
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(pos[t].logprob - v) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]].logprob - ref[j - 1, prompt[j]].item()) < 1e-4


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    alone = llm.generate([[11, 12, 13]], params)[0].outputs[0].token_ids
    rng = random.Random(0)
    others = [[rng.randrange(3, 40000) for _ in range(rng.randrange(2, 30))] for _ in range(7)]
    mixed = llm.generate(others[:3] + [[11, 12, 13]] + others[3:],
                         [SamplingParams(temperature=1.0, max_tokens=10)] * 3 + [params]
                         + [SamplingParams(temperature=0.7, max_tokens=6)] * 4)
    assert mixed[3].outputs[0].token_ids == alone
    unseeded = llm.generate([[11, 12, 13]] * 4, SamplingParams(temperature=1.0, max_tokens=10))
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_n_samples_share_the_prompt_blocks(llama_dir):
    llm = LLM(model=llama_dir, max_num_seqs=8, num_gpu_blocks=64)
    engine = llm.engine
    prompt = list(range(100, 150))          # 3 full blocks of 16
    engine.add_request("n3", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20))
    shared_seen = False
    while engine.has_unfinished_requests():
        engine.step()
        blocks = engine.kv.req_to_blocks
        if len(blocks) == 3:
            first = [set(b.block_id for b in blks[:3]) for blks in blocks.values()]
            shared_seen |= first[0] == first[1] == first[2]
    assert shared_seen
    assert _all_blocks_free(engine)
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stop_string_is_not_emitted_and_ends_with_stop(llm):
    free = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop = free.text[3:6]
    out = llm.generate(["The"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:free.text.index(stop)]


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    free = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_id = free.token_ids[2]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8,
                                                   stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:3] and out.stop_reason == stop_id
    late = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                                    stop_token_ids=[free.token_ids[0]]))[0].outputs[0]
    assert len(late.token_ids) >= 4


def test_prompt_too_long_names_the_lengths(llm):
    with pytest.raises(ValueError, match=r"maximum context length is 1024.*1000 in the prompt, 100"):
        llm.generate([[5] * 1000], SamplingParams(max_tokens=100))
    assert _all_blocks_free(llm.engine)


@pytest.mark.parametrize("bad, named", [([5, 2.0, 7], "2.0"), ([5, 10 ** 9], str(10 ** 9)),
                                         ([-1, 4], "-1"), ([5, 2 ** 70], str(2 ** 70)),
                                         ([5, "7"], "'7'")])
def test_bad_prompt_token_ids_are_named_and_nothing_is_queued(llm, bad, named):
    # the batch's good prompt before the bad one is not queued either (every prompt is checked
    # before the first is added)
    with pytest.raises(ValueError, match=rf"prompt token ids must be integers in \[0, \d+\); "
                                         rf"got \[{re.escape(named)}\]"):
        llm.generate([[3, 4, 5], bad], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests() and _all_blocks_free(llm.engine)


def test_prompt_token_ids_of_any_integer_type_give_python_ints(llm):
    import numpy as np
    ids = [7, 99, 1234, 5]
    engine = llm.engine
    for prompt in (ids, np.array(ids, dtype=np.int64), torch.tensor(ids), tuple(ids)):
        got = engine.tokenize(prompt)
        assert got == ids and all(type(t) is int for t in got)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    assert (llm.generate([np.array(ids)], greedy)[0].outputs[0].token_ids
            == llm.generate([ids], greedy)[0].outputs[0].token_ids)


def test_generate_launches_its_first_step_before_queueing_the_rest(llama_dir, monkeypatch):
    # the first step starts once the queue holds more prompt tokens than a step takes, and
    # schedules exactly what it would schedule from the whole batch queued up front
    prompts = [[(i * 31 + j * 7) % 3000 + 3 for j in range(20)] for i in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    firsts, events = [], []
    for mode in (True, False):
        llm = LLM(model=llama_dir, max_num_seqs=16, num_gpu_blocks=64, async_scheduling=mode,
                  max_num_batched_tokens=64)
        engine = llm.engine
        real_schedule, real_add, real_step = (engine.scheduler.schedule, engine.add_request,
                                              engine.step)
        schedules = []

        def schedule(real_schedule=real_schedule, schedules=schedules):
            out = real_schedule()
            schedules.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
            return out

        def add(*a, real_add=real_add, **k):
            events.append("add")
            return real_add(*a, **k)

        def step(real_step=real_step):
            events.append("step")
            return real_step()

        monkeypatch.setattr(engine.scheduler, "schedule", schedule)
        monkeypatch.setattr(engine, "add_request", add)
        monkeypatch.setattr(engine, "step", step)
        outs = llm.generate(prompts, greedy)
        assert events[:5] == ["add"] * 4 + ["step"] and events[5:11] == ["add"] * 6  # 80 > 64
        firsts.append(schedules[0])
        # the whole batch queued before any step (as generate did before): the same first step
        events.clear()
        monkeypatch.setattr(engine, "add_request", real_add)
        schedules.clear()
        engine.kv.block_pool.reset_prefix_cache()       # (the prompts computed again)
        for i, p in enumerate(prompts):
            engine.add_request(f"whole-{i}", p, greedy, final_only=True)
        whole = {}
        while engine.has_unfinished_requests():
            for o in real_step():
                whole[o.request_id] = o.outputs[0].token_ids
        assert [(rid.replace("whole", "offline"), n) for rid, n in schedules[0]] == [
            (f"offline-{i}", n) for i, (_, n) in enumerate(firsts[-1])]
        assert [o.outputs[0].token_ids for o in outs] == [whole[f"whole-{i}"]
                                                           for i in range(len(prompts))]
    assert firsts[0] == firsts[1] and sum(n for _, n in firsts[0]) == 64


def test_bad_llm_arguments_name_the_argument(llama_dir):
    with pytest.raises(TypeError, match="blok_size"):
        LLM(model=llama_dir, blok_size=16)
    with pytest.raises(ValueError, match="block_size must be one of"):
        LLM(model=llama_dir, block_size=7)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="neither a folder nor a .gguf"):
        LLM(model="/nonexistent/model")


def test_abort_frees_blocks_mid_generation(llm):
    engine = llm.engine
    engine.add_request("x", list(range(200, 260)), SamplingParams(max_tokens=50))
    engine.add_request("y", list(range(300, 330)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.kv.req_to_blocks
    engine.abort_request(["x", "y"])
    assert not engine.has_unfinished_requests() and _all_blocks_free(engine)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]),
                              st.integers(1, 60), st.integers(1, 12)), min_size=5, max_size=40))
def test_random_add_abort_step_never_leaks_blocks(llm, ops):
    run_random_ops(llm.engine, ops)



def test_sharded_checkpoint_with_index_loads_the_same_model(llama_dir, tmp_path):
    from support.tiny_models import make_tiny_model
    sharded = make_tiny_model("llama3", tmp_path / "sharded", max_shard_size="1MB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    params = SamplingParams(temperature=0, max_tokens=6)
    prompt = [[9, 8, 7, 6, 5]]
    one = LLM(model=llama_dir, num_gpu_blocks=16).generate(prompt, params)[0].outputs[0].token_ids
    many = LLM(model=str(sharded), num_gpu_blocks=16).generate(prompt, params)[0].outputs[0].token_ids
    assert one == many


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_load_and_mostly_agree_with_fp32(llama_dir, dtype):
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    ref = LLM(model=llama_dir, num_gpu_blocks=16).generate(prompt, params)[0].outputs[0].token_ids
    half = LLM(model=llama_dir, dtype=dtype, num_gpu_blocks=16)
    assert half.engine.runner.kv_cache.dtype == getattr(torch, dtype)
    out = half.generate(prompt, params)[0].outputs[0].token_ids
    # random tiny weights leave near-ties, so only the first tokens are held to fp32's
    assert out[:2] == ref[:2]


def test_logits_warm_up_meets_every_sampled_row_count_in_steps_of_8(llm, monkeypatch):
    # on a GPU the engine runs lm_head once at each row count (cuBLAS loads a kernel's module
    # on its first launch); here the calls are counted on the CPU runner
    runner = llm.engine.runner
    seen = []
    real = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: seen.append(h.shape[0]) or real(h))
    runner._warm_up_logits()
    top = runner.config.max_num_seqs
    assert seen == sorted(seen) and seen[-1] == top and len(set(seen)) == len(seen)
    assert all(rows in seen for rows in range(8, top + 1, 8)) and {1, 2, 4} <= set(seen)
