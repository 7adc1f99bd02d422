"""CUDA graphs for decode-only steps, one per (padded batch size, context bucket), captured at start.

A decode step of a few hundred tiny kernels is launch-bound; replaying a graph
removes the launch gaps. Batches are padded up to the next captured size
(padded rows write nowhere: slot -1, and read one token of the null block).
The split-KV decode kernel sizes its grid from the longest context, so graphs
are also keyed by a context-length bucket, passed to the kernel as max_seq_len.
An eager decode step of a size some graph serves (every step under --enforce-eager) plans its
split-KV partitions for that graph's batch and bucket (`decode_plan`): a context is cut into
the same partitions either way, so greedy tokens are the same with and without graphs.
Larger batches, prefill and mixed steps run eagerly. Capturing every graph at start
(a few seconds) keeps capture out of the first requests' latency and out of benchmarks;
under tensor parallelism every rank captures the same graphs in the same order, so the
all-reduces inside them line up.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from kvfleet_runtime.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from kvfleet_runtime.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

# up to 1024: with --max-num-seqs 1024 (vLLM's offline default on an H200) an eager decode step
# of ~1000 sequences left the host launching kernels nearly all the time (host share 98%)
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
               640, 768, 896, 1024)
CONTEXT_BUCKETS = (1024, 4096, 16384)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes decode graphs are captured for."""
    max_bs = min(max_num_seqs, BATCH_SIZES[-1])
    return sorted({b for b in BATCH_SIZES if b < max_bs} | {max_bs})


def context_buckets(max_model_len: int) -> list[int]:
    """The context-length buckets decode graphs are captured for (the kernels' max_seq_len)."""
    return sorted({b for b in CONTEXT_BUCKETS if b < max_model_len} | {max_model_len})


def decode_plan(num_seqs: int, max_seq_len: int, batch_sizes: list[int],
                buckets: list[int]) -> tuple[int, int] | None:
    """(padded batch size, context bucket) of the graph a decode step of num_seqs sequences,
    the longest max_seq_len tokens, replays; None when no graph is that large."""
    if num_seqs > batch_sizes[-1] or max_seq_len > buckets[-1]:
        return None
    return (next(b for b in batch_sizes if b >= num_seqs),
            next(b for b in buckets if b >= max_seq_len))


class CUDAGraphRunner:
    def __init__(self, runner: ModelRunner) -> None:
        self.model = runner.model
        self.device = runner.device
        self.batch_sizes = runner.decode_batch_sizes
        self.buckets = runner.decode_buckets
        max_bs = self.batch_sizes[-1]
        dev = self.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(max_bs, runner.max_blocks_per_seq, dtype=torch.int32,
                                        device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def capture_all(self) -> None:
        """Capture every (batch size, bucket) graph; the static inputs are all padding now."""
        start = time.perf_counter()
        # largest first: later, smaller graphs reuse the memory pool the first one grew
        for bs in reversed(self.batch_sizes):
            for bucket in self.buckets:
                self.graphs[(bs, bucket)] = self._capture(bs, bucket)
        log.info("captured %d decode CUDA graphs in %.1f s", len(self.graphs),
                 time.perf_counter() - start)

    def can_run(self, meta: AttentionMetadata, num_seqs: int) -> bool:
        return meta.max_query_len == 1 and num_seqs <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs, bucket = decode_plan(n, meta.max_seq_len, self.batch_sizes, self.buckets)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if n < bs:      # rows left over from a larger previous batch become padding again
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs].zero_()
        graph, hidden = self.graphs[(bs, bucket)]
        graph.replay()
        return hidden[:n]

    def _meta(self, bs: int, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            max_query_len=1, max_seq_len=bucket, plan_num_seqs=bs)

    def _capture(self, bs: int, bucket: int):
        meta = self._meta(bs, bucket)
        # an eager run first: Triton compiles on first launch, which capture cannot record
        self.model(self.input_ids[:bs], self.positions[:bs], meta)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta)
        self.pool = graph.pool()
        log.debug("captured decode graph: batch %d, context <= %d", bs, bucket)
        return graph, hidden
