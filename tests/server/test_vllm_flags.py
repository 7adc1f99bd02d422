"""vLLM's `vllm serve` flags on `kvfleet serve`: a copied command line (a model card's, a KServe or
KubeAI manifest's, a Helm values file's) starts. Each flag does what it does in vLLM where it
means something here; where it cannot change anything, only the value that matches what kvfleet
does is accepted and any other is refused by name (exit 2) before the model loads.

Parsed through the real parser (build_parser, main), then seen through two real servers: one of
the tiny Llama with most flags on at once, one pulled from the Hub stand-in at a revision."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from kvfleet_runtime import loader, model_source
from kvfleet_runtime.cli import build_parser
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.pooling import PoolerConfig
from kvfleet_runtime.server.cli import (
    check_classifier,
    check_vllm_args,
    engine_config_from_args,
    uvicorn_config,
)
from support.hub import HubServer, folder_files
from support.server import ServerProcess, running_server, serve_exit_code

SECRET = "zebra quartz lantern"     # a prompt whose text must never reach the log
REPO = "kvfleet-test/tiny-llama"


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", "m", *flags])


# ---- the parser ----

def test_the_flags_that_act_here_parse_into_the_server_and_engine_settings() -> None:
    args = _serve_args(
        "--trust-remote-code", "--revision", "v1", "--tokenizer-revision", "t1",
        "--download-dir", "/models", "--enable-log-requests", "--disable-log-stats",
        "--uvicorn-log-level", "trace", "--root-path", "/api", "--disable-fastapi-docs",
        "--response-role", "bot", "--enable-request-id-headers", "--task", "embed",
        "--convert", "embed", "--num-gpu-blocks-override", "64", "--swap-space", "4",
        "--max-logprobs", "5", "--enable-force-include-usage", "-tp", "2")
    assert (args.download_dir, args.enable_log_requests, args.uvicorn_log_level) == (
        "/models", True, "trace")
    assert (args.root_path, args.disable_fastapi_docs, args.response_role) == ("/api", True, "bot")
    assert (args.enable_request_id_headers, args.task, args.convert) == (True, "embed", "embed")
    assert (args.swap_space, args.max_logprobs, args.enable_force_include_usage) == (4.0, 5, True)
    config = engine_config_from_args(args, model="m", device="cpu")
    assert (config.trust_remote_code, config.revision, config.tokenizer_revision) == (
        True, "v1", "t1")
    assert (config.num_gpu_blocks, config.tensor_parallel_size) == (64, 2)
    # not given: vLLM's defaults, which are what kvfleet does
    args = _serve_args()
    config = engine_config_from_args(args, model="m", device="cpu")
    assert not config.trust_remote_code and config.revision is config.tokenizer_revision is None
    assert (args.max_logprobs, args.response_role, args.root_path) == (20, "assistant", "")
    assert args.uvicorn_log_level is None and not args.enable_log_requests


def test_the_flags_that_change_nothing_here_take_the_values_that_match() -> None:
    args = _serve_args(
        "--disable-log-requests", "--guided-decoding-backend", "xgrammar",
        "--structured-outputs-config", '{"backend": "auto"}',
        "--distributed-executor-backend", "mp", "--pipeline-parallel-size", "1",
        "--data-parallel-size", "1", "--convert", "none", "--task", "generate")
    assert args.disable_log_requests and args.guided_decoding_backend == "xgrammar"
    assert args.structured_outputs_config == {"backend": "auto"}
    assert (args.distributed_executor_backend, args.pipeline_parallel_size,
            args.data_parallel_size) == ("mp", 1, 1)
    assert _serve_args("-pp", "1", "-dp", "1").pipeline_parallel_size == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--code-revision", "abc123"], "argument --code-revision: kvfleet runs no model code from "
                                    "the Hub"),
    (["--distributed-executor-backend", "ray"],
     "argument --distributed-executor-backend: only mp here"),
    (["--pipeline-parallel-size", "2"], "argument --pipeline-parallel-size/-pp: only 1 here (no "
                                        "pipeline parallelism: shard the model with "
                                        "--tensor-parallel-size)"),
    (["-pp", "4"], "argument --pipeline-parallel-size/-pp: only 1 here"),
    (["--data-parallel-size", "2"], "argument --data-parallel-size/-dp: only 1 here (no data "
                                    "parallelism"),
    (["--guided-decoding-backend", "outlines"],
     "argument --guided-decoding-backend: only auto or xgrammar here (structured outputs run "
     "on xgrammar); got 'outlines'"),
    (["--structured-outputs-config", '{"backend": "guidance"}'],
     "argument --structured-outputs-config: only auto or xgrammar here"),
    (["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
     "argument --structured-outputs-config: only backend may be set here; got "
     "'disable_any_whitespace'"),
    (["--structured-outputs-config", "xgrammar"],
     "argument --structured-outputs-config: must be a JSON object"),
    (["--swap-space", "-1"], "argument --swap-space: must be a number of GiB >= 0"),
    (["--max-logprobs", "21"], "argument --max-logprobs: must be an integer in [0, 20] (the "
                               "engine returns at most 20 logprobs a token); got '21'"),
    (["--max-logprobs", "-1"], "argument --max-logprobs: must be an integer in [0, 20]"),
    (["--task", "transcription"], "argument --task: must be one of auto, generate, embed"),
    (["--convert", "reward"], "argument --convert: invalid choice: 'reward'"),
    (["--uvicorn-log-level", "loud"], "argument --uvicorn-log-level: invalid choice: 'loud'"),
    (["--runner", "generate", "--task", "embed"],
     "--runner generate and --task embed ask for different runners (generate, pooling)"),
    (["--task", "generate", "--convert", "embed"],
     "--task generate and --convert embed ask for different runners"),
    (["--enable-log-requests", "--disable-log-requests"],
     "--enable-log-requests and --disable-log-requests contradict each other"),
    (["--ssl-certfile", "no/such/cert.pem"], "--ssl-certfile: no file 'no/such/cert.pem'"),
    (["--ssl-keyfile", __file__], "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need "
                                  "--ssl-certfile"),
    (["--ssl-cert-reqs", "2"], "need --ssl-certfile"),
    # x.gguf is a local path: no Hub revision to pick
    (["--revision", "v1"], "revision 'v1' is a Hub revision; model 'x.gguf' is a local path"),
    (["--tokenizer-revision", "v1"], "tokenizer_revision 'v1' is a Hub revision; the tokenizer "
                                     "is model 'x.gguf''s, which is not on the Hub"),
    (["--revision", " "], "revision must be a Hub revision (a branch, tag or commit); got ' '"),
])
def test_other_values_exit_2_naming_the_flag(flags: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_exit_code(flags) == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "runner"), [
    (["--task", "embed"], "pooling"), (["--task", "reward"], "pooling"),
    (["--task", "generate"], "generate"), (["--convert", "embed"], "pooling"),
    (["--convert", "classify"], "pooling"), (["--task", "score", "--runner", "pooling"], "pooling"),
    (["--task", "auto", "--convert", "none"], None), (["--convert", "auto"], None)])
def test_task_and_convert_pick_the_runner(flags: list[str], runner: str | None) -> None:
    args = _serve_args(*flags)
    check_vllm_args(args)
    assert getattr(args, "runner", None) == runner


def test_a_config_file_gives_flags_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    config = tmp_path / "vllm.yaml"
    config.write_text(
        "model: from-file\n"                 # the positional MODEL still wins (serve)
        "max_model_len: 512\n"                  # - or _ as vLLM's keys
        "max-num-seqs: 8\n"
        "served-model-name: [a, b]\n"           # a list: a flag of several values
        "enable-prefix-caching: false\n"        # a switch: its --no- form
        "trust-remote-code: true\n"
        "enable-log-requests: true\n"
        "disable-fastapi-docs: false\n"         # a store_true switch left off
        "hf-overrides: {is_matryoshka: true}\n"  # a mapping: JSON
        "allowed-origins: ['https://ui.example']\n"
        "gpu-memory-utilization: 0.5\n")
    args = build_parser().parse_args(["serve", "m", "--config", str(config),
                                      "--max-num-seqs", "16"])
    assert (args.model_positional, args.model, args.max_model_len) == ("m", "from-file", 512)
    assert args.max_num_seqs == 16           # the command line's
    assert args.served_model_name == ["a", "b"] and args.allowed_origins == ["https://ui.example"]
    assert args.enable_log_requests and not args.disable_fastapi_docs
    config_ = engine_config_from_args(args, model="m", device="cpu")
    assert config_.enable_prefix_caching is False and config_.trust_remote_code is True
    assert config_.hf_overrides == {"is_matryoshka": True}
    assert config_.gpu_memory_utilization == 0.5
    # the file after the flags, with =: the same
    args = build_parser().parse_args(["serve", "--max-num-seqs=16", f"--config={config}", "m"])
    assert (args.model_positional, args.max_num_seqs, args.max_model_len) == ("m", 16, 512)


@pytest.mark.parametrize(("text", "message"), [
    ("max-model-len: 512\nno-such-flag: 1\n", "'no-such-flag' is not a flag of this command"),
    ("config: other.yaml\n", "'config' is not a flag of this command"),
    ("trust-remote-code: 'yes'\n", "'trust-remote-code' is a switch: true or false; got 'yes'"),
    ("- max-model-len\n", "must be a mapping of flag names to values"),
    ("max-model-len: [512\n", "cannot read it as YAML"),
])
def test_a_config_file_key_that_is_not_a_flag_is_refused_by_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    config = tmp_path / "vllm.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "m", "--config", str(config)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {config}: {message}" in err and "kvfleet serve: error" in err


def test_uvicorn_takes_the_log_level_tls_files_and_their_checks(tmp_path: Path) -> None:
    key, cert, ca = (tmp_path / name for name in ("key.pem", "cert.pem", "ca.pem"))
    args = _serve_args("--log-level", "warning", "--ssl-keyfile", str(key),
                       "--ssl-certfile", str(cert), "--ssl-ca-certs", str(ca),
                       "--ssl-cert-reqs", "2")
    config = uvicorn_config(None, args)
    assert config.log_level == "warning"       # the --log-level, without --uvicorn-log-level
    assert (config.ssl_keyfile, config.ssl_certfile, config.ssl_ca_certs, config.ssl_cert_reqs) \
        == (str(key), str(cert), str(ca), 2)
    args = _serve_args("--log-level", "warning", "--uvicorn-log-level", "trace")
    config = uvicorn_config(None, args)
    assert config.log_level == "trace" and config.ssl_certfile is None


# ---- what the engine side does with them ----

def test_revision_picks_the_hub_revision_of_a_hub_model() -> None:
    assert model_source.with_revision("org/name", None) == "org/name"
    assert model_source.with_revision("org/name", "v1") == "hf://org/name@v1"
    assert model_source.with_revision("hf://org/name", "refs/pr/1") == "hf://org/name@refs/pr/1"
    assert model_source.with_revision("hf://org/name@v1", "v1") == "hf://org/name@v1"
    with pytest.raises(ValueError, match="model 'hf://org/name@v1' names revision 'v1' and "
                                         "revision is 'v2'; give one"):
        model_source.with_revision("hf://org/name@v1", "v2")
    with pytest.raises(ValueError, match="model 's3://b/p' is an S3 prefix"):
        model_source.with_revision("s3://b/p", "v1")
    with pytest.raises(ValueError, match="model '/abs/folder' is a local path"):
        model_source.with_revision("/abs/folder", "v1")


@pytest.mark.parametrize(("tokenizer", "source", "revision", "expected"), [
    (None, "hf://org/name@v1", "v1", None),           # the model's own revision: its folder's
    (None, "hf://org/name", "main", None),
    (None, "hf://org/name@v1", "t1", "org/name"),      # another: transformers fetches it
    ("org/tok", "hf://org/name", "t1", "org/tok"),     # a Hub tokenizer: at t1 (the loader)
])
def test_tokenizer_revision_fetches_the_tokenizer_at_it(tokenizer, source, revision,
                                                        expected) -> None:
    config = SimpleNamespace(model="org/name", tokenizer=tokenizer, tokenizer_revision=revision)
    model_source._tokenizer_revision(config, source)
    assert config.tokenizer == expected


def test_tokenizer_revision_of_a_local_tokenizer_is_refused(tmp_path: Path) -> None:
    config = SimpleNamespace(model="org/name", tokenizer=str(tmp_path), tokenizer_revision="t1")
    with pytest.raises(ValueError, match=f"tokenizer {str(tmp_path)!r} is not a Hub id"):
        model_source._tokenizer_revision(config, "hf://org/name")


def test_the_tokenizer_is_loaded_with_trust_remote_code_and_its_revision(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer
    calls = []
    original = AutoTokenizer.from_pretrained

    def recorded(path, **kwargs):
        calls.append((str(path), kwargs))
        return original(path)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recorded)
    config = engine_config_from_args(_serve_args("--trust-remote-code"), model=str(tiny_llama),
                                     device="cpu")
    loader._resolve(config)
    assert calls[-1] == (str(tiny_llama), {"revision": None, "trust_remote_code": True})
    # a tokenizer of its own (a Hub id, which transformers fetches) at --tokenizer-revision
    loader._resolve(EngineConfig(model=str(tiny_llama), device="cpu", tokenizer=str(tiny_llama),
                                 tokenizer_revision="t1"))
    assert calls[-1] == (str(tiny_llama), {"revision": "t1", "trust_remote_code": False})


def test_convert_classify_takes_only_a_model_that_is_a_classifier_here() -> None:
    check_classifier(PoolerConfig(labels=("negative", "positive")))
    check_classifier(PoolerConfig(classifier_token_ids=(3, 7)))
    with pytest.raises(ValueError, match="--convert classify: this model is not a classifier "
                                         "here"):
        check_classifier(PoolerConfig())


# ---- through a server: most flags at once ----

@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(
            tiny_llama, "--max-model-len", "256", "--root-path", "/kv", "--response-role", "bot",
            "--enable-request-id-headers", "--enable-log-requests", "--max-logprobs", "3",
            "--enable-force-include-usage", "--swap-space", "4", "--num-gpu-blocks-override", "64",
            "--trust-remote-code", "--task", "generate", "--convert", "none",
            "--disable-log-stats", "--distributed-executor-backend", "mp",
            "--pipeline-parallel-size", "1", "--data-parallel-size", "1",
            "--guided-decoding-backend", "xgrammar") as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def _chat(http: httpx.Client, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0.0, **fields}
    return http.post("/v1/chat/completions", json=body)


def _sse(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_root_path_serves_the_api_with_or_without_the_prefix(http: httpx.Client) -> None:
    assert http.get("/v1/models").status_code == 200
    assert http.get("/kv/v1/models").json()["data"][0]["max_model_len"] == 256
    assert http.get("/openapi.json").json()["servers"] == [{"url": "/kv"}]


def test_the_chat_answer_takes_the_response_role(http: httpx.Client) -> None:
    r = _chat(http)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "bot"
    chunks = _sse(_chat(http, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "bot", "content": ""}
    # continuing a final message answers in that message's role
    r = _chat(http, messages=[{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "Well"}],
              add_generation_prompt=False, continue_final_message=True)
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_every_answer_carries_the_request_id(http: httpx.Client) -> None:
    r = http.get("/v1/models", headers={"X-Request-Id": "client-id-1"})
    assert r.headers["x-request-id"] == "client-id-1"
    ids = {http.get("/v1/models").headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)     # fresh ones
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 999_999},
                  headers={"X-Request-Id": "client-id-2"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "client-id-2"
    r = _chat(http, stream=True, max_tokens=2)
    assert r.status_code == 200 and r.headers["x-request-id"]


def test_a_generation_request_is_logged_without_its_text(http: httpx.Client,
                                                         server: ServerProcess) -> None:
    r = http.post("/v1/completions", json={"prompt": SECRET, "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    log = server.log(tail=100_000)
    assert (f"request {body['id']}: model {body['model']}, prompt tokens "
            f"{body['usage']['prompt_tokens']}, max_tokens 5, stream false") in log
    assert SECRET not in log and "zebra" not in log


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"prompt": "hi", "logprobs": 4}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 4}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 4}, "top_logprobs"),
])
def test_logprobs_above_max_logprobs_are_a_400_naming_the_field(http: httpx.Client, path: str,
                                                                fields: dict,
                                                                param: str) -> None:
    r = http.post(path, json={"max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"] == f"{param} must be at most 3 (the server's --max-logprobs); got 4"
    r = http.post(path, json={"max_tokens": 2, **fields, param: 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_end_with_usage_unasked(http: httpx.Client, path: str) -> None:
    body = {"max_tokens": 3, "stream": True, "temperature": 0.0, "ignore_eos": True,
            **({"prompt": "hi"} if path == "/v1/completions"
               else {"messages": [{"role": "user", "content": "hi"}]})}
    chunks = _sse(http.post(path, json=body))
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3


def test_the_accepted_only_flags_are_said_at_start(server: ServerProcess) -> None:
    log = server.log(tail=100_000)
    assert "--swap-space 4 GiB: not used; a preempted request is recomputed" in log
    assert "64 KV blocks of 16 tokens" in log       # --num-gpu-blocks-override


# ---- through a server: a Hub model at a revision, flags from a --config file ----

@pytest.fixture(scope="module")
def hub_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[ServerProcess, HubServer, Path]]:
    hub = HubServer()
    try:
        files = folder_files(tiny_llama)
        hub.tag(REPO, "v1", hub.create_repo(REPO, files))
        # main moves on: a shorter context, which /v1/models would show if main were served
        config = json.loads(files["config.json"])
        hub.push(REPO, {"config.json": json.dumps({**config,
                                                   "max_position_embeddings": 512}).encode()})
        root = tmp_path_factory.mktemp("hub-serve")
        flags = root / "vllm.yaml"
        flags.write_text("disable-fastapi-docs: true\nserved-model-name: [tiny-hub]\n"
                         f"download-dir: {root / 'downloads'}\nrevision: main\n")
        env = {**hub.env(), "HF_HUB_OFFLINE": "0", "KVFLEET_CACHE_DIR": str(root / "env-cache")}
        # the command line's --revision overrides the file's
        with running_server(REPO, "--config", str(flags), "--revision", "v1", env=env) as s:
            yield s, hub, root
    finally:
        hub.stop()


def test_revision_serves_the_files_of_that_revision_from_the_download_dir(hub_server) -> None:
    server, hub, root = hub_server
    status, body = server.get("/v1/models")
    assert status == 200, body
    (card,) = json.loads(body)["data"]
    assert (card["id"], card["root"]) == ("tiny-hub", REPO)
    assert card["max_model_len"] == 1024            # v1's config.json, not main's 512
    assert json.loads((root / "downloads/hf" / REPO / "v1/config.json").read_text())[
        "max_position_embeddings"] == 1024
    assert not (root / "env-cache").exists()        # --download-dir, not $KVFLEET_CACHE_DIR
    listed = [r.path for r in hub.requests if r.path.startswith("/api/models/")]
    assert listed and all(p.endswith("/revision/v1") for p in listed), listed


def test_disable_fastapi_docs_serves_no_docs(hub_server) -> None:
    server, _, _ = hub_server
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert server.get(path)[0] == 404, path
    assert server.get("/v1/models")[0] == 200
