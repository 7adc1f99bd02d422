"""The official openai client (sync and async, streaming and not) against a real `kvfleet serve`
of a tiny random Llama, behind an API key and two served names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from support.server import ServerProcess, running_server
from transformers import AutoTokenizer

API_KEY = "test-key-123"
NAME = "tiny"
# greedy, fixed length: the tiny model's EOS would otherwise end outputs at random places
FIXED = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


# every test also against the engine loop with async scheduling (the CUDA default), which a
# CPU engine otherwise runs without, and against the engine in a process of its own
@pytest.fixture(scope="module", params=[(), ("--async-scheduling",), ("--engine-process",)],
                ids=["sync", "async", "engine-process"])
def server(tiny_llama: Path, request) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "tiny-alias",
                        "--max-model-len", "256", *request.param, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_models_lists_every_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME, "tiny-alias"]
    assert all(m.owned_by == "kvfleet" for m in models.data)


def test_completion_usage_equals_the_tokenizers_count(client, tokenizer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=7, logprobs=0, **FIXED)
    assert r.object == "text_completion" and r.model == NAME
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 7
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details is None     # (--enable-prompt-tokens-details)
    assert "prompt_tokens_details" not in r.usage.model_dump(exclude_unset=True)


def test_alias_name_and_omitted_max_tokens_default_to_16(client) -> None:
    r = client.completions.create(model="tiny-alias", prompt="Hello", **FIXED)
    assert r.model == "tiny-alias"
    assert r.usage.completion_tokens == 16


def test_streamed_completion_equals_the_non_streamed_one(client) -> None:
    kwargs = dict(model=NAME, prompt="Once upon a time", max_tokens=8, **FIXED)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.usage is None for c in text_chunks)


def test_continuous_usage_stats_count_the_tokens_on_every_chunk(client) -> None:
    # vLLM's stream_options extension: every chunk carries its usage so far
    chunks = list(client.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **FIXED))
    *text_chunks, usage_chunk = chunks
    # a chunk a step with new text (tokens without text, and steps a busy reader merged, add
    # no chunk of their own): the counts rise chunk by chunk to the last token
    counts = [c.usage.completion_tokens for c in text_chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 6 and counts[0] >= 1
    assert {c.usage.prompt_tokens for c in chunks} == {usage_chunk.usage.prompt_tokens}
    assert text_chunks[-1].usage == usage_chunk.usage


def test_chat_uses_the_chat_template_and_max_completion_tokens(client, tokenizer) -> None:
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=5,
                                       **FIXED)
    assert r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert r.usage.prompt_tokens == len(templated)
    assert r.usage.completion_tokens == 5
    legacy = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, **FIXED)
    assert legacy.choices[0].message.content == choice.message.content


def test_streamed_chat_matches_openais_chunk_format(client) -> None:
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "Tell me a story"}],
                  max_tokens=6, **FIXED)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].delta.content is None
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content


def test_n_2_gives_two_choices_and_counts_both(client) -> None:
    r = client.completions.create(model=NAME, prompt="Numbers:", max_tokens=4, n=2, seed=7,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=NAME, prompt="Numbers:", max_tokens=4, n=2,
                                            seed=7, temperature=1.0, stream=True,
                                            extra_body={"ignore_eos": True}))
    for c in r.choices:
        streamed = [ch.choices[0] for ch in chunks if ch.choices[0].index == c.index]
        assert "".join(s.text for s in streamed) == c.text
        assert [s.finish_reason for s in streamed].count("length") == 1


def test_list_of_prompts_and_token_id_prompts_with_echo(client, tokenizer) -> None:
    r = client.completions.create(model=NAME, prompt=["Hello there", "Good morning"],
                                  max_tokens=3, **FIXED)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(tokenizer.encode("Hello there")) + \
        len(tokenizer.encode("Good morning"))
    ids = tokenizer.encode("Good morning")
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=3, echo=True, **FIXED)
    assert by_ids.choices[0].text == "Good morning" + r.choices[1].text


def test_stop_string_ends_the_text_before_it(client) -> None:
    kwargs = dict(model=NAME, prompt="A list of words:", max_tokens=12, **FIXED)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]


def test_vllm_extras_stop_token_ids_and_min_tokens(client, tokenizer) -> None:
    kwargs = dict(model=NAME, prompt="Counting:", max_tokens=6, temperature=0.0)
    free = client.completions.create(logprobs=0, extra_body={"ignore_eos": True}, **kwargs)
    third = tokenizer.convert_tokens_to_ids(
        tokenizer.tokenize(free.choices[0].logprobs.tokens[2]))[0]
    r = client.completions.create(extra_body={"ignore_eos": True, "stop_token_ids": [third],
                                              "top_k": 5, "min_p": 0.0,
                                              "repetition_penalty": 1.0}, **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == third
    assert r.usage.completion_tokens <= 3


def test_logit_bias_and_allowed_token_ids_steer_the_tokens(client, tokenizer) -> None:
    kwargs = dict(model=NAME, prompt="Counting:", max_tokens=5, **FIXED)
    free = client.completions.create(**kwargs).choices[0].text
    word = tokenizer.encode(" Paris")[0]
    forced = client.completions.create(logit_bias={str(word): 100}, **kwargs).choices[0].text
    assert forced == tokenizer.decode([word] * 5) != free
    allowed = tokenizer.encode(" yes no")
    kwargs["extra_body"] = {**FIXED["extra_body"], "allowed_token_ids": allowed}
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Well?"}], logprobs=True,
        **{k: v for k, v in kwargs.items() if k != "prompt"})
    tokens = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t.token)[0])
              for t in chat.choices[0].logprobs.content]
    assert len(tokens) == 5 and set(tokens) <= set(allowed)


class Person(pydantic.BaseModel):
    # a pattern, not max_length: xgrammar's length-bounded strings admit raw control
    # characters, which strict JSON forbids (mlc-ai/xgrammar#800, open; docs/SERVER.md)
    name: str = pydantic.Field(pattern=r"^[a-z]{1,8}$")
    age: int = pydantic.Field(ge=0, le=120)
    color: Literal["red", "green"]


def test_response_format_json_schema_parses_into_the_clients_model(client, tokenizer) -> None:
    # the tiny model's free output is noise; its whitespace runs are banned through logit_bias
    # (the grammar allows whitespace between JSON's tokens) so that it ends within max_tokens
    spaces = {str(i): -100 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()}
    r = client.chat.completions.parse(
        model=NAME, messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person, max_tokens=150, temperature=0.0, logit_bias=spaces)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_structured_outputs_regex_and_choice_streamed_and_not(client) -> None:
    stream = client.completions.create(
        model=NAME, prompt="A code:", max_tokens=30, temperature=0.0, stream=True,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    assert chunks[-1].choices[0].finish_reason == "stop"
    choices = ["red alert", 'say "hi"', "naïve"]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Pick one."}], max_tokens=20,
        temperature=1.0, n=3, seed=1, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in chat.choices)


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, tokenizer) -> None:
    ids = tokenizer.encode("one two three four five six seven eight nine ten")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=3, echo=True,
                                  extra_body={"truncate_prompt_tokens": 4, **FIXED["extra_body"]},
                                  temperature=0.0)
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].text.startswith(tokenizer.decode(ids[-4:]))
    alone = client.completions.create(model=NAME, prompt=ids[-4:], max_tokens=3, **FIXED)
    assert r.choices[0].text == tokenizer.decode(ids[-4:]) + alone.choices[0].text
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "a long question " * 20}],
        max_tokens=2, extra_body={"truncate_prompt_tokens": 8, **FIXED["extra_body"]},
        temperature=0.0)
    assert chat.usage.prompt_tokens == 8


def test_logprobs_of_greedy_tokens_are_the_top_ones(client) -> None:
    r = client.completions.create(model=NAME, prompt="Hi", max_tokens=4, logprobs=3, **FIXED)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and logprob <= 0.0
        assert logprob == pytest.approx(max(top.values()))
        assert top[token] == pytest.approx(logprob)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text

    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True,
        top_logprobs=2, **FIXED)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
               for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_seed_makes_sampling_reproducible(client) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=NAME, prompt="Random:", max_tokens=8,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


async def test_async_client_streams_and_completes(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key=API_KEY, max_retries=0)
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "async?"}], max_tokens=5,
                  **FIXED)
    whole = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(stream=True, **kwargs)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == whole.choices[0].message.content
    await client.close()


def test_api_key_is_required_except_on_probes(server: ServerProcess) -> None:
    bad = openai.OpenAI(base_url=server.openai_base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.base_url + open_path).status_code == 200


def test_tokenize_and_detokenize_round_trip(server: ServerProcess, tokenizer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.base_url + "/tokenize", headers=headers,
                   json={"model": NAME, "prompt": "Hello tokenizer"}).json()
    assert r["tokens"] == tokenizer.encode("Hello tokenizer") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    chat = httpx.post(server.base_url + "/tokenize", headers=headers,
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
    back = httpx.post(server.base_url + "/detokenize", headers=headers,
                      json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello tokenizer"}
    assert httpx.get(server.base_url + "/version").json() == {"version": "0.1.0"}


def test_each_request_has_an_access_log_line_by_default(client: openai.OpenAI,
                                                        server: ServerProcess) -> None:
    client.models.list()
    assert '"GET /v1/models HTTP/1.1" 200' in server.log()


def test_prompt_logprobs_are_hf_log_softmax_of_each_prompt_token(client, tokenizer,
                                                                 tiny_llama) -> None:
    # vLLM's extra: each prompt token's logprob under the positions before it, with its rank
    # and the top k beside it; the first position None
    import torch
    from transformers import AutoModelForCausalLM
    prompt = "The quick brown fox jumps"
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0.0,
                                  extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        entries = got[pos]
        token = entries[str(ids[pos])]
        assert token["logprob"] == pytest.approx(want[pos - 1, ids[pos]].item(), abs=1e-3)
        assert token["rank"] == int((want[pos - 1] > want[pos - 1, ids[pos]]).sum()) + 1
        assert token["decoded_token"] == tokenizer.decode([ids[pos]])
        top = sorted(want[pos - 1].topk(2).indices.tolist())
        assert set(entries) == {str(t) for t in top} | {str(ids[pos])}
    # echo's logprobs of 1 beside prompt_logprobs of 2: each keeps its own k
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0.0,
                                  echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    echoed = r.choices[0].logprobs.top_logprobs[1:len(ids)]
    assert all(len(top) <= 2 for top in echoed)
    assert r.choices[0].model_extra["prompt_logprobs"][1:] == got[1:]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=1,
        extra_body={"prompt_logprobs": 0})
    lps = chat.model_extra["prompt_logprobs"]
    assert len(lps) == chat.usage.prompt_tokens and lps[0] is None
    assert all(len(entry) == 1 for entry in lps[1:])     # k 0: the prompt token alone
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def test_bad_words_keep_a_word_out_of_the_answer(client, tiny_llama) -> None:
    # vLLM's extra, tokenized where the engine runs (its own process too): the answer is the
    # offline engine's with the same bad_words (which tests/runtime/test_bad_words.py holds
    # to HF's bad_words_ids)
    from kvfleet_runtime import LLM, SamplingParams
    prompt = "Once upon a time"
    free = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, **FIXED)
    word = free.choices[0].text.split()[0]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0.0,
                                    extra_body={"ignore_eos": True, "bad_words": [word]})
    llm = LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks=16, max_model_len=256)
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                               bad_words=[word]))[0].outputs[0].text
    assert out.choices[0].text == want != free.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=2,
                                  extra_body={"bad_words": [""]})
    assert e.value.body["param"] == "bad_words"


def test_return_tokens_as_token_ids_names_each_token_by_its_id(client, tokenizer) -> None:
    # vLLM's extra: "token_id:N" in place of each token's text, in the chosen and the top
    kwargs = dict(model=NAME, prompt="Once upon a time", max_tokens=5, **FIXED)
    plain = client.completions.create(logprobs=2, **kwargs).choices[0].logprobs
    kwargs["extra_body"] = {**FIXED["extra_body"], "return_tokens_as_token_ids": True}
    lp = client.completions.create(logprobs=2, **kwargs).choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert all(t.startswith("token_id:") for t in lp.tokens)
    assert [tokenizer.decode([i]) for i in ids] == plain.tokens
    assert lp.token_logprobs == plain.token_logprobs
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True,
        top_logprobs=1, temperature=0.0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    for t in chat.choices[0].logprobs.content:
        assert t.token.startswith("token_id:") and bytes(t.bytes).decode() == t.token
        assert t.top_logprobs[0].token.startswith("token_id:")


def test_cache_salt_keeps_prefix_cache_hits_within_a_tenant(server, client) -> None:
    # vLLM's extra: the same prompt hits the cache under its own salt only
    prompt = "A long shared system prompt for every tenant of this server. " * 4

    def hits_after(salt: str) -> float:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0.0,
                                  extra_body={"cache_salt": salt})
        return server.metric("kvfleet_prefix_cache_hits_total")

    before = server.metric("kvfleet_prefix_cache_hits_total")
    assert hits_after("tenant-a") == before
    assert hits_after("tenant-b") == before
    assert hits_after("tenant-a") > before
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt"


def test_the_response_id_follows_x_request_id_or_the_bodys_request_id(server, client) -> None:
    # vLLM's: the client's X-Request-Id, else the body's request_id, names the response
    r = client.completions.create(model=NAME, prompt="hi", max_tokens=2,
                                  extra_headers={"X-Request-Id": "trace-42"})
    assert r.id == "cmpl-trace-42"
    r = client.chat.completions.create(model=NAME, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"request_id": "mine-7"})
    assert r.id == "chatcmpl-mine-7"
    scored = httpx.post(server.base_url + "/score", headers={
        "X-Request-Id": "s-1", "Authorization": f"Bearer {API_KEY}"},
        json={"model": NAME, "text_1": "a", "text_2": "b"}, timeout=60)
    assert scored.json()["id"] == "score-s-1"
    first = client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    second = client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert first.id.startswith("cmpl-") and first.id != second.id
