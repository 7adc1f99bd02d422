"""LoRA adapters (kvfleet_runtime/lora): greedy outputs token-identical to HF transformers with
the same PEFT adapter (applied by PEFT itself), adapters and the base model side by side in one
batch, the max_loras limit, host-memory eviction, the prefix cache kept apart per adapter,
preemption, drafts, and every refusal named."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from kvfleet_runtime import LLM, LoRARequest, SamplingParams
from kvfleet_runtime.config import EngineConfig
from support.engine_ops import all_blocks_free
from support.lora import hf_lora_greedy, make_lora_adapter
from support.tiny_models import ARCHS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Callable (arch, name) -> a PEFT adapter folder of that arch's tiny model (cached):
    "all": rank 8 on all seven projections; "qv": rank 4 on q/v only; "rs": rank 16 on the MLP
    with rsLoRA's scaling."""
    made: dict[tuple[str, str], str] = {}
    kinds = {"all": dict(rank=8, seed=1),
             "qv": dict(rank=4, seed=2, targets=("q_proj", "v_proj"), scale=1.0),
             "rs": dict(rank=16, seed=3, targets=("gate_proj", "up_proj", "down_proj"),
                        use_rslora=True, alpha=8.0)}

    def get(model_dir: str, kind: str) -> str:
        if (model_dir, kind) not in made:
            out = tmp_path_factory.mktemp(f"lora-{kind}")
            made[(model_dir, kind)] = str(make_lora_adapter(model_dir, out, **kinds[kind]))
        return made[(model_dir, kind)]
    return get


def _prompts(n: int, seed: int, length: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(length + i % 4)] for i in range(n)]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_adapters_and_base_in_one_batch_equal_hf_with_peft(arch, tiny_model_dir, adapters):
    path = tiny_model_dir(arch)
    a, b = adapters(path, "all"), adapters(path, "qv")
    prompts = _prompts(3, seed=len(arch))
    refs = {None: hf_lora_greedy(path, None, prompts, 12), a: hf_lora_greedy(path, a, prompts, 12),
            b: hf_lora_greedy(path, b, prompts, 12)}
    # an adapter that changes nothing would pass the rest: each one moves the outputs
    assert refs[a] != refs[None] and refs[b] != refs[None] and refs[a] != refs[b]
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    order = [ra, None, rb] * 3          # one batch: each prompt under each adapter
    outs = llm.generate([p for p in prompts for _ in range(3)], GREEDY, lora_request=order)
    expect = [refs[None if r is None else r.lora_path][i // 3] for i, r in enumerate(order)]
    assert _ids(outs) == expect
    assert all_blocks_free(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_one_slot_takes_the_adapters_in_turn(async_scheduling, tiny_model_dir, adapters):
    # max_loras=1: requests of a second adapter wait until the first one's have finished (the
    # base model's run beside either); the slot is rewritten each time
    path = tiny_model_dir("llama3")
    a, b = adapters(path, "all"), adapters(path, "qv")
    prompts = _prompts(4, seed=7)
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              async_scheduling=async_scheduling)
    manager = llm.engine.runner.lora
    loads = []
    load = manager._load
    manager._load = lambda slot, adapter: (loads.append(adapter.id), load(slot, adapter))[1]
    ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    order = [ra, rb, None, ra, rb, None, rb, ra]
    outs = llm.generate([prompts[i % 4] for i in range(8)], GREEDY, lora_request=order)
    refs = {r: hf_lora_greedy(path, None if r is None else r.lora_path, prompts, 12)
            for r in (ra, rb, None)}
    assert _ids(outs) == [refs[r][i % 4] for i, r in enumerate(order)]
    # (a step with two adapters would have raised in plan_step); a, then b, once each
    assert loads == [1, 2]
    assert all_blocks_free(llm.engine)


def test_adapters_evicted_from_host_memory_are_read_again(tiny_model_dir, adapters):
    path = tiny_model_dir("qwen2")
    a, b = adapters(path, "all"), adapters(path, "rs")
    prompts = _prompts(2, seed=3)
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
              max_lora_rank=16)
    ra, rb = LoRARequest("a", 1, a), LoRARequest("rs", 2, b)
    seen = []
    for r in (ra, rb, ra, rb):
        seen.append(_ids(llm.generate(prompts, GREEDY, lora_request=r)))
        assert list(llm.engine.runner.lora.cpu) == [r.lora_int_id]
    ref_a, ref_b = hf_lora_greedy(path, a, prompts, 12), hf_lora_greedy(path, b, prompts, 12)
    assert seen == [ref_a, ref_b, ref_a, ref_b]


def test_the_prefix_cache_is_kept_apart_per_adapter(tiny_model_dir, adapters):
    # the same 40-token prompt under the base model, adapter a, a again, then b: only the
    # repeat under a hits the cache (a's blocks hold a's K/V, not the base model's)
    path = tiny_model_dir("llama")
    a, b = adapters(path, "all"), adapters(path, "qv")
    prompt = _prompts(1, seed=11, length=40)
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=16)
    runs = [(None, None), (LoRARequest("a", 1, a), a), (LoRARequest("a", 1, a), a),
            (LoRARequest("b", 2, b), b), (None, None)]
    cached = []
    for lora, folder in runs:
        out = llm.generate(prompt, GREEDY, lora_request=lora)[0]
        assert out.outputs[0].token_ids == hf_lora_greedy(path, folder, prompt, 12)[0]
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 32, 0, 32]


