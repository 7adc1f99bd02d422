"""`kvfleet generate PROMPT...`: offline generation from the command line (chat template by default)."""

from __future__ import annotations

import argparse
import sys

from kvfleet_runtime.server.cli import add_engine_args, engine_config_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text offline (no server)",
                              description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is instead of through the model's chat template")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvfleet_runtime.llm import LLM
    from kvfleet_runtime.sampling_params import SamplingParams
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
        llm = LLM.from_config(engine_config_from_args(args))
    except ValueError as e:
        print(f"kvfleet generate: error: {e}", file=sys.stderr)
        return 2
    tok = llm.get_tokenizer()
    if args.raw or not getattr(tok, "chat_template", None):
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                        use_tqdm=False)
    for out in outs:
        print(out.outputs[0].text.strip())
    return 0
