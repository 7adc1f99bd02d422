"""Quantized weights (GPTQ, AWQ, FP8) under tensor parallelism.

Without processes: each rank's shard of a quantized column- or row-parallel Linear,
dequantized on load, put back together is the whole dequantized weight, bit for bit; the
W4A16 kernel (Triton interpreter) serves row shards; what cannot be split is refused with
the layer, the sizes and the group size named. With two gloo ranks: a tiny Llama quantized
each way gives the same greedy tokens as one rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_sharding
import torch
from kvfleet_runtime import LLM
from kvfleet_runtime.layers.linear import Linear
from kvfleet_runtime.layers.quantization import AWQConfig, FP8Config, GPTQConfig
from kvfleet_runtime.layers.quantization.awq import pack_awq
from kvfleet_runtime.layers.quantization.gptq import pack_gptq
from quantization.checkpoints import quantize_fp8, quantize_int, write_quantized
from quantization.ct_checkpoints import (
    FP8_STATIC_ACTS,
    FP8_WEIGHTS,
    INT8_DYNAMIC_ACTS,
    INT8_WEIGHTS,
    W4A16,
    W4A16_ASYM,
    fp4_preset,
    write_compressed,
)
from test_tensor_parallel import ENGINE_ARGS, _greedy, _live_workers, _prompts

as_rank = test_sharding.as_rank      # the fixture: layers built next are rank r's shard of n

TP = 2
K = 128
QKV, DOWN = "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"

# name -> (config, recipe of the checkpoint: ("gptq"|"awq", bits, group_size, act_order),
# ("fp8", per_channel), or ("fp32",): unquantized, rounded to fp8 on load)
METHODS = {
    "gptq-g32": (GPTQConfig(bits=4, group_size=32), ("gptq", 4, 32, False)),
    "gptq-g32-desc_act": (GPTQConfig(bits=4, group_size=32, desc_act=True),
                          ("gptq", 4, 32, True)),
    "gptq-8bit-g-1-desc_act": (GPTQConfig(bits=8, group_size=-1, desc_act=True),
                               ("gptq", 8, -1, True)),
    "awq-g32": (AWQConfig(group_size=32), ("awq", 4, 32, False)),
    "fp8-per-channel": (FP8Config(serialized=True), ("fp8", True)),
    "fp8-per-tensor": (FP8Config(serialized=True), ("fp8", False)),
    "fp8-on-load": (FP8Config(serialized=False), ("fp32",)),
}


def weights(seed: int, *sizes: int, k: int = K) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, k, generator=g) * 0.05 for n in sizes]


def checkpoint(recipe: tuple, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Checkpoint tensors of w [N, K] as `recipe` writes them, and the weight one rank
    dequantizes them to. Every call shares one act-order seed: the pieces of a fused layer
    read one input."""
    kind = recipe[0]
    if kind == "fp32":
        w8, scale = quantize_fp8(w, per_channel=True)
        return {"weight": w}, w8.float() * scale[:, None]
    if kind == "fp8":
        per_channel = recipe[1]
        w8, scale = quantize_fp8(w, per_channel)
        return ({"weight": w8, "weight_scale": scale},
                w8.float() * (scale[:, None] if per_channel else scale))
    _, bits, group_size, act_order = recipe
    iq = quantize_int(w, bits, group_size, sym=False, act_order=act_order,
                      min_zero=int(kind == "gptq"), seed=5)
    packed = (pack_gptq(iq.q, iq.zeros, iq.scales, iq.g_idx, bits) if kind == "gptq"
              else pack_awq(iq.q, iq.zeros, iq.scales))
    return packed, iq.dequantize()


def rank_layer(as_rank, rank: int, config, input_size: int, sizes: int | list[int],
               parallel: str, pieces: list[dict[str, torch.Tensor]], prefix: str,
               replicas: list[int] | None = None, dtype: torch.dtype = torch.float32) -> Linear:
    """Rank `rank`'s Linear with the checkpoint pieces loaded (fused: in reverse order)."""
    as_rank(rank, TP)
    layer = Linear(input_size, sizes, dtype=dtype, linear_method=config.get_linear_method(prefix),
                   prefix=prefix, parallel=parallel, output_replicas=replicas)
    fused = isinstance(sizes, list)
    for shard_id in reversed(range(len(pieces))):
        for name, tensor in pieces[shard_id].items():
            layer.weight_loader(getattr(layer, name), tensor, shard_id if fused else None)
    return layer


