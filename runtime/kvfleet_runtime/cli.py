"""`kvfleet` command line: serve | generate | pull | bench | make-model | make-lora.

Each subcommand lives in its own module exposing `register(subparsers)`, which
adds its parser and sets `func(args) -> int` as the default; modules are imported
only here, so `kvfleet pull` does not pay for torch's import.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module, in help order
COMMAND_MODULES = {
    "serve": "kvfleet_runtime.server.cli",
    "generate": "kvfleet_runtime.generate",
    "pull": "kvfleet_runtime.pull",
    "bench": "kvfleet_runtime.benchmarks.cli",
    "make-model": "kvfleet_runtime.make_model",
    "make-lora": "kvfleet_runtime.lora.make",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command` given only its module is imported (`kvfleet pull` stays light)."""
    parser = argparse.ArgumentParser(prog="kvfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    names = [command] if command in COMMAND_MODULES else list(COMMAND_MODULES)
    for name in names:
        importlib.import_module(COMMAND_MODULES[name]).register(sub)
    return parser


def vllm_spelling(argv: list[str]) -> list[str]:
    """Flags spelled with underscores as vLLM's parser takes them (`--max_model_len 4096`,
    `--hf_overrides=...`) in this parser's spelling (`--max-model-len`); values unchanged."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            key, eq, value = arg.partition("=")
            arg = key.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = vllm_spelling(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        code = int(args.func(args) or 0)
    except ValueError as e:
        # bad input (a model path, an engine setting): one line, not a traceback
        if os.environ.get("KVFLEET_DEBUG"):
            raise
        print(f"kvfleet {args.command}: error: {e}", file=sys.stderr)
        code = 2
    if "torch" in sys.modules:      # a tensor-parallel engine may have left its group behind
        from kvfleet_runtime.distributed.parallel_state import finish_process
        code = finish_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
