"""Host (CPU) time per engine step at a large batch, and where it goes.

    python -m kvfleet_runtime.benchmarks.host_overhead            # sync and async, 1024 x 128/128
    python -m kvfleet_runtime.benchmarks.host_overhead --mode async --outputs stream

On a GPU the forward of a 1024-row decode step is a 15-28 ms graph replay and the Python
around it (schedule, input building, detokenizing, stop checks, outputs) must fit in its
shadow. This runs a tiny random llama on the CPU, where the model costs little, and reports
per step: host ms = step wall time minus the model's forward and the sampler (the work a
GPU would do), plus a breakdown by phase. Phases are timed by wrapping the engine's per-step
methods with perf_counter (no profiler: its per-call overhead would distort the Python it
measures). Nested phases (detokenize inside update or finish_launched) are listed indented; they are part of
their parent, not added to it.

`--outputs final` (the default) runs the offline path (`LLM.generate`: a request's output once,
when it finishes); `--outputs stream` runs what the engine process of `kvfleet serve` does
every step (engine_process.py): a DeltaEngine gives every running request's delta, and the
step's message (deltas and stats) is pickled; the pickling counts as host time ("post").
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import pickle
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict

# (owner, attribute, label, parent label or None); owner resolved on the built engine
_DEVICE_PHASES = ("forward", "sample")


def _wrap(obj, name: str, label: str, totals: dict[str, float]) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t0
    setattr(obj, name, timed)


class _TimedSampler:
    """Stands in for the runner's Sampler: times its calls (the device's share of a step)."""

    def __init__(self, sampler, totals: dict[str, float]) -> None:
        self._sampler, self._totals = sampler, totals

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._sampler(*args, **kwargs)
        finally:
            self._totals["sample"] += time.perf_counter() - t0

    def sample_on_device(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._sampler.sample_on_device(*args, **kwargs)
        finally:
            self._totals["sample"] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def _wrap_forward(runner, totals: dict[str, float]) -> None:
    """Times the forward, and frees the previous step's logits inside that time: on a CPU
    freeing a [1024, V] fp32 tensor returns it to the OS (~10 ms), where CUDA's caching
    allocator costs nothing, so that belongs to the device's share, not the host's."""
    forward = runner._forward
    held: list = []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        held.clear()
        try:
            out = forward(*args, **kwargs)
            held.append(out)
            return out
        finally:
            totals["forward"] += time.perf_counter() - t0
    runner._forward = timed


def _instrument(engine, fine: bool) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    runner = engine.runner
    _wrap_forward(runner, totals)
    runner.sampler = _TimedSampler(runner.sampler, totals)
    if not fine:
        return totals
    _wrap(engine.scheduler, "schedule", "schedule", totals)
    _wrap(engine, "_block_ids", "block_ids", totals)
    _wrap(runner, "_prepare", "prepare", totals)
    _wrap(runner, "_sampling_inputs", "sampling_inputs", totals)
    _wrap(runner, "finish", "runner.finish", totals)
    _wrap(engine, "_update", "update", totals)
    _wrap(engine, "_finish_launched", "finish_launched", totals)
    _wrap(engine, "_outputs", "outputs", totals)
    from kvfleet_runtime.detokenizer import IncrementalDetokenizer
    original = IncrementalDetokenizer.update_one    # what the engine calls a token

    def update_one(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            totals["  detokenize"] += time.perf_counter() - t0
    IncrementalDetokenizer.update_one = update_one
    totals["_restore"] = 0.0
    engine._restore_detok = lambda: setattr(IncrementalDetokenizer, "update_one", original)
    return totals


def run_once(model: str, num_prompts: int, input_len: int, output_len: int, max_num_seqs: int,
             max_num_batched_tokens: int, async_scheduling: bool, fine: bool,
             tuned_gc: bool = False, stream: bool = False) -> dict:
    saved = gc.get_threshold()
    try:
        return _run_once(model, num_prompts, input_len, output_len, max_num_seqs,
                         max_num_batched_tokens, async_scheduling, fine, tuned_gc, stream)
    finally:
        gc.set_threshold(*saved)


def _stream(engine, prompts: list[list[int]], params, totals: dict[str, float]) -> list[bytes]:
    """The engine process's loop (engine_process._child_main) without the pipe: every request
    queued, then each step's deltas and stats pickled as its message to the server."""
    from multiprocessing.reduction import ForkingPickler
    for i, prompt in enumerate(prompts):
        engine.add_request(f"stream-{i}", prompt, params)
    messages = []
    while engine.has_unfinished_requests():
        deltas = engine.step()
        t0 = time.perf_counter()
        messages.append(ForkingPickler.dumps(("step", deltas, engine.get_stats())))
        totals["post"] += time.perf_counter() - t0
    return messages


