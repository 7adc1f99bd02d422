"""`kvfleet serve` flags: every EngineConfig knob is a flag, MODEL positional or --model,
and bad values are refused by name before any model loads."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from kvfleet_runtime.cli import build_parser, main
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.server.cli import engine_config_from_args, register
from support.server import serve_exit_code


def test_every_engine_knob_is_a_flag() -> None:
    args = build_parser().parse_args([
        "serve", "--model", "m.gguf", "--block-size", "32", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--max-model-len", "1024",
        "--gpu-memory-utilization", "0.5", "--quantization", "fp8",
        "--no-enable-prefix-caching", "--dtype", "fp16", "--enforce-eager",
        "--tensor-parallel-size", "2", "--num-gpu-blocks", "100", "--device", "cpu",
        "--seed", "3"])
    config = engine_config_from_args(args)
    assert (config.model, config.block_size, config.max_num_seqs) == ("m.gguf", 32, 8)
    assert (config.max_num_batched_tokens, config.max_model_len) == (512, 1024)
    assert (config.gpu_memory_utilization, config.quantization) == (0.5, "fp8")
    assert config.enable_prefix_caching is False and config.enforce_eager is True
    assert (config.dtype, config.tensor_parallel_size, config.num_gpu_blocks) == ("fp16", 2, 100)
    assert (config.device, config.seed) == ("cpu", 3)
    subparsers = argparse.ArgumentParser().add_subparsers()
    register(subparsers)
    usage = subparsers.choices["serve"].format_help()
    for f in dataclasses.fields(EngineConfig):
        # --served-model-name is a list; model_source is set by the pull, not a flag
        if f.name not in ("served_model_name", "extra", "model_source"):
            assert "--" + f.name.replace("_", "-") in usage
    assert "--model-source" not in usage


def test_flags_spelled_with_underscores_as_vllm_takes_them() -> None:
    from kvfleet_runtime.cli import vllm_spelling
    argv = vllm_spelling(["serve", "m", "--max_model_len", "128", "--hf_overrides={\"a_b\": 1}",
                          "--runner", "pooling", "--served-model-name", "x_y"])
    assert argv == ["serve", "m", "--max-model-len", "128", "--hf-overrides={\"a_b\": 1}",
                    "--runner", "pooling", "--served-model-name", "x_y"]
    args = build_parser().parse_args(argv)
    config = engine_config_from_args(args, model="m")
    assert (config.max_model_len, config.hf_overrides, config.runner) == (128, {"a_b": 1},
                                                                          "pooling")


def test_flags_not_given_keep_engine_config_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "model-dir", "--device", "cpu"])
    assert args.model_positional == "model-dir" and args.api_key == "from-env"
    config = engine_config_from_args(args, model=args.model_positional)
    default = EngineConfig(model="model-dir", device="cpu")
    assert config == default


@pytest.mark.parametrize(("flags", "message"), [
    (["--block-size", "7"], "block_size must be one of 8, 16, 32, 64, 128; got 7"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["--max-queued-requests", "-1"], "--max-queued-requests must be >= 0; got -1"),
    (["--quantization", "int3"], "invalid choice: 'int3'"),
    (["--chat-template", "no/such/template.jinja"],
     "--chat-template: no file 'no/such/template.jinja'"),
    (["--chat-template", "{% for m in messages %}{{ m.content }}"],
     "--chat-template: not a valid Jinja template (line 1:"),
    (["--chat-template", "{% generation %}{{ messages[0].content }}"],     # no endgeneration
     "--chat-template: not a valid Jinja template (line 1:"),
    (["--allowed-origins", "https://ui.example"], "must be a JSON list of strings"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser "
                                    "(hermes or llama3_json or mistral or pythonic)"),
    (["--tool-call-parser", "granite"], "invalid choice: 'granite'"),
    (["--generation-config", "no/such/folder"],
     "--generation-config: no generation_config.json in 'no/such/folder'"),
    (["--lora-modules", "sql=adapters/sql"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "adapters/sql"],
     "argument --lora-modules: each item must be NAME=PATH or JSON"),
    (["--enable-lora", "--lora-modules", '{"name": "sql"}'],       # no path
     "argument --lora-modules: each item must be NAME=PATH or JSON"),
    (["--enable-lora", "--lora-modules", "sql=no/such/adapter"],
     "--lora-modules 'sql': LoRA adapter 'no/such/adapter': no adapter_config.json"),
])
def test_bad_values_exit_2_naming_the_flag(flags: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_exit_code(flags) == 2 and message in capsys.readouterr().err


def test_a_bad_gc_threshold_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # x.gguf does not exist: refused first, so the model is never looked at
    monkeypatch.setenv("KVFLEET_GC_THRESHOLD", "lots")
    assert main(["serve", "x.gguf", "--device", "cpu"]) == 2
    assert "KVFLEET_GC_THRESHOLD must be 'python' or three integers" in capsys.readouterr().err


@pytest.mark.parametrize("name, value, message", [
    ("KVFLEET_DECODE_MIN_PARTITION", "3", "KVFLEET_DECODE_MIN_PARTITION must be an integer >= 16"),
    ("KVFLEET_PDL", "yes", "KVFLEET_PDL must be unset, 0 or 1"),
    ("KVFLEET_DECODE_PRELOAD", "off", "KVFLEET_DECODE_PRELOAD must be unset, 0 or 1; got 'off'"),
    ("KVFLEET_TRITON_GEMV", "2", "KVFLEET_TRITON_GEMV must be unset, 0, 1 or tuned"),
    ("KVFLEET_FP8_FAST_ACCUM", "on", "KVFLEET_FP8_FAST_ACCUM must be 0 or 1; got 'on'"),
    ("KVFLEET_GEMV_SILU", "no", "KVFLEET_GEMV_SILU must be unset, 0 or 1; got 'no'"),
    ("KVFLEET_TP_EMBEDDING", "both", "KVFLEET_TP_EMBEDDING must be unset, replicated or sharded"),
    ("KVFLEET_GEMV_PUSH", "2", "KVFLEET_GEMV_PUSH must be unset, 0 or 1; got '2'"),
    ("KVFLEET_W4A16_BLOCKED", "no", "KVFLEET_W4A16_BLOCKED must be unset, 0 or 1; got 'no'"),
    ("KVFLEET_V_TOKEN_MAJOR", "rows", "KVFLEET_V_TOKEN_MAJOR must be unset, 0 or 1; got 'rows'"),
    ("KVFLEET_K_HEAD_MAJOR", "heads", "KVFLEET_K_HEAD_MAJOR must be unset, 0 or 1; got 'heads'"),
    ("KVFLEET_WARM_UP_STEPS", "no", "KVFLEET_WARM_UP_STEPS must be unset, 0 or 1; got 'no'"),
    ("KVFLEET_CUBLASLT_TUNE", "on", "KVFLEET_CUBLASLT_TUNE must be unset, 0 or 1; got 'on'"),
    ("KVFLEET_CUBLASLT_ROWS", "0", "KVFLEET_CUBLASLT_ROWS must be comma-separated row counts"),
    ("KVFLEET_DECODE_MANY_PROGRAMS", "0",
     "KVFLEET_DECODE_MANY_PROGRAMS must be an integer >= 1; got '0'"),
    ("KVFLEET_W4A16_GEMV", "tiles=3", "KVFLEET_W4A16_GEMV: expected comma-separated"),
    ("KVFLEET_W4A16_DEQUANT_M", "-1", "KVFLEET_W4A16_DEQUANT_M must be a row count (0: never)"),
    ("KVFLEET_W4A16_GEMV_MAX_M", "0", "KVFLEET_W4A16_GEMV_MAX_M must be a row count >= 1"),
    ("KVFLEET_W4A16_TILED", "per_sm=0", "KVFLEET_W4A16_TILED: expected comma-separated"),
    ("KVFLEET_TP_FUSED_NORM_MAX_BYTES", "512k",
     "KVFLEET_TP_FUSED_NORM_MAX_BYTES must be a number of bytes (an integer >= 0); got '512k'"),
    ("KVFLEET_TP_ONE_SHOT_MAX_BYTES", "-1", "KVFLEET_TP_ONE_SHOT_MAX_BYTES must be a number of")])
def test_a_bad_kernel_setting_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        name: str, value: str,
                                                        message: str) -> None:
    # read by the kernels once at import; serve parses them first (x.gguf is never looked at)
    monkeypatch.setenv(name, value)
    assert main(["serve", "x.gguf", "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err
