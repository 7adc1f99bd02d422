"""Bad input gets OpenAI-shaped errors with the right status, naming the field; the server
keeps serving afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.server import ServerProcess, running_server

MAX_LEN = 128


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    # 4 blocks of 16 tokens: requests within max_model_len can still overflow the KV cache
    with running_server(tiny_llama, "--max-model-len", str(MAX_LEN), "--num-gpu-blocks", "4",
                        "--block-size", "16") as s:
        yield s


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_HI = [{"role": "user", "content": "hi"}]

# (path, JSON body or raw bytes, status, param, words the message must contain)
CASES = [
    (COMPLETIONS, b'{"prompt": "x", ', 400, None, "not valid JSON"),
    (COMPLETIONS, b"[1, 2]", 400, None, "JSON object"),
    (COMPLETIONS, {"prompt": "x", "bogus": 1}, 400, "bogus", "unknown field 'bogus'"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt", "prompt is required"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "'hot'"),
    (COMPLETIONS, {"prompt": "x", "n": "two"}, 400, "n", "integer"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400, "temperature",
     "temperature must be >= 0; got -0.5"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", "n must be an integer >= 1; got 0"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    (COMPLETIONS, {"prompt": [42] * 100, "max_tokens": 60}, 400, "max_tokens",
     f"maximum context length is {MAX_LEN} tokens. However, you requested 160 tokens "
     "(100 in the prompt, 60 in max_tokens)"),
    (COMPLETIONS, {"prompt": [42] * 130, "max_tokens": None}, 400, "max_tokens",
     "prompt has 130 tokens"),
    (CHAT, {"messages": USER_HI, "max_completion_tokens": 500}, 400, "max_completion_tokens",
     f"maximum context length is {MAX_LEN} tokens"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
    (CHAT, {"messages": USER_HI, "model": "gpt-4"}, 404, "model", "does not exist"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix is not supported"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", "must not be empty"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", "token ids must be in [0, 49152)"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "only allowed when stream is true"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias",
     "keys must be token ids (non-negative integers); got 'five'"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias",
     "biases in [-100, 100] (token 5); got 101"),
    (CHAT, {"messages": USER_HI, "logit_bias": {"49152": 1}}, 400, "logit_bias",
     "token ids in [0, 49152); got [49152]"),
    (CHAT, {"messages": USER_HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     400, "response_format", 'response_format is not valid: Unsupported type "bogus"'),
    (CHAT, {"messages": USER_HI, "response_format": {"type": "xml"}}, 400,
     "response_format.type", "'text', 'json_object' or 'json_schema'"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "[a-"}}, 400,
     "structured_outputs", "structured_outputs.regex is not valid: Regex parsing error"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "a+", "response_format": {
        "type": "json_object"}}, 400, "guided_regex",
     "give one way to structure the output; got response_format, guided_regex"),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens",
     "must be -1 or an integer >= 1; got 0"),
    (CHAT, {"messages": USER_HI, "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens",
     "got -2"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids",
     "non-empty list of token ids"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": [3, 10**6]}, 400, "allowed_token_ids",
     "token ids in [0, 49152); got [1000000]"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role",
     "must be one of system, developer, user, assistant, tool; got 'wizard'"),
    (CHAT, {"messages": []}, 400, "messages", "at least one message"),
    (CHAT, {"messages": USER_HI, "top_logprobs": 2}, 400, "top_logprobs", "requires logprobs"),
    (CHAT, {"messages": USER_HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs must be an integer in [0, 20]; got 21"),
    (CHAT, {"messages": USER_HI, "tools": [{"type": "function"}]}, 400,
     "tools.0.function", "tools.0.function is required"),
    (CHAT, {"messages": USER_HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", '"auto" tool choice requires the server to be started with '
     "--enable-auto-tool-choice and --tool-call-parser"),
    (CHAT, {"messages": USER_HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "bogus"}}}], "tool_choice": "required"}, 400,
     "tools", "a tool's parameters are not a usable JSON schema"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "ids in [0, 49152)"),
    ("/tokenize", {}, 400, "prompt", "exactly one of prompt or messages"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), CASES,
                         ids=[f"{c[0]}-{c[4][:30]}" for c in CASES])
def test_bad_request_gets_an_openai_error(server: ServerProcess, path: str,
                                          body: dict | bytes, status: int, param: str | None,
                                          words: str) -> None:
    if isinstance(body, bytes):
        r = httpx.post(server.base_url + path, content=body,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.base_url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_unknown_route_and_wrong_method_are_openai_errors(server: ServerProcess) -> None:
    r = httpx.get(server.base_url + "/v1/nothing")
    assert r.status_code == 404 and "message" in r.json()["error"]
    r = httpx.get(server.base_url + COMPLETIONS)
    assert r.status_code == 405 and "message" in r.json()["error"]


def test_the_engines_own_refusal_is_a_400_or_an_error_event(server: ServerProcess) -> None:
    body = {"prompt": [42] * 10, "max_tokens": 100}     # fits 128 tokens, not 4 blocks
    r = httpx.post(server.base_url + COMPLETIONS, json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    with httpx.stream("POST", server.base_url + COMPLETIONS, json={**body, "stream": True},
                      timeout=60) as stream:
        assert stream.status_code == 200      # the status line went out before the engine said no
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    streamed = json.loads(events[-2][len("data: "):])["error"]
    assert streamed["message"] == r.json()["error"]["message"]


def test_server_still_serves_after_bad_input(server: ServerProcess) -> None:
    # runs after the error cases (pytest keeps file order)
    assert server.get("/health")[0] == 200
    r = httpx.post(server.base_url + COMPLETIONS,
                   json={"prompt": "still alive?", "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.process.poll() is None
