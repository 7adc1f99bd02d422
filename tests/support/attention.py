"""An attention batch's metadata for the layer tests: sequences laid into random cache blocks."""

from __future__ import annotations

import torch
from kvfleet_runtime.layers.attention import AttentionMetadata


def paged_meta(q_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int,
               gen: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of a batch laid into random blocks, and the new tokens' slots."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, used = [], [], 0
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        n = -(-seq_len // block_size)
        table = order[used:used + n]
        used += n
        tables.append(table + [0] * (8 - n))
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return meta, meta.slot_mapping
