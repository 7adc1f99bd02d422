"""`kvfleet serve --chat-template` and CORS (vLLM's --allowed-origins...), on real servers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.server import ServerProcess, running_server
from transformers import AutoTokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
UI = "https://ui.example"


@pytest.fixture(scope="module")
def custom(tiny_llama: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with running_server(tiny_llama, "--chat-template", str(template),
                        "--allowed-origins", f'["{UI}"]', api_key="k") as server:
        yield server


@pytest.fixture(scope="module")
def default(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--chat-template", TEMPLATE) as server:   # inline
        yield server


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("which", ["custom", "default"])
def test_the_chat_template_given_is_the_one_used(which, request, tiny_llama: Path) -> None:
    server = request.getfixturevalue(which)
    headers = {"Authorization": "Bearer k"} if which == "custom" else {}
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES}, headers=headers)
    assert r.status_code == 200, r.text
    expected = "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert r.json()["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) != expected   # not its own
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, json={
        "messages": MESSAGES, "max_tokens": 3, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(
        r.json()["tokens"])


def test_an_allowed_origin_is_answered_with_cors_headers(custom: ServerProcess) -> None:
    preflight = httpx.options(f"{custom.base_url}/v1/chat/completions", headers={
        "Origin": UI, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    # a preflight carries no API key, and needs none
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == UI
    assert "POST" in preflight.headers["access-control-allow-methods"]
    models = httpx.get(f"{custom.base_url}/v1/models",
                       headers={"Origin": UI, "Authorization": "Bearer k"})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == UI
    # errors carry them too: the browser shows the 401's body, not a CORS failure
    unauthorized = httpx.get(f"{custom.base_url}/v1/models", headers={"Origin": UI})
    assert unauthorized.status_code == 401
    assert unauthorized.headers["access-control-allow-origin"] == UI


def test_another_origin_is_refused(custom: ServerProcess) -> None:
    preflight = httpx.options(f"{custom.base_url}/v1/models", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    r = httpx.get(f"{custom.base_url}/v1/models",
                  headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
    assert "access-control-allow-origin" not in r.headers


def test_any_origin_by_default_as_vllm(default: ServerProcess) -> None:
    r = httpx.get(f"{default.base_url}/v1/models", headers={"Origin": "https://any.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    # without an Origin (not a browser) nothing changes
    assert "access-control-allow-origin" not in httpx.get(f"{default.base_url}/v1/models").headers
