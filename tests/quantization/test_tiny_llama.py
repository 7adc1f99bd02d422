"""A tiny Llama quantized each way, served by kvfleet from the quantized checkpoint:
greedy output is token-identical to HF transformers on the dequantized weights (a plain fp32
checkpoint), and prompt log-probs match HF's on those weights to 1e-4 and the original fp32
model's within the quantization error."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from support.tiny_models import make_tiny_model

from quantization.checkpoints import write_quantized

MAX_NEW = 10
# name -> (write_quantized arguments, how far the rounding may move a prompt token's log-prob
# from the fp32 model's; measured on this tiny model: 4-bit <= 0.06, 8-bit and fp8 <= 0.01)
CASES = {
    "gptq-g32-desc_act-asym": ({"method": "gptq", "group_size": 32, "desc_act": True}, 0.1),
    "gptq-g64-sym": ({"method": "gptq", "group_size": 64, "sym": True}, 0.1),
    "gptq-8bit-g-1": ({"method": "gptq", "bits": 8, "group_size": -1, "desc_act": True}, 0.02),
    "awq-g32": ({"method": "awq", "group_size": 32,
                 "not_convert": ("model.layers.1.mlp.down_proj",)}, 0.1),
    "fp8-per-tensor": ({"method": "fp8", "per_channel": False}, 0.02),
    # Qwen3-*-FP8's format: a scale a [128, 128] block (here [16, 32] of the tiny shapes)
    "fp8-blocks-16x32": ({"method": "fp8", "block": (16, 32)}, 0.02),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 19, 33)]


def hf_reference(model_dir: Path, prompts: list[list[int]], prepare=None):
    """HF's greedy continuations, and its log-prob of each prompt token after the first;
    prepare(model), if given, is called on the loaded model first (hooks)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if prepare is not None:
        prepare(model)
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, pad_token_id=0)
            tokens.append(gen[0, len(prompt):].tolist())
            lp = model(ids).logits[0, :-1].float().log_softmax(-1)
            logprobs.append(lp.gather(1, ids[0, 1:, None])[:, 0])
    return tokens, logprobs


def kvfleet_run(model_dir: Path, prompts: list[list[int]], **engine_args):
    llm = LLM(model=str(model_dir), **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                            prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [torch.tensor([pos[tok].logprob for pos, tok in zip(o.prompt_logprobs[1:], p[1:], strict=True)])
                for o, p in zip(outs, prompts, strict=True)]
    return tokens, logprobs


def _assert_matches_hf(quantized: Path, dequantized: Path, **engine_args) -> list:
    """Our greedy tokens and logprobs of the quantized checkpoint equal HF's on its
    dequantized weights (fp32); returns our logprobs."""
    prompts = _prompts()
    tokens, logprobs = kvfleet_run(quantized, prompts, **engine_args)
    ref_tokens, ref_logprobs = hf_reference(dequantized, prompts)
    assert tokens == ref_tokens
    for our_lp, ref_lp in zip(logprobs, ref_logprobs, strict=True):
        torch.testing.assert_close(our_lp, ref_lp, rtol=0, atol=1e-4)
    return logprobs


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_tiny_llama_matches_hf_on_dequantized_weights(case, tiny_llama, fp32_reference,
                                                                tmp_path):
    args, tolerance = CASES[case]
    quantized, dequantized = tmp_path / "quantized", tmp_path / "dequantized"
    write_quantized(tiny_llama, quantized, dequantized, **args)
    logprobs = _assert_matches_hf(quantized, dequantized)
    for our_lp, fp32_lp in zip(logprobs, fp32_reference, strict=True):
        # quantization moved the model, but only so far (and it did move it)
        drift = (our_lp - fp32_lp).abs().max().item()
        assert 0 < drift < tolerance, drift


def test_fp8_quantized_on_load_matches_hf_on_its_rounding(tiny_llama, tmp_path):
    # --quantization fp8 on the fp32 checkpoint: the engine rounds per output channel on load
    dequantized = tmp_path / "dequantized"
    write_quantized(tiny_llama, tmp_path / "fp8", dequantized, method="fp8", per_channel=True)
    _assert_matches_hf(tiny_llama, dequantized, quantization="fp8")


def test_requesting_another_method_than_the_checkpoints_fails(tiny_llama, tmp_path):
    write_quantized(tiny_llama, tmp_path / "q", tmp_path / "d", method="awq", group_size=32)
    with pytest.raises(ValueError, match="'gptq' was requested but the checkpoint is quantized "
                                         "with 'awq'"):
        LLM(model=str(tmp_path / "q"), quantization="gptq")


def test_gptq_qwen2_with_qkv_bias_and_tied_embeddings_matches_hf(tmp_path):
    # the bias rides beside the quantized qkv_proj; tied embeddings keep lm_head unquantized
    source = make_tiny_model("qwen2", tmp_path / "qwen2")
    quantized, dequantized = tmp_path / "quantized", tmp_path / "dequantized"
    write_quantized(source, quantized, dequantized, method="gptq", group_size=32, desc_act=True)
    _assert_matches_hf(quantized, dequantized)


@pytest.mark.parametrize("args", [dict(method="gptq", group_size=32, desc_act=True),
                                  dict(method="awq", group_size=32), dict(method="fp8"),
                                  dict(method="fp8", per_channel=False)],
                         ids=["gptq", "awq", "fp8", "fp8-per-tensor"])
def test_phi3_fused_quantized_projections_match_hf(args, tmp_path):
    # Phi-3 stores qkv_proj and gate_up_proj fused: each quantized tensor (packed along the
    # output for AWQ's qweight and both formats' qzeros) is split into the pieces on load
    source = make_tiny_model("phi3", tmp_path / "phi3")
    quantized, dequantized = tmp_path / "quantized", tmp_path / "dequantized"
    write_quantized(source, quantized, dequantized, **args)
    _assert_matches_hf(quantized, dequantized)
