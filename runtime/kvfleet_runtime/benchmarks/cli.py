"""`kvfleet bench throughput | latency | serve`, with flags like vLLM's `bench` commands.

throughput: offline, fixed-length random prompts, ignore_eos; `--backend kvfleet,hf`
runs HF transformers' generate() on the same prompts in the same process for a
side-by-side ratio. latency: one batch at a time, TTFT and time per output token.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from kvfleet_runtime.engine.gc_tuning import tune_gc
from kvfleet_runtime.server.cli import add_engine_args, engine_config_from_args


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, latency, serve")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    tp = sub.add_parser("throughput", help="offline throughput on fixed-length random prompts")
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--num-prompts", type=int, default=1000)
    tp.add_argument("--backend", default="kvfleet",
                    help="comma-separated: kvfleet, hf (default: kvfleet)")
    tp.add_argument("--hf-max-batch-size", type=int, default=None,
                    help="HF generate() batch size (default: max_num_seqs)")
    tp.add_argument("--json", metavar="PATH", help="write the results as JSON")
    tp.add_argument("--plot", metavar="PNG", help="draw output/total tokens/s of each run")
    tp.add_argument("--structured-output-ratio", type=float, default=0.0, metavar="R",
                    help="the share of prompts (at least one when > 0) whose output follows a "
                         "JSON schema: an array of integers that never completes within "
                         "--output-len (structured outputs' cost at a fixed length)")
    _add_lora_arg(tp, "each prompt runs with one of --max-loras copies of it (ids 1..N, "
                      "picked at random), as vLLM's bench")
    add_engine_args(tp)
    tp.set_defaults(func=run_throughput)

    lat = sub.add_parser("latency", help="TTFT and time per output token of one batch")
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--json", metavar="PATH")
    lat.add_argument("--profile", action="store_true",
                     help="one more iteration under torch.profiler: kernel vs host time of the "
                          "prefill step and of the decode steps")
    _add_lora_arg(lat, "every prompt runs with it")
    add_engine_args(lat)
    lat.set_defaults(func=run_latency)

    from kvfleet_runtime.benchmarks.serve import add_serve_parser
    add_serve_parser(sub)


def _add_lora_arg(parser: argparse.ArgumentParser, how: str) -> None:
    parser.add_argument("--lora-path", metavar="DIR", default=None,
                        help=f"a LoRA adapter folder (PEFT format; turns on --enable-lora): {how}")


def _lora_config(args: argparse.Namespace):
    """The engine config, with LoRA on where --lora-path is given."""
    config = engine_config_from_args(args)
    if args.lora_path:
        config.enable_lora = True
    return config


def lora_requests(args: argparse.Namespace, config, num: int) -> list | None:
    """--lora-path: each of `num` prompts' adapter, one of max_loras ids (seeded choice)."""
    if not args.lora_path:
        return None
    from kvfleet_runtime.lora import LoRARequest
    ids = random.Random(0).choices(range(1, config.max_loras + 1), k=num)
    return [LoRARequest(f"bench-lora-{i}", i, args.lora_path) for i in ids]


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    # ids below 32000 exist in every vocabulary we serve
    rng = random.Random(seed)
    return [[rng.randrange(100, 32000) for _ in range(length)] for _ in range(num)]


# structured outputs in `bench throughput`: a grammar no output can complete within
# --output-len (minItems), so every output still has its fixed length
_BENCH_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000}


def _kvfleet_throughput(llm, prompts, output_len: int, on_start=None,
                        structured_ratio: float = 0.0, loras: list | None = None) -> float:
    """Seconds to generate output_len tokens for each prompt, after a short warm-up;
    on_start() runs between the two (where a caller snapshots the engine's counters).
    structured_ratio: the share of prompts (at least one when > 0) whose output follows
    _BENCH_SCHEMA. loras: each prompt's LoRARequest (None: the base model)."""
    from kvfleet_runtime.sampling_params import SamplingParams
    from kvfleet_runtime.structured_outputs import StructuredOutputsParams
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
    if structured_ratio > 0:
        grammar = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True,
                                 max_tokens=output_len,
                                 structured_outputs=StructuredOutputsParams(
                                     json=_BENCH_SCHEMA, disable_any_whitespace=True))
        num = min(len(prompts), max(1, round(structured_ratio * len(prompts))))
        # spread over the run: a grammar row in every wave of the batch
        every = len(prompts) / num
        marked = {int(i * every) for i in range(num)}
        params = [grammar if i in marked else params for i in range(len(prompts))]
        # the vocabulary read, the schema compiled
        llm.generate(prompts[:1], grammar.clone(), use_tqdm=False)
    warm = min(len(prompts), 4)
    llm.generate(prompts[:warm], SamplingParams(max_tokens=4, ignore_eos=True),
                 lora_request=loras[:warm] if loras else None, use_tqdm=False)
    # the timed run computes every prompt: none hits the blocks the warm-up left cached
    llm.engine.kv.block_pool.reset_prefix_cache()
    if on_start is not None:
        on_start()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    if made != len(prompts) * output_len:
        raise RuntimeError(f"expected {len(prompts) * output_len} output tokens, got {made}")
    return elapsed


