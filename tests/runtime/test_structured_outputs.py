"""Structured outputs: a tiny random Llama (whose free output is noise) made to follow a JSON
schema, any JSON, a regex, a choice and an EBNF grammar, greedy and sampled, alone and beside
free requests; bad grammars refused before anything runs."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet_runtime.llm import LLM
from kvfleet_runtime.sampling_params import SamplingParams
from kvfleet_runtime.structured_outputs import StructuredOutputsParams
from support.engine_ops import all_blocks_free, run_random_ops

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green"]}},
          "required": ["name", "age", "color"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["alpha", "beta", "gamma"]
GRAMMAR = 'root ::= "(" [a-z]{1,6} ")"'
PROMPT = "Tell me about a person:"


def follows_schema(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "color"}
            and isinstance(value["name"], str) and re.fullmatch("[a-z]{1,8}", value["name"])
            and isinstance(value["age"], int) and 0 <= value["age"] <= 120
            and value["color"] in ("red", "green"))


CHECKS = {
    "json": lambda text: follows_schema(json.loads(text)),
    "json_object": lambda text: isinstance(json.loads(text), dict),
    "regex": lambda text: re.fullmatch(REGEX, text) is not None,
    "choice": lambda text: text in CHOICES,
    "grammar": lambda text: re.fullmatch(r"\([a-z]{1,6}\)", text) is not None,
}
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


def _parses(kind: str, text: str) -> bool:
    try:
        return CHECKS[kind](text)
    except ValueError:
        return False


@pytest.fixture(scope="module", params=[
    ("cpu", False), ("cpu", True), pytest.param(("cuda", None), marks=pytest.mark.gpu)],
    ids=["sync", "async", "gpu"])
def llm(tiny_model_dir, request):
    # async scheduling on: a grammar request makes the engine step synchronously while it
    # runs; on the GPU (async, CUDA graphs) the masks are applied by xgrammar's CUDA path
    device, async_scheduling = request.param
    return LLM(model=tiny_model_dir("llama"), max_num_seqs=16, num_gpu_blocks=256,
               max_model_len=512, device=device, async_scheduling=async_scheduling,
               dtype="float32")


def test_free_output_of_the_tiny_model_follows_none_of_them(llm):
    # what makes the tests below able to fail: without a grammar the output is noise
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40,
                                                   ignore_eos=True))
    assert not any(_parses(kind, out.outputs[0].text) for kind in CHECKS)


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_output_follows_its_grammar_and_stops_when_complete(llm, kind):
    bias = None
    if kind == "json_object":
        # any object's keys are free text: the tiny model's would run to max_tokens; a bias
        # toward "}" (the grammar still decides where it may go) closes it
        bias = {llm.get_tokenizer().convert_tokens_to_ids("}"): 30.0}
    params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=SPECS[kind],
                            logit_bias=bias)
    (out,) = llm.generate([PROMPT], params)
    c = out.outputs[0]
    assert _parses(kind, c.text), c.text
    assert c.finish_reason == "stop"
    assert len(c.token_ids) < 100


def test_grammar_rows_beside_free_rows_leave_the_free_rows_unchanged(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["One", "Two two", "Three three three"]
    alone = [o.outputs[0].text for o in llm.generate(prompts, free)]
    params = [free, SamplingParams(temperature=0.0, max_tokens=60,
                                   structured_outputs=SPECS["json"]), free,
              SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SPECS["regex"]),
              free]
    outs = llm.generate(["One", PROMPT, "Two two", PROMPT, "Three three three"], params)
    assert [outs[i].outputs[0].text for i in (0, 2, 4)] == alone
    assert _parses("json", outs[1].outputs[0].text)
    assert _parses("regex", outs[3].outputs[0].text)


def test_sampled_choices_follow_the_grammar_each_with_its_own_matcher(llm):
    params = SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=40,
                            structured_outputs=SPECS["grammar"])
    (out,) = llm.generate([PROMPT], params)
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and all(_parses("grammar", t) for t in texts), texts
    assert len(set(texts)) > 1, "n=4 at temperature 1 drew one text four times"


def test_max_tokens_cuts_a_long_grammar_with_length(llm):
    long_json = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"},
                                              "minItems": 50}, disable_any_whitespace=True)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                   structured_outputs=long_json))
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 8
    assert c.text.startswith("[")


@pytest.mark.parametrize(("spec", "words"), [
    (dict(regex="[a-"), "structured_outputs.regex is not valid: Regex parsing error"),
    (dict(grammar="root ::= foo"), 'structured_outputs.grammar is not valid: EBNF parser error'),
    (dict(json={"type": "bogus"}), 'structured_outputs.json is not valid: Unsupported type "bogus"'),
    (dict(json="{not json"), "structured_outputs.json must be a JSON schema; it is not JSON"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(regex="a", choice=["a"]), "exactly one of json, regex, choice, grammar, json_object; "
                                    "got regex, choice"),
    (dict(), "exactly one of json, regex, choice, grammar, json_object; got none"),
])
def test_bad_grammars_are_refused_before_anything_runs(llm, spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert not llm.engine.has_unfinished_requests()


def test_a_dict_is_taken_for_structured_outputs_params():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])


def test_grammar_requests_keep_async_scheduling(tiny_model_dir, monkeypatch):
    # with async scheduling the runner feeds each grammar the token still in flight: the
    # engine never falls back to synchronous steps for them
    llm = LLM(model=tiny_model_dir("llama"), max_num_seqs=16, num_gpu_blocks=256,
              max_model_len=512, device="cpu", async_scheduling=True, dtype="float32")
    calls = []
    launch = llm.engine.runner.launch
    monkeypatch.setattr(llm.engine.runner, "execute",
                        lambda *a, **k: pytest.fail("a synchronous step ran"))
    monkeypatch.setattr(llm.engine.runner, "launch",
                        lambda *a, **k: calls.append(1) or launch(*a, **k))
    outs = llm.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SPECS["json"]),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SPECS["regex"])])
    assert _parses("json", outs[0].outputs[0].text) and _parses("regex", outs[1].outputs[0].text)
    assert len(calls) > 10


def test_a_vocabulary_padded_past_the_tokenizer_never_samples_the_padding(tmp_path):
    # a model whose embedding rows outnumber the tokenizer's ids (as Qwen's, or a 49k tokenizer
    # on a 128k shape): the grammar knows the tokenizer's ids, the padding is banned outright,
    # even when logit_bias pushes a padding id to the top
    from support.tiny_models import make_tiny_model
    path = make_tiny_model("llama", tmp_path / "padded", vocab_size=49152 + 64,
                           initializer_range=0.2)
    llm = LLM(model=str(path), max_num_seqs=4, num_gpu_blocks=64, max_model_len=256,
              device="cpu", async_scheduling=True)
    bias = {49152 + 7: 100.0}
    free, out = llm.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0.0, max_tokens=3, logit_bias=bias, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logit_bias=bias,
                       structured_outputs=SPECS["regex"])])
    assert free.outputs[0].token_ids == [49152 + 7] * 3, "the bias must reach a free row"
    assert _parses("regex", out.outputs[0].text)
    assert max(out.outputs[0].token_ids) < 49152


ARRAY = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"},
                                      "minItems": 100000}, disable_any_whitespace=True)


def _array_prefix(text: str) -> bool:
    """A JSON array of integers cut anywhere (minItems is never reached)."""
    return text.startswith("[") and set(text[1:]) <= set("0123456789,- ")


@pytest.fixture(scope="module")
def small_async_llm(tiny_model_dir):
    # 12 blocks of 16 tokens: a few requests fill the cache and preempt each other
    return LLM(model=tiny_model_dir("llama"), max_num_seqs=8, num_gpu_blocks=12, block_size=16,
               max_model_len=192, device="cpu", async_scheduling=True, dtype="float32")


def test_preempted_grammar_requests_keep_their_grammar(small_async_llm):
    engine = small_async_llm.engine
    before = engine.scheduler.num_preemptions
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True,
                             structured_outputs=ARRAY if i % 2 == 0 else None) for i in range(6)]
    outs = small_async_llm.generate([[3 + i + j for j in range(20)] for i in range(6)], params)
    assert engine.scheduler.num_preemptions > before, "the cache was meant to run out"
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert len(c.token_ids) == 40
        assert _array_prefix(c.text) == (i % 2 == 0), (i, c.text)
    assert all_blocks_free(engine)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]),
                              st.integers(1, 40), st.integers(1, 24)), min_size=5, max_size=40))
def test_random_adds_aborts_and_steps_with_grammars_leak_nothing(small_async_llm, ops):
    def params_for(i: int, max_tokens: int) -> SamplingParams:    # every other add: a grammar
        return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, n=1 + i % 3 // 2,
                              ignore_eos=True, structured_outputs=ARRAY if i % 2 == 0 else None)
    finished = run_random_ops(small_async_llm.engine, ops, params_for)
    for rid, out in finished.items():
        grammar = int(rid.split("-")[1]) % 2 == 0          # prop-{i}-{steps}
        for c in out.outputs:
            assert _array_prefix(c.text) == grammar, (rid, c.text)


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_grammar_output_equals_hf_with_xgrammars_logits_processor(tiny_model_dir, kind):
    # the reference: transformers' generate() with xgrammar's own LogitsProcessor on the same
    # fp32 checkpoint, one prompt at a time; ours batched, with async scheduling
    import xgrammar as xgr
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor
    path = tiny_model_dir("llama")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=AutoConfig.from_pretrained(
        path).vocab_size, stop_token_ids=[tok.eos_token_id])
    compiled = SPECS[kind].compile(xgr.GrammarCompiler(info))
    prompts = [tok.encode(p) for p in ("Tell me about a person:", "Data:", "Pick one")]
    reference = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=60, pad_token_id=0,
                                 logits_processor=[LogitsProcessor(compiled)])
            reference.append(gen[0, len(ids):].tolist())
    llm = LLM(model=path, max_num_seqs=4, num_gpu_blocks=64, max_model_len=256, device="cpu",
              async_scheduling=True, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=60,
                                                structured_outputs=SPECS[kind]))
    ours = [o.outputs[0].token_ids for o in outs]
    assert ours == reference
    assert all(_parses(kind, o.outputs[0].text) for o in outs)
