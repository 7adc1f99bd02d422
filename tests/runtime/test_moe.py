"""Mixtures of experts (Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert): greedy tokens equal
HF's on tiny random models, on the torch path and on the Triton kernels (in the interpreter),
batched, chunked and from the prefix cache, FP8 on load, with LoRA adapters; what is not
supported yet is refused with a clear error."""

from __future__ import annotations

import json
import random

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.layers.moe import SparseMoeBlock
from support.hf_reference import hf_greedy
from support.tiny_models import MOE_ARCHS, make_tiny_model


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(34)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 49152) for _ in range(rng.randrange(2, 40))]
            for i in range(n)]


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_case(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    prompts = _prompts(10, seed=len(request.param))
    return request.param, path, prompts, hf_greedy(path, prompts, 12)


def test_moe_models_match_hf_batched_chunked_and_cached(moe_case):
    arch, path, prompts, ref = moe_case
    llm = LLM(model=str(path), max_num_seqs=16)
    layers = llm.engine.runner.model.model.layers
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in layers]
    assert sparse == ([True, False] if arch == "qwen3_moe" else [True, True])
    assert _greedy(llm, prompts) == ref
    hits = llm.engine.kv.prefix_cache_hits
    assert _greedy(llm, prompts) == ref and llm.engine.kv.prefix_cache_hits > hits
    chunked = LLM(model=str(path), max_num_seqs=3, max_num_batched_tokens=16)
    assert _greedy(chunked, prompts) == ref