def test_preemption_with_adapters_loses_nothing(tiny_model_dir, adapters):
    # a cache of 10 blocks of 16 for 6 requests of ~40 tokens: requests are preempted and
    # recomputed, under their own adapters
    path = tiny_model_dir("mistral")
    a, b = adapters(path, "all"), adapters(path, "qv")
    prompts = _prompts(6, seed=5, length=20)
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks=10, block_size=16, max_num_seqs=6)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    order = [LoRARequest("a", 1, a), LoRARequest("b", 2, b), None] * 2
    outs = llm.generate(prompts, params, lora_request=order)
    assert llm.engine.scheduler.num_preemptions > 0
    for out, prompt, r in zip(outs, prompts, order, strict=True):
        ref = hf_lora_greedy(path, None if r is None else r.lora_path, [prompt], 20)[0]
        assert out.outputs[0].token_ids == ref
    assert all_blocks_free(llm.engine)


def test_drafted_steps_run_each_row_under_its_adapter(tiny_model_dir, adapters):
    # n-gram drafts on repetitive prompts: the drafted rows (one a position) carry the slot of
    # their request; greedy outputs stay HF + PEFT's
    path = tiny_model_dir("llama3")
    a = adapters(path, "all")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(6)] * 4 for _ in range(3)]
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_lora_rank=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    ra = LoRARequest("a", 1, a)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16),
                        lora_request=[ra, None, ra])
    assert llm.engine.spec_stats["spec_draft_tokens"] > 0
    for out, prompt, folder in zip(outs, prompts, [a, None, a], strict=True):
        assert out.outputs[0].token_ids == hf_lora_greedy(path, folder, [prompt], 16)[0]


def test_triton_path_in_the_interpreter_with_adapters_matches_hf(tiny_model_dir, adapters,
                                                                  monkeypatch):
    # the GPU code path (fused rotary + cache write, paged decode kernel, the adapters'
    # expand kernel over two slots and base-model rows) on a CPU
    path = tiny_model_dir("qwen3")
    a, b = adapters(path, "all"), adapters(path, "qv")
    prompts = _prompts(2, seed=9)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model=path, attention_backend="triton", enable_lora=True, max_lora_rank=8,
              max_loras=2, max_num_seqs=6, max_num_batched_tokens=32)
    try:
        ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
        outs = llm.generate(prompts * 3, SamplingParams(temperature=0.0, max_tokens=8),
                            lora_request=[ra, ra, None, None, rb, rb])
        assert _ids(outs) == (hf_lora_greedy(path, a, prompts, 8)
                              + hf_lora_greedy(path, None, prompts, 8)
                              + hf_lora_greedy(path, b, prompts, 8))
    finally:
        llm.engine.shutdown()
        from kvfleet_runtime.layers.backend import set_backend
        set_backend("auto")


