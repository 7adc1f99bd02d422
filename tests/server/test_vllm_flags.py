"""vLLM's `vllm serve` flags on `kvfleet serve`: a copied command line (a model card's, a KServe or
KubeAI manifest's, a Helm values file's) starts. Each flag does what it does in vLLM where it
means something here; where it cannot change anything, only the value that matches what kvfleet
does is accepted and any other is refused by name (exit 2) before the model loads.

Here: the engine's --revision, --tokenizer-revision and --trust-remote-code (EngineConfig
fields, so LLM(revision=..., trust_remote_code=True) too)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from kvfleet_runtime import loader, model_source
from kvfleet_runtime.cli import build_parser, main
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.server.cli import engine_config_from_args


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", "m", *flags])


def test_the_engine_flags_parse_into_the_engine_config() -> None:
    args = _serve_args("--trust-remote-code", "--revision", "v1", "--tokenizer-revision", "t1")
    config = engine_config_from_args(args, model="m", device="cpu")
    assert (config.trust_remote_code, config.revision, config.tokenizer_revision) == (
        True, "v1", "t1")
    config = engine_config_from_args(_serve_args(), model="m", device="cpu")
    assert not config.trust_remote_code and config.revision is config.tokenizer_revision is None


@pytest.mark.parametrize(("flags", "message"), [
    # x.gguf is a local path: no Hub revision to pick
    (["--revision", "v1"], "revision 'v1' is a Hub revision; model 'x.gguf' is a local path"),
    (["--tokenizer-revision", "v1"], "tokenizer_revision 'v1' is a Hub revision; the tokenizer "
                                     "is model 'x.gguf''s, which is not on the Hub"),
    (["--revision", " "], "revision must be a Hub revision (a branch, tag or commit); got ' '"),
])
def test_other_values_exit_2_naming_the_flag(flags: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["serve", "x.gguf", "--device", "cpu", *flags])
    except SystemExit as e:         # argparse's own refusals
        code = e.code
    assert code == 2 and message in capsys.readouterr().err


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