@pytest.mark.parametrize("replicated", [False, True], ids=["kv-split", "kv-replicated"])
@pytest.mark.parametrize("name", list(METHODS))
def test_column_shards_put_together_are_the_whole_dequantized_weight(name, replicated, as_rank):
    config, recipe = METHODS[name]
    # q, k, v; replicated: one KV head of 16 shared by both ranks
    sizes, replicas = ([64, 16, 16], [1, 2, 2]) if replicated else ([64, 32, 32], [1, 1, 1])
    made = [checkpoint(recipe, w) for w in weights(1, *sizes)]
    parts: list[list[torch.Tensor]] = [[] for _ in sizes]
    for rank in range(TP):
        layer = rank_layer(as_rank, rank, config, K, sizes, "column", [t for t, _ in made],
                           QKV, replicas)
        layer.linear_method.process_weights_after_loading(layer)
        for i, part in enumerate(layer.weight.split(layer.output_sizes)):
            parts[i].append(part)
    for (_, whole), shared_by, ranks in zip(made, replicas, parts, strict=True):
        expected = [whole] * TP if shared_by == TP else list(whole.chunk(TP))
        for got, want in zip(ranks, expected, strict=True):
            assert torch.equal(got, want)


def _groups_per_rank(recipe: tuple, input_size: int) -> int | None:
    """Rows of scales a row shard holds: its own groups, or all of them under act-order."""
    if recipe[0] not in ("gptq", "awq"):
        return None
    _, _, group_size, act_order = recipe
    if group_size == -1:
        return 1
    return input_size // group_size // (1 if act_order else TP)


