"""Act-order GPTQ layers on the W4A16 kernel path (Triton's interpreter; the kernel layout
forced on the CPU): the norms hand qkv and gate_up their input already in act-order, attention
hands o_proj its own, and gate_up's output columns are put in down's order at load
(models/llama.py `order_inputs`), so no projection gathers its input. The engine's tokens and
prompt log-probs must be those of every projection gathering its own (KVFLEET_ORDER_INPUTS=0)."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.layers import backend
from kvfleet_runtime.layers.attention import Attention
from kvfleet_runtime.layers.norm import RMSNorm
from kvfleet_runtime.layers.quantization.int_weight import IntWeightMethod
from support.attention import paged_meta

from quantization.checkpoints import write_quantized
from quantization.test_tiny_llama import _prompts


@pytest.fixture
def kernel_layout(monkeypatch):
    """Int layers repacked for the W4A16 kernel as on a GPU (here run by the interpreter)."""
    def process(self, layer):
        self.finalize(layer, self.unpack(layer), use_kernel=True)
    monkeypatch.setattr(IntWeightMethod, "process_weights_after_loading", process)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(model_dir, monkeypatch, switch: str):
    monkeypatch.setenv("KVFLEET_ORDER_INPUTS", switch)
    # 16-token chunks: prompts cut over steps and mixed with decode rows
    llm = LLM(model=str(model_dir), dtype="float16", attention_backend="triton",
              max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16)
    layers = llm.engine.runner.model.model.layers
    flags = [(layer.input_layernorm.out_perm is not None,
              layer.post_attention_layernorm.out_perm is not None,
              layer.self_attn.attn.out_perm is not None,
              layer.self_attn.qkv_proj.input_permuted, layer.self_attn.o_proj.input_permuted,
              layer.mlp.gate_up_proj.input_permuted, layer.mlp.down_proj.input_permuted)
             for layer in layers]
    assert all(layer.self_attn.o_proj.perm is not None for layer in layers)    # act-order
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                prompt_logprobs=0))
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [torch.tensor([pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], p[1:],
                                                               strict=True)])
                for o, p in zip(outs, prompts, strict=True)]
    return tokens, logprobs, flags


def test_act_order_inputs_come_in_order_with_the_same_outputs(tiny_llama, tmp_path,
                                                              kernel_layout, monkeypatch):
    quantized = tmp_path / "quantized"
    write_quantized(tiny_llama, quantized, tmp_path / "dequantized", method="gptq",
                    group_size=32, desc_act=True)
    tokens, logprobs, flags = _run(quantized, monkeypatch, "1")
    # both norms and attention hand their projection its order; no projection gathers
    assert flags == [(True,) * 7] * len(flags)
    gathered_tokens, gathered_logprobs, gathered_flags = _run(quantized, monkeypatch, "0")
    assert gathered_flags == [(False,) * 7] * len(flags)
    assert tokens == gathered_tokens
    for ours, theirs in zip(logprobs, gathered_logprobs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_attention_hands_its_output_over_in_o_projs_order(path, monkeypatch):
    # a chunk after a cached prefix, decode rows, a fresh prompt: with set_output_order(perm)
    # the layer's [T, H*D] output is the plain layer's [:, perm], bit for bit, on either path
    monkeypatch.setattr(backend, "_forced", path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    q_lens, seq_lens = [5, 1, 12, 1], [40, 70, 12, 33]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    meta, _ = paged_meta(q_lens, seq_lens, block_size, num_blocks, gen)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_heads * head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, num_kv_heads * head_dim, generator=gen) for _ in range(2))
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_heads * head_dim, generator=gen)
    outs = []
    for out_perm in (None, perm):
        layer = Attention(num_heads, head_dim, num_kv_heads, head_dim ** -0.5)
        layer.kv_cache = (cache[0].clone(), cache[1].clone())
        if out_perm is not None:
            layer.set_output_order(out_perm)
            assert layer.out_index.dtype == torch.int32
            assert torch.equal(layer.out_index[perm], torch.arange(len(perm), dtype=torch.int32))
        outs.append(layer(q, k, v, meta))
    assert torch.equal(outs[1], outs[0][:, perm])


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_norm_hands_its_output_over_in_the_consumers_order(path, monkeypatch):
    # with set_output_order(perm) the norm's output is the plain norm's [:, perm], bit for bit,
    # with and without the residual add (whose sum keeps the model's order), on either path
    monkeypatch.setattr(backend, "_forced", path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(2, 5, 48, generator=gen)
    perm = torch.randperm(48, generator=gen)
    plain, ordered = RMSNorm(48, 1e-6), RMSNorm(48, 1e-6)
    for norm in (plain, ordered):
        norm.weight.copy_(1 + 0.1 * torch.randn(48, generator=torch.Generator().manual_seed(2)))
    ordered.set_output_order(perm)
    assert torch.equal(ordered(x), plain(x)[:, perm])
    (out, summed), (plain_out, plain_summed) = ordered(x, residual), plain(x, residual)
    assert torch.equal(out, plain_out[:, perm]) and torch.equal(summed, plain_summed)
