"""Speculative decoding by n-gram prompt lookup: the config, the proposer, the verification
(greedy exact, random by rejection sampling; penalties, min_tokens and grammars over each
drafted row as if the drafts before it were generated; logprobs of every kept token), and the
engine: greedy output token-identical to HF transformers and to the engine without drafts,
stops inside drafts, preemption, no leaks."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.engine.speculative import SpeculativeConfig, propose_ngram
from kvfleet_runtime.layers.sampler import verify_drafts
from kvfleet_runtime.structured_outputs import (
    GrammarBackend,
    StructuredOutputsParams,
    grammar_prefix,
)
from support.engine_ops import all_blocks_free, run_random_ops
from support.hf_reference import hf_greedy
from support.tiny_models import ARCHS, make_tiny_model
from transformers import AutoTokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


# ---- config ------------------------------------------------------------------------------

def test_config_parses_vllms_json_and_fills_lookup_bounds_as_vllm():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 5, 5)
    c = SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 2,
                                 "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


@pytest.mark.parametrize("value, words", [
    ("{not json", "JSON object"),
    ("[1, 2]", "JSON object"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"num_speculative_tokens": 2, "model": "x"}, "unknown keys ['model']"),
])
def test_bad_config_names_what_is_wrong(value, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(value)
    assert words in str(e.value)


def test_engine_config_parses_the_flag_and_keeps_async_scheduling():
    c = EngineConfig(model="x", device="cuda", speculative_config=json.dumps(NGRAM))
    assert c.speculative.num_speculative_tokens == 4 and c.async_scheduling is True
    assert EngineConfig(model="x", device="cuda").speculative is None
    with pytest.raises(ValueError, match="disable_by_batch_size must be a positive integer"):
        EngineConfig(model="x", speculative_config={**NGRAM, "disable_by_batch_size": 0})


# ---- proposer ----------------------------------------------------------------------------

def test_ngram_proposer_takes_the_longest_suffix_then_its_latest_occurrence():
    # suffix [1, 2, 3] occurred at 0 (followed by 4, 5); its 1-gram [3] later at 6 (then 9)
    tokens = [1, 2, 3, 4, 5, 0, 3, 9, 1, 2, 3]
    assert propose_ngram(tokens, 1, 3, 2) == [4, 5]
    assert propose_ngram(tokens, 1, 1, 3) == [9, 1, 2]      # the latest 1-gram match
    assert propose_ngram(tokens, 1, 3, 10) == [4, 5, 0, 3, 9, 1, 2, 3]   # up to the end
    assert propose_ngram([1, 2, 3, 9, 2, 3], 2, 2, 5) == [9, 2, 3]
    assert propose_ngram([1, 2, 3], 1, 2, 2) == []           # nothing recurs
    assert propose_ngram([7], 1, 2, 2) == [] and propose_ngram([7, 7], 1, 1, 0) == []
    assert propose_ngram([7, 7], 1, 1, 3) == [7]


def test_ngram_proposer_ignores_byte_matches_across_token_boundaries():
    # [256, 1] is bytes 00 01 00 00 | 01 00 00 00: 65536 (00 00 01 00) sits at byte 2
    assert propose_ngram([256, 1, 9, 65536], 1, 1, 3) == []
    assert propose_ngram([65536, 5, 256, 1, 9, 65536], 1, 1, 2) == [5, 256]


# ---- verification ------------------------------------------------------------------------

def _rows(*argmaxes: int, vocab: int = 8) -> torch.Tensor:
    x = torch.zeros(len(argmaxes), vocab)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return x


def _verify(*args, **kwargs) -> list[list[int]]:
    """verify_drafts' token ids (each request's kept drafts and the token after them)."""
    return [[t.token_id for t in kept] for kept in verify_drafts(*args, **kwargs)]


def test_greedy_keeps_the_drafts_equal_to_the_argmax_then_the_argmax():
    greedy = SamplingParams(temperature=0.0)
    # request 1: drafts 3, 4, 6 against argmaxes 3, 4, 5, 1 -> 3, 4, then 5
    # request 2: drafts 2, 2 all kept -> 2, 2 and the bonus 7; request 3: first draft wrong
    logits = torch.cat([_rows(3, 4, 5, 1), _rows(2, 2, 7), _rows(0, 6)])
    out = _verify(logits, [[3, 4, 6], [2, 2], [5]], [greedy] * 3, [None] * 3)
    assert out == [[3, 4, 5], [2, 2, 7], [0]]
    with pytest.raises(ValueError, match="drafts need 9"):
        verify_drafts(logits[:8], [[3, 4, 6], [2, 2], [5]], [greedy] * 3, [None] * 3)


def test_greedy_verification_sees_logit_bias_and_allowed_ids():
    p = SamplingParams(temperature=0.0, logit_bias={6: 100.0})
    assert _verify(_rows(3, 3), [[3]], [p], [None]) == [[6]]
    p = SamplingParams(temperature=0.0, allowed_token_ids=[3, 5])
    # row 2's argmax (1) is not allowed: of the allowed ids (tied at 0) the first, 3
    assert _verify(_rows(3, 1), [[3]], [p], [None]) == [[3, 3]]
    # a draft the request may not emit is never kept, even where it is the raw argmax
    assert _verify(_rows(1, 1), [[1]], [p], [None]) == [[3]]


@pytest.mark.parametrize("penalty", [0.0, 1.0], ids=["plain", "frequency-penalty"])
@pytest.mark.parametrize("draft", [0, 2, 4])
def test_random_verification_keeps_the_models_distribution(draft, penalty):
    # a proposal that is always `draft`: the first token must still follow p exactly, and the
    # second (after a kept draft) p2, with the draft counted by the frequency penalty as if it
    # had been generated; 40,000 requests at once, frequencies within 4.5 sigma
    torch.manual_seed(0)
    p1 = torch.tensor([0.05, 0.1, 0.45, 0.25, 0.15])
    p2 = torch.tensor([0.3, 0.3, 0.1, 0.2, 0.1])
    n = 40_000
    logits = torch.stack([p1.log(), p2.log()]).repeat(n, 1)
    params = SamplingParams(temperature=1.0, frequency_penalty=penalty)
    out = _verify(logits, [[draft]] * n, [params] * n, [None] * n, [[]] * n, [[]] * n)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=5) / n
    sigma = (p1 * (1 - p1) / n).sqrt()
    assert ((first - p1).abs() <= 4.5 * sigma).all(), (first, p1)
    kept = [o[1] for o in out if len(o) == 2]
    assert abs(len(kept) / n - p1[draft].item()) <= 4.5 * sigma[draft].item()
    second = torch.bincount(torch.tensor(kept), minlength=5) / len(kept)
    p2 = torch.softmax(p2.log() - penalty * torch.nn.functional.one_hot(torch.tensor(draft), 5), 0)
    assert ((second - p2).abs() <= 4.5 * (p2 * (1 - p2) / len(kept)).sqrt()).all(), (second, p2)


def test_penalties_and_min_tokens_count_the_drafts_before_each_row():
    # every row: 3 scores 5.0, 4 scores 4.0; a frequency penalty of 0.6 a 3 already generated
    x = _rows(3, 3, 3)
    x[:, 4] = 4.0
    p = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    # row 0 (no 3 yet): 3; row 1 (one 3, the kept draft): 4.4 > 4, 3; row 2 (two): 3.8, 4
    assert _verify(x, [[3, 3]], [p], [None], [[]], [[]]) == [[3, 3, 4]]
    # a 3 in the output already: the second draft is rejected
    assert _verify(x, [[3, 3]], [p], [None], [[]], [[3]]) == [[3, 4]]
    # repetition penalty counts the prompt: a 3 in it (5 / 1.3 = 3.85 < 4) -> 4 at once
    p = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    assert _verify(x, [[3, 3]], [p], [None], [[3]], [[]]) == [[4]]
    # min_tokens masks the stop id until the output (kept drafts included) is long enough
    x = _rows(2, 2, 2)
    x[:, 7] = 4.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert _verify(x, [[7, 7]], [p], [None], [[]], [[]]) == [[7, 7, 2]]
    assert _verify(x, [[7, 7]], [p], [None], [[]], [[5]]) == [[7, 2]]
    assert _verify(x, [[7, 7]], [SamplingParams(temperature=0.0, stop_token_ids=[2])],
                   [None], [[]], [[]]) == [[2]]
    with pytest.raises(ValueError, match="need prompt_token_ids and output_token_ids"):
        verify_drafts(x, [[7, 7]], [p], [None])


def test_verification_reports_each_kept_tokens_raw_logprobs():
    torch.manual_seed(5)
    raw = torch.randn(4, 50)
    drafts = [int(raw[0].argmax()), int(raw[1].argmax()), (int(raw[2].argmax()) + 1) % 50]
    # a logit bias that moves no argmax: logprobs stay those of the raw logits
    p = SamplingParams(temperature=0.0, logprobs=3, logit_bias={drafts[0]: 0.5})
    (kept,) = verify_drafts(raw, [drafts], [p], [None])
    assert [t.token_id for t in kept] == [*drafts[:2], int(raw[2].argmax())]
    want = raw.log_softmax(-1)
    for row, tok in enumerate(kept):
        assert tok.logprob == pytest.approx(want[row, tok.token_id].item(), abs=1e-5)
        assert tok.rank == 1
        top = want[row].topk(3)
        assert tok.top_ids == top.indices.tolist()
        assert tok.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    # sampled: a kept draft's logprob is the draft's (not that of the draw the row also made)
    peaked = torch.randn(3, 50) * 0.1
    peaked[0, 7], peaked[1, 9] = 20.0, 20.0
    p = SamplingParams(temperature=1.0, logprobs=0)
    (kept,) = verify_drafts(peaked, [[7, 9]], [p], [None])
    assert [t.token_id for t in kept[:2]] == [7, 9]
    want = peaked.log_softmax(-1)
    for row, tok in enumerate(kept):
        assert tok.logprob == pytest.approx(want[row, tok.token_id].item(), abs=1e-5)
        assert tok.top_ids == []
    assert kept[0].rank == kept[1].rank == 1
    # a request without logprobs: its tokens carry none
    (kept,) = verify_drafts(raw, [drafts], [SamplingParams(temperature=0.0)], [None])
    assert all(t.top_ids is None for t in kept)


def test_random_verification_follows_top_k_and_temperature():
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(2, 1)
    n = 20_000
    params = SamplingParams(temperature=0.5, top_k=2)
    # draft 3 is outside the top 2: never kept; the draws follow softmax(x / 0.5) over ids 0-1
    out = _verify(logits.repeat(n, 1), [[3]] * n, [params] * n, [None] * n)
    assert all(len(o) == 1 and o[0] in (0, 1) for o in out)
    share = sum(o[0] == 0 for o in out) / n
    expected = torch.softmax(torch.tensor([2.0, 1.0]) / 0.5, 0)[0].item()
    assert abs(share - expected) < 0.015


def test_seeded_verification_is_reproducible():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, seed=7)]

    def run():
        g = torch.Generator().manual_seed(7)
        return [_verify(logits, [[1, 2]], params, [g])[0] for _ in range(5)]
    assert run() == run()


def test_a_grammar_cuts_the_drafts_and_masks_each_row_as_after_the_drafts_before(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id})
    grammar = backend.sequence(StructuredOutputsParams(choice=["alpha beta", "gamma"]))
    ids = tok("alpha beta", add_special_tokens=False)["input_ids"]
    other = tok("gamma", add_special_tokens=False)["input_ids"][0]
    # the prefix the grammar allows: all of "alpha beta", then its stop token; not past it
    assert grammar_prefix(grammar, [*ids, tok.eos_token_id, other]) == len(ids) + 1
    assert grammar_prefix(grammar, [*ids[:1], other]) == 1
    assert grammar_prefix(grammar, [other, *ids]) == 1             # "gamma"'s first token
    assert grammar_prefix(grammar, [ids[1]]) == 0                   # not a start
    assert grammar.matcher.accept_token(ids[0]) and grammar.matcher.rollback(1) is None
    # every row's raw argmax (5.0) is a token the grammar forbids there; the drafts score 3.0
    # and the stop token 1.0: masked as after the drafts before it, each row keeps its draft,
    # and the row after them the stop token (the only one left)
    bad = tok(" zzz", add_special_tokens=False)["input_ids"][0]
    x = torch.zeros(len(ids) + 1, len(tok))
    x[:, bad] = 5.0
    x[torch.arange(len(ids)), torch.tensor(ids)] = 3.0
    x[:, tok.eos_token_id] = 1.0
    p = SamplingParams(temperature=0.0, structured_outputs={"choice": ["alpha beta", "gamma"]})
    assert _verify(x, [ids], [p], [None], grammars=[grammar]) == [[*ids, tok.eos_token_id]]
    assert _verify(x, [ids], [p], [None]) == [[bad]]                # (no grammar given)
    # the matcher is where it was: the same again
    assert _verify(x, [ids], [p], [None], grammars=[grammar]) == [[*ids, tok.eos_token_id]]


# ---- engine ------------------------------------------------------------------------------

def _repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase: n-gram lookup finds drafts in them (the tiny random models
    also fall into loops of their own, which the lookup then drafts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 9))]
        out.append(phrase * rng.randrange(2, 5) + phrase[: i % len(phrase)])
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_with_drafts_equals_hf_and_the_engine_without(tiny_model_dir, arch,
                                                                    async_scheduling):
    path = tiny_model_dir(arch)
    prompts = _repetitive_prompts(12, seed=len(arch))
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ref = hf_greedy(path, prompts, 24)
    llm = LLM(model=path, max_num_seqs=8, speculative_config=NGRAM,
              async_scheduling=async_scheduling)
    engine = llm.engine
    async_steps = []
    real_step_async = engine._step_async
    engine._step_async = lambda t0: async_steps.append(1) or real_step_async(t0)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == ref
    # with async scheduling, steps go asynchronous while no drafts are found, and synchronous
    # (drafted) where they are
    assert bool(async_steps) == async_scheduling
    stats = llm.engine.spec_stats
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
    plain = LLM(model=path, max_num_seqs=8, async_scheduling=False)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == ref
    assert all_blocks_free(llm.engine)


def test_a_looping_request_takes_fewer_steps_with_drafts(spec_llm, plain_llm):
    # the tiny model falls into a loop on this prompt: the drafts are then kept, several
    # tokens a step; each kept draft saves one step (drafts never run past max_tokens)
    prompt = [[5, 6, 7, 8] * 6]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    steps, outs = [], []
    accepted = spec_llm.engine.spec_stats["spec_accepted_tokens"]
    for llm in (spec_llm, plain_llm):
        before = llm.engine.step_totals["steps"]
        outs.append(llm.generate(prompt, params)[0].outputs[0].token_ids)
        steps.append(llm.engine.step_totals["steps"] - before)
    accepted = spec_llm.engine.spec_stats["spec_accepted_tokens"] - accepted
    assert outs[0] == outs[1] and len(outs[0]) == 48
    assert steps[1] == 48 and accepted >= 8 and steps[0] == 48 - accepted, (steps, accepted)


def test_triton_path_in_the_interpreter_with_drafts_matches_hf(tiny_model_dir, monkeypatch):
    # the GPU code path (fused rotary + cache write, the decode kernel over the drafted rows,
    # prefill chunks beside them) on a CPU through Triton's interpreter
    path = tiny_model_dir("qwen3")
    prompts = _repetitive_prompts(4, seed=2)
    ref = hf_greedy(path, prompts, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model=path, attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=24,
              speculative_config=NGRAM)
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
        assert [o.outputs[0].token_ids for o in out] == ref
        assert llm.engine.spec_stats["spec_accepted_tokens"] > 0
        assert all_blocks_free(llm.engine)
    finally:
        llm.engine.shutdown()
        from kvfleet_runtime.layers.backend import set_backend
        set_backend("auto")


def _oracle(outputs, k: int, shift: int):
    """A stand-in for SpeculativeConfig.propose: the next k tokens each request's output
    (`outputs`, the engine's without drafts) has, every third proposal's last one wrong (+shift)."""
    ahead = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs}

    def propose(self, request, limit):
        done = len(request.output_token_ids)
        drafts = list(ahead[tuple(request.prompt_token_ids)][done:done + min(limit, k)])
        if drafts and done % 3 == 1:
            drafts[-1] = (drafts[-1] + shift) % 1000
        return drafts
    return propose


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), max_num_seqs=8, speculative_config=NGRAM,
               dtype="float32")


@pytest.fixture(scope="module")
def plain_llm(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), max_num_seqs=8, dtype="float32",
               async_scheduling=False)


def test_stops_and_max_tokens_inside_drafts_cut_the_output_as_without(spec_llm, plain_llm):
    prompts = _repetitive_prompts(8, seed=11)
    free = [o.outputs[0].token_ids for o in plain_llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=30))]
    before = dict(spec_llm.engine.spec_stats)
    # a stop token from the middle of each output, max_tokens of every length, a stop string
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[f[len(f) // 2]])
              for f in free]
    params += [SamplingParams(temperature=0.0, max_tokens=m) for m in (1, 2, 3, 5, 7)]
    all_prompts = prompts + prompts[:5]
    got = spec_llm.generate(all_prompts, params)
    want = plain_llm.generate(all_prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert g.outputs[0].stop_reason == w.outputs[0].stop_reason
    text = plain_llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=30))[0]
    stop = text.outputs[0].text[len(text.outputs[0].text) // 2:][:3]
    p = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop])
    assert (spec_llm.generate(prompts[:1], p)[0].outputs[0].text
            == plain_llm.generate(prompts[:1], p)[0].outputs[0].text)
    assert spec_llm.engine.spec_stats["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    assert all_blocks_free(spec_llm.engine)


def test_penalties_min_tokens_and_logprobs_with_drafts_equal_the_engine_without(
        spec_llm, plain_llm, monkeypatch):
    # drafted like any request: each row sampled as if the drafts before it had been
    # generated, logprobs reported for every kept token. Penalties keep the tiny model out of
    # the loops n-gram lookup finds, so the drafts here come from an oracle: the engine
    # without drafts' own next tokens, every third proposal with its last token wrong
    prompts = _repetitive_prompts(8, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.4,
                             presence_penalty=0.2, logprobs=0)] * 2
    want = plain_llm.generate(prompts, params)
    monkeypatch.setattr(SpeculativeConfig, "propose", _oracle(want, 3, 1))
    engine = spec_llm.engine
    kept: dict[tuple, int] = {}       # each kind of params -> its drafts kept
    real = engine._append_verified

    def spy(r, s, tokens, *rest):
        p = r.params
        kind = (p.repetition_penalty, p.logprobs, p.min_tokens, p.frequency_penalty)
        kept[kind] = kept.get(kind, 0) + len(tokens) - 1
        return real(r, s, tokens, *rest)
    monkeypatch.setattr(engine, "_append_verified", spy)
    got = spec_llm.generate(prompts, params)
    assert len(kept) == 4 and min(kept.values()) >= 16, kept
    for g, w in zip(got, want, strict=True):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids
        assert (g.logprobs is None) == (w.logprobs is None)
        for got_pos, want_pos in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert sorted(got_pos) == sorted(want_pos)
            for tid, lp in want_pos.items():
                assert got_pos[tid].rank == lp.rank
                assert got_pos[tid].logprob == pytest.approx(lp.logprob, abs=1e-4)
        if w.logprobs is not None:
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert all_blocks_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_structured_outputs_with_drafts_equal_the_engine_without(tiny_model_dir, plain_llm,
                                                                  monkeypatch, async_scheduling):
    # a grammar's requests are drafted: drafts cut to the prefix the grammar allows, each row
    # masked as the grammar stands after the drafts before it; the oracle's drafts (the output
    # without drafts, every third proposal's last token wrong) must give that output again
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}},
        "required": ["name", "tags"], "additionalProperties": False}
    specs = [StructuredOutputsParams(json=schema, disable_any_whitespace=True),
             StructuredOutputsParams(regex=r"([0-9]{3}-[a-z]{2} ){3}"),
             StructuredOutputsParams(choice=["alpha beta gamma delta", "epsilon"])]
    prompts = _repetitive_prompts(6, seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=spec)
              for spec in specs] * 2
    want = plain_llm.generate(prompts, params)
    monkeypatch.setattr(SpeculativeConfig, "propose", _oracle(want, 4, 7))
    spec_llm = LLM(model=tiny_model_dir("llama"), max_num_seqs=8, speculative_config=NGRAM,
                   dtype="float32", async_scheduling=async_scheduling)
    engine = spec_llm.engine
    kept: dict[str, int] = {}
    real = engine._append_verified

    def spy(r, s, tokens, *rest):
        kind = r.params.structured_outputs.kind
        kept[kind] = kept.get(kind, 0) + len(tokens) - 1
        return real(r, s, tokens, *rest)
    monkeypatch.setattr(engine, "_append_verified", spy)
    got = spec_llm.generate(prompts, params)
    assert len(kept) == 3 and min(kept.values()) >= 8, kept
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason == "stop"
    json.loads(got[0].outputs[0].text)
    assert all_blocks_free(engine)


def test_seeded_sampling_with_drafts_depends_on_the_seed_only(spec_llm):
    prompts = _repetitive_prompts(4, seed=9)
    p = SamplingParams(temperature=0.7, top_p=0.9, seed=42, max_tokens=30)
    alone = spec_llm.generate(prompts[:1], p)[0].outputs[0].token_ids
    crowd = spec_llm.generate(prompts, [p] + [SamplingParams(temperature=1.0, max_tokens=30)] * 3)
    assert crowd[0].outputs[0].token_ids == alone and len(alone) == 30


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def small_spec_llm(tiny_model_dir, request):
    # 12 blocks of 16 tokens: a few requests fill the cache and preempt each other
    return LLM(model=tiny_model_dir("llama"), max_num_seqs=8, num_gpu_blocks=12, block_size=16,
               max_model_len=192, device="cpu", dtype="float32", speculative_config=NGRAM,
               async_scheduling=request.param)


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(tiny_model_dir, plain_llm):
    llm = LLM(model=tiny_model_dir("llama"), max_num_seqs=8, dtype="float32",
              speculative_config={**NGRAM, "disable_by_batch_size": 2})
    engine = llm.engine
    prompts = _repetitive_prompts(6, seed=3)
    # staggered lengths: the batch shrinks as they finish, drafts start at 2 running
    params = [SamplingParams(temperature=0.0, max_tokens=6 * (i + 1), ignore_eos=True)
              for i in range(6)]
    drafted_at = []
    real = engine._append_verified
    engine._append_verified = lambda *a: drafted_at.append(len(engine.scheduler.running)) or real(*a)
    got = llm.generate(prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [
        w.outputs[0].token_ids for w in plain_llm.generate(prompts, params)]
    assert drafted_at and max(drafted_at) <= 2, drafted_at


def test_preempted_requests_with_drafts_recompute_the_same_tokens(small_spec_llm, plain_llm):
    engine = small_spec_llm.engine
    before = engine.scheduler.num_preemptions, engine.spec_stats["spec_accepted_tokens"]
    prompts = [[3 + (i + j) % 5 for j in range(20)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = small_spec_llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > before[0], "the cache was meant to run out"
    assert engine.spec_stats["spec_accepted_tokens"] > before[1]
    want = plain_llm.generate(prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert all_blocks_free(engine)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]),
                              st.integers(1, 40), st.integers(1, 24)), min_size=5, max_size=40))
def test_random_adds_aborts_and_steps_with_drafts_leak_nothing(small_spec_llm, plain_llm, ops):
    def params_for(i: int, max_tokens: int) -> SamplingParams:   # every third add: greedy
        if i % 3 == 0:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, n=1 + i % 2)
    finished = run_random_ops(small_spec_llm.engine, ops, params_for)
    for rid, out in finished.items():
        i = int(rid.split("-")[1])                         # prop-{i}-{steps}
        if i % 3 == 0:     # greedy: as the engine without drafts gives it
            ref = plain_llm.generate([out.prompt_token_ids], params_for(i, ops[i][2]))[0]
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, rid


# ---- GPU (scripts/gpu-check) ---------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_fp32_greedy_with_drafts_matches_hf_through_the_decode_graphs(tiny_model_dir):
    path = tiny_model_dir("llama3")
    prompts = _repetitive_prompts(12, seed=4)
    ref = hf_greedy(path, prompts, 24)
    llm = LLM(model=path, dtype="float32", max_num_seqs=8, speculative_config=NGRAM)
    graphs = llm.engine.runner.graph_runner
    replays = []
    real_run = graphs.run
    graphs.run = lambda ids, *a: replays.append(ids.shape[0]) or real_run(ids, *a)
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in out] == ref
    assert llm.engine.spec_stats["spec_accepted_tokens"] > 0
    # steps of drafted rows (more rows than requests) replayed a graph
    assert max(replays) > 8, replays
    assert all_blocks_free(llm.engine)


@pytest.mark.gpu
def test_gpu_drafts_give_the_same_tokens_graphed_and_eager(tmp_path, monkeypatch):
    # drafted steps through the CUDA graphs (padded to their sizes) against eager steps, and
    # both against the eager engine without drafts. The model is initialised wide (top-2 logit
    # gaps ~10x HF's 0.02 init) and the drafts come from the oracle: on the 0.02-init model's
    # n-gram loops, two tokens tie so closely that the graphs' padded GEMMs, rounding otherwise
    # than the eager ones, flipped 1 of 16 outputs (thirty-first and thirty-second sessions, H100,
    # bf16 and fp32) without drafts being at fault
    path = make_tiny_model("qwen2", tmp_path / "qwen2", initializer_range=0.2)
    prompts = _repetitive_prompts(16, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = LLM(model=str(path), dtype="float32", max_num_seqs=16,
               enforce_eager=True).generate(prompts, params)
    monkeypatch.setattr(SpeculativeConfig, "propose", _oracle(want, 4, 3))
    for eager in (True, False):
        llm = LLM(model=str(path), dtype="float32", max_num_seqs=16, enforce_eager=eager,
                  speculative_config=NGRAM)
        replays: list[int] = []
        if not eager:
            graphs = llm.engine.runner.graph_runner
            real_run = graphs.run
            graphs.run = (lambda ids, *a, seen=replays, run=real_run:
                          seen.append(ids.shape[0]) or run(ids, *a))
        got = llm.generate(prompts, params)
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
        assert llm.engine.spec_stats["spec_accepted_tokens"] >= 100, eager
    # drafted steps (more rows than requests) replayed a graph
    assert max(replays) > 16, replays
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=32)
    llm = LLM(model=str(path), dtype="bfloat16", max_num_seqs=16, speculative_config=NGRAM)
    assert (llm.generate(prompts[:1], seeded)[0].outputs[0].token_ids
            == llm.generate(prompts[:1], seeded)[0].outputs[0].token_ids)


@pytest.mark.gpu
def test_gpu_penalties_logprobs_and_grammars_with_drafts_equal_the_engine_without(
        tiny_model_dir, monkeypatch):
    # the drafted rows' processing on the GPU (penalties over each row's history, xgrammar's
    # masks per drafted row through its CUDA path, logprobs), the drafts from the oracle
    path = tiny_model_dir("llama")
    prompts = _repetitive_prompts(8, seed=12)
    params = [SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.2, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.3, min_tokens=30),
              SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs={"regex": r"([0-9]{3}-[a-z]{2} ){3}"}),
              SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs={"choice": ["alpha beta gamma", "delta"]})] * 2
    want = LLM(model=path, dtype="float32", max_num_seqs=8).generate(prompts, params)
    monkeypatch.setattr(SpeculativeConfig, "propose", _oracle(want, 4, 5))
    llm = LLM(model=path, dtype="float32", max_num_seqs=8, speculative_config=NGRAM)
    got = llm.generate(prompts, params)
    assert llm.engine.spec_stats["spec_accepted_tokens"] >= 40
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
    assert [lp[t].logprob for lp, t in zip(got[0].outputs[0].logprobs,
                                           got[0].outputs[0].token_ids, strict=True)] == \
        pytest.approx([lp[t].logprob for lp, t in zip(want[0].outputs[0].logprobs,
                                                      want[0].outputs[0].token_ids,
                                                      strict=True)], abs=1e-4)
    assert all_blocks_free(llm.engine)
