"""Which all-reduces the fused all-reduce + RMSNorm takes over (kvfleet_kernels.all_reduce;
the kernel itself: tests/kernels/test_kernel_all_reduce.py, across GPUs:
test_fused_norm_gpu.py). Built as one rank of two without a process group: a stand-in for the
fused path records its calls, and the unfused all-reduce must not run where it serves."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime.distributed import parallel_state
from kvfleet_runtime.layers import linear as linear_module
from kvfleet_runtime.layers.linear import Linear
from kvfleet_runtime.layers.norm import RMSNorm, reduce_in_norm
from kvfleet_runtime.models.config import ModelConfig
from kvfleet_runtime.models.llama import LlamaForCausalLM

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2}


class FakeFused:
    """Stands in for communication.FusedAllReduceNorm: serves every tensor of up to max_rows."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows, self.calls = max_rows, []

    def fits(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.max_rows

    def __call__(self, x, residual, weight, eps, slot):
        self.calls.append((x.shape[0], slot))
        return (x + 1, x + residual)


@pytest.fixture
def rank0_of_2(monkeypatch):
    """Rank 0 of 2, the Triton path on (the fused one is a Triton kernel), and every unfused
    all-reduce recorded instead of run."""
    state = parallel_state.ParallelState(rank=0, size=2)
    monkeypatch.setattr(parallel_state, "_state", state)
    monkeypatch.setenv("KVFLEET_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reduced = []
    monkeypatch.setattr(linear_module, "all_reduce", lambda x: reduced.append(x.shape[0]) or x)
    return state, reduced


def test_the_decoder_pairs_each_row_parallel_projection_with_the_norm_that_reads_it(rank0_of_2):
    model = LlamaForCausalLM(ModelConfig.from_hf(TINY), torch.float32)
    layers = model.model.layers
    pairs = []
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
        pairs += [(layer.self_attn.o_proj, layer.post_attention_layernorm),
                  (layer.mlp.down_proj, nxt)]
    for site, (proj, norm) in enumerate(pairs):
        assert proj.reduced_by == [norm] and norm.reduces_input and norm.reduce_site == site
    # an even number of sites: slots alternate across forward passes too
    assert len(pairs) % 2 == 0
    assert not layers[0].input_layernorm.reduces_input      # reads the embedding's sum
    # the norms are not registered twice as submodules of the projections
    assert len(list(model.modules())) == len(set(map(id, model.modules())))


def test_without_tensor_parallelism_nothing_is_wired(monkeypatch):
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState())
    model = LlamaForCausalLM(ModelConfig.from_hf(TINY), torch.float32)
    assert not any(isinstance(m, RMSNorm) and m.reduces_input for m in model.modules())


def _pair(site: int) -> tuple[Linear, RMSNorm]:
    proj = Linear(8, 6, dtype=torch.float32, prefix="o_proj", parallel="row")
    proj.weight.data.normal_()
    norm = RMSNorm(6, 1e-6, torch.float32)
    reduce_in_norm(proj, norm, site)
    return proj, norm


def test_where_it_fits_the_projection_skips_its_all_reduce_and_the_norm_does_it(rank0_of_2):
    state, reduced = rank0_of_2
    state.fused_norm = fused = FakeFused(max_rows=4)
    proj, norm = _pair(site=3)
    x, residual = torch.randn(2, 4), torch.randn(2, 6)
    partial = proj(x)
    torch.testing.assert_close(partial, x @ proj.weight.t())    # this rank's part, unreduced
    out, summed = norm(partial, residual)
    assert reduced == [] and fused.calls == [(2, 1)]            # slot = site % 2
    torch.testing.assert_close(out, partial + 1)
    torch.testing.assert_close(summed, partial + residual)


@pytest.mark.parametrize("why", ["too-large", "fp8-norm", "no-fused-path", "torch-backend"])
def test_where_it_does_not_serve_the_projection_reduces_and_the_norm_just_normalises(
        rank0_of_2, monkeypatch, why):
    state, reduced = rank0_of_2
    fused = FakeFused(max_rows=1 if why == "too-large" else 4)
    state.fused_norm = None if why == "no-fused-path" else fused
    if why == "torch-backend":
        monkeypatch.setenv("KVFLEET_ATTENTION_BACKEND", "torch")
    proj, norm = _pair(site=0)
    norm.fp8_out = why == "fp8-norm"
    partial = proj(torch.randn(2, 4))
    assert reduced == [2]                                       # all_reduce ran
    if why != "fp8-norm":      # (an fp8 norm needs an FP8 consumer to quantize for)
        norm(partial, torch.randn(2, 6))
    assert fused.calls == []