@pytest.mark.parametrize("name", list(METHODS))
def test_row_shards_put_together_are_the_whole_dequantized_weight(name, as_rank):
    config, recipe = METHODS[name]
    (w,) = weights(2, 64)
    tensors, whole = checkpoint(recipe, w)
    parts = []
    for rank in range(TP):
        layer = rank_layer(as_rank, rank, config, K, 64, "row", [tensors], DOWN)
        groups = _groups_per_rank(recipe, K)
        if groups is not None:
            assert layer.scales.shape == (groups, 64)
        if hasattr(layer, "g_idx"):      # GPTQ: numbered like the rank's rows of scales
            assert 0 <= int(layer.g_idx.min()) and int(layer.g_idx.max()) < groups
        layer.linear_method.process_weights_after_loading(layer)
        assert layer.weight.shape == (64, K // TP)
        parts.append(layer.weight)
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_act_order_rows_need_not_fall_on_group_boundaries(as_rank):
    # 96 inputs, 48 per rank, groups of 32: plain grouping is refused (next test), act-order
    # keeps all 3 groups on each rank and indexes them by the checkpoint's g_idx
    config, recipe = METHODS["gptq-g32-desc_act"]
    (w,) = weights(3, 64, k=96)
    tensors, whole = checkpoint(recipe, w)
    parts = []
    for rank in range(TP):
        layer = rank_layer(as_rank, rank, config, 96, 64, "row", [tensors], DOWN)
        assert layer.scales.shape == (3, 64)
        assert torch.equal(layer.g_idx, tensors["g_idx"][48 * rank:48 * (rank + 1)])
        layer.linear_method.process_weights_after_loading(layer)
        parts.append(layer.weight)
    assert torch.equal(torch.cat(parts, dim=1), whole)


@pytest.mark.parametrize("name", ["gptq-g32", "awq-g32"])
def test_row_split_that_cuts_a_group_names_the_layer_sizes_and_group_size(name, as_rank):
    config, _ = METHODS[name]
    as_rank(1, TP)
    with pytest.raises(ValueError, match=rf"{name.split('-')[0]}: {DOWN} has input size 96, split over "
                                         r"tensor_parallel_size 2 into 48 rows per rank, which "
                                         r"must be a multiple of group_size 32"):
        Linear(96, 64, linear_method=config.get_linear_method(DOWN), prefix=DOWN, parallel="row")


def test_shuffled_g_idx_without_desc_act_is_refused_on_a_row_shard(as_rank):
    (w,) = weights(4, 64)
    tensors, _ = checkpoint(METHODS["gptq-g32-desc_act"][1], w)
    as_rank(0, TP)
    layer = Linear(K, 64, linear_method=GPTQConfig(bits=4, group_size=32).get_linear_method(DOWN),
                   prefix=DOWN, parallel="row")
    with pytest.raises(ValueError, match=rf"{DOWN}: g_idx of this rank's input rows names groups "
                                         r"0\.\.3, outside its groups 0\.\.1; a shuffled "
                                         r"\(act-order\) g_idx needs act-order in the quantization_config "
                                         r"\(GPTQ.s desc_act true"):
        layer.weight_loader(layer.g_idx, tensors["g_idx"])


def test_per_rank_output_piece_that_cannot_be_packed_is_named(as_rank):
    as_rank(0, TP)
    with pytest.raises(ValueError, match=rf"gptq: {QKV} has output size 4 per rank "
                                         r"\(tensor_parallel_size 2\), which must be a multiple "
                                         r"of 8 to be packed"):
        Linear(K, [64, 8, 8], linear_method=METHODS["gptq-g32"][0].get_linear_method(QKV),
               prefix=QKV, parallel="column")


def row_shards_product(as_rank, name: str, x: torch.Tensor, n: int,
                       prepare) -> tuple[torch.Tensor, torch.Tensor, list[Linear]]:
    """(sum of each row shard's output for x [M, K], x @ the whole dequantized weight, the
    shards), the shards built on x's device in x's dtype and made ready by `prepare`."""
    config, recipe = METHODS[name]
    k = x.shape[1]
    (w,) = weights(5, n, k=k)
    tensors, whole = checkpoint(recipe, w)
    out, layers = torch.zeros(x.shape[0], n, device=x.device), []
    for rank in range(TP):
        with torch.device(x.device):
            layer = rank_layer(as_rank, rank, config, k, n, "row", [tensors], DOWN, dtype=x.dtype)
        prepare(layer)
        rows = slice(rank * k // TP, (rank + 1) * k // TP)
        out += layer.linear_method.apply(layer, x[:, rows], None).float()
        layers.append(layer)
    return out, x.float() @ whole.to(x.device).t(), layers


def _kernel_layout(layer: Linear) -> None:
    method = layer.linear_method
    method.finalize(layer, method.unpack(layer), use_kernel=True)


@pytest.mark.parametrize("name", ["gptq-g32", "awq-g32", "gptq-g32-desc_act"])
def test_row_shards_on_the_w4a16_kernel_sum_to_the_full_product(name, as_rank):
    out, expected, layers = row_shards_product(as_rank, name, torch.randn(3, K).half(), 64,
                                               _kernel_layout)
    # an act-order shard's groups have unequal row counts: dequantized instead
    assert [layer.uses_kernel for layer in layers] == [not METHODS[name][1][3]] * TP
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["gptq-g32", "gptq-g32-desc_act", "awq-g32", "fp8-per-channel",
                                  "fp8-on-load"])
def test_row_shards_on_the_gpu_sum_to_the_full_product(name, as_rank):
    # Llama-sized rows (4096 inputs, 2048 per rank) through the real load path on one GPU
    x = torch.randn(5, 4096, device="cuda", dtype=torch.float16)
    out, expected, layers = row_shards_product(
        as_rank, name, x, 1024, lambda layer: layer.linear_method.process_weights_after_loading(layer))
    fast = [getattr(layer, "uses_fp8", getattr(layer, "uses_kernel", None)) for layer in layers]
    assert fast == [name != "gptq-g32-desc_act"] * TP
    # fp8 also rounds the activations per token (3 mantissa bits)
    tolerance = 0.05 if name.startswith("fp8") else 1e-2
    assert (out - expected).norm() / expected.norm() < tolerance


# case -> (tiny model of conftest.CASES, write_quantized arguments; None: fp8 on load)
TP_CASES = {
    "gptq-g32": ("llama3-gqa", {"method": "gptq", "group_size": 32}),
    "gptq-g32-desc_act-one-kv-head": ("llama3-one-kv-head",
                                      {"method": "gptq", "group_size": 32, "desc_act": True}),
    "awq-g32": ("llama3-gqa", {"method": "awq", "group_size": 32}),
    "fp8-per-channel": ("llama3-gqa", {"method": "fp8", "per_channel": True}),
    "fp8-on-load": ("llama3-gqa", None),
    # a scale a [16, 32] block: each rank's rows and columns of the scales with its weight's
    "fp8-blocks": ("llama3-gqa", {"method": "fp8", "block": (16, 32)}),
    # compressed-tensors (written by its library): scales [N, G] and zero points packed along
    # N, cut by columns / by groups along their dim 1; act-order's groups all kept by both ranks
    "ct-w4a16-asym": ("llama3-gqa", {"ct": {"weights": W4A16_ASYM}}),
    "ct-w4a16-actorder": ("llama3-gqa", {"ct": {"weights": W4A16, "act_order": True}}),
    "ct-fp8-static": ("llama3-gqa", {"ct": {"weights": FP8_WEIGHTS,
                                            "input_activations": FP8_STATIC_ACTS}}),
    "ct-w8a8-int8-asym": ("llama3-gqa", {"ct": {"weights": {**INT8_WEIGHTS, "symmetric": False},
                                                "input_activations": INT8_DYNAMIC_ACTS}}),
    # NVFP4: packed bytes and e4m3 group scales cut like the int ones, a global scale a piece
    "ct-nvfp4": ("llama3-gqa", {"ct": dict(zip(("weights", "input_activations"),
                                               fp4_preset("NVFP4A16"), strict=True))}),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(TP_CASES))
def test_two_ranks_greedy_matches_one_rank_on_quantized_llama(case, tp_model_dir, tmp_path):
    base, args = TP_CASES[case]
    path, extra = Path(tp_model_dir(base)), {}
    if args is None:
        extra["quantization"] = "fp8"
    elif "ct" in args:
        write_compressed(path, tmp_path / "quantized", tmp_path / "dequantized", **args["ct"])
        path = tmp_path / "quantized"
    else:
        write_quantized(path, tmp_path / "quantized", tmp_path / "dequantized", **args)
        path = tmp_path / "quantized"
    prompts = _prompts()
    one = LLM(model=str(path), **ENGINE_ARGS, **extra)
    ref = _greedy(one, prompts)
    llm = LLM(model=str(path), tensor_parallel_size=TP, **ENGINE_ARGS, **extra)
    try:
        assert _greedy(llm, prompts) == ref
        # rank 0's row shards are the first input half of one rank's dequantized weights
        for whole, part in zip(one.engine.runner.model.model.layers,
                               llm.engine.runner.model.model.layers, strict=True):
            for w1, w2 in ((whole.self_attn.o_proj.weight, part.self_attn.o_proj.weight),
                           (whole.mlp.down_proj.weight, part.mlp.down_proj.weight)):
                assert torch.equal(w2, w1[:, : w1.shape[1] // TP])
    finally:
        llm.engine.shutdown()
    assert not _live_workers()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("base", "args"), [
    ("qwen3-moe", {"method": "gptq", "group_size": 8}),
    ("mixtral", {"method": "awq", "group_size": 16}),
    ("qwen3-moe", {"method": "gptq", "group_size": 8, "desc_act": True})],
    ids=["gptq-qwen3-moe", "awq-mixtral", "gptq-act-order-qwen3-moe"])
def test_two_ranks_greedy_matches_one_rank_on_int_experts(base, args, tp_model_dir, tmp_path):
    # GPTQ / AWQ experts kept packed: each rank its rows of gate and up, its inputs of down
    # with their groups (the intermediate size 48 / 128 split into whole groups of 8 / 16);
    # act-order ones too: gate / up's rows in down's sorted order before the split, so each
    # rank's inputs of down hold whole groups
    from kvfleet_runtime.layers.moe import SparseMoeBlock
    write_quantized(Path(tp_model_dir(base)), tmp_path / "q", tmp_path / "d", **args)
    prompts = _prompts()
    one = LLM(model=str(tmp_path / "q"), **ENGINE_ARGS)
    ref = _greedy(one, prompts)
    llm = LLM(model=str(tmp_path / "q"), tensor_parallel_size=TP, **ENGINE_ARGS)
    try:
        assert _greedy(llm, prompts) == ref
        whole, part = (next(m for m in e.engine.runner.model.modules()
                            if isinstance(m, SparseMoeBlock)).int_experts for e in (one, llm))
        if args.get("desc_act"):
            assert whole[0].perm is not None and torch.equal(part[0].perm, whole[0].perm)
        inter = part[1].shape[2]                  # rank 0's: the first half of the inputs
        per_word, groups = 32 // part[1].bits, inter // part[1].group_size
        for name in ("qweight", "scales", "zeros"):
            w13, p13 = getattr(whole[0], name), getattr(part[0], name)
            assert torch.equal(p13, torch.cat([w13[:, :inter], w13[:, 2 * inter:3 * inter]], 1))
            w2, p2 = getattr(whole[1], name), getattr(part[1], name)
            assert torch.equal(p2, w2[:, :, :inter // per_word if name == "qweight" else groups])
    finally:
        llm.engine.shutdown()
    assert not _live_workers()
