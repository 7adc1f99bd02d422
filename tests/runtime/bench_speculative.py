"""Batch-1 greedy decode with and without n-gram speculative decoding on chat tasks of a real
model (default: SmolLM2-135M-Instruct): an edit that copies most of its input, a verbatim
repeat, and an open question (where prompt lookup finds little). Prints tokens/s, the drafts'
acceptance and whether the output is the same as without drafts.

    python tests/runtime/bench_speculative.py [--model DIR_OR_GGUF] [--k 2 4 8] [--max-tokens 256]

--step-cost (for a random-weight checkpoint, whose outputs prompt lookup cannot predict): the
time of one engine step at each --batches size, async and synchronous without drafts, then with
K random drafts a request (all but never kept): what a step of drafts costs, and so the tokens a
step that drafts must keep to pay off.

    python tests/runtime/bench_speculative.py --step-cost --model /tmp/llama-3.1-8b --batches 1 16
"""

from __future__ import annotations

import argparse
import json
import time

CODE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / windw)
    return out
'''
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed "
             "the wick, polished the great lens until it gleamed, and lit the lamp that warned "
             "ships away from the rocks. In forty years he had never missed a night, not during "
             "the storm of the century nor the winter the bay froze solid.")
TASKS = {
    "edit": f"Fix the typo in this Python function. Reply with the whole corrected function "
            f"only.\n\n```python\n{CODE}```",
    "repeat": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "open": "Write a short story about a robot who learns to paint.",
}


def step_cost(args: argparse.Namespace) -> list[dict]:
    import random

    import torch
    from kvfleet_runtime import SamplingParams
    from kvfleet_runtime.config import EngineConfig
    from kvfleet_runtime.engine.engine import LLMEngine
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = LLMEngine(EngineConfig(
        model=args.model, max_model_len=args.max_model_len, max_num_seqs=max(args.batches),
        speculative_config={"method": "ngram", "num_speculative_tokens": max(args.k)}))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    rows = []
    for bs in args.batches:
        base = None
        for mode in ["async", "sync", *(f"k{k}" for k in args.k)]:
            k = int(mode[1:]) if mode.startswith("k") else 0

            def propose(dry_run: bool = False, mode=mode, k=k) -> bool:
                for r in engine.scheduler.running:
                    r.spec_token_ids = [rng.randrange(vocab) for _ in range(k)] \
                        if r.num_computed_tokens >= len(r.all_token_ids) - 1 else []
                return mode != "async"
            engine._propose = propose
            ids = [f"{bs}-{mode}-{i}" for i in range(bs)]
            for rid in ids:
                engine.add_request(rid, [rng.randrange(vocab) for _ in range(128)], SamplingParams(
                    temperature=0.0, max_tokens=engine.config.max_model_len - 128, ignore_eos=True))
            for _ in range(10):
                engine.step()
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            sync()
            ms = 1e3 * (time.perf_counter() - start) / args.steps
            engine.abort_request(ids)
            base = base or ms
            row = {"batch": bs, "mode": mode, "step_ms": ms,
                   "break_even_tokens_per_step": ms / base}
            rows.append(row)
            print(f"batch {bs} {mode:5s}: {ms:.2f} ms a step; a drafted step must give "
                  f"{ms / base:.2f} tokens a request to match async steps", flush=True)
    engine.shutdown()
    return rows


def main() -> None:
    from kvfleet_runtime import LLM, SamplingParams
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-cost", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--model", default="")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8],
                        help="num_speculative_tokens values to run")
    parser.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"),
                        help="prompt_lookup_min, prompt_lookup_max")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.step_cost:
        rows = step_cost(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows, reference = [], {}
    for k in [0, *args.k]:
        spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k,
                                    "prompt_lookup_min": args.lookup[0],
                                    "prompt_lookup_max": args.lookup[1]}
        llm = LLM(model=args.model, max_num_seqs=1, speculative_config=spec,
                  async_scheduling=False)
        engine = llm.engine
        for name, prompt in TASKS.items():
            messages = [{"role": "user", "content": prompt}]
            llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8))   # warm-up
            best, out = None, None
            for _ in range(args.repeats):
                stats, steps = dict(engine.spec_stats), engine.step_totals["steps"]
                start = time.perf_counter()
                out = llm.chat(messages, params)[0].outputs[0]
                elapsed = time.perf_counter() - start
                if best is None or elapsed < best[0]:
                    best = (elapsed, engine.step_totals["steps"] - steps,
                            {key: v - stats[key] for key, v in engine.spec_stats.items()})
            elapsed, steps, done = best
            if k == 0:
                reference[name] = out.token_ids
            row = {"task": name, "k": k, "tokens": len(out.token_ids), "steps": steps,
                   "tokens_per_s": len(out.token_ids) / elapsed,
                   "acceptance": done["spec_accepted_tokens"] / max(done["spec_draft_tokens"], 1),
                   "same_output": out.token_ids == reference[name]}
            rows.append(row)
            print(f"{name:6s} k={k}: {row['tokens']} tokens in {steps} steps, "
                  f"{row['tokens_per_s']:.1f} tok/s, {row['acceptance']:.0%} of drafts kept, "
                  f"same output as k=0: {row['same_output']}", flush=True)
        engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
