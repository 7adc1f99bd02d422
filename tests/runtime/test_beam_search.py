"""Beam search (vLLM's LLM.beam_search / AsyncLLMEngine.beam_search): against HF transformers'
`generate(num_beams=...)` where no beam ends (ignore_eos), and against vLLM's end-of-sequence
rule computed from HF's own logits where beams end; arguments refused; no KV block leaked."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvfleet_runtime import LLM
from kvfleet_runtime.beam_search import BeamSearchParams
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.engine.async_engine import AsyncLLMEngine
from support.engine_ops import all_blocks_free
from support.tiny_models import ARCHS, make_tiny_model
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 17, 300, 4000, 12, 99, 7], [1, 2, 3], list(range(40, 61))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # wider init than HF's 0.02: candidates' logprobs apart by more than float noise
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(make_tiny_model(arch, tmp_path_factory.mktemp(f"beam-{arch}"),
                                             initializer_range=0.2))
        return made[arch]
    return get


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_beams_equal_hf_generate_num_beams_where_none_ends(model_dir, arch):
    path = model_dir(arch)
    llm = LLM(model=path, num_gpu_blocks=256, block_size=8)
    hf = _hf(path)
    eos = llm.engine.eos_token_ids
    for width in (1, 4):
        params = BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            # (HF cannot ignore EOS, only mask it: the comparison holds where no beam takes it)
            assert not any(t in eos for s in out.sequences for t in s.tokens[len(prompt):])
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), num_beams=width,
                                  num_return_sequences=width, max_new_tokens=6,
                                  min_new_tokens=6, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True)
            assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
            if width > 1:       # (HF's one beam is greedy search: no scores)
                scores = [s.cum_logprob / 6 for s in out.sequences]   # HF: over the new tokens
                assert scores == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
            assert all(s.finish_reason == "length" for s in out.sequences)
    assert all_blocks_free(llm.engine)


def _reference(hf, prompt, params: BeamSearchParams, eos: set[int]):
    """vLLM's rule, from HF's logits of every beam run whole each round."""
    width = params.beam_width
    beams, completed = [(list(prompt), 0.0)], []

    def score(tokens, cum):
        n = len(tokens) - (tokens[-1] in eos)
        return cum / n ** params.length_penalty
    for _ in range(params.max_tokens):
        extended = []
        for tokens, cum in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1], -1)
            top = logprobs.topk(2 * width)
            for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                if t in eos:
                    completed.append((tokens + [t] if params.include_stop_str_in_output
                                      else tokens, cum + lp, "stop"))
                else:
                    extended.append((tokens + [t], cum + lp))
        extended.sort(key=lambda b: score(*b), reverse=True)
        beams = extended[:width]
        if not beams:
            break
    ranked = sorted(completed + [(t, c, "length") for t, c in beams],
                    key=lambda b: score(b[0], b[1]), reverse=True)
    return ranked[:width]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("include_stop", [False, True])
def test_beams_that_end_follow_vllms_rule(model_dir, length_penalty, include_stop):
    path = model_dir("llama3")
    llm = LLM(model=path, num_gpu_blocks=256, block_size=8)
    hf = _hf(path)
    prompt = PROMPTS[0]
    # an end token the search meets: the best beam's 2nd candidate in round 2
    with torch.no_grad():
        first = hf(torch.tensor([prompt])).logits[0, -1].argmax().item()
        eos_id = hf(torch.tensor([prompt + [first]])).logits[0, -1].topk(2).indices[1].item()
    llm.engine.eos_token_ids = {eos_id}
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty,
                              include_stop_str_in_output=include_stop)
    (out,) = llm.beam_search(prompt, params)
    ref = _reference(hf, prompt, params, {eos_id})
    assert [(s.tokens, s.finish_reason) for s in out.sequences] == [(t, r) for t, _, r in ref]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c, _ in ref],
                                                                   abs=1e-4)
    ended = [s for s in out.sequences if s.finish_reason == "stop"]
    if length_penalty == 0.0:
        assert ended                   # a short beam wins without a length penalty
    assert all(s.stop_reason == eos_id and (s.tokens[-1] == eos_id) == include_stop
               for s in ended)
    assert all(s.text == llm.get_tokenizer().decode(s.tokens) for s in out.sequences)
    assert all_blocks_free(llm.engine)


def test_text_prompts_and_the_prefix_cache(model_dir):
    llm = LLM(model=model_dir("qwen3"), num_gpu_blocks=256, block_size=8)
    text = "The quick brown fox jumps over the lazy dog " * 3
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    (by_text,) = llm.beam_search(text, params)
    ids = llm.get_tokenizer()(text).input_ids
    (by_ids,) = llm.beam_search([ids], params)
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences]
    assert by_text.sequences[0].text.startswith(text)
    # every round after the first found the beams' full blocks cached
    assert llm.engine.kv.prefix_cache_hits > 0


def test_bad_arguments_are_refused_with_nothing_left_running(model_dir):
    llm = LLM(model=model_dir("llama"), num_gpu_blocks=64, max_model_len=64)
    for kwargs, message in [({"beam_width": 0}, "beam_width must be an integer in"),
                            ({"beam_width": 11}, r"beam_width must be an integer in \[1, 10\]"),
                            ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
                            ({"temperature": -1.0}, "temperature must be a number >= 0"),
                            ({"length_penalty": "long"}, "length_penalty must be a number")]:
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.beam_search([list(range(3, 63))], BeamSearchParams(beam_width=2, max_tokens=8))
    with pytest.raises(ValueError, match="a prompt dict takes 'prompt'"):
        llm.beam_search([{"text": "hi"}], BeamSearchParams(beam_width=2, max_tokens=8))
    assert not llm.engine.has_unfinished_requests() and all_blocks_free(llm.engine)


def test_the_async_engine_searches_as_the_offline_one(model_dir):
    path = model_dir("mistral")
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    offline = LLM(model=path, num_gpu_blocks=256, block_size=8).beam_search(PROMPTS, params)

    async def run():
        engine = AsyncLLMEngine(EngineConfig(model=path, num_gpu_blocks=256, block_size=8))
        try:
            outs = await asyncio.gather(*(_final(engine.beam_search(prompt, f"b{i}", params))
                                          for i, prompt in enumerate(PROMPTS)))
            # a search cancelled mid-way aborts its round's requests
            task = asyncio.ensure_future(_final(engine.beam_search(
                PROMPTS[2], "gone", BeamSearchParams(beam_width=4, max_tokens=200,
                                                     ignore_eos=True))))
            while not engine.engine.has_unfinished_requests():
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if not engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert all_blocks_free(engine.engine)
            return outs
        finally:
            await engine.shutdown()
    outs = asyncio.run(run())
    for out, ref in zip(outs, offline, strict=True):
        assert out.finished and len(out.outputs) == 3
        assert [c.token_ids for c in out.outputs] == [
            s.tokens[len(out.prompt_token_ids):] for s in ref.sequences]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
            [s.cum_logprob for s in ref.sequences])


async def _final(gen):
    outs = [out async for out in gen]
    assert len(outs) == 1
    return outs[0]


@pytest.mark.gpu
def test_beams_on_the_gpu_equal_hf_generate_num_beams(model_dir):
    # fp32 through the Triton kernels and the decode graphs (each round's one-token requests)
    path = model_dir("qwen2")
    llm = LLM(model=path, dtype="float32", block_size=16)
    hf = _hf(path).cuda()
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    outs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), num_beams=4,
                              num_return_sequences=4, max_new_tokens=8, min_new_tokens=8,
                              do_sample=False)
        assert [s.tokens for s in out.sequences] == ref.tolist()
    assert all_blocks_free(llm.engine)
