"""The scheduler and KV-cache manager on a benchmark's requests, with no model: how many steps,
preemptions and recomputed prompt tokens a KV capacity and admission policy give, plus a rough
H200 cost model of the GPU time (prefill at ~42.5k tokens/s, decode reading the weights and
every running context's KV at 4 TB/s or computing 16 GFLOP per row at 800 TFLOP/s).

    python -m kvfleet_runtime.benchmarks.schedule_sim --num-gpu-blocks 55442 \
        --num-prompts 1000 --input-len 1000 --output-len 1000 --admission-headroom 0

55442 blocks of 16 tokens is what the engine sized on the H200 for Llama-3.1-8B in bf16
(110884 with --kv-cache-dtype fp8: pass --kv-bytes-per-token 65536). A tiny random model
(made in a temporary folder) only stands in for the tokenizer and config; it never runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile

PREFILL_S_PER_TOKEN = 23.5e-6       # 128/128 prefill steps on the H200: ~42.5k tokens/s
WEIGHTS_S = 3.7e-3                  # 16 GB of bf16 weights at ~4.3 TB/s
HBM_BYTES_PER_S = 4.0e12
DECODE_ROW_S = 20e-6                # 16 GFLOP per token at ~800 TFLOP/s


def simulate(model: str, num_blocks: int, num_prompts: int, input_len: int, output_len: int,
             headroom: int, kv_bytes_per_token: float, max_num_seqs: int = 1024,
             max_num_batched_tokens: int = 16384) -> dict:
    from kvfleet_runtime.engine.model_runner import ModelRunnerOutput
    from kvfleet_runtime.llm import LLM
    from kvfleet_runtime.sampling_params import SamplingParams
    llm = LLM(model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              max_model_len=input_len + output_len, num_gpu_blocks=num_blocks,
              async_scheduling=False, admission_headroom=headroom)
    engine = llm.engine
    totals = {"steps": 0, "prefill_tokens": 0, "gpu_s": 0.0}

    def execute(sched, block_ids):      # stands in for the model runner: one token per row
        out = ModelRunnerOutput()
        prefill = rows = context = 0
        for s in sched.scheduled:
            if s.num_new_tokens == 1:
                rows += 1
                context += s.request.num_computed_tokens + 1
            else:
                prefill += s.num_new_tokens
            if s.samples:
                out.sampled[s.request.request_id] = 5
        totals["steps"] += 1
        totals["prefill_tokens"] += prefill
        totals["gpu_s"] += prefill * PREFILL_S_PER_TOKEN + max(
            WEIGHTS_S + context * kv_bytes_per_token / HBM_BYTES_PER_S, rows * DECODE_ROW_S)
        return out

    engine.runner.execute = execute
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, 30000)
    prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    made = num_prompts * output_len
    return {"num_gpu_blocks": num_blocks, "admission_headroom": headroom,
            "steps": totals["steps"], "preemptions": engine.scheduler.num_preemptions,
            "recomputed_prompt_tokens": totals["prefill_tokens"] - num_prompts * input_len,
            "modelled_gpu_s": round(totals["gpu_s"], 1),
            "modelled_output_tokens_per_s": round(made / totals["gpu_s"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfleet_runtime.benchmarks.schedule_sim",
                                description=__doc__.split("\n")[0])
    p.add_argument("--num-gpu-blocks", type=int, required=True)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--admission-headroom", type=int, nargs="+", default=[0])
    p.add_argument("--kv-bytes-per-token", type=float, default=131072.0,
                   help="Llama-3.1-8B: 131072 in bf16, 65536 in fp8")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--model", help="a model folder (default: a tiny random one)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kvfleet_runtime.make_model import make_model
            make_model("tiny-llama", tmp, tokenizer="byte-level")
            model = tmp
        for h in args.admission_headroom:
            print(json.dumps(simulate(str(model), args.num_gpu_blocks, args.num_prompts,
                                      args.input_len, args.output_len, h,
                                      args.kv_bytes_per_token, args.max_num_seqs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