def _merged(engine, messages: list[bytes], num_prompts: int, params) -> list:
    """_stream's outputs, merged (and, without stop strings, detokenized) as the server's
    process does (its work, not the engine's: not timed), in the prompts' order."""
    from kvfleet_runtime.engine.engine_process import OutputMerger
    merger, final = OutputMerger(engine.tokenizer), {}
    ids = [f"stream-{i}" for i in range(num_prompts)]
    for rid in ids:
        merger.expect(rid, params)
    for message in messages:
        for out in merger.merge([pickle.loads(message)[1]]):
            if out.finished:
                final[out.request_id] = out
    return [final[rid] for rid in ids]


def _run_once(model: str, num_prompts: int, input_len: int, output_len: int, max_num_seqs: int,
              max_num_batched_tokens: int, async_scheduling: bool, fine: bool,
              tuned_gc: bool, stream: bool) -> dict:
    from kvfleet_runtime.config import EngineConfig
    from kvfleet_runtime.engine.delta_engine import DeltaEngine
    from kvfleet_runtime.engine.gc_tuning import tune_gc
    from kvfleet_runtime.llm import LLM
    from kvfleet_runtime.sampling_params import SamplingParams
    config = dict(device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens,
                  max_model_len=input_len + output_len, async_scheduling=async_scheduling,
                  enable_prefix_caching=True)
    if stream:
        llm, engine = None, DeltaEngine(EngineConfig(model=model, **config))
    else:
        llm = LLM(model=model, **config)
        engine = llm.engine
    if tuned_gc:      # what `kvfleet serve` and the benchmarks do after start-up
        tune_gc()
    totals = _instrument(engine, fine)
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    try:
        outs = _stream(engine, prompts, params, totals) if stream else llm.generate(prompts, params, use_tqdm=False)
    finally:
        if fine:
            engine._restore_detok()
    wall = time.perf_counter() - t0
    if stream:
        outs = _merged(engine, outs, len(prompts), params)
    st = engine.step_totals
    steps = int(st["steps"])
    device_s = totals["forward"] + totals["sample"]
    result = {
        "mode": (("async" if async_scheduling else "sync") + ("+stream" if stream else "")
                 + ("+tuned-gc" if tuned_gc else "")),
        "steps": steps,
        "wall_s": round(wall, 2),
        "host_ms_per_step": round(1e3 * (st["step_s"] + totals["post"] - device_s) / steps, 3),
        # the engine's own figure: on a CPU async's forward_s is only the (zero) wait, so
        # it counts the forward as host time there; sync excludes forward + sampling
        "engine_host_ms_per_step": round(1e3 * (st["step_s"] - st["forward_s"]) / steps, 3),
        "device_ms_per_step": round(1e3 * device_s / steps, 3),
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        # a fingerprint of the outputs: equal before and after an optimisation
        "output_hash": hashlib.sha256(json.dumps(
            [[o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason]
             for o in outs]).encode()).hexdigest()[:16],
    }
    if fine:
        result["phases_ms_per_step"] = {k: round(1e3 * v / steps, 3) for k, v in totals.items()
                                        if k not in ("_restore",) + _DEVICE_PHASES}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfleet_runtime.benchmarks.host_overhead",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a model folder (default: a tiny random llama, made here)")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--mode", choices=("sync", "async", "both"), default="both")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is reported")
    p.add_argument("--no-breakdown", action="store_true",
                   help="skip the extra run per mode that times each phase")
    p.add_argument("--tune-gc", choices=("no", "yes", "both"), default="no",
                   help="run with the garbage-collector thresholds of engine.gc_tuning (as "
                        "kvfleet serve and the benchmarks set them), without, or both")
    p.add_argument("--outputs", choices=("final", "stream", "both"), default="final",
                   help="final: the offline path (an output once, at the end); stream: the "
                        "engine process's (every request's delta every step, pickled)")
    args = p.parse_args(argv)
    modes = [(a, g, o) for a in {"sync": [False], "async": [True], "both": [False, True]}[args.mode]
             for g in {"no": [False], "yes": [True], "both": [False, True]}[args.tune_gc]
             for o in {"final": [False], "stream": [True], "both": [False, True]}[args.outputs]]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kvfleet_runtime.make_model import make_model
            make_model("tiny-llama", tmp, dtype="float32")
            model = tmp
        common = (model, args.num_prompts, args.input_len, args.output_len, args.max_num_seqs,
                  args.max_num_batched_tokens)
        for async_scheduling, tuned_gc, stream in modes:
            runs = [run_once(*common, async_scheduling, fine=False, tuned_gc=tuned_gc,
                             stream=stream) for _ in range(args.repeats)]
            for r in runs:
                print(json.dumps(r), flush=True)
            summary = {"mode": runs[0]["mode"], "summary": f"median of {len(runs)}",
                       "host_ms_per_step": statistics.median(r["host_ms_per_step"] for r in runs),
                       "device_ms_per_step": statistics.median(r["device_ms_per_step"] for r in runs)}
            print(json.dumps(summary), flush=True)
            if not args.no_breakdown:
                fine = run_once(*common, async_scheduling, fine=True, tuned_gc=tuned_gc,
                                stream=stream)
                print(json.dumps({"mode": fine["mode"], "breakdown": fine["phases_ms_per_step"],
                                  "host_ms_per_step (timed run)": fine["host_ms_per_step"]}),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
