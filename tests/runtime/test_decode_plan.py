"""Eager decode steps plan split-KV attention as the CUDA graph of their size would run them.

The decode kernel's result depends on how it cuts each context into partitions, and that cut
follows the batch size and max_seq_len it is given; a graph replays with its padded batch and
context bucket. Planning eager steps alike keeps greedy tokens the same with and without graphs
(checked end to end on the GPU by test_gpu_engine; the kernel half by the paged-attention tests).
"""

from __future__ import annotations

from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.engine.cuda_graphs import context_buckets, decode_plan, graph_batch_sizes


def test_decode_plan_pads_to_the_graph_sizes():
    sizes, buckets = graph_batch_sizes(64), context_buckets(8192)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 64 and buckets == [1024, 4096, 8192]
    assert decode_plan(1, 1, sizes, buckets) == (1, 1024)
    assert decode_plan(3, 1025, sizes, buckets) == (4, 4096)
    assert decode_plan(40, 8192, sizes, buckets) == (48, 8192)
    assert decode_plan(65, 10, sizes, buckets) is None         # eager, as no graph is that large
    assert graph_batch_sizes(5000)[-1] == 1024 and context_buckets(600) == [600]


def test_eager_decode_steps_carry_the_graph_plan(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama3"), max_num_seqs=16, num_gpu_blocks=64, max_model_len=512)
    runner = llm.engine.runner
    seen = []
    real = runner._forward
    runner._forward = lambda step, **kw: seen.append(step.meta) or real(step, **kw)
    llm.generate([[5, 6, 7], [8, 9, 10, 11, 12]], SamplingParams(temperature=0, max_tokens=3))
    decode = [(m.plan_num_seqs, m.max_seq_len) for m in seen if m.max_query_len == 1]
    prefill = [(m.plan_num_seqs, m.max_seq_len) for m in seen if m.max_query_len > 1]
    assert decode and all(d == (2, 512) for d in decode)     # 2 sequences, the one bucket
    assert prefill == [(None, 5)]
