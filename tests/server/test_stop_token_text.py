"""The EOS or stop token id that ends a completion adds no text of its own (vLLM's rule),
unless `include_stop_str_in_output`: with `skip_special_tokens: false` an EOS would otherwise
end the text as `<|im_end|>`, which a client (or a tool-call parser) then has to strip. The
official openai client against a real server, the engine in a thread and in its own process
(where the server's process makes the text)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from support.server import ServerProcess, running_server
from transformers import AutoTokenizer

ANSWER = "The answer is 42 tomatoes"


@pytest.fixture(scope="module", params=[("--no-engine-process",), ("--engine-process",)],
                ids=["thread", "engine-process"])
def server(tiny_llama: Path, request) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", "tiny", "--max-model-len", "256",
                        *request.param) as s:
        yield s


def _complete(server: ServerProcess, stream: bool, **extra) -> tuple[str, str]:
    """(text, finish_reason) of a completion the grammar holds to ANSWER, then EOS."""
    client = OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", prompt="Q:", max_tokens=40, temperature=0.0,
                  extra_body={"guided_choice": [ANSWER], **extra})
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_the_eos_that_ends_a_completion_shows_no_text(server, tiny_llama, stream):
    eos = AutoTokenizer.from_pretrained(tiny_llama).eos_token
    for skip in (True, False):
        text, finish = _complete(server, stream, skip_special_tokens=skip)
        assert (text, finish) == (ANSWER, "stop"), skip
    # asked for: the EOS's own text at the end (only where special tokens are not skipped)
    text, _ = _complete(server, stream, skip_special_tokens=False,
                           include_stop_str_in_output=True)
    assert text == ANSWER + eos
    text, _ = _complete(server, stream, skip_special_tokens=True,
                           include_stop_str_in_output=True)
    assert text == ANSWER


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_id_ends_the_text_before_its_own(server, tiny_llama, stream):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    # stop on the token that starts " 42": the text ends right before it
    at = next(i for i in range(len(ids)) if tok.decode(ids[:i + 1]).endswith("42"))
    before = tok.decode(ids[:at])
    text, finish = _complete(server, stream, stop_token_ids=[ids[at]])
    assert (text, finish) == (before, "stop")
    text, _ = _complete(server, stream, stop_token_ids=[ids[at]],
                           include_stop_str_in_output=True)
    assert text == tok.decode(ids[:at + 1])
