"""kv_cache_dtype: an fp8 (e4m3, scale 1.0) KV cache in the engine, on the torch path (CPU).

The accuracy criterion is on log-probabilities, not on greedy tokens: tiny random models have
near-tied top logits (49152-token vocabulary, random weights), so a 1e-3 perturbation can flip an
argmax and token equality would test luck. Teacher-forced prompt logprobs (every prompt position,
both runs scoring the same tokens) and the logprobs of the generated tokens up to the first
difference stay within LOGPROB_TOLERANCE of the fp32-cache run. Measured on the five tiny archs
(16 prompts of 2..80 tokens, 12 new tokens): at most 0.014; the tolerance leaves ~3.5x margin.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvfleet_kernels.paged_attention import (
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    head_major_k,
    is_token_major,
    paged_attention_ref,
    reshape_and_cache_ref,
    token_major_v,
)
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.cli import main
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.layers.attention import (
    paged_attention_torch,
    write_kv_torch,
)
from support.attention import paged_meta
from support.tiny_models import ARCHS

LOGPROB_TOLERANCE = 0.05


# ------------------------------------------------------------------------------- config and flag
@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_accepts_auto_fp8_fp8_e4m3(value: str) -> None:
    config = EngineConfig(model="unused", device="cpu", kv_cache_dtype=value)
    expected = torch.bfloat16 if value == "auto" else torch.float8_e4m3fn
    assert config.resolve_kv_cache_dtype(torch.bfloat16) == expected


def test_bad_kv_cache_dtype_names_the_parameter_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3; "
                                         r"got 'int8'"):
        EngineConfig(model="unused", device="cpu", kv_cache_dtype="int8")


def test_kv_cache_dtype_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfleet_runtime.cli import build_parser
    from kvfleet_runtime.server.cli import engine_config_from_args
    args = build_parser().parse_args(["serve", "m.gguf", "--device", "cpu",
                                      "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m.gguf", "--device", "cpu", "--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err


# ------------------------------------------------------------------------------- KV memory sizing
def test_fp8_cache_holds_twice_the_blocks_of_bf16_and_four_times_fp32(tiny_model_dir) -> None:
    # 1 MiB of KV memory: small enough that memory, not max_num_seqs, sets the block count
    path = tiny_model_dir("llama3")
    runners = {}
    for dtype, kv in [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"),
                      ("bfloat16", "fp8")]:
        llm = LLM(model=path, dtype=dtype, kv_cache_dtype=kv, cpu_kv_cache_gb=2 ** -10)
        runners[dtype, kv] = llm.engine.runner
    fp32, bf16 = runners["float32", "auto"], runners["bfloat16", "auto"]
    assert fp32.kv_cache.dtype == torch.float32 and bf16.kv_cache.dtype == torch.bfloat16
    for dtype in ("float32", "bfloat16"):
        fp8 = runners[dtype, "fp8"]
        assert fp8.kv_cache.dtype == torch.float8_e4m3fn
        assert fp8.bytes_per_block() * 2 == bf16.bytes_per_block()
        assert fp8.num_blocks == 2 * bf16.num_blocks == 4 * fp32.num_blocks
        # the pool really is that size, in bytes
        assert fp8.kv_cache.numel() * fp8.kv_cache.element_size() == fp8.num_blocks * fp8.bytes_per_block()
    # an fp8 cache's layers hold V token-major (views of the pool), other caches V in rows
    for (dtype, kv), runner in runners.items():
        for i, layer in enumerate(runner.model.attention_layers()):
            k_cache, v_cache = layer.kv_cache
            assert k_cache.data_ptr() == runner.kv_cache[i, 0].data_ptr() and k_cache.is_contiguous()
            assert v_cache.data_ptr() == runner.kv_cache[i, 1].data_ptr()
            assert v_cache.shape == k_cache.shape
            assert is_token_major(v_cache) == (kv == "fp8"), (dtype, kv)
    assert fp32.num_blocks == (1 << 20) // fp32.bytes_per_block()


def test_k_head_major_switch_lays_an_fp8_caches_k_head_major_and_changes_no_output(
        tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    # KVFLEET_K_HEAD_MAJOR=1 (an A/B switch, off by default): each fp8 layer's K a head_major_k
    # view of the pool; a bf16 cache keeps rows. The torch path writes and reads K through the
    # view: the same logprobs, bit for bit, as K in rows.
    path = tiny_model_dir("llama3")
    prompts = _prompts(8, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, prompt_logprobs=0)
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("KVFLEET_K_HEAD_MAJOR", switch)
        llm = LLM(model=path, kv_cache_dtype="fp8", max_num_seqs=8)
        runner = llm.engine.runner
        for i, layer in enumerate(runner.model.attention_layers()):
            k_cache, _ = layer.kv_cache
            assert k_cache.data_ptr() == runner.kv_cache[i, 0].data_ptr()
            assert k_cache.shape == runner.kv_cache[i, 0].shape
            assert k_cache.is_contiguous() == (switch == "0")
            if switch == "1":
                assert k_cache.stride(2) == runner.block_size * k_cache.shape[3]
        runs[switch] = llm.generate(prompts, params)
    bf16 = LLM(model=path, dtype="bfloat16", cpu_kv_cache_gb=2 ** -10).engine.runner
    assert all(layer.kv_cache[0].is_contiguous() for layer in bf16.model.attention_layers())
    for a, b in zip(runs["0"], runs["1"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert _max_logprob_difference(runs["0"], runs["1"]) == 0.0


# ------------------------------------------------------------------------------- the torch path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_lens", "seq_lens"), [
    ([9, 9, 30], [9, 9, 30]),           # fresh prompts: attention over this step's own K/V
    ([5, 1, 12], [40, 70, 12]),         # a chunk after a cached prefix, decode, a fresh prompt
    ([1, 1, 1], [33, 70, 5]),           # decode only
], ids=["fresh", "mixed", "decode"])
@pytest.mark.parametrize("v_layout", ["token-major", "rows", "k-head-major"])
def test_torch_path_over_fp8_cache_matches_reference(dtype: torch.dtype, q_lens: list[int],
                                                      seq_lens: list[int], v_layout: str) -> None:
    gen = torch.Generator().manual_seed(len(q_lens) + sum(seq_lens))
    num_blocks, block_size, num_heads, num_kv_heads, head_dim = 24, 16, 4, 2, 32
    meta, slots = paged_meta(q_lens, seq_lens, block_size, num_blocks, gen)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 4).to(dtype)
    v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 4).to(dtype)
    k[0, 0, :3] = torch.tensor([500.0, -1000.0, 449.0])          # saturate at +-448
    # the cached context before this step: random fp8 everywhere
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 4).to(FP8_KV_DTYPE)
    v_cache = (torch.randn(shape, generator=gen) * 4).to(FP8_KV_DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    if v_layout != "rows":     # the engine's fp8 layout; the reference keeps rows
        v_cache = token_major_v(torch.empty_like(v_cache)).copy_(v_cache)
    if v_layout == "k-head-major":     # and K head-major (KVFLEET_K_HEAD_MAJOR=1)
        k_cache = head_major_k(torch.empty_like(k_cache)).copy_(k_cache)

    k_held, v_held = write_kv_torch(k, v, k_cache, v_cache, slots)
    reshape_and_cache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache.contiguous().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.contiguous().view(torch.uint8), v_ref.view(torch.uint8))
    assert k_held.dtype == dtype and k_held[0, 0, :3].tolist() == [FP8_E4M3_MAX, -FP8_E4M3_MAX,
                                                                    FP8_E4M3_MAX]
    out = paged_attention_torch(q, k_held, v_held, k_cache, v_cache, meta, head_dim ** -0.5)
    expected = paged_attention_ref(q, k_ref, v_ref, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, head_dim ** -0.5, meta.max_query_len)
    assert out.dtype == dtype
    # relative to the outputs' scale (~10 here). fp32: summation order only (measured 1e-6);
    # bf16: the torch path rounds scores and probabilities to bf16 (measured 0.017; 2.5e-2 is
    # the bf16 kernel tests' tolerance)
    atol = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2}[dtype]
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(out.float() / scale, expected.float() / scale, rtol=0.0, atol=atol)


# ------------------------------------------------------------------------------- the engine
def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 80))] for _ in range(n)]


def _max_logprob_difference(a, b) -> float:
    """Largest |logprob difference| over teacher-forced prompt tokens and over the generated
    tokens the two runs share (up to their first different token)."""
    diff = 0.0
    for ra, rb in zip(a, b, strict=True):
        for pa, pb in zip(ra.prompt_logprobs, rb.prompt_logprobs, strict=True):
            if pa is not None:
                diff = max(diff, *(abs(pa[t].logprob - pb[t].logprob) for t in pa))
        ca, cb = ra.outputs[0], rb.outputs[0]
        for ta, tb, la, lb in zip(ca.token_ids, cb.token_ids, ca.logprobs, cb.logprobs,
                                  strict=True):
            if ta != tb:
                break
            diff = max(diff, abs(la[ta].logprob - lb[tb].logprob))
    return diff


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_cache_logprobs_stay_close_to_fp32_cache(arch: str, tiny_model_dir) -> None:
    path = tiny_model_dir(arch)
    prompts = _prompts(16, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, prompt_logprobs=0)
    runs = {kv: LLM(model=path, kv_cache_dtype=kv, max_num_seqs=16).generate(prompts, params)
            for kv in ("auto", "fp8")}
    diff = _max_logprob_difference(runs["auto"], runs["fp8"])
    # > 0: the fp8 run really rounded its K/V (an fp32 cache would give identical logprobs)
    assert 0.0 < diff < LOGPROB_TOLERANCE


@pytest.mark.gpu
def test_gpu_fp8_cache_triton_matches_torch_path_and_stays_close(tiny_model_dir) -> None:
    # The Triton kernels (fused rotary + cache write included) against the torch path over the
    # same fp8 cache, then against an fp32-cache run, on a bf16 tiny model.
    path = tiny_model_dir("llama3")
    prompts = _prompts(16, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, prompt_logprobs=0)
    runs = {}
    for backend, kv in [("triton", "fp8"), ("torch", "fp8"), ("triton", "auto")]:
        llm = LLM(model=path, device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                  attention_backend=backend, max_num_seqs=16)
        assert llm.engine.runner.kv_cache.dtype == (FP8_KV_DTYPE if kv == "fp8" else torch.bfloat16)
        runs[backend, kv] = llm.generate(prompts, params)
        del llm
    # bf16 compute: the two backends round differently, as they do with a bf16 cache
    assert _max_logprob_difference(runs["triton", "fp8"], runs["torch", "fp8"]) < 0.1
    assert _max_logprob_difference(runs["triton", "fp8"], runs["triton", "auto"]) < 0.1
