"""LoRA adapters on a GPU: the decode steps' CUDA graphs carry every slot's update (adapters and
the base model mixed in one padded batch), equal to eager steps and to HF + PEFT in fp32 (through
the expand kernel and through the torch path); and
in bf16 through the Triton GEMVs (batch 1, where the gated MLP's fusions step aside for the
adapter), next to HF + PEFT in bf16."""

from __future__ import annotations

import random

import pytest
import torch
from kvfleet_runtime import LLM, LoRARequest, SamplingParams
from support.lora import hf_lora_greedy, make_lora_adapter

pytestmark = pytest.mark.gpu


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def case(tiny_model_dir, tmp_path_factory):
    path = tiny_model_dir("llama3")
    a = make_lora_adapter(path, tmp_path_factory.mktemp("lora-a"), rank=8, seed=1)
    b = make_lora_adapter(path, tmp_path_factory.mktemp("lora-b"), rank=16, seed=2,
                          targets=("q_proj", "v_proj", "down_proj"))
    return path, str(a), str(b)


def _run(llm: LLM, prompts, loras, max_tokens=16):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kernel", [True, False], ids=["expand-kernel", "torch-masks"])
def test_graphed_steps_with_adapters_equal_eager_and_hf_with_peft(case, kernel, monkeypatch):
    # both paths: kvfleet_kernels.lora's expand (the default) and the masked torch matmuls
    # (KVFLEET_LORA_KERNEL=0)
    import kvfleet_runtime.lora.layers as lora_layers
    monkeypatch.setattr(lora_layers, "_KERNEL", kernel)
    path, a, b = case
    prompts = _prompts(12)
    ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    loras = [ra, rb, None] * 4       # 12 rows: the 16-row graph, padded
    kwargs = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                  max_num_seqs=32)
    graphed = LLM(model=path, **kwargs)
    assert graphed.engine.runner.graph_runner is not None
    got = _run(graphed, prompts, loras)
    assert graphed.engine.runner.graph_runner.graphs, "no decode step used a CUDA graph"
    eager = _run(LLM(model=path, enforce_eager=True, **kwargs), prompts, loras)
    assert got == eager
    refs = {None: hf_lora_greedy(path, None, prompts, 16), a: hf_lora_greedy(path, a, prompts, 16),
            b: hf_lora_greedy(path, b, prompts, 16)}
    assert got == [refs[None if r is None else r.lora_path][i] for i, r in enumerate(loras)]
    torch.cuda.empty_cache()


def test_bf16_batch_one_with_an_adapter_stays_next_to_hf_with_peft(case):
    # bf16 on the Triton GEMVs at batch 1: the first tokens equal HF + PEFT's in bf16 (later
    # ones may part at a near-tie of bf16 rounding), and the adapter visibly changes them
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    path, a, _ = case
    prompts = _prompts(4, seed=8)
    llm = LLM(model=path, dtype="bfloat16", enable_lora=True, max_lora_rank=16)
    ra = LoRARequest("a", 1, a)
    ours = [_run(llm, [p], [ra], 8)[0] for p in prompts]
    base = [_run(llm, [p], None, 8)[0] for p in prompts]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda(), a)
    agree = 0
    for p, mine in zip(prompts, ours, strict=True):
        ids = torch.tensor([p], device="cuda")
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=8, pad_token_id=0)[0, len(p):].tolist()
        agree += mine[:4] == ref[:4]
    assert agree >= 3, (ours, "vs HF + PEFT")
    assert ours != base


def _scored_error(llm: LLM, hf_model, prompts, lora, batched: bool) -> tuple[float, list]:
    """Our greedy tokens (6 a prompt, all prompts in one batch or each alone) with their
    logprobs, scored by `hf_model` on the same tokens: the largest |ours - HF's| logprob, and
    the tokens. HF reads the sequence we chose, so the error is the engine's, not a fork."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    loras = None if lora is None else [lora] * len(prompts)
    outs = (llm.generate(prompts, params, lora_request=loras) if batched else
            [llm.generate([p], params, lora_request=None if lora is None else [lora])[0]
             for p in prompts])
    worst, tokens = 0.0, []
    for p, out in zip(prompts, outs, strict=True):
        mine = out.outputs[0].token_ids
        tokens.append(mine)
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([p + mine], device="cuda")).logits[0]
                                    .float(), dim=-1)
        for i, (t, pos) in enumerate(zip(mine, out.outputs[0].logprobs, strict=True)):
            worst = max(worst, abs(pos[t].logprob - ref[len(p) - 1 + i, t].item()))
    return worst, tokens


@pytest.mark.parametrize("batched", [True, False], ids=["batch-4", "batch-1"])
def test_fp8_weights_take_adapters(tmp_path, batched):
    # FP8 weights: the projections with adapter slots get their input unquantized (the adapter
    # reads it; the FP8 GEMM quantizes it itself). Our greedy tokens, scored by HF + PEFT over
    # the FP8-rounded weights (fp32): the adapter adds no more logprob error than the FP8
    # activations' rounding gives the base model (scored by HF alone), and it moves the
    # logprobs far more than that (batch 1: the W8A16 GEMV; 4: the FP8 GEMM)
    from peft import PeftModel
    from quantization.checkpoints import write_quantized
    from support.tiny_models import make_tiny_model
    from transformers import AutoModelForCausalLM
    path = make_tiny_model("llama3", tmp_path / "wide", initializer_range=0.2)
    adapter = make_lora_adapter(path, tmp_path / "lora", rank=8, seed=4)
    write_quantized(path, tmp_path / "fp8", tmp_path / "rounded", method="fp8")
    llm = LLM(model=str(tmp_path / "fp8"), dtype="bfloat16", enable_lora=True, max_lora_rank=8)
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.uses_fp8 and not layer.input_layernorm.fp8_out
    assert not layer.mlp.act_fn.fp8_out and layer.self_attn.qkv_proj.lora is not None
    prompts = _prompts(4, seed=12)
    base_model = AutoModelForCausalLM.from_pretrained(tmp_path / "rounded",
                                                      dtype=torch.float32).cuda()
    base_err, base = _scored_error(llm, base_model, prompts, None, batched)
    lora_model = PeftModel.from_pretrained(base_model, str(adapter))
    ra = LoRARequest("a", 1, str(adapter))
    lora_err, ours = _scored_error(llm, lora_model, prompts, ra, batched)
    with lora_model.disable_adapter():      # how far the adapter moves the same tokens' logprobs
        moved, _ = _scored_error(llm, lora_model, prompts, ra, batched)
    print(f"fp8 + LoRA ({'batch 4' if batched else 'batch 1'}): |logprob error| with the "
          f"adapter {lora_err:.4f}, without it {base_err:.4f}; the adapter moves them {moved:.4f}")
    assert ours != base
    assert lora_err <= 2 * max(base_err, 0.02), (lora_err, base_err, moved)
    assert moved >= 5 * lora_err, (lora_err, base_err, moved)
