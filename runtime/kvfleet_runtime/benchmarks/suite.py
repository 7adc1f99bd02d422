"""The issue-3 benchmark rows on one engine, loaded once (a GPU session's minutes are few).

    python -m kvfleet_runtime.benchmarks.suite --model DIR [engine flags] \
        [--rows bs1,ttft,profile,tp128,tp128-max,tp1000,tp1000-max] [--num-prompts 1000] [--json PATH]

Rows, each what `kvfleet bench latency|throughput` prints for the same flags:
  bs1        latency, batch 1, 128 in / 256 out
  bs4, bs16  latency, 4 / 16 at once, 128 in / 256 out
  ttft       latency, batch 1, 2048 in / 2 out, 5 iterations (TTFT on an idle engine)
  profile    `--profile` of batch 1 x 2048 in and batch 256 x 128 in (32 decode steps profiled
             after the last prompt is in, with every request still running)
  tp128      throughput 128 in / 128 out, at most 256 running sequences
  tp128-max  the same with the engine's own --max-num-seqs (e.g. 1024, as vLLM on an H200)
  tp1000     throughput 1000 in / 1000 out, at most 256 running sequences
  tp1000-max the same with the engine's own --max-num-seqs (then the KV cache, not the
             admission limit, bounds how many run: the scheduler preempts when blocks run out)
  tp1000-half the same with half the prompts running at most (the engine's --max-num-seqs at
             most): two even waves where the KV cache holds only about half at full length
             (1000/1000 on one H200: ~886 a time, 1000 running leaves a ~114-sequence tail)
  profile-max  `--profile` of a decode batch of the engine's own --max-num-seqs x 128 in
  profile-1000 `--profile` of a decode batch at 1000/1000's contexts: as many 1000-token
             prompts as the KV cache holds at 2000 tokens each (at most --max-num-seqs)
Between rows the prefix cache is reset; the admission limit (the scheduler's max_num_seqs)
is lowered to 256 where a row says so, on the same engine.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvfleet_runtime.benchmarks.cli import (
    _kvfleet_throughput,
    _profile_latency,
    measure_latency,
    random_prompts,
)
from kvfleet_runtime.engine.gc_tuning import tune_gc
from kvfleet_runtime.server.cli import add_engine_args, engine_config_from_args

ROWS = ("bs1", "bs4", "bs16", "ttft", "profile", "profile-max", "profile-1000", "tp128", "tp128-max", "tp1000",
        "tp1000-max", "tp1000-half")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfleet_runtime.benchmarks.suite",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {', '.join(ROWS)}")
    p.add_argument("--num-prompts", type=int, default=1000, help="prompts of tp128 rows")
    p.add_argument("--num-prompts-1000", type=int, default=None,
                   help="prompts of the tp1000 row (default: --num-prompts)")
    p.add_argument("--label", default="", help="prefix of each row's name in the output")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each throughput row this many times on the same engine (the 2nd "
                        "and later rows are named ...-run2, ...: warm caches, for comparison)")
    p.add_argument("--trace-first-use", action="store_true",
                   help="log every Triton compile (and the row that met it) and each "
                        "throughput row's slowest engine steps (benchmarks/first_use.py)")
    p.add_argument("--json", metavar="PATH")
    add_engine_args(p)
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = sorted(set(rows) - set(ROWS))
    if bad:
        p.error(f"--rows: unknown {', '.join(bad)}; choose from {', '.join(ROWS)}")
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1; got {args.repeat}")

    import logging
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kvfleet_runtime").setLevel(logging.INFO)   # KV cache size, TP all-reduce, graphs
    from kvfleet_runtime.llm import LLM
    compiles = steps = None
    if args.trace_first_use:
        from kvfleet_runtime.benchmarks.first_use import CompileLog, StepLog
        compiles = CompileLog()
        if not compiles.install():
            print("[first-use] this Triton has no JIT hooks: compiles are not logged", flush=True)
            compiles = None
    llm = LLM.from_config(engine_config_from_args(args))
    engine = llm.engine
    if args.trace_first_use:
        steps = StepLog(engine)
    tune_gc()       # as kvfleet serve does after start-up
    own_max = engine.scheduler.max_num_seqs
    results = []

    def emit(name: str, row: dict) -> None:
        row = {"row": args.label + name, **row}
        results.append(row)
        shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                 if not k.startswith("profile_")}
        print(json.dumps(shown), flush=True)

    def latency(name: str, batch: int, input_len: int, output_len: int, iters: int) -> None:
        engine.scheduler.max_num_seqs = own_max
        if compiles is not None:
            compiles.row = name
        res, _ = measure_latency(engine, random_prompts(batch, input_len), output_len, 1, iters)
        emit(name, res)

    def throughput(name: str, num: int, length: int, max_seqs: int) -> None:
        for run in range(1, args.repeat + 1):
            throughput_once(name if run == 1 else f"{name}-run{run}", num, length, max_seqs)

    def throughput_once(name: str, num: int, length: int, max_seqs: int) -> None:
        engine.kv.block_pool.reset_prefix_cache()
        engine.scheduler.max_num_seqs = max_seqs
        totals = engine.step_totals
        before = {}

        def on_start():         # after the warm-up: the counters of the timed run alone
            before.update(totals)
            if compiles is not None:
                compiles.row = name
            if steps is not None:
                steps.take()

        elapsed = _kvfleet_throughput(llm, random_prompts(num, length, seed=len(results)), length,
                                      on_start)
        step_s = totals["step_s"] - before["step_s"]
        trace = {}
        if compiles is not None:
            trace.update(compiles.summary(name))
            compiles.row = "between rows"
        if steps is not None:
            trace.update(steps.summary(steps.take()))
        emit(name, {"num_prompts": num, "input_len": length, "output_len": length,
                    "max_num_seqs": max_seqs, "elapsed_s": elapsed,
                    "output_tokens_per_s": num * length / elapsed,
                    "total_tokens_per_s": 2 * num * length / elapsed,
                    "steps": totals["steps"] - before["steps"], "engine_step_s": step_s,
                    # time in generate() but in no engine step: adding requests, outputs
                    "outside_steps_s": elapsed - step_s,
                    "host_share": 1.0 - (totals["forward_s"] - before["forward_s"]) / max(step_s, 1e-9),
                    **trace})

    if "bs1" in rows:
        latency("bs1", 1, 128, 256, 3)
    if "bs4" in rows:       # a few at once (4-bit: the GEMVs, a program a row, up to
        latency("bs4", 4, 128, 256, 3)        # KVFLEET_W4A16_GEMV_MAX_M rows)
    if "bs16" in rows:      # 16 at once: the projections' tiled kernels (4-bit), not GEMVs
        latency("bs16", 16, 128, 256, 3)
    if "ttft" in rows:
        latency("ttft2048", 1, 2048, 2, 5)
    shapes = (((1, 2048), (min(256, own_max), 128)) if "profile" in rows else ())
    if "profile-max" in rows:
        shapes += ((own_max, 128),)
    if "profile-1000" in rows:
        fits = engine.kv.block_pool.num_blocks * engine.config.block_size // 2000
        shapes += ((max(1, min(own_max, fits)), 1000),)
    if shapes:
        for batch, input_len in shapes:
            engine.scheduler.max_num_seqs = own_max
            prompts = random_prompts(batch, input_len, seed=99)
            # 32 decode steps after the last prompt is in, every request still running: those
            # prefilled first decode one token per later prefill step
            prefill_steps = -(-batch * input_len // engine.config.max_num_batched_tokens)
            _, params = measure_latency(engine, prompts, 33 + prefill_steps, 0, 1)
            for prof in _profile_latency(engine, prompts, params):
                print(f"[profile batch {batch} x {input_len}] " + prof.render(), flush=True)
                results.append({"row": f"{args.label}profile-bs{batch}-{prof.label}",
                                "wall_ms": prof.wall_ms, "kernel_ms": prof.kernel_ms,
                                "batch": prof.batch, "top": prof.top})
    if "tp128" in rows:
        throughput("tp128", args.num_prompts, 128, min(256, own_max))
    if "tp128-max" in rows and own_max > 256:
        throughput(f"tp128-seqs{own_max}", args.num_prompts, 128, own_max)
    n1000 = args.num_prompts_1000 or args.num_prompts
    if "tp1000" in rows:
        throughput("tp1000", n1000, 1000, min(256, own_max))
    if "tp1000-max" in rows and own_max > 256:
        throughput(f"tp1000-seqs{own_max}", n1000, 1000, own_max)
    if "tp1000-half" in rows:
        half = min(-(-n1000 // 2), own_max)
        throughput(f"tp1000-seqs{half}", n1000, 1000, half)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    engine.shutdown()
    from kvfleet_runtime.distributed.parallel_state import finish_process
    return finish_process(0)


if __name__ == "__main__":
    sys.exit(main())
