"""`kvfleet serve --enable-lora --lora-modules`: a request naming an adapter gets HF + PEFT's
greedy tokens for that adapter and one naming the base model the base model's, streamed or not,
alone or batched together, with the engine in the server's thread and in its own process;
/v1/models lists each adapter under the base model it adapts; bad --lora-modules items stop
the start (exit 2) naming the item, before the model loads where they can, else once the engine
has read the adapter's weights (one that does not fit the model), in either engine mode."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from kvfleet_runtime.cli import main
from openai import OpenAI
from support.lora import hf_lora_greedy, make_lora_adapter
from support.server import ServerProcess, running_server, start_server
from support.tiny_models import make_tiny_model
from transformers import AutoTokenizer

BASE, ALIAS = "tiny-base", "tiny-alias"
SQL, CHAT = "sql-lora", "chat-lora"        # CHAT adapts ALIAS (--lora-modules' JSON form)
OTHER = "other-model-lora"                  # an adapter of a wider model: its weights do not fit
MAX_NEW = 12
PROMPTS = [[1, 422, 3201, 77, 9000, 15], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 31000, 2200, 48000]]
MESSAGES = [{"role": "user", "content": "Write a query that counts the users."}]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # wide init (as conftest's tiny_llama): greedy picks do not flip on float noise when a
    # batch mixes adapters
    return make_tiny_model("llama3", tmp_path_factory.mktemp("lora-base"), initializer_range=0.2)


@pytest.fixture(scope="module")
def adapters(base_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    wider = make_tiny_model("llama3", root / "wider-model", hidden_size=96)
    return {SQL: make_lora_adapter(base_model, root / "sql", rank=8, seed=1),
            CHAT: make_lora_adapter(base_model, root / "chat", rank=4, seed=2,
                                    targets=("q_proj", "v_proj", "o_proj", "down_proj")),
            OTHER: make_lora_adapter(wider, root / "other", rank=4)}


@pytest.fixture(scope="module")
def reference(base_model: Path, adapters: dict[str, Path]) -> dict[str, list[list[int]]]:
    """HF + PEFT's greedy tokens of PROMPTS by served model name."""
    refs = {name: hf_lora_greedy(base_model, adapters[name], PROMPTS, MAX_NEW)
            for name in (SQL, CHAT)}
    refs[BASE] = refs[ALIAS] = hf_lora_greedy(base_model, None, PROMPTS, MAX_NEW)
    return refs


@pytest.fixture(scope="module")
def tokenizer(base_model: Path):
    return AutoTokenizer.from_pretrained(base_model)


def _lora_flags(adapters: dict[str, Path]) -> list[str]:
    return ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
            f"{SQL}={adapters[SQL]}",
            json.dumps({"name": CHAT, "path": str(adapters[CHAT]), "base_model_name": ALIAS})]


@pytest.fixture(scope="module", params=[(), ("--engine-process",)], ids=["thread", "engine-process"])
def server(base_model: Path, adapters: dict[str, Path], request) -> Iterator[ServerProcess]:
    with running_server(base_model, "--served-model-name", BASE, ALIAS, "--max-model-len", "256",
                        *_lora_flags(adapters), *request.param) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.openai_base_url, api_key="unused")


def test_the_adapters_change_the_reference(reference) -> None:
    # else the serving tests below would pass with the adapters ignored
    for base, sql, chat in zip(reference[BASE], reference[SQL], reference[CHAT], strict=True):
        assert sql != base and chat != base and sql != chat


def test_each_name_runs_its_adapter_as_hf_peft(client, reference, tokenizer) -> None:
    for name in (BASE, ALIAS, SQL, CHAT):
        for prompt, want in zip(PROMPTS, reference[name], strict=True):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW,
                                          temperature=0)
            assert r.model == name
            assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), name
            assert r.usage.completion_tokens == len(want)


def test_streamed_with_an_adapter_equals_the_reference(client, reference, tokenizer) -> None:
    for prompt, want in zip(PROMPTS, reference[CHAT], strict=True):
        chunks = list(client.completions.create(model=CHAT, prompt=prompt, max_tokens=MAX_NEW,
                                                temperature=0, stream=True))
        assert {c.model for c in chunks} == {CHAT}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == \
            tokenizer.decode(want, skip_special_tokens=True)


def test_one_batch_mixes_the_adapters_and_the_base(client, reference, tokenizer) -> None:
    # --max-loras 2: both adapters and the base model share steps
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in (BASE, SQL, CHAT)] * 2

    def complete(job: tuple[str, int]) -> str:
        name, i = job
        return client.completions.create(model=name, prompt=PROMPTS[i], max_tokens=MAX_NEW,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(complete, jobs))
    assert texts == [tokenizer.decode(reference[name][i], skip_special_tokens=True)
                     for name, i in jobs]