def test_sampled_requests_follow_their_adapter(tiny_model_dir, adapters):
    # seeded sampling: the same seed under the adapter and under the base model gives the
    # adapter's tokens only when the adapter is applied (repeatable, and unlike the base's)
    path = tiny_model_dir("llama3")
    a = adapters(path, "all")
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=3)
    prompt = _prompts(1, seed=1)
    ra = LoRARequest("a", 1, a)
    first = _ids(llm.generate(prompt, params, lora_request=ra))
    again = _ids(llm.generate(prompt, params, lora_request=ra))
    base = _ids(llm.generate(prompt, params))
    assert first == again and first != base


def _write_adapter(folder, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_bad_adapters_and_requests_are_refused_with_the_reason(tiny_model_dir, adapters,
                                                               tmp_path):
    path = tiny_model_dir("llama3")
    good = adapters(path, "all")
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_lora_rank=4)
    engine = llm.engine
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    ok_tensors = {f"{name}.lora_A.weight": torch.zeros(4, 64),
                  f"{name}.lora_B.weight": torch.zeros(64, 4)}     # 4 heads of 16
    cases = {
        "larger than max_lora_rank (4)": good,          # rank 8
        "no adapter_config.json": str(tmp_path / "missing"),
        "DoRA adapters are not supported": _write_adapter(
            tmp_path / "dora", {"r": 4, "use_dora": True}, ok_tensors),
        "modules_to_save": _write_adapter(
            tmp_path / "save", {"r": 4, "modules_to_save": ["lm_head"]}, ok_tensors),
        "bias='all' is not supported": _write_adapter(tmp_path / "bias", {"r": 4, "bias": "all"},
                                                      ok_tensors),
        "peft_type 'PROMPT_TUNING'": _write_adapter(
            tmp_path / "pt", {"r": 4, "peft_type": "PROMPT_TUNING"}, ok_tensors),
        "no adapter_model.safetensors": _write_adapter(tmp_path / "empty", {"r": 4}, {}),
        "LoRA on embeddings is not supported": _write_adapter(
            tmp_path / "emb", {"r": 4}, {"base_model.model.model.embed_tokens.lora_embedding_A":
                                         torch.zeros(4, 49152)}),
        "LoRA on 'lm_head' is not supported": _write_adapter(
            tmp_path / "head", {"r": 4}, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                                          "base_model.model.lm_head.lora_B.weight": torch.zeros(49152, 4)}),
        "do not fit rank 4": _write_adapter(
            tmp_path / "shape", {"r": 4}, {f"{name}.lora_A.weight": torch.zeros(4, 64),
                                           f"{name}.lora_B.weight": torch.zeros(128, 4)}),
        "lora_A and lora_B must both be present": _write_adapter(
            tmp_path / "half", {"r": 4}, {f"{name}.lora_A.weight": torch.zeros(4, 64)}),
        "the model has no such module": _write_adapter(
            tmp_path / "layer9", {"r": 4}, {
                "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}),
    }
    for i, (reason, folder) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            llm.generate([5, 6, 7], GREEDY, lora_request=LoRARequest(f"bad{i}", 10 + i, folder))
    assert not engine.has_unfinished_requests() and all_blocks_free(engine)
    # an id names one adapter: the same id with another folder is refused
    fine = _write_adapter(tmp_path / "fine", {"r": 4}, ok_tensors)
    llm.generate([5, 6, 7], GREEDY, lora_request=LoRARequest("fine", 1, fine))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'fine'"):
        llm.generate([5, 6, 7], GREEDY, lora_request=LoRARequest("other", 1, good))
    # ... also once it has left host memory (max_cpu_loras 1: another adapter evicted it)
    llm.generate([5, 6, 7], GREEDY, lora_request=LoRARequest("fine2", 2, fine))
    assert list(engine.runner.lora.cpu) == [2]
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'fine'"):
        llm.generate([5, 6, 7], GREEDY, lora_request=LoRARequest("other", 1, good))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, fine)
    # an engine without enable_lora names the flag
    plain = LLM(model=path, dtype="float32")
    with pytest.raises(ValueError, match="LoRA is not enabled.*--enable-lora"):
        plain.generate([5, 6, 7], GREEDY, lora_request=LoRARequest("fine", 1, fine))
    with pytest.raises(ValueError, match="lora_request has 2 entries for 1 prompts"):
        llm.generate([5, 6, 7], GREEDY, lora_request=[None, None])


