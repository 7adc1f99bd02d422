"""Run by test_two_gpus_greedy_matches_one_gpu_with_cuda_graphs in a fresh process: greedy
tokens of one GPU, then of two ranks with CUDA graphs, and what the TP engine used, as one JSON
line. A process of its own per case, because NCCL's teardown of a group whose collectives were
captured in CUDA graphs can hang (pytorch#115388): the engine then leaves the group behind,
and this process (not the test session) ends through finish_process.

    python tp_gpu_child.py MODEL_DIR
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch
from kvfleet_runtime import LLM
from kvfleet_runtime.distributed.parallel_state import finish_process, get_state, teardown_abandoned
from test_tensor_parallel import _greedy, _prompts


def _count_fused_gemvs() -> dict[str, int]:
    """Count (on rank 0, this process) the batch-1 GEMVs that push their output to the peer
    and those that compute the MLP's SiLU (kvfleet_kernels.gemv's push= and gated=)."""
    from kvfleet_kernels import gemv as gemv_module
    counts = {"gemv_pushes": 0, "gated_gemvs": 0}
    real = gemv_module.gemv

    def counting(*args, gated=False, push=None, **kwargs):
        counts["gemv_pushes"] += push is not None
        counts["gated_gemvs"] += gated
        return real(*args, gated=gated, push=push, **kwargs)
    gemv_module.gemv = counting
    return counts


def main(path: str) -> int:
    counts = _count_fused_gemvs()
    # fp32: bf16 sums in a different order across ranks may flip a near-tie argmax; no fixed
    # pool: each rank profiles its memory and the pool is the minimum
    args = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=48,
                gpu_memory_utilization=0.3)
    prompts = _prompts()
    single = LLM(model=path, **args)
    ref = _greedy(single, prompts)
    counts.update(gemv_pushes=0, gated_gemvs=0)       # what the TP engine's rank 0 runs
    # the one-GPU engine's KV cache and graphs go before rank 0 sizes its own on the same GPU
    del single
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(model=path, tensor_parallel_size=2, **args)
    try:
        result = {"ref": ref, "tp": _greedy(llm, prompts),
                  "graphs": bool(getattr(llm.engine.runner.graph_runner, "graphs", None)),
                  "one_shot": get_state().one_shot is not None,
                  "fused_norm": get_state().fused_norm is not None,
                  "kv_device": str(llm.engine.runner.kv_cache.device), **counts}
    finally:
        start = time.monotonic()
        llm.engine.shutdown()
        shutdown_s = time.monotonic() - start
    result.update(shutdown_s=shutdown_s, teardown_abandoned=teardown_abandoned())
    print(json.dumps(result), flush=True)
    return finish_process(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
