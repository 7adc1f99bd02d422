"""Structured outputs with a reasoning parser (EngineConfig.reasoning_parser): the grammar holds
only what follows `</think>`, as vLLM's. A tiny random Llama whose tokenizer has `<think>` and
`</think>` as single tokens (as Qwen3's and DeepSeek-R1's do), pushed by logit_bias where a test
needs a tag at a given place: thinking is sampled freely, the answer after it follows the
grammar, and a prompt that closes its thinking leaves the grammar all of the output."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from kvfleet_runtime.llm import LLM
from kvfleet_runtime.sampling_params import SamplingParams
from kvfleet_runtime.structured_outputs import (
    GRAMMAR,
    START,
    THINKING,
    GrammarBackend,
    ReasoningTags,
    StructuredOutputsParams,
    grammar_prefix,
    mask_draft_rows,
    mask_logits,
)
from support.tiny_models import VOCAB, make_thinking_model, tokenizer_dir

CHOICES = ["alpha", "beta", "gamma"]
CHOICE = StructuredOutputsParams(choice=CHOICES)
OPEN_ID, CLOSE_ID = VOCAB, VOCAB + 1          # make_thinking_model's tags
THINKS = "Question: what is it? <think>\n"     # the prompt opens the thinking (DeepSeek-R1's way)
NO_THINKING = "Question: what is it? <think>\n\n</think>\n\n"     # thinking switched off
PLAIN = "Question: what is it?"


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> Path:
    return make_thinking_model(tmp_path_factory.mktemp("thinking"))


def test_tags_are_found_and_the_prompt_decides_where_an_output_starts(thinking_model, caplog):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    for parser, default in (("deepseek_r1", THINKING), ("qwen3", START)):
        tags = ReasoningTags.of(parser, tok)
        assert (tags.open_id, tags.close_id) == (OPEN_ID, CLOSE_ID)
        assert tags.first_phase(ids(THINKS), tok.decode) == THINKING
        assert tags.first_phase(ids(NO_THINKING), tok.decode) == GRAMMAR
        assert tags.first_phase(ids(PLAIN), tok.decode) == default
        # an earlier turn's finished thinking, then more conversation: the parser's rule again
        assert tags.first_phase(ids("<think>a</think> b. Next question:"), tok.decode) == default
    plain = AutoTokenizer.from_pretrained(tokenizer_dir())     # "<think>" is several tokens
    with caplog.at_level(logging.WARNING):
        assert ReasoningTags.of("qwen3", plain) is None
    assert "not single tokens" in caplog.text


def test_masks_and_drafts_by_phase(thinking_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    width = VOCAB + 64
    r1 = GrammarBackend(tok, width, {tok.eos_token_id}, "deepseek_r1")
    qwen3 = GrammarBackend(tok, width, {tok.eos_token_id}, "qwen3")
    thinking, starting = r1.sequence(CHOICE, ids(THINKS)), qwen3.sequence(CHOICE, ids(PLAIN))
    answering = qwen3.sequence(CHOICE, ids(NO_THINKING))
    assert (thinking.phase, starting.phase, answering.phase) == (THINKING, START, GRAMMAR)
    first = {ids(c)[0] for c in CHOICES}          # each choice's first token

    def allowed(row: torch.Tensor) -> set[int]:
        return set(torch.isfinite(row).nonzero().flatten().tolist())

    logits = torch.zeros(3, width)
    mask_logits(logits, [0, 1, 2], [thinking, starting, answering])
    assert torch.isfinite(logits[0]).all()                         # thinking: free
    grammar_first = allowed(logits[2])       # the grammar's first tokens: "a", "al", "alpha", ...
    assert first <= grammar_first and not {OPEN_ID, CLOSE_ID} & grammar_first
    assert allowed(logits[1]) == grammar_first | {OPEN_ID}         # the grammar's, or <think>
    # drafts: while thinking, those before </think>; none for qwen3's first token
    word = ids(" so")
    drafts = [*word, CLOSE_ID, *ids("gamma")]
    assert grammar_prefix(thinking, drafts) == len(word)
    assert grammar_prefix(thinking, word) == len(word)
    assert grammar_prefix(starting, [OPEN_ID, *word]) == 0
    logits = torch.zeros(len(word) + 2, width)
    mask_draft_rows(logits, [(thinking, 0, word), (starting, len(word) + 1, [])])
    assert torch.isfinite(logits[:len(word) + 1]).all()
    assert allowed(logits[-1]) == grammar_first | {OPEN_ID}
    # </think> hands the next tokens to the grammar
    thinking.feed([*word, CLOSE_ID])
    assert thinking.phase == GRAMMAR and not thinking.done
    assert grammar_prefix(thinking, word) == 0
    assert grammar_prefix(thinking, ids("gamma")) == len(ids("gamma"))
    thinking.feed(ids("gamma"))
    assert not thinking.done            # only the end of text is left
    thinking.feed([tok.eos_token_id])
    assert thinking.done and not thinking.broken
    starting.feed([OPEN_ID, CLOSE_ID, *ids("beta"), tok.eos_token_id])
    assert starting.done and not starting.broken
    answering.feed([OPEN_ID])
    assert answering.broken


@pytest.fixture(scope="module", params=[
    ("cpu", False), ("cpu", True), pytest.param(("cuda", None), marks=pytest.mark.gpu)],
    ids=["sync", "async", "gpu"])
def engines(thinking_model, request):
    """(deepseek_r1 engine, qwen3 engine, engine without a parser), one device and mode."""
    device, async_scheduling = request.param
    made = [LLM(model=str(thinking_model), max_num_seqs=8, num_gpu_blocks=128, max_model_len=256,
                device=device, async_scheduling=async_scheduling, dtype="float32",
                reasoning_parser=parser) for parser in ("deepseek_r1", "qwen3", None)]
    yield made
    for llm in made:
        llm.engine.shutdown()


def _run(llm: LLM, prompt: str, structured: bool = True, bias: dict[int, float] | None = None,
         max_tokens: int = 12):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=bias,
                            structured_outputs=CHOICE if structured else None,
                            ignore_eos=not structured)
    return llm.generate([prompt], params)[0].outputs[0]


def test_thinking_is_sampled_freely(engines):
    r1, _, _ = engines
    free = _run(r1, THINKS, structured=False)
    assert CLOSE_ID not in free.token_ids and free.text.strip() not in CHOICES   # noise
    out = _run(r1, THINKS)
    assert out.token_ids == free.token_ids        # no mask while thinking (ran to max_tokens)
    assert out.finish_reason == "length"


def test_the_answer_after_the_thinking_follows_the_grammar(engines):
    r1, qwen3, plain = engines
    bias = {CLOSE_ID: 100.0}          # close the thinking at once; the grammar then decides
    for llm in (r1, qwen3):           # (a qwen3 template may open the tag in the prompt too)
        out = _run(llm, THINKS, bias=bias)
        assert out.token_ids[0] == CLOSE_ID
        answer = out.text.split("</think>", 1)[1]
        assert answer in CHOICES and out.finish_reason == "stop", out.text
    # without a parser the grammar holds all of it: the tag is never sampled
    out = _run(plain, THINKS, bias=bias)
    assert CLOSE_ID not in out.token_ids and out.text in CHOICES


def test_qwen3_answers_under_the_grammar_unless_its_output_opens_the_tag(engines):
    _, qwen3, plain = engines
    assert _run(qwen3, PLAIN).token_ids == _run(plain, PLAIN).token_ids
    assert _run(qwen3, PLAIN).text in CHOICES
    # </think> alone does not start anything: the first token is the grammar's or <think>
    out = _run(qwen3, PLAIN, bias={CLOSE_ID: 100.0})
    assert out.text in CHOICES
    # an output that opens the tag thinks freely from there
    bias = {OPEN_ID: 100.0}
    out = _run(qwen3, PLAIN, bias=bias)
    assert out.token_ids[0] == OPEN_ID and out.finish_reason == "length"
    assert out.token_ids == _run(qwen3, PLAIN, structured=False, bias=bias).token_ids


def test_a_prompt_that_closes_the_thinking_leaves_the_grammar_everything(engines):
    for llm in engines[:2]:
        out = _run(llm, NO_THINKING, bias={OPEN_ID: 100.0, CLOSE_ID: 100.0})
        assert out.text in CHOICES and not {OPEN_ID, CLOSE_ID} & set(out.token_ids), out.text


def test_drafted_steps_agree_with_plain_steps(thinking_model, engines):
    # n-gram drafts from a prompt that repeats itself, across the end of the thinking
    r1 = engines[0]
    device = r1.engine.config.device
    spec = LLM(model=str(thinking_model), max_num_seqs=8, num_gpu_blocks=128, max_model_len=256,
               device=device, dtype="float32", reasoning_parser="deepseek_r1",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    try:
        free = _run(r1, THINKS, structured=False, max_tokens=24).text
        # the prompt's end was seen before: drafts are what followed it, a word then the tag
        # (kept up to the tag while thinking), or the tag first (none kept)
        prompts = [THINKS + free + " so</think>gamma " + free, THINKS + free + "</think>beta " + free]
        for bias in (None, {CLOSE_ID: 100.0}):
            for text in (THINKS, *prompts):
                want = _run(r1, text, bias=bias, max_tokens=24)
                got = _run(spec, text, bias=bias, max_tokens=24)
                assert got.token_ids == want.token_ids, (text, bias)
        assert spec.engine.spec_stats["spec_draft_tokens"] > 0
    finally:
        spec.engine.shutdown()