def test_chat_and_responses_with_an_adapter_as_hf_peft(server, client, base_model, adapters,
                                                       tokenizer) -> None:
    # /tokenize takes the adapter's name too: the chat prompt's ids, as the server builds them
    r = httpx.post(f"{server.base_url}/tokenize",
                   json={"model": SQL, "messages": MESSAGES, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    (want,) = hf_lora_greedy(base_model, adapters[SQL], [ids], MAX_NEW)
    (base,) = hf_lora_greedy(base_model, None, [ids], MAX_NEW)
    assert want != base
    kwargs = dict(model=SQL, messages=MESSAGES, max_tokens=MAX_NEW, temperature=0)
    answer = client.chat.completions.create(**kwargs)
    assert answer.model == SQL
    assert answer.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert {c.model for c in chunks} == {SQL}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        answer.choices[0].message.content
    # /v1/responses: the same chat path, with the adapter its model names
    response = client.responses.create(model=SQL, input=MESSAGES, max_output_tokens=MAX_NEW,
                                       temperature=0)
    assert response.model == SQL
    assert response.output_text == answer.choices[0].message.content


def test_models_lists_the_adapters_under_their_base(server, base_model, adapters) -> None:
    status, body = server.get("/v1/models")
    assert status == 200, body
    cards = {c["id"]: c for c in json.loads(body)["data"]}
    assert list(cards) == [BASE, ALIAS, SQL, CHAT]
    for name in (BASE, ALIAS):
        assert cards[name]["root"] == str(base_model) and cards[name]["parent"] is None
    assert (cards[SQL]["root"], cards[SQL]["parent"]) == (str(adapters[SQL]), BASE)
    assert (cards[CHAT]["root"], cards[CHAT]["parent"]) == (str(adapters[CHAT]), ALIAS)
    assert all(c["object"] == "model" and c["owned_by"] == "kvfleet" and c["max_model_len"] == 256
               for c in cards.values())


def test_an_unknown_model_is_404_naming_the_adapters(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="sql", prompt="x", max_tokens=1)
    error = e.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"served: {BASE}, {ALIAS}; LoRA adapters: {SQL}, {CHAT}" in error["message"]


@pytest.mark.parametrize("mode", [(), ("--engine-process",)], ids=["thread", "engine-process"])
def test_an_adapter_whose_weights_do_not_fit_stops_the_start(mode, base_model, adapters) -> None:
    # its config passes the checks before loading; the engine reads its weights at start (as
    # vLLM loads --lora-modules) and they do not fit this model
    with pytest.raises(RuntimeError, match="exited with 2") as e:
        start_server(base_model, "--max-model-len", "256", "--enable-lora", "--lora-modules",
                     f"{SQL}={adapters[SQL]}", f"{OTHER}={adapters[OTHER]}", *mode)
    assert f"--lora-modules '{OTHER}': LoRA adapter" in str(e.value)
    assert "do not fit rank 4" in str(e.value)


# ---- start-up refusals ----

def _config_only(tmp: Path) -> Path:
    (tmp / "adapter_config.json").write_text("{}")       # no r
    return tmp


@pytest.mark.parametrize(("flags", "message"), [
    (lambda a, tmp: ["--enable-lora", "--lora-modules", f"{SQL}={a[SQL]}", f"{SQL}={a[CHAT]}"],
     f"--lora-modules '{SQL}': the name is given twice"),
    (lambda a, tmp: ["--enable-lora", "--served-model-name", BASE, "--lora-modules",
                     f"{BASE}={a[SQL]}"],
     f"--lora-modules '{BASE}': the name is a served model's ({BASE})"),
    (lambda a, tmp: ["--enable-lora", "--served-model-name", BASE, "--lora-modules",
                     json.dumps({"name": SQL, "path": str(a[SQL]), "base_model_name": "gpt"})],
     f"--lora-modules '{SQL}': base_model_name must be a served model name ({BASE}); "
     "got 'gpt'"),
    (lambda a, tmp: ["--enable-lora", "--lora-modules", f"{SQL}={tmp}"],
     f"--lora-modules '{SQL}': LoRA adapter '{{tmp}}': no adapter_config.json"),
    (lambda a, tmp: ["--enable-lora", "--lora-modules", f"{SQL}={_config_only(tmp)}"],
     f"--lora-modules '{SQL}': LoRA adapter '{{tmp}}': r must be a positive integer"),
    (lambda a, tmp: ["--enable-lora", "--max-lora-rank", "4", "--lora-modules",
                     f"{CHAT}={a[CHAT]}", f"{SQL}={a[SQL]}"],
     f"--lora-modules '{SQL}': rank 8 is larger than --max-lora-rank (4)"),
], ids=["duplicate", "served-name", "base-model-name", "no-config", "bad-config", "rank"])
def test_bad_adapters_exit_2_before_loading(flags: Callable, message: str, adapters, tmp_path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # x.gguf does not exist: refused first, so the model is never looked at
    assert main(["serve", "x.gguf", "--device", "cpu", *flags(adapters, tmp_path)]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_an_adapter_named_as_the_models_default_name_stops_the_start(base_model,
                                                                     adapters) -> None:
    # without --served-model-name the model's name is known once it has loaded
    with pytest.raises(RuntimeError, match="exited with 2") as e:
        start_server(base_model, "--enable-lora", "--lora-modules",
                     f"{base_model.name}={adapters[SQL]}")
    assert f"--lora-modules '{base_model.name}': the name is a served model's" in str(e.value)


# ---- adapters loaded and unloaded while serving (vLLM's routes) ----

@pytest.fixture(scope="module", params=[(), ("--engine-process",)], ids=["thread", "engine-process"])
def updating_server(base_model: Path, request) -> Iterator[ServerProcess]:
    with running_server(base_model, "--served-model-name", BASE, "--max-model-len", "256",
                        "--enable-lora", "--max-lora-rank", "8", *request.param,
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as s:
        yield s


def test_adapters_loaded_and_unloaded_while_serving(updating_server, adapters, reference,
                                                    tokenizer) -> None:
    client = OpenAI(base_url=updating_server.openai_base_url, api_key="unused")
    http = httpx.Client(base_url=updating_server.base_url, timeout=60)

    def served() -> list[str]:
        return [c["id"] for c in http.get("/v1/models").json()["data"]]

    def complete(model: str) -> str:
        r = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_NEW,
                                      temperature=0)
        return r.choices[0].text
    assert served() == [BASE]
    with pytest.raises(openai.NotFoundError):
        complete(SQL)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": SQL, "lora_path": str(adapters[SQL])})
    assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{SQL}' added successfully."
    assert served() == [BASE, SQL]
    assert complete(SQL) == tokenizer.decode(reference[SQL][1], skip_special_tokens=True)
    # refused: the name again, a served name, no path, weights that do not fit the model (read
    # by the engine before the adapter is listed), an unknown base model
    refusals = [({"lora_name": SQL, "lora_path": str(adapters[CHAT])}, "has already been loaded",
                 "lora_name"),
                ({"lora_name": BASE, "lora_path": str(adapters[CHAT])}, "has already been loaded",
                 "lora_name"),
                ({"lora_name": CHAT}, "Both 'lora_name' and 'lora_path' must be provided",
                 "lora_path"),
                ({"lora_name": OTHER, "lora_path": str(adapters[OTHER])}, "do not fit rank 4",
                 "lora_path"),
                ({"lora_name": CHAT, "lora_path": str(adapters[CHAT]), "base_model_name": "gpt"},
                 "base_model_name must be a served model name", "base_model_name")]
    for body, message, param in refusals:
        r = http.post("/v1/load_lora_adapter", json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and message in error["message"] and error["param"] == param
    assert served() == [BASE, SQL]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": CHAT, "lora_path": str(adapters[CHAT])})
    assert r.status_code == 200
    assert complete(CHAT) == tokenizer.decode(reference[CHAT][1], skip_special_tokens=True)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": SQL})
    assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{SQL}' removed successfully."
    assert served() == [BASE, CHAT]
    with pytest.raises(openai.NotFoundError):
        complete(SQL)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": SQL})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    # loaded again: a new id (the engine's cache keeps one folder an id)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": SQL, "lora_path": str(adapters[CHAT])})
    assert r.status_code == 200
    assert complete(SQL) == tokenizer.decode(reference[CHAT][1], skip_special_tokens=True)
    assert complete(BASE) == tokenizer.decode(reference[BASE][1], skip_special_tokens=True)


def test_the_runtime_routes_need_the_environment_setting(server) -> None:
    # the module's server runs without VLLM_ALLOW_RUNTIME_LORA_UPDATING: no such routes
    r = httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": "x",
                                                                    "lora_path": "/x"})
    assert r.status_code == 404


def test_metrics_name_the_running_adapters(server, client) -> None:
    # vLLM's lora_requests_info (what LoRA-aware routers read), while a request with an adapter
    # streams; one series at a time, its value the time it was seen
    import re
    import time
    stream = client.completions.create(model=SQL, prompt=PROMPTS[0], max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    status, body = server.get("/metrics")
    stream.close()
    series = re.findall(r"^kvfleet_lora_requests_info\{(.*)\} (\S+)$", body, re.M)
    assert len(series) == 1, series
    labels, value = series[0]
    assert f'running_lora_adapters="{SQL}"' in labels and 'max_lora="2"' in labels
    assert f'model_name="{BASE}"' in labels and abs(float(value) - time.time()) < 60
    # and under vLLM's own name, as the Inference Extension's endpoint picker reads it
    assert re.findall(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", body, re.M) == series
