"""Each rank's shard, built without a process group: the ranks' parts put back together are
the checkpoint's tensors, and what cannot be sharded is refused with the field named."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime.distributed import parallel_state
from kvfleet_runtime.distributed.layers import VocabParallelEmbedding
from kvfleet_runtime.layers.linear import Linear


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(r, n): layers built next are rank r's shard of n (no collectives may run)."""
    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_state",
                            parallel_state.ParallelState(rank=rank, size=size))
    return set_rank


def _qkv(as_rank, rank: int, pieces: list[torch.Tensor], replicas: list[int]) -> Linear:
    as_rank(rank, 2)
    layer = Linear(8, [p.shape[0] for p in pieces], bias=True, dtype=torch.float32,
                   prefix="qkv_proj", parallel="column", output_replicas=replicas)
    for i, p in enumerate(pieces):
        layer.weight_loader(layer.weight, p, i)
        layer.weight_loader(layer.bias, p[:, 0], i)
    return layer


def test_column_pieces_split_per_rank_and_replicated_kv_is_whole_on_each(as_rank):
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    ranks = [_qkv(as_rank, r, [q, k, v], [1, 2, 2]) for r in range(2)]
    for r, layer in enumerate(ranks):
        assert layer.output_sizes == [4, 4, 4]
        assert torch.equal(layer.weight, torch.cat([q[4 * r:4 * r + 4], k, v]))
        assert torch.equal(layer.bias, torch.cat([q[4 * r:4 * r + 4, 0], k[:, 0], v[:, 0]]))


def test_row_parts_sum_to_the_full_product_and_bias_enters_once(as_rank):
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    partial = []
    for r in range(2):
        as_rank(r, 2)
        layer = Linear(8, 6, bias=True, dtype=torch.float32, prefix="o_proj", parallel="row")
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        assert layer.weight.shape == (6, 4)
        assert torch.equal(layer.bias, b)           # every rank holds it; rank 0 adds it
        bias = layer.bias if r == 0 else None
        partial.append(layer.linear_method.apply(layer, x[:, 4 * r:4 * r + 4], bias))
    torch.testing.assert_close(partial[0] + partial[1], x @ w.t() + b)


def test_checkpoint_tensor_of_the_wrong_size_is_refused_not_cut(as_rank):
    as_rank(1, 2)
    layer = Linear(8, 6, dtype=torch.float32, prefix="o_proj", parallel="row")
    with pytest.raises(ValueError, match=r"o_proj: .* has 10 rows along dim 1; expected 8"):
        layer.weight_loader(layer.weight, torch.randn(6, 10))


def test_sizes_that_do_not_split_name_the_layer_and_the_sizes(as_rank):
    as_rank(0, 2)
    with pytest.raises(ValueError, match=r"down_proj input size \(7\) must be a multiple of "
                                         r"tensor_parallel_size \(2\)"):
        Linear(7, 4, prefix="down_proj", parallel="row")


def test_vocab_rows_split_with_the_last_rank_padded(as_rank):
    table = torch.randn(7, 4)
    for r in range(2):
        as_rank(r, 2)
        emb = VocabParallelEmbedding(7, 4, torch.float32)
        emb.weight_loader(emb.weight, table)
        assert emb.weight.shape == (4, 4)
        expected = table[4 * r:4 * r + 4]
        assert torch.equal(emb.weight[: len(expected)], expected)
        assert not emb.weight[len(expected):].any()


def test_the_replicated_input_embedding_looks_up_locally_and_serves_its_slice_of_logits(
        as_rank, monkeypatch):
    # no process group here: a lookup that tried to all-reduce would fail
    table, ids = torch.randn(7, 4), torch.tensor([0, 6, 3, 4])
    for r in range(2):
        as_rank(r, 2)
        emb = VocabParallelEmbedding(7, 4, torch.float32, replicated=True)
        emb.weight_loader(emb.weight, table)
        assert emb.replicated and emb.weight.shape == (8, 4)       # padded to 2 x 4 rows
        assert torch.equal(emb(ids), table[ids])
        sharded = VocabParallelEmbedding(7, 4, torch.float32)
        sharded.weight_loader(sharded.weight, table)
        assert torch.equal(emb.local_rows(), sharded.weight)       # the lm_head's part
    monkeypatch.setenv("KVFLEET_TP_EMBEDDING", "sharded")
    assert not VocabParallelEmbedding(7, 4, torch.float32, replicated=True).replicated
    as_rank(0, 1)
    assert not VocabParallelEmbedding(7, 4, torch.float32, replicated=True).replicated
