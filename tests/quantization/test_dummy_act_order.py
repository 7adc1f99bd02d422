"""--load-format dummy on a GPTQ desc_act config: each layer's g_idx is shuffled as an act-order
checkpoint's is (so a benchmark of random weights times the act-order path), groups kept equal."""

from __future__ import annotations

import torch
from kvfleet_runtime.layers.linear import Linear
from kvfleet_runtime.layers.quantization import GPTQConfig
from kvfleet_runtime.loader import _init_dummy
from torch import nn


def _layers(desc_act: bool) -> nn.Module:
    config = GPTQConfig(bits=4, group_size=32, desc_act=desc_act)
    model = nn.Module()
    model.qkv = Linear(128, [64, 32, 32], bias=False, dtype=torch.float16,
                       linear_method=config.get_linear_method("qkv"), prefix="qkv")
    model.down = Linear(256, [128], bias=False, dtype=torch.float16,
                        linear_method=config.get_linear_method("down"), prefix="down")
    return model


def test_act_order_g_idx_is_shuffled_into_equal_groups():
    model = _layers(desc_act=True)
    plain = {name: layer.g_idx.clone() for name, layer in model.named_children()}
    _init_dummy(model, act_order=True)
    for name, layer in model.named_children():
        g = layer.g_idx
        assert not torch.equal(g, plain[name]), name
        assert torch.equal(torch.sort(g).values, plain[name]), name        # same group sizes
        assert torch.equal(torch.bincount(g.long()), torch.full((g.numel() // 32,), 32))


def test_plain_grouping_stays_without_act_order():
    model = _layers(desc_act=False)
    plain = {name: layer.g_idx.clone() for name, layer in model.named_children()}
    _init_dummy(model)
    for name, layer in model.named_children():
        assert torch.equal(layer.g_idx, plain[name]), name