def test_engine_config_refuses_what_lora_cannot_run_with():
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineConfig(model="x", max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        EngineConfig(model="x", max_lora_rank=0)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_adapters_on_quantized_weights_equal_hf_with_peft_on_the_dequantized_weights(
        method, tiny_model_dir, adapters, tmp_path):
    # QLoRA-style serving: the base projections run from 4-bit (or FP8) weights, the adapter's
    # update is added to their output; the reference is HF + PEFT over the same weights
    # dequantized
    from quantization.checkpoints import write_quantized
    path = tiny_model_dir("llama")
    quantized, dequantized = tmp_path / "q", tmp_path / "d"
    write_quantized(Path(path), quantized, dequantized, method=method, group_size=32)
    a = adapters(path, "all")       # trained on the full-precision base, as users do
    prompts = _prompts(3, seed=13)
    llm = LLM(model=str(quantized), dtype="float32", enable_lora=True, max_lora_rank=8)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert method in type(qkv.linear_method).__name__.lower(), qkv.linear_method
    outs = llm.generate(prompts * 2, GREEDY, lora_request=[LoRARequest("a", 1, a)] * 3 + [None] * 3)
    assert _ids(outs) == (hf_lora_greedy(dequantized, a, prompts, 12)
                          + hf_lora_greedy(dequantized, None, prompts, 12))


@pytest.mark.parametrize("arch, projections", [("qwen3", 3), ("phi3", 2)])
def test_make_lora_writes_an_adapter_peft_reads_and_we_serve_alike(arch, projections,
                                                                   tiny_model_dir, tmp_path,
                                                                   capsys):
    # `kvfleet make-lora` (the benchmarks' adapters): PEFT loads the folder as its own, with
    # the same tensors, and HF + PEFT's greedy outputs are ours (Phi-3: q and v on its fused
    # qkv_proj)
    from kvfleet_runtime.cli import main
    from safetensors.torch import load_file
    path = tiny_model_dir(arch)
    out = tmp_path / "made"
    assert main(["make-lora", "--model", path, "--out", str(out), "--rank", "4", "--targets",
                 "q_proj,v_proj,down_proj", "--dtype", "float32", "--seed", "5"]) == 0
    written = load_file(str(out / "adapter_model.safetensors"))
    assert len(written) == 2 * projections * 2      # A and B, the projections, 2 layers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), out)
    state = peft_model.state_dict()
    for name, tensor in written.items():
        peft_name = name.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight")
        assert torch.equal(state[peft_name], tensor), name
    prompts = _prompts(2, seed=21)
    llm = LLM(model=path, dtype="float32", enable_lora=True, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("made", 1, str(out)))
    ref = hf_lora_greedy(path, out, prompts, 12)
    assert _ids(outs) == ref and ref != hf_lora_greedy(path, None, prompts, 12)
    capsys.readouterr()
    assert main(["make-lora", "--model", path, "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["make-lora", "--model", path, "--out", str(tmp_path / "x"), "--targets",
                 "lm_head"]) == 2
    assert "targets must be some of q_proj" in capsys.readouterr().err


def test_bench_throughput_and_latency_with_an_adapter(tiny_model_dir, tmp_path, capsys,
                                                      monkeypatch):
    from kvfleet_runtime.cli import main
    from kvfleet_runtime.lora.make import make_lora
    path = tiny_model_dir("llama")
    adapter = make_lora(path, tmp_path / "adapter", rank=4)
    seen = []
    generate = LLM.generate

    def recording(self, prompts, params=None, lora_request=None, **kwargs):
        seen.append(lora_request)
        return generate(self, prompts, params, lora_request, **kwargs)
    monkeypatch.setattr(LLM, "generate", recording)
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", path, "--num-prompts", "8", "--input-len",
                 "12", "--output-len", "4", "--lora-path", str(adapter), "--max-loras", "2",
                 "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["lora_path"] == str(adapter) and result["max_loras"] == 2
    timed = seen[-1]
    assert {r.lora_int_id for r in timed} == {1, 2} and len(timed) == 8
    assert "LoRA adapters (2 ids) on every prompt" in capsys.readouterr().out
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", path, "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--num-iters", "1", "--lora-path", str(adapter),
                 "--json", str(out)]) == 0
    (res,) = json.loads(out.read_text())
    assert res["lora_path"] == str(adapter) and res["tpot_ms"] > 0
    assert main(["bench", "throughput", "--model", path, "--lora-path", str(adapter),
                 "--backend", "hf"]) == 2
    assert "--lora-path is for --backend kvfleet alone" in capsys.readouterr().err