def _hf_throughput(config, prompts, output_len: int, batch_size: int) -> tuple[float, str]:
    """(seconds, dtype): HF runs in the --dtype given, else in its own default dtype (what
    from_pretrained gives: fp32 for a GGUF), not in the one our engine picks for itself."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from kvfleet_runtime.config import DTYPES, torch_dtype
    dtype = torch_dtype(DTYPES[config.dtype])
    path = config.model
    kwargs = {} if dtype is None else {"dtype": dtype}
    if path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(config.torch_device)
    model.eval()
    dtype_name = str(model.dtype).removeprefix("torch.")

    def run(batch):
        ids = torch.tensor(batch, device=config.torch_device)
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                       top_p=1.0, top_k=0, max_new_tokens=output_len, min_new_tokens=output_len,
                       pad_token_id=0)
    with torch.inference_mode():
        run(prompts[:1])
        if config.torch_device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            run(prompts[i:i + batch_size])
        if config.torch_device.type == "cuda":
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    model = None    # free its memory before our engine sizes its KV cache
    if config.torch_device.type == "cuda":
        torch.cuda.empty_cache()
    return elapsed, dtype_name


def run_throughput(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    bad = sorted(set(backends) - {"kvfleet", "hf"})
    if bad or not backends:
        print(f"kvfleet bench throughput: error: --backend must list kvfleet and/or hf; got "
              f"{args.backend!r}", file=sys.stderr)
        return 2
    if not 0.0 <= args.structured_output_ratio <= 1.0 or (
            args.structured_output_ratio and backends != ["kvfleet"]):
        print("kvfleet bench throughput: error: --structured-output-ratio must be in [0, 1] "
              f"and for --backend kvfleet alone; got {args.structured_output_ratio}",
              file=sys.stderr)
        return 2
    if args.lora_path and backends != ["kvfleet"]:
        print("kvfleet bench throughput: error: --lora-path is for --backend kvfleet alone",
              file=sys.stderr)
        return 2
    config = _lora_config(args)
    prompts = random_prompts(args.num_prompts, args.input_len)
    results = []
    # HF first: our engine takes most of the GPU memory for its KV cache once it starts
    for backend in sorted(backends, key=lambda b: b != "hf"):
        extra = {}
        if backend == "kvfleet":
            from kvfleet_runtime.llm import LLM
            llm = LLM.from_config(config)
            tune_gc()       # as kvfleet serve does after start-up
            elapsed = _kvfleet_throughput(llm, prompts, args.output_len,
                                          structured_ratio=args.structured_output_ratio,
                                          loras=lora_requests(args, config, len(prompts)))
            totals = llm.engine.step_totals
            extra = {"dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
                     "steps": totals["steps"],
                     "host_share": 1.0 - totals["forward_s"] / max(totals["step_s"], 1e-9)}
        else:
            elapsed, dtype = _hf_throughput(config, prompts, args.output_len,
                                            args.hf_max_batch_size or config.max_num_seqs)
            extra = {"dtype": dtype}
        out_tokens = args.num_prompts * args.output_len
        results.append({
            "backend": backend, "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "max_num_seqs": config.max_num_seqs,
            "elapsed_s": elapsed, "requests_per_s": args.num_prompts / elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "structured_output_ratio": args.structured_output_ratio,
            "lora_path": args.lora_path, "max_loras": config.max_loras if args.lora_path else 0,
            "total_tokens_per_s": (out_tokens + args.num_prompts * args.input_len) / elapsed,
            **extra})
        r = results[-1]
        host = f", host share of step time {r['host_share']:.1%}" if "host_share" in r else ""
        if args.structured_output_ratio:
            host += f", structured outputs on {args.structured_output_ratio:.1%} of prompts"
        if args.lora_path:
            host += f", LoRA adapters ({config.max_loras} ids) on every prompt"
        print(f"[{backend}] {r['dtype']}, {args.num_prompts} prompts {args.input_len} in / "
              f"{args.output_len} out: "
              f"{r['elapsed_s']:.2f} s, {r['requests_per_s']:.2f} req/s, "
              f"{r['output_tokens_per_s']:.1f} output tok/s, "
              f"{r['total_tokens_per_s']:.1f} total tok/s{host}", flush=True)
    if len(results) == 2:
        ours, hf = sorted(results, key=lambda r: r["backend"] != "kvfleet")
        print(f"ratio kvfleet/hf: {ours['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x "
              f"(kvfleet in {ours['dtype']}, hf in {hf['dtype']})")
    _write(args, results)
    if args.plot:
        from kvfleet_runtime.benchmarks.plot import plot_throughput
        plot_throughput(results, args.plot)
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from kvfleet_runtime.engine.engine import LLMEngine
    config = _lora_config(args)
    engine = LLMEngine(config)
    tune_gc()       # as kvfleet serve does after start-up
    prompts = random_prompts(args.batch_size, args.input_len)
    loras = lora_requests(args, config, 1)
    res, params = measure_latency(engine, prompts, args.output_len, args.num_iters_warmup,
                                  args.num_iters, loras[0] if loras else None)
    print(f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out: "
          f"TTFT {res['ttft_ms']:.1f} ms, TPOT {res['tpot_ms']:.2f} ms "
          f"({res['decode_tokens_per_s_per_seq']:.1f} tok/s per sequence), "
          f"end to end {res['latency_s']:.3f} s")
    if loras:
        res["lora_path"] = args.lora_path
        print(f"every prompt with the LoRA adapter {args.lora_path}")
    if "spec_acceptance" in res:
        print(f"speculative decoding: {res['spec_acceptance']:.1%} of drafts kept, "
              f"{res['spec_tokens_per_step']:.2f} tokens a drafted step, "
              f"{res['steps_per_iter']:.0f} steps an iteration")
    if args.profile:
        for p in _profile_latency(engine, prompts, params, loras[0] if loras else None):
            print(p.render())
            res[f"profile_{p.label}"] = {"wall_ms": p.wall_ms, "kernel_ms": p.kernel_ms,
                                         "top": p.top}
    _write(args, [res])
    return 0


def measure_latency(engine, prompts, output_len: int, num_warmup: int, num_iters: int,
                    lora_request=None):
    """TTFT, time per output token and end-to-end time of `prompts` as one batch (each with
    lora_request's adapter, if given) -> (row, params)."""
    import torch

    from kvfleet_runtime.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    sync = torch.cuda.synchronize if engine.config.device.startswith("cuda") else (lambda: None)
    ttfts, tpots, totals = [], [], []
    spec, steps = {}, 0
    for it in range(num_warmup + num_iters):
        if it == num_warmup:
            spec, steps = dict(engine.spec_stats), engine.step_totals["steps"]
        for i, p in enumerate(prompts):
            engine.add_request(f"lat-{it}-{i}", p, params, lora_request=lora_request)
        # prefix caching would turn later iterations' prefill into a cache hit
        engine.kv.block_pool.reset_prefix_cache()
        sync()
        start = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and outs and all(o.outputs[0].token_ids for o in outs):
                sync()
                first = time.perf_counter() - start
        sync()
        total = time.perf_counter() - start
        if it >= num_warmup:
            ttfts.append(first)
            totals.append(total)
            tpots.append((total - first) / max(output_len - 1, 1))
    n = len(totals)
    res = {"batch_size": len(prompts), "input_len": len(prompts[0]), "output_len": output_len,
           "ttft_ms": 1e3 * sum(ttfts) / n, "tpot_ms": 1e3 * sum(tpots) / n,
           "latency_s": sum(totals) / n, "decode_tokens_per_s_per_seq": 1.0 / (sum(tpots) / n),
           "steps_per_iter": (engine.step_totals["steps"] - steps) / n}
    if engine.config.speculative is not None:   # what the drafts did in the measured iterations
        done = {k: v - spec[k] for k, v in engine.spec_stats.items()}
        res["spec_acceptance"] = done["spec_accepted_tokens"] / max(done["spec_draft_tokens"], 1)
        res["spec_tokens_per_step"] = 1 + done["spec_accepted_tokens"] / max(done["spec_drafts"], 1)
    return res, params


def _profile_latency(engine, prompts, params, lora_request=None):
    from kvfleet_runtime.benchmarks.profile import profile_steps
    for i, p in enumerate(prompts):
        engine.add_request(f"profile-{i}", p, params, lora_request=lora_request)
    engine.kv.block_pool.reset_prefix_cache()
    device = engine.config.torch_device
    sched = engine.scheduler

    def prompts_done() -> bool:     # every prompt computed (chunked over several steps or not)
        return not sched.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                         for r in sched.running)
    prefill = profile_steps(engine.step, 1 << 30, "prefill", device, until=prompts_done)
    first = len(sched.running)
    decode = profile_steps(engine.step, max(min(params.max_tokens - 1, 32), 1), "decode", device)
    # requests prefilled early decode during the later prefill steps and may finish inside
    # these: the batch the decode steps saw, first and last
    decode.batch = (first, len(sched.running))
    while engine.has_unfinished_requests():
        engine.step()
    return prefill, decode


def _write(args, results) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
