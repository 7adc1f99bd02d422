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
    """Stands in for communication.FusedAllReduceNorm: serves every tensor of up to max_rows;
    its slots are one fp32 buffer per rank of two, in this process (the GEMV pushes into the
    peer's for real)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows, self.calls = max_rows, []
        self.slot_bytes = 4096
        self.buffers = [torch.zeros(2 * 2 * self.slot_bytes, dtype=torch.uint8) for _ in range(2)]

    def fits_output(self, rows, cols, dtype, device) -> bool:
        return rows <= self.max_rows

    def slots(self, dtype, slot):
        from kvfleet_kernels.all_reduce import PeerSlots
        bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        return PeerSlots(bases, 0, 2, slot * 2 * self.slot_bytes, self.slot_bytes)

    def sent(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """What rank 0 pushed into rank 1's buffer on `slot`."""
        start = slot * 2 * self.slot_bytes
        return self.buffers[1][start:start + like.numel() * 4].view(torch.float32).view(like.shape)

    def __call__(self, x, residual, weight, eps, slot, pushed=False):
        self.calls.append((x.shape[0], slot, pushed))
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
    assert reduced == [] and fused.calls == [(2, 1, False)]     # slot = site % 2
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


@pytest.fixture
def batch_one_gemv_on(monkeypatch):
    """Every batch-1 projection on kvfleet_kernels.gemv (KVFLEET_TRITON_GEMV=1), as the tuned
    shapes are on an H200."""
    monkeypatch.setattr(linear_module, "_TRITON_GEMV", True)


@pytest.mark.parametrize("site", [2, 5])
def test_at_batch_one_the_gemv_sends_its_output_and_the_norm_only_waits(
        rank0_of_2, batch_one_gemv_on, site):
    state, reduced = rank0_of_2
    state.fused_norm = fused = FakeFused(max_rows=4)
    proj, norm = _pair(site=site)
    x, residual = torch.randn(1, 4), torch.randn(1, 6)
    partial = proj(x)
    torch.testing.assert_close(partial, x @ proj.weight.t())
    assert torch.equal(fused.sent(site % 2, partial), partial)     # into the peer's slot
    norm(partial, residual)
    assert reduced == [] and fused.calls == [(1, site % 2, True)]


@pytest.mark.parametrize("why", ["two-rows", "bias", "push-off", "gemv-off"])
def test_where_the_gemv_does_not_send_the_norm_does(rank0_of_2, batch_one_gemv_on,
                                                     monkeypatch, why):
    state, reduced = rank0_of_2
    state.fused_norm = fused = FakeFused(max_rows=4)
    if why == "push-off":
        monkeypatch.setattr(linear_module, "_PUSH_GEMV", False)
    if why == "gemv-off":
        monkeypatch.setattr(linear_module, "_TRITON_GEMV", False)
    proj, norm = _pair(site=1)
    if why == "bias":        # (rank 0 adds it; every rank must decide alike: none pushes)
        proj.bias = torch.nn.Parameter(torch.randn(6), requires_grad=False)
    x = torch.randn(2 if why == "two-rows" else 1, 4)
    partial = proj(x)
    assert torch.count_nonzero(fused.sent(1, partial)) == 0
    norm(partial, torch.randn_like(partial))
    assert reduced == [] and fused.calls == [(x.shape[0], 1, False)]


@pytest.mark.parametrize("tp", [False, True])
def test_the_mlp_computes_its_activation_inside_the_down_gemv_at_batch_one(
        rank0_of_2, batch_one_gemv_on, monkeypatch, tp):
    from kvfleet_runtime.layers import activation as activation_module
    from kvfleet_runtime.models.llama import DecoderMLP
    state, reduced = rank0_of_2
    if not tp:
        monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState())
    else:
        state.fused_norm = FakeFused(max_rows=4)
    mlp = DecoderMLP(ModelConfig.from_hf(TINY), torch.float32, None, "mlp")
    for p in mlp.parameters():
        p.data.normal_()
    if tp:
        _, norm = _pair(site=0)
        reduce_in_norm(mlp.down_proj, norm, 3)
    x = torch.randn(1, 16)
    expected = mlp.down_proj.forward(mlp.act_fn(mlp.gate_up_proj(x)))
    acts = []
    real = activation_module.SiluAndMul.forward
    monkeypatch.setattr(activation_module.SiluAndMul, "forward",
                        lambda self, t: acts.append(t.shape) or real(self, t))
    assert torch.equal(mlp(x), expected)
    assert acts == []                                   # no activation kernel at batch 1
    mlp(torch.randn(2, 16))
    assert acts == [(2, 64 // (2 if tp else 1))]        # above it, the activation runs
    monkeypatch.setattr(linear_module, "_GATED_GEMV", False)
    assert torch.equal(mlp(x), expected) and len(acts) == 2
