"""`kvfleet` command line: serve | generate | pull | bench | make-model.

Each subcommand lives in its own module exposing `register(subparsers)`, which
adds its parser and sets `func(args) -> int` as the default; modules are imported
only here, so `kvfleet pull` does not pay for torch's import.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand modules, in help order
COMMAND_MODULES = [
    "kvfleet_runtime.server.cli",       # serve
    "kvfleet_runtime.generate",         # generate
    "kvfleet_runtime.pull",             # pull
    "kvfleet_runtime.benchmarks.cli",   # bench throughput | latency | serve
    "kvfleet_runtime.make_model",       # make-model
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        # bad input (a model path, an engine setting): one line, not a traceback
        if os.environ.get("KVFLEET_DEBUG"):
            raise
        print(f"kvfleet {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