def test_moe_models_match_hf_on_the_triton_kernels(moe_case, monkeypatch):
    arch, path, prompts, ref = moe_case
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls, gemv_calls, route_calls = [], [], []
    from kvfleet_kernels import moe
    real, real_gemv, real_route = moe.fused_moe, moe._fused_moe_gemv, moe.moe_route
    monkeypatch.setattr(moe, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(moe, "_fused_moe_gemv",
                        lambda *a, **k: gemv_calls.append(1) or real_gemv(*a, **k))
    monkeypatch.setattr(moe, "moe_route", lambda *a, **k: route_calls.append(1) or
                        real_route(*a, **k))
    llm = LLM(model=str(path), attention_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=24)
    try:
        assert _greedy(llm, prompts[:5]) == ref[:5]
        # the router kernel, the grouped GEMM (prefill chunks) and the GEMV kernels (decode
        # steps of at most 4 tokens off the GPU: use_gemv) ran the experts
        assert route_calls and gemv_calls and len(calls) > len(gemv_calls)
    finally:
        llm.engine.shutdown()
        from kvfleet_runtime.layers.backend import set_backend
        set_backend("auto")


def test_the_router_and_experts_matter(moe_case):
    # the same model with its routers zeroed (every expert weighted alike) answers otherwise:
    # the routing and the expert weights are read, not skipped
    arch, path, prompts, ref = moe_case
    llm = LLM(model=str(path), max_num_seqs=16)
    for layer in llm.engine.runner.model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.gate.weight.data.zero_()
    assert _greedy(llm, prompts) != ref


def test_a_missing_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    path = make_tiny_model("mixtral", tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e\.g\. model\.layers\.1\.mlp\.w13"):
        LLM(model=str(path), num_gpu_blocks=16)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fp8_on_load_matches_hf_over_the_rounded_weights(arch, tmp_path, monkeypatch):
    # --quantization fp8: every projection and every expert rounded to e4m3 a row at a time
    # (the router, embeddings and lm_head not); HF with the same rounding is the reference.
    # (A CPU serves the rounded weights dequantized; the GPU keeps them e4m3: test_gpu_engine)
    from kvfleet_kernels.fp8 import quantize_fp8_rowwise
    from support.hf_reference import greedy_of
    from transformers import AutoModelForCausalLM
    path = make_tiny_model(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = _prompts(4, seed=12)
    plain = greedy_of(hf, prompts, 12)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if (p.dim() < 2 or "embed" in name or "lm_head" in name
                    or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))):
                continue      # (the routers and the shared expert's gate stay unquantized)
            q, scale = quantize_fp8_rowwise(p.reshape(-1, p.shape[-1]))
            p.copy_((q.float() * scale).reshape(p.shape))
    ref = greedy_of(hf, prompts, 12)
    assert ref != plain                       # the rounding moves these outputs
    llm = LLM(model=str(path), dtype="float32", quantization="fp8")
    assert _greedy(llm, prompts) == ref
    # the grouped GEMM reads e4m3 experts (in the interpreter, as a GPU would)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvfleet_kernels import fp8 as fp8_kernels
    from kvfleet_runtime.layers import moe as moe_layer
    monkeypatch.setattr(fp8_kernels, "fp8_supported", lambda device: True)
    block = moe_layer.SparseMoeBlock(64, 32, 4, 2, True, False, torch.float32, fp8=True)
    torch.nn.init.normal_(block.w13, std=0.1)
    torch.nn.init.normal_(block.w2, std=0.1)
    torch.nn.init.normal_(block.gate.weight, std=0.5)
    dense = (block.w13.detach().clone(), block.w2.detach().clone())
    block.process_weights_after_loading()
    assert block.w13.dtype == torch.float8_e4m3fn and block.w2_scale.shape == (4, 64)
    x = torch.randn(9, 64)
    from kvfleet_runtime.layers import backend
    monkeypatch.setattr(backend, "_forced", "triton")
    out = block(x)
    weights, ids = block.route(x)
    from kvfleet_kernels.moe import fused_moe_ref
    expected = fused_moe_ref(x, block.w13, block.w2, weights, ids, block.w13_scale,
                             block.w2_scale)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
    assert (fused_moe_ref(x, *dense, weights, ids) - expected).abs().max() < 0.05 * \
        expected.abs().max()                   # rounding, not another function


def _ramped(source):
    """source's weights scaled to grow along rows and columns: every row's (and block's) scale
    its own, so a scale grid read transposed, or scales mapped to the wrong rows, shows."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(source / "model.safetensors")
    for name, w in tensors.items():
        if w.dim() == 2 and "embed" not in name and "lm_head" not in name:
            rows = torch.linspace(0.2, 3.0, w.shape[0])[:, None]
            cols = torch.linspace(1.0, 0.1, w.shape[1])[None, :]
            tensors[name] = w * rows * cols
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    return source


def test_block_scaled_fp8_checkpoint_matches_hf_on_its_dequantized_weights(tmp_path):
    # Qwen3-30B-A3B-FP8's format: every projection and expert e4m3 with a scale a block
    # ([16, 16] at the tiny shapes), the routers unquantized
    from quantization.checkpoints import write_quantized
    source = _ramped(make_tiny_model("qwen3_moe", tmp_path / "source"))
    quantized, dequantized = tmp_path / "fp8", tmp_path / "dequantized"
    write_quantized(source, quantized, dequantized, method="fp8", block=(16, 16))
    from safetensors import safe_open
    with safe_open(quantized / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.5.down_proj.weight_scale_inv") \
            .get_shape() == [4, 3]
    prompts = _prompts(4, seed=13)
    ref = hf_greedy(dequantized, prompts, 12)
    assert ref != hf_greedy(source, prompts, 12)        # the rounding moves these outputs
    assert _greedy(LLM(model=str(quantized)), prompts) == ref


@pytest.mark.parametrize(("arch", "method", "bits", "group_size"), [
    ("mixtral", "awq", 4, 8), ("qwen3_moe", "gptq", 4, 8), ("qwen2_moe", "gptq", 8, -1)])
def test_gptq_and_awq_experts_match_hf_on_their_dequantized_weights(arch, method, bits,
                                                                   group_size, tmp_path,
                                                                   monkeypatch):
    # every projection quantized (experts, attention, Qwen2-MoE's shared expert), groups of 8
    # inputs or one a row, zero points not at the midpoint; the routers unquantized, as the
    # tools leave them
    from quantization.checkpoints import write_quantized
    source = make_tiny_model(arch, tmp_path / "source")
    quantized, dequantized = tmp_path / method, tmp_path / "dequantized"
    write_quantized(source, quantized, dequantized, method=method, bits=bits,
                    group_size=group_size)
    prompts = _prompts(4, seed=17)
    ref = hf_greedy(dequantized, prompts, 12)
    if bits == 4:       # the rounding moves these outputs (8 bits' does not, here)
        assert ref != hf_greedy(source, prompts, 12)
    llm = LLM(model=str(quantized))
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    w13, _ = block.int_experts                                                 # kept packed
    assert block.w13 is None and (w13.bits, w13.group_size) == (bits, 8 if bits == 4 else 64)
    assert _greedy(llm, prompts) == ref
    # the kernels (in the interpreter): the grouped GEMM over prefill chunks, the GEMV decode
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model=str(quantized), attention_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=24)
    try:
        assert _greedy(llm, prompts[:2]) == ref[:2]
    finally:
        llm.engine.shutdown()
        from kvfleet_runtime.layers.backend import set_backend
        set_backend("auto")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_act_order_experts_stay_packed_and_match_hf(arch, tmp_path, monkeypatch):
    # GPTQ desc_act: each expert's g_idx a shuffle of its own; the experts stay packed, their
    # inputs sorted by group, the permutations kept (the kernels gather through them).
    # Qwen3-MoE's down_proj loads before its gate_proj / up_proj, Mixtral's w1 (gate) before
    # its w2 (down): gate waits for down's order
    from quantization.checkpoints import write_quantized
    from safetensors.torch import load_file, save_file
    source = make_tiny_model(arch, tmp_path / "source")
    # inputs of growing size: each group's scale its own (a g_idx ignored shows)
    tensors = load_file(source / "model.safetensors")
    for name, w in tensors.items():
        if ".experts." in name:
            tensors[name] = w * torch.linspace(0.1, 3.0, w.shape[1])[None, :]
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    write_quantized(source, tmp_path / "g", tmp_path / "d", method="gptq", group_size=8,
                    desc_act=True)
    prompts = _prompts(3, seed=19)
    ref = hf_greedy(tmp_path / "d", prompts, 12)
    assert ref != hf_greedy(source, prompts, 12)
    llm = LLM(model=str(tmp_path / "g"), num_gpu_blocks=16)
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    # gate / up gather their input through perm; their rows are in down's sorted order
    w13, w2 = block.int_experts
    assert block.w13 is None and w13.perm is not None and w2.perm is None
    assert not torch.equal(w13.perm[0], torch.arange(w13.shape[2], dtype=torch.int32))
    assert _greedy(llm, prompts) == ref
    # the kernels (in the interpreter): the grouped GEMM over prefill chunks, the GEMV decode
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model=str(tmp_path / "g"), attention_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=24, num_gpu_blocks=16)
    try:
        assert _greedy(llm, prompts[:2]) == ref[:2]
    finally:
        llm.engine.shutdown()
        from kvfleet_runtime.layers.backend import set_backend
        set_backend("auto")
    if arch != "qwen3_moe":
        return
    # a shuffled g_idx without desc_act is refused, as on the dense layers
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (tmp_path / "g" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="shuffled g_idx .* needs desc_act true"):
        LLM(model=str(tmp_path / "g"), num_gpu_blocks=16)


def hf_greedy_experts_rounded(path, prompts, max_tokens: int) -> list[list[int]]:
    """HF's greedy tokens on `path` with every expert's weight rounded to e4m3 a row at a
    time, as the engine rounds FP8 checkpoints' experts once they are dequantized."""
    from kvfleet_kernels.fp8 import quantize_fp8_rowwise
    from support.hf_reference import greedy_of
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        rounded = 0
        for name, p in hf.named_parameters():
            if ".experts." in name and p.dim() >= 2:
                q, scale = quantize_fp8_rowwise(p.reshape(-1, p.shape[-1]))
                p.copy_((q.float() * scale).reshape(p.shape))
                rounded += 1
        assert rounded
    return greedy_of(hf, prompts, max_tokens)


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_per_channel_and_per_tensor_fp8_experts_match_hf_over_their_rounding(per_channel,
                                                                            tmp_path):
    # an FP8 checkpoint's experts with a scale a row or one a tensor: dequantized as they load,
    # then rounded a row at a time (the attention's FP8 layers keep the checkpoint's values)
    from quantization.checkpoints import write_quantized
    source = _ramped(make_tiny_model("qwen3_moe", tmp_path / "source"))
    write_quantized(source, tmp_path / "f", tmp_path / "d", method="fp8", per_channel=per_channel)
    prompts = _prompts(4, seed=23)
    ref = hf_greedy_experts_rounded(tmp_path / "d", prompts, 12)
    assert ref != hf_greedy(source, prompts, 12)        # the rounding moves these outputs
    llm = LLM(model=str(tmp_path / "f"), num_gpu_blocks=16)
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    assert block.fp8
    assert _greedy(llm, prompts) == ref


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_lora_on_attention_and_dense_layers_equals_hf_with_it_merged(arch, tmp_path, capsys):
    # make-lora's default targets on a mixture of experts: every attention projection, the
    # MLP's only where a layer is dense (Qwen3-MoE's mlp_only_layers; none in Mixtral); the
    # experts take none. The reference: HF with each A/B pair merged into its weight by hand
    # (PEFT rewrites a MoE model's gate/up/down targets for its fused experts, dense layers'
    # patterns included, so it is no reference here)
    import json

    from kvfleet_runtime.cli import main
    from kvfleet_runtime.lora import LoRARequest
    from safetensors.torch import load_file
    from support.hf_reference import greedy_of
    from transformers import AutoModelForCausalLM
    path = make_tiny_model(arch, tmp_path / arch)
    out = tmp_path / "lora"
    assert main(["make-lora", "--model", str(path), "--out", str(out), "--rank", "4",
                 "--dtype", "float32"]) == 0
    tensors = load_file(str(out / "adapter_model.safetensors"))
    mlp = {n.split(".layers.")[1].split(".")[0] for n in tensors if ".mlp." in n}
    assert mlp == ({"1"} if arch == "qwen3_moe" else set())
    config = json.loads((out / "adapter_config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = _prompts(3, seed=9)
    base = greedy_of(hf, prompts, 12)
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for name, a in tensors.items():
            if name.endswith("lora_A.weight"):
                module = modules[name.removeprefix("base_model.model.").removesuffix(
                    ".lora_A.weight")]
                b = tensors[name.replace("lora_A", "lora_B")]
                module.weight += (b @ a) * (config["lora_alpha"] / config["r"])
    ref = greedy_of(hf, prompts, 12)
    assert ref != base
    llm = LLM(model=str(path), dtype="float32", enable_lora=True, max_lora_rank=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False,
                        lora_request=LoRARequest("made", 1, str(out)))
    assert [o.outputs[0].token_ids for o in outs] == ref
    capsys.readouterr()
    assert main(["make-lora", "--model", str(path), "--out", str(tmp_path / "x"), "--targets",
                 "down_proj"]) == (0 if arch == "qwen3_moe" else 2)
