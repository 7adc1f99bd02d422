"""LoRA adapters under tensor parallelism (two ranks over gloo): each rank keeps its part of
every adapter (a column-parallel projection its rows of B, a row-parallel one its columns of A,
whose partial update joins the all-reduce); greedy tokens equal HF + PEFT's, adapters and the
base model mixed in one batch, through chunked prefill and preemption."""

from __future__ import annotations

import random

import pytest
from kvfleet_runtime import LLM, LoRARequest, SamplingParams
from support.engine_ops import all_blocks_free
from support.lora import hf_lora_greedy, make_lora_adapter

MAX_NEW = 10
# small token budget and KV pool: chunked prefill, mixed steps and preemption
ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=48, num_gpu_blocks=12,
                   dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["llama3-gqa", "llama3-one-kv-head", "qwen2"])
def test_two_ranks_with_adapters_equal_hf_with_peft(case, tp_model_dir, tmp_path):
    path = tp_model_dir(case)
    a = make_lora_adapter(path, tmp_path / "a", rank=8, seed=1)
    b = make_lora_adapter(path, tmp_path / "b", rank=4, seed=2,
                          targets=("k_proj", "v_proj", "o_proj", "down_proj"))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    loras = [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b)), None] * 2
    refs = {None: hf_lora_greedy(path, None, prompts, MAX_NEW)}
    for r in loras[:2]:
        refs[r.lora_path] = hf_lora_greedy(path, r.lora_path, prompts, MAX_NEW)
    llm = LLM(model=path, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                            lora_request=loras)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == [refs[None if r is None else r.lora_path][i] for i, r in enumerate(loras)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert all_blocks_free(llm.engine)
        # rank 0 holds half of a row-parallel projection's A and of a column-parallel one's B
        attn = llm.engine.runner.model.model.layers[0].self_attn
        assert attn.o_proj.lora.a.shape[1] == attn.o_proj.weight.shape[1]
        assert attn.qkv_proj.lora.b.shape[0] == attn.qkv_proj.weight.shape[0]
    finally:
        llm.engine.shutdown()
