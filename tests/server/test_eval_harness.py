"""What lm-evaluation-harness' `local-completions` model asks of a server, against a real
`kvfleet serve` (its requests written from its source: lm_eval/models/openai_completions.py and
the remote tokenizer in lm_eval/utils.py). With vLLM's `--enable-tokenizer-info-endpoint` it
tokenizes through the server (GET /tokenizer_info, POST /tokenize, /detokenize: no tokenizer
download on the client); its loglikelihood requests are token-id prompts with echo, logprobs 1
and max_tokens 1, scored on the prompt's own logprobs. The reference is HF transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import jinja2
import pytest
import torch
from support.server import ServerProcess, running_server
from transformers import AutoModelForCausalLM, AutoTokenizer

API_KEY = "eval-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", "tiny", "--max-model-len", "256",
                        "--enable-tokenizer-info-endpoint", "--return-tokens-as-token-ids",
                        api_key=API_KEY) as s:
        yield s


def _http(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60)


def test_the_remote_tokenizer_tokenizes_as_the_model_does(server, tiny_llama) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    with _http(server) as http:
        info = http.get("/tokenizer_info").json()
        # check_remote_tokenizer_support: eos_token in the info, tokens from /tokenize
        assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
        assert info["model_max_length"] == 256
        text = "The quick brown fox"
        tokens = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}
                           ).json()["tokens"]
        assert tokens == tok.encode(text, add_special_tokens=False)
        assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == text
        # its chat template, rendered by the client's own Jinja, is the server's chat prompt
        messages = [{"role": "user", "content": "Hi there"}]
        rendered = jinja2.Environment().from_string(info["chat_template"]).render(
            messages=messages, add_generation_prompt=True,
            bos_token=info["bos_token"], eos_token=info["eos_token"])
        served = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert tok.encode(rendered, add_special_tokens=False) == served
        # behind the API key, as the other routes
        assert httpx.get(server.base_url + "/tokenizer_info").status_code == 401


def test_loglikelihood_requests_score_continuations_as_hf(server, tiny_llama) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    pairs = [("The capital of France is", " Paris"), ("One, two,", " three, four")]
    contexts = [tok.encode(c) for c, _ in pairs]
    prompts = [ctx + tok.encode(cont, add_special_tokens=False)
               for ctx, (_, cont) in zip(contexts, pairs, strict=True)]
    payload = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    with _http(server) as http:
        out = http.post("/v1/completions", json=payload).json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for choice, ids, ctx in zip(choices, prompts, contexts, strict=True):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        want = [lp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids))]
        # parse_logprobs: the continuation's slice [ctxlen:-1] (the last is the new token)
        got = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        # --return-tokens-as-token-ids: the echoed tokens name the prompt's own ids
        assert choice["logprobs"]["tokens"][:len(ids)] == [f"token_id:{t}" for t in ids]
        assert got == pytest.approx(want, abs=1e-3)
        greedy = all(t == max(top.values()) for t, top in
                     zip(got, choice["logprobs"]["top_logprobs"][len(ctx):-1], strict=True))
        assert greedy == all(lp[i - 1].argmax().item() == ids[i]
                             for i in range(len(ctx), len(ids)))


def test_without_the_flag_there_is_no_tokenizer_info(tiny_llama) -> None:
    with running_server(tiny_llama, "--max-model-len", "128") as server:
        assert server.get("/tokenizer_info")[0] == 404
