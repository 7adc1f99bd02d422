"""Random paged-attention batches for the kernel tests and the benchmark.

Each batch lays its contexts into a KV cache through block tables that list blocks in a random
(non-contiguous) order, with padding entries and spare blocks, as the engine's block pool does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Attention against paged_attention_ref: fp32 differs by summation order only; fp16/bf16 also
# round the probabilities to the cache dtype before the P @ V product (as every flash kernel does).
ATTENTION_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# what the interpreter runs (its bf16 is broken); bf16 is checked on the GPU
CPU_DTYPES = [torch.float32, torch.float16]


@dataclass
class PagedBatch:
    query: torch.Tensor             # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor           # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    scale: float
    max_query_len: int
    max_seq_len: int

    def args(self) -> tuple:
        """Positional arguments of paged_attention / paged_attention_ref."""
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale, self.max_query_len)


def make_paged_batch(q_lens: list[int], seq_lens: list[int], *, num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype, device: str | torch.device,
                     seed: int, spare_blocks: int = 3) -> PagedBatch:
    """Sequence i has seq_lens[i] tokens of context, of which the last q_lens[i] are new queries."""
    assert len(q_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 1          # one padding column, as the engine pads
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[used:used + n]
        used += n

    # the values drawn where they are used: on a GPU the CPU took ~8 s for a 600-sequence cache
    data_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=data_gen, device=device).to(dtype=dtype)

    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        query=randn(sum(q_lens), num_heads, head_dim),
        k_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        v_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        scale=head_dim ** -0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
