"""`kvfleet` command line: serve | generate | pull | bench | make-model | make-lora.

Each subcommand lives in its own module exposing `register(subparsers)`, which
adds its parser and sets `func(args) -> int` as the default; modules are imported
only here, so `kvfleet pull` does not pay for torch's import.
"""

from __future__ import annotations

import argparse
import importlib
import json
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


class _Parser(argparse.ArgumentParser):
    """argparse, reading vLLM's `--config FILE.yaml` of a subcommand that takes one (serve): the
    file's flags go in right after the subcommand (and its MODEL), so the command line's win."""
    commands: dict[str, argparse.ArgumentParser]

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        command = self.commands.get(args[0]) if args else None
        if command is not None and "--config" in command._option_string_actions:
            args = with_config_files(args, command)
        return super().parse_known_args(args, namespace)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command` given only its module is imported (`kvfleet pull` stays light)."""
    parser = _Parser(prog="kvfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=argparse.ArgumentParser)
    names = [command] if command in COMMAND_MODULES else list(COMMAND_MODULES)
    for name in names:
        importlib.import_module(COMMAND_MODULES[name]).register(sub)
    parser.commands = sub.choices
    return parser


def with_config_files(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv (COMMAND first) with each `--config FILE` replaced by the file's flags, put right
    after COMMAND and a MODEL that follows it: the command line's own flags come later and win."""
    head, rest, files = argv[:1], [], []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--config":
            files.append(next(args, None))
        elif arg.startswith("--config="):
            files.append(arg.partition("=")[2])
        else:
            rest.append(arg)
    if None in files:
        parser.error("argument --config: expected one argument")
    if rest and not rest[0].startswith("-"):
        head.append(rest.pop(0))
    return [*head, *(a for f in files for a in _config_file_args(f, parser)), *rest]


def _config_file_args(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a YAML file of vLLM's --config holds: `key: value` is --key=value (a mapping, or
    a list for a one-value flag, as JSON), a list --key v1 v2 ... for a flag of several, true
    --key for a switch (false its --no- form, or nothing)."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: cannot read it as YAML: {e}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        parser.error(f"--config {path}: must be a mapping of flag names to values")
    out = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None or flag == "--config":
            parser.error(f"--config {path}: {key!r} is not a flag of this command")
        if value is None:
            parser.error(f"--config {path}: {key!r} has no value")
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key!r} is a switch: true or false; got {value!r}")
            positive = flag if not flag.startswith("--no-") else "--" + flag[5:]
            out.append(positive if value == (flag == positive) else "--no-" + positive[2:])
        elif action.nargs == 0:
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key!r} is a switch: true or false; got {value!r}")
            out += [flag] if value else []
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            out += [flag, *map(_yaml_scalar, value)]
        else:
            out.append(f"{flag}={_yaml_scalar(value)}")
    return out


def _yaml_scalar(value) -> str:
    """A YAML value as a flag's text: JSON for a mapping or a list (--hf-overrides, ...),
    true/false for a boolean, else as written."""
    if isinstance(value, (dict, list, bool)):
        return json.dumps(value)
    return str(value)


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
