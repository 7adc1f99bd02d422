"""The SSE events of streamed completions and chats, built without a live server.

A stream's commonest event (a choice's new text, nothing else) is joined from two halves
rendered once through the response models (`text_event`); it must be the same bytes as the
models give, for any text, and the streams built from it the chunks OpenAI's clients expect.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from kvfleet_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet_runtime.server import api
from kvfleet_runtime.server import protocol as p

TEXTS = ["", "plain", ' "quoted" \\ back\\slash', "new\nline\ttab\r", "é 漢字 🙂", "\u2028\u2029",
         "\x00\x1f\x7f", "</script>", "{}[]", "null", "\ue000kvfleet-text", "a" * 500]
MODEL = 'm"ö'


def call(kind: str, **fields) -> api._GenerationCall:
    state = SimpleNamespace(engine=SimpleNamespace(tokenizer=None), model_name=MODEL,
                            served_model_names=[MODEL], return_tokens_as_token_ids=False,
                            enable_prompt_tokens_details=False, options=api.APIOptions())
    if kind == "completion":
        return api._CompletionCall(state, None, p.CompletionRequest(model=MODEL, prompt="hi",
                                                                    stream=True, **fields))
    return api._ChatCall(state, None, p.ChatCompletionRequest(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, **fields))


def data(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n"), event
    return json.loads(event[len("data: "):-2])


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("usage", [False, True])
def test_a_text_event_is_the_models_event_byte_for_byte(kind, usage):
    c = call(kind, stream_options={"include_usage": usage})
    for index in (0, 3, 12):
        for text in TEXTS:
            expected = c.event(c.text_chunk(index, text), (2, 5))
            assert c.text_event(index, text, (2, 5)) == expected
            chunk = data(expected)
            assert chunk["choices"][0]["index"] == index
            assert chunk["model"] == MODEL and ("usage" in chunk) == usage
            got = (chunk["choices"][0]["text"] if kind == "completion"
                   else chunk["choices"][0]["delta"]["content"])
            assert got == text


def outputs(texts: list[str], finish: str = "length", n: int = 1) -> list[RequestOutput]:
    """Cumulative outputs of a request whose choices each grow by texts, one token each."""
    outs = []
    for step in range(1, len(texts) + 1):
        done = step == len(texts)
        outs.append(RequestOutput("r", None, [1, 2], [
            CompletionOutput(i, "".join(texts[:step]), list(range(step)),
                             logprobs=[{t: Logprob(logprob=-1.0, decoded_token=texts[t])}
                                       for t in range(step)],
                             finish_reason=finish if done else None)
            for i in reversed(range(n))], finished=done))
    return outs


def stream(c: api._GenerationCall, outs: list[RequestOutput]) -> list[dict]:
    return [data(e) for out in outs for e in c.events(0, out)]


@pytest.mark.parametrize("n", [1, 2])
def test_a_completion_stream_carries_each_choices_text_then_its_finish(n):
    texts = ["Hel", "lo", "", ' "w"', "örld"]
    chunks = stream(call("completion", n=n), outputs(texts, n=n))
    for i in range(n):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        # the empty step sends nothing; the finish comes on the last text's chunk
        assert [m["text"] for m in mine] == ["Hel", "lo", ' "w"', "örld"]
        assert [m["finish_reason"] for m in mine] == [None, None, None, "length"]
        assert all(m["logprobs"] is None for m in mine)
    assert all(set(ch) == {"id", "object", "created", "model", "choices", "system_fingerprint"}
               and ch["object"] == "text_completion" for ch in chunks)


def test_a_completion_stream_with_logprobs_carries_them_on_every_chunk():
    chunks = stream(call("completion", logprobs=0), outputs(["a", "b", "c"]))
    assert [ch["choices"][0]["logprobs"]["tokens"] for ch in chunks] == [["a"], ["b"], ["c"]]


def test_a_chat_stream_opens_with_the_role_and_ends_with_the_finish():
    chunks = stream(call("chat", stream_options={"include_usage": True}),
                    outputs(["Hi", "", " there"], finish="stop"))
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hi"},
                      {"content": " there"}, {}]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, None, None, "stop"]
    assert all(ch["usage"] is None and ch["object"] == "chat.completion.chunk" for ch in chunks)


def test_a_chat_stream_with_logprobs_carries_them_on_every_content_chunk():
    chunks = stream(call("chat", logprobs=True), outputs(["Hi", " there"]))
    content = [ch["choices"][0] for ch in chunks if ch["choices"][0]["delta"].get("content")]
    assert [[e["token"] for e in c["logprobs"]["content"]] for c in content] == [["Hi"], [" there"]]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_puts_the_tokens_so_far_on_every_chunk(kind):
    texts = ["a", "b", "c"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(call(kind, stream_options=options), outputs(texts))
    completion_tokens = [ch["usage"]["completion_tokens"] for ch in chunks]
    # the chat's role chunk comes before any token; its finish chunk after the last
    assert completion_tokens == ([1, 2, 3] if kind == "completion" else [0, 1, 2, 3, 3])
    assert all(ch["usage"]["prompt_tokens"] == 2 and ch["usage"]["total_tokens"]
               == 2 + ch["usage"]["completion_tokens"] for ch in chunks)
    # without include_usage the setting asks nothing (vLLM's rule): no usage key at all
    plain = stream(call(kind, stream_options={"continuous_usage_stats": True}), outputs(texts))
    assert all("usage" not in ch for ch in plain)
