"""The default model (SmolLM2-135M-Instruct GGUF, no MODEL argument) behind the official
openai client: real answers, real chat template, usage equal to the tokenizer's counts."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from support.server import ServerProcess, running_server
from support.tiny_models import tokenizer_dir
from transformers import AutoTokenizer

NAME = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(None, "--max-model-len", "512") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tokenizer_dir())


def test_the_default_model_knows_the_capital_of_france(client, tokenizer) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=12,
                                       temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer
    assert r.choices[0].finish_reason == "stop"     # the model ends its sentence itself
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids)
    # the answer's tokens plus the end-of-turn token that stopped it
    assert r.usage.completion_tokens == len(tokenizer.encode(answer, add_special_tokens=False)) + 1


async def test_async_stream_equals_the_whole_answer(server: ServerProcess, client) -> None:
    whole = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=12,
                                           temperature=0).choices[0].message.content
    aclient = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key="unused",
                                 max_retries=0, timeout=120)
    stream = await aclient.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=12,
                                                   temperature=0, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == whole
    await aclient.close()


def test_seeded_samples_repeat_and_logprobs_rank_the_choice(client) -> None:
    kwargs = dict(model=NAME, prompt="The three primary colors are", max_tokens=6, n=2,
                  temperature=0.8, seed=11, logprobs=2)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)
    for choice in first.choices:
        for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs, strict=True):
            assert token in top and len(top) >= 2
