"""vLLM's --enable-prompt-tokens-details: completions and chat usage carry OpenAI's
prompt_tokens_details.cached_tokens, the prompt tokens the prefix cache held (whole blocks),
streamed or not; without the flag the field is left out (tests/server/test_openai_client.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from support.server import ServerProcess, running_server

NAME = "tiny"
PROMPT = "The tenants of the shared prefix all start with this long system preamble. " * 4


@pytest.fixture(scope="module", params=[(), ("--engine-process",)], ids=["thread", "engine-process"])
def server(tiny_llama: Path, request) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "512",
                        "--block-size", "16", "--enable-prompt-tokens-details",
                        *request.param) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)


def test_the_second_request_reports_the_blocks_the_first_cached(client) -> None:
    first = client.completions.create(model=NAME, prompt=PROMPT + "first", max_tokens=2)
    second = client.completions.create(model=NAME, prompt=PROMPT + "second", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached <= second.usage.prompt_tokens - 1
    stream = client.completions.create(model=NAME, prompt=PROMPT + "third", max_tokens=2,
                                       stream=True, stream_options={"include_usage": True})
    (usage,) = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_chat_and_several_prompts_sum_theirs(client) -> None:
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hi"}]
    client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    again = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    # the same prompt again: every whole block but the one of its last token (computed anew)
    assert again.usage.prompt_tokens_details.cached_tokens == (
        (again.usage.prompt_tokens - 1) // 16 * 16)
    both = client.completions.create(model=NAME, prompt=[PROMPT + "a", PROMPT + "b"],
                                     max_tokens=2)
    one = client.completions.create(model=NAME, prompt=PROMPT + "c", max_tokens=2)
    assert both.usage.prompt_tokens_details.cached_tokens == 2 * (
        one.usage.prompt_tokens_details.cached_tokens)
