"""`/v1/embeddings` with the official openai client: every input form, base64, usage, vLLM's
extras, errors naming their field; in both engine modes. The reference is HF transformers' base
model (the last token's final hidden state, normalised) on the same tiny random checkpoint."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from support.server import running_server
from support.tiny_models import make_tiny_model

TEXTS = ["The quick brown fox", "jumps over the lazy dog. " * 6, "x"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = make_tiny_model("qwen3", tmp_path_factory.mktemp("embed"), initializer_range=0.2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return path


@pytest.fixture(scope="module")
def reference(model: Path):
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModel.from_pretrained(model, dtype=torch.float32)

    def embed(ids: list[int], normalize: bool = True, dims: int | None = None) -> torch.Tensor:
        with torch.no_grad():
            h = hf(torch.tensor([ids])).last_hidden_state[0, -1][:dims]
        return torch.nn.functional.normalize(h, dim=-1) if normalize else h
    return tok, embed


@pytest.fixture(scope="module", params=["thread", "engine-process"])
def server(model: Path, request):
    flags = ["--engine-process"] if request.param == "engine-process" else ["--no-engine-process"]
    with running_server(model, "--max-model-len", "128", "--dtype", "float32",
                        "--served-model-name", "embedder", *flags) as s:
        yield s


@pytest.fixture
def client(server) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)


def _close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), want, atol=1e-4, rtol=1e-4)


def test_texts_embed_as_hf_does(client, reference):
    tok, embed = reference
    r = client.embeddings.create(model="embedder", input=TEXTS)
    assert r.object == "list" and r.model == "embedder"
    assert [d.index for d in r.data] == [0, 1, 2]
    ids = [tok.encode(t) for t in TEXTS]
    for d, i in zip(r.data, ids, strict=True):
        assert len(d.embedding) == 64 and _close(d.embedding, embed(i))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    # the same text again (its prompt now in the prefix cache) embeds the same
    again = client.embeddings.create(model="embedder", input=TEXTS[1])
    assert _close(again.data[0].embedding, torch.tensor(r.data[1].embedding))


def test_token_ids_base64_dimensions_and_normalize(client, reference):
    tok, embed = reference
    ids = [tok.encode(t) for t in TEXTS[:2]]
    one = client.embeddings.create(model="embedder", input=ids[0])        # one list of ids
    assert len(one.data) == 1 and _close(one.data[0].embedding, embed(ids[0]))
    many = client.embeddings.create(model="embedder", input=ids, dimensions=16)
    for d, i in zip(many.data, ids, strict=True):
        assert len(d.embedding) == 16 and _close(d.embedding, embed(i, dims=16))
    # base64: little-endian float32, what the openai client decodes by default with numpy
    raw = httpx.post(f"{client.base_url}embeddings", json={
        "model": "embedder", "input": TEXTS[0], "encoding_format": "base64"}).json()
    data = base64.b64decode(raw["data"][0]["embedding"])
    values = list(struct.unpack(f"<{len(data) // 4}f", data))
    assert _close(values, embed(tok.encode(TEXTS[0])))
    plain = client.embeddings.create(model="embedder", input=TEXTS[0],
                                     extra_body={"normalize": False})
    assert _close(plain.data[0].embedding, embed(tok.encode(TEXTS[0]), normalize=False))
    cut = client.embeddings.create(model="embedder", input=TEXTS[1],
                                   extra_body={"truncate_prompt_tokens": 5})
    assert cut.usage.prompt_tokens == 5
    assert _close(cut.data[0].embedding, embed(tok.encode(TEXTS[1])[-5:]))


def test_embeddings_run_beside_a_stream(client):
    stream = client.completions.create(model="embedder", prompt="Hello", max_tokens=20,
                                       temperature=0.0, stream=True)
    first = next(iter(stream))
    r = client.embeddings.create(model="embedder", input=TEXTS)
    text = first.choices[0].text + "".join(c.choices[0].text for c in stream if c.choices)
    alone = client.completions.create(model="embedder", prompt="Hello", max_tokens=20,
                                      temperature=0.0).choices[0].text
    assert len(r.data) == 3 and text == alone


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], [10 ** 9]]}, "input"),
    ({"input": "word " * 200}, "input"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "dimensions": 100}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "model": "nope"}, "model"),
    ({"input": "x", "unknown": 1}, "unknown"),
])
def test_bad_requests_name_their_field(server, body, param):
    r = httpx.post(f"{server.openai_base_url}/embeddings", json={"model": "embedder", **body})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
    # and the server goes on serving
    ok = httpx.post(f"{server.openai_base_url}/embeddings", json={"input": "fine"})
    assert ok.status_code == 200


def test_a_model_that_is_not_matryoshka_refuses_dimensions(tmp_path):
    path = make_tiny_model("llama", tmp_path / "plain")
    with running_server(path, "--max-model-len", "64", "--no-engine-process") as s:
        r = httpx.post(f"{s.openai_base_url}/embeddings", json={"input": "x", "dimensions": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
        assert "Matryoshka" in r.json()["error"]["message"]
        assert httpx.post(f"{s.openai_base_url}/embeddings", json={"input": "x"}).status_code == 200


def test_metrics_count_the_inputs_tokens_as_prompt_and_nothing_as_generated(server, client):
    before = {name: server.metric(name) for name in (
        "kvfleet_prompt_tokens_total", "kvfleet_generation_tokens_total",
        "kvfleet_request_prompt_tokens_count")}
    stops = server.metric("kvfleet_request_success_total", finished_reason="stop")
    lengths = server.metric("kvfleet_request_success_total", finished_reason="length")
    r = client.embeddings.create(model="embedder", input=TEXTS)
    assert server.metric("kvfleet_prompt_tokens_total") == \
        before["kvfleet_prompt_tokens_total"] + r.usage.prompt_tokens
    assert server.metric("kvfleet_generation_tokens_total") == \
        before["kvfleet_generation_tokens_total"]
    assert server.metric("kvfleet_request_prompt_tokens_count") == \
        before["kvfleet_request_prompt_tokens_count"] + len(TEXTS)
    assert server.metric("kvfleet_request_success_total", finished_reason="stop") == stops + 3
    assert server.metric("kvfleet_request_success_total", finished_reason="length") == lengths