def test_an_adapter_of_the_real_default_model_equals_hf_with_peft_on_the_gguf(tmp_path):
    # SmolLM2-135M-Instruct (GGUF; HF transformers reads the same file) with an adapter that
    # `kvfleet make-lora` wrote for it: greedy tokens equal HF + PEFT's, and unlike the base's
    import os

    from kvfleet_runtime.config import default_model
    from kvfleet_runtime.lora.make import make_lora
    from peft import PeftModel
    from support.hf_reference import greedy_of
    from transformers import AutoModelForCausalLM
    path = default_model()
    adapter = make_lora(path, tmp_path / "smol-lora", rank=8, alpha=256.0, dtype="float32",
                        seed=3)
    llm = LLM(dtype="float32", enable_lora=True, max_lora_rank=8)
    tok = llm.get_tokenizer()
    prompts = [tok(p).input_ids for p in ("The quick brown fox", "Kubernetes is")]
    ours = _ids(llm.generate(prompts, GREEDY, lora_request=LoRARequest("smol", 1, str(adapter))))
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    base = greedy_of(hf, prompts, 12)
    ref = greedy_of(PeftModel.from_pretrained(hf, adapter), prompts, 12)
    assert ours == ref and ref != base


def test_bf16_on_a_cpu_keeps_the_slots_in_fp32(tmp_path):
    # the adapters' small matmuls run in fp32 on a CPU (oneDNN's bf16 path costs ~5x there);
    # the update joins the bf16 projection's output, and moves the outputs as in fp32 (a
    # wide-init model: bf16 rounding does not flip its greedy picks)
    from support.tiny_models import make_tiny_model
    path = str(make_tiny_model("llama3", tmp_path / "wide", initializer_range=0.2))
    a = str(make_lora_adapter(path, tmp_path / "a", rank=8, seed=1))
    prompts = _prompts(3, seed=31)
    llm = LLM(model=path, dtype="bfloat16", device="cpu", enable_lora=True, max_lora_rank=8)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.lora.a.dtype == torch.float32 and llm.engine.runner.dtype == torch.bfloat16
    ra = LoRARequest("a", 1, a)
    ours = _ids(llm.generate(prompts, GREEDY, lora_request=ra))
    ref = hf_lora_greedy(path, a, prompts, 12)
    # bf16 rounding may part the two late; the first tokens agree
    assert sum(o[:3] == r[:3] for o, r in zip(ours, ref, strict=True)) >= 2, (ours, ref)
    assert ours != _ids(llm.generate(prompts, GREEDY))
